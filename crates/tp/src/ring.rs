//! Async tensor parallelism (PyTorch's micro-pipelined TP, TorchTitan's and NeMo's
//! `enable_async_tensor_parallel`): under sequence parallelism, the all-gather before the
//! colwise projections and the reduce-scatter after the rowwise ones are cut into ring steps,
//! and each step's exchange runs while the matmul of the chunk already here computes.
//!
//! A linear layer acts on each token alone, so its output on the gathered sequence is its
//! outputs on each rank's chunk, concatenated in rank order; and the reduce-scatter of its
//! output is, for each chunk, the sum over ranks of the output on that chunk. The steps are
//! [`start_ring_shift`]s, differentiable like every collective here: backward sends each
//! chunk's gradient back along the ring. The threads and MPI engines progress an exchange on
//! their own while the rank computes; NCCL runs it when the step finishes (CubeCL and tch hide
//! their streams), so there the steps are correct but not overlapped.
//!
//! Every rank must hold at least one token: with an empty chunk Burn's autodiff leaves tensors
//! of the ring out of the graph on some ranks, whose backward then skips ring steps the others
//! run. An empty chunk is an error naming the fix (synchronous sequence parallelism handles
//! it).

use burn::tensor::Tensor;
use burn_parallel_comm::chunk::{chunk_sizes, offsets};
use burn_parallel_comm::collectives::start_ring_shift;
use burn_parallel_comm::{CollectiveError, ProcessGroup};

/// A per-token layer applied to a chunk of the sequence.
pub(crate) type ChunkForward<'a, const D: usize> = &'a dyn Fn(Tensor<D>) -> Tensor<D>;

/// Each of `layers` applied to the all-gather along `dim` of every rank's `x` over `group`:
/// the same values as gathering first, with the gather in `group.size() - 1` ring steps, each
/// overlapping the layers' matmuls on the chunk that arrived before it. Sibling layers (q, k
/// and v) share one ring.
pub(crate) fn gathered_apply<const D: usize, const N: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    layers: [ChunkForward<'_, D>; N],
) -> Result<[Tensor<D>; N], CollectiveError> {
    let n = group.size();
    let mut outputs: [Vec<Tensor<D>>; N] = std::array::from_fn(|_| Vec::with_capacity(n));
    let (mut held, mut owner) = (x, group.index());
    let mut owners = Vec::with_capacity(n);
    for step in 0..n {
        if held.dims()[dim] == 0 {
            return Err(empty_chunk(group, owner));
        }
        let next = match step + 1 < n {
            true => Some(start_ring_shift(held.clone(), group, dim)?),
            false => None,
        };
        for (out, layer) in outputs.iter_mut().zip(&layers) {
            out.push(layer(held.clone()));
        }
        owners.push(owner);
        if let Some(next) = next {
            held = next.finish();
            owner = (owner + n - 1) % n;
        }
    }
    // Chunks arrived in ring order; the gathered sequence is in rank order.
    Ok(outputs.map(|chunks| {
        let mut by_rank: Vec<_> = owners.iter().copied().zip(chunks).collect();
        by_rank.sort_by_key(|(rank, _)| *rank);
        Tensor::cat(by_rank.into_iter().map(|(_, c)| c).collect(), dim)
    }))
}

/// `layer(x)` reduce-scattered along `dim` over `group` (this rank's chunk, of
/// `chunk_sizes(len, group.size())`, of the sum over ranks): the same values as reducing after
/// the layer up to summation order, in `group.size() - 1` ring steps, each overlapping the
/// layer's matmul on the next chunk. Step `k` adds this rank's part of chunk `index - k - 1` to
/// the sum the previous rank passed on; the last step's chunk is this rank's own.
pub(crate) fn reduce_scattered_apply<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
    layer: ChunkForward<'_, D>,
) -> Result<Tensor<D>, CollectiveError> {
    let (n, me) = (group.size(), group.index());
    let sizes = chunk_sizes(x.dims()[dim], n);
    if let Some(rank) = sizes.iter().position(|&s| s == 0) {
        return Err(empty_chunk(group, rank));
    }
    let starts = offsets(&sizes);
    let part = |step: usize| {
        let chunk = (me + n * 2 - step - 1) % n;
        layer(x.clone().narrow(dim, starts[chunk], sizes[chunk]))
    };
    let mut sum = part(0);
    for step in 1..n {
        let passed = start_ring_shift(sum, group, dim)?;
        let mine = part(step);
        sum = passed.finish() + mine;
    }
    Ok(sum)
}

/// Rank `rank` of `group` holds no token of the sequence.
fn empty_chunk(group: &ProcessGroup, rank: usize) -> CollectiveError {
    CollectiveError::InvalidArgument {
        op: "async tensor parallelism".into(),
        group: group.label().into(),
        message: format!(
            "rank {rank} of the group holds no token of the sequence (fewer tokens than the \
             {} ranks' chunks): the ring steps need one on every rank; use a longer sequence \
             or enable_async_tensor_parallel = false (synchronous sequence parallelism)",
            group.size()
        ),
    }
}
