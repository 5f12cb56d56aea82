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

use super::device::{DeviceCollective, adjoint_of};

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

    /// Runs a collective on the tensor's device buffer (NCCL on CUDA). The entry points in
    /// [`super::device`] check the device and the group first, so a backend without device
    /// collectives never receives this call.
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        let _ = x;
        panic!("{}", op.unsupported_here())
    }
}

impl CollectiveBackend for NdArray {}
impl CollectiveBackend for Flex {}

/// LibTorch: host collectives only for now. Device collectives would need the tensor's CUDA
/// pointer and libtorch's current stream (`tch` exposes the pointer, not the stream); the
/// default body reports them as unsupported, and the entry points refuse LibTorch devices.
#[cfg(feature = "tch")]
impl CollectiveBackend for burn::backend::LibTorch {}

/// Burn's CUDA backend: device collectives through NCCL (see `crate::nccl::cube`).
#[cfg(feature = "cuda")]
impl CollectiveBackend for burn_cubecl::CubeBackend {
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        crate::nccl::cube::run(x, &op)
            .unwrap_or_else(|e| panic!("{} on group {} failed: {e}", op.op.kind(), op.group))
    }
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

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        let backward = adjoint_of(&op);
        let (primitive, guard) = x.into_parts();
        match DeviceBackward
            .prepare::<C>([guard])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(backward, B::device_collective(primitive, op)),
            OpsKind::UnTracked(prep) => prep.finish(B::device_collective(primitive, op)),
        }
    }

    fn host_collective(x: FloatTensor<Self>, op: HostCollective) -> FloatTensor<Self> {
        let backward = op.backward.clone();
        let inner = HostCollective {
            recompute: None,
            ..op.clone()
        };
        match op.recompute {
            None => {
                let (primitive, guard) = x.into_parts();
                match HostBackward
                    .prepare::<C>([guard])
                    .compute_bound()
                    .stateful()
                {
                    OpsKind::Tracked(prep) => {
                        prep.finish(backward, B::host_collective(primitive, inner))
                    }
                    OpsKind::UnTracked(prep) => prep.finish(B::host_collective(primitive, inner)),
                }
            }
            Some(recompute) => {
                let retro = RetroHost::<B> {
                    input: x.id(),
                    recompute,
                    _backend: std::marker::PhantomData,
                };
                match HostBackward
                    .prepare::<C>([x.node()])
                    .memory_bound()
                    .retro_forward(retro)
                    .parents([&x])
                    .stateful()
                {
                    OpsKind::Tracked(prep) => {
                        prep.finish(backward, B::host_collective(x.into_primitive(), inner))
                    }
                    OpsKind::UnTracked(prep) => {
                        prep.finish(B::host_collective(x.into_primitive(), inner))
                    }
                }
            }
        }
    }
}
