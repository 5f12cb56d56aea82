//! The Llama trainer as an MPI job (one process per rank) against the same run on rank threads
//! of one process: the same program, only `TrainConfig::engine` differs.

use burn_parallel::train::{
    Backend, DistributedFlags, EngineKind, OptimizerKind, Strategy, TrainConfig, TrainSummary,
    train,
};

/// The argument that selects this role, followed by the strategy, tp and pp (empty for none).
pub const TRAIN_ARG: &str = "--train";

/// The layouts checked on `np` processes, as `(strategy, tp, pp)`.
pub fn strategies(np: usize) -> Vec<(&'static str, Option<usize>, Option<usize>)> {
    match np {
        2 => vec![
            ("fsdp2", None, None),
            ("tp", None, None),
            ("fsdp2", None, Some(2)),
        ],
        3 => vec![("fsdp2", None, None)],
        4 => vec![("fsdp2_tp", Some(2), None), ("fsdp2", None, Some(2))],
        _ => vec![("fsdp2", None, None)],
    }
}

fn config(
    strategy: Strategy,
    world: usize,
    (tp, pp): (Option<usize>, Option<usize>),
    engine: EngineKind,
) -> TrainConfig {
    let mut model = burn_parallel::models::LlamaConfig::tiny();
    model.num_hidden_layers = 2;
    let flags = DistributedFlags {
        tp,
        pp,
        // Two microbatches per stage rank: 1F1B's steady state sends an activation and a
        // gradient across the same pair of processes at once.
        microbatches: pp.map(|_| 2),
        ..DistributedFlags::on(strategy, world)
    };
    TrainConfig {
        distributed: flags.resolve().expect("flags without a file resolve"),
        steps: 3,
        global_batch: if pp.is_some() { 8 } else { 5 },
        // Under pp, messages above Open MPI's eager limits (a microbatch's activation is 2 or 4
        // rows x 64 tokens x 64 floats, 32-64 KiB): a send that waited for its receive would
        // hang the schedule.
        seq_len: if pp.is_some() { 64 } else { 8 },
        optimizer: OptimizerKind::AdamW,
        backend: Backend::Ndarray,
        model,
        engine,
        ..TrainConfig::default()
    }
}

/// Runs `strategy` as this MPI job; the process holding rank 0 then runs it on threads and
/// compares the loss curves and gradient norms bit for bit (both engines reduce in rank order).
pub fn run(
    world: usize,
    strategy: &str,
    tp: Option<usize>,
    pp: Option<usize>,
) -> Result<(), String> {
    let strategy = strategy.parse::<Strategy>().map_err(|e| e.to_string())?;
    let on_mpi = train(&config(strategy, world, (tp, pp), EngineKind::Mpi), &|_| {})
        .map_err(|e| e.to_string())?;
    if !on_mpi.has_rank_zero() {
        return Ok(());
    }
    let on_threads = train(
        &config(strategy, world, (tp, pp), EngineKind::Threads),
        &|_| {},
    )
    .map_err(|e| e.to_string())?;
    let curve = |s: &TrainSummary| -> Vec<(u32, u32)> {
        s.steps
            .iter()
            .map(|r| (r.report.loss.to_bits(), r.report.grad_norm.to_bits()))
            .collect()
    };
    if curve(&on_mpi) != curve(&on_threads) {
        return Err(format!(
            "{strategy} on {world}: MPI losses {:?} differ from threads {:?}",
            on_mpi.losses(),
            on_threads.losses()
        ));
    }
    let pp = pp.map(|p| format!(" pp {p}")).unwrap_or_default();
    println!(
        "mpi tests: train_llama {strategy}{pp} on {world} processes equals {world} threads: {:?}",
        on_mpi.losses()
    );
    Ok(())
}
