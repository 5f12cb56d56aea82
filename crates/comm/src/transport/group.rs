//! `ProcessGroup`: the handle a rank holds on one group, with one typed method per collective.
//! Arguments are checked here, before any rank is contacted, so every engine reports bad input
//! the same way.

use std::fmt;
use std::sync::Arc;

use burn::tensor::TensorData;

use crate::transport::chunk::chunk_sizes;
use crate::transport::collective::{
    Collective, CollectiveHandle, CollectiveResult, Communicator, GroupInfo, OpKind,
};
use crate::transport::data::{ReduceOp, reducible};
use crate::transport::error::CollectiveError;
use crate::transport::stats::CommStats;

/// A group of ranks that run collectives together. Cheap to clone.
#[derive(Clone)]
pub struct ProcessGroup {
    comm: Arc<dyn Communicator>,
}

impl fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ProcessGroup({}, index {})",
            self.info().label,
            self.info().index
        )
    }
}

type Result<T> = std::result::Result<T, CollectiveError>;

impl ProcessGroup {
    /// A group over an engine's communicator.
    pub fn new(comm: Arc<dyn Communicator>) -> Self {
        Self { comm }
    }

    /// The group's identity as this rank sees it.
    pub fn info(&self) -> &GroupInfo {
        self.comm.info()
    }

    /// The engine's communicator behind this group.
    #[cfg(feature = "nccl")]
    pub(crate) fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.info().size()
    }

    /// This rank's position in the group.
    pub fn index(&self) -> usize {
        self.info().index
    }

    /// Global ranks of the members, in group order.
    pub fn ranks(&self) -> &[usize] {
        &self.info().ranks
    }

    /// A readable name, e.g. `tp[2, 3]`.
    pub fn label(&self) -> &str {
        &self.info().label
    }

    /// This rank's counters for this group.
    pub fn stats(&self) -> CommStats {
        self.comm.stats()
    }

    /// Every rank gets the elementwise reduction of every rank's tensor.
    pub fn all_reduce(&self, data: TensorData, op: ReduceOp) -> Result<TensorData> {
        self.run_data(Collective::AllReduce { data, op })
    }

    /// Concatenation along `dim` of every rank's tensor, in group order. Sizes along `dim` may
    /// differ between ranks (zero included); the other dimensions must agree.
    pub fn all_gather(&self, data: TensorData, dim: usize) -> Result<TensorData> {
        self.run_data(Collective::AllGather { data, dim })
    }

    /// As `all_gather`, also returning each rank's size along `dim`.
    pub fn all_gather_sized(
        &self,
        data: TensorData,
        dim: usize,
    ) -> Result<(TensorData, Vec<usize>)> {
        self.run_sized(Collective::AllGather { data, dim })
    }

    /// Rank `i` gets the reduction of chunk `i` along `dim`, chunks following the pad-to-ceil
    /// rule of [`chunk_sizes`](crate::transport::chunk::chunk_sizes) (FSDP2's): all-gathering the results
    /// gives back the reduced tensor.
    pub fn reduce_scatter(&self, data: TensorData, dim: usize, op: ReduceOp) -> Result<TensorData> {
        let sizes = self.default_sizes(&data, dim, OpKind::ReduceScatter)?;
        self.reduce_scatter_sizes(data, dim, &sizes, op)
    }

    /// As `reduce_scatter`, with explicit chunk sizes (one per rank, summing to the dimension).
    pub fn reduce_scatter_sizes(
        &self,
        data: TensorData,
        dim: usize,
        sizes: &[usize],
        op: ReduceOp,
    ) -> Result<TensorData> {
        self.run_data(Collective::ReduceScatter {
            data,
            dim,
            sizes: sizes.to_vec(),
            op,
        })
    }

    /// The root's tensor, on every rank. Other ranks may pass `None`.
    pub fn broadcast(&self, data: Option<TensorData>, root: usize) -> Result<TensorData> {
        self.run_data(Collective::Broadcast { data, root })
    }

    /// Slice `j` of `data` along `split_dim` (`send_sizes[j]` long) goes to rank `j`; the result
    /// is the received slices concatenated along `concat_dim` in group order.
    pub fn all_to_all(
        &self,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
        send_sizes: &[usize],
    ) -> Result<TensorData> {
        self.run_data(Collective::AllToAll {
            data,
            split_dim,
            concat_dim,
            send_sizes: send_sizes.to_vec(),
        })
    }

    /// As `all_to_all`, also returning the size along `concat_dim` of each received slice.
    pub fn all_to_all_sized(
        &self,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
        send_sizes: &[usize],
    ) -> Result<(TensorData, Vec<usize>)> {
        self.run_sized(Collective::AllToAll {
            data,
            split_dim,
            concat_dim,
            send_sizes: send_sizes.to_vec(),
        })
    }

    /// Sends to the member at position `dst`; returns once the message is handed over.
    pub fn send(&self, data: TensorData, dst: usize) -> Result<()> {
        self.run(Collective::Send { data, dst }).map(|_| ())
    }

    /// Receives the next message from the member at position `src`.
    pub fn recv(&self, src: usize) -> Result<TensorData> {
        self.run_data(Collective::Recv { src })
    }

    /// Returns once every member has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.run(Collective::Barrier).map(|_| ())
    }

    /// As `all_reduce`, without waiting.
    pub fn all_reduce_async(&self, data: TensorData, op: ReduceOp) -> CollectiveHandle {
        self.start(Collective::AllReduce { data, op })
    }

    /// As `all_gather`, without waiting.
    pub fn all_gather_async(&self, data: TensorData, dim: usize) -> CollectiveHandle {
        self.start(Collective::AllGather { data, dim })
    }

    /// As `reduce_scatter`, without waiting.
    pub fn reduce_scatter_async(
        &self,
        data: TensorData,
        dim: usize,
        op: ReduceOp,
    ) -> CollectiveHandle {
        match self.default_sizes(&data, dim, OpKind::ReduceScatter) {
            Ok(sizes) => self.reduce_scatter_sizes_async(data, dim, &sizes, op),
            Err(e) => self.failed(OpKind::ReduceScatter, e),
        }
    }

    /// As `reduce_scatter_sizes`, without waiting.
    pub fn reduce_scatter_sizes_async(
        &self,
        data: TensorData,
        dim: usize,
        sizes: &[usize],
        op: ReduceOp,
    ) -> CollectiveHandle {
        self.start(Collective::ReduceScatter {
            data,
            dim,
            sizes: sizes.to_vec(),
            op,
        })
    }

    /// As `broadcast`, without waiting.
    pub fn broadcast_async(&self, data: Option<TensorData>, root: usize) -> CollectiveHandle {
        self.start(Collective::Broadcast { data, root })
    }

    /// As `all_to_all`, without waiting.
    pub fn all_to_all_async(
        &self,
        data: TensorData,
        split_dim: usize,
        concat_dim: usize,
        send_sizes: &[usize],
    ) -> CollectiveHandle {
        self.start(Collective::AllToAll {
            data,
            split_dim,
            concat_dim,
            send_sizes: send_sizes.to_vec(),
        })
    }

    /// As `recv`, without waiting.
    pub fn recv_async(&self, src: usize) -> CollectiveHandle {
        self.start(Collective::Recv { src })
    }

    /// As `barrier`, without waiting.
    pub fn barrier_async(&self) -> CollectiveHandle {
        self.start(Collective::Barrier)
    }

    /// Issues any call; the typed methods above are shorthands for this.
    pub fn start(&self, call: Collective) -> CollectiveHandle {
        let kind = call.kind();
        match self.validate(&call) {
            Ok(()) => self.comm.start(call).counting_waits(self.comm.clone()),
            Err(e) => self.failed(kind, e),
        }
    }

    /// Runs any call to completion.
    pub fn run(&self, call: Collective) -> CollectiveResult {
        self.validate(&call)?;
        let (kind, started) = (call.kind(), std::time::Instant::now());
        let result = self.comm.run(call);
        self.comm.record_wait(kind, started.elapsed());
        result
    }

    fn run_data(&self, call: Collective) -> Result<TensorData> {
        self.run_sized(call).map(|(data, _)| data)
    }

    fn run_sized(&self, call: Collective) -> Result<(TensorData, Vec<usize>)> {
        let kind = call.kind();
        let out = self.run(call)?;
        let data = out
            .data
            .ok_or_else(|| self.invalid(kind, "the engine returned no tensor".into()))?;
        Ok((data, out.sizes))
    }

    fn failed(&self, kind: OpKind, e: CollectiveError) -> CollectiveHandle {
        CollectiveHandle::ready(kind, self.label().to_string(), Err(e))
    }

    fn default_sizes(&self, data: &TensorData, dim: usize, kind: OpKind) -> Result<Vec<usize>> {
        let shape = data.shape();
        if dim >= shape.len() {
            return Err(self.invalid(kind, dim_error(dim, shape)));
        }
        Ok(chunk_sizes(shape[dim], self.size()))
    }

    fn invalid(&self, kind: OpKind, message: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op: kind.name().into(),
            group: self.label().into(),
            message,
        }
    }

    fn member(&self, kind: OpKind, rank: usize) -> Result<()> {
        if rank < self.size() {
            Ok(())
        } else {
            Err(CollectiveError::NoSuchRank {
                op: kind.name().into(),
                group: self.label().into(),
                rank,
                size: self.size(),
            })
        }
    }

    /// Checks what one rank can check alone.
    fn validate(&self, call: &Collective) -> Result<()> {
        let kind = call.kind();
        let check_dim = |data: &TensorData, dim: usize| {
            if dim < data.shape().len() {
                Ok(())
            } else {
                Err(self.invalid(kind, dim_error(dim, data.shape())))
            }
        };
        let check_reducible = |data: &TensorData| {
            if reducible(data.dtype()) {
                Ok(())
            } else {
                Err(CollectiveError::UnsupportedDtype {
                    op: kind.name().into(),
                    dtype: format!("{:?}", data.dtype()),
                })
            }
        };
        match call {
            Collective::AllReduce { data, .. } => check_reducible(data),
            Collective::AllGather { data, dim } => check_dim(data, *dim),
            Collective::ReduceScatter {
                data, dim, sizes, ..
            } => {
                check_dim(data, *dim)?;
                check_reducible(data)?;
                self.check_sizes(kind, sizes, data.shape()[*dim], "sizes")
            }
            Collective::Broadcast { data, root } => {
                self.member(kind, *root)?;
                if *root == self.index() && data.is_none() {
                    return Err(self.invalid(kind, "the root must pass the tensor".into()));
                }
                Ok(())
            }
            Collective::AllToAll {
                data,
                split_dim,
                concat_dim,
                send_sizes,
            } => {
                check_dim(data, *split_dim)?;
                check_dim(data, *concat_dim)?;
                self.check_sizes(kind, send_sizes, data.shape()[*split_dim], "send_sizes")
            }
            Collective::Send { dst, .. } => self.member(kind, *dst),
            Collective::Recv { src } => self.member(kind, *src),
            Collective::Barrier => Ok(()),
        }
    }

    fn check_sizes(&self, kind: OpKind, sizes: &[usize], len: usize, what: &str) -> Result<()> {
        if sizes.len() != self.size() {
            return Err(self.invalid(
                kind,
                format!(
                    "{what} has {} entries but the group has {} ranks",
                    sizes.len(),
                    self.size()
                ),
            ));
        }
        let total: usize = sizes.iter().sum();
        if total != len {
            return Err(self.invalid(
                kind,
                format!("{what} {sizes:?} sum to {total} but the dimension has {len}"),
            ));
        }
        Ok(())
    }
}

fn dim_error(dim: usize, shape: &[usize]) -> String {
    format!(
        "dim {dim} is out of range for a tensor of shape {shape:?} ({} dims)",
        shape.len()
    )
}
