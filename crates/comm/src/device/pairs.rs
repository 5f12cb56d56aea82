//! The step lists of the differentiable collectives, each paired with its adjoint:
//! all_gather <-> reduce_scatter (sum), copy_to_group = identity <-> all_reduce,
//! reduce_from_group = all_reduce <-> identity, scatter_to_group = this rank's piece <->
//! all_gather, gather_from_group = all_gather <-> this rank's piece, all_to_all <-> the inverse
//! all_to_all. FSDP's parameter gather adds casts, a replica all-reduce, deferral and
//! observers to the same kinds of lists (`fsdp`).

use burn::tensor::DType;

use crate::transport::chunk::chunk_sizes;
use crate::transport::data::ReduceOp;

use super::collective::DeviceCollective;
use super::steps::{DeviceOp, DeviceStep, Exchange, Sizes};

/// A collective step.
pub fn run(op: DeviceOp, exchange: &Exchange) -> DeviceStep {
    DeviceStep::Run {
        op,
        exchange: exchange.clone(),
    }
}

/// A gather's dtypes: compute (gather) and reduce, when they differ from the input's, and the
/// input's own dtype, which its gradient returns in.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixedDtypes {
    /// The dtype to gather in, when not the input's.
    pub compute: Option<DType>,
    /// The dtype to reduce the gradient in, when not the input's.
    pub reduce: Option<DType>,
    /// The input's dtype, in which the gradient is returned.
    pub input: DType,
}

/// Gather along `dim`, in `compute` when given; backward reduces the gradient (in `reduce` when
/// given) to this rank's piece and returns it in the input's dtype. `sizes` are every rank's
/// rows when known, else learned forward.
pub fn gather_mixed(
    dim: usize,
    sizes: Sizes,
    dtypes: MixedDtypes,
    ex: &Exchange,
) -> DeviceCollective {
    let mut forward: Vec<DeviceStep> = dtypes.compute.map(DeviceStep::Cast).into_iter().collect();
    forward.push(run(
        DeviceOp::AllGather {
            dim,
            sizes: sizes.clone(),
        },
        ex,
    ));
    let mut backward: Vec<DeviceStep> = dtypes.reduce.map(DeviceStep::Cast).into_iter().collect();
    backward.push(run(
        DeviceOp::ReduceScatter {
            dim,
            sizes,
            op: ReduceOp::Sum,
        },
        ex,
    ));
    backward.push(DeviceStep::Cast(dtypes.input));
    DeviceCollective {
        forward,
        backward,
        recompute: None,
        prefetch: None,
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
        prefetch: None,
    }
}

/// All-reduce forward, identity backward (`reduce_from_group`, or any op detached).
pub fn all_reduce(op: ReduceOp, ex: &Exchange) -> DeviceCollective {
    DeviceCollective::steps(vec![run(DeviceOp::AllReduce { op }, ex)])
}

/// Identity forward, all-reduce (sum) backward (`copy_to_group`).
pub fn copy_to_group(ex: &Exchange) -> DeviceCollective {
    DeviceCollective {
        forward: Vec::new(),
        backward: vec![run(DeviceOp::AllReduce { op: ReduceOp::Sum }, ex)],
        recompute: None,
        prefetch: None,
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
        prefetch: None,
    }
}

/// Pieces of `send_sizes` along `split` to each rank, concatenated along `concat`; backward
/// sends the gradient's pieces back the other way.
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
        prefetch: None,
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
        prefetch: None,
    }
}
