//! LoRA fine-tuning in the trainer: `--lora-rank`, `--lora-alpha`, `--lora-targets`,
//! `--lora-rslora`, `--lora-init DIR` (start from a peft adapter) and `--save-adapter DIR`
//! (write one). The adapters are attached to the whole model on every rank before
//! `parallelize_model`; after training the model is gathered, rank 0 writes the adapter, and
//! `--save` writes the merged model.

use std::path::{Path, PathBuf};

use burn::nn::Linear;
use burn::tensor::TensorData;
use burn_parallel_fsdp::RowRequest;
use burn_parallel_models::ModelError;
use burn_parallel_models::checkpoint::{CheckpointRows, fused_part_names};
use burn_parallel_models::{Llama, LlamaConfig};
use burn_parallel_parallelizer::Dtype;
use burn_parallel_parallelizer::full_model;
use burn_parallel_peft::{
    AdapterConfig, LazyQuantized, Lora, LoraConfig, LoraError, LoraModule, TargetModules,
    adapted_paths, apply_lora, load_adapter, merge_lora, quantize_bases, save_adapter,
};

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};
use crate::options::{DEFAULT_TARGETS, FUSED_DEFAULT_TARGETS, LoraOptions, LoraQuantize};

/// The LoRA flags of the trainer's command line; [`options`](Self::options) gives the run's
/// [`LoraOptions`].
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct LoraFlags {
    /// `--lora-rank R`.
    #[arg(
        long,
        value_name = "R",
        help = "Train LoRA adapters of rank R on --lora-targets, every base parameter frozen"
    )]
    pub lora_rank: Option<usize>,
    /// `--lora-alpha A`.
    #[arg(
        long,
        value_name = "A",
        help = "LoRA's scale numerator: adapters are scaled by A / R (default: A = R, a scale of \
                1; peft users often give 2 * R)"
    )]
    pub lora_alpha: Option<f64>,
    /// `--lora-targets LIST`.
    #[arg(
        long,
        value_name = "LIST",
        help = "LoRA target modules: comma-separated Hugging Face module names or dotted path \
                suffixes (default: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; on \
                Phi-3, whose checkpoint fuses them: qkv_proj,o_proj,gate_up_proj,down_proj)"
    )]
    pub lora_targets: Option<String>,
    /// `--lora-rslora`.
    #[arg(long, help = "Rank-stabilized LoRA: scale by A / sqrt(R)")]
    pub lora_rslora: bool,
    /// `--lora-init DIR`.
    #[arg(
        long,
        value_name = "DIR",
        help = "Start from a peft LoRA adapter (adapter_config.json + adapter_model.safetensors); \
                its config gives the rank, alpha and targets"
    )]
    pub lora_init: Option<PathBuf>,
    /// `--save-adapter DIR`.
    #[arg(
        long,
        value_name = "DIR",
        help = "Save the trained LoRA adapter here in peft's format (--save then writes the \
                merged model)"
    )]
    pub save_adapter: Option<PathBuf>,
    /// `--lora-quantize nf4`.
    #[arg(
        long,
        value_name = "KIND",
        help = "QLoRA: store the frozen base of every decoder linear in 4 bits (nf4: \
                bitsandbytes' NormalFloat, blocks of 64), decoded in f32 for each use; the \
                embedding, norms and LM head stay as loaded"
    )]
    pub lora_quantize: Option<LoraQuantize>,
}

impl LoraFlags {
    /// The run's LoRA settings.
    pub fn options(&self) -> LoraOptions {
        LoraOptions {
            rank: self.lora_rank,
            alpha: self.lora_alpha,
            targets: self.lora_targets.as_deref().map(split_targets),
            rslora: self.lora_rslora,
            init: self.lora_init.clone(),
            save_adapter: self.save_adapter.clone(),
            quantize: self.lora_quantize,
        }
    }
}

/// Checks a run's LoRA settings before any rank starts (reading `--lora-init`'s config).
pub(crate) fn check(cfg: &TrainConfig) -> Result<(), TrainError> {
    if cfg.lora.plan(cfg.seed, false)?.is_some() && !cfg.freeze.is_empty() {
        return Err(flag_error(
            "--freeze",
            "with LoRA: LoRA already freezes every base parameter (only the adapters train); \
             drop --freeze",
        ));
    }
    if cfg.lora.quantize.is_some() {
        check_quantized(cfg)?;
    }
    Ok(())
}

/// Refuses targets that name a part of a projection `model`'s checkpoint stores fused (Phi-3's
/// `q_proj` inside `qkv_proj`): peft adapts the fused module as one (one `lora_A` over its
/// parts), and sees no part, so the target is the fused module's name.
pub(crate) fn check_model(cfg: &TrainConfig, model: &LlamaConfig) -> Result<(), TrainError> {
    let row = model.family.row();
    if !row.fused {
        return Ok(());
    }
    let (flag, targets) = match cfg.lora.plan(cfg.seed, true)? {
        None => return Ok(()),
        Some(LoraPlan::New(config)) => ("--lora-targets", config.targets),
        Some(LoraPlan::Load(dir)) => {
            let file = AdapterConfig::read(&dir).map_err(lora_error)?;
            let targets = match file.target_modules {
                Some(TargetModules::List(list)) => list,
                Some(TargetModules::One(one)) => vec![one],
                None => Vec::new(),
            };
            ("--lora-init", targets)
        }
    };
    let names = |t: &String| {
        fused_part_names()
            .find(|(part, _)| t == part || t.ends_with(&format!(".{part}")))
            .map(|(_, fused)| (t.clone(), fused.to_string()))
    };
    let parts: Vec<(String, String)> = targets.iter().filter_map(names).collect();
    if parts.is_empty() {
        return Ok(());
    }
    let named = parts
        .iter()
        .map(|(part, fused)| format!("{part} (inside {fused})"))
        .collect::<Vec<_>>()
        .join(", ");
    Err(flag_error(
        flag,
        format!(
            "names parts of a fused projection of a {} model: {named}; peft adapts qkv_proj and \
             gate_up_proj each as one module (one lora_A shared by its parts), so target them \
             by those names (--lora-targets {})",
            row.model_type,
            FUSED_DEFAULT_TARGETS.join(",")
        ),
    ))
}

/// `--lora-quantize` needs adapters to train, and packed blocks that no cast rounds.
fn check_quantized(cfg: &TrainConfig) -> Result<(), TrainError> {
    if !cfg.lora.enabled() {
        return Err(flag_error(
            "--lora-quantize",
            "needs LoRA: give --lora-rank R (or --lora-init DIR); a quantized base alone \
             trains nothing",
        ));
    }
    let param_dtype = cfg.distributed.mp_policy.param_dtype;
    if param_dtype.is_some_and(|d| d != Dtype::F32) {
        return Err(flag_error(
            "--lora-quantize",
            "computes in f32 (bnb_4bit_compute_dtype = float32): a bf16/f16 --param-dtype \
             would round the packed 4-bit blocks; drop --param-dtype",
        ));
    }
    Ok(())
}

/// Where a run's adapters come from.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum LoraPlan {
    /// Fresh adapters (`a` seeded, `b` zero) of this config.
    New(LoraConfig),
    /// A peft adapter directory.
    Load(PathBuf),
}

impl LoraOptions {
    /// Whether the run trains LoRA adapters.
    pub fn enabled(&self) -> bool {
        self.rank.is_some() || self.init.is_some()
    }

    /// The run's adapters, or `None` without LoRA. Reads `--lora-init`'s config, which the
    /// LoRA flags given with it must agree with; flags that need a rank without one are
    /// errors saying so. `fused`: the model's checkpoint fuses projections (Phi-3), whose
    /// default targets are [`FUSED_DEFAULT_TARGETS`].
    pub(crate) fn plan(&self, seed: u64, fused: bool) -> Result<Option<LoraPlan>, TrainError> {
        if let Some(dir) = &self.init {
            let file = AdapterConfig::read(dir).map_err(lora_error)?;
            self.agrees_with(&file, dir)?;
            return Ok(Some(LoraPlan::Load(dir.clone())));
        }
        let Some(r) = self.rank else {
            let given = [
                (self.alpha.is_some(), "--lora-alpha"),
                (self.targets.is_some(), "--lora-targets"),
                (self.rslora, "--lora-rslora"),
                (self.save_adapter.is_some(), "--save-adapter"),
            ];
            return match given.iter().find(|(set, _)| *set) {
                Some((_, flag)) => Err(flag_error(
                    flag,
                    "needs LoRA: give --lora-rank R (or --lora-init DIR)",
                )),
                None => Ok(None),
            };
        };
        let targets = match &self.targets {
            Some(t) => t.clone(),
            None if fused => FUSED_DEFAULT_TARGETS.map(String::from).to_vec(),
            None => DEFAULT_TARGETS.map(String::from).to_vec(),
        };
        let config = LoraConfig {
            r,
            alpha: self.alpha.unwrap_or(r as f64),
            targets,
            rslora: self.rslora,
            seed,
        };
        config
            .validate()
            .map_err(|e| flag_error("--lora-rank/--lora-alpha/--lora-targets", format!(": {e}")))?;
        Ok(Some(LoraPlan::New(config)))
    }

    /// Refuses LoRA flags that contradict `--lora-init`'s `adapter_config.json`.
    fn agrees_with(&self, file: &AdapterConfig, dir: &Path) -> Result<(), TrainError> {
        let where_ = format!("--lora-init {}", dir.display());
        // `given`: the value typed after the flag; a switch (`--lora-rslora`) has none.
        let contradicts = |flag: &'static str, given: Option<String>, theirs: String| {
            let reason = format!(
                "contradicts {where_}, whose adapter_config.json says {theirs}; drop the flag \
                 (the adapter's config is used) or start without --lora-init"
            );
            Err(flag_error(
                flag,
                match given {
                    Some(value) => format!("{value} {reason}"),
                    None => reason,
                },
            ))
        };
        if let Some(r) = self.rank.filter(|r| *r != file.r) {
            return contradicts(
                "--lora-rank",
                Some(r.to_string()),
                format!("r = {}", file.r),
            );
        }
        if let Some(a) = self.alpha.filter(|a| *a != file.lora_alpha) {
            return contradicts(
                "--lora-alpha",
                Some(a.to_string()),
                format!("lora_alpha = {}", file.lora_alpha),
            );
        }
        if self.rslora && !file.use_rslora {
            return contradicts("--lora-rslora", None, "use_rslora = false".into());
        }
        if let Some(t) = &self.targets {
            let theirs = match &file.target_modules {
                Some(TargetModules::List(list)) => list.clone(),
                Some(TargetModules::One(one)) => vec![one.clone()],
                None => Vec::new(),
            };
            let (mut mine, mut sorted) = (t.clone(), theirs.clone());
            mine.sort();
            sorted.sort();
            if mine != sorted {
                return contradicts(
                    "--lora-targets",
                    Some(t.join(",")),
                    format!("target_modules = {theirs:?}"),
                );
            }
        }
        Ok(())
    }
}

/// Splits `--lora-targets`' comma-separated list, dropping blanks.
pub(crate) fn split_targets(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

pub(crate) fn lora_error(e: LoraError) -> TrainError {
    TrainError::Config(e.to_string())
}

/// `model` (whole, before `parallelize_model`) with `plan`'s adapters attached and its base
/// frozen, and the adapters' element count (what trains).
pub(crate) fn apply(model: Llama, plan: &LoraPlan) -> Result<(Llama, u64), TrainError> {
    let model = match plan {
        LoraPlan::New(config) => apply_lora(model, config).map_err(lora_error)?,
        LoraPlan::Load(dir) => load_adapter(model, dir).map_err(lora_error)?.0,
    };
    let trainable = adapter_elements(&model)?;
    Ok((model, trainable))
}

/// `model` (a whole model or a pipeline stage) with its `Lora` bases stored as `quantize`
/// says (unchanged without), and the bases left lazy ([`read_rows`] reads their shards).
pub(crate) fn quantize_base<M: LoraModule>(
    model: M,
    quantize: Option<LoraQuantize>,
) -> Result<(M, Vec<LazyQuantized>), TrainError> {
    match quantize {
        Some(LoraQuantize::Nf4) => quantize_bases(model).map_err(lora_error),
        None => Ok((model, Vec::new())),
    }
}

/// Rows `r` of a lazily read checkpoint's parameter: this rank's blocks of a QLoRA base in
/// `quantized` (quantized from just those elements), else the parameter's rows.
pub(crate) fn read_rows(
    rows: &CheckpointRows,
    quantized: &[LazyQuantized],
    r: &RowRequest,
) -> Result<TensorData, ModelError> {
    match quantized.iter().find(|q| q.packed == r.id) {
        Some(q) => rows.read_nf4_blocks(q.source, r.rows.clone(), &q.coded),
        None => rows.read(r.id, r.rows.clone()),
    }
}

/// Elements of every adapter's `a` and `b` (a whole model's, or a pipeline stage's; a fused
/// projection's shared `a` once).
pub(crate) fn adapter_elements<M: LoraModule + Clone>(model: &M) -> Result<u64, TrainError> {
    let mut n = 0u64;
    model
        .clone()
        .map_lora("", &mut |_, layer: Lora<Linear>| {
            if let Some(ad) = &layer.adapter {
                let a = ad.a.as_ref().map_or(0, |a| a.lazy_shape().num_elements());
                n += (a + ad.b.lazy_shape().num_elements()) as u64;
            }
            Ok(layer)
        })
        .map_err(lora_error)?;
    Ok(n)
}

/// After training: the whole model (gathered: collective, every rank calls it), `--save-adapter`
/// written by rank 0 (`is_root`), and the model with its adapters merged, for `--save`.
pub(crate) fn finish(
    model: Llama,
    plan: &LoraPlan,
    save_to: Option<&Path>,
    base_model: Option<&Path>,
    is_root: bool,
) -> Result<Llama, TrainError> {
    let model = full_model(model)?;
    if let (Some(dir), true) = (save_to, is_root) {
        let config = match plan {
            LoraPlan::New(config) => config.clone(),
            LoraPlan::Load(init) => {
                let file = AdapterConfig::read(init).map_err(lora_error)?;
                file.to_lora(&adapted_paths(&model).map_err(lora_error)?)
            }
        };
        let base = base_model.map(|p| p.display().to_string());
        save_adapter(&model, &config, dir, base.as_deref()).map_err(lora_error)?;
    }
    merge_lora(model).map_err(lora_error)
}

/// The end of a run on one rank: without LoRA, or with nothing to save, `model` as it is;
/// else [`finish`] (collective) with the run's settings.
pub(crate) fn finish_run(
    cfg: &TrainConfig,
    model_cfg: &LlamaConfig,
    model: Llama,
    is_root: bool,
) -> Result<Llama, TrainError> {
    let save_adapter = cfg.lora.save_adapter.as_deref();
    let Some(plan) = cfg.lora.plan(cfg.seed, model_cfg.family.row().fused)? else {
        return Ok(model);
    };
    if save_adapter.is_none() && cfg.save.is_none() {
        return Ok(model);
    }
    finish(
        model,
        &plan,
        save_adapter,
        cfg.checkpoint.as_deref(),
        is_root,
    )
}
