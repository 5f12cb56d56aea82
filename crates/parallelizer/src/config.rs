//! `DistributedConfig`: what to parallelize and how, loadable from TOML, JSON or YAML.
//! Field names and defaults follow NeMo AutoModel's `parallelize_model` / `_apply`.

use std::collections::BTreeMap;
use std::path::Path;

use burn::tensor::FloatDType;
use burn_parallel_fsdp::MixedPrecisionPolicy;
use burn_parallel_tp::ParallelStyle;
use serde::{Deserialize, Serialize};

use crate::error::ParallelError;

/// The data-parallel strategy. Tensor parallelism composes with FSDP2/HSDP through `tp_size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Replicated parameters, gradients all-reduced (bucketed) after backward.
    Ddp,
    /// Fully sharded over dp_shard (HSDP when `dp_replicate_size > 1`).
    #[default]
    Fsdp2,
    /// FSDP2 sharded within dp_shard and replicated across `dp_replicate_size` groups.
    Hsdp,
    /// Megatron-style FSDP: not implemented yet.
    MegatronFsdp,
}

/// A float dtype in a config file: `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
    #[serde(alias = "float16", alias = "fp16", alias = "half")]
    F16,
}

impl From<Dtype> for FloatDType {
    fn from(d: Dtype) -> Self {
        match d {
            Dtype::F32 => FloatDType::F32,
            Dtype::Bf16 => FloatDType::BF16,
            Dtype::F16 => FloatDType::F16,
        }
    }
}

/// FSDP2's `MixedPrecisionPolicy` as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecisionConfig {
    pub param_dtype: Option<Dtype>,
    pub reduce_dtype: Option<Dtype>,
    pub output_dtype: Option<Dtype>,
    pub cast_forward_inputs: bool,
}

impl Default for MixedPrecisionConfig {
    /// NeMo's default: bf16 parameters, f32 gradient reduction, no input cast.
    fn default() -> Self {
        Self {
            param_dtype: Some(Dtype::Bf16),
            reduce_dtype: Some(Dtype::F32),
            output_dtype: None,
            cast_forward_inputs: false,
        }
    }
}

impl MixedPrecisionConfig {
    /// Everything in the shards' own dtype (f32): no casts.
    pub fn full_precision() -> Self {
        Self {
            param_dtype: None,
            reduce_dtype: None,
            output_dtype: None,
            cast_forward_inputs: false,
        }
    }

    pub fn policy(&self) -> MixedPrecisionPolicy {
        MixedPrecisionPolicy {
            param_dtype: self.param_dtype.map(Into::into),
            reduce_dtype: self.reduce_dtype.map(Into::into),
            output_dtype: self.output_dtype.map(Into::into),
            cast_forward_inputs: self.cast_forward_inputs,
        }
    }
}

/// CPU offload of shards, gradients and the optimizer step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    pub offload_params: bool,
}

/// `tp_shard_plan`: a named plan (`"llama"`) or a map from module path (with `*`) to a style.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TpShardPlan {
    Named(String),
    Map(BTreeMap<String, String>),
}

/// The mesh dimension names (NeMo's defaults).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshNames {
    pub dp_replicate: String,
    pub dp_shard: String,
    pub tp: String,
}

impl Default for MeshNames {
    fn default() -> Self {
        Self {
            dp_replicate: "dp_replicate".into(),
            dp_shard: "dp_shard_cp".into(),
            tp: "tp".into(),
        }
    }
}

/// Everything `parallelize_model` needs to know. Unknown keys in a file are errors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistributedConfig {
    pub strategy: Strategy,
    /// The number of ranks the job expects; checked against the world when set.
    pub world_size: Option<usize>,
    /// Data-parallel shard size; inferred as `world / (dp_replicate * tp * cp)` when unset.
    pub dp_size: Option<usize>,
    pub dp_replicate_size: usize,
    pub tp_size: usize,
    pub cp_size: usize,
    pub ep_size: usize,
    pub mesh_names: MeshNames,
    pub sequence_parallel: bool,
    pub activation_checkpointing: bool,
    pub activation_checkpointing_scope: String,
    pub mp_policy: MixedPrecisionConfig,
    pub offload_policy: Option<OffloadConfig>,
    pub tp_shard_plan: Option<TpShardPlan>,
    /// `None`: NeMo's policy, every unit but the last reshards and the root never does.
    pub reshard_after_forward: Option<bool>,
    pub enable_fsdp2_prefetch: bool,
    /// Units whose all-gather is in flight ahead of the one computing (`forward_units`).
    pub fsdp2_forward_prefetch_depth: usize,
    /// Accepted for NeMo configs; no effect: Burn 0.22 has no backward hooks to issue a
    /// unit's gather ahead of its backward.
    pub fsdp2_backward_prefetch_depth: usize,
    /// Kernel fusion; no effect on the CPU backends (see `compile_parallelized_model`).
    pub enable_compile: bool,
    pub enable_async_tensor_parallel: bool,
    /// Accumulate gradients locally on micro-steps and reduce once on the last: a training
    /// loop that accumulates calls `MeshContext::set_requires_gradient_sync(false)` around
    /// its micro-steps' backward when this is set.
    pub defer_fsdp_grad_sync: bool,
    /// DDP all-reduce bucket size in MiB (PyTorch DDP's `bucket_cap_mb`).
    pub ddp_bucket_cap_mb: f64,
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Fsdp2,
            world_size: None,
            dp_size: None,
            dp_replicate_size: 1,
            tp_size: 1,
            cp_size: 1,
            ep_size: 1,
            mesh_names: MeshNames::default(),
            sequence_parallel: false,
            activation_checkpointing: false,
            activation_checkpointing_scope: "all".into(),
            mp_policy: MixedPrecisionConfig::default(),
            offload_policy: None,
            tp_shard_plan: None,
            reshard_after_forward: None,
            enable_fsdp2_prefetch: true,
            fsdp2_forward_prefetch_depth: 1,
            fsdp2_backward_prefetch_depth: 2,
            enable_compile: false,
            enable_async_tensor_parallel: false,
            defer_fsdp_grad_sync: true,
            ddp_bucket_cap_mb: 25.0,
        }
    }
}

/// The sizes of the mesh a config asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshSizes {
    pub dp_replicate: usize,
    pub dp_shard: usize,
    pub tp: usize,
}

fn invalid(message: impl Into<String>) -> ParallelError {
    ParallelError::Config(message.into())
}

impl DistributedConfig {
    /// Reads a config from a `.toml`, `.json`, `.yaml` or `.yml` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ParallelError> {
        let path = path.as_ref();
        let file_error = |message: String| ParallelError::ConfigFile {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| file_error(e.to_string()))?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext {
            "toml" => toml::from_str(&text).map_err(|e| file_error(e.to_string())),
            "json" => serde_json::from_str(&text).map_err(|e| file_error(e.to_string())),
            "yaml" | "yml" => serde_yaml_ng::from_str(&text).map_err(|e| file_error(e.to_string())),
            other => Err(file_error(format!(
                "unknown extension {other:?}: use .toml, .json, .yaml or .yml"
            ))),
        }
    }

    /// Writes the config in the format its extension names.
    pub fn to_file(&self, path: impl AsRef<Path>) -> Result<(), ParallelError> {
        let path = path.as_ref();
        let file_error = |message: String| ParallelError::ConfigFile {
            path: path.display().to_string(),
            message,
        };
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        let text = match ext {
            "toml" => toml::to_string(self).map_err(|e| file_error(e.to_string()))?,
            "json" => serde_json::to_string_pretty(self).map_err(|e| file_error(e.to_string()))?,
            "yaml" | "yml" => {
                serde_yaml_ng::to_string(self).map_err(|e| file_error(e.to_string()))?
            }
            other => {
                return Err(file_error(format!(
                    "unknown extension {other:?}: use .toml, .json, .yaml or .yml"
                )));
            }
        };
        std::fs::write(path, text).map_err(|e| file_error(e.to_string()))
    }

    /// Checks the config against a world of `world_size` ranks and returns the mesh sizes.
    /// Every inconsistency is reported here, before any rank communicates.
    pub fn validate(&self, world_size: usize) -> Result<MeshSizes, ParallelError> {
        if let Some(expected) = self.world_size
            && expected != world_size
        {
            return Err(invalid(format!(
                "world_size is {expected} but the job has {world_size} ranks"
            )));
        }
        match self.strategy {
            Strategy::MegatronFsdp => {
                return Err(ParallelError::NotSupported("strategy megatron_fsdp".into()));
            }
            Strategy::Ddp if self.tp_size > 1 => {
                return Err(invalid(format!(
                    "strategy ddp cannot use tp_size {} (use fsdp2 with tp_size)",
                    self.tp_size
                )));
            }
            _ => {}
        }
        if self.ep_size > 1 {
            return Err(ParallelError::NotSupported(format!(
                "expert parallelism (ep_size {})",
                self.ep_size
            )));
        }
        if self.cp_size > 1 {
            return Err(ParallelError::NotSupported(format!(
                "context parallelism (cp_size {})",
                self.cp_size
            )));
        }
        if self.offload_policy.is_some_and(|o| o.offload_params) {
            return Err(ParallelError::NotSupported(
                "offload_policy.offload_params".into(),
            ));
        }
        for (name, size) in [
            ("tp_size", self.tp_size),
            ("dp_replicate_size", self.dp_replicate_size),
            ("cp_size", self.cp_size),
            ("ep_size", self.ep_size),
        ] {
            if size == 0 {
                return Err(invalid(format!("{name} must be at least 1")));
            }
        }
        if self.enable_async_tensor_parallel && !self.sequence_parallel {
            return Err(invalid(
                "enable_async_tensor_parallel requires sequence_parallel",
            ));
        }
        if self.enable_async_tensor_parallel {
            return Err(ParallelError::NotSupported(
                "enable_async_tensor_parallel".into(),
            ));
        }
        if self.sequence_parallel && self.tp_size == 1 {
            return Err(invalid("sequence_parallel requires tp_size > 1"));
        }
        if self.activation_checkpointing_scope != "all" {
            return Err(ParallelError::NotSupported(format!(
                "activation_checkpointing_scope {:?} (only \"all\")",
                self.activation_checkpointing_scope
            )));
        }
        // Written so NaN is rejected too.
        if self.ddp_bucket_cap_mb.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(invalid("ddp_bucket_cap_mb must be positive"));
        }
        let model_parallel = self.tp_size * self.cp_size * self.dp_replicate_size;
        if !world_size.is_multiple_of(model_parallel) {
            return Err(invalid(format!(
                "world size {world_size} is not divisible by dp_replicate_size {} x tp_size {} x cp_size {}",
                self.dp_replicate_size, self.tp_size, self.cp_size
            )));
        }
        let dp_shard = self.dp_size.unwrap_or(world_size / model_parallel);
        let sizes = MeshSizes {
            dp_replicate: self.dp_replicate_size,
            dp_shard,
            tp: self.tp_size,
        };
        let total = sizes.dp_replicate * sizes.dp_shard * sizes.tp;
        if total != world_size {
            return Err(invalid(format!(
                "mesh dp_replicate {} x dp_shard {} x tp {} has {total} ranks but the world has {world_size}",
                sizes.dp_replicate, sizes.dp_shard, sizes.tp
            )));
        }
        match self.strategy {
            Strategy::Hsdp if sizes.dp_replicate < 2 => Err(invalid(
                "strategy hsdp needs dp_replicate_size >= 2 (with 1 it is fsdp2)",
            )),
            Strategy::Ddp if sizes.dp_replicate > 1 => Err(invalid(
                "strategy ddp replicates over every rank: leave dp_replicate_size at 1",
            )),
            _ => Ok(sizes),
        }
    }

    /// The TP plan the config names, if any; styles by name (`colwise`, `rowwise`,
    /// `colwise_sp`, ...; sequence-parallel styles shard dim 1).
    pub fn tp_plan_override(&self) -> Result<Option<burn_parallel_tp::TpPlan>, ParallelError> {
        let Some(plan) = &self.tp_shard_plan else {
            return Ok(None);
        };
        match plan {
            TpShardPlan::Named(name) => {
                let name = if self.sequence_parallel && !name.ends_with("-sp") {
                    format!("{name}-sp")
                } else {
                    name.clone()
                };
                Ok(Some(burn_parallel_tp::TpPlan::named(&name)?))
            }
            TpShardPlan::Map(entries) => {
                let mut plan = burn_parallel_tp::TpPlan::new();
                for (path, style) in entries {
                    plan = plan.with(path.clone(), style_by_name(style)?);
                }
                Ok(Some(plan))
            }
        }
    }
}

/// A `ParallelStyle` by its config name; sequence-parallel styles use the sequence dim 1 of
/// `[batch, seq, hidden]`.
pub fn style_by_name(name: &str) -> Result<ParallelStyle, ParallelError> {
    const SEQ: usize = 1;
    Ok(match name {
        "colwise" => ParallelStyle::colwise(),
        "colwise_gathered" => ParallelStyle::colwise_gathered(),
        "colwise_sp" => ParallelStyle::colwise_sp(SEQ),
        "rowwise" => ParallelStyle::rowwise(),
        "rowwise_from_replicated" => ParallelStyle::rowwise_from_replicated(),
        "rowwise_sp" => ParallelStyle::rowwise_sp(SEQ),
        "vocab_parallel" => ParallelStyle::vocab_parallel(),
        "vocab_parallel_sp" => ParallelStyle::vocab_parallel_sp(SEQ),
        "sequence_parallel" => ParallelStyle::sequence_parallel(SEQ),
        other => {
            return Err(invalid(format!(
                "unknown tp style {other:?} (known: colwise, colwise_gathered, colwise_sp, rowwise, rowwise_from_replicated, rowwise_sp, vocab_parallel, vocab_parallel_sp, sequence_parallel)"
            )));
        }
    })
}
