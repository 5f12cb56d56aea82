//! A collective as a list of steps on a backend tensor: [`DeviceStep`]s to run forward and a
//! list to run on the gradient in backward. Every differentiable collective and FSDP's
//! parameter gather are such lists; [`run_steps`] interprets them. Only the innermost exchange
//! ([`DeviceStep::Run`]) differs between machines: the group's engine on the tensor's data
//! ([`Exchange::Engine`], every CPU backend), or NCCL on a CUDA buffer ([`Exchange::Nccl`]).

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, Slice, TensorData, try_read_sync};

use super::decode::CodedWeight;
use crate::transport::chunk::{chunk_sizes, offsets};
use crate::transport::collective::{Collective, CollectiveHandle, OpKind};
use crate::transport::data::ReduceOp;
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;

/// Every rank's length along a collective's dim: known up front (chunks of a known length), or
/// learned by a forward all-gather and read by its backward.
#[derive(Clone, Default)]
pub struct Sizes(Arc<Mutex<Option<Vec<usize>>>>);

impl Sizes {
    /// Sizes given up front.
    pub fn known(sizes: Vec<usize>) -> Self {
        Self(Arc::new(Mutex::new(Some(sizes))))
    }

    /// Sizes for a forward all-gather to learn.
    pub fn unknown() -> Self {
        Self::default()
    }

    /// The sizes, once known or learned.
    pub fn get(&self) -> Option<Vec<usize>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub(crate) fn set(&self, sizes: Vec<usize>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(sizes);
    }

    /// The sizes, which the forward all-gather has learned by the time backward asks.
    fn expect(&self, what: &str) -> Vec<usize> {
        self.get()
            .unwrap_or_else(|| panic!("{what}: the sizes were not learned by the forward gather"))
    }
}

impl fmt::Debug for Sizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.get() {
            Some(s) => write!(f, "{s:?}"),
            None => f.write_str("(unknown)"),
        }
    }
}

impl PartialEq for Sizes {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

/// One collective on a tensor.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceOp {
    /// Concatenation along `dim` of every rank's piece; rank `j` holds `sizes[j]` rows.
    AllGather {
        /// The dimension to concatenate along.
        dim: usize,
        /// Each rank's rows along `dim`; the gather learns them when unknown.
        sizes: Sizes,
    },
    /// Rank `i` keeps the reduction of every rank's slice `i` (of `sizes[i]` rows along `dim`).
    ReduceScatter {
        /// The dimension the slices are cut along.
        dim: usize,
        /// Each rank's slice length; when unknown, the pad-to-ceil chunks.
        sizes: Sizes,
        /// The reduction.
        op: ReduceOp,
    },
    /// Every rank gets the elementwise reduction of every rank's tensor.
    AllReduce {
        /// The reduction.
        op: ReduceOp,
    },
    /// Slice `j` along `split_dim` (`send_sizes[j]` long) goes to rank `j`; the slices
    /// received are concatenated along `concat_dim`, and their lengths there are learned.
    AllToAll {
        /// The dimension the outgoing slices are cut along.
        split_dim: usize,
        /// The dimension the received slices are concatenated along.
        concat_dim: usize,
        /// Length of the slice for each rank; must be known when the step runs.
        send_sizes: Sizes,
        /// Length of each received slice, learned by the exchange.
        received: Sizes,
    },
}

impl DeviceOp {
    /// The op's kind, for counters and messages.
    pub fn kind(&self) -> OpKind {
        match self {
            DeviceOp::AllGather { .. } => OpKind::AllGather,
            DeviceOp::ReduceScatter { .. } => OpKind::ReduceScatter,
            DeviceOp::AllReduce { .. } => OpKind::AllReduce,
            DeviceOp::AllToAll { .. } => OpKind::AllToAll,
        }
    }

    /// The engine call that runs this op on `data`.
    fn engine_call(&self, data: TensorData, group: &ProcessGroup) -> Collective {
        match self {
            DeviceOp::AllGather { dim, .. } => Collective::AllGather { data, dim: *dim },
            DeviceOp::ReduceScatter { dim, sizes, op } => {
                let sizes = sizes
                    .get()
                    .unwrap_or_else(|| chunk_sizes(data.shape()[*dim], group.size()));
                Collective::ReduceScatter {
                    data,
                    dim: *dim,
                    sizes,
                    op: *op,
                }
            }
            DeviceOp::AllReduce { op } => Collective::AllReduce { data, op: *op },
            DeviceOp::AllToAll {
                split_dim,
                concat_dim,
                send_sizes,
                ..
            } => Collective::AllToAll {
                data,
                split_dim: *split_dim,
                concat_dim: *concat_dim,
                send_sizes: send_sizes.expect("sending pieces of an all_to_all"),
            },
        }
    }

    /// Records what the exchange taught: every rank's rows of a gather, the lengths received
    /// by an all_to_all.
    /// Whether this op on a group of one gives the input itself, learning the sizes the engine
    /// would. True for every op whose known sizes agree with the input's dims; otherwise the
    /// engine runs it and names the disagreement. A group of one exchanges nothing, so its
    /// steps skip the engine's copies through host memory.
    fn passes_through_alone(&self, dims: &[usize]) -> bool {
        match self {
            DeviceOp::AllReduce { .. } => true,
            DeviceOp::AllGather { dim, sizes } => dims.get(*dim).is_some_and(|&len| {
                sizes.set(vec![len]);
                true
            }),
            DeviceOp::ReduceScatter { dim, sizes, .. } => dims
                .get(*dim)
                .is_some_and(|&len| sizes.get().is_none_or(|s| s == [len])),
            DeviceOp::AllToAll {
                split_dim,
                concat_dim,
                send_sizes,
                received,
            } => match (dims.get(*split_dim), dims.get(*concat_dim)) {
                (Some(&sent), Some(&kept)) if send_sizes.get() == Some(vec![sent]) => {
                    received.set(vec![kept]);
                    true
                }
                _ => false,
            },
        }
    }

    fn learn(&self, sizes: Vec<usize>) {
        match self {
            DeviceOp::AllGather { sizes: s, .. } => s.set(sizes),
            DeviceOp::AllToAll { received, .. } => received.set(sizes),
            DeviceOp::ReduceScatter { .. } | DeviceOp::AllReduce { .. } => {}
        }
    }
}

/// What exchanges a step's bytes.
#[derive(Clone)]
pub enum Exchange {
    /// The group's engine, on the tensor's data (threads, MPI; every CPU backend).
    Engine(ProcessGroup),
    /// NCCL on the CUDA buffer (the group belongs to the nccl engine).
    #[cfg(feature = "nccl")]
    Nccl(ProcessGroup),
}

impl Exchange {
    /// The group whose ranks exchange.
    pub fn group(&self) -> &ProcessGroup {
        match self {
            Exchange::Engine(g) => g,
            #[cfg(feature = "nccl")]
            Exchange::Nccl(g) => g,
        }
    }
}

impl fmt::Debug for Exchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exchange::Engine(g) => write!(f, "engine({})", g.label()),
            #[cfg(feature = "nccl")]
            Exchange::Nccl(g) => write!(f, "nccl({})", g.label()),
        }
    }
}

/// Called with the bytes of the tensor at its step (memory accounting).
#[derive(Clone)]
pub struct Observer(Arc<dyn Fn(usize) + Send + Sync>);

impl Observer {
    /// An observer that calls `f`.
    pub fn new(f: impl Fn(usize) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// Calls the observer with `bytes`.
    pub(crate) fn notify(&self, bytes: usize) {
        (self.0)(bytes)
    }
}

impl fmt::Debug for Observer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Observer")
    }
}

/// A gradient summed over micro-steps on the device, of whatever backend produced it.
#[derive(Clone, Default)]
pub struct DevicePending(Arc<Mutex<Option<Box<dyn Any + Send>>>>);

impl DevicePending {
    fn take<B: Backend>(&self) -> Option<FloatTensor<B>> {
        let held = self.0.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        Some(
            *held
                .downcast::<FloatTensor<B>>()
                .unwrap_or_else(|_| panic!("a deferred gradient from another backend")),
        )
    }

    fn put<B: Backend>(&self, x: FloatTensor<B>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(Box::new(x));
    }
}

impl fmt::Debug for DevicePending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DevicePending")
    }
}

/// FSDP2's deferred gradient sync. While `sync` is off the gradient is added to `pending` and
/// the steps after this one see zeros of `zeros` (shape, dtype) and run only their observers;
/// on the sync step the pending sum joins the gradient.
#[derive(Clone)]
pub struct Deferral {
    /// Off while gradients accumulate; on for the step that syncs them.
    pub sync: Arc<AtomicBool>,
    /// The gradient summed so far while sync was off.
    pub pending: DevicePending,
    /// Shape and dtype of the zeros the later steps see while deferring.
    pub zeros: (Vec<usize>, DType),
    /// Called with the pending bytes before and after the step.
    pub on_change: Arc<dyn Fn(usize, usize) + Send + Sync>,
}

impl fmt::Debug for Deferral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deferral(zeros {:?})", self.zeros)
    }
}

/// An engine collective issued ahead of its use (FSDP's prefetch), or run before its op is
/// attached (so that its error reaches the caller): [`DeviceStep::Await`] takes its result.
#[derive(Clone)]
pub struct InFlight {
    op: DeviceOp,
    group: ProcessGroup,
    state: Arc<Mutex<Option<Exchanged>>>,
}

enum Exchanged {
    Running(CollectiveHandle),
    Done(TensorData),
}

impl InFlight {
    /// Issues `op` on `data` through `group`'s engine without waiting.
    pub fn start(op: DeviceOp, data: TensorData, group: &ProcessGroup) -> Self {
        let handle = group.start(op.engine_call(data, group));
        Self::holding(op, group, Exchanged::Running(handle))
    }

    /// Runs `op` on `data` through `group`'s engine now, so that its error is returned here (in
    /// forward, where a caller can take it) instead of surfacing inside autodiff.
    pub fn run(
        op: DeviceOp,
        data: TensorData,
        group: &ProcessGroup,
    ) -> Result<Self, CollectiveError> {
        let out = engine_exchange(&op, data, group)?;
        Ok(Self::holding(op, group, Exchanged::Done(out)))
    }

    fn holding(op: DeviceOp, group: &ProcessGroup, state: Exchanged) -> Self {
        Self {
            op,
            group: group.clone(),
            state: Arc::new(Mutex::new(Some(state))),
        }
    }

    /// Whether the exchange has finished (waiting would not block).
    pub fn is_done(&self) -> bool {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match state.as_ref() {
            Some(Exchanged::Running(handle)) => handle.is_done(),
            _ => true,
        }
    }

    /// The result, as the same op run now would give it (sizes learned included).
    fn wait(&self) -> Result<TensorData, CollectiveError> {
        let state = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("an in-flight collective is awaited once");
        match state {
            Exchanged::Done(data) => Ok(data),
            Exchanged::Running(handle) => {
                let (data, sizes) = handle.wait_sized()?;
                self.op.learn(sizes);
                Ok(data)
            }
        }
    }
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "InFlight({} on {})", self.op.kind(), self.group.label())
    }
}

/// One step of a device collective.
#[derive(Debug, Clone)]
pub enum DeviceStep {
    /// To this dtype (nothing when the tensor has it already).
    Cast(DType),
    /// Piece `index` along `dim`, the pieces being `sizes` long.
    Piece {
        /// The dimension the pieces are cut along.
        dim: usize,
        /// Every rank's piece length.
        sizes: Sizes,
        /// Which piece to keep.
        index: usize,
    },
    /// A collective.
    Run {
        /// The collective.
        op: DeviceOp,
        /// What exchanges its bytes.
        exchange: Exchange,
    },
    /// The result of a collective issued earlier; the tensor only gives its device.
    Await(InFlight),
    /// Reports the tensor's bytes; the tensor passes unchanged.
    Observe(Observer),
    /// Defers a gradient while sync is off (see [`Deferral`]).
    Defer(Deferral),
    /// Decodes a 4-bit packed weight into its values ([`crate::device::decode`]).
    Decode(CodedWeight),
}

/// One NCCL collective for a backend to run on its own buffer.
#[derive(Debug, Clone)]
pub struct NcclCall {
    /// The collective.
    pub op: DeviceOp,
    /// The group it runs on (an nccl-engine group).
    pub group: ProcessGroup,
    /// Where it runs, for the message of a failure.
    pub phase: Phase,
}

impl NcclCall {
    /// Unwraps the backend's result; a failure panics as every failing step does.
    pub fn finish<T>(&self, result: Result<T, CollectiveError>) -> T {
        result.unwrap_or_else(|e| failed(&self.op, &self.group, self.phase, e))
    }
}

/// How a backend runs an NCCL step on its own buffer. Backends without NCCL use [`no_nccl`]
/// (routing never sends them such a step).
pub type NcclStep<B> = fn(FloatTensor<B>, NcclCall) -> FloatTensor<B>;

/// How a backend decodes a 4-bit packed weight ([`DeviceStep::Decode`]).
pub type DecodeStep<B> = fn(FloatTensor<B>, CodedWeight) -> FloatTensor<B>;

/// How a backend converts a tensor to another float dtype ([`DeviceStep::Cast`]).
pub type CastStep<B> = fn(FloatTensor<B>, DType) -> FloatTensor<B>;

/// A backend's own implementations of the steps that have one: its NCCL collective, its
/// decode of packed weights and its dtype cast (flex's one-pass loops; the plain ops
/// elsewhere).
pub struct StepKernels<B: Backend> {
    /// Runs an NCCL step on the backend's buffer (read only in builds with NCCL).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub nccl: NcclStep<B>,
    /// Decodes a packed weight.
    pub decode: DecodeStep<B>,
    /// Casts to another float dtype.
    pub cast: CastStep<B>,
}

impl<B: Backend> Clone for StepKernels<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend> Copy for StepKernels<B> {}

/// The NCCL step of a backend that has none.
pub fn no_nccl<B: Backend>(_x: FloatTensor<B>, call: NcclCall) -> FloatTensor<B> {
    call.finish(Err(CollectiveError::InvalidArgument {
        op: call.op.kind().name().into(),
        group: call.group.label().into(),
        message: "this backend has no NCCL path (only Burn's CUDA and LibTorch backends, with \
                  the `cuda` / `tch` features, run one)"
            .into(),
    }))
}

/// Where steps run, for the message of a failing collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The forward pass, on the input.
    Forward,
    /// The backward pass, on the gradient.
    Backward,
    /// Gathering again in backward what resharding dropped after forward.
    Recompute,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Recompute => "backward (recompute)",
        })
    }
}

fn bytes_of<B: Backend>(x: &FloatTensor<B>) -> usize {
    x.shape().num_elements() * x.dtype().size()
}

/// Runs `steps` on a backend tensor; NCCL and decode steps go to the backend's `kernels`. A failing collective panics
/// with the op, the group and the phase: Burn's autodiff cannot return errors, and the launcher
/// turns the panic into this rank's failure (entry points check what they can first).
pub fn run_steps<B: Backend>(
    mut x: FloatTensor<B>,
    steps: &[DeviceStep],
    phase: Phase,
    kernels: StepKernels<B>,
) -> FloatTensor<B> {
    let mut deferred = false;
    for step in steps {
        x = match step {
            DeviceStep::Observe(Observer(f)) => {
                f(bytes_of::<B>(&x));
                x
            }
            _ if deferred => x,
            DeviceStep::Defer(d) => {
                let pending = d.pending.take::<B>();
                let before = pending.as_ref().map_or(0, bytes_of::<B>);
                let sum = match pending {
                    Some(p) => B::float_add(p, x),
                    None => x,
                };
                if d.sync.load(Ordering::SeqCst) {
                    (d.on_change)(before, 0);
                    sum
                } else {
                    (d.on_change)(before, bytes_of::<B>(&sum));
                    let device = sum.device();
                    d.pending.put::<B>(sum);
                    deferred = true;
                    let (shape, dtype) = &d.zeros;
                    B::float_zeros(shape.clone().into(), &device, (*dtype).into())
                }
            }
            DeviceStep::Decode(weight) => (kernels.decode)(x, weight.clone()),
            DeviceStep::Cast(dtype) if x.dtype() == *dtype => x,
            DeviceStep::Cast(dtype) => (kernels.cast)(x, *dtype),
            DeviceStep::Piece { dim, sizes, index } => {
                let sizes = sizes.expect("slicing this rank's piece");
                piece::<B>(x, *dim, offsets(&sizes)[*index], sizes[*index])
            }
            DeviceStep::Run { op, exchange }
                if exchange.group().size() == 1 && op.passes_through_alone(&x.shape()) =>
            {
                x
            }
            DeviceStep::Run {
                op,
                exchange: Exchange::Engine(group),
            } => run_on_engine::<B>(x, op, group).unwrap_or_else(|e| failed(op, group, phase, e)),
            #[cfg(feature = "nccl")]
            DeviceStep::Run {
                op,
                exchange: Exchange::Nccl(group),
            } => (kernels.nccl)(
                x,
                NcclCall {
                    op: op.clone(),
                    group: group.clone(),
                    phase,
                },
            ),
            DeviceStep::Await(started) => {
                let device = x.device();
                let out = started
                    .wait()
                    .unwrap_or_else(|e| failed(&started.op, &started.group, phase, e));
                B::float_from_data(out, &device)
            }
        };
    }
    x
}

fn failed(op: &DeviceOp, group: &ProcessGroup, phase: Phase, e: CollectiveError) -> ! {
    let hint = match &e {
        // Ranks in one process (the threads engine): a shared autodiff tensor is the usual way
        // one rank's backward ends up waiting on another's.
        CollectiveError::Timeout { .. } | CollectiveError::Diverged { .. }
            if phase != Phase::Forward =>
        {
            " (a common cause: two ranks share an autodiff tensor, which joins their graphs \
             under one lock so one rank's backward blocks the other's; build each rank's \
             tensors on that rank, or share TensorData)"
        }
        // Ranks in separate processes (MPI), which share no tensor: a peer is not running.
        // The roll call named the ranks that never reached a collective.
        CollectiveError::Stalled { call, .. } if call.missing.is_some() => {
            " (the ranks it waits for did not answer the roll call of the ranks blocked in \
             collectives: they are paused (SIGSTOP), hung, or in a long computation; if one \
             failed, the job's output names it)"
        }
        CollectiveError::Stalled { .. } => {
            " (every rank answered the roll call, so each is blocked in a collective: they \
             issued their collectives in different orders; compare the pending calls that each \
             rank prints)"
        }
        _ => "",
    };
    panic!(
        "{} in {phase} failed on group {}: {e}{hint}",
        op.kind(),
        group.label()
    )
}

/// `x`'s piece along `dim` from `start`, `len` long.
pub fn piece<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    start: usize,
    len: usize,
) -> FloatTensor<B> {
    if len == 0 {
        // Backends refuse empty slices; an empty piece (a rank holding nothing) is built.
        let mut dims = x.shape().to_vec();
        dims[dim] = 0;
        let device = x.device();
        return B::float_zeros(dims.into(), &device, x.dtype().into());
    }
    let ndim = x.shape().num_dims();
    let slices: Vec<Slice> = (0..ndim)
        .map(|d| match d == dim {
            true => Slice::new(start as isize, Some((start + len) as isize), 1),
            false => Slice::full(),
        })
        .collect();
    B::float_slice(x, &slices)
}

/// A tensor's data on the host (a copy on GPU backends; CPU backends hand their buffer over).
pub fn read_data<B: Backend>(x: FloatTensor<B>) -> TensorData {
    try_read_sync(B::float_into_data(x))
        .expect("synchronous read is supported on the engine path")
        .expect("reading a tensor for a collective")
}

/// A step exchanged by the group's engine, on the tensor's data.
fn run_on_engine<B: Backend>(
    x: FloatTensor<B>,
    op: &DeviceOp,
    group: &ProcessGroup,
) -> Result<FloatTensor<B>, CollectiveError> {
    let device = x.device();
    let out = engine_exchange(op, read_data::<B>(x), group)?;
    Ok(B::float_from_data(out, &device))
}

/// The one place a step's data goes through a group's engine (blocking).
fn engine_exchange(
    op: &DeviceOp,
    data: TensorData,
    group: &ProcessGroup,
) -> Result<TensorData, CollectiveError> {
    let out = group.run(op.engine_call(data, group))?;
    let data = out.data.ok_or_else(|| CollectiveError::InvalidArgument {
        op: op.kind().name().into(),
        group: group.label().into(),
        message: "the engine returned no tensor".into(),
    })?;
    op.learn(out.sizes);
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a group of one every op gives its input, learning the sizes an engine would; known
    /// sizes that disagree with the input go to the engine, which names the error.
    #[test]
    fn ops_pass_through_a_group_of_one_only_where_their_sizes_agree() {
        let dims = [5, 3];
        let gather = DeviceOp::AllGather {
            dim: 1,
            sizes: Sizes::unknown(),
        };
        assert!(gather.passes_through_alone(&dims));
        let DeviceOp::AllGather { sizes, .. } = &gather else {
            unreachable!()
        };
        assert_eq!(sizes.get(), Some(vec![3]));
        let scatter = |sizes| DeviceOp::ReduceScatter {
            dim: 0,
            sizes,
            op: ReduceOp::Sum,
        };
        assert!(scatter(Sizes::unknown()).passes_through_alone(&dims));
        assert!(scatter(Sizes::known(vec![5])).passes_through_alone(&dims));
        assert!(!scatter(Sizes::known(vec![4])).passes_through_alone(&dims));
        let to_all = |sent| DeviceOp::AllToAll {
            split_dim: 0,
            concat_dim: 1,
            send_sizes: Sizes::known(sent),
            received: Sizes::unknown(),
        };
        let through = to_all(vec![5]);
        assert!(through.passes_through_alone(&dims));
        let DeviceOp::AllToAll { received, .. } = &through else {
            unreachable!()
        };
        assert_eq!(received.get(), Some(vec![3]));
        assert!(!to_all(vec![2]).passes_through_alone(&dims));
        let out_of_range = DeviceOp::AllGather {
            dim: 2,
            sizes: Sizes::unknown(),
        };
        assert!(!out_of_range.passes_through_alone(&dims));
        assert!(DeviceOp::AllReduce { op: ReduceOp::Avg }.passes_through_alone(&dims));
    }

    #[test]
    fn sizes_learned_forward_are_read_backward() {
        let s = Sizes::unknown();
        let t = s.clone();
        assert_eq!(s.get(), None);
        s.set(vec![3, 1]);
        assert_eq!(t.get(), Some(vec![3, 1]));
        assert_eq!(t, Sizes::known(vec![3, 1]));
    }
}
