//! The experts' forward over sorted rows, local or across an ep group.
//!
//! The autodiff graph this builds has the same shape whatever the routing: every local expert
//! runs exactly once, on a zero row when it received none, and the rows are picked and put back
//! with the same ops whether or not any arrived. Burn runs backward by graph depth, so a graph
//! whose shape followed the routing would make ranks issue their backward collectives (the
//! token all_to_all, the FSDP reduce-scatters of the expert and dense units) in different
//! orders, and hang.

use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel_comm::collectives as coll;

use crate::error::EpError;
use crate::shard::ExpertShard;

/// Runs `expert(e, rows)` on the rows routed to each expert `e` (global index) and returns
/// the outputs in the order of `rows`.
///
/// `rows` `[slots, width]` are this rank's routed rows in expert-major order
/// ([`Routing::order`](crate::Routing)), `counts[e]` of them for expert `e` (over all experts).
/// Without `shard` (or with a one-rank group) every expert is local. With a shard, the rows
/// travel to the ranks holding their experts and back; `expert` is called once for each of
/// this rank's experts, in order, whatever its routing: an expert that received no row is
/// called on one zero row, and that output is dropped. Collective over the shard's group:
/// every rank calls it for the same layer.
pub fn run_experts(
    rows: Tensor<2>,
    counts: &[usize],
    shard: Option<&ExpertShard>,
    mut expert: impl FnMut(usize, Tensor<2>) -> Tensor<2>,
) -> Result<Tensor<2>, EpError> {
    let [slots, width] = rows.dims();
    if counts.iter().sum::<usize>() != slots {
        return Err(EpError::BadCounts {
            what: format!(
                "the expert counts add up to {} but {slots} rows were given",
                counts.iter().sum::<usize>()
            ),
        });
    }
    let shard = match shard {
        Some(s) if s.group().size() > 1 => s,
        _ => return run_every_expert(rows, &contiguous_rows(counts), 0, &mut expert),
    };
    if counts.len() != shard.num_experts() {
        return Err(EpError::BadCounts {
            what: format!(
                "{} expert counts for a layer of {} experts",
                counts.len(),
                shard.num_experts()
            ),
        });
    }
    let group = shard.group();
    let (ranks, per_rank) = (group.size(), shard.experts_per_rank());
    let send_sizes: Vec<usize> = counts.chunks(per_rank).map(|c| c.iter().sum()).collect();

    // received[i][e]: rows source rank i sends to this rank's local expert e.
    let counts_data = TensorData::new(counts.iter().map(|&c| c as i64).collect(), [counts.len()]);
    let received = group.all_to_all(counts_data, 0, 0, &vec![per_rank; ranks])?;
    let received: Vec<usize> = received
        .try_into_vec::<i64>()
        .map_err(|e| EpError::BadCounts {
            what: format!("the exchanged expert counts are not integers: {e:?}"),
        })?
        .into_iter()
        .map(|c| c as usize)
        .collect();
    let from_rank: Vec<usize> = received.chunks(per_rank).map(|c| c.iter().sum()).collect();

    let arrived = coll::all_to_all(rows, group, 0, 0, &send_sizes)?;
    let rows_of = arrived_rows(&received, ranks, per_rank);
    let first = shard.local_experts().start;
    let outputs = run_every_expert(arrived, &rows_of, first, &mut expert)?;
    let back = coll::all_to_all(outputs, group, 0, 0, &from_rank)?;
    debug_assert_eq!(back.dims(), [slots, width]);
    Ok(back)
}

/// Runs each expert once (numbered from `first`) on its rows of `rows`, `rows_of[e]` being
/// their positions, and returns every row's output at its position. An expert without rows
/// runs on one zero row, whose output is dropped (a zero row's gradients are zero), so the
/// graph is the same for every routing, no rows at all included.
fn run_every_expert(
    rows: Tensor<2>,
    rows_of: &[Vec<usize>],
    first: usize,
    expert: &mut impl FnMut(usize, Tensor<2>) -> Tensor<2>,
) -> Result<Tensor<2>, EpError> {
    let [n, width] = rows.dims();
    let device = rows.device();

    // The zero row is derived from `rows` (their sum times zero), not made anew, so that it
    // hangs below `rows` in the graph even when `rows` is empty: Burn drops empty tensors from
    // `cat`, and a fresh zero row would then cut the experts off the exchange on a rank that
    // received nothing, at other depths than on its peers. `cat` makes a node either way.
    let zero = rows.clone().sum_dim(0).mul_scalar(0.0);
    // Row `n` of the source is the zero row.
    let source = Tensor::cat(vec![rows, zero], 0);
    let mut outputs = Vec::with_capacity(rows_of.len());
    // Where each input row's output lands in the experts' concatenated outputs.
    let mut output_of = vec![0; n];
    let mut at = 0;
    for (e, positions) in rows_of.iter().enumerate() {
        let picked = if positions.is_empty() {
            vec![n]
        } else {
            positions.clone()
        };
        for (j, &p) in positions.iter().enumerate() {
            output_of[p] = at + j;
        }
        let out = expert(first + e, source.clone().select(0, index(&picked, &device)));
        let input = [picked.len(), width];
        if out.dims() != input {
            return Err(EpError::ExpertShape {
                expert: first + e,
                input,
                output: out.dims(),
            });
        }
        at += picked.len();
        outputs.push(out);
    }
    Ok(Tensor::cat(outputs, 0).select(0, index(&output_of, &device)))
}

/// Each expert's row positions when the rows are expert-major, `counts[e]` for expert `e`.
fn contiguous_rows(counts: &[usize]) -> Vec<Vec<usize>> {
    let mut offset = 0;
    counts
        .iter()
        .map(|&n| {
            offset += n;
            (offset - n..offset).collect()
        })
        .collect()
}

/// Each local expert's row positions in arrival order (source-major):
/// `received[i * per_rank + e]` rows came from rank `i` for local expert `e`. Within an
/// expert the rows are ordered by source rank, then as the source sent them.
fn arrived_rows(received: &[usize], ranks: usize, per_rank: usize) -> Vec<Vec<usize>> {
    // Where each (source, expert) block starts in arrival order.
    let mut starts = vec![0; received.len()];
    let mut offset = 0;
    for (block, start) in starts.iter_mut().enumerate() {
        *start = offset;
        offset += received[block];
    }
    (0..per_rank)
        .map(|e| {
            (0..ranks)
                .flat_map(|i| {
                    let block = i * per_rank + e;
                    starts[block]..starts[block] + received[block]
                })
                .collect()
        })
        .collect()
}

fn index(positions: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    Tensor::from_data(TensorData::new(values, [positions.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrived_rows_interleave_sources_per_expert() {
        // Two sources, two local experts: source 0 sends [e0: 2 rows, e1: 1], source 1 sends
        // [e0: 0, e1: 2]. Arrival: 0 1 | 2 | 3 4 (source 0: e0 e0 e1, source 1: e1 e1).
        assert_eq!(
            arrived_rows(&[2, 1, 0, 2], 2, 2),
            vec![vec![0, 1], vec![2, 3, 4]]
        );
        assert_eq!(
            arrived_rows(&[1, 1, 1, 1], 2, 2),
            vec![vec![0, 2], vec![1, 3]]
        );
        assert_eq!(
            arrived_rows(&[0, 0, 0, 0], 2, 2),
            vec![Vec::<usize>::new(); 2]
        );
    }

    #[test]
    fn contiguous_rows_follow_the_counts() {
        assert_eq!(
            contiguous_rows(&[2, 0, 1]),
            vec![vec![0, 1], vec![], vec![2]]
        );
    }
}
