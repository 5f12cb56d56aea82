// NdArray is deprecated in Burn 0.22 but remains our default test backend until 0.23.
#![allow(deprecated)]

//! The Burn backend extension behind every differentiable collective: it runs a
//! [`DeviceCollective`]'s forward steps on the tensor and, on the autodiff backend, records a
//! node whose backward runs the backward steps on the gradient. Only detached data ever
//! crosses ranks (a tracked tensor handed to another rank would merge the two graphs).

use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::retro_forward::RetroForward;
use burn::backend::autodiff::checkpoint::state::BackwardStates;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, unary};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, NdArray, backend_extension};

use crate::device::{DeviceCollective, DeviceStep, NcclCall, Phase, no_nccl, run_steps};

/// A backend that runs [`DeviceCollective`]s on its tensors and, on CUDA backends, NCCL steps
/// on its own buffers.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(feature = "cuda"),
    LibTorch: cfg(feature = "tch")
)]
pub trait CollectiveBackend: Backend {
    /// Runs a collective's forward steps on the tensor; the autodiff backend also records its
    /// backward steps (and its recomputation, under gradient checkpointing).
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        run_steps::<Self>(x, &op.forward, Phase::Forward, Self::nccl_step)
    }

    /// One NCCL collective on the tensor's device buffer. Only the CUDA backends have one;
    /// routing (`device::route`) sends NCCL steps to CUDA tensors only.
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        no_nccl::<Self>(x, call)
    }
}

impl CollectiveBackend for NdArray {}
impl CollectiveBackend for Flex {}

/// LibTorch: NCCL on the tensor's CUDA buffer (see `device::torch`).
#[cfg(feature = "tch")]
impl CollectiveBackend for burn::backend::LibTorch {
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        call.finish(crate::device::torch::run(x, &call.op, &call.group))
    }
}

/// Burn's CUDA backend: NCCL on the tensor's buffer (see `device::cube`).
#[cfg(feature = "cuda")]
impl CollectiveBackend for burn_cubecl::CubeBackend {
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        call.finish(crate::device::cube::run(x, &call.op, &call.group))
    }
}

#[derive(Debug)]
struct DeviceBackward;

impl<B: CollectiveBackend> Backward<B, 1> for DeviceBackward {
    type State = Option<DeviceCollective>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| match state {
            Some(op) => run_steps::<B>(grad, &op.forward, Phase::Backward, B::nccl_step),
            None => grad,
        });
    }
}

/// Rebuilds a dropped output from the input in backward (FSDP's reshard-after-forward).
#[derive(Debug)]
struct Recompute<B> {
    input: NodeId,
    steps: Vec<DeviceStep>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: CollectiveBackend> RetroForward for Recompute<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        let output = run_steps::<B>(input, &self.steps, Phase::Recompute, B::nccl_step);
        states.save(out_node, output);
    }
}

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        let backward = op.adjoint();
        let forward = DeviceCollective::steps(op.forward);
        let compute = |x| B::device_collective(x, forward);
        let Some(steps) = op.recompute else {
            let (primitive, guard) = x.into_parts();
            return match DeviceBackward
                .prepare::<C>([guard])
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish(backward, compute(primitive)),
                OpsKind::UnTracked(prep) => prep.finish(compute(primitive)),
            };
        };
        let retro = Recompute::<B> {
            input: x.id(),
            steps,
            _backend: std::marker::PhantomData,
        };
        match DeviceBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(backward, compute(x.into_primitive())),
            OpsKind::UnTracked(prep) => prep.finish(compute(x.into_primitive())),
        }
    }
}
