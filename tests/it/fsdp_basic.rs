//! FSDP's first slice: per-parameter sharding of stock Burn modules, trained with SGD on 1-4
//! ranks (dims the world size does not divide, empty shards at 4 ranks), against
//! single-device training on the same global batches.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::dist::chunk::chunk_range;
use burn_parallel::dist::{ReduceOp, launch};
use burn_parallel::fsdp::{FsdpConfig, fully_shard, gather_full};

use crate::common::{assert_close, ndarray_ad, values, vec_of};

const IN: usize = 5;
const HIDDEN: usize = 3; // 3 rows of layer 2 over 4 ranks: 1, 1, 1, 0
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
    /// Deterministic weights from seeds, built on the calling rank.
    fn new(device: &Device) -> Self {
        let linear = |i, o, seed| {
            let mut l: Linear = LinearConfig::new(i, o).init(device);
            l.weight = l
                .weight
                .map(|_| tensor2(seed, [i, o], device).require_grad());
            l.bias = l
                .bias
                .map(|b| b.map(|_| tensor1(seed + 1, o, device).require_grad()));
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
}

fn tensor2(seed: u64, shape: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(
        TensorData::new(values(seed, shape[0] * shape[1]), shape),
        device,
    )
}

fn tensor1(seed: u64, n: usize, device: &Device) -> Tensor<1> {
    Tensor::from_data(TensorData::new(values(seed, n), [n]), device)
}

/// Mean squared error of `rows` of the global batch of `step`, divided by the global batch so
/// that summing over ranks gives the global mean.
fn loss(model: &Mlp, step: usize, rows: std::ops::Range<usize>, device: &Device) -> Tensor<1> {
    let x = tensor2(100 + step as u64, [BATCH, IN], device).narrow(0, rows.start, rows.len());
    let y = tensor2(200 + step as u64, [BATCH, OUT], device).narrow(0, rows.start, rows.len());
    (model.forward(x) - y).powi_scalar(2).sum() / (BATCH * OUT) as f32
}

/// Plain SGD on every parameter: `p -= lr * g`.
fn sgd(model: Mlp, grads: &burn::tensor::Gradients) -> Mlp {
    struct Step<'a> {
        grads: &'a burn::tensor::Gradients,
    }
    impl burn::module::ModuleMapper for Step<'_> {
        fn map_float<const D: usize>(
            &mut self,
            p: burn::module::Param<Tensor<D>>,
        ) -> burn::module::Param<Tensor<D>> {
            let grad = p.base().grad(self.grads);
            p.map(|t| match grad {
                Some(g) => Tensor::from_inner(t.inner() - g * LR).require_grad(),
                None => t,
            })
        }
    }
    model.map(&mut Step { grads })
}

fn flat(model: &Mlp) -> Vec<f32> {
    [
        vec_of(&model.a.weight.val()),
        vec_of(&model.a.bias.as_ref().unwrap().val()),
        vec_of(&model.b.weight.val()),
        vec_of(&model.b.bias.as_ref().unwrap().val()),
    ]
    .concat()
}

fn single_device() -> (Vec<f32>, Vec<f32>) {
    let device = ndarray_ad();
    let mut model = Mlp::new(&device);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let l = loss(&model, step, 0..BATCH, &device);
        losses.push(vec_of(&l)[0]);
        let grads = l.backward();
        model = sgd(model, &grads);
    }
    (losses, flat(&model))
}

fn sharded(world: usize) -> Vec<(Vec<f32>, Vec<f32>, Vec<usize>)> {
    launch(world, |ctx| {
        let device = ndarray_ad();
        let group = ctx.world()?;
        let mut model = fully_shard(Mlp::new(&device), &FsdpConfig::new(group.clone()));
        let shard_rows = model.b.weight.base().dims()[0];
        let rows = chunk_range(BATCH, world, group.index());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let l = loss(&model, step, rows.clone(), &device);
            let global = group.all_reduce(l.to_data(), ReduceOp::Sum)?;
            losses.push(global.try_into_vec::<f32>().unwrap()[0]);
            let grads = l.backward();
            model = sgd(model, &grads);
        }
        let full = gather_full(model);
        Ok::<_, burn_parallel::dist::CollectiveError>((losses, flat(&full), vec![shard_rows]))
    })
    .unwrap()
}

#[test]
fn fully_sharded_sgd_matches_single_device_on_1_to_4_ranks() {
    let (want_losses, want_weights) = single_device();
    for world in 1..=4 {
        for (rank, (losses, weights, shard_rows)) in sharded(world).iter().enumerate() {
            let ctx = format!("{world} ranks, rank {rank}");
            assert_close(losses, &want_losses, 1e-5, &format!("{ctx}: losses"));
            assert_close(
                weights,
                &want_weights,
                1e-5,
                &format!("{ctx}: final weights"),
            );
            assert_eq!(
                shard_rows[0],
                chunk_range(HIDDEN, world, rank).len(),
                "{ctx}: shard"
            );
        }
    }
}
