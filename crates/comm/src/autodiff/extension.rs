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

use std::ops::Range;

use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::backend::{AutodiffBackend, Dispatch, TensorMetadata};
use burn::tensor::{DType, Shape, Slice, TensorData, bf16, f16};

use super::hub::SplitHub;
use super::placement::Placement;
use crate::device::decode::decode;
use crate::device::{
    CodedWeight, DeviceCollective, DeviceStep, NcclCall, Phase, Prefetch, RebuildSteps,
    StepKernels, cast_flex, decode_flex, no_nccl, run_steps,
};
use crate::linear::LinearBackend;

/// A backend that runs [`DeviceCollective`]s on its tensors and, on CUDA backends, NCCL steps
/// on its own buffers.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait CollectiveBackend: LinearBackend {
    /// Runs a collective's forward steps on the tensor; the autodiff backend also records its
    /// backward steps (and its recomputation, under gradient checkpointing).
    fn device_collective(x: FloatTensor<Self>, op: DeviceCollective) -> FloatTensor<Self> {
        run_steps::<Self>(x, &op.forward, Phase::Forward, kernels::<Self>())
    }

    /// One NCCL collective on the tensor's device buffer. Only the CUDA backends have one;
    /// routing (`device::route`) sends NCCL steps to CUDA tensors only.
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        no_nccl::<Self>(x, call)
    }

    /// The weight of 4-bit packed blocks ([`DeviceStep::Decode`]): Burn's plain ops
    /// ([`decode`]); flex decodes in one pass ([`decode_flex`]).
    fn decode_packed(x: FloatTensor<Self>, weight: CodedWeight) -> FloatTensor<Self> {
        decode::<Self>(x, &weight)
    }

    /// `x` in another float dtype ([`DeviceStep::Cast`], the mixed-precision casts): Burn's
    /// cast; flex converts f32 and bf16 in vectorized chunks ([`cast_flex`]).
    fn cast_step(x: FloatTensor<Self>, dtype: DType) -> FloatTensor<Self> {
        Self::float_cast(x, dtype.into())
    }

    /// The hub of a split (`split::split_views`): the tensor itself; on the autodiff backend, a
    /// node that gathers its views' gradients into one.
    fn split_hub(x: FloatTensor<Self>, _hub: SplitHub) -> FloatTensor<Self> {
        x
    }

    /// A 1-D tensor's elements `segments`, back to back (a slice when there is one); on the
    /// autodiff backend its gradient goes to the hub.
    fn split_piece(
        x: FloatTensor<Self>,
        _hub: SplitHub,
        segments: Vec<Range<usize>>,
    ) -> FloatTensor<Self> {
        segments_of::<Self>(x, &segments)
    }

    /// `linear(x, w)` without bias. On the autodiff backend, with `rebuild`, the node keeps
    /// `source` and the steps that rebuild `w` from it rather than `w` itself, and backward
    /// rebuilds `w` for the input gradient (see
    /// [`resharded_linear`](crate::autodiff::resharded_linear)). Elsewhere `source` is not read.
    fn resharded_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        _source: FloatTensor<Self>,
        _rebuild: Option<RebuildSteps>,
    ) -> FloatTensor<Self> {
        Self::linear_forward(x, w)
    }

    /// The tensor itself; on the autodiff backend, a node whose backward issues `prefetches`
    /// before passing the gradient on (backward prefetch, see [`Prefetch`]).
    fn prefetch_marker(x: FloatTensor<Self>, _prefetches: Vec<Prefetch>) -> FloatTensor<Self> {
        x
    }

    /// `x` itself; on the autodiff backend, a node below `anchor` too, whose backward passes the
    /// gradient to `x` unchanged and gives `anchor` an exact zero (see
    /// [`order_after`](crate::autodiff::order::order_after)).
    fn order_after(x: FloatTensor<Self>, _anchor: FloatTensor<Self>) -> FloatTensor<Self> {
        x
    }

    /// `len` zeros (1-D) in `like`'s dtype and on its device: the buffer `place::place_flat`
    /// writes pieces into. Flex allocates them zeroed in one pass (its `float_zeros` copies a
    /// fresh zeroed buffer once more to align it: a second pass over a unit's buffer every
    /// step); untracked on the autodiff backend.
    fn flat_zeros(like: FloatTensor<Self>, len: usize) -> FloatTensor<Self> {
        let dtype = like.dtype().into();
        Self::float_zeros(Shape::new([len]), &like.device(), dtype)
    }

    /// `acc` (1-D) with `piece` written at `place.offset`, one step of `place::place_flat`
    /// (in place where the backend owns `acc` alone); on the autodiff backend a node that
    /// gradient checkpointing recomputes rather than keeps.
    fn place_piece(
        acc: FloatTensor<Self>,
        piece: FloatTensor<Self>,
        place: Placement,
    ) -> FloatTensor<Self> {
        if place.len == 0 {
            return acc;
        }
        let end = place.offset + place.len;
        Self::float_slice_assign(acc, &[Slice::from(place.offset..end)], piece)
    }
}

/// `x`'s `segments` back to back: a slice of one, a concatenation of several.
fn segments_of<B: Backend>(x: FloatTensor<B>, segments: &[Range<usize>]) -> FloatTensor<B> {
    let slice = |x: FloatTensor<B>, r: &Range<usize>| B::float_slice(x, &[Slice::from(r.clone())]);
    match segments {
        [one] => slice(x, one),
        _ => B::float_cat(segments.iter().map(|r| slice(x.clone(), r)).collect(), 0),
    }
}

/// The backend's NCCL step, decode and cast, for [`run_steps`].
fn kernels<B: CollectiveBackend>() -> StepKernels<B> {
    StepKernels {
        nccl: B::nccl_step,
        decode: B::decode_packed,
        cast: B::cast_step,
    }
}

impl CollectiveBackend for NdArray {}

impl CollectiveBackend for Flex {
    fn decode_packed(x: FloatTensor<Self>, weight: CodedWeight) -> FloatTensor<Self> {
        decode_flex(x, &weight)
    }

    fn cast_step(x: FloatTensor<Self>, dtype: DType) -> FloatTensor<Self> {
        cast_flex(x, dtype)
    }

    fn flat_zeros(like: FloatTensor<Self>, len: usize) -> FloatTensor<Self> {
        let data = match like.dtype() {
            DType::F32 => TensorData::new(vec![0f32; len], [len]),
            DType::BF16 => TensorData::new(vec![bf16::ZERO; len], [len]),
            DType::F16 => TensorData::new(vec![f16::ZERO; len], [len]),
            DType::F64 => TensorData::new(vec![0f64; len], [len]),
            other => return Self::float_zeros(Shape::new([len]), &like.device(), other.into()),
        };
        FlexTensor::from_data(data)
    }
}

/// LibTorch: NCCL on the tensor's CUDA buffer (see `device::torch`).
#[cfg(feature = "tch")]
impl CollectiveBackend for burn::backend::LibTorch {
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        call.finish(crate::device::torch::run(x, &call.op, &call.group))
    }
}

/// Burn's CUDA backend: NCCL on the tensor's buffer (see `device::cube`). With the `fusion`
/// feature `Cube` is Burn's fusion backend over it: the step is a fusion boundary
/// (`device::fused`).
#[cfg(feature = "cuda")]
impl CollectiveBackend for burn_cubecl::Cube {
    fn nccl_step(x: FloatTensor<Self>, call: NcclCall) -> FloatTensor<Self> {
        #[cfg(feature = "fusion")]
        let result = crate::device::fused::on_inner(x, |x| {
            crate::device::cube::run(x, &call.op, &call.group)
        });
        #[cfg(not(feature = "fusion"))]
        let result = crate::device::cube::run(x, &call.op, &call.group);
        call.finish(result)
    }
}

/// Burn's CubeCL backend built for wgpu alone: its tensors exchange through the group's engine
/// (`device::route` sends NCCL steps to CUDA tensors only), so it has no NCCL step. The engine
/// path reads the tensor's values, which flushes a fusion stream first.
#[cfg(all(feature = "wgpu", not(feature = "cuda")))]
impl CollectiveBackend for burn_cubecl::Cube {}

#[derive(Debug)]
struct DeviceBackward;

impl<B: CollectiveBackend> Backward<B, 1> for DeviceBackward {
    type State = Option<DeviceCollective>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let state = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| match state {
            Some(op) => run_steps::<B>(grad, &op.forward, Phase::Backward, kernels::<B>()),
            None => grad,
        });
    }
}

/// Rebuilds a dropped output from the input in backward (FSDP's reshard-after-forward), or
/// finishes the same rebuild issued ahead by backward prefetch.
#[derive(Debug)]
struct Recompute<B> {
    input: NodeId,
    steps: Vec<DeviceStep>,
    prefetch: Option<Prefetch>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: CollectiveBackend> RetroForward for Recompute<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        let output = match &self.prefetch {
            Some(p) => run_steps::<B>(
                input,
                &p.finish_steps(&self.steps),
                Phase::Recompute,
                kernels::<B>(),
            ),
            None => run_steps::<B>(input, &self.steps, Phase::Recompute, kernels::<B>()),
        };
        states.save(out_node, output);
    }
}

/// A prefetch marker's backward: issues the prefetches, passes the gradient unchanged.
#[derive(Debug)]
struct PrefetchBackward;

impl<B: CollectiveBackend> Backward<B, 1> for PrefetchBackward {
    type State = Vec<Prefetch>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        ops.state
            .iter()
            .for_each(|prefetch| prefetch.issue(kernels::<Dispatch>()));
        unary::<B, _>(ops.parents, ops.node, grads, |grad| grad);
    }
}

/// An order marker's backward: the gradient to `x` unchanged; to the anchor, zeros of its
/// shape, dtype and device, made without reading the gradient.
#[derive(Debug)]
struct OrderBackward;

impl<B: CollectiveBackend> Backward<B, 2> for OrderBackward {
    type State = (burn::tensor::Shape, burn::tensor::DType, B::Device);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (shape, dtype, device) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [x, anchor] = ops.parents;
        if let Some(anchor) = anchor {
            grads.register::<B>(anchor.id, B::float_zeros(shape, &device, dtype.into()));
        }
        if let Some(x) = x {
            grads.register::<B>(x.id, grad);
        }
    }
}

/// What a resharded linear's backward multiplies the gradient by: the weight itself, or how to
/// gather it again.
#[derive(Debug, Clone)]
enum LinearWeight<B: Backend> {
    Kept(FloatTensor<B>),
    Rebuilt {
        source: FloatTensor<B>,
        shape: burn::tensor::Shape,
        rebuild: RebuildSteps,
    },
}

impl<B: CollectiveBackend> LinearWeight<B> {
    /// The weight: kept, or rebuilt now from the source (a collective: every rank's backward
    /// reaches it in the same order, as every rank built the same graph).
    fn weight(&self) -> FloatTensor<B> {
        match self {
            Self::Kept(w) => w.clone(),
            Self::Rebuilt {
                source,
                shape,
                rebuild,
            } => {
                let steps = match &rebuild.prefetch {
                    Some(p) => p.finish_steps(&rebuild.steps),
                    None => rebuild.steps.clone(),
                };
                let flat = run_steps::<B>(source.clone(), &steps, Phase::Recompute, kernels::<B>());
                B::float_reshape(flat, shape.clone())
            }
        }
    }

    /// Called once the weight [`weight`](Self::weight) returned has been dropped.
    fn released(&self) {
        if let Self::Rebuilt { rebuild, .. } = self {
            rebuild.released();
        }
    }
}

/// A resharded linear's backward: the input gradient from the weight it rebuilds (or kept),
/// the weight gradient from the kept input, each with the backend's linear kernels.
#[derive(Debug)]
struct ReshardedLinearBackward;

impl<B: CollectiveBackend> Backward<B, 2> for ReshardedLinearBackward {
    type State = (Option<FloatTensor<B>>, Option<LinearWeight<B>>);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (input, weight) = ops.state;
        let [x_node, w_node] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        if let (Some(node), Some(input)) = (w_node, input) {
            grads.register::<B>(node.id, B::linear_weight_grad(input, grad.clone()));
        }
        if let (Some(node), Some(weight)) = (x_node, weight) {
            let mut w = weight.weight();
            // A shard offloaded to the host is gathered there, then moved.
            if w.device() != grad.device() {
                w = B::float_to_device(w, &grad.device());
            }
            let grad = B::linear_input_grad(w, grad);
            weight.released();
            grads.register::<B>(node.id, grad);
        }
    }
}

/// The hub's backward: the views' gradients, in place in one tensor of the input's length.
#[derive(Debug)]
struct HubBackward;

impl<B: CollectiveBackend> Backward<B, 1> for HubBackward {
    type State = (SplitHub, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (hub, len) = ops.state;
        // The views' one-element markers: they only made this node run.
        let marker = grads.consume::<B>(&ops.node);
        let Some(parent) = &ops.parents[0] else {
            return;
        };
        let pieces = segment_gradients::<B>(hub.take::<FloatTensor<B>>());
        let device = marker.device();
        let dtype = pieces.first().map_or(marker.dtype(), |(_, g)| g.dtype());
        let zeros = |n: usize| B::float_zeros([n].into(), &device, dtype.into());
        let mut parts = Vec::with_capacity(2 * pieces.len() + 1);
        let mut at = 0;
        for (start, grad) in pieces {
            if start > at {
                parts.push(zeros(start - at));
            }
            at = start + grad.shape().num_elements();
            parts.push(grad);
        }
        if at < len {
            parts.push(zeros(len - at));
        }
        let grad = match parts.len() {
            1 => parts.pop().expect("one part"),
            _ => B::float_cat(parts, 0),
        };
        grads.register::<B>(parent.id, grad);
    }
}

/// Each view's gradient cut at its segments' bounds, as (start in the input, gradient) in
/// input order.
fn segment_gradients<B: Backend>(
    views: Vec<(Vec<Range<usize>>, FloatTensor<B>)>,
) -> Vec<(usize, FloatTensor<B>)> {
    let mut pieces = Vec::new();
    for (segments, grad) in views {
        if let [one] = segments.as_slice() {
            pieces.push((one.start, grad));
            continue;
        }
        let mut at = 0;
        for r in segments {
            let part = at..at + r.len();
            pieces.push((r.start, B::float_slice(grad.clone(), &[Slice::from(part)])));
            at += r.len();
        }
    }
    pieces.sort_by_key(|(start, _)| *start);
    pieces
}

/// A view's backward: its gradient goes to the hub, and a one-element marker to the hub node.
#[derive(Debug)]
struct PieceBackward;

impl<B: CollectiveBackend> Backward<B, 1> for PieceBackward {
    type State = (SplitHub, Vec<Range<usize>>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (hub, segments) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        if let Some(parent) = &ops.parents[0] {
            let marker = B::float_zeros([1].into(), &grad.device(), grad.dtype().into());
            hub.deposit(segments, grad);
            grads.register::<B>(parent.id, marker);
        }
    }
}

/// Recomputes a dropped output from its input's state: the hub (identity) or a view (its
/// segments).
#[derive(Debug)]
struct RetroSplit<B> {
    input: NodeId,
    segments: Option<Vec<Range<usize>>>,
    _backend: std::marker::PhantomData<B>,
}

impl<B: CollectiveBackend> RetroForward for RetroSplit<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let input = states.get_state::<FloatTensor<B>>(&self.input);
        let output = match &self.segments {
            Some(segments) => segments_of::<B>(input, segments),
            None => input,
        };
        states.save(out_node, output);
    }
}

/// A placement's backward: the piece gets its range of the gradient, and the buffer before the
/// placement the whole gradient (that range of it held zeros, which no other placement reads:
/// `place_flat`'s pieces do not overlap).
#[derive(Debug)]
struct PlaceBackward;

impl<B: CollectiveBackend> Backward<B, 2> for PlaceBackward {
    type State = Placement;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let place = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [acc, piece] = ops.parents;
        if let Some(piece) = piece {
            // An empty piece (a rank with no rows of a parameter) gets an empty gradient: Burn
            // has no empty slice, and the steps below it expect one.
            let piece_grad = match place.len {
                0 => B::float_zeros([0].into(), &grad.device(), grad.dtype().into()),
                len => {
                    let range = place.offset..place.offset + len;
                    B::float_slice(grad.clone(), &[Slice::from(range)])
                }
            };
            grads.register::<B>(piece.id, piece_grad);
        }
        if let Some(acc) = acc {
            grads.register::<B>(acc.id, grad);
        }
    }
}

/// Where a recomputed placement reads an input: a tracked input's saved state, or an untracked
/// one itself (a frozen parameter), which the graph does not save.
#[derive(Debug)]
enum Source<B: Backend> {
    Node(NodeId),
    Value(FloatTensor<B>),
}

/// Rebuilds a dropped placement from its inputs.
#[derive(Debug)]
struct RetroPlace<B: Backend> {
    /// The buffer's node; `None`: the first placement, into zeros of `place.total`.
    acc: Option<NodeId>,
    piece: Source<B>,
    place: Placement,
}

impl<B: CollectiveBackend> RetroForward for RetroPlace<B> {
    fn forward(&self, states: &mut BackwardStates, out_node: NodeId) {
        let piece = match &self.piece {
            Source::Node(id) => states.get_state::<FloatTensor<B>>(id),
            Source::Value(v) => v.clone(),
        };
        let acc = match self.acc {
            Some(id) => states.get_state::<FloatTensor<B>>(&id),
            None => B::float_zeros(
                [self.place.total].into(),
                &piece.device(),
                piece.dtype().into(),
            ),
        };
        states.save(out_node, B::place_piece(acc, piece, self.place));
    }
}

impl<B: CollectiveBackend, C: CheckpointStrategy> CollectiveBackend for Autodiff<B, C> {
    fn flat_zeros(like: FloatTensor<Self>, len: usize) -> FloatTensor<Self> {
        Self::from_inner(B::flat_zeros(Self::inner(like), len))
    }

    fn place_piece(
        acc: FloatTensor<Self>,
        piece: FloatTensor<Self>,
        place: Placement,
    ) -> FloatTensor<Self> {
        let source = |t: &FloatTensor<Self>| match t.is_tracked() {
            true => Source::Node(t.id()),
            false => Source::Value(t.primitive().clone()),
        };
        let retro = RetroPlace::<B> {
            // A first piece's buffer is untracked zeros, rebuilt rather than kept.
            acc: acc.is_tracked().then(|| acc.id()),
            piece: source(&piece),
            place,
        };
        let tracked = [&acc, &piece].into_iter().filter(|t| t.is_tracked());
        match PlaceBackward
            .prepare::<C>([acc.node(), piece.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents(tracked)
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                place,
                B::place_piece(acc.into_primitive(), piece.into_primitive(), place),
            ),
            OpsKind::UnTracked(prep) => prep.finish(B::place_piece(
                acc.into_primitive(),
                piece.into_primitive(),
                place,
            )),
        }
    }

    fn resharded_linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        source: FloatTensor<Self>,
        rebuild: Option<RebuildSteps>,
    ) -> FloatTensor<Self> {
        let x_tracked = x.is_tracked();
        let w_tracked = w.is_tracked();
        let (x, x_node) = x.into_parts();
        let (w, w_node) = w.into_parts();
        let prefetch = rebuild.as_ref().and_then(|r| r.prefetch.clone());
        // As Burn's linear: the input is kept for the weight gradient, the weight (here, how
        // to get it again) for the input gradient.
        let weight = x_tracked.then(|| match rebuild {
            Some(rebuild) => LinearWeight::Rebuilt {
                source: source.into_primitive(),
                shape: w.shape(),
                rebuild,
            },
            None => LinearWeight::Kept(w.clone()),
        });
        let input = w_tracked.then(|| x.clone());
        let output = B::linear_forward(x, w);
        match ReshardedLinearBackward
            .prepare::<C>([x_node, w_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                if weight.is_some() {
                    prefetch.iter().for_each(Prefetch::arm);
                }
                prep.finish((input, weight), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        }
    }

    fn prefetch_marker(x: FloatTensor<Self>, prefetches: Vec<Prefetch>) -> FloatTensor<Self> {
        let retro = RetroSplit::<B> {
            input: x.id(),
            segments: None,
            _backend: std::marker::PhantomData,
        };
        match PrefetchBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(prefetches, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }

    fn order_after(x: FloatTensor<Self>, anchor: FloatTensor<Self>) -> FloatTensor<Self> {
        let retro = RetroSplit::<B> {
            input: x.id(),
            segments: None,
            _backend: std::marker::PhantomData,
        };
        let anchor_meta = (anchor.shape(), anchor.dtype(), anchor.primitive().device());
        match OrderBackward
            .prepare::<C>([x.node(), anchor.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x, &anchor])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(anchor_meta, x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }

    fn split_hub(x: FloatTensor<Self>, hub: SplitHub) -> FloatTensor<Self> {
        let len = x.shape().num_elements();
        let retro = RetroSplit::<B> {
            input: x.id(),
            segments: None,
            _backend: std::marker::PhantomData,
        };
        match HubBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((hub, len), x.into_primitive()),
            OpsKind::UnTracked(prep) => prep.finish(x.into_primitive()),
        }
    }

    fn split_piece(
        x: FloatTensor<Self>,
        hub: SplitHub,
        segments: Vec<Range<usize>>,
    ) -> FloatTensor<Self> {
        let retro = RetroSplit::<B> {
            input: x.id(),
            segments: Some(segments.clone()),
            _backend: std::marker::PhantomData,
        };
        let view = |x| segments_of::<B>(x, &segments);
        match PieceBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = view(x.into_primitive());
                prep.finish((hub, segments), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(view(x.into_primitive())),
        }
    }

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
            prefetch: op.prefetch.clone(),
            _backend: std::marker::PhantomData,
        };
        match DeviceBackward
            .prepare::<C>([x.node()])
            .memory_bound()
            .retro_forward(retro)
            .parents([&x])
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                op.prefetch.iter().for_each(Prefetch::arm);
                prep.finish(backward, compute(x.into_primitive()))
            }
            OpsKind::UnTracked(prep) => prep.finish(compute(x.into_primitive())),
        }
    }
}
