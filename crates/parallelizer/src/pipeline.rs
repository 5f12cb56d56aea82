//! The training step of a pipeline-parallel model: this rank's stages run the schedule over the
//! step's microbatches (crate burn-parallel-pp), then the same gradient sync as every other
//! step (the data-parallel average within the stage, the global norm over every stage,
//! clipping) and one optimizer step.

use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Gradients, TensorData};
use burn_parallel_comm::ReduceOp;
use burn_parallel_describe::Parallelize;
use burn_parallel_pp::{
    PipelineError, PipelineStage, ScheduleKind, ScheduleStats, StageLink, run_forward, run_schedule,
};

use crate::context::{LocalRows, MeshContext};
use crate::error::ParallelError;
use crate::step::{StepReport, scalar, sync_stage_gradients};

/// What one pipeline step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PipelineReport {
    /// The global batch's mean loss and the global gradient norm (the same on every rank).
    pub step: StepReport,
    /// This rank's schedule: its wall time, the time it waited for its neighbours (its part
    /// of the bubble) and the most microbatches it held activations for.
    pub schedule: ScheduleStats,
}

/// One step of a pipeline-parallel model on this rank: `chunks` are its stages (one under
/// `gpipe` and `1f1b`; under `interleaved`, chunk `c` is stage `c * pp + r` of pipeline rank
/// `r`), each parallelized on its own. The microbatches are this rank's `rows` of the global
/// batch: `microbatches[m]` holds `microbatch_rows[m]` of them (see
/// [`burn_parallel_pp::split_rows`]). Each microbatch's mean loss is weighted by its share of
/// the global batch, so the step trains on the global batch's mean loss whatever the layout
/// (a stage whose loss is normalised otherwise, such as a sum over counting targets, folds the
/// inverse of that share into it, as the trainer does for masked data). FSDP defers its gradient reduction to each chunk's last backward. Then
/// [`sync_gradients`](crate::sync_gradients)'s work (the average over the stage's
/// data-parallel ranks, the global gradient norm over every stage, clipping by it when
/// `max_grad_norm` is set) and `optimizer_step` on this rank's parameters, which sees the step's
/// report first (as [`train_step_reported`](crate::train_step_reported)). The reported loss is
/// the global batch's mean on every rank, with this rank's schedule measurements. Collective:
/// every rank calls it, each with the same microbatches as the other ranks of its pipeline.
#[allow(clippy::too_many_arguments)]
pub fn pipeline_train_step_reported<const D: usize, S: PipelineStage<D> + Parallelize>(
    chunks: Vec<S>,
    microbatches: &[S::Microbatch],
    microbatch_rows: &[usize],
    rows: &LocalRows,
    schedule: ScheduleKind,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
    optimizer_step: impl FnOnce(Vec<S>, Gradients, &StepReport) -> Vec<S>,
) -> Result<(Vec<S>, PipelineReport), ParallelError> {
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
    let chunks = optimizer_step(chunks, grads, &step);
    let schedule = run.stats;
    Ok((chunks, PipelineReport { step, schedule }))
}

/// [`pipeline_train_step_reported`] with a Burn optimizer (AdamW, SGD, ...) stepping at `lr`.
#[allow(clippy::too_many_arguments)]
pub fn pipeline_train_step<const D: usize, S: PipelineStage<D> + Parallelize>(
    chunks: Vec<S>,
    microbatches: &[S::Microbatch],
    microbatch_rows: &[usize],
    rows: &LocalRows,
    schedule: ScheduleKind,
    optimizer: &mut ModuleOptimizer,
    lr: f64,
    max_grad_norm: Option<f32>,
    ctx: &MeshContext,
) -> Result<(Vec<S>, PipelineReport), ParallelError> {
    pipeline_train_step_reported(
        chunks,
        microbatches,
        microbatch_rows,
        rows,
        schedule,
        max_grad_norm,
        ctx,
        |chunks, grads, _| {
            let grads = GradientsParams::from_grads(grads, &chunks);
            optimizer.step(lr, chunks, grads)
        },
    )
}

/// The global batch's mean loss, forward only (an evaluation): the microbatches run through
/// the stages under `schedule`'s order of forwards, weighted as [`pipeline_train_step`]
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
/// `rows_m / rows`, times the rows' weight in the data-parallel average (`train_step`'s
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
