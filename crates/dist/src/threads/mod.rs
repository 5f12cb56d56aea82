//! The `threads` engine: ranks are threads of one process that exchange tensors through shared
//! memory. Deterministic (reductions run in rank order) and never silently stuck: a rank that
//! fails stops the others at their next collective, and a wait past the timeout is an error
//! that names the missing ranks.

mod compute;
mod engine;
mod group;
mod world;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::engine::RankContext;
use crate::error::{LaunchError, RankFailure};

use engine::ThreadEngine;
use world::{World, lock};

/// Environment variable that overrides the default collective timeout, in seconds.
pub const TIMEOUT_ENV: &str = "BURN_PARALLEL_TIMEOUT_SECS";

/// The default time a rank waits for the others in one collective.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// Stack size of each rank thread: deep autodiff graphs recurse in backward.
const RANK_STACK_BYTES: usize = 64 << 20;

/// Runs `world_size` ranks as threads. Configure with the builder methods, then `run`.
#[derive(Debug, Clone)]
pub struct Launcher {
    world_size: usize,
    timeout: Duration,
}

impl Launcher {
    pub fn new(world_size: usize) -> Self {
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Self {
            world_size,
            timeout,
        }
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
        let world = Arc::new(World::new(self.world_size, self.timeout));
        let failures = Mutex::new(Vec::new());
        let results: Vec<Option<T>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..self.world_size)
                .map(|rank| {
                    let world = world.clone();
                    let f = &f;
                    let failures = &failures;
                    std::thread::Builder::new()
                        .name(format!("rank-{rank}"))
                        .stack_size(RANK_STACK_BYTES)
                        .spawn_scoped(scope, move || {
                            let engine = Arc::new(ThreadEngine {
                                world: world.clone(),
                                rank,
                            });
                            let ctx = RankContext::new(engine);
                            let outcome = catch_unwind(AssertUnwindSafe(|| f(ctx)));
                            let failure = match outcome {
                                Ok(Ok(value)) => {
                                    world.exit(rank);
                                    return Some(value);
                                }
                                Ok(Err(e)) => (e.to_string(), false),
                                Err(payload) => (panic_message(payload.as_ref()), true),
                            };
                            world.fail(rank, failure.0.clone());
                            lock(failures).push(RankFailure {
                                rank,
                                message: failure.0,
                                panicked: failure.1,
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
        if let Some((first, _)) = world.failure() {
            // The root cause first; the others usually report being aborted by it.
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

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".into()
    }
}
