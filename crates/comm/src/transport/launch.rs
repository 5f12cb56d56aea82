//! One entry point for every kind of launch: the same program runs its ranks as threads of one
//! process (the threads engine), as the processes of an MPI job (the `mpi` engine, cargo
//! feature `mpi`), or as GPUs talking NCCL (the `nccl` engine, cargo feature `nccl`). Each
//! rank's closure gets a [`RankContext`] either way.
//!
//! The engine is chosen by [`ENGINE_ENV`] (`threads`, `mpi` or `nccl`) when set, else `mpi`
//! when the process was started by an MPI launcher (`mpirun`, `mpiexec`, `srun --mpi=pmix`),
//! else `threads`. Programs with an `--engine` flag pass their choice to [`Ranks::engine`].

use std::fmt;
use std::str::FromStr;

use crate::transport::engine::RankContext;
use crate::transport::error::{LaunchError, RankFailure};

/// Environment variable that picks the engine: `threads`, `mpi` or `nccl`.
pub const ENGINE_ENV: &str = "BURN_PARALLEL_ENGINE";

/// The engines a launch can run ranks on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// Ranks are threads of this process.
    Threads,
    /// Each process of an MPI job runs one rank.
    Mpi,
    /// Ranks are GPUs talking NCCL: one process per GPU when the launcher sets `RANK`
    /// (`torchrun`-style environment, see `nccl::LaunchEnv`), else one thread per GPU of this
    /// process.
    Nccl,
}

impl EngineKind {
    /// Every engine and its name, as [`ENGINE_ENV`] and `--engine` spell it: the one table
    /// `name`, `FromStr` and [`UnknownEngine`]'s message read.
    pub const NAMES: [(EngineKind, &'static str); 3] = [
        (EngineKind::Threads, "threads"),
        (EngineKind::Mpi, "mpi"),
        (EngineKind::Nccl, "nccl"),
    ];

    /// The engine's name, as [`ENGINE_ENV`] and `--engine` spell it.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(kind, _)| *kind == self)
            .map_or("", |(_, name)| name)
    }

    /// Whether this build includes the engine (`mpi` needs the cargo feature `mpi`).
    pub fn available(self) -> bool {
        match self {
            EngineKind::Threads => true,
            EngineKind::Mpi => cfg!(feature = "mpi"),
            EngineKind::Nccl => cfg!(feature = "nccl"),
        }
    }

    /// The engine [`ENGINE_ENV`] names, else `Mpi` under an MPI launcher, else `Threads`.
    pub fn detect() -> Result<Self, LaunchError> {
        match std::env::var(ENGINE_ENV) {
            Ok(value) if !value.trim().is_empty() => value
                .parse()
                .map_err(|e: UnknownEngine| launch_error(format!("{ENGINE_ENV}: {e}"))),
            _ if started_by_mpi_launcher() => Ok(EngineKind::Mpi),
            _ => Ok(EngineKind::Threads),
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A word that names no engine of [`EngineKind::NAMES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown engine {0:?} (expected one of: {names})",
    names = EngineKind::NAMES.map(|(_, name)| name).join(", ")
)]
pub struct UnknownEngine(pub String);

impl FromStr for EngineKind {
    type Err = UnknownEngine;
    fn from_str(s: &str) -> Result<Self, UnknownEngine> {
        let word = s.trim().to_ascii_lowercase();
        Self::NAMES
            .iter()
            .find(|(_, name)| *name == word)
            .map(|(kind, _)| *kind)
            .ok_or_else(|| UnknownEngine(s.into()))
    }
}

/// Whether this process was started by an MPI launcher: Open MPI's `mpirun`, MPICH's
/// `mpiexec` (PMI), or Slurm's `srun --mpi=pmix`.
pub fn started_by_mpi_launcher() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// Runs `world_size` ranks on the engine [`EngineKind::detect`] picks: [`Ranks::run`] with
/// no options.
pub fn run_ranks<T, E, F>(world_size: usize, f: F) -> Result<Vec<(usize, T)>, LaunchError>
where
    T: Send,
    E: fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    Ranks::new(world_size).run(f)
}

/// A launch of `world_size` ranks with its options: the engine (default: the one
/// [`EngineKind::detect`] picks) and each CPU rank's compute threads (default: the cores
/// shared among the process's ranks, see [`threads_per_rank`](crate::threads_per_rank)).
///
/// ```ignore
/// let results = Ranks::new(4).engine(EngineKind::Mpi).run(|ctx| train(ctx))?;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "a launch does nothing until it is run"]
pub struct Ranks {
    world_size: usize,
    engine: Option<EngineKind>,
    threads_per_rank: Option<usize>,
}

impl Ranks {
    /// `world_size` ranks on the detected engine.
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            engine: None,
            threads_per_rank: None,
        }
    }

    /// Runs the ranks on `engine` (a program's `--engine` flag).
    pub fn engine(mut self, engine: EngineKind) -> Self {
        self.engine = Some(engine);
        self
    }

    /// Each CPU rank's compute threads (`None`: the default).
    pub fn threads_per_rank(mut self, threads: Option<usize>) -> Self {
        self.threads_per_rank = threads;
        self
    }

    /// Runs `f` on every rank this process hosts and returns their `(rank, result)` pairs in
    /// rank order: all `world_size` ranks with `Threads`; this process's one rank with `Mpi`
    /// (and NCCL under a launcher), where `world_size` must equal the job's process count.
    ///
    /// Failures: with `Threads`, a rank that errors or panics makes the others' collectives
    /// fail and the launch returns every failure (see [`Launcher::run`](crate::Launcher::run)).
    /// With `Mpi`, it prints the rank and the error (which names the collective and its group)
    /// and aborts the whole job (`MPI_Abort`), so no process waits forever.
    pub fn run<T, E, F>(self, f: F) -> Result<Vec<(usize, T)>, LaunchError>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(RankContext) -> Result<T, E> + Sync,
    {
        let engine = match self.engine {
            Some(engine) => engine,
            None => EngineKind::detect()?,
        };
        run_on(self.world_size, engine, self.threads_per_rank, f)
    }
}

/// [`Ranks::run`] on a chosen engine.
fn run_on<T, E, F>(
    world_size: usize,
    engine: EngineKind,
    threads_per_rank: Option<usize>,
    f: F,
) -> Result<Vec<(usize, T)>, LaunchError>
where
    T: Send,
    E: fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    match engine {
        EngineKind::Threads => {
            let mut launcher = crate::transport::threads::Launcher::new(world_size);
            if let Some(threads) = threads_per_rank {
                launcher = launcher.threads_per_rank(threads);
            }
            let results = launcher.run(f)?;
            Ok(results.into_iter().enumerate().collect())
        }
        #[cfg(feature = "mpi")]
        EngineKind::Mpi => {
            crate::transport::mpi::run_with_threads(world_size, threads_per_rank, &f)
        }
        #[cfg(not(feature = "mpi"))]
        EngineKind::Mpi => Err(launch_error(
            "the mpi engine is not in this build: enable the cargo feature `mpi` \
             (it needs Open MPI and libclang installed)"
                .into(),
        )),
        #[cfg(feature = "nccl")]
        EngineKind::Nccl => run_nccl(world_size, f),
        #[cfg(not(feature = "nccl"))]
        EngineKind::Nccl => Err(launch_error(
            "the nccl engine is not in this build: enable the cargo feature `nccl` (or `cuda`)"
                .into(),
        )),
    }
}

/// One process per GPU under a launcher that sets `RANK` (its world must be `world_size`; the
/// id comes from `NCCL_COMM_ID` or `BURN_PARALLEL_NCCL_ID`), or under `mpirun` with the `mpi`
/// feature (rank 0 creates the id and broadcasts it over MPI), else `world_size` rank threads
/// on GPUs `0..world_size`. A process whose rank fails (an error or a panic) aborts its
/// communicators, which ends its peers' calls, and returns the error; the launcher (`torchrun`,
/// `mpirun`, `srun`) then ends the job.
#[cfg(feature = "nccl")]
fn run_nccl<T, E, F>(world_size: usize, f: F) -> Result<Vec<(usize, T)>, LaunchError>
where
    T: Send,
    E: fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    use crate::transport::nccl::{LaunchEnv, NcclEngine, launch_local};
    if std::env::var_os("RANK").is_none() {
        #[cfg(feature = "mpi")]
        if started_by_mpi_launcher() {
            // `_mpi` keeps MPI initialized until the rank's work has ended.
            let (rank, engine, _mpi) = crate::transport::mpi::nccl_world(world_size)?;
            return run_nccl_rank(rank, engine, f);
        }
        let ordinals: Vec<usize> = (0..world_size).collect();
        return Ok(launch_local(&ordinals, f)?
            .into_iter()
            .enumerate()
            .collect());
    }
    let env = LaunchEnv::from_env().map_err(|e| launch_error(e.to_string()))?;
    if env.world_size != world_size {
        return Err(launch_error(format!(
            "the launcher started {} processes (WORLD_SIZE) but the job asks for {world_size} ranks",
            env.world_size
        )));
    }
    let engine = NcclEngine::from_env().map_err(|e| rank_error(env.rank, e.to_string()))?;
    run_nccl_rank(env.rank, engine, f)
}

/// Runs this process's rank on `engine`; a failure (error or panic) aborts its communicators
/// before they drop, so peers blocked on this rank end instead of being waited for.
#[cfg(feature = "nccl")]
pub(crate) fn run_nccl_rank<T, E, F>(
    rank: usize,
    engine: crate::transport::nccl::NcclEngine,
    f: F,
) -> Result<Vec<(usize, T)>, LaunchError>
where
    E: fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E>,
{
    let engine = std::sync::Arc::new(engine);
    let ctx = RankContext::new(engine.clone());
    run_rank_then_abort(rank, ctx, || engine.abort_all(), f)
}

/// Runs one process's rank; on a failure, returned or panicked, calls `abort` (on this, the
/// rank's thread) before the context's communicators drop, and reports the failure.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
fn run_rank_then_abort<T, E, F>(
    rank: usize,
    ctx: RankContext,
    abort: impl FnOnce(),
    f: F,
) -> Result<Vec<(usize, T)>, LaunchError>
where
    E: fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E>,
{
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let outcome = catch_unwind(AssertUnwindSafe(|| f(ctx)));
    let (message, panicked) = match outcome {
        Ok(Ok(v)) => return Ok(vec![(rank, v)]),
        Ok(Err(e)) => (e.to_string(), false),
        Err(payload) => (
            crate::transport::rank_threads::panic_message(payload.as_ref()),
            true,
        ),
    };
    abort();
    Err(LaunchError {
        failures: vec![RankFailure {
            rank,
            message,
            panicked,
        }],
    })
}

#[cfg(feature = "nccl")]
fn rank_error(rank: usize, message: String) -> LaunchError {
    LaunchError {
        failures: vec![RankFailure {
            rank,
            message,
            panicked: false,
        }],
    }
}

fn launch_error(message: String) -> LaunchError {
    LaunchError {
        failures: vec![RankFailure {
            rank: 0,
            message,
            panicked: false,
        }],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_names_parse_and_print() {
        for kind in [EngineKind::Threads, EngineKind::Mpi, EngineKind::Nccl] {
            assert_eq!(kind.name().parse::<EngineKind>(), Ok(kind));
            assert_eq!(kind.to_string(), kind.name());
        }
        assert_eq!(" MPI ".parse::<EngineKind>(), Ok(EngineKind::Mpi));
        let err = "gloo".parse::<EngineKind>().unwrap_err();
        assert!(err.to_string().contains("\"gloo\""), "{err}");
    }

    #[test]
    fn threads_launch_reports_every_rank_in_order() {
        let results = Ranks::new(3)
            .engine(EngineKind::Threads)
            .run(|ctx| Ok::<_, String>(ctx.rank() * 10))
            .unwrap();
        assert_eq!(results, vec![(0, 0), (1, 10), (2, 20)]);
    }

    #[test]
    fn nccl_without_the_feature_or_a_gpu_is_a_clear_error() {
        assert_eq!("nccl".parse::<EngineKind>(), Ok(EngineKind::Nccl));
        let err = Ranks::new(2)
            .engine(EngineKind::Nccl)
            .run(|_| Ok::<_, String>(()))
            .unwrap_err()
            .to_string();
        if EngineKind::Nccl.available() {
            // No GPU or CUDA driver on the machines that run this test.
            assert!(err.contains("libcuda") || err.contains("CUDA"), "{err}");
        } else {
            assert!(err.contains("feature `nccl`"), "{err}");
        }
    }

    /// A rank that returns an error (not only one that panics) aborts its communicators.
    #[test]
    fn a_rank_that_fails_aborts_before_its_communicators_drop() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let aborts = AtomicUsize::new(0);
        crate::transport::threads::launch(1, |ctx| {
            let abort = || {
                aborts.fetch_add(1, Ordering::SeqCst);
            };
            let e = run_rank_then_abort(3, ctx.clone(), abort, |_| Err::<(), _>("boom"));
            let e = e.unwrap_err();
            assert_eq!((e.first().rank, e.first().message.as_str()), (3, "boom"));
            let ok = run_rank_then_abort(3, ctx.clone(), abort, |_| Ok::<_, String>(7));
            assert_eq!(ok.unwrap(), vec![(3, 7)]);
            let panicked =
                run_rank_then_abort(3, ctx, abort, |_| -> Result<(), String> { panic!("oops") });
            assert!(panicked.unwrap_err().first().panicked);
            Ok::<_, String>(())
        })
        .unwrap();
        assert_eq!(aborts.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn mpi_without_the_feature_is_a_clear_error() {
        if EngineKind::Mpi.available() {
            return;
        }
        let err = Ranks::new(2)
            .engine(EngineKind::Mpi)
            .run(|_| Ok::<_, String>(()))
            .unwrap_err();
        assert!(err.to_string().contains("feature `mpi`"), "{err}");
    }
}
