//! 2-D parallelism: tensor parallel inside each FSDP rank on a dp_shard x tp mesh. The TP
//! shards of the MLP are sharded again by FSDP over dp_shard; each dp group trains on its part
//! of the global batch. Trained with SGD against the same MLP on one device.

use burn::tensor::Tensor;
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{DeviceMesh, MeshShape, RankContext, ReduceOp, launch};
use burn_parallel::fsdp::{FsdpConfig, fully_shard, gather_full};
use burn_parallel_tp::{TpModule, apply_plan};

use crate::common::{assert_close, ndarray_ad, sgd, tensor, vec_of};
use crate::tp_common::{columns, rows};
use crate::tp_mlp::{MODEL, Mlp, mlp_plan};

const BATCH: usize = 6;
// Uneven over tp = 2, 3 and 4 (the MPI tests run this on meshes of those widths).
const HIDDEN: usize = 7;
const STEPS: usize = 3;
const LR: f32 = 0.1;

fn loss(model: &Mlp, step: usize, rows: std::ops::Range<usize>) -> Tensor<1> {
    let d = ndarray_ad();
    let x = tensor(300 + step as u64, [BATCH, MODEL], &d).narrow(0, rows.start, rows.len());
    let y = tensor(400 + step as u64, [BATCH, MODEL], &d).narrow(0, rows.start, rows.len());
    (model.forward(x) - y).powi_scalar(2).sum() / (BATCH * MODEL) as f32
}

/// (losses, up weight, down weight) after training.
fn single_device() -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let mut model = Mlp::new(HIDDEN);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, 0..BATCH);
        losses.push(vec_of(&l)[0]);
        model = sgd(model, &l.backward(), LR);
    }
    (
        losses,
        vec_of(&model.up.inner().weight.val()),
        vec_of(&model.down.inner().weight.val()),
    )
}

/// One rank's training: losses, its tp coordinate, and its gathered up / down weights (the TP
/// shards, whole over dp_shard).
pub type Trained = (Vec<f32>, usize, Vec<f32>, Vec<f32>);

/// Trains this rank on a `dp` x `tp` mesh of `ctx`'s world (shared with the MPI tests).
pub fn train_on_mesh(
    ctx: &RankContext,
    dp: usize,
    tp: usize,
) -> Result<Trained, Box<dyn std::error::Error>> {
    let mesh = DeviceMesh::new(ctx, MeshShape::new(&[("dp_shard", dp), ("tp", tp)])?)?;
    let (model, report) = apply_plan(Mlp::new(HIDDEN), &mlp_plan(), mesh.group("tp")?)?;
    assert!(report.is_complete(), "{report:?}");
    let config = FsdpConfig::new(mesh.group("dp_shard")?.clone());
    let mut model = fully_shard(model, &config)?;
    // TP ranks of one dp group see the same rows.
    let rows = chunk_range(BATCH, dp, mesh.coord("dp_shard")?);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, rows.clone());
        let global = mesh
            .group("dp_shard")?
            .all_reduce(l.to_data(), ReduceOp::Sum)?;
        losses.push(global.try_to_vec::<f32>()?[0]);
        let mut grads = l.backward();
        model.sync_tp_grads(&mut grads)?;
        model = sgd(model, &grads, LR);
    }
    let full = gather_full(model)?;
    Ok((
        losses,
        mesh.coord("tp")?,
        vec_of(&full.up.inner().weight.val()),
        vec_of(&full.down.inner().weight.val()),
    ))
}

/// Checks one rank's training on a mesh with `tp` columns against the single device.
pub fn check_against_single_device(rank: usize, tp: usize, trained: &Trained) {
    let (want_losses, want_up, want_down) = single_device();
    let (losses, tp_rank, up, down) = trained;
    let cols = chunk_range(HIDDEN, tp, *tp_rank);
    let ctx = format!("rank {rank} (tp rank {tp_rank} of {tp})");
    assert_close(losses, &want_losses, 1e-5, &format!("{ctx}: losses"));
    let up_want = columns(&want_up, HIDDEN, cols.clone());
    assert_close(up, &up_want, 1e-5, &format!("{ctx}: up (colwise) shard"));
    let down_want = rows(&want_down, MODEL, cols);
    assert_close(
        down,
        &down_want,
        1e-5,
        &format!("{ctx}: down (rowwise) shard"),
    );
}

#[test]
fn tp_inside_fsdp_on_a_2x2_mesh_matches_single_device() {
    let (dp, tp) = (2, 2);
    let out = launch(dp * tp, |ctx| train_on_mesh(&ctx, dp, tp)).unwrap();
    for (rank, trained) in out.iter().enumerate() {
        check_against_single_device(rank, tp, trained);
    }
}
