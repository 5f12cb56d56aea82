//! What one call moves, under the direct-exchange model of [`super::stats`]: the sizes a call's
//! traffic depends on, taken before the call consumes its input.

use burn::tensor::TensorData;

use crate::transport::chunk::chunk_range;
use crate::transport::collective::{Collective, GroupInfo};
use crate::transport::stats::OpKind;

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
