//! burn-train's `SupervisedTraining` under our strategies: a small classifier (three Linear
//! layers with `#[parallelize]` attributes) on a synthetic dataset, trained single-device with
//! burn-train's own strategy, then under ddp 2, fsdp2 2 and tp 2 through
//! `ParallelStrategy`. Prints each epoch's train/valid loss and accuracy and exits non-zero
//! when a run differs from the single-device one by more than 1e-5.
//!
//! `cargo run --example learner -- [--epochs N]` (default 2 epochs of 8 steps: a few seconds).
//! Under `mpirun -np 2 ... -- --strategy fsdp2` the run's ranks are the MPI processes (the MPI
//! engine launches once per process: pick one strategy).

#[path = "support/learner_setup.rs"]
mod setup;

use burn::optim::AdamWConfig;
use burn::tensor::Device;
use burn_parallel::learner::ParallelStrategy;
use burn_parallel::learner::burn_train::metric::{AccuracyMetric, LearningRateMetric, LossMetric};
use burn_parallel::learner::burn_train::{
    ExecutionStrategy, Learner, SupervisedTraining, TrainingStrategy,
};
use burn_parallel::prelude::*;
use setup::{Classifier, Quiet, Recorder, Table};

const TRAIN: usize = 64;
const VALID: usize = 32;
const BATCH: usize = 8;
const LR: f64 = 1e-2;

/// One run through `SupervisedTraining`: `None` is burn-train's single-device strategy.
fn run(
    init: &burn::store::ModuleRecord,
    config: Option<DistributedConfig>,
    epochs: usize,
) -> Result<Table, String> {
    use burn::module::Module;
    let device = Device::flex().autodiff();
    let model = Classifier::new(&device).load_record(init.clone());
    let (train, valid) = setup::loaders(TRAIN, VALID, BATCH, 42, &device);
    let recorder = Recorder::default();
    let dir = std::env::temp_dir().join(format!(
        "burn-parallel-learner-example-{}",
        std::process::id()
    ));
    let strategy = match config {
        None => TrainingStrategy::Default(ExecutionStrategy::SingleDevice(device)),
        Some(config) => ParallelStrategy::new(config, AdamWConfig::new().init()).into(),
    };
    let result = SupervisedTraining::new(&dir, train, valid)
        .metrics((LossMetric::new(), AccuracyMetric::new()))
        .metric_train_numeric(LearningRateMetric::new())
        .with_metric_logger(recorder.clone())
        .with_application_logger(None)
        .renderer(Box::new(Quiet::default()))
        .num_epochs(epochs)
        .with_training_strategy(strategy)
        .launch(Learner::new(model, AdamWConfig::new().init(), LR));
    let _ = std::fs::remove_dir_all(&dir);
    if let Some(error) = result.error {
        return Err(error.to_string());
    }
    Ok(recorder.table())
}

fn config(strategy: Strategy) -> DistributedConfig {
    DistributedConfig {
        strategy,
        world_size: Some(2),
        ..Default::default()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    use burn::module::Module;
    let mut epochs = 2;
    let mut only: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--epochs" => epochs = args.next().ok_or("--epochs N")?.parse()?,
            "--quick" => epochs = 1,
            "--strategy" => only = Some(args.next().ok_or("--strategy ddp|fsdp2|tp")?),
            other => {
                return Err(format!(
                    "unknown argument {other:?} (--epochs N, --quick, --strategy ddp|fsdp2|tp)"
                )
                .into());
            }
        }
    }
    // Under `mpirun` every process trains; rank 0 renders, so only it has the metrics.
    let mpi_rank = ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse::<usize>().ok());
    // One initial model for every run (and, under MPI, every process: seeded).
    let device = Device::flex().autodiff();
    device.seed(7);
    let init = Classifier::new(&device).into_record();
    let single = run(&init, None, epochs)?;
    let mut worst = 0.0f64;
    let mut rows = Vec::new();
    for (name, strategy) in [
        ("ddp 2", Strategy::Ddp),
        ("fsdp2 2", Strategy::Fsdp2),
        ("tp 2", Strategy::Tp),
    ] {
        if only.as_deref().is_some_and(|o| o != strategy.name()) {
            continue;
        }
        let table = run(&init, Some(config(strategy)), epochs)?;
        for (key, expected) in &single {
            let got = table.get(key).copied().unwrap_or(f64::NAN);
            let diff = (got - expected).abs() / expected.abs().max(1e-3);
            worst = worst.max(if diff.is_nan() { f64::INFINITY } else { diff });
            rows.push((name, key.clone(), *expected, got, diff));
        }
    }
    if mpi_rank.is_some_and(|rank| rank != 0) {
        return Ok(());
    }
    println!(
        "{:<8} {:<6} {:>5} {:<14} {:>12} {:>12} {:>9}",
        "run", "split", "epoch", "metric", "single", "parallel", "rel diff"
    );
    for (name, (split, epoch, metric), expected, got, diff) in &rows {
        println!(
            "{name:<8} {split:<6} {epoch:>5} {metric:<14} {expected:>12.6} {got:>12.6} {diff:>9.1e}"
        );
    }
    if worst > 1e-5 || rows.is_empty() {
        eprintln!(
            "FAIL: a parallel run differs from the single-device run by {worst:.1e} (> 1e-5)"
        );
        std::process::exit(1);
    }
    println!("every run equals the single-device run to {worst:.1e} (<= 1e-5)");
    Ok(())
}
