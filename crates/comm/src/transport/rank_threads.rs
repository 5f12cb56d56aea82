//! Ranks as threads of one process: the one routine that runs a closure per rank thread and
//! collects results or failures, for every engine that runs ranks that way (threads, and NCCL
//! with one thread per GPU), and the text of a rank's panic (also what MPI reports).

use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

use crate::transport::compute_threads::run_in_pool;
use crate::transport::engine::RankContext;
use crate::transport::error::{LaunchError, RankFailure};

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".into()
    }
}

/// How [`run_on_threads`] starts each rank and tells its engine how the rank ended.
pub(crate) trait RankThreads: Sync {
    /// The context of `rank`, built on the rank's own thread.
    fn context(&self, rank: usize) -> RankContext;

    /// Called on the rank's thread when it ends: `None` when it returned a value, else its
    /// failure (the engine releases or aborts the other ranks).
    fn finished(&self, rank: usize, failure: Option<&str>);

    /// The rank whose failure came first (listed first), when the engine knows it.
    fn root_cause(&self) -> Option<usize> {
        None
    }
}

/// Stack of a rank thread: Burn's backward recurses through the graph.
pub(crate) const RANK_STACK_BYTES: usize = 64 << 20;

/// Runs `f` on one scoped thread per rank, each inside its own pool of `threads_per_rank`
/// compute threads, and returns the ranks' results in rank order, or every failure: an error
/// returned or a panic, the root cause first. The one failure-collection routine of every
/// engine that runs ranks as threads.
pub(crate) fn run_on_threads<T, E, F>(
    world_size: usize,
    threads_per_rank: usize,
    ranks: &impl RankThreads,
    f: &F,
) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    let failures = Mutex::new(Vec::new());
    let results: Vec<Option<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let failures = &failures;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .stack_size(RANK_STACK_BYTES)
                    .spawn_scoped(scope, move || {
                        let outcome = catch_unwind(AssertUnwindSafe(|| {
                            run_in_pool(rank, threads_per_rank, RANK_STACK_BYTES, || {
                                f(ranks.context(rank)).map_err(|e| e.to_string())
                            })
                        }));
                        let (message, panicked) = match outcome {
                            Ok(Ok(Ok(value))) => {
                                ranks.finished(rank, None);
                                return Some(value);
                            }
                            Ok(Ok(Err(message))) | Ok(Err(message)) => (message, false),
                            Err(payload) => (panic_message(payload.as_ref()), true),
                        };
                        ranks.finished(rank, Some(&message));
                        failures
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(RankFailure {
                                rank,
                                message,
                                panicked,
                            });
                        None
                    })
                    .expect("spawning a rank thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank threads catch their panics"))
            .collect()
    });
    let mut failures = failures.into_inner().unwrap_or_else(|e| e.into_inner());
    if let Some(first) = ranks.root_cause() {
        failures.sort_by_key(|f| f.rank != first);
    }
    if !failures.is_empty() {
        return Err(LaunchError { failures });
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("no failure"))
        .collect())
}
