//! Slicing a parameter to this rank's shard (pad-to-ceil chunks) while keeping its ParamId.

use std::ops::Range;

use burn::module::Param;
use burn::tensor::Tensor;
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::chunk::chunk_range;
use burn_parallel_comm::collectives as coll;

use crate::error::TpError;

/// Which slice of a sharded dim this rank holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSpec {
    /// Size of the dim before sharding.
    pub full: usize,
    /// This rank's range of it.
    pub range: Range<usize>,
}

impl ShardSpec {
    /// This rank's chunk of `full`; an empty chunk is an error (Burn ops reject empty dims).
    pub fn new(
        full: usize,
        group: &ProcessGroup,
        path: &str,
        what: &'static str,
    ) -> Result<Self, TpError> {
        let range = chunk_range(full, group.size(), group.index());
        if range.is_empty() {
            return Err(TpError::EmptyShard {
                path: path.to_string(),
                what,
                size: full,
                tp: group.size(),
                rank: group.index(),
            });
        }
        Ok(Self { full, range })
    }
}

/// The slice `range` of `param` along `dim`, as a fresh leaf (same ParamId, same
/// require-grad setting): the shard is what the optimizer updates.
pub fn narrow_param<const D: usize>(
    param: Param<Tensor<D>>,
    dim: usize,
    range: Range<usize>,
) -> Param<Tensor<D>> {
    param.map(|t| {
        let require_grad = t.is_require_grad();
        let shard = t.narrow(dim, range.start, range.len()).detach();
        if require_grad {
            shard.require_grad()
        } else {
            shard
        }
    })
}

/// The whole of a parameter split along `dim` over `group` (every rank holds its piece, in
/// group order), as a fresh leaf with the same ParamId and require-grad setting: the inverse of
/// [`narrow_param`]. Collective over `group`.
pub fn gather_param<const D: usize>(
    param: Param<Tensor<D>>,
    dim: usize,
    group: &ProcessGroup,
    path: &str,
) -> Result<Param<Tensor<D>>, TpError> {
    let piece = param.val();
    let trainable = piece.is_require_grad();
    // A fresh leaf: the gathered parameter, not the collective's output, is what is trained.
    let full = coll::all_gather(piece.detach(), group, dim)
        .map_err(TpError::collective(path))?
        .detach();
    let full = if trainable { full.require_grad() } else { full };
    Ok(param.map(|_| full))
}
