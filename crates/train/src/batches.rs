//! One step's batches and losses: the micro-batches of `--grad-accum`, each rank's rows of
//! them, the loss normalised over the step's GLOBAL batch, and the evaluation loss.
//!
//! The loss is `sum of the counting targets' cross-entropy / their count` over every
//! micro-batch and data-parallel rank of the step. Rank `d` hands micro-batch `m` to backward
//! as `E = dp * S_dm / N` (`S_dm` its weighted sum, `N` the count all-reduced over dp), and the
//! step averages over dp, so the gradient is the global mean's whatever each rank's count.
//! A token stream without accumulation keeps the plain mean over the rank's tokens (equal, as
//! every row has the same count).

use burn::tensor::{Int, Tensor, TensorData};
use burn_parallel_comm::ReduceOp;
use burn_parallel_models::Llama;
use burn_parallel_models::context_parallel::split_rows;
use burn_parallel_parallelizer::{Accumulated, LocalRows, MeshContext};
use burn_parallel_tp::{loss_parallel, loss_parallel_weighted};

use crate::aux::{RouterReport, router_report};
use crate::config::TrainConfig;
use crate::data::{Dataset, LossBatch};
use crate::error::TrainError;

/// The global sample indices of micro-batch `m` of the step at data position `position`,
/// this rank's rows of it.
fn micro_samples(
    cfg: &TrainConfig,
    position: usize,
    m: usize,
    rows: &LocalRows,
) -> std::ops::Range<usize> {
    let start = position + m * cfg.global_batch;
    start + rows.rows.start..start + rows.rows.end
}

/// The padded length of the step's rows: `--seq-len` when padding to it, else the longest row
/// of the step's whole global batch (every micro-batch, every rank).
pub(crate) fn pad_len(
    cfg: &TrainConfig,
    data: &Dataset,
    samples: std::ops::Range<usize>,
    mesh: &MeshContext,
) -> usize {
    let len = match cfg.data_options.pad_to_seq_len {
        true => cfg.seq_len,
        false => data.longest(samples, cfg.data_options.shuffle_seed),
    };
    // Context parallelism cuts each row in 2 x cp chunks (--seq-len is a multiple of it).
    let chunks = 2 * mesh.sizes().cp;
    match chunks > 2 {
        true => len.next_multiple_of(chunks),
        false => len,
    }
}

/// This rank's part of `batch` under context parallelism: the head-tail part of each row of
/// the ids, targets and loss mask (packed positions and segments stay whole: the model reads
/// them for the gathered keys too). The batch itself without it.
fn cp_part(batch: LossBatch, mesh: &MeshContext) -> Result<LossBatch, TrainError> {
    let Some(group) = mesh.cp_group() else {
        return Ok(batch);
    };
    let (cp, rank, rows) = (group.size(), group.index(), batch.rows);
    Ok(LossBatch {
        inputs: split_rows(&batch.inputs, rows, cp, rank)?,
        targets: split_rows(&batch.targets, rows, cp, rank)?,
        mask: split_rows(&batch.mask, rows, cp, rank)?,
        seq_len: batch.seq_len / cp,
        ..batch
    })
}

/// The model's logits of a batch, `[rows * seq, local vocab]`, and its router logits.
fn logits_of(
    model: &Llama,
    batch: &LossBatch,
    mesh: &MeshContext,
) -> Result<(Tensor<2>, Vec<Tensor<2>>), TrainError> {
    let device = mesh.device();
    let (b, t) = (batch.rows, batch.seq_len);
    let int = |v: &[i64]| Tensor::<2, Int>::from_data(TensorData::new(v.to_vec(), [b, t]), device);
    let ids = int(&batch.inputs);
    let packed = batch
        .packed
        .as_ref()
        .map(|(p, s)| (p.as_slice(), s.as_slice()));
    let (logits, router) = match (mesh.cp_group(), packed) {
        (Some(group), packed) => model.try_forward_context_parallel(ids, group, packed)?,
        (None, None) => model.try_forward_routed(ids)?,
        (None, Some((positions, segments))) => {
            model.try_forward_packed(ids, positions, segments)?
        }
    };
    let local_vocab = logits.dims()[2];
    Ok((logits.reshape([b * t, local_vocab]), router))
}

/// What the step's forward passes leave for the `Step` (its `accumulated` micro-batches).
pub(crate) struct StepForward {
    /// The last micro-batch's loss, in the `Step`'s convention (weighted by the rows'
    /// share there).
    pub loss: Tensor<1>,
    /// The earlier micro-batches' gradients and loss.
    pub accumulated: Accumulated,
    /// The last micro-batch's MoE routing report.
    pub routing: Option<RouterReport>,
    /// The step's trained (counting) targets over every rank, for masked data (`None`: every
    /// target counts).
    pub trained_tokens: Option<f64>,
}

/// Forward (and, for all but the last micro-batch, backward) of the step at data position
/// `position`. Collective: every rank calls it.
pub(crate) fn forward_step(
    cfg: &TrainConfig,
    model: &Llama,
    data: &Dataset,
    position: usize,
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<StepForward, TrainError> {
    let device = mesh.device().clone();
    let k = cfg.grad_accum;
    let vocab = model.config.vocab_size;
    let seed = cfg.data_options.shuffle_seed;
    let pad = pad_len(cfg, data, position..position + k * cfg.global_batch, mesh);
    let batches: Vec<LossBatch> = (0..k)
        .map(|m| {
            cp_part(
                data.batch(micro_samples(cfg, position, m, rows), seed, pad),
                mesh,
            )
        })
        .collect::<Result<_, _>>()?;
    // The plain per-rank mean: a token stream in one micro-batch (today's numerics).
    let plain = !data.masked() && k == 1;
    let w = rows.loss_weight();
    // E = dp * S / N, handed over as E / w (the Step weights it by w again).
    let (scale, trained_tokens) = match plain {
        true => (0.0, None),
        false => {
            let local: usize = batches.iter().map(|b| b.count()).sum();
            let n = all_reduce_sum(mesh, &[local as f64])?[0];
            let scale = match (n > 0.0, w > 0.0) {
                (true, true) => mesh.dp_cp_size() as f64 / (n * w),
                _ => 0.0,
            };
            // Token streams count every target; only masked data can have none.
            (scale, data.masked().then_some(n))
        }
    };
    let mut accumulated = Accumulated::default();
    let mut last = None;
    for (m, batch) in batches.into_iter().enumerate() {
        let (logits, router_logits) = logits_of(model, &batch, mesh)?;
        let targets = Tensor::<1, Int>::from_data(
            TensorData::new(batch.targets.clone(), [batch.rows * batch.seq_len]),
            &device,
        );
        let mut loss = match plain {
            true => loss_parallel(logits, targets, mesh.tp_group(), vocab)?,
            false => {
                let weights: Vec<f32> = batch
                    .mask
                    .iter()
                    .map(|v| (*v as f64 * scale) as f32)
                    .collect();
                let len = weights.len();
                let weights = Tensor::<1>::from_data(TensorData::new(weights, [len]), &device);
                loss_parallel_weighted(logits, targets, weights, mesh.tp_group(), vocab)?
            }
        };
        let routing = router_report(model, &router_logits, rows, mesh)?;
        if let Some(term) = routing.as_ref().and_then(|r| r.term.clone()) {
            loss = loss + term.div_scalar(k as f64);
        }
        if m + 1 < k {
            mesh.set_requires_gradient_sync(false);
            accumulated.backward(model, loss.mul_scalar(w));
            mesh.set_requires_gradient_sync(true);
        } else {
            last = Some((loss, routing));
        }
    }
    let (loss, routing) = last.expect("at least one micro-batch");
    Ok(StepForward {
        loss,
        accumulated,
        routing,
        trained_tokens,
    })
}

/// Sums `values` over the data-parallel group, with the cp ranks (each holding a part of every
/// row) under context parallelism (exactly, in f64).
pub(crate) fn all_reduce_sum(mesh: &MeshContext, values: &[f64]) -> Result<Vec<f64>, TrainError> {
    if mesh.dp_cp_size() == 1 {
        return Ok(values.to_vec());
    }
    let data = TensorData::new(values.to_vec(), [values.len()]);
    let summed = mesh.dp_cp_group().all_reduce(data, ReduceOp::Sum)?;
    Ok(summed.try_into_vec::<f64>().expect("f64 sums"))
}

/// The evaluation loss: the counting targets' mean cross-entropy over the whole of `data`, or
/// its first `--eval-batches` global batches (file order), each item once, forward only, under
/// the run's strategy. Collective: every rank calls it.
pub(crate) fn eval_loss(
    cfg: &TrainConfig,
    model: &Llama,
    data: &Dataset,
    rows: &LocalRows,
    mesh: &MeshContext,
) -> Result<f32, TrainError> {
    let device = mesh.device().clone();
    let vocab = model.config.vocab_size;
    let b = cfg.global_batch;
    let (mut sum, mut count) = (0.0f64, 0.0f64);
    let eval = cfg.data_options.eval_batches;
    // Past the end of what the evaluation reads, rows count nothing: each item counts once.
    let end = eval.items(data.len(), b);
    for e in 0..eval.batches(data.len(), b) {
        let start = e * b;
        let pad = match cfg.data_options.pad_to_seq_len {
            true => cfg.seq_len,
            false => data.longest(start..start + b, None),
        };
        let pad = match mesh.sizes().cp {
            1 => pad,
            cp => pad.next_multiple_of(2 * cp),
        };
        let first = start + rows.rows.start;
        let mut batch = data.batch(first..start + rows.rows.end, None, pad);
        batch.count_rows_before(end.saturating_sub(first));
        let batch = cp_part(batch, mesh)?;
        let (logits, _) = logits_of(model, &batch, mesh)?;
        let n = batch.rows * batch.seq_len;
        let targets =
            Tensor::<1, Int>::from_data(TensorData::new(batch.targets.clone(), [n]), &device);
        let weights = Tensor::<1>::from_data(TensorData::new(batch.mask.clone(), [n]), &device);
        let s = loss_parallel_weighted(logits, targets, weights, mesh.tp_group(), vocab)?;
        let s = s
            .detach()
            .into_data()
            .convert_dtype(burn::tensor::DType::F64);
        sum += s.try_into_vec::<f64>().expect("an f64 sum")[0];
        count += batch.count() as f64;
    }
    let total = all_reduce_sum(mesh, &[sum, count])?;
    Ok((total[0] / total[1]) as f32)
}

/// Whether the run evaluates after `done` steps: every `--eval-every` steps and after the
/// last.
pub(crate) fn evaluates_after(cfg: &TrainConfig, done: usize) -> bool {
    let every = cfg.data_options.eval_every;
    every > 0 && (done.is_multiple_of(every) || done == cfg.steps)
}
