//! One process, one thread per GPU: [`launch_local`] creates every communicator of the world at
//! once (`ncclCommInitAll`, nothing to hand over between processes), waits for each under a
//! watchdog and runs each rank on a thread of its own with its [`NcclEngine`].

use std::sync::{Arc, Mutex};

use crate::transport::engine::RankContext;
use crate::transport::error::{LaunchError, RankFailure};
use crate::transport::rank_threads::{RankThreads, run_on_threads};

use super::comm::{NcclComm, NcclError};
use super::engine::{NcclEngine, NcclOptions, lock, ready};
use super::watchdog::{Abort, Watchdog};

/// Runs one rank per GPU of `ordinals` as threads of this process (communicators from
/// `ncclCommInitAll`, what cudarc's `Comm::from_devices` uses) and returns their results in
/// rank order, or every failure. A rank that fails ends the others' NCCL calls with its
/// message.
pub fn launch_local<T, E, F>(ordinals: &[usize], f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    launch_local_with(ordinals, NcclOptions::from_env(), f)
}

/// [`launch_local`] with explicit options (their signal is shared by the ranks).
fn launch_local_with<T, E, F>(
    ordinals: &[usize],
    options: NcclOptions,
    f: F,
) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    let failed = |e: NcclError| LaunchError {
        failures: vec![RankFailure {
            rank: 0,
            message: e.to_string(),
            panicked: false,
        }],
    };
    let comms = NcclComm::init_local(ordinals).map_err(failed)?;
    // The joins run in NCCL's threads; wait for each under a timeout (one GPU that does not
    // start would otherwise leave the others waiting).
    let dog = Watchdog::new(options.timeout, options.signal.clone());
    let world = comms.len();
    let mut ready_comms = Vec::with_capacity(world);
    let mut comms = comms.into_iter();
    for comm in comms.by_ref() {
        let what = format!(
            "ncclCommInitRankConfig of rank {} of {world} on GPU {} (one process)",
            comm.rank(),
            comm.ordinal()
        );
        match ready(comm, &dog, what) {
            Ok(c) => ready_comms.push(c),
            Err(e) => {
                ready_comms
                    .iter()
                    .chain(comms.as_slice())
                    .for_each(Abort::abort);
                return Err(failed(e));
            }
        }
    }
    let ranks = NcclRanks {
        comms: Mutex::new(ready_comms.into_iter().map(Some).collect()),
        engines: Mutex::new((0..world).map(|_| None).collect()),
        options,
    };
    // GPU ranks compute on their device: one host thread each runs the rank.
    run_on_threads(world, 1, &ranks, &f)
}

/// Threads of one process, one per GPU: each rank takes its communicator; they share the
/// options' failure signal.
struct NcclRanks {
    comms: Mutex<Vec<Option<NcclComm>>>,
    /// Each running rank's engine, so that a failed rank aborts its communicators.
    engines: Mutex<Vec<Option<Arc<NcclEngine>>>>,
    options: NcclOptions,
}

impl RankThreads for NcclRanks {
    fn context(&self, rank: usize) -> RankContext {
        let comm = lock(&self.comms)[rank]
            .take()
            .expect("each rank takes its communicator once");
        let engine = Arc::new(NcclEngine::with_options(comm, self.options.clone()));
        lock(&self.engines)[rank] = Some(engine.clone());
        RankContext::new(engine)
    }

    /// On the rank's own thread: a failed rank tells the others and aborts its communicators
    /// (an error returned, not only a panic, must not destroy them: that waits for peers).
    fn finished(&self, rank: usize, failure: Option<&str>) {
        let engine = lock(&self.engines)[rank].take();
        if let Some(message) = failure {
            self.options.signal.raise(rank, message);
            if let Some(engine) = engine {
                engine.abort_all();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;
    use crate::transport::error::CollectiveError;
    use crate::transport::nccl::engine::tests::skipped;

    /// Without CUDA the launcher fails with the library message, before touching cudarc; with
    /// CUDA and NCCL it runs a real one-rank all_reduce and agreement on GPU 0 (or names the
    /// missing GPU). Whichever half cannot run here says so on the terminal.
    #[test]
    fn launching_runs_on_a_gpu_or_fails_clearly_without_one() {
        match super::super::library::check_libraries() {
            Err(missing) => {
                let e = launch_local(&[0], |_ctx| Ok::<(), String>(())).unwrap_err();
                assert!(e.first().message.contains("lib"), "{e}");
                skipped("the GPU half of the NCCL launch test", &missing.to_string());
            }
            Ok(()) => {
                let run = launch_local(&[0], |ctx| {
                    let world = ctx.world()?;
                    let x = TensorData::new(vec![1.5f32, -2.0, 3.25], [3]);
                    let y = world.all_reduce(x.clone(), crate::ReduceOp::Sum)?;
                    let again = world.all_reduce(x.clone(), crate::ReduceOp::Sum)?;
                    Ok::<_, CollectiveError>((x, y, again))
                });
                match run {
                    Ok(out) => {
                        let (x, y, again) = &out[0];
                        assert_eq!(x, y);
                        assert_eq!(x, again);
                    }
                    Err(e) if e.to_string().contains("does not exist") => {
                        skipped("the GPU half of the NCCL launch test", &e.to_string())
                    }
                    Err(e) => panic!("NCCL on GPU 0 failed: {e}"),
                }
            }
        }
    }
}
