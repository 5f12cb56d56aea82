//! The Llama trainer as an MPI job (one process per rank) against the same run on rank threads
//! of one process: the same program, only `TrainConfig::engine` differs.

use burn_parallel::train::{
    Backend, DistributedFlags, EngineKind, OptimizerKind, Strategy, TrainConfig, TrainSummary,
    train,
};

/// The argument that selects this role, followed by the strategy, tp and pp (empty for none),
/// and [`ASYNC_TP_ARG`] or nothing.
pub const TRAIN_ARG: &str = "--train";

/// Sequence parallelism with async TP (`enable_async_tensor_parallel`) on an uneven sequence.
pub const ASYNC_TP_ARG: &str = "async-tp";

/// One layout checked on MPI.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    pub strategy: Strategy,
    pub tp: Option<usize>,
    pub pp: Option<usize>,
    /// Sequence parallelism (the `llama-sp` plan) on 7 tokens: sequence chunks of 4 and 3.
    pub sequence_parallel: bool,
    pub async_tp: bool,
}

const fn layout(strategy: Strategy, tp: Option<usize>, pp: Option<usize>) -> Layout {
    Layout {
        strategy,
        tp,
        pp,
        sequence_parallel: false,
        async_tp: false,
    }
}

const fn async_tp(strategy: Strategy, tp: Option<usize>) -> Layout {
    Layout {
        sequence_parallel: true,
        async_tp: true,
        ..layout(strategy, tp, None)
    }
}

/// The layouts checked on `np` processes.
pub fn strategies(np: usize) -> Vec<Layout> {
    match np {
        2 => vec![
            layout(Strategy::Fsdp2, None, None),
            layout(Strategy::Tp, None, None),
            async_tp(Strategy::Tp, None),
            layout(Strategy::Fsdp2, None, Some(2)),
        ],
        3 => vec![layout(Strategy::Fsdp2, None, None)],
        4 => vec![
            layout(Strategy::Fsdp2Tp, Some(2), None),
            async_tp(Strategy::Fsdp2Tp, Some(2)),
            layout(Strategy::Fsdp2, None, Some(2)),
        ],
        _ => vec![layout(Strategy::Fsdp2, None, None)],
    }
}

fn config(strategy: Strategy, world: usize, layout: Layout, engine: EngineKind) -> TrainConfig {
    let (tp, pp) = (layout.tp, layout.pp);
    let mut model = burn_parallel::models::LlamaConfig::tiny();
    model.num_hidden_layers = 2;
    let flags = DistributedFlags {
        tp,
        pp,
        tp_plan: layout
            .async_tp
            .then(|| "llama-sp".parse().expect("a plan name")),
        // Two microbatches per stage rank: 1F1B's steady state sends an activation and a
        // gradient across the same pair of processes at once.
        microbatches: pp.map(|_| 2),
        ..DistributedFlags::on(strategy, world)
    };
    let mut distributed = flags.resolve().expect("flags without a file resolve");
    distributed.enable_async_tensor_parallel = layout.async_tp;
    TrainConfig {
        distributed,
        steps: 3,
        global_batch: if pp.is_some() { 8 } else { 5 },
        // Under pp, messages above Open MPI's eager limits (a microbatch's activation is 2 or 4
        // rows x 64 tokens x 64 floats, 32-64 KiB): a send that waited for its receive would
        // hang the schedule. Under sequence parallelism, 7 tokens: chunks of 4 and 3.
        seq_len: match (pp, layout.sequence_parallel) {
            (Some(_), _) => 64,
            (None, true) => 7,
            (None, false) => 8,
        },
        optimizer: OptimizerKind::AdamW,
        backend: Backend::Ndarray,
        model,
        engine,
        ..TrainConfig::default()
    }
}

/// Runs `layout` as this MPI job; the process holding rank 0 then runs it on threads and
/// compares the loss curves and gradient norms bit for bit (both engines reduce in rank order).
/// Under async TP it also runs synchronous TP on threads: the same curves to 1e-6.
pub fn run(world: usize, layout: Layout) -> Result<(), String> {
    let strategy = layout.strategy;
    let run = |layout: Layout, engine| {
        train(&config(strategy, world, layout, engine), &|_| {}).map_err(|e| e.to_string())
    };
    let on_mpi = run(layout, EngineKind::Mpi)?;
    if !on_mpi.has_rank_zero() {
        return Ok(());
    }
    let on_threads = run(layout, EngineKind::Threads)?;
    if layout.async_tp {
        let sync = run(
            Layout {
                async_tp: false,
                ..layout
            },
            EngineKind::Threads,
        )?;
        let pairs = on_mpi.steps.iter().zip(&sync.steps);
        for (a, s) in pairs {
            let (a, s) = (&a.report, &s.report);
            let close = |x: f32, y: f32| (x - y).abs() <= 1e-6 * y.abs().max(1.0);
            if !close(a.loss, s.loss) || !close(a.grad_norm, s.grad_norm) {
                return Err(format!(
                    "async TP {strategy} on {world} MPI processes: loss {} grad norm {} against \
                     synchronous TP's {} and {}",
                    a.loss, a.grad_norm, s.loss, s.grad_norm
                ));
            }
        }
    }
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
    let pp = layout.pp.map(|p| format!(" pp {p}")).unwrap_or_default();
    let pp = match layout.async_tp {
        true => format!("{pp} async TP (equal to synchronous TP to 1e-6)"),
        false => pp,
    };
    println!(
        "mpi tests: train_llama {strategy}{pp} on {world} processes equals {world} threads: {:?}",
        on_mpi.losses()
    );
    Ok(())
}
