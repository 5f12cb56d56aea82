//! A tour of the foundation: four rank threads train a linear model whose weight is sharded
//! FSDP-style (all-gather before use, reduce-scatter of the gradient), next to the same model
//! on one device. Prints both loss curves and the communication each rank did.
//!
//! Run: cargo run --release --example collectives

use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::comm::chunk::chunk_range;
use burn_parallel::comm::collectives::all_gather;
use burn_parallel::comm::{CollectiveError, OpKind, ReduceOp, launch};

const WORLD: usize = 4;
const IN: usize = 10; // 10 rows over 4 ranks: shards of 3, 3, 3, 1
const OUT: usize = 3;
const BATCH: usize = 8; // per rank
const STEPS: usize = 30;
const LR: f32 = 0.05;

fn data(seed: u64, shape: [usize; 2], device: &Device) -> Tensor<2> {
    let n = shape[0] * shape[1];
    let values: Vec<f32> = (0..n)
        .map(|i| (((i as u64 + 1) * (seed * 2 + 7919)) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Rank `r`'s batch at `step`: inputs and the targets of a fixed "true" model.
fn batch(step: usize, rank: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    // A small data set of 4 global batches, visited in turn.
    let x = data(((step % 4) * WORLD + rank) as u64 + 1, [BATCH, IN], device);
    let truth = data(999, [IN, OUT], device);
    let y = x.clone().matmul(truth);
    (x, y)
}

fn mse(pred: Tensor<2>, target: Tensor<2>) -> Tensor<1> {
    (pred - target).powi_scalar(2).mean()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[allow(deprecated)]
    let device = Device::ndarray().autodiff();
    let init = data(5, [IN, OUT], &device);

    // One device, the global batch of every step.
    let mut w = init.clone();
    let mut single = Vec::new();
    for step in 0..STEPS {
        let wg = w.clone().require_grad();
        let mut loss: Option<Tensor<1>> = None;
        for rank in 0..WORLD {
            let (x, y) = batch(step, rank, &device);
            let l = mse(x.matmul(wg.clone()), y) / WORLD as f32;
            loss = Some(loss.map_or(l.clone(), |acc| acc + l));
        }
        let loss = loss.unwrap();
        single.push(loss.clone().into_scalar::<f32>());
        let grad = wg.grad(&loss.backward()).unwrap();
        w = Tensor::from_inner(w.inner() - grad * LR);
    }

    // Four ranks, each holding a shard of the weight and a quarter of the batch.
    let ranks = launch(WORLD, |ctx| {
        let world = ctx.world()?;
        let rows = chunk_range(IN, WORLD, world.index());
        let mut shard = init.clone().narrow(0, rows.start, rows.len());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            let s = shard.clone().require_grad();
            let full = all_gather(s.clone(), &world, 0)?;
            let (x, y) = batch(step, world.index(), &device);
            // Each rank's gradient is summed by the reduce-scatter: scale for the mean.
            let loss = mse(x.matmul(full), y) / WORLD as f32;
            let global = world.all_reduce(loss.to_data(), ReduceOp::Sum)?;
            losses.push(global.try_to_vec::<f32>().unwrap()[0]);
            let grad = s.grad(&loss.backward()).unwrap();
            shard = Tensor::from_inner(shard.inner() - grad * LR);
        }
        Ok::<_, CollectiveError>((losses, world.stats()))
    })?;

    println!("step  single-device loss  {WORLD}-rank sharded loss");
    for (step, (one, sharded)) in single.iter().zip(&ranks[0].0).enumerate() {
        if step % 5 == 0 || step + 1 == STEPS {
            println!("{step:>4}  {one:>18.6}  {sharded:>20.6}");
        }
    }
    let worst = (0..STEPS)
        .map(|s| ((single[s] - ranks[0].0[s]) / single[s]).abs())
        .fold(0f32, f32::max);
    println!("largest relative difference: {worst:.2e}");
    for (rank, (_, stats)) in ranks.iter().enumerate() {
        let ag = stats.op(OpKind::AllGather);
        let rs = stats.op(OpKind::ReduceScatter);
        println!(
            "rank {rank}: {} all_gather ({} B sent, {} B received), {} reduce_scatter ({} B sent, {} B received)",
            ag.calls, ag.bytes_sent, ag.bytes_received, rs.calls, rs.bytes_sent, rs.bytes_received
        );
    }
    Ok(())
}
