//! Each rank's stages of a `--pp` run: seeded or read lazily from `--checkpoint`, with
//! `--freeze` or LoRA's adapters applied by Hugging Face name across every stage, and
//! parallelized over the stage's ranks.

use std::path::PathBuf;

use burn::tensor::TensorData;
use burn_parallel_comm::ReduceOp;
use burn_parallel_fsdp::RowRequest;
use burn_parallel_models::checkpoint::{hf_stage_params, lazy_llama_stage};
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{
    MeshContext, StageSplit, parallelize_model, parallelize_model_from,
};
use burn_parallel_peft::{Attached, LoraConfig, attach_lora, load_adapter_part};

use crate::config::TrainConfig;
use crate::error::TrainError;
use crate::freeze;
use crate::lora::{LoraPlan, adapter_elements, lora_error};

/// What trains in a pipeline run, chosen stage by stage and checked over all of them: the
/// parameters `--freeze` leaves, fresh LoRA adapters (`--lora-rank`) or a peft adapter's
/// (`--lora-init`).
enum Trainable {
    Freeze,
    Attach(LoraConfig),
    Load(PathBuf),
}

/// This rank's chunks (stage `c * pp + r` for chunk `c` of pipeline rank `r`), each
/// parallelized over its stage's ranks, the elements of the whole model that train, and the
/// run's LoRA config (fresh or loaded), if any.
pub(super) fn build_chunks(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: &MeshContext,
) -> Result<(Vec<LlamaStage>, u64, Option<LoraConfig>), TrainError> {
    let group = mesh.pp_group().expect("a pipeline run has a pp group");
    let (r, p, v) = (group.index(), group.size(), cfg.pipeline.stages_per_rank());
    let split = StageSplit::even(model.num_hidden_layers, p * v)
        .map_err(|e| TrainError::Config(format!("--pp {p} --stages-per-rank {v}: {e}")))?;
    // Under expert parallelism each rank reads its own experts whole.
    let ep = mesh.expert_groups().map(|g| &g.ep);
    let trainable = match cfg.lora.plan(cfg.seed)? {
        Some(LoraPlan::New(config)) => Trainable::Attach(config),
        Some(LoraPlan::Load(dir)) => Trainable::Load(dir),
        None => Trainable::Freeze,
    };
    // Per pattern, target or adapter module: what this rank's stages selected of it.
    let mut marks: Vec<f64> = Vec::new();
    let mut add_marks = |mine: Vec<f64>| {
        marks.resize(mine.len(), 0.0);
        for (sum, m) in marks.iter_mut().zip(mine) {
            *sum += m;
        }
    };
    let (mut names, mut seen, mut loaded) = (Vec::new(), Vec::new(), None);
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
        let stage = match &trainable {
            Trainable::Freeze => {
                let (plan, used) = freeze::plan_params(&params, &cfg.freeze)?;
                add_marks(used.into_iter().map(|u| f64::from(u8::from(u))).collect());
                own += plan.trainable_elements;
                freeze::freeze(stage, &plan.frozen)
            }
            Trainable::Attach(config) => {
                let (stage, attached) = attach_lora(stage, config).map_err(lora_error)?;
                add_marks(attached.hits.iter().map(|&h| h as f64).collect());
                seen.extend(attached.seen);
                own += adapter_elements(&stage)?;
                stage
            }
            Trainable::Load(dir) => {
                let (stage, part) = load_adapter_part(stage, dir).map_err(lora_error)?;
                add_marks(
                    part.loaded
                        .iter()
                        .map(|&l| f64::from(u8::from(l)))
                        .collect(),
                );
                seen.extend(part.seen.iter().cloned());
                loaded = Some(part);
                own += adapter_elements(&stage)?;
                stage
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
    // Each stage counted once: one rank per stage in the pp group. A --freeze pattern, a LoRA
    // target and an adapter's module must each select something on some stage.
    let sums: Vec<f64> = std::iter::once(own as f64).chain(marks).collect();
    let n = sums.len();
    let total = group.all_reduce(TensorData::new(sums, [n]), ReduceOp::Sum)?;
    let total = total.try_into_vec::<f64>().expect("f64 sums");
    let (own, marks) = (total[0] as u64, &total[1..]);
    if own == 0 {
        return Err(TrainError::Config(
            "nothing trains: --freeze selects every parameter of the model (a stage may be \
             wholly frozen, not every stage); freeze less"
                .into(),
        ));
    }
    // `seen` and `names`: this rank's stages' (the others hold the rest).
    let lora = match trainable {
        Trainable::Freeze => {
            let used: Vec<bool> = marks.iter().map(|&u| u > 0.0).collect();
            freeze::check_used(&cfg.freeze, &used, &names)?;
            None
        }
        Trainable::Attach(config) => {
            let hits = marks.iter().map(|&h| h as usize).collect();
            Attached { hits, seen }.check(&config).map_err(lora_error)?;
            Some(config)
        }
        Trainable::Load(_) => {
            let mut part = loaded.expect("every rank holds a stage");
            part.loaded = marks.iter().map(|&l| l > 0.0).collect();
            part.seen = seen;
            part.check().map_err(lora_error)?;
            Some(part.config)
        }
    };
    Ok((chunks, own, lora))
}
