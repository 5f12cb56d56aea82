//! A `--pp` run's rows as microbatches: each step's (this rank's rows of the global batch) and
//! each evaluation batch's. Token streams train on each microbatch's mean loss; masked data
//! (SFT, chat, packed rows) weights each counting target so that the step's loss is the
//! counting targets' mean over the global batch, as every other layout computes it.

use burn_parallel_models::{LlamaStage, TokenMicrobatch};
use burn_parallel_parallelizer::{LocalRows, MeshContext, pipeline_eval_loss};

use crate::batches::{all_reduce_sum, pad_len};
use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::{TrainError, flag_error};

/// This rank's rows of one global batch, split into the run's microbatches.
struct Split {
    microbatches: Vec<TokenMicrobatch>,
    /// Rows of each microbatch.
    rows: Vec<usize>,
    /// Each microbatch's loss mask.
    masks: Vec<Vec<f32>>,
    /// Counting targets of all of them.
    count: usize,
}

/// This rank's `rows` of the global batch starting at sample `position`, padded to `pad`; the
/// samples from `end` on count nothing (an evaluation's rows past the end of its data).
fn split(
    cfg: &TrainConfig,
    data: &Dataset,
    position: usize,
    shuffle_seed: Option<u64>,
    pad: usize,
    rows: &LocalRows,
    end: usize,
) -> Result<Split, TrainError> {
    let samples = position + rows.rows.start..position + rows.rows.end;
    let first = samples.start;
    let mut batch = data.batch(samples, shuffle_seed, pad);
    batch.count_rows_before(end.saturating_sub(first));
    let m = cfg.pipeline.microbatches(cfg.distributed.pp_size);
    let (b, t) = (batch.rows, batch.seq_len);
    let (plain, counts) = TokenMicrobatch::split(&batch.inputs, &batch.targets, b, t, m)
        .map_err(|e| flag_error("--microbatches", format!("{m}: {e}")))?;
    let (mut masks, mut microbatches) = (Vec::with_capacity(m), Vec::with_capacity(m));
    let mut start = 0;
    for (mb, &r) in plain.into_iter().zip(&counts) {
        let tokens = start * t..(start + r) * t;
        masks.push(batch.mask[tokens.clone()].to_vec());
        // Packed rows keep their documents' positions and boundaries.
        microbatches.push(match &batch.packed {
            None => mb,
            Some((positions, segments)) => mb
                .with_packing(
                    positions[tokens.clone()].to_vec(),
                    segments[tokens].to_vec(),
                )
                .map_err(|e| TrainError::Config(e.to_string()))?,
        });
        start += r;
    }
    Ok(Split {
        microbatches,
        rows: counts,
        masks,
        count: batch.count(),
    })
}

/// `split`'s microbatches with each target weighted by `mask * dp / (n w) * rows / rows_m`:
/// `n` counting targets in what the loss averages over, `w` this rank's weight. The step weighs
/// microbatch `m`'s loss by `w * rows_m / rows` (its share of a mean over rows) and averages
/// over the `dp` data-parallel ranks, so the total is the counting targets' mean.
fn weighted(
    split: Split,
    n: f64,
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<Vec<TokenMicrobatch>, TrainError> {
    let scale = mesh.dp_cp_size() as f64 / (n.max(1.0) * rows.loss_weight());
    split
        .microbatches
        .into_iter()
        .zip(split.masks)
        .zip(&split.rows)
        .map(|((mb, mask), &r)| {
            let per_target = scale * rows.len() as f64 / r as f64;
            let weights = mask
                .iter()
                .map(|&v| (v as f64 * per_target) as f32)
                .collect();
            mb.with_weights(weights)
                .map_err(|e| TrainError::Config(e.to_string()))
        })
        .collect()
}

/// A step's microbatches on this rank, the rows each holds, and for masked data the global
/// batch's trained (counting) targets.
pub(super) type StepMicrobatches = (Vec<TokenMicrobatch>, Vec<usize>, Option<f64>);

/// The step at data position `position`: this rank's rows as microbatches, with the rows each
/// holds, and for masked data the global batch's trained (counting) targets. Collective over
/// the data-parallel ranks for masked data (the global count).
pub(super) fn step_microbatches(
    cfg: &TrainConfig,
    data: &Dataset,
    position: usize,
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<StepMicrobatches, TrainError> {
    let seed = cfg.data_options.shuffle_seed;
    let pad = pad_len(cfg, data, position..position + cfg.global_batch, mesh);
    // Training counts every row (the stream wraps around the epochs).
    let split = split(cfg, data, position, seed, pad, rows, usize::MAX)?;
    if !data.masked() {
        return Ok((split.microbatches, split.rows, None));
    }
    let n = all_reduce_sum(mesh, &[split.count as f64])?[0];
    let counts = split.rows.clone();
    Ok((weighted(split, n, rows, mesh)?, counts, Some(n)))
}

/// The `--eval-data` loss under pp: the counting targets' mean cross-entropy over the whole
/// eval data, or its first `--eval-batches` global batches (file order, each padded to its
/// longest row, each item once), forward only through the stages. Collective as a step.
pub(super) fn eval_loss(
    cfg: &TrainConfig,
    chunks: &[LlamaStage],
    data: &Dataset,
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<f32, TrainError> {
    let b = cfg.global_batch;
    let eval = cfg.data_options.eval_batches;
    // Past the end of what the evaluation reads, rows count nothing: each item counts once.
    let end = eval.items(data.len(), b);
    let splits = (0..eval.batches(data.len(), b))
        .map(|e| {
            let start = e * b;
            let pad = match cfg.data_options.pad_to_seq_len {
                true => cfg.seq_len,
                false => data.longest(start..start + b, None),
            };
            split(cfg, data, start, None, pad, rows, end)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let local: usize = splits.iter().map(|s| s.count).sum();
    let n = all_reduce_sum(mesh, &[local as f64])?[0];
    let kind = cfg.pipeline.schedule();
    let mut sum = 0.0;
    for split in splits {
        let counts = split.rows.clone();
        let microbatches = weighted(split, n, rows, mesh)?;
        sum += pipeline_eval_loss(chunks, &microbatches, &counts, rows, kind, mesh)?;
    }
    Ok(sum)
}
