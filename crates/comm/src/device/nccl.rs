//! The backend-independent half of a device collective on NCCL: the ranks' agreement on op,
//! dtype and shape, the output's shape, the NCCL calls on raw device pointers (with the strided
//! copies that uneven pieces need) and the byte counters. The backends (`cube`, `torch`) only
//! provide the pointers, allocate the output and order NCCL against their own kernels.
//!
//! The agreement ([`crate::transport::nccl::agreement`]) tells a gather of unknown sizes every
//! rank's length and turns a mismatch into the same error on every rank instead of a hang; the
//! calls FSDP repeats with static shapes are agreed once. Temporaries are the group's reused
//! staging buffers, and every wait runs under the rank's watchdog.

use burn::tensor::DType;

use super::steps::DeviceOp;
use crate::transport::chunk::{chunk_sizes, offsets};
use crate::transport::collective::OpKind;
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;

use crate::transport::nccl::agreement::{CallKind, CallSpec};
use crate::transport::nccl::comm::{DevicePtr, NcclComm, NcclError};
use crate::transport::nccl::engine::{NcclCommunicator, nccl_communicator};
use crate::transport::nccl::layout::{AlongDim, gather_layout, scatter_layout};
use crate::transport::nccl::scope::{Scope, Slot, collective_error};
use crate::transport::nccl::types::{NcclDataType, nccl_dtype, nccl_reduce};

/// A CUDA failure as an NCCL-engine error.
#[cfg(feature = "cuda")]
pub(crate) fn cuda_err(call: &'static str) -> impl Fn(String) -> NcclError {
    move |message| NcclError::Cuda { call, message }
}

/// One device collective of `group`, from its agreement to the wait for its stream.
pub(crate) struct DeviceCall<'a> {
    pub op: &'a DeviceOp,
    group: &'a ProcessGroup,
    engine: &'a NcclCommunicator,
    scope: Scope<'a>,
    started: std::time::Instant,
}

/// A gather, reduce-scatter or all-reduce, agreed on: the output's shape and the pieces.
pub(crate) struct Planned {
    pub shape: Vec<usize>,
    pub out_shape: Vec<usize>,
    pub dtype: DType,
    sizes: Vec<usize>,
    op: DeviceOp,
}

impl Planned {
    pub fn in_bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }

    pub fn out_bytes(&self) -> usize {
        self.out_shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// An all_to_all, agreed on: this rank's pieces along the split dim (start, length) and the
/// shape of the piece each rank sends here.
pub(crate) struct PlannedAllToAll {
    pub split: usize,
    pub concat: usize,
    pub send: Vec<(usize, usize)>,
    pub recv_shapes: Vec<Vec<usize>>,
    pub dtype: DType,
    /// Bytes of the piece this rank keeps for itself.
    pub kept: usize,
}

impl<'a> DeviceCall<'a> {
    pub fn new(op: &'a DeviceOp, group: &'a ProcessGroup) -> Result<Self, CollectiveError> {
        let engine = nccl_communicator(group).ok_or_else(|| CollectiveError::InvalidArgument {
            op: format!("{} (device)", op.kind()),
            group: group.label().into(),
            message: "the group does not belong to the nccl engine".into(),
        })?;
        let scope = engine.scope(op.kind())?;
        Ok(Self {
            op,
            group,
            engine,
            scope,
            started: std::time::Instant::now(),
        })
    }

    pub fn comm(&self) -> &NcclComm {
        self.engine.comm()
    }

    /// Maps an NCCL or CUDA failure to the error that names this call and group (the
    /// watchdog's reason when it stopped the call).
    pub fn fail(&self) -> impl Fn(NcclError) -> CollectiveError + '_ {
        move |e| {
            collective_error(
                &format!("{} (device)", self.op.kind()),
                self.group.label(),
                self.scope.explain(e),
            )
        }
    }

    /// Checks that the tensor's GPU is the communicator's: NCCL on another GPU's buffer would
    /// fail deep in the driver or read the wrong memory.
    pub fn check_ordinal(&self, ordinal: usize) -> Result<(), CollectiveError> {
        let mine = self.comm().ordinal();
        if ordinal == mine {
            return Ok(());
        }
        Err(self.invalid(format!(
            "the tensor is on GPU {ordinal} but this rank's communicator runs on GPU {mine}: \
             put each rank's tensors on its own GPU (the launcher's LOCAL_RANK)"
        )))
    }

    pub fn invalid(&self, message: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op: format!("{} (device)", self.op.kind()),
            group: self.group.label().into(),
            message,
        }
    }

    /// Agrees with the other ranks on a gather, reduce-scatter or all-reduce of a `dtype`
    /// tensor of `shape`, and works out its output.
    pub fn plan(&mut self, shape: &[usize], dtype: DType) -> Result<Planned, CollectiveError> {
        let n = self.comm().size();
        let me = self.comm().rank();
        nccl_dtype(self.op.kind().name(), dtype)?;
        let kind = match self.op {
            DeviceOp::AllReduce { .. } => CallKind::Same,
            DeviceOp::AllGather { dim, sizes } => CallKind::Gather {
                dim: *dim,
                sizes: sizes.get(),
            },
            DeviceOp::ReduceScatter { dim, sizes, .. } => CallKind::Scatter {
                dim: *dim,
                sizes: sizes
                    .get()
                    .unwrap_or_else(|| chunk_sizes(shape.get(*dim).copied().unwrap_or(0), n)),
            },
            DeviceOp::AllToAll { .. } => {
                return Err(self.invalid("all_to_all is planned by plan_all_to_all".into()));
            }
        };
        // The agreement checks the pieces on every rank (a bad split is every rank's error).
        let pieces = match &kind {
            CallKind::Scatter { sizes, .. } => sizes.clone(),
            _ => Vec::new(),
        };
        let spec = CallSpec {
            op: self.op.kind(),
            tensor: Some((dtype, shape.to_vec())),
            kind,
        };
        let shapes = self.engine.agree(&mut self.scope, &spec)?.shapes;
        let mut out_shape = shape.to_vec();
        let sizes = match self.op {
            DeviceOp::AllReduce { .. } => Vec::new(),
            DeviceOp::AllGather {
                dim,
                sizes: learned,
            } => {
                let sizes: Vec<usize> = shapes.iter().map(|s| s[*dim]).collect();
                learned.set(sizes.clone());
                out_shape[*dim] = sizes.iter().sum();
                sizes
            }
            DeviceOp::ReduceScatter { dim, .. } => {
                out_shape[*dim] = pieces[me];
                pieces
            }
            DeviceOp::AllToAll { .. } => unreachable!("returned before the agreement"),
        };
        Ok(Planned {
            shape: shape.to_vec(),
            out_shape,
            dtype,
            sizes,
            op: self.op.clone(),
        })
    }

    /// Agrees with the other ranks on an all_to_all of a `dtype` tensor of `shape`.
    pub fn plan_all_to_all(
        &mut self,
        shape: &[usize],
        dtype: DType,
    ) -> Result<PlannedAllToAll, CollectiveError> {
        let DeviceOp::AllToAll {
            split_dim: split,
            concat_dim: concat,
            send_sizes,
            received,
        } = self.op
        else {
            return Err(self.invalid("not an all_to_all".into()));
        };
        let (split, concat) = (*split, *concat);
        let me = self.comm().rank();
        nccl_dtype(self.op.kind().name(), dtype)?;
        let send = send_sizes
            .get()
            .ok_or_else(|| self.invalid("the send sizes are not known".into()))?;
        let spec = CallSpec {
            op: OpKind::AllToAll,
            tensor: Some((dtype, shape.to_vec())),
            kind: CallKind::AllToAll {
                split,
                concat,
                send: send.clone(),
            },
        };
        let agreed = self.engine.agree(&mut self.scope, &spec)?;
        // The piece from rank j: its shape, with its send size for this rank along `split`.
        let recv_shapes: Vec<Vec<usize>> = agreed
            .shapes
            .iter()
            .zip(&agreed.lists)
            .map(|(s, sizes)| {
                let mut s = s.clone();
                s[split] = sizes[me];
                s
            })
            .collect();
        received.set(recv_shapes.iter().map(|s| s[concat]).collect());
        let row_bytes = shape.iter().product::<usize>() * dtype.size();
        let kept = send[me] * row_bytes.checked_div(shape[split]).unwrap_or(0);
        Ok(PlannedAllToAll {
            split,
            concat,
            send: offsets(&send).into_iter().zip(send).collect(),
            recv_shapes,
            dtype,
            kept,
        })
    }

    /// Runs a planned gather, reduce-scatter or all-reduce from `src` into `dst` (of
    /// `plan.out_bytes()`), then waits for the communicator's stream: the output is complete
    /// when this returns.
    ///
    /// # Safety
    /// `src` holds the planned input and `dst` the planned output, both live on this
    /// communicator's GPU until this returns, and no other work writes them meanwhile.
    pub unsafe fn exchange(
        &mut self,
        plan: &Planned,
        src: DevicePtr,
        dst: DevicePtr,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract.
        let ran = unsafe { plan.run(&mut self.scope, src, dst) };
        ran.map_err(self.fail())?;
        self.engine.record_device(
            self.op.kind(),
            plan.in_bytes(),
            plan.dtype.size(),
            plan.out_bytes(),
            0,
            self.started.elapsed(),
        );
        Ok(())
    }

    /// Runs a planned all_to_all: `sends[j]` (pointer, elements) to rank `j`, `recvs[j]` from
    /// it, then waits for the communicator's stream.
    ///
    /// # Safety
    /// As [`Self::exchange`], for every buffer.
    pub unsafe fn exchange_all_to_all(
        &self,
        plan: &PlannedAllToAll,
        sends: &[(DevicePtr, usize)],
        recvs: &[(DevicePtr, usize)],
    ) -> Result<(), CollectiveError> {
        let comm = self.comm();
        let t = nccl_dtype(OpKind::AllToAll.name(), plan.dtype)?;
        // SAFETY: the caller's contract.
        unsafe { comm.all_to_all(sends, recvs, t) }.map_err(self.fail())?;
        self.scope.finish().map_err(self.fail())?;
        let eb = plan.dtype.size();
        let sent: usize = sends.iter().map(|(_, n)| n * eb).sum();
        let received: usize = recvs.iter().map(|(_, n)| n * eb).sum();
        self.engine.record_device(
            OpKind::AllToAll,
            sent,
            eb,
            received,
            plan.kept,
            self.started.elapsed(),
        );
        Ok(())
    }
}

impl Planned {
    /// The NCCL calls, with the strided copies that uneven pieces need.
    ///
    /// # Safety
    /// As [`DeviceCall::exchange`].
    unsafe fn run(
        &self,
        scope: &mut Scope<'_>,
        src: DevicePtr,
        dst: DevicePtr,
    ) -> Result<(), NcclError> {
        let comm = scope.comm;
        let me = comm.rank();
        let eb = self.dtype.size();
        let t: NcclDataType = nccl_dtype(self.op.kind().name(), self.dtype)
            .map_err(|e| NcclError::InvalidArgument(e.to_string()))?;
        // SAFETY: the caller holds `src` and `dst` in place until this returns, and every plan
        // stays inside the buffers it names (see `layout`).
        unsafe {
            match &self.op {
                DeviceOp::AllReduce { op } => {
                    let count = self.out_bytes() / eb;
                    if count > 0 {
                        comm.all_reduce(src, dst, count, t, nccl_reduce(*op))?;
                    }
                }
                DeviceOp::AllGather { dim, .. } => {
                    let l = gather_layout(AlongDim::new(&self.shape, *dim, eb), &self.sizes, me);
                    let send = match l.pack {
                        Some(c) => {
                            let p = scope.buffer(Slot::Send, l.piece_bytes)?;
                            comm.copy_2d(src, p, c)?;
                            p
                        }
                        None => src,
                    };
                    let gathered = match &l.unpack {
                        Some(_) => scope.buffer(Slot::Recv, l.piece_bytes * self.sizes.len())?,
                        None => dst,
                    };
                    if l.piece_bytes > 0 {
                        comm.all_gather(send, gathered, l.piece_bytes / eb, t)?;
                    }
                    for c in l.unpack.iter().flatten() {
                        comm.copy_2d(gathered, dst, *c)?;
                    }
                }
                DeviceOp::AllToAll { .. } => unreachable!("all_to_all has its own exchange"),
                DeviceOp::ReduceScatter { dim, op, .. } => {
                    let l = scatter_layout(AlongDim::new(&self.shape, *dim, eb), &self.sizes, me);
                    let send = match &l.pack {
                        Some(copies) => {
                            let p = scope.buffer(Slot::Send, l.piece_bytes * self.sizes.len())?;
                            for c in copies {
                                comm.copy_2d(src, p, *c)?;
                            }
                            p
                        }
                        None => src,
                    };
                    let recv = match l.unpack {
                        Some(_) => scope.buffer(Slot::Recv, l.piece_bytes)?,
                        None => dst,
                    };
                    if l.piece_bytes > 0 {
                        comm.reduce_scatter(send, recv, l.piece_bytes / eb, t, nccl_reduce(*op))?;
                    }
                    if let Some(c) = l.unpack {
                        comm.copy_2d(recv, dst, c)?;
                    }
                }
            }
        }
        scope.finish()
    }
}
