//! DTensor's `PrepareModuleInput` / `PrepareModuleOutput`: converting an activation between
//! layouts at a module boundary (say, the sequence-sharded output of a norm into the replicated
//! input an attention block expects), for modules that are not `Tp` layers themselves.
//!
//! Gradients follow Megatron's convention for what surrounds a tensor-parallel region:
//! - `SequenceSharded -> Replicated` all-gathers; its backward reduce-scatters, because the
//!   replicated activation feeds tensor-parallel compute whose gradients are partial sums.
//! - `Replicated -> SequenceSharded` and `Replicated -> Sharded` keep this rank's chunk; their
//!   backward all-gathers.
//! - `Sharded -> Replicated` all-gathers the features; its backward keeps this rank's slice
//!   (the consumers are replicated).
//! - `SequenceSharded <-> Sharded` is an all-to-all (sequence chunks for feature chunks, as
//!   in Ulysses sequence parallelism); its backward is the inverse all-to-all.

use burn::tensor::Tensor;
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::chunk::chunk_sizes;
use burn_parallel_comm::collectives as coll;

use crate::error::TpError;
use crate::style::Layout;

/// A layout conversion at a module boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Redistribute {
    /// The layout the activation arrives in.
    pub from: Layout,
    /// The layout it is converted to.
    pub to: Layout,
}

/// Converts a module's input (DTensor's `PrepareModuleInput`).
pub type PrepareModuleInput = Redistribute;
/// Converts a module's output (DTensor's `PrepareModuleOutput`).
pub type PrepareModuleOutput = Redistribute;

impl Redistribute {
    /// A conversion from `from` to `to`.
    pub fn new(from: Layout, to: Layout) -> Self {
        Self { from, to }
    }

    /// Applies the conversion to `x` over `group`; `path` names the module in errors.
    pub fn apply<const D: usize>(
        &self,
        x: Tensor<D>,
        group: &ProcessGroup,
        path: &str,
    ) -> Result<Tensor<D>, TpError> {
        redistribute(x, self.from, self.to, group).map_err(TpError::collective(path))
    }
}

/// Converts `x` from layout `from` to layout `to` over `group` (see the module docs for the
/// gradients). `Sharded` means split on the last dim.
pub fn redistribute<const D: usize>(
    x: Tensor<D>,
    from: Layout,
    to: Layout,
    group: &ProcessGroup,
) -> Result<Tensor<D>, burn_parallel_comm::CollectiveError> {
    let last = D - 1;
    match (from, to) {
        (a, b) if a == b => Ok(x),
        (Layout::SequenceSharded { dim }, Layout::Replicated) => coll::all_gather(x, group, dim),
        (Layout::Replicated, Layout::SequenceSharded { dim }) => {
            coll::scatter_to_group(x, group, dim)
        }
        (Layout::Sharded, Layout::Replicated) => coll::gather_from_group(x, group, last),
        (Layout::Replicated, Layout::Sharded) => coll::scatter_to_group(x, group, last),
        (Layout::SequenceSharded { dim }, Layout::Sharded) => {
            let sizes = chunk_sizes(x.dims()[last], group.size());
            coll::all_to_all(x, group, last, dim, &sizes)
        }
        (Layout::Sharded, Layout::SequenceSharded { dim }) => {
            let sizes = chunk_sizes(x.dims()[dim], group.size());
            coll::all_to_all(x, group, dim, last, &sizes)
        }
        (Layout::SequenceSharded { dim: a }, Layout::SequenceSharded { dim: b }) => {
            // Resharding the sequence over another dim: through the replicated layout.
            let full = coll::gather_from_group(x, group, a)?;
            coll::scatter_to_group(full, group, b)
        }
        _ => unreachable!("equal layouts are handled first"),
    }
}
