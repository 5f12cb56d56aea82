//! The device path: differentiable collectives on a tensor's own buffer. On Burn's CUDA
//! backend with a group of the nccl engine the bytes go through NCCL and never reach the host;
//! everywhere else the same steps can run with the group's engine doing the exchange
//! ([`force_device_path`]), which is how the CPU tests check this path's graph: the casts,
//! slices and adjoints are the ones CUDA runs, and only the innermost exchange differs.
//!
//! A [`DeviceCollective`] is a list of [`DeviceStep`]s to run now and a list to run on the
//! gradient in backward, so every op of [`super::ops`] is a pair of lists: all_gather <->
//! reduce_scatter (sum), copy_to_group = identity <-> all_reduce, reduce_from_group =
//! all_reduce <-> identity, scatter_to_group = this rank's piece <-> all_gather,
//! gather_from_group = all_gather <-> this rank's piece. FSDP's parameter gather adds casts
//! (its mixed-precision policy) and a replica all-reduce (HSDP) to the same lists.

use std::any::Any;
use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{DType, Slice, Tensor, TensorData, try_read_sync};

use crate::chunk::{chunk_sizes, offsets};
use crate::collective::OpKind;
use crate::data::ReduceOp;
use crate::group::ProcessGroup;

use super::extension::CollectiveBackend;

/// Every rank's length along a collective's dim: known up front (chunks of a known length), or
/// learned by a forward all-gather and read by its backward.
#[derive(Clone, Default)]
pub struct Sizes(Arc<Mutex<Option<Vec<usize>>>>);

impl Sizes {
    pub fn known(sizes: Vec<usize>) -> Self {
        Self(Arc::new(Mutex::new(Some(sizes))))
    }

    pub fn unknown() -> Self {
        Self::default()
    }

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

/// One collective on a device buffer.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceOp {
    /// Concatenation along `dim` of every rank's piece; rank `j` holds `sizes[j]` rows.
    AllGather {
        dim: usize,
        sizes: Sizes,
    },
    /// Rank `i` keeps the reduction of every rank's slice `i` (of `sizes[i]` rows along `dim`).
    ReduceScatter {
        dim: usize,
        sizes: Sizes,
        op: ReduceOp,
    },
    AllReduce {
        op: ReduceOp,
    },
    /// Slice `j` along `split_dim` (`send_sizes[j]` long) goes to rank `j`; the slices
    /// received are concatenated along `concat_dim`, and their lengths there are learned.
    AllToAll {
        split_dim: usize,
        concat_dim: usize,
        send_sizes: Sizes,
        received: Sizes,
    },
}

impl DeviceOp {
    pub fn kind(&self) -> OpKind {
        match self {
            DeviceOp::AllGather { .. } => OpKind::AllGather,
            DeviceOp::ReduceScatter { .. } => OpKind::ReduceScatter,
            DeviceOp::AllReduce { .. } => OpKind::AllReduce,
            DeviceOp::AllToAll { .. } => OpKind::AllToAll,
        }
    }
}

/// What exchanges a step's bytes.
#[derive(Clone)]
pub enum Exchange {
    /// The group's engine, on the tensor's data read to the host (every backend).
    Host(ProcessGroup),
    /// NCCL on the CUDA buffer (the group belongs to the nccl engine).
    #[cfg(feature = "nccl")]
    Nccl(ProcessGroup),
}

impl Exchange {
    pub fn group(&self) -> &ProcessGroup {
        match self {
            Exchange::Host(g) => g,
            #[cfg(feature = "nccl")]
            Exchange::Nccl(g) => g,
        }
    }
}

impl fmt::Debug for Exchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exchange::Host(g) => write!(f, "host({})", g.label()),
            #[cfg(feature = "nccl")]
            Exchange::Nccl(g) => write!(f, "nccl({})", g.label()),
        }
    }
}

/// Called with the bytes of the tensor at its step (memory accounting).
#[derive(Clone)]
pub struct Observer(Arc<dyn Fn(usize) + Send + Sync>);

impl Observer {
    pub fn new(f: impl Fn(usize) + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
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

/// FSDP2's deferred gradient sync on the device path. While `sync` is off the gradient is
/// added to `pending` and the steps after this one see zeros of `zeros` (shape, dtype) and run
/// only their observers; on the sync step the pending sum joins the gradient.
#[derive(Clone)]
pub struct Deferral {
    pub sync: Arc<AtomicBool>,
    pub pending: DevicePending,
    pub zeros: (Vec<usize>, DType),
    /// Called with the pending bytes before and after the step.
    pub on_change: Arc<dyn Fn(usize, usize) + Send + Sync>,
}

impl fmt::Debug for Deferral {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Deferral(zeros {:?})", self.zeros)
    }
}

/// One step of a device collective.
#[derive(Debug, Clone)]
pub enum DeviceStep {
    /// To this dtype (nothing when the tensor has it already).
    Cast(DType),
    /// Piece `index` along `dim`, the pieces being `sizes` long.
    Piece {
        dim: usize,
        sizes: Sizes,
        index: usize,
    },
    /// A collective.
    Run { op: DeviceOp, exchange: Exchange },
    /// Reports the tensor's bytes; the tensor passes unchanged.
    Observe(Observer),
    /// Defers a gradient while sync is off (see [`Deferral`]).
    Defer(Deferral),
}

/// A differentiable collective: `forward` runs on the input, `backward` on the gradient.
/// With `recompute`, under gradient checkpointing the output is dropped after forward and these
/// steps rebuild it from the input when backward needs it (FSDP's reshard-after-forward).
#[derive(Debug, Clone, Default)]
pub struct DeviceCollective {
    pub forward: Vec<DeviceStep>,
    pub backward: Vec<DeviceStep>,
    pub recompute: Option<Vec<DeviceStep>>,
}

impl DeviceCollective {
    /// Only `steps`, run forward.
    pub(crate) fn steps(steps: Vec<DeviceStep>) -> Self {
        Self {
            forward: steps,
            ..Self::default()
        }
    }

    /// The backward steps as a collective of their own (what the autodiff node runs).
    pub(crate) fn adjoint(&self) -> Option<DeviceCollective> {
        (!self.backward.is_empty()).then(|| Self::steps(self.backward.clone()))
    }

    /// Why a backend without NCCL was handed an NCCL step (the routing rules it out).
    pub(crate) fn unsupported_here(op: &DeviceOp, exchange: &Exchange) -> String {
        format!(
            "{} on group {}: this backend has no NCCL path (only Burn's CUDA backend with the \
             `cuda` feature runs one)",
            op.kind(),
            exchange.group().label()
        )
    }
}

fn bytes_of<B: Backend>(x: &FloatTensor<B>) -> usize {
    x.shape().num_elements() * x.dtype().size()
}

/// Runs `steps` on a backend tensor; the NCCL steps go to the backend's extension.
pub(crate) fn run_steps<B: CollectiveBackend>(
    mut x: FloatTensor<B>,
    steps: &[DeviceStep],
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
            DeviceStep::Cast(dtype) if x.dtype() == *dtype => x,
            DeviceStep::Cast(dtype) => B::float_cast(x, (*dtype).into()),
            DeviceStep::Piece { dim, sizes, index } => {
                let sizes = sizes.expect("slicing this rank's piece");
                piece::<B>(x, *dim, offsets(&sizes)[*index], sizes[*index])
            }
            DeviceStep::Run {
                op,
                exchange: Exchange::Host(group),
            } => run_on_host::<B>(x, op, group),
            #[cfg(feature = "nccl")]
            DeviceStep::Run {
                exchange: Exchange::Nccl(_),
                ..
            } => B::nccl_collective(x, step.clone()),
        };
    }
    x
}

/// `x`'s piece along `dim` from `start`, `len` long.
pub(crate) fn piece<B: Backend>(
    x: FloatTensor<B>,
    dim: usize,
    start: usize,
    len: usize,
) -> FloatTensor<B> {
    let ndim = x.shape().num_dims();
    let slices: Vec<Slice> = (0..ndim)
        .map(|d| match d == dim {
            true => Slice::new(start as isize, Some((start + len) as isize), 1),
            false => Slice::full(),
        })
        .collect();
    B::float_slice(x, &slices)
}

/// A step exchanged by the group's engine. Errors panic: the extension cannot return them, and
/// the launcher turns the panic into this rank's failure (the entry points check what they
/// can first).
fn run_on_host<B: Backend>(
    x: FloatTensor<B>,
    op: &DeviceOp,
    group: &ProcessGroup,
) -> FloatTensor<B> {
    let device = x.device();
    let data = try_read_sync(B::float_into_data(x))
        .expect("synchronous read is supported on CPU backends")
        .expect("reading a tensor for a collective");
    let out = match op {
        DeviceOp::AllGather { dim, sizes } => group.all_gather_sized(data, *dim).map(|(out, s)| {
            sizes.set(s);
            out
        }),
        DeviceOp::ReduceScatter { dim, sizes, op } => {
            let sizes = sizes
                .get()
                .unwrap_or_else(|| chunk_sizes(data.shape()[*dim], group.size()));
            group.reduce_scatter_sizes(data, *dim, &sizes, *op)
        }
        DeviceOp::AllReduce { op } => group.all_reduce(data, *op),
        DeviceOp::AllToAll {
            split_dim,
            concat_dim,
            send_sizes,
            received,
        } => {
            let send = send_sizes.expect("sending pieces of an all_to_all");
            group
                .all_to_all_sized(data, *split_dim, *concat_dim, &send)
                .map(|(out, sizes)| {
                    received.set(sizes);
                    out
                })
        }
    };
    let out: TensorData =
        out.unwrap_or_else(|e| panic!("{} on group {} failed: {e}", op.kind(), group.label()));
    B::float_from_data(out, &device)
}

thread_local! {
    static FORCED: Cell<bool> = const { Cell::new(false) };
}

/// While held, the collectives of this thread (a rank) take the device path on every backend,
/// with the group's engine exchanging where NCCL cannot. For tests of the device path.
#[must_use = "the device path is forced only while the guard lives"]
pub struct ForcedDevicePath {
    previous: bool,
}

/// Forces the device path on this thread until the returned guard drops.
pub fn force_device_path() -> ForcedDevicePath {
    ForcedDevicePath {
        previous: FORCED.with(|f| f.replace(true)),
    }
}

impl Drop for ForcedDevicePath {
    fn drop(&mut self) {
        FORCED.with(|f| f.set(self.previous));
    }
}

/// How a collective of `group` on a tensor on `device` exchanges on the device path: NCCL for
/// a CUDA tensor on an nccl group, the engine when the path is forced, else `None` (the host
/// path).
pub fn route(device: &burn::tensor::Device, group: &ProcessGroup) -> Option<Exchange> {
    #[cfg(feature = "nccl")]
    if is_cuda_device(device) && crate::nccl::nccl_comm(group).is_some() {
        return Some(Exchange::Nccl(group.clone()));
    }
    let _ = device;
    FORCED
        .with(Cell::get)
        .then(|| Exchange::Host(group.clone()))
}

/// Runs the differentiable device collective; the building block of the device branches.
pub fn attach_device<const D: usize>(x: Tensor<D>, op: DeviceCollective) -> Tensor<D> {
    Tensor::from_dispatch(
        <burn::backend::Dispatch as CollectiveBackend>::device_collective(x.into_dispatch(), op),
    )
}

/// Whether `device` is a CUDA device of Burn's CubeCL or LibTorch backend (with or without
/// autodiff).
pub fn is_cuda_device(device: &burn::tensor::Device) -> bool {
    #[cfg(any(feature = "cuda", feature = "tch"))]
    {
        use burn::backend::DispatchDevice;
        let inner = device.clone().inner();
        #[cfg(feature = "cuda")]
        if matches!(
            inner.as_dispatch(),
            DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_))
        ) {
            return true;
        }
        #[cfg(feature = "tch")]
        #[allow(deprecated)] // burn-tch is deprecated in Burn 0.22, still shipped
        if matches!(
            inner.as_dispatch(),
            DispatchDevice::LibTorch(burn_tch::LibTorchDevice::Cuda(_))
        ) {
            return true;
        }
    }
    let _ = device;
    false
}

fn run(op: DeviceOp, exchange: &Exchange) -> DeviceStep {
    DeviceStep::Run {
        op,
        exchange: exchange.clone(),
    }
}

/// The steps of the ops in [`super::ops`], for a tensor that takes the device path.
pub mod pairs {
    use super::*;

    /// Gather along `dim`, in `compute` when given; backward reduces the gradient (in
    /// `reduce` when given) to this rank's piece and returns it in the input's dtype. `sizes`
    /// are every rank's rows when known, else learned forward; `replicas` all-reduces the
    /// reduced gradient (HSDP).
    pub fn gather_mixed(
        dim: usize,
        sizes: Sizes,
        dtypes: MixedDtypes,
        ex: &Exchange,
        replicas: Option<&Exchange>,
    ) -> DeviceCollective {
        let mut forward = Vec::new();
        forward.extend(dtypes.compute.map(DeviceStep::Cast));
        forward.push(run(
            DeviceOp::AllGather {
                dim,
                sizes: sizes.clone(),
            },
            ex,
        ));
        let mut backward = Vec::new();
        backward.extend(dtypes.reduce.map(DeviceStep::Cast));
        backward.push(run(
            DeviceOp::ReduceScatter {
                dim,
                sizes,
                op: ReduceOp::Sum,
            },
            ex,
        ));
        if let Some(r) = replicas {
            backward.push(run(DeviceOp::AllReduce { op: ReduceOp::Sum }, r));
        }
        backward.push(DeviceStep::Cast(dtypes.input));
        DeviceCollective {
            forward,
            backward,
            recompute: None,
        }
    }

    /// This rank's chunk (pad-to-ceil) of `len` rows summed over ranks; backward gathers.
    pub fn reduce_scatter(dim: usize, len: usize, ex: &Exchange) -> DeviceCollective {
        let sizes = Sizes::known(chunk_sizes(len, ex.group().size()));
        DeviceCollective {
            forward: vec![run(
                DeviceOp::ReduceScatter {
                    dim,
                    sizes: sizes.clone(),
                    op: ReduceOp::Sum,
                },
                ex,
            )],
            backward: vec![run(DeviceOp::AllGather { dim, sizes }, ex)],
            recompute: None,
        }
    }

    /// All-reduce forward, identity backward (`reduce_from_group`, or any op detached).
    pub fn all_reduce(op: ReduceOp, ex: &Exchange) -> DeviceCollective {
        DeviceCollective {
            forward: vec![run(DeviceOp::AllReduce { op }, ex)],
            backward: Vec::new(),
            recompute: None,
        }
    }

    /// Identity forward, all-reduce (sum) backward (`copy_to_group`).
    pub fn copy_to_group(ex: &Exchange) -> DeviceCollective {
        DeviceCollective {
            forward: Vec::new(),
            backward: vec![run(DeviceOp::AllReduce { op: ReduceOp::Sum }, ex)],
            recompute: None,
        }
    }

    /// This rank's chunk of `len` rows, no communication; backward gathers.
    pub fn scatter_to_group(dim: usize, len: usize, ex: &Exchange) -> DeviceCollective {
        let g = ex.group();
        let sizes = Sizes::known(chunk_sizes(len, g.size()));
        DeviceCollective {
            forward: vec![DeviceStep::Piece {
                dim,
                sizes: sizes.clone(),
                index: g.index(),
            }],
            backward: vec![run(DeviceOp::AllGather { dim, sizes }, ex)],
            recompute: None,
        }
    }

    /// Pieces of `send_sizes` along `split` to each rank, concatenated along `concat`;
    /// backward sends the gradient's pieces back the other way.
    pub fn all_to_all(
        split: usize,
        concat: usize,
        send_sizes: Vec<usize>,
        ex: &Exchange,
    ) -> DeviceCollective {
        let (sent, received) = (Sizes::known(send_sizes), Sizes::unknown());
        DeviceCollective {
            forward: vec![run(
                DeviceOp::AllToAll {
                    split_dim: split,
                    concat_dim: concat,
                    send_sizes: sent,
                    received: received.clone(),
                },
                ex,
            )],
            backward: vec![run(
                DeviceOp::AllToAll {
                    split_dim: concat,
                    concat_dim: split,
                    send_sizes: received,
                    received: Sizes::unknown(),
                },
                ex,
            )],
            recompute: None,
        }
    }

    /// Gather forward; backward keeps this rank's piece of the gradient.
    pub fn gather_from_group(dim: usize, ex: &Exchange) -> DeviceCollective {
        let sizes = Sizes::unknown();
        DeviceCollective {
            forward: vec![run(
                DeviceOp::AllGather {
                    dim,
                    sizes: sizes.clone(),
                },
                ex,
            )],
            backward: vec![DeviceStep::Piece {
                dim,
                sizes,
                index: ex.group().index(),
            }],
            recompute: None,
        }
    }
}

/// FSDP's dtypes: compute (gather) and reduce, when they differ from the input's, and the
/// input's own dtype, which its gradient returns in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixedDtypes {
    pub compute: Option<DType>,
    pub reduce: Option<DType>,
    pub input: DType,
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)]
    use burn::tensor::Device;

    use super::*;
    use crate::error::CollectiveError;
    use crate::threads::launch;

    /// Without CUDA, a tensor takes the device path only when it is forced, and then the
    /// group's engine exchanges.
    #[test]
    fn routing_takes_nccl_only_for_cuda_tensors_and_is_forced_for_tests() {
        let errors = launch(2, |ctx| {
            let group = ctx.world()?;
            let cpu = Device::ndarray();
            assert!(!is_cuda_device(&cpu));
            assert!(route(&cpu, &group).is_none());
            {
                let _forced = force_device_path();
                assert!(matches!(route(&cpu, &group), Some(Exchange::Host(_))));
            }
            assert!(route(&cpu, &group).is_none());
            Ok::<_, CollectiveError>(())
        });
        assert!(errors.is_ok(), "{errors:?}");
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
