//! The `mpi` engine: one process per rank, over the system's MPI library (Open MPI) through
//! rsmpi. Every group is an MPI communicator made with `MPI_Comm_create_group` (only its members
//! take part, so groups of any rank subset work, e.g. one per mesh dimension). Tensors travel as
//! bytes, so every dtype works, half precision included; reductions run in this crate in rank
//! order, as in the threads engine, so both engines give bit-identical results.
//!
//! Each group runs its calls on a worker thread of its own, in issue order, so async calls and
//! calls on several groups proceed as in the threads engine. MPI must provide
//! `MPI_THREAD_MULTIPLE` (Open MPI does).
//!
//! A rank whose work fails calls `MPI_Abort` with a message naming the rank and the error
//! (which names the collective and its group), so that no rank waits forever on a dead peer.
//! A call (blocking or async) that does not complete within the timeout
//! ([`TIMEOUT_ENV`](crate::transport::timeout::TIMEOUT_ENV), 300 s by default) fails with
//! [`CollectiveError::Stalled`], naming it and every call this process has pending on any
//! group, also printed at once: ranks that issued their calls in different orders each say
//! where they wait, and the rank's failure then aborts the job. Before, a roll call
//! (`roll_call`) names the ranks of the call's group that never reached a collective.

mod comm;
mod lock;
#[cfg(feature = "nccl")]
mod nccl_id;
mod ops;
mod p2p;
mod pending;
mod roll_call;
mod shared_comm;

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::topology::{Communicator as _, SimpleCommunicator};

use crate::transport::collective::Communicator;
use crate::transport::compute_threads::{run_in_pool, threads_per_rank as compute_threads};
use crate::transport::engine::{Engine, RankContext, group_info};
use crate::transport::error::{CollectiveError, LaunchError, RankFailure};
use crate::transport::rank_threads::RANK_STACK_BYTES;
use crate::transport::stats::CommStats;

use comm::MpiCommunicator;
#[cfg(feature = "nccl")]
pub(crate) use nccl_id::nccl_world;

/// The exit status of a process that aborts the job because its rank failed.
pub const ABORT_EXIT_CODE: i32 = 3;

/// How long `run` waits, after the rank's work returned, for groups still in use elsewhere
/// (e.g. one returned inside the result) to shut down before MPI is finalized.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A group is identified by its label and its members in order.
type GroupKey = (String, Vec<usize>);

/// One process's connection to the MPI job.
#[derive(Debug)]
pub(crate) struct MpiEngine {
    rank: usize,
    size: usize,
    /// The counters, pending calls and timeout every group of this process shares.
    shared: comm::Shared,
    /// Asking again for a group returns the same communicator, with one call sequence, as the
    /// threads engine does.
    groups: Mutex<HashMap<GroupKey, Arc<MpiCommunicator>>>,
    workers: comm::WorkerRegistry,
}

impl Engine for MpiEngine {
    fn name(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn new_group(
        &self,
        label: &str,
        ranks: &[usize],
    ) -> Result<Arc<dyn Communicator>, CollectiveError> {
        let mut groups = lock::lock(&self.groups);
        let key = (label.to_string(), ranks.to_vec());
        if let Some(comm) = groups.get(&key) {
            return Ok(comm.clone());
        }
        let info = group_info(label, ranks, self.rank);
        let comm = Arc::new(MpiCommunicator::new(info, &self.shared, &self.workers)?);
        groups.insert(key, comm.clone());
        Ok(comm)
    }

    fn stats(&self) -> CommStats {
        lock::lock(&self.shared.rank_stats).clone()
    }
}

/// Runs this process's rank of an MPI job: initializes MPI, runs `f` with this rank's context,
/// and finalizes MPI. Returns `[(rank, result)]`. `world_size` must equal the number of
/// processes of the job. MPI can be initialized once per process, so this runs once.
///
/// `f` runs in a pool of compute threads: the cores divided by the job's processes on this node
/// (`OMPI_COMM_WORLD_LOCAL_SIZE` / `MPI_LOCALNRANKS`), or `BURN_PARALLEL_THREADS_PER_RANK`.
///
/// If `f` returns an error or panics, the process prints which rank failed and why, and aborts
/// the whole job (`MPI_Abort`): this call then never returns, and the job's processes exit
/// with a failure status.
pub fn run<T, E, F>(world_size: usize, f: F) -> Result<Vec<(usize, T)>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E> + Send,
{
    run_with_threads(world_size, None, f)
}

/// [`run`] with the rank's compute threads set (`None`: the default described there).
pub(crate) fn run_with_threads<T, E, F>(
    world_size: usize,
    threads_per_rank: Option<usize>,
    f: F,
) -> Result<Vec<(usize, T)>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E> + Send,
{
    if mpi::is_initialized() {
        return Err(launch_error(
            0,
            "MPI was already initialized in this process: the mpi engine runs one launch per process"
                .into(),
        ));
    }
    let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
        .ok_or_else(|| launch_error(0, "MPI could not be initialized".into()))?;
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    check_job(world_size, rank, size, threading)?;
    let engine = new_engine(&world, rank, size);
    let threads = compute_threads(threads_per_rank, local_ranks())
        .unwrap_or_else(|e| abort_job(rank, size, &e));
    let value = run_rank(&engine, rank, size, threads, f);
    shut_down(engine);
    drop(world);
    drop(universe);
    Ok(vec![(rank, value)])
}

/// The launch's failure on `rank` with `message`, before any rank's work ran.
fn launch_error(rank: usize, message: String) -> LaunchError {
    LaunchError {
        failures: vec![RankFailure {
            rank,
            message,
            panicked: false,
        }],
    }
}

/// Checks that the job is one this engine can run as asked: MPI's thread support and the
/// number of processes.
fn check_job(
    world_size: usize,
    rank: usize,
    size: usize,
    threading: Threading,
) -> Result<(), LaunchError> {
    // Every rank sees the same job, so every rank returns the same error: nobody is left waiting.
    if threading != Threading::Multiple {
        return Err(launch_error(
            rank,
            format!(
                "the MPI library provides thread support {threading:?}, the mpi engine needs Multiple"
            ),
        ));
    }
    if world_size != size {
        return Err(launch_error(
            rank,
            format!(
                "the program asks for {world_size} ranks but the MPI job has {size} processes (mpirun -np {world_size})"
            ),
        ));
    }
    Ok(())
}

/// This process's engine, with no group yet (collective over `world`: its roll call's
/// communicator).
fn new_engine(world: &SimpleCommunicator, rank: usize, size: usize) -> Arc<MpiEngine> {
    Arc::new(MpiEngine {
        rank,
        size,
        shared: comm::Shared {
            rank_stats: Arc::new(Mutex::new(CommStats::default())),
            pending: Arc::new(pending::PendingCalls::default()),
            timeout: crate::transport::timeout::from_env(),
            roll_call: Arc::new(roll_call::RollCall::new(world, rank, size)),
        },
        groups: Mutex::new(HashMap::new()),
        workers: comm::WorkerRegistry::default(),
    })
}

/// Runs `f` on this rank's compute threads and returns its value; an error or a panic aborts
/// the whole job instead, since the other ranks would wait for this one forever.
fn run_rank<T, E, F>(engine: &Arc<MpiEngine>, rank: usize, size: usize, threads: usize, f: F) -> T
where
    T: Send,
    E: std::fmt::Display,
    F: FnOnce(RankContext) -> Result<T, E> + Send,
{
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let engine = engine.clone();
        run_in_pool(rank, threads, RANK_STACK_BYTES, move || {
            f(RankContext::new(engine)).map_err(|e| e.to_string())
        })
    }));
    match outcome {
        Ok(Ok(Ok(value))) => value,
        Ok(Ok(Err(message)) | Err(message)) => abort_job(rank, size, &message),
        Err(payload) => abort_job(
            rank,
            size,
            &crate::transport::rank_threads::panic_message(payload.as_ref()),
        ),
    }
}

/// Waits, up to [`SHUTDOWN_GRACE`], for the groups' workers to stop when nothing else holds
/// the engine any more, so that MPI is not finalized under a worker still calling it.
fn shut_down(engine: Arc<MpiEngine>) {
    // Dropping the groups stops their workers; MPI is finalized once they have stopped.
    if let Ok(engine) = Arc::try_unwrap(engine) {
        let MpiEngine {
            groups, workers, ..
        } = engine;
        drop(groups);
        workers.join(Instant::now() + SHUTDOWN_GRACE);
    }
}

/// The processes of this job on this node, as the MPI launcher says (1 when it does not).
fn local_ranks() -> usize {
    ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.trim().parse().ok())
        .unwrap_or(1)
}

/// Ends the whole job: the failure of one rank would leave the others blocked in collectives.
fn abort_job(rank: usize, size: usize, message: &str) -> ! {
    eprintln!("burn-parallel: rank {rank} of {size} failed: {message}");
    eprintln!("burn-parallel: aborting the MPI job (MPI_Abort) so that no rank waits forever");
    SimpleCommunicator::world().abort(ABORT_EXIT_CODE)
}
