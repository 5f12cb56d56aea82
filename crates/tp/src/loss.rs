//! Cross-entropy over vocab-sharded logits without gathering them (DTensor's
//! `loss_parallel`): all-reduce the row max (a constant shift), the sum of exponentials and
//! the target logit. The two sums use `reduce_from_group` (identity backward), which is
//! exact because every rank computes the same replicated loss from them.

use burn::tensor::{FloatDType, Int, Tensor};
use burn_parallel_comm::collectives as coll;
use burn_parallel_comm::{ProcessGroup, ReduceOp};

use crate::error::TpError;
use crate::shard::ShardSpec;

/// Mean cross-entropy of `logits` (`[tokens, vocab / tp]`, this rank's vocab chunk of a
/// `vocab`-sized vocabulary, pad-to-ceil split) against `targets` (`[tokens]`, global ids).
/// Returns the replicated loss, shape `[1]`; backward gives this rank's logits gradient.
/// Logits of any float dtype (bf16 under mixed precision) are computed in f32, as PyTorch's
/// cross-entropy upcasts; the loss is f32 and the gradient returns in the logits' dtype. On a
/// tp group of one rank it is the plain cross-entropy.
pub fn loss_parallel(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    group: &ProcessGroup,
    vocab: usize,
) -> Result<Tensor<1>, TpError> {
    Ok(token_losses(logits, targets, group, vocab)?.mean())
}

/// As [`loss_parallel`], averaging only over tokens whose target is not `ignore_index`
/// (PyTorch's `ignore_index`, -100 for padding). All tokens ignored gives NaN, as PyTorch.
pub fn loss_parallel_ignoring(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    group: &ProcessGroup,
    vocab: usize,
    ignore_index: i64,
) -> Result<Tensor<1>, TpError> {
    let keep = targets.clone().not_equal_elem(ignore_index).float();
    let losses = token_losses(logits, targets, group, vocab)?;
    Ok((losses * keep.clone()).sum() / keep.sum())
}

/// The weighted sum `sum_i weights[i] * CE_i` of the tokens' cross-entropies, replicated,
/// shape `[1]`: a masked loss without a magic target id (a weight of 0 drops a token whatever
/// its target; every target must still be a vocabulary id). `weights` is `[tokens]`, f32.
/// With `weights = mask / count` it is the masked mean, with the count taken over any set of
/// tokens (the global batch's); under a vocab split (tp > 1) every rank computes the same
/// value and its own logits' gradient.
pub fn loss_parallel_weighted(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    weights: Tensor<1>,
    group: &ProcessGroup,
    vocab: usize,
) -> Result<Tensor<1>, TpError> {
    if weights.dims()[0] != targets.dims()[0] {
        return Err(TpError::Loss(format!(
            "{} weights for {} targets: give one weight per token",
            weights.dims()[0],
            targets.dims()[0]
        )));
    }
    let losses = token_losses(logits, targets, group, vocab)?;
    Ok((losses * weights.cast(FloatDType::F32)).sum())
}

/// Per-token cross-entropy `[tokens]`; a target outside the vocabulary contributes no
/// target logit (callers mask it).
fn token_losses(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    group: &ProcessGroup,
    vocab: usize,
) -> Result<Tensor<1>, TpError> {
    let path = "loss_parallel";
    let spec = ShardSpec::new(vocab, group, path, "vocab")?;
    let [tokens, local] = logits.dims();
    if local != spec.range.len() || targets.dims()[0] != tokens {
        return Err(TpError::Loss(format!(
            "logits [{tokens}, {local}] and targets [{}] do not match rank {}'s vocab chunk \
             {:?} of {vocab} over tp = {}",
            targets.dims()[0],
            group.index(),
            spec.range,
            group.size()
        )));
    }
    let err = TpError::collective(path);
    if logits.device() != targets.device() {
        return Err(TpError::Loss(format!(
            "logits are on {:?} but targets on {:?}: build both on the model's device",
            logits.device(),
            targets.device()
        )));
    }
    let logits = logits.cast(FloatDType::F32);

    // The global row max only stabilises exp: a constant, so no gradient flows through it.
    let max = coll::all_reduce(logits.clone().max_dim(1), group, ReduceOp::Max).map_err(err)?;
    let shifted = logits - max;

    let sum_exp = coll::reduce_from_group(shifted.clone().exp().sum_dim(1), group)
        .map_err(TpError::collective(path))?;

    let (start, end) = (spec.range.start as i64, spec.range.end as i64);
    let outside = targets
        .clone()
        .lower_elem(start)
        .bool_or(targets.clone().greater_equal_elem(end));
    let idx = targets.sub_scalar(start).mask_fill(outside.clone(), 0);
    let keep = outside
        .bool_not()
        .float()
        .cast(FloatDType::from(shifted.dtype()));
    let picked = shifted.gather(1, idx.unsqueeze_dim::<2>(1)) * keep.unsqueeze_dim::<2>(1);
    let target = coll::reduce_from_group(picked, group).map_err(TpError::collective(path))?;

    Ok((sum_exp.log() - target).squeeze_dim::<1>(1))
}
