//! Benchmark: tokens/s and per-rank peak model-state bytes of the default tiny Llama under
//! single, ddp, fsdp2 (2 and 4 ranks) and tp (2), measured in one run, as ratios to single.
//!
//! ```text
//! cargo run --release --example llama_strategies [-- --steps 12 --backend flex]
//! ```
//! Ranks are threads of this process sharing the machine's cores, so throughput ratios show
//! the overhead of each strategy's communication and sharding on one machine, not multi-device
//! speed-up.

use burn_parallel::train::{Backend, DistributedFlags, Strategy, TrainConfig, train};
use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 12)]
    steps: usize,
    #[arg(long, default_value = "flex")]
    backend: Backend,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let runs = [
        (Strategy::Single, 1),
        (Strategy::Ddp, 2),
        (Strategy::Fsdp2, 2),
        (Strategy::Fsdp2, 4),
        (Strategy::Tp, 2),
    ];
    println!(
        "{:<10} {:>5} {:>12} {:>8} {:>22} {:>8} {:>10}",
        "strategy", "ranks", "tokens/s", "ratio", "peak state/rank (B)", "ratio", "loss"
    );
    let mut base: Option<(f64, u64)> = None;
    for (strategy, world) in runs {
        let cfg = TrainConfig {
            distributed: DistributedFlags::on(strategy, world).resolve()?,
            steps: args.steps,
            backend: args.backend,
            ..TrainConfig::default()
        };
        let s = train(&cfg, &|_| {})?;
        let tps = s.tokens_per_s();
        let peak = *s.model_state_bytes.iter().max().unwrap_or(&0);
        let (btps, bpeak) = *base.get_or_insert((tps, peak));
        println!(
            "{:<10} {:>5} {:>12.0} {:>8.2} {:>22} {:>8.2} {:>10.4}",
            strategy.to_string(),
            world,
            tps,
            tps / btps,
            peak,
            peak as f64 / bpeak as f64,
            s.steps.last().map(|r| r.report.loss).unwrap_or(f32::NAN)
        );
    }
    Ok(())
}
