//! The training loop: rank threads, each builds the same model, parallelizes it, and trains on
//! its rows of every global batch; rank 0 reports each step.

use std::path::Path;
use std::time::Instant;

use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use burn_parallel_dist::{DeviceMesh, MeshShape, ReduceOp, launch};
use burn_parallel_fsdp::gather_full;
use burn_parallel_models::checkpoint::{SaveDtype, hf_tensors, load_llama, save_llama};
use burn_parallel_models::data::{TokenData, dp_rows};
use burn_parallel_models::{Llama, LlamaConfig};
use burn_parallel_tp::{TpModule, loss_parallel};
use serde::Serialize;

use crate::config::{OptimizerKind, TrainConfig};
use crate::error::TrainError;
use crate::optim::{AdamW, Optimizer, Sgd};
use crate::parallelize::{Layout, parallelize};
use crate::state::{global_grad_norm, model_state_bytes};

/// One step as rank 0 saw it; what `--json` prints.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepReport {
    pub step: usize,
    /// Mean token cross-entropy over the global batch.
    pub loss: f32,
    /// Global gradient L2 norm before clipping.
    pub grad_norm: f32,
    pub step_time_s: f64,
    pub tokens_per_s: f64,
    pub peak_model_state_bytes_per_rank: u64,
}

/// A finished run.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    pub layout: Layout,
    pub model: LlamaConfig,
    pub steps: Vec<StepReport>,
    /// Parameters + gradients + optimizer state of each rank, in rank order.
    pub model_state_bytes: Vec<u64>,
    /// Bytes each rank sent and received per step on average, in rank order.
    pub comm_bytes_per_step: Vec<u64>,
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

    pub fn losses(&self) -> Vec<f32> {
        self.steps.iter().map(|s| s.loss).collect()
    }
}

/// The model config of a run: the checkpoint's, or the built-in one.
fn model_config(cfg: &TrainConfig) -> Result<LlamaConfig, TrainError> {
    match &cfg.checkpoint {
        Some(dir) => Ok(LlamaConfig::load(dir)?),
        None => Ok(cfg.model.clone()),
    }
}

fn token_data(cfg: &TrainConfig, model: &LlamaConfig) -> Result<TokenData, TrainError> {
    match &cfg.data {
        Some(path) => Ok(TokenData::load(path, model.vocab_size, cfg.seq_len)?),
        None => {
            let len = (cfg.steps * cfg.global_batch).max(64) * cfg.seq_len + 1;
            Ok(TokenData::synthetic(model.vocab_size, cfg.seq_len, len)?)
        }
    }
}

/// Trains as `cfg` says; `on_step` sees every step (on rank 0's thread) as it finishes. Bad
/// input (files, configs, sizes a strategy cannot use) is an error before any rank starts.
pub fn train(
    cfg: &TrainConfig,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<TrainSummary, TrainError> {
    cfg.check()?;
    let model_cfg = model_config(cfg)?;
    let layout = Layout::of(cfg, &model_cfg)?;
    let data = token_data(cfg, &model_cfg)?;
    if let Some(dir) = &cfg.checkpoint {
        // Opens every file now, so that a broken checkpoint fails before training.
        burn_parallel_models::checkpoint::HfCheckpoint::open(dir)?;
    }
    let results = launch(layout.world(), |ctx| {
        run_rank(cfg, &layout, &model_cfg, &data, ctx, on_step)
    })
    .map_err(|e| TrainError::Ranks(e.to_string()))?;
    let steps = results[0].0.clone();
    Ok(TrainSummary {
        layout,
        model: model_cfg,
        steps,
        model_state_bytes: results.iter().map(|r| r.1).collect(),
        comm_bytes_per_step: results.iter().map(|r| r.2).collect(),
    })
}

type RankResult = (Vec<StepReport>, u64, u64);

/// One optimizer step on the whole model.
type StepFn = Box<dyn FnMut(Llama, &burn::tensor::Gradients) -> Llama>;

fn build_model(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    device: &burn::tensor::Device,
) -> Result<Llama, TrainError> {
    match &cfg.checkpoint {
        Some(dir) => Ok(load_llama(dir, device)?),
        None => Ok(Llama::seeded(model_cfg, cfg.seed, device)),
    }
}

fn run_rank(
    cfg: &TrainConfig,
    layout: &Layout,
    model_cfg: &LlamaConfig,
    data: &TokenData,
    ctx: burn_parallel_dist::RankContext,
    on_step: &(dyn Fn(&StepReport) + Sync),
) -> Result<RankResult, TrainError> {
    let shape = MeshShape::new(&[
        (Layout::DIMS[0], layout.replicate),
        (Layout::DIMS[1], layout.shard),
        (Layout::DIMS[2], layout.tp),
    ])?;
    let mut mesh = DeviceMesh::new(&ctx, shape)?;
    let dp_group = mesh.flatten(&["dp_replicate", "dp_shard"], "dp")?.clone();
    let dp_rank = mesh.coord("dp_replicate")? * layout.shard + mesh.coord("dp_shard")?;
    let is_root = ctx.rank() == 0;

    let fsdp = layout.uses_fsdp(cfg);
    let device = cfg.backend.device(fsdp && cfg.reshard_after_forward);
    let model = build_model(cfg, model_cfg, &device)?;
    let mut model = parallelize(model, cfg, layout, &mesh)?;

    let mut optimizer: StepFn = match cfg.optimizer {
        OptimizerKind::Sgd => {
            let mut o = Sgd { lr: cfg.lr };
            Box::new(move |m, g| o.step(m, g))
        }
        OptimizerKind::AdamW => {
            let mut o = AdamW::new(cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
            Box::new(move |m, g| o.step(m, g))
        }
    };
    let states = match cfg.optimizer {
        OptimizerKind::Sgd => 0,
        OptimizerKind::AdamW => 2,
    };
    let my_state = model_state_bytes(&model, states);
    let peak_state = max_over_world(&ctx, my_state)?;

    let rows = dp_rows(cfg.global_batch, layout.dp(), dp_rank);
    let global_tokens = (cfg.global_batch * cfg.seq_len) as f32;
    let vocab = model_cfg.vocab_size;
    let tp_group = mesh.group("tp")?.clone();
    let stats_before = ctx.stats();
    let mut reports = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let start = Instant::now();
        let batch = data.batch(step, cfg.global_batch, rows.clone());
        let (b, t) = (batch.rows, batch.seq_len);
        let ids = Tensor::<2, Int>::from_data(TensorData::new(batch.inputs, [b, t]), &device);
        let targets = Tensor::<1, Int>::from_data(TensorData::new(batch.targets, [b * t]), &device);

        let logits = model.try_forward(ids)?.cast(FloatDType::F32);
        let local_vocab = logits.dims()[2];
        let logits = logits.reshape([b * t, local_vocab]);
        // This rank's tokens' share of the global mean.
        let loss = if layout.tp > 1 {
            loss_parallel(logits, targets, &tp_group, vocab)?
                .mul_scalar(b as f32 * t as f32 / global_tokens)
        } else {
            log_softmax(logits, 1)
                .gather(1, targets.unsqueeze_dim::<2>(1))
                .sum()
                .neg()
                .div_scalar(global_tokens)
                .reshape([1])
        };
        let local_loss = loss.clone().detach().into_data();
        let mut grads = loss.backward();
        if layout.tp > 1 {
            model.sync_tp_grads(&mut grads)?;
        }
        let grad_norm = global_grad_norm(&model, &mut grads, &mesh, cfg.grad_clip)?;
        model = optimizer(model, &grads);
        let global = dp_group.all_reduce(local_loss, ReduceOp::Sum)?;
        let loss_value = global.as_slice::<f32>().expect("f32 loss")[0];
        let step_time_s = start.elapsed().as_secs_f64();
        let report = StepReport {
            step,
            loss: loss_value,
            grad_norm,
            step_time_s,
            tokens_per_s: global_tokens as f64 / step_time_s.max(1e-12),
            peak_model_state_bytes_per_rank: peak_state,
        };
        if is_root {
            on_step(&report);
        }
        reports.push(report);
    }
    let comm = ctx.stats().since(&stats_before).total();
    let comm_per_step = (comm.bytes_sent + comm.bytes_received) / cfg.steps as u64;

    if let Some(dir) = &cfg.save {
        save(model, fsdp, model_cfg, dir, is_root)?;
    }
    Ok((reports, my_state, comm_per_step))
}

/// Gathers the trained model (FSDP shards, then tp shards: collective) and writes it from
/// rank 0 in the checkpoint's dtype.
fn save(
    model: Llama,
    fsdp: bool,
    model_cfg: &LlamaConfig,
    dir: &Path,
    is_root: bool,
) -> Result<(), TrainError> {
    let full = if fsdp { gather_full(model) } else { model };
    let tensors = hf_tensors(&full)?;
    if is_root {
        let dtype = SaveDtype::from_config_dtype(model_cfg.dtype.as_deref());
        save_llama(model_cfg, &tensors, dir, dtype)?;
    }
    Ok(())
}

/// The largest of every rank's `value`, exactly (as two f32 halves).
fn max_over_world(ctx: &burn_parallel_dist::RankContext, value: u64) -> Result<u64, TrainError> {
    let world = ctx.world()?;
    let all = world.all_gather(
        TensorData::new(
            vec![(value >> 24) as f32, (value & 0xFF_FFFF) as f32],
            [1, 2],
        ),
        0,
    )?;
    let v = all.as_slice::<f32>().expect("f32 values");
    Ok(v.chunks(2)
        .map(|p| ((p[0] as u64) << 24) | p[1] as u64)
        .max()
        .unwrap_or(value))
}
