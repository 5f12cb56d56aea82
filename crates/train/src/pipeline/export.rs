//! The end of a `--pp` run: LoRA's `--save-adapter` (one peft adapter of every stage's
//! factors) and `--save` (a sharded Hugging Face checkpoint, one file per stage), each stage's
//! part written by its first rank and completed by rank 0 once every part is there.

use std::path::{Path, PathBuf};

use burn::tensor::TensorData;
use burn_parallel_comm::ReduceOp;
use burn_parallel_models::checkpoint::{
    SaveDtype, hf_stage_tensors, save_llama_index, save_llama_part,
};
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{MeshContext, full_model};
use burn_parallel_peft::{LoraConfig, adapted_paths, combine_adapters, merge_lora, save_adapter};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::lora::lora_error;

/// After a LoRA run with `--save-adapter` or `--save`: each stage gathered (collective over its
/// ranks), `--save-adapter` written as one peft adapter (each stage's first rank writes its
/// layers' part, rank 0 combines them once all are there), and the stages with their adapters
/// merged, for `--save`. Without LoRA (`lora`: the run's config, fresh or loaded), or with
/// nothing to save, the chunks as they are.
pub(super) fn finish_lora(
    cfg: &TrainConfig,
    chunks: Vec<LlamaStage>,
    lora: Option<&LoraConfig>,
    mesh: &MeshContext,
) -> Result<Vec<LlamaStage>, TrainError> {
    let save_to = cfg.lora.save_adapter.as_deref();
    let Some(config) = lora else {
        return Ok(chunks);
    };
    if save_to.is_none() && cfg.save.is_none() {
        return Ok(chunks);
    }
    let whole = chunks
        .into_iter()
        .map(full_model)
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(dir) = save_to {
        let part = |stage: usize| dir.join(".stages").join(format!("stage-{stage:05}"));
        let base = cfg.checkpoint.as_deref().map(|p| p.display().to_string());
        let mut failed = None;
        if mesh.world_group().index() == 0 {
            for chunk in &whole {
                // A stage none of whose modules a target names has no part.
                let adapted = adapted_paths(chunk).map_err(lora_error)?;
                if failed.is_none() && !adapted.is_empty() {
                    failed = save_adapter(chunk, config, part(chunk.stage), base.as_deref())
                        .map_err(lora_error)
                        .err();
                }
            }
        }
        written_everywhere(failed, mesh, dir)?;
        if mesh.rank() == 0 {
            let stages = whole.len() * mesh.pp_group().map_or(1, |g| g.size());
            let parts: Vec<PathBuf> = (0..stages).map(part).filter(|p| p.exists()).collect();
            let parts: Vec<&Path> = parts.iter().map(PathBuf::as_path).collect();
            combine_adapters(&parts, dir).map_err(lora_error)?;
            let stages_dir = dir.join(".stages");
            std::fs::remove_dir_all(&stages_dir).map_err(|e| {
                TrainError::Config(format!("removing {}: {e}", stages_dir.display()))
            })?;
        }
    }
    whole
        .into_iter()
        .map(|chunk| merge_lora(chunk).map_err(lora_error))
        .collect()
}

/// After each stage's first rank wrote its part to `dir` (`failed`: its error), the outcome of
/// every stage on every rank: a failed write anywhere fails the run on every rank. Collective
/// over the pipeline group.
fn written_everywhere(
    failed: Option<TrainError>,
    mesh: &MeshContext,
    dir: &Path,
) -> Result<(), TrainError> {
    let pp = mesh.pp_group().expect("a pipeline run has a pp group");
    let failures = TensorData::new(vec![f32::from(failed.is_some())], [1]);
    let failures = pp.all_reduce(failures, ReduceOp::Sum)?;
    let failures = failures.try_into_vec::<f32>().expect("an f32 sum")[0];
    if let Some(e) = failed {
        return Err(e);
    }
    match failures > 0.0 {
        true => Err(TrainError::Config(format!(
            "writing {}: another pipeline stage failed to write its part",
            dir.display()
        ))),
        false => Ok(()),
    }
}

/// `--save` under pp: a sharded Hugging Face checkpoint with one file per stage, each written
/// by the first rank of its stage once gathered (collective over the stage), then the index
/// and config by rank 0 once every stage's file is there.
pub(super) fn save(
    chunks: &[LlamaStage],
    model_cfg: &LlamaConfig,
    dir: &Path,
    mesh: &MeshContext,
) -> Result<(), TrainError> {
    let pp = mesh.pp_group().expect("a pipeline run has a pp group");
    let dtype = SaveDtype::from_config_dtype(model_cfg.dtype.as_deref());
    let stages = chunks.len() * pp.size();
    let writes = mesh.world_group().index() == 0;
    let mut failed = None;
    for chunk in chunks {
        let tensors = hf_stage_tensors(chunk)?;
        if writes && failed.is_none() {
            failed = save_llama_part(&tensors, dir, chunk.stage, stages, dtype)
                .map_err(TrainError::from)
                .err();
        }
    }
    written_everywhere(failed, mesh, dir)?;
    if mesh.rank() == 0 {
        save_llama_index(model_cfg, dir, stages, dtype)?;
    }
    Ok(())
}
