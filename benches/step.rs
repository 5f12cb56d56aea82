//! Where one training step's time goes, per strategy, against one device in the same run: the
//! tiny Llama (`LlamaConfig::tiny()`) on flex, global batch 8 x 128 tokens, AdamW, the gradient
//! norm clipped to 1.0, one thread per rank, the trainer's allocator setting (`Malloc::Kept`).
//! The Rust-only counterpart of `scripts/bench-torch.py` (which adds PyTorch's figures): a
//! change that slows a phase shows here without Python.
//!
//! Run: cargo bench --bench step
//!
//! Prints the median over steps 2.. of rank 0's step time and its split (forward with the
//! loss, backward with the gradient sync and clipping, optimizer; the all-gathers,
//! reduce-scatters and all-reduces inside forward and backward), and step / single.

use burn_parallel::models::LlamaConfig;
use burn_parallel::train::{
    Backend, DistributedFlags, Malloc, OptimizerKind, StepLog, Strategy, TrainConfig, train,
};

const STEPS: usize = 12;

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The median of `field` over the steps after the first two (warm-up).
fn median_of(steps: &[StepLog], field: impl Fn(&StepLog) -> f64) -> f64 {
    median(steps.iter().skip(2).map(field).collect())
}

fn main() {
    Malloc::Kept.apply();
    let base = TrainConfig {
        steps: STEPS,
        global_batch: 8,
        seq_len: 128,
        optimizer: OptimizerKind::AdamW,
        lr: 3e-3,
        weight_decay: 0.0,
        grad_clip: Some(1.0),
        backend: Backend::Flex,
        model: LlamaConfig::tiny(),
        ..TrainConfig::default()
    };
    let runs = [
        ("single", Strategy::Single, 1, None),
        ("ddp x2", Strategy::Ddp, 2, None),
        ("fsdp2 x2", Strategy::Fsdp2, 2, None),
        ("fsdp2 x4", Strategy::Fsdp2, 4, None),
        ("tp x2", Strategy::Tp, 2, Some(2)),
        ("fsdp2_tp 2x2", Strategy::Fsdp2Tp, 4, Some(2)),
    ];
    println!(
        "tiny Llama, flex, batch 8 x 128, AdamW, 1 thread per rank; seconds, median of steps 3..{STEPS}"
    );
    println!(
        "{:<14}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>9}",
        "run", "step", "fwd", "bwd", "opt", "gather", "r-scat", "a-red", "/single"
    );
    let mut single = None;
    for (name, strategy, world, tp) in runs {
        let flags = DistributedFlags {
            tp,
            ..DistributedFlags::on(strategy, world)
        };
        let cfg = TrainConfig {
            distributed: flags.resolve().unwrap_or_else(|e| panic!("{name}: {e}")),
            ..base.clone()
        };
        let summary = train(&cfg, &|_: &StepLog| {}).unwrap_or_else(|e| panic!("{name}: {e}"));
        let s = &summary.steps;
        let step = median_of(s, |l| l.step_time_s);
        let single_step = *single.get_or_insert(step);
        println!(
            "{name:<14}{step:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>9.2}",
            median_of(s, |l| l.times.forward_s),
            median_of(s, |l| l.times.backward_s),
            median_of(s, |l| l.times.optimizer_s),
            median_of(s, |l| l.times.all_gather_s),
            median_of(s, |l| l.times.reduce_scatter_s),
            median_of(s, |l| l.times.all_reduce_s),
            step / single_step,
        );
    }
}
