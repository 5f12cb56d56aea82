//! The threads engine's `Engine` and `Communicator`: a rank's handles on the shared world.

use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use crate::transport::collective::{
    Collective, CollectiveHandle, CollectiveOutput, CollectiveResult, Communicator, GroupInfo,
    OpKind,
};
use crate::transport::engine::{Engine, group_info};
use crate::transport::error::CollectiveError;
use crate::transport::stats::CommStats;
use crate::transport::traffic::CallBytes;

use super::compute::output;
use super::group::Member;
use super::state::GroupShared;
use super::state::lock;
use super::world::World;

#[derive(Debug)]
pub(crate) struct ThreadEngine {
    pub world: Arc<World>,
    pub rank: usize,
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "World({} ranks)", self.size)
    }
}

impl Engine for ThreadEngine {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    fn new_group(
        &self,
        label: &str,
        ranks: &[usize],
    ) -> Result<Arc<dyn Communicator>, CollectiveError> {
        Ok(Arc::new(ThreadCommunicator {
            world: self.world.clone(),
            shared: self.world.group(label, ranks),
            info: group_info(label, ranks, self.rank),
        }))
    }

    fn stats(&self) -> CommStats {
        lock(&self.world.rank_stats[self.rank]).clone()
    }
}

pub(crate) struct ThreadCommunicator {
    world: Arc<World>,
    shared: Arc<GroupShared>,
    info: GroupInfo,
}

impl std::fmt::Debug for ThreadCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadCommunicator({})", self.info.label)
    }
}

/// What is left of a call after it took its place: enough to finish it on any thread.
enum Issued {
    Slot(u64, OpKind),
    Recv(usize),
    Done,
}

impl ThreadCommunicator {
    /// This rank's member of the group; `blocking` when the caller's thread is the rank's
    /// issuing thread, waiting for the call to finish (see [`Member::blocking`]).
    fn member(&self, blocking: bool) -> Member<'_> {
        Member {
            world: &self.world,
            group: &self.shared,
            info: &self.info,
            blocking,
        }
    }

    /// Takes the call's place in the group's order (never blocks on other ranks).
    fn issue(&self, call: Collective) -> Result<Issued, CollectiveError> {
        let member = self.member(true);
        match call {
            Collective::Send { data, dst } => {
                member.post(dst, data);
                Ok(Issued::Done)
            }
            Collective::Recv { src } => Ok(Issued::Recv(src)),
            call => {
                let kind = call.kind();
                member.deposit(call).map(|seq| Issued::Slot(seq, kind))
            }
        }
    }

    /// Waits for the other ranks and builds this rank's output; `blocking` as in
    /// [`Self::member`].
    fn finish(&self, issued: Issued, blocking: bool) -> CollectiveResult {
        let member = self.member(blocking);
        match issued {
            Issued::Done => Ok(CollectiveOutput::none()),
            Issued::Recv(src) => member.take(src).map(CollectiveOutput::tensor),
            Issued::Slot(seq, kind) => {
                let deposits = member.wait_deposits(seq, kind);
                let result = deposits.and_then(|d| output(&member, seq, &d));
                member.release(seq);
                result
            }
        }
    }

    fn record(&self, bytes: CallBytes, result: &CollectiveResult, took: Duration) {
        if let Ok(out) = result {
            let produced = out
                .data
                .as_ref()
                .map_or(0, |d: &TensorData| d.as_bytes().len());
            let (sent, received) = bytes.traffic(produced);
            let kind = bytes.kind();
            lock(&self.shared.stats[self.info.index]).record(kind, sent, received, took);
            lock(&self.world.rank_stats[self.info.ranks[self.info.index]])
                .record(kind, sent, received, took);
        }
    }
}

impl Communicator for ThreadCommunicator {
    fn info(&self) -> &GroupInfo {
        &self.info
    }

    fn record_wait(&self, kind: OpKind, waited: Duration) {
        lock(&self.shared.stats[self.info.index]).record_wait(kind, waited);
        lock(&self.world.rank_stats[self.info.ranks[self.info.index]]).record_wait(kind, waited);
    }

    fn run(&self, call: Collective) -> CollectiveResult {
        let bytes = CallBytes::of(&call, &self.info);
        let started = Instant::now();
        let result = self.issue(call).and_then(|i| self.finish(i, true));
        self.record(bytes, &result, started.elapsed());
        result
    }

    fn start(&self, call: Collective) -> CollectiveHandle {
        let bytes = CallBytes::of(&call, &self.info);
        let started = Instant::now();
        let kind = call.kind();
        let label = self.info.label.clone();
        let issued = match self.issue(call) {
            Ok(i) => i,
            Err(e) => return CollectiveHandle::ready(kind, label, Err(e)),
        };
        let this = ThreadCommunicator {
            world: self.world.clone(),
            shared: self.shared.clone(),
            info: self.info.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("{kind}-{}", self.info.label))
            .spawn(move || {
                let result = this.finish(issued, false);
                this.record(bytes, &result, started.elapsed());
                result
            })
            .expect("spawning a collective thread");
        CollectiveHandle::running(kind, label, thread)
    }

    fn stats(&self) -> CommStats {
        lock(&self.shared.stats[self.info.index]).clone()
    }
}
