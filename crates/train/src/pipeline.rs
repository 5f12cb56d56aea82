//! The trainer under pipeline parallelism (`--pp N`): each rank builds only its stages of the
//! Llama ([`LlamaStage`]; one chunk, or `--stages-per-rank` under the interleaved schedule),
//! splits its rows of the step into `--microbatches` and runs
//! [`pipeline_train_step_reported`] with the run's optimizer, learning-rate schedule and
//! `--grad-clip`. The loss and gradient norm it reports are the global batch's mean and the
//! global norm, as under every other layout. What the pipeline path does not support yet is
//! refused by [`check`] before any rank starts.

use std::time::Instant;

use burn::module::Module;
use burn::tensor::{Gradients, TensorData};
use burn_parallel_comm::{OpKind, RankContext, ReduceOp};
use burn_parallel_models::{LlamaConfig, LlamaStage, TokenMicrobatch};
use burn_parallel_parallelizer::{
    LocalRows, MeshContext, MeshSizes, ScheduleKind, StageSplit, StepReport, parallelize_model,
    pipeline_train_step_reported,
};

use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::TrainError;
use crate::guard::{check_finite, skips};
use crate::resume::RunOptimizer;
use crate::schedule::LrSchedule;
use crate::state::{model_state_bytes, optimizer_state_bytes};
use crate::trainer::{RankResult, StepCalls, StepLog, StepTimes, max_over_world};
use crate::usage::ProcessUsage;

/// The pipeline schedule of a `--pp` run, each `None` when not given.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineOptions {
    /// `--pp-schedule` (default 1f1b).
    pub schedule: Option<ScheduleKind>,
    /// `--microbatches` each pipeline rank splits its rows into (default: the pp size).
    pub microbatches: Option<usize>,
    /// `--stages-per-rank` (default 2 under interleaved, else 1).
    pub stages_per_rank: Option<usize>,
}

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

/// Refuses, before any rank starts, data the pipeline path cannot train on and schedule
/// settings that cannot work on `mesh` and the model.
pub(crate) fn check(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: MeshSizes,
    data: &Dataset,
) -> Result<(), TrainError> {
    let (opts, pp) = (&cfg.pipeline, cfg.distributed.pp_size);
    if pp <= 1 {
        return Ok(());
    }
    if data.masked() || data.packed() {
        return bad(format!(
            "--pp {pp}: SFT, chat or packed data (masked targets) is not supported under \
             pipeline parallelism yet; use a token stream (.bin, text)"
        ));
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
        (d.ep_size > 1, "--ep", "expert parallelism without --pp"),
        (
            model.moe.is_some(),
            "a mixture-of-experts model",
            "a dense model",
        ),
        (
            model.tie_word_embeddings,
            "tied embeddings (the embedding lives on the first stage, the LM head on the last)",
            "a model with tie_word_embeddings = false",
        ),
        (
            cfg.checkpoint.is_some(),
            "--checkpoint",
            "a seeded model (--model), or no --pp",
        ),
        (
            cfg.save.is_some() || cfg.save_every.is_some() || cfg.resume.is_some(),
            "--save, --save-every and --resume (sharded checkpoints refuse pp)",
            "a run without them, or no --pp",
        ),
        (
            cfg.lora.rank.is_some() || cfg.lora.init.is_some(),
            "LoRA",
            "full training, or no --pp",
        ),
        (!cfg.freeze.is_empty(), "--freeze", "no --freeze"),
        (
            cfg.grad_accum > 1,
            "--grad-accum > 1",
            "--microbatches (the pipeline accumulates over them)",
        ),
        (
            cfg.data_options.eval_data.is_some(),
            "--eval-data",
            "no --eval-data",
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

/// This rank's chunks (stage `c * pp + r` for chunk `c` of pipeline rank `r`), each
/// parallelized over its stage's ranks, and the elements of the whole model that train.
fn build_chunks(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: &MeshContext,
) -> Result<(Vec<LlamaStage>, u64), TrainError> {
    let group = mesh.pp_group().expect("a pipeline run has a pp group");
    let (r, p, v) = (group.index(), group.size(), cfg.pipeline.stages_per_rank());
    let split = StageSplit::even(model.num_hidden_layers, p * v)
        .map_err(|e| TrainError::Config(format!("--pp {p} --stages-per-rank {v}: {e}")))?;
    let mut own = 0;
    let mut chunks = Vec::with_capacity(v);
    for c in 0..v {
        let stage = LlamaStage::seeded(model, cfg.seed, &split, c * p + r, mesh.device())?
            .with_loss_group(mesh.tp_group().clone());
        own += stage.num_params();
        chunks.push(parallelize_model(stage, mesh)?);
    }
    // Each stage counted once: one rank per stage in the pp group.
    let own = TensorData::new(vec![own as f64], [1]);
    let total = group.all_reduce(own, ReduceOp::Sum)?;
    let total = total.try_into_vec::<f64>().expect("f64 count")[0];
    Ok((chunks, total as u64))
}

/// This rank's rows of the step at data position `position`, split into the run's
/// microbatches, with the rows each holds.
fn microbatches(
    cfg: &TrainConfig,
    data: &Dataset,
    position: usize,
    rows: &LocalRows,
) -> Result<(Vec<TokenMicrobatch>, Vec<usize>), TrainError> {
    let samples = position + rows.rows.start..position + rows.rows.end;
    let batch = data.batch(samples, cfg.data_options.shuffle_seed, cfg.seq_len);
    let m = cfg.pipeline.microbatches(cfg.distributed.pp_size);
    let (b, t) = (batch.rows, batch.seq_len);
    TokenMicrobatch::split(&batch.inputs, &batch.targets, b, t, m)
        .map_err(|e| TrainError::Config(format!("--microbatches {m}: {e}")))
}

/// The pipeline run of one rank: [`crate::trainer`]'s loop with
/// [`pipeline_train_step_reported`] as its step.
pub(crate) fn run_rank(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    data: &Dataset,
    mesh: &MeshContext,
    ctx: &RankContext,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<RankResult, TrainError> {
    let (mut chunks, trainable_params) = build_chunks(cfg, model_cfg, mesh)?;
    let mut optimizer = RunOptimizer::new(cfg);
    let states = optimizer.states_per_param();
    let my_state = model_state_bytes(&chunks, states);
    let my_optimizer_state = optimizer_state_bytes(&chunks, states);
    let [peak_state, peak_optimizer_state] = max_over_world(ctx, [my_state, my_optimizer_state])?;
    burn_parallel_comm::memory::reset_peak_rss();
    let schedule = LrSchedule::of(cfg);
    let rows = mesh.local_rows(cfg.global_batch);
    let global_tokens = (cfg.global_batch * cfg.seq_len) as f64;
    let stats_before = ctx.stats();
    let mut reports = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let start_time = Instant::now();
        let (usage_before, comm_before) = (ProcessUsage::now(), ctx.stats());
        let (mbs, counts) = microbatches(cfg, data, step * cfg.global_batch, &rows)?;
        let lr = schedule.lr_at(step);
        optimizer.set_lr(lr);
        let (mut optimizer_s, mut skipped) = (0.0, false);
        let step_fn = |m: Vec<LlamaStage>, g: Gradients, report: &StepReport| {
            skipped = skips(cfg, report);
            if skipped {
                return m;
            }
            let started = Instant::now();
            let m = optimizer.step(m, &g);
            optimizer_s = started.elapsed().as_secs_f64();
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
        if !skipped {
            check_finite(cfg, step, &done.step)?;
        }
        let step_time_s = start_time.elapsed().as_secs_f64();
        let usage = ProcessUsage::now();
        let comm = ctx.stats().since(&comm_before);
        let comm_s = |kind| comm.op(kind).time.as_secs_f64();
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
            eval_loss: None,
            aux_loss: None,
            expert_tokens_min: None,
            expert_tokens_max: None,
        };
        if ctx.rank() == 0 {
            on_step(&report);
        }
        reports.push(report);
    }
    let comm = ctx.stats().since(&stats_before).total();
    let comm_per_step = (comm.bytes_sent + comm.bytes_received) / reports.len().max(1) as u64;
    Ok((reports, my_state, comm_per_step, Vec::new()))
}
