//! FSDP2 under the MPI engine: a small MLP fully sharded over every rank (hidden size 3, so 4
//! ranks hold uneven and empty shards), trained with SGD on the global batch split over ranks,
//! against the same training on one device, and against the threads engine (same bits).

use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::{RankContext, ReduceOp};
use burn_parallel::fsdp::{FsdpConfig, MixedPrecisionPolicy, fully_shard, gather_full};

use crate::common::{assert_close, ndarray_ad, sgd, to_vec, vec_of};
use crate::fsdp_basic::{BATCH, LR, Mlp, STEPS, flat};

fn loss(
    model: &Mlp,
    step: usize,
    rows: std::ops::Range<usize>,
    device: &burn::tensor::Device,
) -> burn::tensor::Tensor<1> {
    crate::fsdp_basic::loss(model, step, rows, device, &MixedPrecisionPolicy::default())
}

/// Losses and final weights.
pub type Run = (Vec<f32>, Vec<f32>);

pub fn single_device() -> Run {
    let device = ndarray_ad();
    let mut model = Mlp::new(&device);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, 0..BATCH, &device);
        losses.push(vec_of(&l)[0]);
        let grads = l.backward();
        model = sgd(model, &grads, LR);
    }
    (losses, flat(&model))
}

/// One rank's FSDP training, on whatever engine `ctx` comes from.
pub fn sharded(ctx: &RankContext) -> Result<Run, Box<dyn std::error::Error>> {
    let device = ndarray_ad();
    let world = ctx.world()?;
    let config = FsdpConfig::new(world.clone());
    let mut model = fully_shard(Mlp::new(&device), &config)?;
    let rows = chunk_range(BATCH, ctx.world_size(), ctx.rank());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, rows.clone(), &device);
        let global = world.all_reduce(l.to_data(), ReduceOp::Sum)?;
        losses.push(to_vec(&global)[0]);
        let grads = l.backward();
        model = sgd(model, &grads, LR);
    }
    Ok((losses, flat(&gather_full(model)?)))
}

/// Checks this rank's run against one device (round-off) and the threads engine (same bits).
pub fn check(rank: usize, got: &Run, threads: &Run) -> Result<(), String> {
    let want = single_device();
    let what = format!("FSDP rank {rank}");
    std::panic::catch_unwind(|| {
        assert_close(&got.0, &want.0, 1e-5, &format!("{what}: losses"));
        assert_close(&got.1, &want.1, 1e-5, &format!("{what}: final weights"));
    })
    .map_err(|_| format!("{what}: differs from one device"))?;
    if got != threads {
        return Err(format!(
            "{what}: differs from the threads engine: {got:?} vs {threads:?}"
        ));
    }
    Ok(())
}
