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
use std::ops::AddAssign;

use burn::tensor::TensorData;

use crate::transport::chunk::chunk_range;
use crate::transport::collective::{Collective, GroupInfo, OpKind};

/// Counters for one kind of op.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OpCounters {
    pub calls: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

impl AddAssign for OpCounters {
    fn add_assign(&mut self, o: Self) {
        self.calls += o.calls;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
    }
}

/// Counters for every kind of op.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CommStats {
    by_op: [OpCounters; OpKind::ALL.len()],
}

impl CommStats {
    pub fn record(&mut self, kind: OpKind, bytes_sent: u64, bytes_received: u64) {
        self.by_op[kind.index()] += OpCounters {
            calls: 1,
            bytes_sent,
            bytes_received,
        };
    }

    pub fn op(&self, kind: OpKind) -> OpCounters {
        self.by_op[kind.index()]
    }

    pub fn calls(&self, kind: OpKind) -> u64 {
        self.op(kind).calls
    }

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

    /// What happened since `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        let mut out = CommStats::default();
        for k in OpKind::ALL {
            let (a, b) = (self.op(k), earlier.op(k));
            out.by_op[k.index()] = OpCounters {
                calls: a.calls - b.calls,
                bytes_sent: a.bytes_sent - b.bytes_sent,
                bytes_received: a.bytes_received - b.bytes_received,
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

/// The sizes of one call that its traffic depends on, taken before the call consumes its input.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallBytes {
    kind: OpKind,
    group_size: usize,
    index: usize,
    input: usize,
    elem: usize,
    /// all_to_all: bytes of the slice a rank keeps for itself. broadcast: whether it is root.
    own_slice: usize,
    is_root: bool,
}

impl CallBytes {
    pub(crate) fn of(call: &Collective, info: &GroupInfo) -> Self {
        let bytes = |d: &TensorData| d.as_bytes().len();
        let (input, elem) = match call {
            Collective::AllReduce { data, .. }
            | Collective::AllGather { data, .. }
            | Collective::ReduceScatter { data, .. }
            | Collective::AllToAll { data, .. }
            | Collective::Send { data, .. } => (bytes(data), data.dtype().size()),
            Collective::Broadcast { data: Some(d), .. } => (bytes(d), d.dtype().size()),
            _ => (0, 1),
        };
        let own_slice = match call {
            Collective::AllToAll {
                data,
                split_dim,
                send_sizes,
                ..
            } => {
                let len = data.shape()[*split_dim];
                bytes(data)
                    .checked_div(len)
                    .map_or(0, |per_index| per_index * send_sizes[info.index])
            }
            _ => 0,
        };
        let is_root = matches!(call, Collective::Broadcast { root, .. } if *root == info.index);
        Self {
            kind: call.kind(),
            group_size: info.size(),
            index: info.index,
            input,
            elem,
            own_slice,
            is_root,
        }
    }

    /// A call on `input` bytes of `elem`-byte elements with no root that keeps `own_slice`
    /// bytes (all_to_all): the device path, which has no `Collective` to measure.
    #[cfg(feature = "nccl")]
    pub(crate) fn sized(
        kind: OpKind,
        info: &GroupInfo,
        input: usize,
        elem: usize,
        own_slice: usize,
    ) -> Self {
        Self {
            kind,
            group_size: info.size(),
            index: info.index,
            input,
            elem,
            own_slice,
            is_root: false,
        }
    }

    /// (sent, received) once the call produced `output` bytes.
    pub(crate) fn traffic(&self, output: usize) -> (u64, u64) {
        let others = self.group_size - 1;
        let (sent, received) = match self.kind {
            OpKind::AllGather => (self.input * others, output - self.input),
            OpKind::ReduceScatter => (self.input - output, output * others),
            OpKind::AllReduce => {
                let n = self.input / self.elem;
                let mine = chunk_range(n, self.group_size, self.index).len() * self.elem;
                let rest = self.input - mine;
                (rest + mine * others, mine * others + rest)
            }
            OpKind::Broadcast if self.is_root => (output * others, 0),
            OpKind::Broadcast => (0, output),
            OpKind::AllToAll => {
                // The slice kept for itself is the same size coming in and going out.
                (self.input - self.own_slice, output - self.own_slice)
            }
            OpKind::Send => (self.input, 0),
            OpKind::Recv => (0, output),
            OpKind::Barrier => (0, 0),
        };
        (sent as u64, received as u64)
    }

    pub(crate) fn kind(&self) -> OpKind {
        self.kind
    }
}
