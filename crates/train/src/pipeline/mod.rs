//! The trainer under pipeline parallelism (`--pp N`): each rank builds only its stages of the
//! Llama ([`LlamaStage`]; one chunk, or `--stages-per-rank` under the interleaved schedule),
//! splits its rows of the step into `--microbatches` and runs
//! [`pipeline_train_step_reported`] with the run's optimizer, learning-rate schedule and
//! `--grad-clip`. The loss and gradient norm it reports are the global batch's mean and the
//! global norm, as under every other layout. What the pipeline path does not support yet is
//! refused by [`check`] before any rank starts.

mod batches;
mod build;
mod export;

use std::time::Instant;

use burn::tensor::Gradients;
use burn_parallel_checkpoint::LoadOptions;
use burn_parallel_comm::{OpKind, RankContext};
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{
    MeshContext, MeshSizes, ScheduleKind, StepReport, pipeline_train_step_reported,
};

use crate::batches::evaluates_after;
use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::TrainError;
use crate::guard::check_finite;
use crate::options::PipelineOptions;
use crate::resume::{Resume, RunOptimizer, SavePoint, Saves, saves_after};
use crate::schedule::LrSchedule;
use crate::state::{model_state_bytes, optimizer_state_bytes};
use crate::step_log::{
    RankResult, StepCalls, StepLog, StepTimes, fsdp_memory, max_over_world, step_figures,
};
use crate::stop::stop_agreed;
use crate::stragglers::Stragglers;
use crate::usage::ProcessUsage;
use batches::{eval_loss, step_microbatches};
use build::build_chunks;
use export::{finish_lora, save};

impl PipelineOptions {
    /// The schedule: the one given, else 1F1B.
    pub fn schedule(&self) -> ScheduleKind {
        self.schedule.unwrap_or_default()
    }

    /// The microbatches per step on `pp` stages.
    pub fn microbatches(&self, pp: usize) -> usize {
        self.microbatches.unwrap_or(pp)
    }

    /// The chunks each pipeline rank holds.
    pub fn stages_per_rank(&self) -> usize {
        let interleaved = self.schedule() == ScheduleKind::Interleaved;
        self.stages_per_rank
            .unwrap_or(if interleaved { 2 } else { 1 })
    }

    fn given(&self) -> bool {
        *self != Self::default()
    }
}

/// Refuses, before the mesh is validated, the settings the pipeline path does not support
/// (naming the flag and what to use instead), and the schedule flags without `--pp > 1`.
pub(crate) fn check_flags(cfg: &TrainConfig, model: &LlamaConfig) -> Result<(), TrainError> {
    match cfg.distributed.pp_size > 1 {
        true => unsupported(cfg, model),
        false if cfg.pipeline.given() => {
            bad("--pp-schedule, --microbatches and --stages-per-rank need --pp > 1")
        }
        false => Ok(()),
    }
}

/// Refuses, before any rank starts, the schedule settings that cannot work on `mesh` and the
/// model.
pub(crate) fn check(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: MeshSizes,
) -> Result<(), TrainError> {
    let (opts, pp) = (&cfg.pipeline, cfg.distributed.pp_size);
    if pp <= 1 {
        return Ok(());
    }
    let (schedule, m, v) = (
        opts.schedule(),
        opts.microbatches(pp),
        opts.stages_per_rank(),
    );
    if m == 0 || v == 0 {
        return bad("--microbatches and --stages-per-rank must be at least 1");
    }
    if schedule != ScheduleKind::Interleaved && v != 1 {
        return bad(format!(
            "--stages-per-rank {v} needs --pp-schedule interleaved (gpipe and 1f1b hold one \
             stage per rank)"
        ));
    }
    if schedule == ScheduleKind::Interleaved && !m.is_multiple_of(pp) {
        return bad(format!(
            "--pp-schedule interleaved needs --microbatches ({m}) to be a multiple of --pp \
             ({pp}); use {}",
            m.next_multiple_of(pp)
        ));
    }
    let layers = model.num_hidden_layers;
    if layers < pp * v {
        return bad(format!(
            "the model's {layers} layers cannot fill --pp {pp} x --stages-per-rank {v} stages \
             (each needs a layer); use fewer stages"
        ));
    }
    // The fewest rows any data-parallel rank holds of the global batch.
    let fewest = cfg.global_batch / mesh.dp();
    if fewest < m {
        return bad(format!(
            "--microbatches {m}: a data-parallel rank holds only {fewest} of --global-batch {}'s \
             rows, so a microbatch would have none; use --microbatches <= {fewest} or a larger \
             --global-batch",
            cfg.global_batch
        ));
    }
    Ok(())
}

/// The settings the pipeline path refuses (not yet supported under `--pp`).
fn unsupported(cfg: &TrainConfig, model: &LlamaConfig) -> Result<(), TrainError> {
    let d = &cfg.distributed;
    let refusals = [
        (d.cp_size > 1, "--cp", "context parallelism without --pp"),
        (
            d.ep_size > 1 && model.moe.is_none(),
            "--ep with a dense model",
            "a mixture-of-experts model, or no --ep",
        ),
        (
            model.moe.as_ref().is_some_and(|m| m.output_router_logits),
            "a mixture-of-experts model's load-balancing loss (output_router_logits)",
            "output_router_logits = false in the model's config",
        ),
        (
            model.tie_word_embeddings,
            "tied embeddings (the embedding lives on the first stage, the LM head on the last)",
            "a model with tie_word_embeddings = false",
        ),
        (
            cfg.grad_accum > 1,
            "--grad-accum > 1",
            "--microbatches (the pipeline accumulates over them)",
        ),
    ];
    match refusals.iter().find(|r| r.0) {
        Some((_, what, instead)) => bad(format!(
            "--pp {}: {what} is not supported under pipeline parallelism yet; use {instead}",
            d.pp_size
        )),
        None => Ok(()),
    }
}

fn bad(message: impl Into<String>) -> Result<(), TrainError> {
    Err(TrainError::Config(message.into()))
}

/// The pipeline run of one rank: [`crate::trainer`]'s loop with
/// [`pipeline_train_step_reported`] as its step.
pub(crate) fn run_rank(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    (data, eval): (&Dataset, Option<&Dataset>),
    resume: Option<&Resume>,
    mesh: &MeshContext,
    ctx: &RankContext,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<RankResult, TrainError> {
    let (mut chunks, trainable_params, lora) = build_chunks(cfg, model_cfg, mesh)?;
    let mut optimizer = RunOptimizer::new(cfg);
    // As the whole-model loop: the stages' parameters and optimizer state from the checkpoint
    // (saved under any layout), the data stream and the schedule from its progress.
    let (start, mut position, schedule_start) = match resume {
        Some(r) => {
            let options = LoadOptions::default();
            let state = Some(optimizer.state_mut());
            chunks = r.checkpoint.load_stages(chunks, state, mesh, &options)?.0;
            (r.step, r.data_position, r.schedule_position)
        }
        None => (0, 0, 0),
    };
    let states = optimizer.states_per_param();
    let my_state = model_state_bytes(&chunks, states);
    let my_optimizer_state = optimizer_state_bytes(&chunks, states);
    let [peak_state, peak_optimizer_state] = max_over_world(ctx, [my_state, my_optimizer_state])?;
    burn_parallel_comm::memory::reset_peak_rss();
    let memory = fsdp_memory(&chunks);
    let schedule = LrSchedule::of(cfg);
    let rows = mesh.local_rows(cfg.global_batch);
    let global_tokens = (cfg.global_batch * cfg.seq_len) as f64;
    let stats_before = ctx.stats();
    let mut reports = Vec::with_capacity(cfg.steps - start);
    let mut saves = Saves::new();
    let mut stopped_at = None;
    let mut stragglers = Stragglers::default();
    for step in start..cfg.steps {
        let start_time = Instant::now();
        let (usage_before, comm_before) = (ProcessUsage::now(), ctx.stats());
        // A `nan` fault is refused under --pp when the run is checked.
        if let Some(fault) = &cfg.fault {
            fault.at_step_start(ctx.rank(), step);
        }
        let (mbs, counts) = step_microbatches(cfg, data, position, &rows, mesh)?;
        let lr = schedule.lr_at(schedule_start + (step - start));
        optimizer.set_lr(lr);
        let mut update_s = None;
        let step_fn = |m: Vec<LlamaStage>, g: Gradients, report: &StepReport| {
            let (m, seconds) = optimizer.step_unless_skipped(cfg, m, &g, report);
            update_s = seconds;
            m
        };
        let kind = cfg.pipeline.schedule();
        let (next, done) = pipeline_train_step_reported(
            chunks,
            &mbs,
            &counts,
            &rows,
            kind,
            cfg.grad_clip,
            mesh,
            step_fn,
        )?;
        chunks = next;
        let (skipped, optimizer_s) = (update_s.is_none(), update_s.unwrap_or(0.0));
        if !skipped {
            check_finite(cfg, step, &done.step)?;
        }
        position += cfg.global_batch;
        let step_time_s = start_time.elapsed().as_secs_f64();
        let eval_loss = match eval {
            Some(eval) if evaluates_after(cfg, step + 1) => {
                Some(eval_loss(cfg, &chunks, eval, &rows, mesh)?)
            }
            _ => None,
        };
        let usage = ProcessUsage::now();
        let comm = ctx.stats().since(&comm_before);
        let comm_s = |kind| comm.op(kind).time.as_secs_f64();
        // After the step's counters: the bookkeeping exchange is not the step's traffic.
        let figures = step_figures(
            ctx,
            &memory,
            &mut stragglers,
            (step, step_time_s),
            &comm,
            usage.peak_rss_bytes,
        )?;
        let report = StepLog {
            step,
            report: done.step,
            lr,
            skipped,
            step_time_s,
            tokens_per_s: global_tokens / step_time_s.max(1e-12),
            peak_model_state_bytes_per_rank: peak_state,
            trainable_params,
            optimizer_state_bytes_per_rank: peak_optimizer_state,
            // The schedule interleaves forward and backward: its whole time is reported as
            // backward.
            times: StepTimes {
                forward_s: 0.0,
                backward_s: step_time_s - optimizer_s,
                optimizer_s,
                all_gather_s: comm_s(OpKind::AllGather),
                reduce_scatter_s: comm_s(OpKind::ReduceScatter),
                all_reduce_s: comm_s(OpKind::AllReduce),
            },
            calls: StepCalls {
                all_gather_calls: comm.op(OpKind::AllGather).calls,
                reduce_scatter_calls: comm.op(OpKind::ReduceScatter).calls,
                all_reduce_calls: comm.op(OpKind::AllReduce).calls,
                all_to_all_calls: comm.op(OpKind::AllToAll).calls,
            },
            minor_faults: usage.minor_faults - usage_before.minor_faults,
            peak_rss_bytes: usage.peak_rss_bytes,
            peak_rss_bytes_per_rank: figures.rss_peak,
            gathered_peak_bytes_per_rank: figures.gathered_peak,
            rank_compute_s: figures.compute_s,
            rank_wait_s: figures.wait_s,
            eval_loss,
            aux_loss: None,
            expert_tokens_min: None,
            expert_tokens_max: None,
            pp_wait_s: Some(done.schedule.waiting.as_secs_f64()),
            pp_peak_microbatches: Some(done.schedule.peak_microbatches),
        };
        if ctx.rank() == 0 {
            on_step(&report);
        }
        reports.push(report);
        // A stop request (preemption) ends every rank's run after this step, saved.
        let stop = stop_agreed(cfg.stop.as_ref(), ctx)?;
        if let Some(save_dir) = &cfg.save_dir
            && (saves_after(cfg, step + 1) || stop)
        {
            let at = SavePoint {
                save_dir,
                done: step + 1,
                data_position: position,
            };
            saves.save_stages(cfg, at, &chunks, &optimizer, mesh)?;
        }
        if stop {
            stopped_at = Some(step + 1);
            break;
        }
    }
    saves.commit(mesh)?;
    let checkpoints = saves.done;
    let comm = ctx.stats().since(&stats_before).total();
    let comm_per_step = (comm.bytes_sent + comm.bytes_received) / reports.len().max(1) as u64;
    if stopped_at.is_none() {
        let chunks = finish_lora(cfg, chunks, lora.as_ref(), mesh)?;
        if let Some(dir) = &cfg.save {
            save(&chunks, model_cfg, dir, mesh)?;
            if mesh.rank() == 0 {
                crate::model_dir::complete(cfg, dir)?;
            }
        }
    }
    Ok((reports, my_state, comm_per_step, checkpoints, stopped_at))
}
