//! The trainer: checks the run before any rank starts, then on every rank builds the same
//! model, parallelizes it with `parallelize_model` and trains it through the one loop
//! ([`crate::run_loop`]) with [`WholeModel`] as its step, or the pipeline's stages under `--pp`;
//! rank 0 reports each step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn_parallel_checkpoint::LoadOptions;
use burn_parallel_comm::{LaunchError, Ranks};
use burn_parallel_fsdp::{MemoryTracker, RowRequest, gather_full};
use burn_parallel_models::checkpoint::{SaveDtype, hf_tensors, lazy_llama_ep, save_llama};
use burn_parallel_models::data::TokenData;
use burn_parallel_models::{Llama, LlamaConfig};
use burn_parallel_parallelizer::{
    LocalRows, MeshContext, MeshSizes, Plan, Step, parallelize_model, parallelize_model_from,
};
use burn_parallel_peft::LazyQuantized;

use crate::batches::{eval_loss, forward_step};
use crate::config::TrainConfig;
use crate::data::{self, Dataset, EvalBatches};
use crate::error::TrainError;
use crate::freeze;
use crate::guard::{check_batch_memory, check_positions};
use crate::mesh::mesh_plan;
use crate::resume::{Resume, RunOptimizer, SavePoint, Saves, open_resume};
use crate::run_loop::{RankRun, StepDone, StepInput, StepRunner, Update, no_update, train_loop};
use crate::step_log::{RankResult, StepLog, fsdp_memory};

/// A finished run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// The mesh the run used: `dp_replicate x dp_shard x tp`.
    pub mesh: MeshSizes,
    /// The model trained (the checkpoint's config, or the built-in one).
    pub model: LlamaConfig,
    /// Every step as rank 0 saw it, in order.
    pub steps: Vec<StepLog>,
    /// The ranks this process ran, in order: all of them on the threads engine, one under MPI.
    pub ranks: Vec<usize>,
    /// Parameters + gradients + optimizer state of each of `ranks`.
    pub model_state_bytes: Vec<u64>,
    /// Bytes each of `ranks` sent and received per step on average.
    pub comm_bytes_per_step: Vec<u64>,
    /// The checkpoints `save_every` wrote, in order (and the one a stop request wrote).
    pub checkpoints: Vec<PathBuf>,
    /// The steps done when a stop request (`TrainConfig::stop`) ended the run early; `None`
    /// when it ran to `steps`. With a save directory, its last checkpoint is of this step.
    pub stopped_at: Option<usize>,
    /// How many times the run was restarted after its ranks failed (`--max-restarts`).
    pub restarts: usize,
}

impl TrainSummary {
    /// Mean throughput over the steps after the first (which pays one-time costs).
    pub fn tokens_per_s(&self) -> f64 {
        let timed = if self.steps.len() > 1 {
            &self.steps[1..]
        } else {
            &self.steps[..]
        };
        let tokens: f64 = timed.iter().map(|s| s.tokens_per_s * s.step_time_s).sum();
        let time: f64 = timed.iter().map(|s| s.step_time_s).sum();
        tokens / time.max(1e-12)
    }

    /// The loss of every step, in order.
    pub fn losses(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.report.loss).collect()
    }

    /// Whether this process ran rank 0 (the one that reports steps).
    pub fn has_rank_zero(&self) -> bool {
        self.ranks.first() == Some(&0)
    }
}

/// The model config of a run: the checkpoint's, or the built-in one.
fn model_config(cfg: &TrainConfig) -> Result<LlamaConfig, TrainError> {
    match &cfg.checkpoint {
        Some(dir) => Ok(LlamaConfig::load(dir)?),
        None => Ok(cfg.model.clone()),
    }
}

fn token_data(cfg: &TrainConfig, model: &LlamaConfig) -> Result<Dataset, TrainError> {
    let vocab = model.vocab_size;
    match &cfg.data {
        Some(path) => data::load(path, &cfg.data_options, cfg.seq_len, vocab, "--data"),
        None => {
            let len = (cfg.steps * cfg.global_batch * cfg.grad_accum).max(64) * cfg.seq_len + 1;
            Ok(Dataset::Tokens(TokenData::synthetic(
                vocab,
                cfg.seq_len,
                len,
            )?))
        }
    }
}

/// The `--eval-data` set, if any.
fn eval_data(cfg: &TrainConfig, model: &LlamaConfig) -> Result<Option<Dataset>, TrainError> {
    let Some(path) = &cfg.data_options.eval_data else {
        return Ok(None);
    };
    let eval = data::load(
        path,
        &cfg.data_options,
        cfg.seq_len,
        model.vocab_size,
        "--eval-data",
    )?;
    // Past the file's end the batches would wrap around and count items twice.
    let rows = cfg.global_batch;
    if let EvalBatches::First(batches) = cfg.data_options.eval_batches
        && batches * rows > eval.len()
    {
        return Err(crate::error::flag_error(
            "--eval-batches",
            format!(
                "{batches} of --global-batch {rows} rows need {} items, but --eval-data {} has \
                 {}: {}, so that each item counts once",
                batches * rows,
                path.display(),
                eval.len(),
                match eval.len() / rows {
                    0 => "give --eval-batches all (the whole file)".to_string(),
                    most => format!("give --eval-batches {most} or less, or all"),
                }
            ),
        ));
    }
    Ok(Some(eval))
}

/// Every tensor of the `--checkpoint` is one the config's model takes: a config.json with
/// fewer layers (or another architecture) than the weights would otherwise train, and save,
/// a truncated model without a word.
fn check_all_weights_taken(dir: &std::path::Path) -> Result<(), TrainError> {
    let untaken = burn_parallel_models::checkpoint::untaken_tensors(dir)?;
    let Some(first) = untaken.first() else {
        return Ok(());
    };
    Err(crate::error::flag_error(
        "--checkpoint",
        format!(
            "{}: {} of its tensors are not part of the model its config.json describes (the \
             first: `{first}`): the config and the weights disagree, for example in \
             num_hidden_layers; give the config.json that came with these weights",
            dir.display(),
            untaken.len()
        ),
    ))
}

/// One attempt of [`train`](crate::train): the run from its start or its `resume`
/// checkpoint, without restarts.
pub(crate) fn train_once(
    cfg: &TrainConfig,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainSummary, TrainError> {
    cfg.check()?;
    let model_cfg = model_config(cfg)?;
    // Before the data, the ranks and the model allocate anything sized by the sequence.
    check_positions(cfg, &model_cfg)?;
    crate::pipeline::check_flags(cfg, &model_cfg)?;
    crate::lora::check_model(cfg, &model_cfg)?;
    let plan = mesh_plan(cfg, &model_cfg)?;
    let mesh = plan.sizes();
    let data = token_data(cfg, &model_cfg)?;
    let eval = eval_data(cfg, &model_cfg)?;
    check_batch_memory(cfg, &model_cfg, &data, mesh)?;
    crate::guard::warn_long_step(cfg, &model_cfg);
    crate::pipeline::check(cfg, &model_cfg, mesh)?;
    if let Some(dir) = &cfg.checkpoint {
        // Opens every file now, so that a broken checkpoint fails before training.
        burn_parallel_models::checkpoint::HfCheckpoint::open(dir)?;
        check_all_weights_taken(dir)?;
    }
    let resume = open_resume(cfg)?;
    crate::outputs::check_writable(cfg)?;
    let world = cfg.world_size()?;
    let ranks = Ranks::new(world)
        .engine(cfg.engine)
        .threads_per_rank(cfg.threads_per_rank);
    let results = ranks
        .run(|ctx| {
            run_rank(
                cfg,
                &plan,
                &model_cfg,
                (&data, eval.as_ref()),
                resume.as_ref(),
                ctx,
                on_step,
            )
        })
        .map_err(ranks_failed)?;
    // Every rank holds the same (dp-averaged) reports; under MPI this process has one rank.
    let steps = results[0].1.0.clone();
    Ok(TrainSummary {
        mesh,
        model: model_cfg,
        steps,
        ranks: results.iter().map(|r| r.0).collect(),
        model_state_bytes: results.iter().map(|r| r.1.1).collect(),
        comm_bytes_per_step: results.iter().map(|r| r.1.2).collect(),
        checkpoints: results[0].1.3.clone(),
        stopped_at: results[0].1.4,
        restarts: 0,
    })
}

/// The launch's failures as one error; said once when every rank failed alike (a guard that
/// every rank decides on the same values, such as a non-finite loss).
fn ranks_failed(e: LaunchError) -> TrainError {
    let first = e.first();
    let alike = e.failures.len() > 1
        && e.failures
            .iter()
            .all(|f| !f.panicked && f.message == first.message);
    match alike {
        true => TrainError::AllRanks(format!(
            "on all {} ranks, {}",
            e.failures.len(),
            first.message
        )),
        false => TrainError::Ranks(e.to_string()),
    }
}

/// The GPU of `rank` on its node: the launcher's local rank when it sets one (one process per
/// GPU), else the rank itself (one thread per GPU of this process).
fn gpu_of(rank: usize) -> usize {
    ["LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|var| std::env::var(var).ok()?.parse().ok())
        .unwrap_or(rank)
}

/// This rank's model, with `--freeze`'s parameters frozen and parallelized as the context
/// says (an f32 `single` run stays plain), and the elements of the whole model that train. A
/// checkpoint is loaded lazily, so each FSDP rank reads only its rows.
fn build_model(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    mesh: &MeshContext,
) -> Result<(Llama, u64), TrainError> {
    let device = mesh.device();
    // Frozen before parallelize_model, which then shards them without gradient or state.
    let lora = cfg.lora.plan(cfg.seed, model_cfg.family.row().fused)?;
    // Also the QLoRA bases left lazy, whose shards a sharded load quantizes from its rows.
    let frozen = |model: Llama| -> Result<(Llama, u64, Vec<LazyQuantized>), TrainError> {
        // LoRA freezes the whole base: only the adapters train.
        if let Some(lora) = &lora {
            let (model, lazy) = crate::lora::quantize_base(model, cfg.lora.quantize)?;
            let (model, trainable) = crate::lora::apply(model, lora)?;
            return Ok((model, trainable, lazy));
        }
        let plan = freeze::plan(&model, &cfg.freeze)?;
        let model = freeze::freeze(model, &plan.frozen);
        Ok((model, plan.trainable_elements, Vec::new()))
    };
    Ok(match &cfg.checkpoint {
        Some(dir) => {
            // Under expert parallelism each rank reads its own experts whole.
            let ep = mesh.expert_groups().map(|g| &g.ep);
            let (model, rows) = lazy_llama_ep(dir, device, ep)?;
            let (model, trainable, quantized) = frozen(model)?;
            let read = move |r: &RowRequest| crate::lora::read_rows(&rows, &quantized, r);
            (parallelize_model_from(model, mesh, read)?, trainable)
        }
        None => {
            let (model, trainable, _) = frozen(Llama::seeded(model_cfg, cfg.seed, device))?;
            (parallelize_model(model, mesh)?, trainable)
        }
    })
}

fn run_rank(
    cfg: &TrainConfig,
    plan: &Plan,
    model_cfg: &LlamaConfig,
    (data, eval): (&Dataset, Option<&Dataset>),
    resume: Option<&Resume>,
    ctx: burn_parallel_comm::RankContext,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<RankResult, TrainError> {
    let device = cfg.backend.device(gpu_of(ctx.rank()))?;
    // The Llama checkpoints its decoder layers itself (`activation_checkpointing_mode`
    // "full" or every k-th layer). Selective checkpointing by op is Burn's checkpointing
    // device, which keeps about 1.4x the activations otherwise (the inputs of the ops it may
    // recompute). FSDP2 reshards on the
    // plain device (the decoder's projections gather their weights again in backward);
    // Megatron-FSDP's flat units, and the experts' stacked weights (their matmuls are Burn's),
    // only there.
    let experts_reshard =
        model_cfg.moe.is_some() && plan.shards_parameters() && plan.resharding() != Some(false);
    let recomputes = plan.reshards_by_recomputation() || experts_reshard;
    let device = match plan.checkpoints_ops() || recomputes {
        true => device.gradient_checkpointing(),
        false => device,
    };
    let mesh = MeshContext::from_plan(&ctx, plan.clone(), device)?;
    // One job per save directory, held until this rank's run returns.
    let _save_dir = crate::outputs::hold_save_dir(cfg, &mesh)?;
    let run = RankRun {
        cfg,
        data,
        eval,
        resume,
        mesh: &mesh,
        ctx: &ctx,
        on_step,
    };
    if mesh.pp_group().is_some() {
        return crate::pipeline::run_rank(&run, model_cfg);
    }
    let model = build_model(cfg, model_cfg, &mesh)?;
    let runner = WholeModel { cfg, model_cfg };
    train_loop(&run, &runner, model)
}

/// The whole model on every rank (every layout but pipeline parallelism): each step runs
/// every micro-batch's forward and backward, then the [`Step`] with the earlier ones
/// accumulated.
struct WholeModel<'a> {
    cfg: &'a TrainConfig,
    model_cfg: &'a LlamaConfig,
}

impl StepRunner for WholeModel<'_> {
    type Model = Llama;

    fn samples_per_step(&self, cfg: &TrainConfig) -> usize {
        cfg.global_batch * cfg.grad_accum
    }

    fn resume(
        &self,
        model: Llama,
        resume: &Resume,
        optimizer: &mut RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<Llama, TrainError> {
        let state = Some(optimizer.state_mut());
        let options = LoadOptions::default();
        Ok(resume.checkpoint.load(model, state, mesh, &options)?.0)
    }

    fn memory(&self, model: &Llama) -> Vec<MemoryTracker> {
        fsdp_memory(std::slice::from_ref(model))
    }

    fn step(
        &self,
        model: Llama,
        input: StepInput<'_>,
        update: Update<'_, Llama>,
        mesh: &MeshContext,
    ) -> Result<(Llama, StepDone), TrainError> {
        let cfg = self.cfg;
        let start = Instant::now();
        // Every micro-batch's forward (the earlier ones' backward too), the loss normalised
        // over the step's global batch (`batches`).
        let forward = forward_step(cfg, &model, input.data, input.position, input.rows, mesh)?;
        let forward_s = start.elapsed().as_secs_f64();
        let forward_comm = input.ctx.stats();
        let loss = match input.nan_fault {
            true => forward.loss.mul_scalar(f32::NAN),
            false => forward.loss,
        };
        let step = Step::new(mesh, input.rows)
            .max_grad_norm(cfg.grad_clip)
            .accumulated(forward.accumulated);
        // The same count on every rank: every rank skips alike, still running the step's
        // collectives.
        let no_trained_tokens = forward.trained_tokens == Some(0.0);
        let (model, report) = match no_trained_tokens {
            true => step.run(model, loss, no_update)?,
            false => step.run(model, loss, update)?,
        };
        let done = StepDone {
            report,
            forward_s: Some(forward_s),
            forward_comm: Some(forward_comm),
            routing: forward.routing,
            schedule: None,
            no_trained_tokens,
        };
        Ok((model, done))
    }

    fn eval(
        &self,
        model: &Llama,
        eval: &Dataset,
        rows: &LocalRows,
        mesh: &MeshContext,
    ) -> Result<f32, TrainError> {
        eval_loss(self.cfg, model, eval, rows, mesh)
    }

    fn save_checkpoint(
        &self,
        saves: &mut Saves,
        at: SavePoint<'_>,
        model: &Llama,
        optimizer: &RunOptimizer,
        mesh: &MeshContext,
    ) -> Result<(), TrainError> {
        saves.save_model(self.cfg, at, model, optimizer, mesh)
    }

    /// With LoRA, the adapter saved and the base merged; then `--save`.
    fn finish(&self, model: Llama, mesh: &MeshContext) -> Result<(), TrainError> {
        let is_root = mesh.rank() == 0;
        let model = crate::lora::finish_run(self.cfg, self.model_cfg, model, is_root)?;
        if let Some(dir) = &self.cfg.save {
            save(model, self.model_cfg, dir, is_root)?;
            if is_root {
                crate::model_dir::complete(self.cfg, dir)?;
            }
        }
        Ok(())
    }
}

/// Gathers the trained model (FSDP shards, then tp shards: collective) and writes it from
/// rank 0 in the checkpoint's dtype.
fn save(
    model: Llama,
    model_cfg: &LlamaConfig,
    dir: &Path,
    is_root: bool,
) -> Result<(), TrainError> {
    let full = gather_full(model)?;
    let tensors = hf_tensors(&full)?;
    if is_root {
        let dtype = SaveDtype::from_config_dtype(model_cfg.dtype.as_deref());
        save_llama(model_cfg, &tensors, dir, dtype)?;
    }
    Ok(())
}
