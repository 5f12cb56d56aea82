//! Context parallelism: each sequence split over the `cp` ranks of a data-parallel group.
//!
//! Every cp rank of a data-parallel group reads the same rows and keeps its part of each
//! sequence, load-balanced for causal attention (NeMo's and TorchTitan's head-tail): the row is
//! cut in `2 * cp` equal chunks and rank `r` keeps chunks `r` and `2cp - 1 - r`, so that every
//! rank has as many (query, visible key) pairs as the others. Embedding, norms, MLP and LM head
//! run on the rank's tokens alone; the rotary embedding uses the tokens' global positions;
//! attention all-gathers K and V over the cp group (backward reduce-scatters their gradients)
//! and each rank attends its queries to every key by the tokens' global order
//! ([`AttentionMask::indexed`]). The loss of a rank is the mean over its tokens; the
//! data-parallel average over `dp x cp` is then the mean over the global batch.

use burn::tensor::{DType, Device, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives as coll;

use crate::attention::{AttentionMask, flash_attention};
use crate::error::ModelError;
use crate::rope::Rope;

/// Checks that a sequence of `seq` tokens splits over `cp` ranks (a multiple of `2 * cp`).
pub fn check_split(seq: usize, cp: usize) -> Result<(), ModelError> {
    match cp <= 1 || seq.is_multiple_of(2 * cp) {
        true => Ok(()),
        false => Err(ModelError::ContextParallelSplit { seq, cp }),
    }
}

/// The indices in a sequence of `seq` tokens that cp rank `rank` of `cp` keeps, in order:
/// chunk `rank`, then chunk `2cp - 1 - rank`, of `seq / (2cp)` tokens each. With `cp` 1, every
/// index.
pub fn head_tail_indices(seq: usize, cp: usize, rank: usize) -> Result<Vec<usize>, ModelError> {
    check_split(seq, cp)?;
    if cp <= 1 {
        return Ok((0..seq).collect());
    }
    let chunk = seq / (2 * cp);
    let (head, tail) = (rank, 2 * cp - 1 - rank);
    Ok((head * chunk..(head + 1) * chunk)
        .chain(tail * chunk..(tail + 1) * chunk)
        .collect())
}

/// This rank's part of each of `rows` rows of `values` (row-major `[rows, seq]`): the
/// head-tail columns of [`head_tail_indices`], `[rows, seq / cp]`.
pub fn split_rows<T: Copy>(
    values: &[T],
    rows: usize,
    cp: usize,
    rank: usize,
) -> Result<Vec<T>, ModelError> {
    let seq = values.len() / rows.max(1);
    let keep = head_tail_indices(seq, cp, rank)?;
    Ok(values
        .chunks(seq.max(1))
        .flat_map(|row| keep.iter().map(|&i| row[i]))
        .collect())
}

/// What every decoder layer of one forward shares: the rotary `cos`/`sin` of the tokens this
/// rank holds, the attention mask, and the group K and V are gathered over.
#[derive(Debug, Clone)]
pub struct TokenLayout {
    /// Rotary cosines, `[1 or batch, 1, local seq, head_dim]`.
    pub cos: Tensor<4>,
    /// Rotary sines, as `cos`.
    pub sin: Tensor<4>,
    /// Which keys each query sees.
    pub mask: AttentionMask,
    /// The context-parallel group (`None`: the rank holds whole sequences).
    pub cp: Option<ProcessGroup>,
}

impl TokenLayout {
    /// The layout of `batch` rows of which this rank holds `local_seq` tokens each: whole rows
    /// without `cp`, its head-tail part of each row with it. `packed` gives every token's
    /// position and example (`[batch, seq]` of the WHOLE rows, row-major; positions restart
    /// per example): rotary positions are those, and attention stays within an example.
    pub fn new(
        rope: &Rope,
        batch: usize,
        local_seq: usize,
        packed: Option<(&[i64], &[i64])>,
        cp: Option<&ProcessGroup>,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        let (size, rank) = cp.map_or((1, 0), |g| (g.size(), g.index()));
        let seq = local_seq * size;
        let mine = head_tail_indices(seq, size, rank)?;
        // The gathered keys: every cp rank's tokens, in rank order.
        let keys: Vec<usize> = match size {
            1 => mine.clone(),
            _ => (0..size)
                .map(|r| head_tail_indices(seq, size, r))
                .collect::<Result<Vec<_>, _>>()?
                .concat(),
        };
        let as_i64 = |v: &[usize]| v.iter().map(|&i| i as i64).collect::<Vec<_>>();
        let mask = AttentionMask::indexed(as_i64(&mine), as_i64(&keys));
        let pick = |values: &[i64], at: &[usize]| -> Vec<i64> {
            values
                .chunks(seq)
                .flat_map(|row| at.iter().map(|&i| row[i]))
                .collect()
        };
        let ((cos, sin), mask) = match packed {
            None if size == 1 => (rope.cos_sin(seq, device, dtype), mask),
            None => {
                let positions = as_i64(&mine);
                (rope.cos_sin_at(&positions, 1, device, dtype), mask)
            }
            Some((positions, segments)) => {
                let expected = batch * seq;
                if positions.len() != expected || segments.len() != expected {
                    return Err(ModelError::Unsupported(format!(
                        "packed rows need {expected} positions and segments ([{batch}, {seq}]), \
                         got {} and {}",
                        positions.len(),
                        segments.len()
                    )));
                }
                let rope_at = pick(positions, &mine);
                let mask = mask.with_segments(batch, pick(segments, &mine), pick(segments, &keys));
                (rope.cos_sin_at(&rope_at, batch, device, dtype), mask)
            }
        };
        Ok(Self {
            cos,
            sin,
            mask,
            cp: cp.filter(|g| g.size() > 1).cloned(),
        })
    }

    /// Attention of `q` `[batch, heads, local seq, head_dim]` over this rank's `k`, `v`
    /// `[batch, kv_heads, local seq, head_dim]`: under context parallelism K and V are first
    /// all-gathered over the cp group along the sequence (a differentiable gather: backward
    /// reduce-scatters their gradients). Collective over the cp group: every rank of it runs
    /// the same layers. A failed gather panics naming the group, as every collective inside a
    /// forward does. `layer_mask` adds the layer's own terms to the layout's mask (a sliding
    /// window, a soft cap).
    pub fn attend(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        v: Tensor<4>,
        scale: f64,
        layer_mask: impl FnOnce(AttentionMask) -> AttentionMask,
    ) -> Tensor<4> {
        let (k, v) = match &self.cp {
            None => (k, v),
            Some(group) => {
                let gather = |t: Tensor<4>, what: &str| {
                    coll::all_gather(t, group, 2).unwrap_or_else(|e| {
                        panic!("context parallelism: gathering {what} over {group:?}: {e}")
                    })
                };
                (gather(k, "keys"), gather(v, "values"))
            }
        };
        flash_attention(q, k, v, &layer_mask(self.mask.clone()), scale)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_tail_balances_the_causal_work() {
        // 16 tokens over cp 2: chunks of 4; rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
        assert_eq!(
            head_tail_indices(16, 2, 0).unwrap(),
            [0, 1, 2, 3, 12, 13, 14, 15]
        );
        assert_eq!(
            head_tail_indices(16, 2, 1).unwrap(),
            [4, 5, 6, 7, 8, 9, 10, 11]
        );
        // Every rank sees as many (query, earlier-or-same key) pairs.
        let work = |r| -> usize {
            head_tail_indices(24, 3, r)
                .unwrap()
                .iter()
                .map(|i| i + 1)
                .sum()
        };
        assert_eq!((work(0), work(1)), (work(1), work(2)));
        let err = head_tail_indices(18, 2, 0).unwrap_err().to_string();
        assert!(err.contains("multiple of 2 * cp = 4"), "{err}");
    }

    #[test]
    fn split_rows_keeps_each_rows_part() {
        let values: Vec<i64> = (0..16).collect();
        assert_eq!(
            split_rows(&values, 2, 2, 1).unwrap(),
            [2, 3, 4, 5, 10, 11, 12, 13]
        );
        assert_eq!(split_rows(&values, 2, 1, 0).unwrap(), values);
    }
}
