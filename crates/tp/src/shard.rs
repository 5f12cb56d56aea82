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

    /// The indices of the whole split dim this rank holds when it is `parts` equal parts of
    /// `self.full` each, each split on its own (a fused style): this rank's range of every
    /// part, part by part. One part is `self.range` itself.
    pub fn part_ranges(&self, parts: usize) -> Vec<Range<usize>> {
        (0..parts)
            .map(|j| j * self.full + self.range.start..j * self.full + self.range.end)
            .collect()
    }
}

/// The size of each of `parts` equal parts of a dim of size `full` (a fused projection's
/// output), or why it has none: no parts, or a size the parts do not divide.
pub fn part_size(full: usize, parts: usize, path: &str) -> Result<usize, String> {
    if parts == 0 || !full.is_multiple_of(parts) {
        return Err(format!(
            "`{path}` has {full} output features, which do not split into {parts} equal parts: \
             give colwise_fused the number of equal parts the layer's output is (3 for q/k/v)"
        ));
    }
    Ok(full / parts)
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

/// The pieces `ranges` of `param` along `dim`, concatenated in that order, as a fresh leaf
/// (same ParamId, same require-grad setting): a fused style's shard, this rank's chunk of each
/// part ([`ShardSpec::part_ranges`]).
pub fn narrow_param_parts<const D: usize>(
    param: Param<Tensor<D>>,
    dim: usize,
    ranges: &[Range<usize>],
) -> Param<Tensor<D>> {
    param.map(|t| {
        let require_grad = t.is_require_grad();
        let pieces = ranges
            .iter()
            .map(|r| t.clone().narrow(dim, r.start, r.len()))
            .collect();
        let shard = Tensor::cat(pieces, dim).detach();
        if require_grad {
            shard.require_grad()
        } else {
            shard
        }
    })
}

/// The whole of a parameter split along `dim` by a fused style of `parts` parts (every rank
/// holds its chunk of each part, part by part, as [`narrow_param_parts`] cut it): the pieces
/// all-gathered (rank-major, uneven chunks allowed) and reordered part-major, as a fresh leaf
/// with the same ParamId and require-grad setting. `part` is the size of one whole part.
/// Collective over `group`.
pub fn gather_param_parts<const D: usize>(
    param: Param<Tensor<D>>,
    dim: usize,
    parts: usize,
    part: usize,
    group: &ProcessGroup,
    path: &str,
) -> Result<Param<Tensor<D>>, TpError> {
    let piece = param.val();
    let trainable = piece.is_require_grad();
    let gathered = coll::all_gather(piece.detach(), group, dim)
        .map_err(TpError::collective(path))?
        .detach();
    // Rank r's piece is its chunk of part 0, then of part 1, ...: take chunk (r, j) for every
    // part j in turn, for every rank r.
    let ranks = group.size();
    let lens: Vec<usize> = (0..ranks)
        .map(|r| chunk_range(part, ranks, r).len())
        .collect();
    let starts: Vec<usize> = lens
        .iter()
        .scan(0, |at, len| {
            let start = *at;
            *at += parts * len;
            Some(start)
        })
        .collect();
    let mut pieces = Vec::with_capacity(parts * ranks);
    for j in 0..parts {
        for r in (0..ranks).filter(|&r| lens[r] > 0) {
            pieces.push(
                gathered
                    .clone()
                    .narrow(dim, starts[r] + j * lens[r], lens[r]),
            );
        }
    }
    let full = Tensor::cat(pieces, dim).detach();
    let full = if trainable { full.require_grad() } else { full };
    Ok(param.map(|_| full))
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
