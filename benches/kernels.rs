//! The fused Llama blocks (`models::fused`) against the same blocks op by op
//! (`models::fused::reference`), forward + backward, on flex (the default CPU backend), at the
//! per-rank shapes of the 95M config (`examples/models/llama_95m.json`) under fsdp2 x2: 2 rows
//! of 128 tokens, hidden 1024, intermediate 2752, 16 heads of 64.
//!
//! Run: cargo bench --bench kernels
//!
//! Prints the median of 7 timed runs (after one warm-up) of each block and the ratio fused /
//! op by op (below 1: the fused block is faster). One thread, freed pages kept in the process
//! (the trainer's `Malloc::Kept`).

use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor, TensorData};
use burn_parallel::models::fused::{self, reference};
use burn_parallel::train::Malloc;

const ROWS: usize = 2;
const SEQ: usize = 128;
const HIDDEN: usize = 1024;
const INTERMEDIATE: usize = 2752;
const HEADS: usize = 16;
const HEAD_DIM: usize = 64;
const RUNS: usize = 7;

fn input<const D: usize>(shape: [usize; D], seed: u64, device: &Device) -> Tensor<D> {
    let n: usize = shape.iter().product();
    let mut state = seed;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// The median time of forward + backward of `block` on fresh leaves of `inputs`.
fn time<const D: usize, const N: usize>(
    inputs: &[Tensor<D>; N],
    block: impl Fn([Tensor<D>; N]) -> Tensor<D>,
) -> Duration {
    let mut times: Vec<Duration> = (0..=RUNS)
        .map(|_| {
            let leaves = inputs.clone().map(|t| t.require_grad());
            let started = Instant::now();
            let grads = block(leaves.clone()).sum().backward();
            for leaf in &leaves {
                let _ = leaf.grad(&grads).expect("a gradient");
            }
            started.elapsed()
        })
        .skip(1)
        .collect();
    times.sort();
    times[RUNS / 2]
}

fn report(name: &str, shape: &str, op_by_op: Duration, fused: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name:<11}{shape:<22}{:>12.2}{:>10.2}{:>8.2}",
        ms(op_by_op),
        ms(fused),
        ms(fused) / ms(op_by_op)
    );
}

fn main() {
    // The trainer's allocator setting: freed pages stay in the process.
    Malloc::Kept.apply();
    let device = Device::flex().autodiff();
    println!(
        "{:<11}{:<22}{:>12}{:>10}{:>8}",
        "block", "shape", "op-by-op ms", "fused ms", "ratio"
    );

    let x = input([ROWS, SEQ, HIDDEN], 1, &device);
    let weight = input([HIDDEN], 2, &device);
    let norm = [x.clone(), weight.clone().unsqueeze::<3>()];
    let as_weight = |w: Tensor<3>| w.reshape([HIDDEN]);
    report(
        "rms_norm",
        "2x128x1024",
        time(&norm, |[x, w]| reference::rms_norm(x, as_weight(w), 1e-5)),
        time(&norm, |[x, w]| fused::rms_norm(x, as_weight(w), 1e-5)),
    );

    let gate_up = [
        input([ROWS, SEQ, INTERMEDIATE], 3, &device),
        input([ROWS, SEQ, INTERMEDIATE], 4, &device),
    ];
    report(
        "swiglu",
        "2x128x2752",
        time(&gate_up, |[g, u]| reference::swiglu(g, u)),
        time(&gate_up, |[g, u]| fused::swiglu(g, u)),
    );

    // q as the model has it: [rows, seq, heads, dim] with heads and seq swapped (strided).
    let q = [input([ROWS, SEQ, HEADS, HEAD_DIM], 5, &device).swap_dims(1, 2)];
    let cos = input([1, 1, SEQ, HEAD_DIM], 6, &device);
    let sin = input([1, 1, SEQ, HEAD_DIM], 7, &device);
    report(
        "rotary",
        "2x16x128x64",
        time(&q, |[q]| reference::rotary(q, &cos, &sin)),
        time(&q, |[q]| fused::rotary(q, &cos, &sin)),
    );

    let qkv = [8, 9, 10].map(|seed| input([ROWS, HEADS, SEQ, HEAD_DIM], seed, &device));
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    report(
        "attention",
        "2x16x128x64",
        time(&qkv, |[q, k, v]| {
            reference::causal_attention(q, k, v, scale)
        }),
        time(&qkv, |[q, k, v]| fused::causal_attention(q, k, v, scale)),
    );
}
