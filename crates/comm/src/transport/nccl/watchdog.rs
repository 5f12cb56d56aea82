//! Ending a rank's NCCL calls when they cannot finish: another rank of the process failed, NCCL
//! reports a failed peer, or the engine's timeout passed.
//!
//! NCCL blocks: a rank whose peer died waits inside the collective (or in the wait for its
//! stream) for ever. Each rank's engine has a [`Watchdog`]: every NCCL call and wait runs under
//! a [`Guard`] holding the communicator it uses; a monitor thread aborts that communicator
//! (`ncclCommAbort`, which NCCL allows from another thread to end a blocked call) when the
//! guard's deadline passes or a [`FailureSignal`] shared by the process's ranks is raised, and
//! the call then fails with that reason. Waits poll ([`wait`]) rather than block, so NCCL's
//! asynchronous error (a peer process that aborted or vanished) ends them too. A rank that
//! fails aborts its own communicators, which is what its peers in other processes see.
//!
//! Pure (std only) and compiled without the `nccl` feature: the tests drive it with fakes.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How often the monitor looks at deadlines and the failure signal.
const MONITOR_PERIOD: Duration = Duration::from_millis(20);
/// The longest sleep between two polls of work in flight.
const MAX_POLL_SLEEP: Duration = Duration::from_millis(1);

/// Something the watchdog can abort: a communicator.
pub trait Abort: Send + Sync {
    /// Ends every call on it, now or in flight; it cannot be used afterwards.
    fn abort(&self);
}

/// Work issued and not known to be done.
pub trait InFlight {
    /// `Ok(true)` once done, `Ok(false)` while running, `Err` with NCCL's or CUDA's message
    /// when it failed.
    fn poll(&self) -> Result<bool, String>;
}

/// Why a guarded call or wait stopped short.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Stopped {
    /// Another rank of this process failed first.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// The global rank that failed.
        rank: usize,
        /// Its error.
        message: String,
    },
    /// The call did not finish within the engine's timeout.
    #[error(
        "{what} did not finish within {timeout:?}: a rank is missing, has failed, or the ranks \
         issued different calls (run with BURN_PARALLEL_NCCL_CHECK=every-call to check every \
         call's agreement; BURN_PARALLEL_TIMEOUT_SECS sets the timeout)"
    )]
    TimedOut {
        /// The call.
        what: String,
        /// The timeout.
        timeout: Duration,
    },
    /// NCCL or CUDA reported a failure while the work ran (a peer that aborted or vanished).
    #[error("{0}")]
    Failed(String),
}

/// The first failure among the ranks of one process, shared by their engines.
#[derive(Debug, Clone, Default)]
pub struct FailureSignal(Arc<Mutex<Option<(usize, String)>>>);

impl FailureSignal {
    /// Records that `rank` failed with `message` (the first failure is kept).
    pub fn raise(&self, rank: usize, message: &str) {
        let mut first = self.0.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert_with(|| (rank, message.to_string()));
    }

    /// The first failure raised, if any.
    pub fn raised(&self) -> Option<(usize, String)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

struct Watched {
    id: u64,
    what: String,
    deadline: Instant,
    target: Arc<dyn Abort>,
    stopped: Option<Stopped>,
}

#[derive(Default)]
struct Registry {
    next_id: u64,
    watched: Vec<Watched>,
}

struct Shared {
    timeout: Duration,
    signal: FailureSignal,
    registry: Mutex<Registry>,
}

impl Shared {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One look: aborts what is past its deadline or, once a failure is raised, everything.
    fn check(&self, now: Instant) {
        let failure = self.signal.raised();
        for w in self.registry().watched.iter_mut() {
            if w.stopped.is_some() {
                continue;
            }
            let reason = match &failure {
                Some((rank, message)) => Stopped::PeerFailed {
                    rank: *rank,
                    message: message.clone(),
                },
                None if now >= w.deadline => Stopped::TimedOut {
                    what: w.what.clone(),
                    timeout: self.timeout,
                },
                None => continue,
            };
            w.stopped = Some(reason);
            w.target.abort();
        }
    }
}

/// One rank's watchdog: a monitor thread over the calls under its guards.
pub struct Watchdog {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Watchdog(timeout {:?})", self.shared.timeout)
    }
}

impl Watchdog {
    /// A watchdog that aborts guarded calls after `timeout`, or at once when `signal` is
    /// raised. Its monitor thread ends when the watchdog is dropped.
    pub fn new(timeout: Duration, signal: FailureSignal) -> Self {
        let shared = Arc::new(Shared {
            timeout,
            signal,
            registry: Mutex::default(),
        });
        let weak: Weak<Shared> = Arc::downgrade(&shared);
        std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || {
                while let Some(shared) = weak.upgrade() {
                    shared.check(Instant::now());
                    drop(shared);
                    std::thread::sleep(MONITOR_PERIOD);
                }
            })
            .expect("spawning the NCCL watchdog thread");
        Self { shared }
    }

    /// Guards a call named `what` on `target` until the guard drops; a failure already raised
    /// stops it before it starts.
    pub fn guard(&self, what: impl Into<String>, target: Arc<dyn Abort>) -> Result<Guard, Stopped> {
        if let Some((rank, message)) = self.shared.signal.raised() {
            return Err(Stopped::PeerFailed { rank, message });
        }
        let mut registry = self.shared.registry();
        let id = registry.next_id;
        registry.next_id += 1;
        registry.watched.push(Watched {
            id,
            what: what.into(),
            deadline: Instant::now() + self.shared.timeout,
            target,
            stopped: None,
        });
        Ok(Guard {
            shared: self.shared.clone(),
            id,
        })
    }
}

/// A call under watch; dropping it ends the watch.
pub struct Guard {
    shared: Arc<Shared>,
    id: u64,
}

impl Guard {
    /// Why the watchdog stopped the call, if it did (the call's own error is then only its
    /// consequence).
    pub fn stopped(&self) -> Option<Stopped> {
        self.shared
            .registry()
            .watched
            .iter()
            .find(|w| w.id == self.id)
            .and_then(|w| w.stopped.clone())
    }

    /// The watchdog's reason if it stopped the call, else `error`.
    pub fn explain(&self, error: String) -> Stopped {
        self.stopped().unwrap_or(Stopped::Failed(error))
    }

    /// Aborts the guarded target (this rank found a failure itself).
    fn abort_with(&self, reason: Stopped) {
        let mut registry = self.shared.registry();
        if let Some(w) = registry.watched.iter_mut().find(|w| w.id == self.id)
            && w.stopped.is_none()
        {
            w.stopped = Some(reason);
            w.target.abort();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.shared.registry().watched.retain(|w| w.id != self.id);
    }
}

/// Waits for `work` under `guard`: done, or the reason it never will be (the work's own
/// failure aborts the guarded communicator, so peers in other processes see it too).
pub fn wait(work: &dyn InFlight, guard: &Guard) -> Result<(), Stopped> {
    let mut sleep = Duration::from_micros(10);
    loop {
        if let Some(reason) = guard.stopped() {
            return Err(reason);
        }
        match work.poll() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(message) => {
                let reason = Stopped::Failed(message);
                guard.abort_with(reason.clone());
                return Err(guard.stopped().unwrap_or(reason));
            }
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(MAX_POLL_SLEEP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Condvar;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A communicator whose blocking call returns only once aborted, like NCCL's.
    #[derive(Default)]
    struct FakeComm {
        aborted: Mutex<bool>,
        woken: Condvar,
        aborts: AtomicUsize,
    }

    impl Abort for FakeComm {
        fn abort(&self) {
            self.aborts.fetch_add(1, Ordering::SeqCst);
            *self.aborted.lock().unwrap() = true;
            self.woken.notify_all();
        }
    }

    impl FakeComm {
        /// A collective whose peer never arrives: returns NCCL's error once aborted.
        fn blocking_call(&self) -> Result<(), String> {
            let mut aborted = self.aborted.lock().unwrap();
            while !*aborted {
                aborted = self.woken.wait(aborted).unwrap();
            }
            Err("ncclInternalError: communicator aborted".into())
        }
    }

    impl InFlight for FakeComm {
        fn poll(&self) -> Result<bool, String> {
            Ok(false)
        }
    }

    #[test]
    fn one_ranks_failure_ends_the_others_blocked_calls_with_its_message() {
        // Three ranks of one process: ranks 0 and 2 block in a collective rank 1 never joins;
        // rank 1 fails and raises the signal; both others end with rank 1's message.
        let signal = FailureSignal::default();
        let long = Duration::from_secs(600);
        let results: Vec<Result<(), Stopped>> = std::thread::scope(|s| {
            let handles: Vec<_> = [0, 2]
                .into_iter()
                .map(|_| {
                    let dog = Watchdog::new(long, signal.clone());
                    s.spawn(move || {
                        let comm = Arc::new(FakeComm::default());
                        let guard = dog.guard("all_gather on dp", comm.clone())?;
                        let e = comm.blocking_call().unwrap_err();
                        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
                        Err(guard.explain(e))
                    })
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            signal.raise(1, "out of memory in layer 3");
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(
                r.unwrap_err(),
                Stopped::PeerFailed {
                    rank: 1,
                    message: "out of memory in layer 3".into()
                }
            );
        }
        // A rank that starts a call after the failure does not enter it.
        let dog = Watchdog::new(long, signal);
        let e = dog
            .guard("all_reduce", Arc::new(FakeComm::default()))
            .err()
            .unwrap();
        assert!(matches!(e, Stopped::PeerFailed { rank: 1, .. }));
    }

    #[test]
    fn a_call_past_the_timeout_is_aborted_with_the_reason() {
        let dog = Watchdog::new(Duration::from_millis(100), FailureSignal::default());
        let comm = Arc::new(FakeComm::default());
        let started = Instant::now();
        let guard = dog.guard("reduce_scatter on tp", comm.clone()).unwrap();
        let e = guard.explain(comm.blocking_call().unwrap_err());
        assert!(started.elapsed() < Duration::from_secs(5));
        let text = e.to_string();
        assert!(
            text.contains("reduce_scatter on tp") && text.contains("every-call"),
            "{text}"
        );
        // Waiting on work that never finishes ends the same way.
        let guard = dog.guard("all_to_all on ep", comm.clone()).unwrap();
        assert!(matches!(
            wait(comm.as_ref(), &guard),
            Err(Stopped::TimedOut { .. })
        ));
    }

    #[test]
    fn a_failure_reported_while_waiting_aborts_the_communicator() {
        struct Failing(AtomicBool);
        impl InFlight for Failing {
            fn poll(&self) -> Result<bool, String> {
                if self.0.swap(true, Ordering::SeqCst) {
                    Err("ncclRemoteError: a peer aborted".into())
                } else {
                    Ok(false)
                }
            }
        }
        let dog = Watchdog::new(Duration::from_secs(600), FailureSignal::default());
        let comm = Arc::new(FakeComm::default());
        let guard = dog.guard("all_gather", comm.clone()).unwrap();
        let e = wait(&Failing(AtomicBool::new(false)), &guard).unwrap_err();
        assert_eq!(e, Stopped::Failed("ncclRemoteError: a peer aborted".into()));
        assert_eq!(comm.aborts.load(Ordering::SeqCst), 1);
        // Finished work is not aborted.
        struct Done;
        impl InFlight for Done {
            fn poll(&self) -> Result<bool, String> {
                Ok(true)
            }
        }
        let other = Arc::new(FakeComm::default());
        let guard = dog.guard("all_gather", other.clone()).unwrap();
        assert_eq!(wait(&Done, &guard), Ok(()));
        drop(guard);
        std::thread::sleep(MONITOR_PERIOD * 3);
        assert_eq!(other.aborts.load(Ordering::SeqCst), 0);
    }
}
