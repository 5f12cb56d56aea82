//! The `threads` engine: ranks are threads of one process that exchange tensors through shared
//! memory. Deterministic (reductions run in rank order) and never silently stuck: a rank that
//! fails stops the others at their next collective, ranks that wait for each other in calls of
//! different groups (collectives issued in different orders) end with an error naming every
//! rank's call about a second later (`waits`), and a wait past the timeout is an error that
//! names the missing ranks.

mod compute;
mod engine;
mod group;
mod state;
#[cfg(test)]
mod tests;
mod waits;
mod world;

use std::sync::Arc;
use std::time::Duration;

use crate::transport::compute_threads::threads_per_rank;
use crate::transport::engine::RankContext;
use crate::transport::error::{LaunchError, RankFailure};
use crate::transport::rank_threads::{RankThreads, run_on_threads};

use engine::ThreadEngine;
use world::World;

pub use crate::transport::timeout::{DEFAULT_TIMEOUT, TIMEOUT_ENV};

/// Runs `world_size` ranks as threads. Configure with the builder methods, then `run`.
#[derive(Debug, Clone)]
pub struct Launcher {
    world_size: usize,
    timeout: Duration,
    threads_per_rank: Option<usize>,
}

impl Launcher {
    /// A launcher of `world_size` ranks, waiting [`TIMEOUT_ENV`] seconds when set, else [`DEFAULT_TIMEOUT`].
    pub fn new(world_size: usize) -> Self {
        Self {
            world_size,
            timeout: crate::transport::timeout::from_env(),
            threads_per_rank: None,
        }
    }

    /// The compute threads each rank's kernels use (default: [`crate::THREADS_PER_RANK_ENV`] when
    /// set, else the cores divided by the ranks; see [`crate::threads_per_rank`]).
    pub fn threads_per_rank(mut self, threads: usize) -> Self {
        self.threads_per_rank = Some(threads);
        self
    }

    /// How long a rank waits for the others in one collective before giving up.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs `f` on every rank and returns the ranks' results in rank order, or every failure,
    /// the first one first. A rank that returns an error or panics makes the others' pending
    /// and later collectives fail.
    pub fn run<T, E, F>(&self, f: F) -> Result<Vec<T>, LaunchError>
    where
        T: Send,
        E: std::fmt::Display,
        F: Fn(RankContext) -> Result<T, E> + Sync,
    {
        if self.world_size == 0 {
            return Err(LaunchError {
                failures: vec![RankFailure {
                    rank: 0,
                    message: "world size must be at least 1".into(),
                    panicked: false,
                }],
            });
        }
        let threads =
            threads_per_rank(self.threads_per_rank, self.world_size).map_err(|message| {
                LaunchError {
                    failures: vec![RankFailure {
                        rank: 0,
                        message,
                        panicked: false,
                    }],
                }
            })?;
        let world = Arc::new(World::new(self.world_size, self.timeout));
        run_on_threads(self.world_size, threads, &ThreadRanks(world), &f)
    }
}

/// The threads engine's ranks: each a `ThreadEngine` on the shared world, which learns how
/// each rank ended.
struct ThreadRanks(Arc<World>);

impl RankThreads for ThreadRanks {
    fn context(&self, rank: usize) -> RankContext {
        RankContext::new(Arc::new(ThreadEngine {
            world: self.0.clone(),
            rank,
        }))
    }

    fn finished(&self, rank: usize, failure: Option<&str>) {
        match failure {
            None => self.0.exit(rank),
            Some(message) => self.0.fail(rank, message.to_string()),
        }
    }

    fn root_cause(&self) -> Option<usize> {
        self.0.failure().map(|(first, _)| first)
    }
}

/// Runs `world_size` ranks as threads with the default settings. See [`Launcher::run`].
pub fn launch<T, E, F>(world_size: usize, f: F) -> Result<Vec<T>, LaunchError>
where
    T: Send,
    E: std::fmt::Display,
    F: Fn(RankContext) -> Result<T, E> + Sync,
{
    Launcher::new(world_size).run(f)
}
