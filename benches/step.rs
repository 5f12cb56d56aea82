//! Where one training step's time goes, per strategy, against one device in the same run: a
//! Llama (`--model`: `hf-3m`, examples/models/llama_hf3m.json, 3.4M parameters where matmuls
//! dominate, the default; `tiny`, `LlamaConfig::tiny()`, where per-op overhead does; `95m`) on
//! flex, global batch 8 x 128 tokens, AdamW, the gradient norm clipped to 1.0, the trainer's
//! allocator setting (`Malloc::Kept`).
//! The Rust-only counterpart of `scripts/bench-torch.py` (which adds PyTorch's figures): a
//! change that slows a phase shows here without Python.
//!
//! Run: cargo bench --bench step [-- --model tiny|hf-3m|95m]
//!
//! Prints the median over steps 2.. of rank 0's step time and its split (forward with the
//! loss, backward with the gradient sync and clipping, optimizer; the all-gathers,
//! reduce-scatters and all-reduces inside forward and backward), step / single, and the
//! model GFLOP/s per rank (scripts/bench-torch.py's count).

use burn_parallel::models::LlamaConfig;
use burn_parallel::train::step_flops;
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

/// The `--model` argument's Llama and its name.
fn model() -> (String, LlamaConfig) {
    let args: Vec<String> = std::env::args().collect();
    let name = args
        .iter()
        .position(|a| a == "--model")
        .and_then(|i| args.get(i + 1))
        .map_or("hf-3m", |s| s.as_str())
        .to_string();
    let file = match name.as_str() {
        "tiny" => return (name, LlamaConfig::tiny()),
        "hf-3m" => "examples/models/llama_hf3m.json",
        "95m" => "examples/models/llama_95m.json",
        other => panic!("unknown --model {other}: tiny, hf-3m or 95m"),
    };
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let config = LlamaConfig::load(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
    (name, config)
}

fn main() {
    Malloc::Kept.apply();
    let (name, model) = model();
    let flops = step_flops(&model, 8, 128);
    let base = TrainConfig {
        steps: STEPS,
        global_batch: 8,
        seq_len: 128,
        optimizer: OptimizerKind::AdamW,
        lr: 3e-3,
        weight_decay: 0.0,
        grad_clip: Some(1.0),
        backend: Backend::Flex,
        model,
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
        "{name} Llama ({:.1} GFLOP per step), flex, batch 8 x 128, AdamW; seconds, median of \
         steps 3..{STEPS}",
        flops / 1e9
    );
    println!(
        "{:<14}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>8}{:>9}{:>11}",
        "run", "step", "fwd", "bwd", "opt", "gather", "r-scat", "a-red", "/single", "GFLOP/s/rk"
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
            "{name:<14}{step:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>8.4}{:>9.2}{:>11.1}",
            median_of(s, |l| l.times.forward_s),
            median_of(s, |l| l.times.backward_s),
            median_of(s, |l| l.times.optimizer_s),
            median_of(s, |l| l.times.all_gather_s),
            median_of(s, |l| l.times.reduce_scatter_s),
            median_of(s, |l| l.times.all_reduce_s),
            step / single_step,
            flops / world as f64 / step / 1e9,
        );
    }
}
