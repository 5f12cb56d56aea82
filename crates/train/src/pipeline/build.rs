//! Each rank's stages of a `--pp` run: seeded or read lazily from `--checkpoint`, with
//! `--freeze` or LoRA's adapters applied by Hugging Face name across every stage, and
//! parallelized over the stage's ranks.

use burn::tensor::TensorData;
use burn_parallel_comm::ReduceOp;
use burn_parallel_fsdp::RowRequest;
use burn_parallel_models::checkpoint::{hf_stage_params, lazy_llama_stage};
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{
    MeshContext, StageSplit, parallelize_model, parallelize_model_from,
};
use burn_parallel_peft::{Attached, LoraConfig, attach_lora};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::freeze;
use crate::lora::{LoraPlan, adapter_elements, lora_error};

/// This rank's chunks (stage `c * pp + r` for chunk `c` of pipeline rank `r`), each
/// parallelized over its stage's ranks, and the elements of the whole model that train.
pub(super) fn build_chunks(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: &MeshContext,
) -> Result<(Vec<LlamaStage>, u64), TrainError> {
    let group = mesh.pp_group().expect("a pipeline run has a pp group");
    let (r, p, v) = (group.index(), group.size(), cfg.pipeline.stages_per_rank());
    let split = StageSplit::even(model.num_hidden_layers, p * v)
        .map_err(|e| TrainError::Config(format!("--pp {p} --stages-per-rank {v}: {e}")))?;
    // Under expert parallelism each rank reads its own experts whole.
    let ep = mesh.expert_groups().map(|g| &g.ep);
    let lora = new_adapters(cfg)?;
    let targets = lora.as_ref().map_or(0, |l| l.targets.len());
    let (mut hits, mut seen) = (vec![0usize; targets], Vec::new());
    let mut used_anywhere = vec![false; cfg.freeze.len()];
    let mut names = Vec::new();
    let mut own = 0;
    let mut chunks = Vec::with_capacity(v);
    for c in 0..v {
        let s = c * p + r;
        let (stage, rows) = match &cfg.checkpoint {
            Some(dir) => {
                let (stage, rows) = lazy_llama_stage(dir, &split, s, mesh.device(), ep)?;
                (stage, Some(rows))
            }
            None => (
                LlamaStage::seeded(model, cfg.seed, &split, s, mesh.device())?,
                None,
            ),
        };
        let stage = stage.with_loss_group(mesh.tp_group().clone());
        // --freeze by Hugging Face name, or LoRA's adapters on the frozen base, before
        // parallelize_model (which then shards frozen parameters without gradient or state);
        // counted by name, so experts split over ep count whole.
        let params = hf_stage_params(&stage);
        names.extend(params.iter().take(3).cloned());
        let stage = match &lora {
            Some(config) => {
                let (stage, attached) = attach_lora(stage, config).map_err(lora_error)?;
                for (sum, mine) in hits.iter_mut().zip(&attached.hits) {
                    *sum += mine;
                }
                seen.extend(attached.seen);
                own += adapter_elements(&stage)?;
                stage
            }
            None => {
                let (plan, used) = freeze::plan_params(&params, &cfg.freeze)?;
                for (any, mine) in used_anywhere.iter_mut().zip(used) {
                    *any |= mine;
                }
                own += plan.trainable_elements;
                freeze::freeze(stage, &plan.frozen)
            }
        };
        chunks.push(match rows {
            // A checkpoint is read lazily: each FSDP rank reads only its rows.
            Some(rows) => {
                let read = move |r: &RowRequest| rows.read(r.id, r.rows.clone());
                parallelize_model_from(stage, mesh, read)?
            }
            None => parallelize_model(stage, mesh)?,
        });
    }
    // Each stage counted once: one rank per stage in the pp group. A --freeze pattern and a
    // LoRA target must each select something on some stage.
    let sums: Vec<f64> = std::iter::once(own as f64)
        .chain(used_anywhere.iter().map(|&u| f64::from(u8::from(u))))
        .chain(hits.iter().map(|&h| h as f64))
        .collect();
    let n = sums.len();
    let total = group.all_reduce(TensorData::new(sums, [n]), ReduceOp::Sum)?;
    let total = total.try_into_vec::<f64>().expect("f64 sums");
    let (used, hits) = total[1..].split_at(cfg.freeze.len());
    let used: Vec<bool> = used.iter().map(|&u| u > 0.0).collect();
    freeze::check_used(&cfg.freeze, &used, &names)?;
    if let Some(config) = &lora {
        let hits = hits.iter().map(|&h| h as usize).collect();
        // `seen`: this rank's stages' modules (the others hold the rest).
        Attached { hits, seen }.check(config).map_err(lora_error)?;
    }
    Ok((chunks, total[0] as u64))
}

/// The run's fresh LoRA adapters (`--lora-rank`), if any.
pub(super) fn new_adapters(cfg: &TrainConfig) -> Result<Option<LoraConfig>, TrainError> {
    Ok(match cfg.lora.plan(cfg.seed)? {
        Some(LoraPlan::New(config)) => Some(config),
        // Refused by `unsupported` before any rank starts.
        Some(LoraPlan::Load(dir)) => {
            return Err(TrainError::Config(format!(
                "--lora-init {} under --pp is not supported yet",
                dir.display()
            )));
        }
        None => None,
    })
}
