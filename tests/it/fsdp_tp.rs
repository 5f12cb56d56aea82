//! 2-D parallelism: tensor parallel inside each FSDP rank on a dp_shard x tp mesh. The TP
//! shards of the MLP are sharded again by FSDP over dp_shard; each dp group trains on its part
//! of the global batch. Trained with SGD against the same MLP on one device.

use burn::tensor::Tensor;
use burn_parallel::dist::chunk::chunk_range;
use burn_parallel::dist::{DeviceMesh, MeshShape, ReduceOp, launch};
use burn_parallel::fsdp::{FsdpConfig, fully_shard, gather_full};
use burn_parallel_tp::{TpModule, apply_plan};

use crate::common::{assert_close, ndarray_ad, sgd, tensor, vec_of};
use crate::tp_common::{columns, rows};
use crate::tp_mlp::{MODEL, Mlp, mlp_plan};

const BATCH: usize = 6;
const HIDDEN: usize = 6;
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

#[test]
fn tp_inside_fsdp_on_a_2x2_mesh_matches_single_device() {
    let (want_losses, want_up, want_down) = single_device();
    let (dp, tp) = (2, 2);
    let out = launch(dp * tp, |ctx| {
        let mesh = DeviceMesh::new(&ctx, MeshShape::new(&[("dp_shard", dp), ("tp", tp)])?)?;
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
        let full = gather_full(model);
        Ok::<_, Box<dyn std::error::Error>>((
            losses,
            mesh.coord("tp")?,
            vec_of(&full.up.inner().weight.val()),
            vec_of(&full.down.inner().weight.val()),
        ))
    })
    .unwrap();
    for (rank, (losses, tp_rank, up, down)) in out.iter().enumerate() {
        let cols = chunk_range(HIDDEN, tp, *tp_rank);
        let ctx = format!("rank {rank} (tp rank {tp_rank})");
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
}
