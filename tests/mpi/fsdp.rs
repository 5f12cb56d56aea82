//! FSDP2 under the MPI engine: a small MLP fully sharded over every rank (hidden size 3, so 4
//! ranks hold uneven and empty shards), trained with SGD on the global batch split over ranks,
//! against the same training on one device, and against the threads engine (same bits).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor};
use burn_parallel::dist::chunk::chunk_range;
use burn_parallel::dist::{RankContext, ReduceOp};
use burn_parallel::fsdp::{FsdpConfig, fully_shard, gather_full};

use crate::common::{assert_close, ndarray_ad, sgd, tensor, to_vec, vec_of};

const IN: usize = 5;
const HIDDEN: usize = 3;
const OUT: usize = 2;
const BATCH: usize = 12;
const STEPS: usize = 3;
const LR: f32 = 0.1;

#[derive(Module, Debug)]
struct Mlp {
    a: Linear,
    b: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        let linear = |i, o, seed| {
            let mut l: Linear = LinearConfig::new(i, o).init(device);
            l.weight = l
                .weight
                .map(|_| tensor(seed, [i, o], device).require_grad());
            l.bias = l
                .bias
                .map(|b| b.map(|_| tensor(seed + 1, [o], device).require_grad()));
            l
        };
        Self {
            a: linear(IN, HIDDEN, 1),
            b: linear(HIDDEN, OUT, 3),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.a.forward(x).tanh())
    }

    fn flat(&self) -> Vec<f32> {
        [
            vec_of(&self.a.weight.val()),
            vec_of(&self.a.bias.as_ref().unwrap().val()),
            vec_of(&self.b.weight.val()),
            vec_of(&self.b.bias.as_ref().unwrap().val()),
        ]
        .concat()
    }
}

/// Squared error of `rows` of step `step`'s global batch over the global element count, so
/// that the sum over ranks is the global mean.
fn loss(model: &Mlp, step: usize, rows: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
    let x = tensor(100 + step as u64, [BATCH, IN], device).narrow(0, rows.start, rows.len());
    let y = tensor(200 + step as u64, [BATCH, OUT], device).narrow(0, rows.start, rows.len());
    (model.forward(x) - y).powi_scalar(2).sum() / (BATCH * OUT) as f32
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
    (losses, model.flat())
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
    Ok((losses, gather_full(model).flat()))
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
