//! Differentiable collectives on Burn tensors, each paired with its adjoint:
//!
//! | forward            | backward                          |
//! |--------------------|-----------------------------------|
//! | all_gather         | reduce_scatter (sum) to the rank's piece |
//! | reduce_scatter     | all_gather                        |
//! | copy_to_group      | all_reduce (sum)                  |
//! | reduce_from_group  | identity                          |
//! | scatter_to_group   | all_gather                        |
//! | gather_from_group  | the rank's slice of the gradient  |
//! | all_to_all         | the inverse all_to_all            |
//!
//! They work with and without autodiff, on every backend the extension lists. Gradients are
//! summed, never averaged: data-parallel averaging is the caller's choice.
//!
//! Each op is one step list ([`crate::device::pairs`]): a CUDA tensor on a group of the nccl
//! engine exchanges through NCCL on its own buffer, every other tensor through the group's
//! engine on its data. The steps around the exchange are the same everywhere.
//!
//! Every rank must build its own autodiff tensors. An autodiff tensor shared by two rank
//! threads joins their graphs under one lock, and a collective in one rank's backward then
//! waits for a rank that cannot enter its own backward. Share `TensorData` (or plain tensors)
//! and create the tracked tensors on each rank.

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor, TensorData};

use crate::device::pairs::{self, MixedDtypes};
use crate::device::{
    CodedWeight, DeviceCollective, DeviceOp, DeviceStep, InFlight, Prefetch, RebuildSteps, Sizes,
    route,
};
use crate::transport::collective::OpKind;
use crate::transport::data::ReduceOp;
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;

use super::extension::CollectiveBackend;

type Result<T> = std::result::Result<T, CollectiveError>;

/// Runs a collective's steps on `x` and places it in the autodiff graph: the building block of
/// every op here, public so that strategies (FSDP's parameter gather) define their own lists.
pub fn attach<const D: usize>(x: Tensor<D>, op: DeviceCollective) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::device_collective(
        x.into_dispatch(),
        op,
    ))
}

/// Runs `op` on `x` and places it in the autodiff graph, returning a failing forward exchange
/// as an error: the first engine exchange runs before the op is attached (the steps before it
/// run untracked), which is where the errors a caller can act on arise (mismatched shapes
/// between ranks, a failed rank). NCCL exchanges run inside the op and panic on failure.
pub fn attach_checked<const D: usize>(x: Tensor<D>, op: DeviceCollective) -> Result<Tensor<D>> {
    let (op, _) = issue_first(&x, op, InFlight::run)?;
    Ok(attach(x, op))
}

/// `op` with its first engine exchange issued on `x` by `issue`, and that exchange.
fn issue_first<const D: usize>(
    x: &Tensor<D>,
    op: DeviceCollective,
    issue: impl FnOnce(DeviceOp, TensorData, &ProcessGroup) -> Result<InFlight>,
) -> Result<(DeviceCollective, Option<InFlight>)> {
    let Some((prefix, first, group)) = op.engine_prefix() else {
        return Ok((op, None));
    };
    let input = attach(x.clone().detach(), DeviceCollective::steps(prefix.to_vec()));
    let issued = issue(first.clone(), input.into_data(), group)?;
    Ok((op.awaiting(issued.clone()), Some(issued)))
}

/// A collective whose forward exchange was issued ahead of its use (prefetch): the exchange runs
/// while the rank computes; [`Started::finish`] waits for it. Exchanges that cannot be issued
/// ahead (NCCL: CubeCL and tch hide their streams) run when finished.
#[must_use = "finish() the collective to use its result"]
pub struct Started<const D: usize> {
    x: Tensor<D>,
    op: DeviceCollective,
    in_flight: Option<InFlight>,
}

impl<const D: usize> Started<D> {
    /// Issues `op`'s first exchange on `x` now.
    pub fn new(x: Tensor<D>, op: DeviceCollective) -> Self {
        let started = |op, data, group: &ProcessGroup| Ok(InFlight::start(op, data, group));
        let (op, in_flight) = issue_first(&x, op, started).expect("starting does not fail");
        Self { x, op, in_flight }
    }

    /// Whether the exchange has finished (finishing would not wait for it).
    pub fn is_done(&self) -> bool {
        self.in_flight.as_ref().is_none_or(InFlight::is_done)
    }

    /// Waits for the exchange and places the result in the autodiff graph. A failed exchange
    /// panics, as it would inside backward (the launcher fails the rank).
    pub fn finish(self) -> Tensor<D> {
        attach(self.x, self.op)
    }
}

/// Checks that `dim` exists in a `D`-d tensor, for a gather on `group`.
pub fn check_gather_dim<const D: usize>(group: &ProcessGroup, dim: usize) -> Result<()> {
    check_dim::<D>(OpKind::AllGather, group, dim)
}

fn check_dim<const D: usize>(op: OpKind, group: &ProcessGroup, dim: usize) -> Result<()> {
    if dim < D {
        Ok(())
    } else {
        Err(CollectiveError::InvalidArgument {
            op: op.name().into(),
            group: group.label().into(),
            message: format!("dim {dim} is out of range for a {D}-d tensor"),
        })
    }
}

/// Concatenation along `dim` of every rank's tensor (sizes may differ). Backward: each rank
/// gets the sum over ranks of its piece of the output gradient.
pub fn all_gather<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    all_gather_with(x, group, dim, GatherOptions::default())
}

/// As [`all_gather`], but under gradient checkpointing the gathered tensor is not kept for
/// backward: it is dropped after forward and gathered again when backward needs it (FSDP's
/// reshard-after-forward). Without checkpointing it behaves exactly like `all_gather`.
pub fn all_gather_recompute<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    let options = GatherOptions {
        recompute: true,
        ..GatherOptions::default()
    };
    all_gather_with(x, group, dim, options)
}

/// How [`all_gather_with`] gathers: FSDP's parameter all-gather with its mixed-precision policy.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct GatherOptions {
    /// Drop the result after forward and gather again in backward (under checkpointing).
    pub recompute: bool,
    /// Gather (and so compute) in this dtype; the input keeps its own (FSDP2's param_dtype).
    pub compute_dtype: Option<DType>,
    /// Reduce-scatter the gradient in this dtype (FSDP2's reduce_dtype). The gradient reaching
    /// the input is in the input's dtype, converted once after the reduction.
    pub reduce_dtype: Option<DType>,
}

/// The step list of [`all_gather_with`].
fn gather_op<const D: usize>(
    x: &Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    options: GatherOptions,
) -> Result<DeviceCollective> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    let dtypes = MixedDtypes {
        compute: options.compute_dtype,
        reduce: options.reduce_dtype,
        input: x.dtype(),
    };
    let ex = route(&x.device(), group);
    let mut op = pairs::gather_mixed(dim, Sizes::unknown(), dtypes, &ex);
    op.recompute = options.recompute.then(|| op.forward.clone());
    Ok(op)
}

/// [`all_gather`] with options: recomputation and a mixed-precision policy.
pub fn all_gather_with<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    options: GatherOptions,
) -> Result<Tensor<D>> {
    let op = gather_op(&x, group, dim, options)?;
    attach_checked(x, op)
}

/// Starts [`all_gather_with`] without waiting: the gather runs while the caller computes, and
/// [`Started::finish`] returns the differentiable result (prefetch).
pub fn start_all_gather<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    options: GatherOptions,
) -> Result<Started<D>> {
    let op = gather_op(&x, group, dim, options)?;
    Ok(Started::new(x, op))
}

/// How backward gets a weight again for [`resharded_linear`]: this rank's source (its shard,
/// flattened) and the steps that gather the weight from it.
#[derive(Debug, Clone)]
pub struct WeightRebuild {
    /// This rank's part of the weight, flattened, on the compute device.
    pub source: Tensor<1>,
    /// The steps from `source` to the flattened weight.
    pub rebuild: RebuildSteps,
}

/// `linear(x, weight)` without bias. With `rebuild`, autodiff keeps the weight's shard and
/// gathers the weight again when backward needs it for the input gradient, rather than keeping
/// the gathered weight alive from forward until then (FSDP2's reshard after forward, on any
/// device: Burn's own linear would keep it). A tracked `weight` (a trainable FSDP parameter)
/// gets its gradient as Burn's linear gives it, and passes it on to its gather's backward.
/// Without `rebuild`, [`linear`](crate::linear::linear). The products are the backend's
/// [`LinearBackend`](crate::linear::LinearBackend) kernels either way.
pub fn resharded_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    rebuild: Option<WeightRebuild>,
) -> Tensor<D> {
    let Some(WeightRebuild { source, rebuild }) = rebuild else {
        return crate::linear::linear(x, weight, None);
    };
    if D == 1 {
        // Burn's linear adds a batch dimension to 1-d input; so does this.
        let d_in = x.dims()[0];
        let y: Tensor<2> = resharded_linear(
            x.reshape([1, d_in]),
            weight,
            Some(WeightRebuild { source, rebuild }),
        );
        let d_out = y.dims()[1];
        return Tensor::from_dispatch(y.reshape([d_out]).into_dispatch());
    }
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::resharded_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        source.into_dispatch(),
        Some(rebuild),
    ))
}

/// `x` unchanged, with a node whose backward issues `prefetches` before passing the gradient
/// on: placed on a unit's output, it issues the gathers that the backward of the unit and of
/// the units before it will run, while backward is still above them (FSDP2's backward
/// prefetch). Issuing is collective: every rank places the same markers. Without autodiff, or
/// on an untracked `x`, nothing is recorded.
pub fn prefetch_on_backward<const D: usize>(x: Tensor<D>, prefetches: Vec<Prefetch>) -> Tensor<D> {
    if prefetches.is_empty() {
        return x;
    }
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::prefetch_marker(
        x.into_dispatch(),
        prefetches,
    ))
}

/// The weight `[d_in, d_out]` of 4-bit packed blocks (see [`crate::device::decode`]), as a
/// value outside the autodiff graph: a quantized weight takes no gradient. Pass the same
/// [`CodedWeight`] as a [`DeviceStep::Decode`] step of [`resharded_linear`]'s rebuild so that
/// backward decodes it again rather than keeping it. Panics when `packed` is not f32 or not of
/// `weight.packed_shape()`: both are fixed where the weight is packed.
pub fn decode_weight(packed: Tensor<2>, weight: &CodedWeight) -> Tensor<2> {
    let n = packed.shape().num_elements();
    let op = DeviceCollective::steps(vec![DeviceStep::Decode(weight.clone())]);
    attach(packed.detach().reshape([n]), op).reshape([weight.d_in, weight.d_out])
}

/// Rank `i` gets the sum over ranks of chunk `i` along `dim` (pad-to-ceil chunks, FSDP2's).
/// Backward: all-gather of the output gradient.
pub fn reduce_scatter<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::ReduceScatter, group, dim)?;
    let op = pairs::reduce_scatter(dim, x.dims()[dim], &route(&x.device(), group));
    attach_checked(x, op)
}

/// Identity forward; backward sums the gradient over the group (Megatron's `f`, the input of
/// a column-parallel layer).
pub fn copy_to_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    let op = pairs::copy_to_group(&route(&x.device(), group));
    attach(x, op)
}

/// Sum over the group forward; identity backward (Megatron's `g`, the output of a row-parallel
/// layer).
pub fn reduce_from_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>> {
    check_reducible(&x, OpKind::AllReduce)?;
    let op = pairs::all_reduce(ReduceOp::Sum, &route(&x.device(), group));
    attach_checked(x, op)
}

/// All-reduce of a tensor that takes no gradient (a gradient bucket, a statistic); the result
/// is detached.
pub fn all_reduce<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    op: ReduceOp,
) -> Result<Tensor<D>> {
    check_reducible(&x, OpKind::AllReduce)?;
    let x = x.detach();
    let steps = pairs::all_reduce(op, &route(&x.device(), group));
    attach_checked(x, steps)
}

/// The reductions run on float tensors only; checked here so a bad dtype is an error, not a
/// panic inside the exchange.
fn check_reducible<const D: usize>(x: &Tensor<D>, op: OpKind) -> Result<()> {
    if x.dtype().is_float() {
        Ok(())
    } else {
        Err(CollectiveError::UnsupportedDtype {
            op: op.name().into(),
            dtype: format!("{:?}", x.dtype()),
        })
    }
}

/// This rank's chunk along `dim` (pad-to-ceil chunks) of a tensor replicated over the group;
/// backward all-gathers the gradient.
pub fn scatter_to_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    let op = pairs::scatter_to_group(dim, x.dims()[dim], &route(&x.device(), group));
    Ok(attach(x, op))
}

/// All-gather along `dim` of a tensor whose consumers are replicated over the group; backward
/// keeps this rank's slice of the gradient (no communication).
pub fn gather_from_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    let op = pairs::gather_from_group(dim, &route(&x.device(), group));
    attach_checked(x, op)
}

/// Starts one step of a ring: `x` goes to the next rank of the group (index + 1, wrapping) and
/// the previous rank's tensor, whose length along `dim` may differ, comes back from
/// [`Started::finish`]; the exchange runs while the caller computes. Backward: the gradient
/// goes back the other way. The steps of async tensor parallelism.
pub fn start_ring_shift<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Started<D>> {
    check_dim::<D>(OpKind::AllToAll, group, dim)?;
    let mut send_sizes = vec![0; group.size()];
    send_sizes[(group.index() + 1) % group.size()] = x.dims()[dim];
    let op = pairs::all_to_all(dim, dim, send_sizes, &route(&x.device(), group));
    Ok(Started::new(x, op))
}

/// Slice `j` along `split_dim` (`send_sizes[j]` long) goes to rank `j`; received slices are
/// concatenated along `concat_dim`. Backward: the inverse exchange of the gradient.
pub fn all_to_all<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    split_dim: usize,
    concat_dim: usize,
    send_sizes: &[usize],
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllToAll, group, split_dim)?;
    check_dim::<D>(OpKind::AllToAll, group, concat_dim)?;
    let len = x.dims()[split_dim];
    if send_sizes.len() != group.size() || send_sizes.iter().sum::<usize>() != len {
        return Err(CollectiveError::InvalidArgument {
            op: OpKind::AllToAll.name().into(),
            group: group.label().into(),
            message: format!(
                "send sizes {send_sizes:?} do not split {len} along dim {split_dim} over {} ranks",
                group.size()
            ),
        });
    }
    let ex = route(&x.device(), group);
    let op = pairs::all_to_all(split_dim, concat_dim, send_sizes.to_vec(), &ex);
    attach_checked(x, op)
}
