//! The training loop: rank threads, each builds the same model, parallelizes it with
//! `parallelize_model`, and trains on its rows of every global batch with `train_step`; rank 0
//! reports each step.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Gradients;
use burn_parallel_checkpoint::LoadOptions;
use burn_parallel_comm::{LaunchError, OpKind, run_ranks_with};
use burn_parallel_fsdp::{RowRequest, gather_full};
use burn_parallel_models::checkpoint::{SaveDtype, hf_tensors, lazy_llama_ep, save_llama};
use burn_parallel_models::data::TokenData;
use burn_parallel_models::{Llama, LlamaConfig};
use burn_parallel_parallelizer::{
    MeshContext, MeshSizes, StepReport, parallelize_model, parallelize_model_from,
    train_step_accumulated,
};

use crate::batches::{eval_loss, evaluates_after, forward_step};
use crate::config::TrainConfig;
use crate::data::{self, Dataset};
use crate::error::TrainError;
use crate::freeze;
use crate::guard::{check_batch_memory, check_finite, check_positions};
use crate::mesh::mesh_sizes;
use crate::resume::{Resume, RunOptimizer, SavePoint, Saves, open_resume, saves_after};
use crate::schedule::LrSchedule;
use crate::state::{model_state_bytes, optimizer_state_bytes};
use crate::step_log::{
    RankResult, StepCalls, StepLog, StepTimes, fsdp_memory, max_over_world, step_figures,
};
use crate::stop::stop_agreed;
use crate::stragglers::Stragglers;
use crate::usage::ProcessUsage;
use burn_parallel_comm::memory::reset_peak_rss;

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
    Err(TrainError::Config(format!(
        "--checkpoint {}: {} of its tensors are not part of the model its config.json \
         describes (the first: `{first}`): the config and the weights disagree, for example in \
         num_hidden_layers; give the config.json that came with these weights",
        dir.display(),
        untaken.len()
    )))
}

/// Trains as `cfg` says on `cfg.engine`'s ranks; `on_step` sees every step (on rank 0's
/// thread, so under MPI in process 0 only) as it finishes. Bad input (files, configs, sizes a
/// strategy cannot use) is an error before any rank starts.
pub fn train(
    cfg: &TrainConfig,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<TrainSummary, TrainError> {
    cfg.check()?;
    let model_cfg = model_config(cfg)?;
    // Before the data, the ranks and the model allocate anything sized by the sequence.
    check_positions(cfg, &model_cfg)?;
    crate::pipeline::check_flags(cfg, &model_cfg)?;
    let mesh = mesh_sizes(cfg, &model_cfg)?;
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
    let results = run_ranks_with(world, cfg.engine, cfg.threads_per_rank, |ctx| {
        run_rank(
            cfg,
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
        true => TrainError::Ranks(format!(
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
    let lora = cfg.lora.plan(cfg.seed)?;
    let frozen = |model: Llama| -> Result<(Llama, u64), TrainError> {
        // LoRA freezes the whole base: only the adapters train.
        if let Some(lora) = &lora {
            return crate::lora::apply(model, lora);
        }
        let plan = freeze::plan(&model, &cfg.freeze)?;
        Ok((freeze::freeze(model, &plan.frozen), plan.trainable_elements))
    };
    Ok(match &cfg.checkpoint {
        Some(dir) => {
            // Under expert parallelism each rank reads its own experts whole.
            let ep = mesh.expert_groups().map(|g| &g.ep);
            let (model, rows) = lazy_llama_ep(dir, device, ep)?;
            let (model, trainable) = frozen(model)?;
            let read = move |r: &RowRequest| rows.read(r.id, r.rows.clone());
            (parallelize_model_from(model, mesh, read)?, trainable)
        }
        None => {
            let (model, trainable) = frozen(Llama::seeded(model_cfg, cfg.seed, device))?;
            (parallelize_model(model, mesh)?, trainable)
        }
    })
}

fn run_rank(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    (data, eval): (&Dataset, Option<&Dataset>),
    resume: Option<&Resume>,
    ctx: burn_parallel_comm::RankContext,
    on_step: &(dyn Fn(&StepLog) + Sync),
) -> Result<RankResult, TrainError> {
    let device = cfg.backend.device(gpu_of(ctx.rank()))?;
    // FSDP frees gathered weights after forward only on Burn's checkpointing device.
    let device = match cfg.checkpointing_device() {
        true => device.gradient_checkpointing(),
        false => device,
    };
    let mesh = MeshContext::new(&ctx, cfg.distributed.clone(), device)?;
    // One job per save directory, held until this rank's run returns.
    let _save_dir = crate::outputs::hold_save_dir(cfg, &mesh)?;
    if mesh.pp_group().is_some() {
        return crate::pipeline::run_rank(
            cfg,
            model_cfg,
            (data, eval),
            resume,
            &mesh,
            &ctx,
            on_step,
        );
    }
    let (mut model, trainable_params) = build_model(cfg, model_cfg, &mesh)?;
    let mut optimizer = RunOptimizer::new(cfg);
    // Where the data stream stands, in samples: batches follow it rather than the step, so a
    // resumed run continues the stream exactly (also with another --global-batch).
    // The schedule continues from its saved position, so a run resumed mid-warmup goes on
    // without a jump.
    let (start, mut position, schedule_start) = match resume {
        Some(r) => {
            let options = LoadOptions::default();
            let state = Some(optimizer.state_mut());
            model = r.checkpoint.load(model, state, &mesh, &options)?.0;
            (r.step, r.data_position, r.schedule_position)
        }
        None => (0, 0, 0),
    };
    let schedule = LrSchedule::of(cfg);
    let states = optimizer.states_per_param();
    let my_state = model_state_bytes(&model, states);
    let my_optimizer_state = optimizer_state_bytes(&model, states);
    let [peak_state, peak_optimizer_state] = max_over_world(&ctx, [my_state, my_optimizer_state])?;
    // Every rank has built its model by now (the max above waited for all): the peak RSS the
    // steps report is training's, not the full model each rank builds before sharding it.
    reset_peak_rss();
    let memory = fsdp_memory(std::slice::from_ref(&model));

    let rows = mesh.local_rows(cfg.global_batch);
    let global_tokens = (cfg.global_batch * cfg.grad_accum * cfg.seq_len) as f32;
    let stats_before = ctx.stats();
    let mut reports = Vec::with_capacity(cfg.steps - start);
    let mut saves = Saves::new();
    let mut stopped_at = None;
    let mut stragglers = Stragglers::default();
    for step in start..cfg.steps {
        let start_time = Instant::now();
        let (usage_before, comm_before) = (ProcessUsage::now(), ctx.stats());
        let nan_fault = cfg.fault.is_some_and(|f| f.at_step_start(ctx.rank(), step));
        // Every micro-batch's forward (the earlier ones' backward too), the loss normalised
        // over the step's global batch (`batches`).
        let forward = forward_step(cfg, &model, data, position, &rows, &mesh)?;
        let routing = forward.routing;
        let forward_s = start_time.elapsed().as_secs_f64();
        let lr = schedule.lr_at(schedule_start + (step - start));
        optimizer.set_lr(lr);
        let mut update_s = None;
        let step_fn = |m: Llama, g: Gradients, report: &StepReport| {
            let (m, seconds) = optimizer.step_unless_skipped(cfg, m, &g, report);
            update_s = seconds;
            m
        };
        let (loss, acc) = (forward.loss, forward.accumulated);
        let loss = match nan_fault {
            true => loss.mul_scalar(f32::NAN),
            false => loss,
        };
        let (next, done) =
            train_step_accumulated(model, loss, acc, &rows, cfg.grad_clip, &mesh, step_fn)?;
        model = next;
        // Under `stop`, ends the run on every rank alike (the values all ranks agree on).
        let (skipped, optimizer_s) = (update_s.is_none(), update_s.unwrap_or(0.0));
        if !skipped {
            check_finite(cfg, step, &done)?;
        }
        // A skipped step still counts and consumes its batch.
        position += cfg.global_batch * cfg.grad_accum;
        let eval_loss = match eval {
            Some(eval) if evaluates_after(cfg, step + 1) => {
                Some(eval_loss(cfg, &model, eval, &rows, &mesh)?)
            }
            _ => None,
        };
        let step_time_s = start_time.elapsed().as_secs_f64();
        let usage = ProcessUsage::now();
        let comm = ctx.stats().since(&comm_before);
        let comm_s = |kind| comm.op(kind).time.as_secs_f64();
        let times = StepTimes {
            forward_s,
            backward_s: step_time_s - forward_s - optimizer_s,
            optimizer_s,
            all_gather_s: comm_s(OpKind::AllGather),
            reduce_scatter_s: comm_s(OpKind::ReduceScatter),
            all_reduce_s: comm_s(OpKind::AllReduce),
        };
        let calls = StepCalls {
            all_gather_calls: comm.op(OpKind::AllGather).calls,
            reduce_scatter_calls: comm.op(OpKind::ReduceScatter).calls,
            all_reduce_calls: comm.op(OpKind::AllReduce).calls,
            all_to_all_calls: comm.op(OpKind::AllToAll).calls,
        };
        // After the step's counters: the bookkeeping exchange is not the step's traffic.
        let figures = step_figures(
            &ctx,
            &memory,
            &mut stragglers,
            (step, step_time_s),
            &comm,
            usage.peak_rss_bytes,
        )?;
        let report = StepLog {
            step,
            report: done,
            lr,
            skipped,
            step_time_s,
            tokens_per_s: global_tokens as f64 / step_time_s.max(1e-12),
            peak_model_state_bytes_per_rank: peak_state,
            trainable_params,
            optimizer_state_bytes_per_rank: peak_optimizer_state,
            times,
            calls,
            minor_faults: usage.minor_faults - usage_before.minor_faults,
            peak_rss_bytes: usage.peak_rss_bytes,
            peak_rss_bytes_per_rank: figures.rss_peak,
            gathered_peak_bytes_per_rank: figures.gathered_peak,
            rank_compute_s: figures.compute_s,
            rank_wait_s: figures.wait_s,
            eval_loss,
            aux_loss: routing.as_ref().and_then(|r| r.aux_loss),
            expert_tokens_min: routing.as_ref().map(|r| r.expert_tokens.0),
            expert_tokens_max: routing.as_ref().map(|r| r.expert_tokens.1),
            pp_wait_s: None,
            pp_peak_microbatches: None,
        };
        if ctx.rank() == 0 {
            on_step(&report);
        }
        reports.push(report);
        // A stop request (preemption) ends every rank's run after this step, saved.
        let stop = stop_agreed(cfg.stop.as_ref(), &ctx)?;
        if let Some(save_dir) = &cfg.save_dir
            && (saves_after(cfg, step + 1) || stop)
        {
            let at = SavePoint {
                save_dir,
                done: step + 1,
                data_position: position,
            };
            saves.save_model(cfg, at, &model, &optimizer, &mesh)?;
        }
        if stop {
            stopped_at = Some(step + 1);
            break;
        }
    }
    saves.commit(&mesh)?;
    let checkpoints = saves.done;
    let comm = ctx.stats().since(&stats_before).total();
    let comm_per_step = (comm.bytes_sent + comm.bytes_received) / reports.len().max(1) as u64;

    // With LoRA: the adapter saved, and the merged model for --save (a stopped run is not
    // finished: its checkpoint resumes it).
    if stopped_at.is_none() {
        let model = crate::lora::finish_run(cfg, model, ctx.rank() == 0)?;
        if let Some(dir) = &cfg.save {
            save(model, model_cfg, dir, ctx.rank() == 0)?;
            if ctx.rank() == 0 {
                crate::model_dir::complete(cfg, dir)?;
            }
        }
    }
    Ok((reports, my_state, comm_per_step, checkpoints, stopped_at))
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
