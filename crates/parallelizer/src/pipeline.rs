//! The training step of a pipeline-parallel model: this rank's stages run the schedule over the
//! step's microbatches (crate burn-parallel-pp), then the same gradient sync as every other
//! step (the data-parallel average within the stage, the global norm over every stage,
//! clipping) and one optimizer step.

use burn::tensor::TensorData;
use burn_parallel_comm::ReduceOp;
use burn_parallel_describe::Parallelize;
use burn_parallel_pp::{
    PipelineError, PipelineStage, ScheduleKind, ScheduleStats, StageLink, run_forward, run_schedule,
};

use crate::context::{LocalRows, MeshContext};
use crate::error::ParallelError;
use crate::step::{StepReport, StepUpdate, scalar, sync_stage_gradients};

/// What one pipeline step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineReport {
    /// The global batch's mean loss and the global gradient norm (the same on every rank).
    pub step: StepReport,
    /// This rank's schedule: its wall time, the time it waited for its neighbours (its part
    /// of the bubble) and the most microbatches it held activations for.
    pub schedule: ScheduleStats,
}

/// This rank's part of a pipeline step's batch: `microbatches[m]` holds `microbatch_rows[m]`
/// of this rank's `rows` (see [`burn_parallel_pp::split_rows`]), run in `schedule`'s order.
pub(crate) struct PipelineBatch<'a, M> {
    pub microbatches: &'a [M],
    pub microbatch_rows: &'a [usize],
    pub rows: &'a LocalRows,
    pub schedule: ScheduleKind,
}

/// One step of a pipeline-parallel model on this rank ([`Step::run_pipeline`](crate::Step::run_pipeline)): `chunks` are
/// its stages (one under `gpipe` and `1f1b`; under `interleaved`, chunk `c` is stage
/// `c * pp + r` of pipeline rank `r`), each parallelized on its own. Each microbatch's mean loss
/// is weighted by its share of the global batch, so the step trains on the global batch's mean
/// loss whatever the layout (a stage whose loss is normalised otherwise, such as a sum over
/// counting targets, folds the inverse of that share into it, as the trainer does for masked
/// data). FSDP defers its gradient reduction to each chunk's last backward. Then
/// [`sync_gradients`](crate::sync_gradients)'s work (the average over the stage's data-parallel
/// ranks, the global gradient norm over every stage, clipping by it when `max_grad_norm` is
/// set) and `update` on this rank's parameters. The reported loss is the global batch's mean on
/// every rank, with this rank's schedule measurements. Every rank of a pipeline runs it with
/// the same microbatches.
pub(crate) fn pipeline_step<const D: usize, S: PipelineStage<D> + Parallelize>(
    chunks: Vec<S>,
    batch: PipelineBatch<'_, S::Microbatch>,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
    update: impl StepUpdate<Vec<S>>,
) -> Result<(Vec<S>, PipelineReport), ParallelError> {
    let PipelineBatch {
        microbatches,
        microbatch_rows,
        rows,
        schedule,
    } = batch;
    let (mut link, weights) = link_and_weights(microbatches.len(), microbatch_rows, rows, ctx)?;
    let run = run_schedule(
        &chunks,
        &mut link,
        schedule,
        microbatches,
        &weights,
        ctx.device(),
        &|last| ctx.set_requires_gradient_sync(last),
    );
    // Whatever happened, the next step starts with gradient sync on.
    ctx.set_requires_gradient_sync(true);
    let run = run?;
    let mut grads = run.grads;
    let grad_norm = sync_stage_gradients(&chunks, &mut grads, max_grad_norm, ctx)?;
    let loss = global_mean(run.loss, ctx)?;
    let step = StepReport { loss, grad_norm };
    let chunks = update.update(chunks, grads, &step);
    let schedule = run.stats;
    Ok((chunks, PipelineReport { step, schedule }))
}

/// The global batch's mean loss, forward only (an evaluation): the microbatches run through
/// the stages under `schedule`'s order of forwards, weighted as [`Step::run_pipeline`](crate::Step::run_pipeline)
/// weights them. The same on every rank. Collective as a step.
pub fn pipeline_eval_loss<const D: usize, S: PipelineStage<D> + Parallelize>(
    chunks: &[S],
    microbatches: &[S::Microbatch],
    microbatch_rows: &[usize],
    rows: &LocalRows,
    schedule: ScheduleKind,
    ctx: &MeshContext,
) -> Result<f32, ParallelError> {
    let (mut link, weights) = link_and_weights(microbatches.len(), microbatch_rows, rows, ctx)?;
    let loss = run_forward(
        chunks,
        &mut link,
        schedule,
        microbatches,
        &weights,
        ctx.device(),
    )?;
    global_mean(loss, ctx)
}

/// The link to the neighbouring stages and each microbatch's loss weight: its mean loss times
/// `rows_m / rows`, times the rows' weight in the data-parallel average ([`Step::run`](crate::Step::run)'s
/// weighting, split over the microbatches).
fn link_and_weights(
    microbatches: usize,
    microbatch_rows: &[usize],
    rows: &LocalRows,
    ctx: &MeshContext,
) -> Result<(StageLink, Vec<f64>), ParallelError> {
    let (Some(forward), Some(backward)) = (ctx.pp_group(), ctx.pp_backward_group()) else {
        return Err(PipelineError::Schedule(
            "a pipeline step needs pp_size > 1 in the config".into(),
        )
        .into());
    };
    let total: usize = microbatch_rows.iter().sum();
    if total != rows.len() || microbatch_rows.len() != microbatches {
        return Err(PipelineError::Schedule(format!(
            "{microbatches} microbatches of {microbatch_rows:?} rows for this rank's {} rows",
            rows.len()
        ))
        .into());
    }
    let weights = microbatch_rows
        .iter()
        .map(|&r| rows.loss_weight() * r as f64 / rows.len() as f64)
        .collect();
    Ok((StageLink::new(forward.clone(), backward.clone())?, weights))
}

/// Only the last stage has a loss: summed over the stages, then averaged over the
/// data-parallel ranks as every step does.
fn global_mean(loss: f64, ctx: &MeshContext) -> Result<f32, ParallelError> {
    let pp = ctx.pp_group().expect("a pipeline has a pp group");
    let loss = pp.all_reduce(TensorData::new(vec![loss as f32], [1]), ReduceOp::Sum)?;
    Ok(scalar(ctx.dp_cp_group().all_reduce(loss, ReduceOp::Avg)?))
}
