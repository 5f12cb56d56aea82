// NdArray is deprecated in Burn 0.22 but remains our default test backend until 0.23.
#![allow(deprecated)]

//! The backend extension behind per-layer activation checkpointing
//! ([`crate::checkpoint`]): a segment node whose backward recomputes the segment and runs its
//! backward there, and tie nodes that hand the segment's parameters their gradients.
//!
//! A segment's forward runs outside the graph, so its parameters are not parents of the segment
//! node. Each trainable parameter is instead tied to the segment's input (`tie(x, p) = x`); the
//! ties sit below the segment, so their backward runs after the segment's, which leaves each
//! parameter's gradient in a [`GradSlot`] for its tie to register. The recomputation runs at the
//! tensor API level (the layer's own forward); its tensors cross between the two levels as
//! [`DispatchTensor`]s of the concrete backend.

use std::sync::{Arc, Mutex};

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Flex, NdArray, TensorMetadata, backend_extension};
use burn::tensor::DispatchTensor;
use burn_dispatch::{BackendTensor, DispatchKindConversion};

/// What a segment's backward runs: the segment again on its input `x`, and the backward of
/// its output against `grad`. It returns the input's gradient and leaves the parameters' in
/// the segment's [`GradSlot`]. Both tensors are of the concrete backend (no autodiff).
pub trait Recompute: Send + Sync + std::fmt::Debug {
    /// The input's gradient (`None` when the input takes none).
    fn backward(&self, x: DispatchTensor, grad: DispatchTensor) -> Option<DispatchTensor>;
}

/// The recomputation a segment node holds.
#[derive(Clone, Debug)]
pub struct Segment(pub Arc<dyn Recompute>);

/// The parameters' gradients of one segment's backward, by tie index, until each tie takes its
/// own.
#[derive(Clone, Debug, Default)]
pub struct GradSlot(Arc<Mutex<Vec<Option<DispatchTensor>>>>);

impl GradSlot {
    /// A slot for `n` parameters.
    pub fn new(n: usize) -> Self {
        Self(Arc::new(Mutex::new(vec![None; n])))
    }

    /// Stores parameter `index`'s gradient.
    pub fn put(&self, index: usize, grad: DispatchTensor) {
        self.0.lock().expect("gradient slot")[index] = Some(grad);
    }

    fn take(&self, index: usize) -> Option<DispatchTensor> {
        self.0.lock().expect("gradient slot")[index].take()
    }
}

/// A backend that records checkpointed segments (on autodiff; elsewhere both ops are the
/// identity on their value).
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait RecomputeBackend: Backend {
    /// `x`; on autodiff a node with parents `x` and `param` whose backward passes `x`'s
    /// gradient on and gives `param` the gradient `slot` holds at `index`.
    fn recompute_tie(
        x: FloatTensor<Self>,
        _param: FloatTensor<Self>,
        _slot: GradSlot,
        _index: usize,
    ) -> FloatTensor<Self> {
        x
    }

    /// `value` (the segment's output, computed outside the graph); on autodiff a node with
    /// parent `x` (the segment's input, which it keeps) whose backward runs `segment`.
    fn recompute_segment(
        _x: FloatTensor<Self>,
        value: FloatTensor<Self>,
        _segment: Segment,
    ) -> FloatTensor<Self> {
        value
    }
}

impl RecomputeBackend for NdArray {}
impl RecomputeBackend for Flex {}
#[cfg(feature = "tch")]
impl RecomputeBackend for burn::backend::LibTorch {}
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl RecomputeBackend for burn_cubecl::Cube {}

impl<B: RecomputeBackend, C: CheckpointStrategy> RecomputeBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn recompute_tie(
        x: FloatTensor<Self>,
        param: FloatTensor<Self>,
        slot: GradSlot,
        index: usize,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (_, param_node) = param.into_parts();
        match TieBackward
            .prepare::<C>([x_node, param_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((slot, index), x),
            OpsKind::UnTracked(prep) => prep.finish(x),
        }
    }

    fn recompute_segment(
        x: FloatTensor<Self>,
        value: FloatTensor<Self>,
        segment: Segment,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let value = value.into_primitive();
        match SegmentBackward
            .prepare::<C>([x_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((x, segment), value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        }
    }
}

/// A concrete backend tensor as a dispatch tensor (no autodiff).
fn to_dispatch<B: Backend>(x: FloatTensor<B>) -> DispatchTensor
where
    DispatchTensor: DispatchKindConversion<B>,
{
    <DispatchTensor as DispatchKindConversion<B>>::from_backend(BackendTensor::Float(x))
}

/// A dispatch tensor of the concrete backend `B` as its primitive. The recomputation returns
/// gradients without autodiff on the segment's own device, so anything else is a bug here.
fn from_dispatch<B: Backend>(x: DispatchTensor) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    match <DispatchTensor as DispatchKindConversion<B>>::try_into_backend(x) {
        Ok(BackendTensor::Float(x)) => x,
        Ok(other) => panic!(
            "a recomputed gradient is a {} tensor, not a float one",
            other.name()
        ),
        Err(e) => panic!("a recomputed gradient is on another backend: {e}"),
    }
}

#[derive(Debug)]
struct TieBackward;

impl<B: Backend> Backward<B, 2> for TieBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = (GradSlot, usize);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (slot, index) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [x, param] = ops.parents;
        if let (Some(param), Some(g)) = (param, slot.take(index)) {
            grads.register::<B>(param.id, from_dispatch::<B>(g));
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, grad);
        }
    }
}

#[derive(Debug)]
struct SegmentBackward;

impl<B: Backend> Backward<B, 1> for SegmentBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = (FloatTensor<B>, Segment);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (x, segment) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let (shape, device, dtype) = (x.shape(), x.device(), x.dtype());
        let dx = segment
            .0
            .backward(to_dispatch::<B>(x), to_dispatch::<B>(grad));
        let Some(parent) = &ops.parents[0] else {
            return;
        };
        // The parent is tracked through the ties even when the segment's own input is not (a
        // first layer after a frozen embedding); the ties still pass a gradient on.
        let dx = match dx {
            Some(dx) => from_dispatch::<B>(dx),
            None => B::float_zeros(shape, &device, dtype.into()),
        };
        grads.register::<B>(parent.id, dx);
    }
}
