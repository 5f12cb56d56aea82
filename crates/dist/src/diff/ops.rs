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
//! A CUDA tensor on a group of the nccl engine takes the device path ([`super::device`]):
//! NCCL on its buffer, no copy through the host. Every other tensor takes the host path: the
//! group's engine on the tensor's data.
//!
//! Every rank must build its own autodiff tensors. An autodiff tensor shared by two rank
//! threads joins their graphs under one lock, and a collective in one rank's backward then
//! waits for a rank that cannot enter its own backward. Share `TensorData` (or plain tensors)
//! and create the tracked tensors on each rank.

use burn::backend::Dispatch;
use burn::tensor::{DType, Tensor, TensorData};

use crate::chunk::{chunk_range, chunk_sizes, offsets};
use crate::collective::{CollectiveHandle, OpKind};
use crate::data::{ReduceOp, narrow};
use crate::error::CollectiveError;
use crate::group::ProcessGroup;

use super::device::{MixedDtypes, Sizes, attach_device, pairs, route};
use super::extension::{CollectiveBackend, HostCollective, HostFn};

type Result<T> = std::result::Result<T, CollectiveError>;

/// Places a host collective that already ran forward in the autodiff graph of `x`: the
/// building block of every op here, public so that strategies (FSDP's parameter gather) can
/// define their own backward.
pub fn attach<const D: usize>(x: Tensor<D>, op: HostCollective) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CollectiveBackend>::host_collective(
        x.into_dispatch(),
        op,
    ))
}

/// Unwraps a collective run inside backward, where Burn allows no error: the panic reaches
/// the launcher, which fails this rank and releases the others.
fn in_backward<T>(op: &str, result: Result<T>) -> T {
    result.unwrap_or_else(|e| {
        let hint = if matches!(e, CollectiveError::Timeout { .. }) {
            " (a common cause: two ranks share an autodiff tensor, which joins their graphs \
             under one lock so one rank's backward blocks the other's; build each rank's \
             tensors on that rank, or share TensorData)"
        } else {
            ""
        };
        panic!("{op} in backward failed: {e}{hint}")
    })
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

/// [`all_gather`] with options: recomputation and a mixed-precision policy.
pub fn all_gather_with<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    options: GatherOptions,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    if let Some(ex) = route(&x.device(), group) {
        let dtypes = MixedDtypes {
            compute: options.compute_dtype,
            reduce: options.reduce_dtype,
            input: x.dtype(),
        };
        let mut op = pairs::gather_mixed(dim, Sizes::unknown(), dtypes, &ex, None);
        op.recompute = options.recompute.then(|| op.forward.clone());
        return Ok(attach_device(x, op));
    }
    let input = to_dtype(x.to_data(), options.compute_dtype);
    let (gathered, sizes) = group.all_gather_sized(input, dim)?;
    let dtype = x.dtype();
    Ok(attach(
        x,
        gather_op(group, dim, gathered, sizes, dtype, options),
    ))
}

/// `data` in `dtype` (unchanged when `None` or already there).
pub fn to_dtype(data: TensorData, dtype: Option<DType>) -> TensorData {
    match dtype {
        Some(d) if d != data.dtype() => data.convert_dtype(d),
        _ => data,
    }
}

fn gather_op(
    group: &ProcessGroup,
    dim: usize,
    gathered: TensorData,
    sizes: Vec<usize>,
    input_dtype: DType,
    options: GatherOptions,
) -> HostCollective {
    let g = group.clone();
    let backward = HostFn::new(move |dy| {
        let dy = to_dtype(dy, options.reduce_dtype);
        let reduced = in_backward(
            "reduce_scatter",
            g.reduce_scatter_sizes(dy, dim, &sizes, ReduceOp::Sum),
        );
        to_dtype(reduced, Some(input_dtype))
    });
    let g = group.clone();
    let regather = HostFn::new(move |x| {
        let x = to_dtype(x, options.compute_dtype);
        in_backward("all_gather (recompute)", g.all_gather(x, dim))
    });
    HostCollective {
        output: Some(gathered),
        backward: Some(backward),
        recompute: options.recompute.then_some(regather),
    }
}

/// An all-gather started ahead of its use (prefetch): the communication runs while the caller
/// computes; `finish` waits and returns the differentiable result. On the device path the
/// gather runs in `finish` (CubeCL does not expose its stream, so NCCL cannot overlap it).
#[must_use = "finish() the gather to use its result"]
pub struct PendingAllGather<const D: usize> {
    x: Tensor<D>,
    group: ProcessGroup,
    dim: usize,
    options: GatherOptions,
    /// `None` on the device path.
    handle: Option<CollectiveHandle>,
}

impl<const D: usize> PendingAllGather<D> {
    pub fn finish(self) -> Result<Tensor<D>> {
        let Some(handle) = self.handle else {
            return all_gather_with(self.x, &self.group, self.dim, self.options);
        };
        let (gathered, sizes) = handle.wait_sized()?;
        let dtype = self.x.dtype();
        let op = gather_op(&self.group, self.dim, gathered, sizes, dtype, self.options);
        Ok(attach(self.x, op))
    }

    pub fn is_done(&self) -> bool {
        self.handle.as_ref().is_none_or(CollectiveHandle::is_done)
    }
}

/// Starts [`all_gather_with`] without waiting.
pub fn start_all_gather<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    options: GatherOptions,
) -> Result<PendingAllGather<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    let handle = match route(&x.device(), group) {
        Some(_) => None,
        None => Some(group.all_gather_async(to_dtype(x.to_data(), options.compute_dtype), dim)),
    };
    Ok(PendingAllGather {
        x,
        group: group.clone(),
        dim,
        options,
        handle,
    })
}

/// Rank `i` gets the sum over ranks of chunk `i` along `dim` (pad-to-ceil chunks, FSDP2's).
/// Backward: all-gather of the output gradient.
pub fn reduce_scatter<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::ReduceScatter, group, dim)?;
    if let Some(ex) = route(&x.device(), group) {
        let op = pairs::reduce_scatter(dim, x.dims()[dim], &ex);
        return Ok(attach_device(x, op));
    }
    let sizes = chunk_sizes(x.dims()[dim], group.size());
    let out = group.reduce_scatter_sizes(x.to_data(), dim, &sizes, ReduceOp::Sum)?;
    let g = group.clone();
    let backward = HostFn::new(move |dy| in_backward("all_gather", g.all_gather(dy, dim)));
    Ok(attach(
        x,
        HostCollective {
            output: Some(out),
            backward: Some(backward),
            recompute: None,
        },
    ))
}

/// Identity forward; backward sums the gradient over the group (Megatron's `f`, the input of
/// a column-parallel layer).
pub fn copy_to_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Tensor<D> {
    if let Some(ex) = route(&x.device(), group) {
        return attach_device(x, pairs::copy_to_group(&ex));
    }
    let g = group.clone();
    let backward =
        HostFn::new(move |dy| in_backward("all_reduce", g.all_reduce(dy, ReduceOp::Sum)));
    attach(
        x,
        HostCollective {
            output: None,
            backward: Some(backward),
            recompute: None,
        },
    )
}

/// Sum over the group forward; identity backward (Megatron's `g`, the output of a row-parallel
/// layer).
pub fn reduce_from_group<const D: usize>(x: Tensor<D>, group: &ProcessGroup) -> Result<Tensor<D>> {
    if let Some(ex) = route(&x.device(), group) {
        return Ok(attach_device(x, pairs::all_reduce(ReduceOp::Sum, &ex)));
    }
    let out = group.all_reduce(x.to_data(), ReduceOp::Sum)?;
    Ok(attach(
        x,
        HostCollective {
            output: Some(out),
            backward: None,
            recompute: None,
        },
    ))
}

/// All-reduce of a tensor that takes no gradient (a gradient bucket, a statistic); the result
/// is detached. On the device path for a CUDA tensor on an nccl group, like every op here.
pub fn all_reduce<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    op: ReduceOp,
) -> Result<Tensor<D>> {
    let x = x.detach();
    if let Some(ex) = route(&x.device(), group) {
        return Ok(attach_device(x, pairs::all_reduce(op, &ex)));
    }
    let out = group.all_reduce(x.to_data(), op)?;
    Ok(Tensor::from_data(out, &x.device()))
}

/// This rank's chunk along `dim` (pad-to-ceil chunks) of a tensor replicated over the group;
/// backward all-gathers the gradient.
pub fn scatter_to_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    if let Some(ex) = route(&x.device(), group) {
        let op = pairs::scatter_to_group(dim, x.dims()[dim], &ex);
        return Ok(attach_device(x, op));
    }
    let range = chunk_range(x.dims()[dim], group.size(), group.index());
    let out = narrow(&x.to_data(), dim, range.start, range.len());
    let g = group.clone();
    let backward = HostFn::new(move |dy| in_backward("all_gather", g.all_gather(dy, dim)));
    Ok(attach(
        x,
        HostCollective {
            output: Some(out),
            backward: Some(backward),
            recompute: None,
        },
    ))
}

/// All-gather along `dim` of a tensor whose consumers are replicated over the group; backward
/// keeps this rank's slice of the gradient (no communication).
pub fn gather_from_group<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    check_dim::<D>(OpKind::AllGather, group, dim)?;
    if let Some(ex) = route(&x.device(), group) {
        return Ok(attach_device(x, pairs::gather_from_group(dim, &ex)));
    }
    let (gathered, sizes) = group.all_gather_sized(x.to_data(), dim)?;
    let me = group.index();
    let start = offsets(&sizes)[me];
    let len = sizes[me];
    let backward = HostFn::new(move |dy| narrow(&dy, dim, start, len));
    Ok(attach(
        x,
        HostCollective {
            output: Some(gathered),
            backward: Some(backward),
            recompute: None,
        },
    ))
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
    if let Some(ex) = route(&x.device(), group) {
        let len = x.dims()[split_dim];
        if send_sizes.len() != group.size() || send_sizes.iter().sum::<usize>() != len {
            return Err(CollectiveError::InvalidArgument {
                op: OpKind::AllToAll.name().into(),
                group: group.label().into(),
                message: format!(
                    "send sizes {send_sizes:?} do not split {len} along dim {split_dim} over {} \
                     ranks",
                    group.size()
                ),
            });
        }
        let op = pairs::all_to_all(split_dim, concat_dim, send_sizes.to_vec(), &ex);
        return Ok(attach_device(x, op));
    }
    let (out, received) = group.all_to_all_sized(x.to_data(), split_dim, concat_dim, send_sizes)?;
    let g = group.clone();
    let backward = HostFn::new(move |dy| {
        in_backward(
            "all_to_all",
            g.all_to_all(dy, concat_dim, split_dim, &received),
        )
    });
    Ok(attach(
        x,
        HostCollective {
            output: Some(out),
            backward: Some(backward),
            recompute: None,
        },
    ))
}
