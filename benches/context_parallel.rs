//! Long sequences: the attention kernel before and after the memory-efficient one, and the Llama
//! under context parallelism, against sequence length, on flex (one thread per rank).
//!
//! Run: cargo bench --bench context_parallel [-- --quick]
//!
//! 1. Attention alone, forward + backward, `[1, 4 heads, seq, 64]`: the eager fused kernel the
//!    Llama used before (`fused::causal_attention`, which keeps the f32 probabilities
//!    `[heads, seq, seq]` for backward) against `attention::flash_attention` (online softmax,
//!    keeps one log-sum-exp per row and recomputes in backward).
//! 2. A Llama (hidden 256, 2 layers, 4 heads of 64, 2 kv heads) training step (forward, loss,
//!    backward, AdamW) on one row of `seq` tokens: one device, and fsdp2 with cp 2 and cp 4
//!    (each rank holds `seq / cp` tokens of the row).
//!
//! Memory is counted by this binary's allocator: "peak" is the largest growth of the heap
//! during the measured pass over what it held before (activations, gradients, gathered
//! weights, workspace), divided by the ranks that ran in the process. Times are medians of
//! `REPEATS` runs after one warm-up; tokens/s per rank is the rank's tokens over the step.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_parallel::comm::launch;
use burn_parallel::models::attention::{AttentionMask, flash_attention};
use burn_parallel::models::context_parallel::split_rows;
use burn_parallel::models::{Llama, LlamaConfig, fused};
use burn_parallel::parallelizer::{
    DistributedConfig, MeshContext, MixedPrecisionConfig, OptimizerStep, Step, Strategy,
    parallelize_model,
};
use burn_parallel::tp::loss_parallel;

/// The system allocator, counting the bytes it holds and their high-water mark.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(by: usize) {
    let now = HELD.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters are atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        HELD.fetch_sub(layout.size(), Ordering::Relaxed);
        grew(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Starts a measurement: the peak is set to what is held now, which is returned.
fn start_peak() -> usize {
    let held = HELD.load(Ordering::Relaxed);
    PEAK.store(held, Ordering::Relaxed);
    held
}

const REPEATS: usize = 3;
const HEADS: usize = 4;
const HEAD_DIM: usize = 64;

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_add(1);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// (median time, peak bytes) of forward + backward of `kernel` on `[1, HEADS, seq, HEAD_DIM]`.
fn attention(
    seq: usize,
    kernel: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<4>,
) -> (Duration, usize) {
    let device = Device::flex().autodiff();
    let shape = [1, HEADS, seq, HEAD_DIM];
    let n = HEADS * seq * HEAD_DIM;
    let input = |seed| Tensor::<4>::from_data(TensorData::new(values(n, seed), shape), &device);
    let (q, k, v) = (input(1), input(2), input(3));
    let mut times = Vec::new();
    let mut peak = 0;
    for _ in 0..=REPEATS {
        let leaves = [q.clone(), k.clone(), v.clone()].map(|t| t.require_grad());
        let base = start_peak();
        let started = Instant::now();
        let [q, k, v] = leaves.clone();
        let grads = kernel(q, k, v).sum().backward();
        for leaf in &leaves {
            let _ = leaf.grad(&grads).expect("a gradient");
        }
        times.push(started.elapsed());
        peak = peak.max(PEAK.load(Ordering::Relaxed) - base);
    }
    times.remove(0);
    (median(times), peak)
}

fn model_config(seq: usize) -> LlamaConfig {
    LlamaConfig {
        vocab_size: 512,
        hidden_size: 256,
        intermediate_size: 688,
        num_hidden_layers: 2,
        num_attention_heads: HEADS,
        num_key_value_heads: 2,
        head_dim: HEAD_DIM,
        max_position_embeddings: seq,
        ..LlamaConfig::tiny()
    }
}

/// (median step time, peak bytes per rank) of a Llama training step on one row of `seq`
/// tokens split over `cp` ranks (1: one device).
fn llama_step(seq: usize, cp: usize) -> (Duration, usize) {
    let config = model_config(seq);
    let distributed = DistributedConfig {
        strategy: if cp == 1 {
            Strategy::Single
        } else {
            Strategy::Fsdp2
        },
        cp_size: cp,
        mp_policy: MixedPrecisionConfig::full_precision(),
        ..DistributedConfig::default()
    };
    let ids: Vec<i64> = (0..seq + 1)
        .map(|t| ((t * 37 + t * t) % 512) as i64)
        .collect();
    let out = launch(cp, |rank| {
        let device = Device::flex().autodiff();
        let ctx = MeshContext::new(&rank, distributed.clone(), device.clone())?;
        let mut model = parallelize_model(Llama::seeded(&config, 1, &device), &ctx)?;
        let mut optim = AdamWConfig::new().init();
        let rows = ctx.local_rows(1);
        let (cp_size, cp_rank) = ctx.cp_group().map_or((1, 0), |g| (g.size(), g.index()));
        let inputs = split_rows(&ids[..seq], 1, cp_size, cp_rank)?;
        let targets = split_rows(&ids[1..], 1, cp_size, cp_rank)?;
        let local = seq / cp_size;
        let world = ctx.world_group().clone();
        let (mut times, mut peak) = (Vec::new(), 0);
        for _ in 0..=REPEATS {
            world.barrier()?;
            let base = if rank.rank() == 0 { start_peak() } else { 0 };
            world.barrier()?;
            let started = Instant::now();
            let ids =
                Tensor::<2, Int>::from_data(TensorData::new(inputs.clone(), [1, local]), &device);
            let logits = match ctx.cp_group() {
                Some(group) => model.try_forward_context_parallel(ids, group, None)?.0,
                None => model.try_forward_routed(ids)?.0,
            };
            let logits = logits.reshape([local, config.vocab_size]);
            let targets =
                Tensor::<1, Int>::from_data(TensorData::new(targets.clone(), [local]), &device);
            let loss = loss_parallel(logits, targets, ctx.tp_group(), config.vocab_size)?;
            model = Step::new(&ctx, &rows)
                .run(model, loss, OptimizerStep::new(&mut optim, 1e-4))?
                .0;
            times.push(started.elapsed());
            world.barrier()?;
            if rank.rank() == 0 {
                peak = peak.max(PEAK.load(Ordering::Relaxed) - base);
            }
        }
        times.remove(0);
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>((median(times), peak / cp))
    })
    .expect("llama launch");
    out[0]
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let seqs: &[usize] = if quick {
        &[256, 512]
    } else {
        &[1024, 2048, 4096, 8192]
    };
    println!(
        "Attention [1, {HEADS} heads, seq, {HEAD_DIM}] forward + backward on flex, median of \
         {REPEATS}"
    );
    println!(
        "{:>6} {:>22} {:>22} {:>9} {:>9}",
        "seq", "eager: ms / peak MiB", "flash: ms / peak MiB", "time", "memory"
    );
    let scale = 1.0 / (HEAD_DIM as f64).sqrt();
    for &seq in seqs {
        let (te, me) = attention(seq, &|q, k, v| fused::causal_attention(q, k, v, scale));
        let mask = AttentionMask::causal(seq);
        let (tf, mf) = attention(seq, &|q, k, v| flash_attention(q, k, v, &mask, scale));
        println!(
            "{seq:>6} {:>10.1} / {:>9.1} {:>10.1} / {:>9.1} {:>8.2}x {:>8.3}x",
            te.as_secs_f64() * 1e3,
            mib(me),
            tf.as_secs_f64() * 1e3,
            mib(mf),
            tf.as_secs_f64() / te.as_secs_f64(),
            mf as f64 / me as f64
        );
    }
    println!();
    println!(
        "Llama step (hidden 256, 2 layers, {HEADS} heads of {HEAD_DIM}, AdamW) on one row, flash \
         attention; per rank"
    );
    println!(
        "{:>6} {:>5} {:>10} {:>12} {:>14}",
        "seq", "cp", "step ms", "tokens/s", "peak MiB"
    );
    for &seq in seqs {
        for cp in [1, 2, 4] {
            let (t, peak) = llama_step(seq, cp);
            println!(
                "{seq:>6} {cp:>5} {:>10.1} {:>12.0} {:>14.1}",
                t.as_secs_f64() * 1e3,
                (seq / cp) as f64 / t.as_secs_f64(),
                mib(peak)
            );
        }
    }
}
