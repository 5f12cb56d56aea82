//! Communication counters: calls and bytes per op, per rank and per group, so that tests and
//! benchmarks can check communication volume exactly.
//!
//! Bytes follow a direct-exchange model, independent of the algorithm an engine uses:
//! a rank "sends" each byte of its input that another rank's output needs, once per receiving
//! rank, and "receives" each byte of its output that came from another rank.
//! - all_gather: sent = own bytes x (n - 1); received = output bytes - own bytes.
//! - reduce_scatter: sent = input bytes - own slice bytes; received = own slice bytes x (n - 1).
//! - all_reduce: reduce_scatter of the pad-to-ceil chunks followed by all_gather of them.
//! - broadcast: root sends bytes x (n - 1); every other rank receives bytes.
//! - all_to_all: sent = bytes of the slices for other ranks; received = bytes from others.
//! - send / recv: the message bytes. barrier: 0.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::AddAssign;
use std::time::Duration;

/// The kinds of operation, as counted in [`CommStats`].
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub enum OpKind {
    /// Every rank gets the reduction of every rank's tensor.
    AllReduce,
    /// Every rank gets the concatenation of every rank's tensor.
    AllGather,
    /// Every rank gets its slice of the reduction.
    ReduceScatter,
    /// Every rank gets the root's tensor.
    Broadcast,
    /// Every rank sends a slice to each rank.
    AllToAll,
    /// A point-to-point send.
    Send,
    /// A point-to-point receive.
    Recv,
    /// A wait for every member.
    Barrier,
}

impl OpKind {
    /// Every kind, in counter order.
    pub const ALL: [OpKind; 8] = [
        OpKind::AllReduce,
        OpKind::AllGather,
        OpKind::ReduceScatter,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Send,
        OpKind::Recv,
        OpKind::Barrier,
    ];

    /// The snake_case name used in messages and summaries.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::AllGather => "all_gather",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Broadcast => "broadcast",
            OpKind::AllToAll => "all_to_all",
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Barrier => "barrier",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Counters for one kind of op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounters {
    /// Calls issued.
    pub calls: u64,
    /// Bytes sent, as the direct-exchange model above counts them.
    pub bytes_sent: u64,
    /// Bytes received, as the direct-exchange model above counts them.
    pub bytes_received: u64,
    /// Time from issue to completion, summed over the calls (as the issuing rank saw it).
    pub time: Duration,
    /// Time the issuing rank was blocked on the calls: the whole call when it ran to
    /// completion, only the wait for its result when it was issued ahead and awaited later (a
    /// prefetch; it can outlast the exchange by the time the waiting thread takes to resume).
    pub waited: Duration,
}

impl AddAssign for OpCounters {
    fn add_assign(&mut self, o: Self) {
        self.calls += o.calls;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.time += o.time;
        self.waited += o.waited;
    }
}

/// Counters for every kind of op.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommStats {
    by_op: [OpCounters; OpKind::ALL.len()],
}

impl CommStats {
    /// Counts one call of `kind`, its bytes and the time it took.
    pub fn record(&mut self, kind: OpKind, bytes_sent: u64, bytes_received: u64, time: Duration) {
        self.by_op[kind.index()] += OpCounters {
            calls: 1,
            bytes_sent,
            bytes_received,
            time,
            waited: Duration::ZERO,
        };
    }

    /// Counts `waited` of this rank's time blocked on a call of `kind` (see
    /// [`OpCounters::waited`]).
    pub fn record_wait(&mut self, kind: OpKind, waited: Duration) {
        self.by_op[kind.index()].waited += waited;
    }

    /// The counters of one kind.
    pub fn op(&self, kind: OpKind) -> OpCounters {
        self.by_op[kind.index()]
    }

    /// Number of calls of `kind`.
    pub fn calls(&self, kind: OpKind) -> u64 {
        self.op(kind).calls
    }

    /// The counters summed over every kind.
    pub fn total(&self) -> OpCounters {
        let mut t = OpCounters::default();
        self.by_op.iter().for_each(|c| t += *c);
        t
    }

    /// Counters of the ops that were called at least once, by name.
    pub fn summary(&self) -> BTreeMap<&'static str, OpCounters> {
        OpKind::ALL
            .iter()
            .filter(|k| self.op(**k).calls > 0)
            .map(|k| (k.name(), self.op(*k)))
            .collect()
    }

    /// The calls and bytes without the times: what two engines running the same calls agree
    /// on.
    pub fn traffic(&self) -> CommStats {
        let mut out = self.clone();
        out.by_op.iter_mut().for_each(|c| {
            c.time = Duration::ZERO;
            c.waited = Duration::ZERO;
        });
        out
    }

    /// What happened since `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = CommStats::default();
        for k in OpKind::ALL {
            let (a, b) = (self.op(k), earlier.op(k));
            out.by_op[k.index()] = OpCounters {
                calls: a.calls - b.calls,
                bytes_sent: a.bytes_sent - b.bytes_sent,
                bytes_received: a.bytes_received - b.bytes_received,
                time: a.time.saturating_sub(b.time),
                waited: a.waited.saturating_sub(b.waited),
            };
        }
        out
    }
}

impl AddAssign<&CommStats> for CommStats {
    fn add_assign(&mut self, o: &CommStats) {
        for (a, b) in self.by_op.iter_mut().zip(&o.by_op) {
            *a += *b;
        }
    }
}
