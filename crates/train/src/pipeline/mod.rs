//! The trainer under pipeline parallelism (`--pp N`): each rank builds only its stages of the
//! Llama ([`LlamaStage`]; one chunk, or `--stages-per-rank` under the interleaved schedule),
//! splits its rows of the step into `--microbatches` and runs
//! [`Step::run_pipeline`] with the run's optimizer, learning-rate schedule and
//! `--grad-clip`. The loss and gradient norm it reports are the global batch's mean and the
//! global norm, as under every other layout. What the pipeline path does not support yet is
//! refused by [`check`] before any rank starts.

mod batches;
mod build;
mod export;

use burn_parallel_checkpoint::LoadOptions;
use burn_parallel_fsdp::MemoryTracker;
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{LocalRows, MeshContext, MeshSizes, ScheduleKind, Step};
use burn_parallel_peft::LoraConfig;

use crate::config::TrainConfig;
use crate::data::Dataset;
use crate::error::TrainError;
use crate::options::PipelineOptions;
use crate::resume::{Resume, RunOptimizer, SavePoint, Saves};
use crate::run_loop::{RankRun, StepDone, StepInput, StepRunner, Update, no_update, train_loop};
use crate::step_log::{RankResult, fsdp_memory};
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
        false if cfg.pipeline.given() => bad(
            "--pp-schedule",
            ", --microbatches and --stages-per-rank need --pp > 1",
        ),
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
        return bad("--microbatches", "and --stages-per-rank must be at least 1");
    }
    if schedule != ScheduleKind::Interleaved && v != 1 {
        return bad(
            "--stages-per-rank",
            format!("{v} needs --pp-schedule interleaved (gpipe and 1f1b hold one stage per rank)"),
        );
    }
    if schedule == ScheduleKind::Interleaved && !m.is_multiple_of(pp) {
        return bad(
            "--pp-schedule",
            format!(
                "interleaved needs --microbatches ({m}) to be a multiple of --pp ({pp}); use {}",
                m.next_multiple_of(pp)
            ),
        );
    }
    let layers = model.num_hidden_layers;
    if layers < pp * v {
        return Err(TrainError::Config(format!(
            "the model's {layers} layers cannot fill --pp {pp} x --stages-per-rank {v} stages \
             (each needs a layer); use fewer stages"
        )));
    }
    // The fewest rows any data-parallel rank holds of the global batch.
    let fewest = cfg.global_batch / mesh.dp();
    if fewest < m {
        return bad(
            "--microbatches",
            format!(
                "{m}: a data-parallel rank holds only {fewest} of --global-batch {}'s rows, so a \
                 microbatch would have none; use --microbatches <= {fewest} or a larger \
                 --global-batch",
                cfg.global_batch
            ),
        );
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
        Some((_, what, instead)) => bad(
            "--pp",
            format!(
                "{}: {what} is not supported under pipeline parallelism yet; use {instead}",
                d.pp_size
            ),
        ),
        None => Ok(()),
    }
}

fn bad(flag: &'static str, reason: impl Into<String>) -> Result<(), TrainError> {
    Err(crate::error::flag_error(flag, reason))
}

/// The pipeline run of one rank: the one loop ([`crate::run_loop`]) over this rank's stages.
pub(crate) fn run_rank(
    run: &RankRun<'_>,
    model_cfg: &LlamaConfig,
) -> Result<RankResult, TrainError> {
    let (cfg, mesh) = (run.cfg, run.mesh);
    let (chunks, trainable_params, lora) = build_chunks(cfg, model_cfg, mesh)?;
    let runner = Stages {
        cfg,
        model_cfg,
        lora,
    };
    train_loop(run, &runner, (chunks, trainable_params))
}

/// This rank's stages: each step splits the rows into microbatches and runs
/// [`Step::run_pipeline`] on the configured schedule.
struct Stages<'a> {
    cfg: &'a TrainConfig,
    model_cfg: &'a LlamaConfig,
    /// The run's LoRA config (fresh or loaded), if any.
    lora: Option<LoraConfig>,
}

impl StepRunner for Stages<'_> {
    type Model = Vec<LlamaStage>;

    fn samples_per_step(&self, cfg: &TrainConfig) -> usize {
        cfg.global_batch
    }

    /// The stages' parameters and optimizer state from the checkpoint, saved under any layout.
    fn resume(
        &self,
        chunks: Vec<LlamaStage>,
        resume: &Resume,
        optimizer: &mut RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<Vec<LlamaStage>, TrainError> {
        let state = Some(optimizer.state_mut());
        let options = LoadOptions::default();
        Ok(resume
            .checkpoint
            .load_stages(chunks, state, mesh, &options)?
            .0)
    }

    fn memory(&self, chunks: &Vec<LlamaStage>) -> Vec<MemoryTracker> {
        fsdp_memory(chunks)
    }

    /// A `nan` fault drill is refused under --pp before the run starts.
    fn step(
        &self,
        chunks: Vec<LlamaStage>,
        input: StepInput<'_>,
        update: Update<'_, Vec<LlamaStage>>,
        mesh: &MeshContext,
    ) -> Result<(Vec<LlamaStage>, StepDone), TrainError> {
        let cfg = self.cfg;
        let (mbs, counts, trained_tokens) =
            step_microbatches(cfg, input.data, input.position, input.rows, mesh)?;
        let step = Step::new(mesh, input.rows).max_grad_norm(cfg.grad_clip);
        let schedule = cfg.pipeline.schedule();
        // The same count on every rank of every stage: all skip alike.
        let no_trained_tokens = trained_tokens == Some(0.0);
        let (chunks, done) = match no_trained_tokens {
            true => step.run_pipeline(chunks, &mbs, &counts, schedule, no_update)?,
            false => step.run_pipeline(chunks, &mbs, &counts, schedule, update)?,
        };
        let schedule = &done.schedule;
        let done = StepDone {
            report: done.step,
            forward_s: None,
            forward_comm: None,
            routing: None,
            schedule: Some((schedule.waiting.as_secs_f64(), schedule.peak_microbatches)),
            no_trained_tokens,
        };
        Ok((chunks, done))
    }

    fn eval(
        &self,
        chunks: &Vec<LlamaStage>,
        eval: &Dataset,
        rows: &LocalRows,
        mesh: &MeshContext,
    ) -> Result<f32, TrainError> {
        eval_loss(self.cfg, chunks, eval, rows, mesh)
    }

    fn save_checkpoint(
        &self,
        saves: &mut Saves,
        at: SavePoint<'_>,
        chunks: &Vec<LlamaStage>,
        optimizer: &RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<(), TrainError> {
        saves.save_stages(self.cfg, at, chunks, optimizer, mesh)
    }

    fn finish(&self, chunks: Vec<LlamaStage>, mesh: &MeshContext) -> Result<(), TrainError> {
        let chunks = finish_lora(self.cfg, chunks, self.lora.as_ref(), mesh)?;
        if let Some(dir) = &self.cfg.save {
            save(&chunks, self.model_cfg, dir, mesh)?;
            if mesh.rank() == 0 {
                crate::model_dir::complete(self.cfg, dir)?;
            }
        }
        Ok(())
    }
}
