// NdArray is deprecated in Burn 0.22 but remains our default test backend until 0.23.
#![allow(deprecated)]

//! The Burn backend extension behind every differentiable collective.
//!
//! A collective runs on host data (`TensorData`) before the extension is called; the extension
//! only places the result in the autodiff graph with a backward step that runs the adjoint
//! collective. So forward errors are `Result`s, and only detached data ever crosses ranks
//! (a tracked tensor handed to another rank would merge the two graphs).

use std::fmt;
use std::sync::Arc;

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, NdArray, TensorMetadata, backend_extension};
use burn::tensor::{TensorData, try_read_sync};

use super::device::{DeviceCollective, DeviceStep, run_steps};

/// A host-side function of tensor data, run inside backward (or a recomputation). It cannot
/// return an error through Burn's backward pass, so a failing collective panics with its
/// message; the launcher turns that into a failure of the rank.
#[derive(Clone)]
pub struct HostFn(Arc<dyn Fn(TensorData) -> TensorData + Send + Sync>);

impl HostFn {
    pub fn new(f: impl Fn(TensorData) -> TensorData + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    fn call(&self, data: TensorData) -> TensorData {
        (self.0)(data)
    }
}

impl fmt::Debug for HostFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostFn")
    }
}

/// One differentiable collective, already run forward.
#[derive(Clone, Debug)]
pub struct HostCollective {
    /// The forward result; `None` for an identity forward.
    pub output: Option<TensorData>,
    /// Maps the output gradient to the input gradient; `None` for an identity backward.
    pub backward: Option<HostFn>,
    /// Recomputes the output from the input: with gradient checkpointing the output is dropped
    /// after forward and recomputed in backward instead of kept.
    pub recompute: Option<HostFn>,
}

#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(feature = "cuda"),
    LibTorch: cfg(feature = "tch")
)]
pub trait CollectiveBackend: Backend {
    /// Places a host collective's result in the graph.
    fn host_collective(x: FloatTensor<Self>, op: HostCollective) -> FloatTensor<Self> {
        match op.output {
            Some(data) => Self::float_from_data(data, &x.device()),
            None => x,
        }
    }

    /// Runs a device collective's forward steps on the tensor (see [`super::device`]); the
    /// autodiff backend also records its backward steps.
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        run_steps::<Self>(x, &op.forward)
    }

    /// One NCCL step on the tensor's device buffer. Only the CUDA backend has one; the
    /// routing ([`super::device::route`]) sends NCCL steps to CUDA tensors only.
    fn nccl_collective(x: FloatTensor<Self>, step: DeviceStep) -> FloatTensor<Self> {
        let _ = x;
        match &step {
            DeviceStep::Run { op, exchange } => {
                panic!("{}", DeviceCollective::unsupported_here(op, exchange))
            }
            other => panic!("not an NCCL step: {other:?}"),
        }
    }
}

impl CollectiveBackend for NdArray {}
impl CollectiveBackend for Flex {}

/// LibTorch: NCCL on the tensor's CUDA buffer (see `crate::nccl::torch`).
#[cfg(feature = "tch")]
impl CollectiveBackend for burn::backend::LibTorch {
    fn nccl_collective(x: FloatTensor<Self>, step: DeviceStep) -> FloatTensor<Self> {
        run_nccl_step(x, &step, crate::nccl::torch::run)
    }
}

/// Burn's CUDA backend: NCCL on the tensor's buffer (see `crate::nccl::cube`).
#[cfg(feature = "cuda")]
impl CollectiveBackend for burn_cubecl::CubeBackend {
    fn nccl_collective(x: FloatTensor<Self>, step: DeviceStep) -> FloatTensor<Self> {
        run_nccl_step(x, &step, crate::nccl::cube::run)
    }
}

/// Runs an NCCL step with a backend's `run`; a failure panics with the op and the group (the
/// extension cannot return it; the launcher fails the rank).
#[cfg(any(feature = "cuda", feature = "tch"))]
fn run_nccl_step<T>(
    x: T,
    step: &DeviceStep,
    run: impl FnOnce(
        T,
        &super::DeviceOp,
        &crate::group::ProcessGroup,
    ) -> Result<T, crate::error::CollectiveError>,
) -> T {
    let DeviceStep::Run { op, exchange } = step else {
        panic!("not an NCCL step: {step:?}")
    };
    let group = exchange.group();
    run(x, op, group)
        .unwrap_or_else(|e| panic!("{} on group {} failed: {e}", op.kind(), group.label()))
}

fn run_host<B: Backend>(x: FloatTensor<B>, f: &HostFn) -> FloatTensor<B> {
    let device = x.device();
    let data = try_read_sync(B::float_into_data(x))
        .expect("synchronous read is supported on CPU backends")
        .expect("reading a gradient for a collective");
    B::float_from_data(f.call(data), &device)
}

#[derive(Debug)]
struct HostBackward;

impl<B: Backend> Backward<B, 1> for HostBackward {
    type State = Option<HostFn>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| match &state {
            Some(f) => run_host::<B>(grad, f),
            None => grad,
        });
    }
}

#[derive(Debug)]
struct RetroHost<B> {
    input: NodeId,
    recompute: HostFn,
    _backend: std::marker::PhantomData<B>,
}

impl<B: Backend> RetroForward for RetroHost<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        states.save(out_node, run_host::<B>(input, &self.recompute));
    }
}

#[derive(Debug)]
struct DeviceBackward;

impl<B: CollectiveBackend> Backward<B, 1> for DeviceBackward {
    type State = Option<DeviceCollective>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| match state {
            Some(op) => B::device_collective(grad, op),
            None => grad,
        });
    }
}

#[derive(Debug)]
struct RetroDevice<B> {
    input: NodeId,
    steps: Vec<DeviceStep>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: CollectiveBackend> RetroForward for RetroDevice<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        states.save(out_node, run_steps::<B>(input, &self.steps));
    }
}

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        let backward = op.adjoint();
        let forward = DeviceCollective::steps(op.forward);
        let retro = op.recompute.map(|steps| RetroDevice::<B> {
            input: x.id(),
            steps,
            _backend: std::marker::PhantomData,
        });
        place::<B, C, _>(x, DeviceBackward, backward, retro, |x| {
            B::device_collective(x, forward)
        })
    }

    fn host_collective(x: FloatTensor<Self>, op: HostCollective) -> FloatTensor<Self> {
        let backward = op.backward.clone();
        let inner = HostCollective {
            recompute: None,
            ..op.clone()
        };
        let retro = op.recompute.map(|recompute| RetroHost::<B> {
            input: x.id(),
            recompute,
            _backend: std::marker::PhantomData,
        });
        place::<B, C, _>(x, HostBackward, backward, retro, |x| {
            B::host_collective(x, inner)
        })
    }
}

/// Places `compute(x)` in the graph with `node` (and its `state`) as its backward. With
/// `retro`, the output is not kept for backward under checkpointing but recomputed by `retro`.
fn place<B: Backend, C: CheckpointStrategy, N: Backward<B, 1>>(
    x: FloatTensor<Autodiff<B, C>>,
    node: N,
    state: N::State,
    retro: Option<impl RetroForward>,
    compute: impl FnOnce(FloatTensor<B>) -> FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match retro {
        None => {
            let (primitive, guard) = x.into_parts();
            match node.prepare::<C>([guard]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => prep.finish(state, compute(primitive)),
                OpsKind::UnTracked(prep) => prep.finish(compute(primitive)),
            }
        }
        Some(retro) => {
            match node
                .prepare::<C>([x.node()])
                .memory_bound()
                .retro_forward(retro)
                .parents([&x])
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(state, compute(x.into_primitive())),
                OpsKind::UnTracked(prep) => prep.finish(compute(x.into_primitive())),
            }
        }
    }
}
