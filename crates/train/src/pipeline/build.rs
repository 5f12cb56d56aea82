//! Each rank's stages of a `--pp` run: seeded or read lazily from `--checkpoint`, with
//! `--freeze` or LoRA's adapters applied by Hugging Face name across every stage, and
//! parallelized over the stage's ranks.

use std::path::PathBuf;

use burn::tensor::TensorData;
use burn_parallel_comm::{ProcessGroup, ReduceOp};
use burn_parallel_fsdp::RowRequest;
use burn_parallel_models::checkpoint::{
    CheckpointRows, HfParam, hf_stage_params, lazy_llama_stage,
};
use burn_parallel_models::{LlamaConfig, LlamaStage};
use burn_parallel_parallelizer::{
    MeshContext, StageSplit, parallelize_model, parallelize_model_from,
};
use burn_parallel_peft::{Attached, LoadedAdapter, LoraConfig, attach_lora, load_adapter_part};

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};
use crate::freeze;
use crate::lora::{LoraPlan, adapter_elements, lora_error, quantize_base, read_rows};
use burn_parallel_peft::LazyQuantized;

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
        .map_err(|e| flag_error("--pp", format!("{p} --stages-per-rank {v}: {e}")))?;
    let trainable = match cfg.lora.plan(cfg.seed, model.family.row().fused)? {
        Some(LoraPlan::New(config)) => Trainable::Attach(config),
        Some(LoraPlan::Load(dir)) => Trainable::Load(dir),
        None => Trainable::Freeze,
    };
    let mut selection = Selection::default();
    let mut chunks = Vec::with_capacity(v);
    for c in 0..v {
        let (stage, rows) = read_or_seed_stage(cfg, model, mesh, &split, c * p + r)?;
        let (stage, quantized) = quantize_base(stage, cfg.lora.quantize)?;
        let stage = selection.apply(stage, &trainable, &cfg.freeze)?;
        chunks.push(parallelize(stage, rows, quantized, mesh)?);
    }
    let (own, lora) = selection.check_all_stages(group, trainable, &cfg.freeze)?;
    Ok((chunks, own, lora))
}

/// Stage `s` of `split`, before `--freeze` or LoRA: read lazily from `--checkpoint` (with the
/// rows its FSDP ranks read when it is parallelized), else seeded.
fn read_or_seed_stage(
    cfg: &TrainConfig,
    model: &LlamaConfig,
    mesh: &MeshContext,
    split: &StageSplit,
    s: usize,
) -> Result<(LlamaStage, Option<CheckpointRows>), TrainError> {
    // Under expert parallelism each rank reads its own experts whole.
    let ep = mesh.expert_groups().map(|g| &g.ep);
    let (stage, rows) = match &cfg.checkpoint {
        Some(dir) => {
            let (stage, rows) = lazy_llama_stage(dir, split, s, mesh.device(), ep)?;
            (stage, Some(rows))
        }
        None => (
            LlamaStage::seeded(model, cfg.seed, split, s, mesh.device())?,
            None,
        ),
    };
    Ok((stage.with_loss_group(mesh.tp_group().clone()), rows))
}

/// `stage` parallelized over its stage's ranks.
fn parallelize(
    stage: LlamaStage,
    rows: Option<CheckpointRows>,
    quantized: Vec<LazyQuantized>,
    mesh: &MeshContext,
) -> Result<LlamaStage, TrainError> {
    Ok(match rows {
        // A checkpoint is read lazily: each FSDP rank reads only its rows (of a QLoRA base,
        // its blocks).
        Some(rows) => {
            let read = move |r: &RowRequest| read_rows(&rows, &quantized, r);
            parallelize_model_from(stage, mesh, read)?
        }
        None => parallelize_model(stage, mesh)?,
    })
}

/// What this rank's stages select of the model, summed over its chunks. A `--freeze` pattern,
/// a LoRA target or an adapter's module may select nothing on one stage and something on
/// another, so only the sums over every stage ([`Selection::check_all_stages`]) can refuse it.
#[derive(Default)]
struct Selection {
    /// Elements that train.
    own: u64,
    /// Per pattern, target or adapter module: what the stages selected of it.
    marks: Vec<f64>,
    /// A few parameters of each stage, which name examples in `--freeze`'s errors.
    names: Vec<HfParam>,
    /// The paths of the stages' `Lora` modules.
    seen: Vec<String>,
    /// `--lora-init`'s adapter as the last stage read it.
    loaded: Option<LoadedAdapter>,
}

impl Selection {
    fn add_marks(&mut self, mine: Vec<f64>) {
        self.marks.resize(mine.len(), 0.0);
        for (sum, m) in self.marks.iter_mut().zip(mine) {
            *sum += m;
        }
    }

    /// `stage` with `--freeze` (`patterns`) or LoRA's adapters on the frozen base applied by
    /// Hugging Face name, before parallelize_model (which then shards frozen parameters
    /// without gradient or state). Counted by name, so experts split over ep count whole.
    fn apply(
        &mut self,
        stage: LlamaStage,
        trainable: &Trainable,
        patterns: &[String],
    ) -> Result<LlamaStage, TrainError> {
        let params = hf_stage_params(&stage);
        self.names.extend(params.iter().take(3).cloned());
        Ok(match trainable {
            Trainable::Freeze => {
                let (plan, used) = freeze::plan_params(&params, patterns)?;
                self.add_marks(used.into_iter().map(|u| f64::from(u8::from(u))).collect());
                self.own += plan.trainable_elements;
                freeze::freeze(stage, &plan.frozen)
            }
            Trainable::Attach(config) => {
                let (stage, attached) = attach_lora(stage, config).map_err(lora_error)?;
                self.add_marks(attached.hits.iter().map(|&h| h as f64).collect());
                self.seen.extend(attached.seen);
                self.own += adapter_elements(&stage)?;
                stage
            }
            Trainable::Load(dir) => {
                let (stage, part) = load_adapter_part(stage, dir).map_err(lora_error)?;
                self.add_marks(
                    part.loaded
                        .iter()
                        .map(|&l| f64::from(u8::from(l)))
                        .collect(),
                );
                self.seen.extend(part.seen.iter().cloned());
                self.loaded = Some(part);
                self.own += adapter_elements(&stage)?;
                stage
            }
        })
    }

    /// Sums the selection over `group` (the pp group: one rank per stage, so each stage is
    /// counted once) and refuses a run in which nothing trains, or a `--freeze` pattern
    /// (`patterns`), LoRA target or adapter module that selected nothing on any stage. The
    /// elements that train over the whole model, and the run's LoRA config.
    fn check_all_stages(
        self,
        group: &ProcessGroup,
        trainable: Trainable,
        patterns: &[String],
    ) -> Result<(u64, Option<LoraConfig>), TrainError> {
        let sums: Vec<f64> = std::iter::once(self.own as f64).chain(self.marks).collect();
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
                freeze::check_used(patterns, &used, &self.names)?;
                None
            }
            Trainable::Attach(config) => {
                let hits = marks.iter().map(|&h| h as usize).collect();
                let seen = self.seen;
                Attached { hits, seen }.check(&config).map_err(lora_error)?;
                Some(config)
            }
            Trainable::Load(_) => {
                let mut part = self.loaded.expect("every rank holds a stage");
                part.loaded = marks.iter().map(|&l| l > 0.0).collect();
                part.seen = self.seen;
                part.check().map_err(lora_error)?;
                Some(part.config)
            }
        };
        Ok((own, lora))
    }
}
