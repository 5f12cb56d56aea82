//! Ending a rank's NCCL calls when they cannot finish: another rank of the process failed, NCCL
//! reports a failed peer, or the engine's timeout passed.
//!
//! NCCL blocks: a rank whose peer died waits for ever. So the engine's communicators are
//! non-blocking (`ncclCommInitRankConfig` with `blocking = 0`): every NCCL call returns at once,
//! possibly with `ncclInProgress`, and the rank's own thread polls it ([`wait`]) under a
//! [`Guard`] of its [`Watchdog`]. The monitor thread never touches NCCL: it only marks a guarded
//! call stopped when its deadline passes or a [`FailureSignal`] shared by the process's ranks
//! is raised. The owning thread sees the mark at its next poll and aborts the communicator
//! itself (`ncclCommAbort`), outside NCCL and outside the registry's lock, as NCCL requires
//! (no thread may be inside NCCL on a communicator being aborted). Polls also read NCCL's
//! asynchronous error (a peer process that aborted or vanished) and CUDA's, which abort the
//! same way. A rank that fails aborts its own communicators, which is what its peers in other
//! processes see.
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
    /// Ends every call on it; it cannot be used afterwards. Called only by the thread that owns
    /// it, never while that thread is inside NCCL.
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
    /// Whether the owner has aborted the target for this call (once is enough).
    aborted: bool,
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

    /// One look of the monitor: marks what is past its deadline or, once a failure is raised,
    /// everything. It aborts nothing: the owners do, when they next poll.
    fn check(&self, now: Instant) {
        let failure = self.signal.raised();
        for w in self.registry().watched.iter_mut() {
            if w.stopped.is_some() {
                continue;
            }
            w.stopped = match &failure {
                Some((rank, message)) => Some(Stopped::PeerFailed {
                    rank: *rank,
                    message: message.clone(),
                }),
                None if now >= w.deadline => Some(Stopped::TimedOut {
                    what: w.what.clone(),
                    timeout: self.timeout,
                }),
                None => continue,
            };
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
    /// A watchdog that stops guarded calls after `timeout`, or at once when `signal` is
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
            aborted: false,
        });
        Ok(Guard {
            watch: Watch {
                shared: self.shared.clone(),
                id,
            },
        })
    }
}

/// A handle on one guarded call, for code that polls it (a communicator keeps the current
/// call's watch while the call runs). Cloning it does not extend the guard.
#[derive(Clone)]
pub struct Watch {
    shared: Arc<Shared>,
    id: u64,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Watch({})", self.id)
    }
}

impl Watch {
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

    /// Marks the call stopped for `reason` (unless it already was) and aborts its target, on
    /// the calling thread: the owner's, outside NCCL. Returns the reason that stands.
    pub fn stop_and_abort(&self, reason: Stopped) -> Stopped {
        let (target, reason) = {
            let mut registry = self.shared.registry();
            let Some(w) = registry.watched.iter_mut().find(|w| w.id == self.id) else {
                return reason;
            };
            let reason = w.stopped.get_or_insert(reason).clone();
            let target = (!w.aborted).then(|| w.target.clone());
            w.aborted = true;
            (target, reason)
        };
        // Outside the lock: an abort may take long (NCCL joins its proxy thread), and the
        // monitor must keep watching the other calls meanwhile.
        if let Some(target) = target {
            target.abort();
        }
        reason
    }

    /// If the watchdog stopped the call, aborts its target here (the owner's thread) and
    /// returns the reason.
    pub fn abort_if_stopped(&self) -> Option<Stopped> {
        let reason = self.stopped()?;
        Some(self.stop_and_abort(reason))
    }
}

/// A call under watch; dropping it ends the watch. Dereferences to its [`Watch`].
pub struct Guard {
    watch: Watch,
}

impl Guard {
    /// A handle on this call for the code that polls it.
    pub fn watch(&self) -> &Watch {
        &self.watch
    }
}

impl std::ops::Deref for Guard {
    type Target = Watch;
    fn deref(&self) -> &Watch {
        &self.watch
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let id = self.watch.id;
        self.watch.shared.registry().watched.retain(|w| w.id != id);
    }
}

/// Waits for `work` under `watch`, polling from the calling thread (the owner of the guarded
/// communicator): done, or the reason it never will be. When the watchdog stopped the call,
/// or the work failed, the owner aborts the communicator before returning, so that peers in
/// other processes see the failure too.
pub fn wait(work: &dyn InFlight, watch: &Watch) -> Result<(), Stopped> {
    let mut sleep = Duration::from_micros(10);
    loop {
        if let Some(reason) = watch.abort_if_stopped() {
            return Err(reason);
        }
        match work.poll() {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(message) => return Err(watch.stop_and_abort(Stopped::Failed(message))),
        }
        std::thread::sleep(sleep);
        sleep = (sleep * 2).min(MAX_POLL_SLEEP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::thread::ThreadId;

    /// A non-blocking communicator like NCCL's with `blocking = 0`: its call stays in progress
    /// until a peer arrives (never, here) or it is aborted. It records who aborted it and
    /// whether a thread was inside it (polling) at that moment, which NCCL forbids.
    #[derive(Default)]
    struct FakeComm {
        inside: AtomicUsize,
        aborted: AtomicBool,
        aborts: Mutex<Vec<(ThreadId, bool)>>,
    }

    impl Abort for FakeComm {
        fn abort(&self) {
            let inside = self.inside.load(Ordering::SeqCst) > 0;
            self.aborts
                .lock()
                .unwrap()
                .push((std::thread::current().id(), inside));
            self.aborted.store(true, Ordering::SeqCst);
        }
    }

    impl InFlight for FakeComm {
        /// `ncclCommGetAsyncError`: in progress until aborted, then NCCL's error. Stays
        /// "inside" for a while, so an abort from another thread would likely land there.
        fn poll(&self) -> Result<bool, String> {
            self.inside.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(300));
            self.inside.fetch_sub(1, Ordering::SeqCst);
            if self.aborted.load(Ordering::SeqCst) {
                return Err("ncclInternalError: communicator aborted".into());
            }
            Ok(false)
        }
    }

    impl FakeComm {
        fn aborts(&self) -> Vec<(ThreadId, bool)> {
            self.aborts.lock().unwrap().clone()
        }

        /// Aborted exactly once, by `owner`, with nobody inside.
        fn assert_aborted_by(&self, owner: ThreadId) {
            assert_eq!(self.aborts(), vec![(owner, false)]);
        }
    }

    #[test]
    fn one_ranks_failure_ends_the_others_calls_with_its_message() {
        // Three ranks of one process: ranks 0 and 2 wait in a collective rank 1 never joins;
        // rank 1 fails and raises the signal; both others end with rank 1's message, each
        // having aborted its own communicator.
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
                        let r = wait(comm.as_ref(), &guard);
                        comm.assert_aborted_by(std::thread::current().id());
                        r
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

    /// The abort discipline: the monitor only marks the call; the owner, between two polls,
    /// aborts. Before, the monitor thread aborted while the owner could be inside NCCL.
    #[test]
    fn the_owner_aborts_a_call_past_the_timeout_never_the_monitor() {
        let dog = Watchdog::new(Duration::from_millis(100), FailureSignal::default());
        let comm = Arc::new(FakeComm::default());
        let started = Instant::now();
        let guard = dog.guard("reduce_scatter on tp", comm.clone()).unwrap();
        let e = wait(comm.as_ref(), &guard).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(5));
        let text = e.to_string();
        assert!(
            text.contains("reduce_scatter on tp") && text.contains("every-call"),
            "{text}"
        );
        comm.assert_aborted_by(std::thread::current().id());
        // Marked but not yet polled: nothing is aborted until the owner looks.
        let other = Arc::new(FakeComm::default());
        let guard = dog.guard("all_to_all on ep", other.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(100) + MONITOR_PERIOD * 5);
        assert!(matches!(guard.stopped(), Some(Stopped::TimedOut { .. })));
        assert!(other.aborts().is_empty(), "the monitor aborted");
        assert!(matches!(
            guard.abort_if_stopped(),
            Some(Stopped::TimedOut { .. })
        ));
        other.assert_aborted_by(std::thread::current().id());
        // A second look does not abort again.
        assert!(guard.abort_if_stopped().is_some());
        assert_eq!(other.aborts().len(), 1);
    }

    /// The abort runs outside the registry's lock: a slow abort (NCCL joins its proxy thread)
    /// does not hold up the monitor's marking of another rank's call.
    #[test]
    fn a_slow_abort_does_not_block_the_monitor() {
        struct Slow;
        impl Abort for Slow {
            fn abort(&self) {
                std::thread::sleep(Duration::from_millis(400));
            }
        }
        let dog = Arc::new(Watchdog::new(
            Duration::from_millis(50),
            FailureSignal::default(),
        ));
        let slow = dog.guard("split", Arc::new(Slow)).unwrap();
        let fast_comm = Arc::new(FakeComm::default());
        let fast = dog.guard("all_gather", fast_comm.clone()).unwrap();
        std::thread::sleep(Duration::from_millis(50) + MONITOR_PERIOD * 3);
        let aborter = std::thread::spawn(move || slow.abort_if_stopped());
        std::thread::sleep(Duration::from_millis(20));
        let started = Instant::now();
        assert!(fast.stopped().is_some());
        assert!(started.elapsed() < Duration::from_millis(200));
        assert!(aborter.join().unwrap().is_some());
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
        comm.assert_aborted_by(std::thread::current().id());
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
        assert!(other.aborts().is_empty());
    }
}
