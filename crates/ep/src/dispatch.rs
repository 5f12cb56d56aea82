//! The experts' forward over sorted rows, local or across an ep group.

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
/// travel to the ranks holding their experts and back; `expert` is called only for this
/// rank's experts, once each, and only for an expert that received rows. Collective over the
/// shard's group: every rank calls it for the same layer, whatever its routing.
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
        _ => return run_local(rows, counts, 0, &mut expert),
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
    let total: usize = from_rank.iter().sum();
    let outputs = if total == 0 {
        arrived
    } else {
        // Arrived rows are source-major; the experts want them expert-major.
        let (to_expert_major, back_to_sources) = expert_major(&received, ranks, per_rank);
        let device = arrived.device();
        let by_expert = arrived.select(0, index(&to_expert_major, &device));
        let local_counts: Vec<usize> = (0..per_rank)
            .map(|e| (0..ranks).map(|i| received[i * per_rank + e]).sum())
            .collect();
        let first = shard.local_experts().start;
        let out = run_local(by_expert, &local_counts, first, &mut expert)?;
        out.select(0, index(&back_to_sources, &device))
    };
    let back = coll::all_to_all(outputs, group, 0, 0, &from_rank)?;
    debug_assert_eq!(back.dims(), [slots, width]);
    Ok(back)
}

/// Each expert on its contiguous rows (experts numbered from `first`), outputs concatenated.
fn run_local(
    rows: Tensor<2>,
    counts: &[usize],
    first: usize,
    expert: &mut impl FnMut(usize, Tensor<2>) -> Tensor<2>,
) -> Result<Tensor<2>, EpError> {
    let width = rows.dims()[1];
    let mut outputs = Vec::new();
    let mut offset = 0;
    for (e, &n) in counts.iter().enumerate() {
        if n == 0 {
            continue;
        }
        let out = expert(first + e, rows.clone().narrow(0, offset, n));
        let output = out.dims()[1];
        if output != width {
            return Err(EpError::ExpertWidth {
                expert: first + e,
                input: width,
                output,
            });
        }
        outputs.push(out);
        offset += n;
    }
    Ok(match outputs.len() {
        // No routed rows at all: the (empty) input stands for the (empty) output.
        0 => rows,
        1 => outputs.pop().expect("one output"),
        _ => Tensor::cat(outputs, 0),
    })
}

/// The permutation from source-major arrival order to local-expert-major order, and its
/// inverse. `received[i * per_rank + e]` rows came from rank `i` for local expert `e`.
fn expert_major(received: &[usize], ranks: usize, per_rank: usize) -> (Vec<usize>, Vec<usize>) {
    // Where each (source, expert) block starts in arrival order.
    let mut starts = vec![0; received.len()];
    let mut offset = 0;
    for (block, start) in starts.iter_mut().enumerate() {
        *start = offset;
        offset += received[block];
    }
    let mut to_expert_major = Vec::with_capacity(offset);
    for e in 0..per_rank {
        for i in 0..ranks {
            let block = i * per_rank + e;
            to_expert_major.extend(starts[block]..starts[block] + received[block]);
        }
    }
    let mut back = vec![0; offset];
    for (position, &row) in to_expert_major.iter().enumerate() {
        back[row] = position;
    }
    (to_expert_major, back)
}

fn index(positions: &[usize], device: &burn::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = positions.iter().map(|&p| p as i64).collect();
    Tensor::from_data(TensorData::new(values, [positions.len()]), device)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_major_interleaves_sources_per_expert() {
        // Two sources, two local experts: source 0 sends [e0: 2 rows, e1: 1], source 1 sends
        // [e0: 0, e1: 2]. Arrival: 0 1 | 2 | 3 4 (source 0: e0 e0 e1, source 1: e1 e1).
        let (to, back) = expert_major(&[2, 1, 0, 2], 2, 2);
        assert_eq!(to, vec![0, 1, 2, 3, 4]);
        let (to, back2) = expert_major(&[1, 1, 1, 1], 2, 2);
        assert_eq!(to, vec![0, 2, 1, 3]);
        assert_eq!(back2, vec![0, 2, 1, 3]);
        assert_eq!(back, vec![0, 1, 2, 3, 4]);
    }
}
