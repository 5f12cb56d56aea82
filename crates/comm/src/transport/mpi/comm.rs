//! One group as an MPI communicator, with the worker threads that run its calls in order.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mpi::Rank;
use mpi::topology::{Communicator as _, Group as _, SimpleCommunicator};

use crate::transport::collective::{
    Collective, CollectiveHandle, CollectiveResult, Communicator, GroupInfo, OpKind,
};
use crate::transport::error::{CollectiveError, PendingCall};
use crate::transport::stats::CommStats;
use crate::transport::traffic::CallBytes;

use super::lock::lock;
use super::pending::{PendingCalls, await_reply};
use super::roll_call::{RollCall, grace};
use super::shared_comm::Comm;
use super::{ops, p2p};

type Job = Box<dyn FnOnce() + Send>;

/// The worker threads of every group of one process, joined before MPI is finalized.
#[derive(Debug, Default)]
pub(crate) struct WorkerRegistry {
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl WorkerRegistry {
    /// Waits until `deadline` for the workers to stop (they stop when their group is dropped).
    pub fn join(self, deadline: Instant) {
        let threads = self.threads.into_inner().unwrap_or_else(|e| e.into_inner());
        for thread in threads {
            while !thread.is_finished() && Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            if thread.is_finished() {
                let _ = thread.join();
            }
        }
    }
}

/// A thread that runs jobs one at a time, in the order they were queued.
struct Worker {
    queue: mpsc::Sender<Job>,
}

impl Worker {
    fn spawn(name: String, registry: &WorkerRegistry) -> Self {
        let (queue, jobs) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || jobs.into_iter().for_each(|job| job()))
            .expect("spawning an MPI worker thread");
        lock(&registry.threads).push(thread);
        Self { queue }
    }
}

/// What every group of one process shares besides MPI itself.
#[derive(Clone)]
pub(crate) struct Shared {
    /// This process's counters, over all groups.
    pub rank_stats: Arc<Mutex<CommStats>>,
    /// This process's calls not yet complete, over all groups.
    pub pending: Arc<PendingCalls>,
    /// How long a caller waits for a call's result.
    pub timeout: Duration,
    /// Which ranks never reached a collective, asked when a call times out.
    pub roll_call: Arc<RollCall>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shared(timeout {:?})", self.timeout)
    }
}

/// The ranks of `call`'s group that did not answer the roll call (see [`RollCall`]).
fn absent_ranks(roll_call: &RollCall, timeout: Duration, call: &PendingCall) -> Vec<usize> {
    let heard = roll_call.heard(grace(timeout));
    call.ranks
        .iter()
        .filter(|r| !heard.contains(r))
        .copied()
        .collect()
}

/// What the jobs of one group share.
struct GroupState {
    pub info: GroupInfo,
    /// Collectives run here.
    pub comm: Comm,
    /// Point-to-point messages use a duplicate, so they never interfere with collectives.
    pub p2p: Comm,
    /// The next collective's number, taken when it is issued (the worker runs them in order).
    next_seq: AtomicU64,
    /// The error that broke the group, if any.
    broken: Mutex<Option<String>>,
    stats: Mutex<CommStats>,
    rank_stats: Arc<Mutex<CommStats>>,
}

pub(crate) struct MpiCommunicator {
    state: Arc<GroupState>,
    pending: Arc<PendingCalls>,
    timeout: Duration,
    roll_call: Arc<RollCall>,
    collectives: Worker,
    sends: Worker,
    recvs: Worker,
}

impl std::fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiCommunicator({})", self.state.info.label)
    }
}

/// A tag for `MPI_Comm_create_group` that tells apart groups created at the same time.
fn creation_tag(info: &GroupInfo) -> Rank {
    let mut hasher = DefaultHasher::new();
    info.label.hash(&mut hasher);
    info.ranks.hash(&mut hasher);
    // 32767 is the smallest tag upper bound MPI allows.
    (hasher.finish() % 32767) as Rank
}

impl MpiCommunicator {
    /// Creates the group's communicator; only its members take part.
    pub fn new(
        info: GroupInfo,
        shared: &Shared,
        registry: &WorkerRegistry,
    ) -> Result<Self, CollectiveError> {
        let world = SimpleCommunicator::world();
        let members: Vec<Rank> = info.ranks.iter().map(|r| *r as Rank).collect();
        let group = world.group().include(&members);
        let comm = world
            .split_by_subgroup_with_tag(&group, creation_tag(&info))
            .ok_or_else(|| CollectiveError::InvalidArgument {
                op: "new_group".into(),
                group: info.label.clone(),
                message: "MPI did not create the communicator".into(),
            })?;
        let p2p = comm.duplicate();
        let label = info.label.clone();
        let state = Arc::new(GroupState {
            info,
            comm: Comm::new(comm),
            p2p: Comm::new(p2p),
            next_seq: AtomicU64::new(0),
            broken: Mutex::new(None),
            stats: Mutex::new(CommStats::default()),
            rank_stats: shared.rank_stats.clone(),
        });
        Ok(Self {
            state,
            pending: shared.pending.clone(),
            timeout: shared.timeout,
            roll_call: shared.roll_call.clone(),
            collectives: Worker::spawn(format!("mpi-{label}"), registry),
            sends: Worker::spawn(format!("mpi-send-{label}"), registry),
            recvs: Worker::spawn(format!("mpi-recv-{label}"), registry),
        })
    }

    /// Queues the call on its worker, entered as pending until its job ends; the result
    /// arrives on the returned channel.
    fn submit(&self, call: Collective) -> (mpsc::Receiver<CollectiveResult>, PendingCall) {
        let info = &self.state.info;
        let global = |i: &usize| info.ranks.get(*i).map(|r| vec![*r]);
        let (worker, seq, peer) = match &call {
            Collective::Send { dst, .. } => (&self.sends, None, global(dst)),
            Collective::Recv { src } => (&self.recvs, None, global(src)),
            _ => {
                let seq = self.state.next_seq.fetch_add(1, Ordering::Relaxed);
                (&self.collectives, Some(seq), None)
            }
        };
        let pending = PendingCall {
            rank: info.ranks[info.index],
            op: call.kind().name().into(),
            group: info.label.clone(),
            ranks: info.ranks.clone(),
            seq,
            missing: peer,
        };
        let entered = self.pending.enter(pending.clone());
        let (reply, result) = mpsc::channel();
        let state = self.state.clone();
        let job: Job = Box::new(move || {
            let _entered = entered;
            let _ = reply.send(state.execute(call, seq));
        });
        // The worker lives as long as this communicator, so the queue is open.
        let _ = worker.queue.send(job);
        (result, pending)
    }

    fn stopped(&self, kind: OpKind) -> impl FnOnce() -> CollectiveError + Send + 'static {
        let group = self.state.info.label.clone();
        move || CollectiveError::GroupBroken {
            group,
            reason: format!("the MPI worker stopped during a {kind}"),
        }
    }
}

impl GroupState {
    /// Runs one call on the worker thread and records its traffic; `seq` is a collective's
    /// number.
    fn execute(&self, call: Collective, seq: Option<u64>) -> CollectiveResult {
        let kind = call.kind();
        let bytes = CallBytes::of(&call, &self.info);
        let started = std::time::Instant::now();
        let result = match seq {
            None => p2p::execute(&self.p2p, &self.info, call),
            Some(seq) => self.collective(call, seq),
        };
        if let Ok(out) = &result {
            let produced = out.data.as_ref().map_or(0, |d| d.as_bytes().len());
            let (sent, received) = bytes.traffic(produced);
            let took = started.elapsed();
            lock(&self.stats).record(kind, sent, received, took);
            lock(&self.rank_stats).record(kind, sent, received, took);
        }
        result
    }

    /// Runs collective number `seq`; an error that leaves the members out of step (a mismatch,
    /// a panic) breaks the group, as in the threads engine.
    fn collective(&self, call: Collective, seq: u64) -> CollectiveResult {
        let kind = call.kind();
        if let Some(reason) = lock(&self.broken).as_ref() {
            return Err(CollectiveError::GroupBroken {
                group: self.info.label.clone(),
                reason: reason.clone(),
            });
        }
        let break_group = |e: &CollectiveError| *lock(&self.broken) = Some(e.to_string());
        let result = catch_unwind(AssertUnwindSafe(|| {
            ops::execute(&self.comm, &self.info, seq, call, break_group)
        }))
        .unwrap_or_else(|payload| {
            Err(CollectiveError::GroupBroken {
                group: self.info.label.clone(),
                reason: format!(
                    "{kind} panicked: {}",
                    crate::transport::rank_threads::panic_message(payload.as_ref())
                ),
            })
        });
        if let Err(e @ CollectiveError::GroupBroken { .. }) = &result {
            *lock(&self.broken) = Some(e.to_string());
        }
        result
    }
}

impl Communicator for MpiCommunicator {
    fn info(&self) -> &GroupInfo {
        &self.state.info
    }

    /// Waits for the result up to the timeout; then returns [`CollectiveError::Stalled`] with
    /// every call this process has pending (and prints it, see [`await_reply`]).
    fn run(&self, call: Collective) -> CollectiveResult {
        let started = Instant::now();
        let stopped = self.stopped(call.kind());
        let (result, pending) = self.submit(call);
        let (roll_call, timeout) = (&self.roll_call, self.timeout);
        await_reply(
            &result,
            pending,
            started,
            timeout,
            &self.pending,
            stopped,
            |call| absent_ranks(roll_call, timeout, call),
        )
    }

    /// As `run`, on a thread of its own: the handle's result is the same, timeout included.
    fn start(&self, call: Collective) -> CollectiveHandle {
        let started = Instant::now();
        let kind = call.kind();
        let stopped = self.stopped(kind);
        let (result, pending) = self.submit(call);
        let (timeout, calls) = (self.timeout, self.pending.clone());
        let roll_call = self.roll_call.clone();
        let absent = move |call: &PendingCall| absent_ranks(&roll_call, timeout, call);
        let waiter = std::thread::Builder::new()
            .name(format!("{kind}-{}", self.state.info.label))
            .spawn(move || await_reply(&result, pending, started, timeout, &calls, stopped, absent))
            .expect("spawning a collective thread");
        CollectiveHandle::running(kind, self.state.info.label.clone(), waiter)
    }

    fn stats(&self) -> CommStats {
        lock(&self.state.stats).clone()
    }

    fn record_wait(&self, kind: OpKind, waited: std::time::Duration) {
        lock(&self.state.stats).record_wait(kind, waited);
        lock(&self.state.rank_stats).record_wait(kind, waited);
    }
}
