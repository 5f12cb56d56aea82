//! `DistributedConfig`: what to parallelize and how, loadable from TOML, JSON or YAML.
//! Field names and defaults follow NeMo AutoModel's `parallelize_model` / `_apply`.

use std::collections::BTreeMap;

use burn::tensor::FloatDType;
use burn_parallel_describe::{ModelDescription, SEQUENCE_PARALLEL_SUFFIX, plan_name};
use burn_parallel_fsdp::MixedPrecisionPolicy;
use burn_parallel_tp::ParallelStyle;
use serde::{Deserialize, Serialize};

use crate::error::ParallelError;

pub(crate) mod error;
mod file;
mod placement;
mod plan;

pub use error::{ConfigError, Unsupported};
pub use placement::{FrozenModuleSharding, Strategy};
pub use plan::{Checkpointing, DataParallel, Plan};

crate::named_enum! {
    /// A float dtype in a config file or on the command line: `f32`/`float32`/`fp32`,
    /// `bf16`/`bfloat16`, `f16`/`float16`/`fp16`/`half`.
    pub enum Dtype as "dtype" {
        /// 32-bit float.
        F32 = "f32" | "float32" | "fp32",
        /// bfloat16.
        Bf16 = "bf16" | "bfloat16",
        /// IEEE half precision.
        F16 = "f16" | "float16" | "fp16" | "half",
    }
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

/// FSDP2's `MixedPrecisionPolicy` as configured, for every strategy (DDP with a policy that
/// casts runs as FSDP2 replicated over every rank, which applies it).
///
/// The default casts nothing: parameters, gradients and outputs stay in the model's own dtype
/// (f32), as PyTorch's `MixedPrecisionPolicy()` does. NeMo AutoModel defaults to bf16
/// parameters with f32 reduction: [`MixedPrecisionConfig::bf16`], or in a file
/// `mp_policy = { param_dtype = "bf16", reduce_dtype = "f32" }`. A dtype that is absent, or
/// `"none"`, is no cast.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct MixedPrecisionConfig {
    /// The dtype weights are gathered and computed in (default `None`: the model's own).
    #[serde(with = "optional_dtype")]
    pub param_dtype: Option<Dtype>,
    /// The dtype gradients are reduced in (default `None`: the model's own).
    #[serde(with = "optional_dtype")]
    pub reduce_dtype: Option<Dtype>,
    /// The dtype each FSDP unit's output is cast to (default `None`: left as computed).
    #[serde(with = "optional_dtype")]
    pub output_dtype: Option<Dtype>,
    /// Whether each unit's input is cast to `param_dtype` (default `false`).
    pub cast_forward_inputs: bool,
}

/// `Option<Dtype>` in config files: `"none"` (what `None` writes, TOML having no null), null or
/// an absent key is no cast.
mod optional_dtype {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::Dtype;

    /// The word for no cast.
    const NONE: &str = "none";

    pub fn serialize<S: Serializer>(dtype: &Option<Dtype>, s: S) -> Result<S::Ok, S::Error> {
        match dtype {
            Some(d) => d.serialize(s),
            None => s.serialize_str(NONE),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Dtype>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(word) if word == NONE => Ok(None),
            Some(word) => Dtype::from_name(&word).map(Some).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "{}, or {NONE} (no cast)",
                    Dtype::unknown_name(&word)
                ))
            }),
        }
    }
}

impl MixedPrecisionConfig {
    /// Everything in the model's own dtype (f32): no casts. The default.
    pub fn full_precision() -> Self {
        Self::default()
    }

    /// NeMo AutoModel's default: bf16 parameters (gathered and computed in bf16), gradients
    /// reduced in f32, inputs cast. Needs a backend with bf16 (flex, CUDA; ndarray has none).
    pub fn bf16() -> Self {
        Self {
            param_dtype: Some(Dtype::Bf16),
            reduce_dtype: Some(Dtype::F32),
            output_dtype: None,
            cast_forward_inputs: true,
        }
    }

    /// Whether the policy changes any dtype (f32 everywhere is no policy at all).
    pub fn casts(&self) -> bool {
        let casts = |d: Option<Dtype>| d.is_some_and(|d| d != Dtype::F32);
        casts(self.param_dtype) || casts(self.reduce_dtype) || casts(self.output_dtype)
    }

    /// The FSDP policy this config stands for.
    pub fn policy(&self) -> MixedPrecisionPolicy {
        MixedPrecisionPolicy {
            param_dtype: self.param_dtype.map(Into::into),
            reduce_dtype: self.reduce_dtype.map(Into::into),
            output_dtype: self.output_dtype.map(Into::into),
            cast_forward_inputs: self.cast_forward_inputs,
        }
    }
}

crate::named_enum! {
    /// What Megatron-FSDP shards, as its `zero_dp_strategy` names it (`optim`/`1`,
    /// `optim_grads`/`2`, `optim_grads_params`/`3`; in a file also the integer). Every stage
    /// stores only this rank's piece of each parameter and its optimizer state between steps;
    /// they differ in the step's communication and in what is held during it.
    #[derive(Default)]
    pub enum ZeroDpStrategy as "megatron_fsdp zero_dp_strategy", hint = no_shard_hint {
        /// ZeRO-1: the full gradient is all-reduced and each rank keeps its piece; weights are
        /// gathered once per step and kept through backward.
        Optim = "optim" | "1",
        /// ZeRO-2: gradients are reduce-scattered; weights gathered once per step and kept
        /// through backward.
        OptimGrads = "optim_grads" | "2",
        /// ZeRO-3 (the default): gradients reduce-scattered; weights freed after each unit's
        /// forward and gathered again in backward (Burn recomputes the gather: on a
        /// checkpointing device).
        #[default]
        OptimGradsParams = "optim_grads_params" | "3",
    }
}

/// What users coming from ZeRO-0 write, and where that lives here.
fn no_shard_hint(word: &str) -> Option<&'static str> {
    matches!(word, "0" | "no_shard").then_some("no sharding is strategy ddp")
}

impl ZeroDpStrategy {
    /// The ZeRO stage (1, 2 or 3).
    pub fn stage(self) -> u8 {
        match self {
            Self::Optim => 1,
            Self::OptimGrads => 2,
            Self::OptimGradsParams => 3,
        }
    }

    /// Whether units keep their gathered weights from forward through backward (ZeRO-1 and
    /// ZeRO-2); ZeRO-3 frees them after forward and gathers again.
    pub fn keeps_gathered_weights(self) -> bool {
        self != Self::OptimGradsParams
    }
}

/// Megatron-FSDP's options, named as NeMo AutoModel's Megatron-FSDP config names them. The
/// buckets are the FSDP units (the model's `#[fsdp(unit)]` layers, then the root), as
/// Megatron-FSDP buckets by `fsdp_unit_modules`: each is one flat buffer and one collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MegatronFsdpConfig {
    /// What is sharded (default ZeRO-3, `optim_grads_params`).
    pub zero_dp_strategy: ZeroDpStrategy,
    /// Reduce gradients in f32 whatever `mp_policy.param_dtype` is (default `false`: in
    /// `mp_policy.reduce_dtype`).
    pub grad_reduce_in_fp32: bool,
    /// Gather the next units' buffers while one computes (default `true`; the depth is
    /// `fsdp2_forward_prefetch_depth`).
    pub overlap_param_gather: bool,
    /// Elements one collective may move for a run of consecutive units (decoder layers):
    /// units are gathered and reduced together while their buffers add up to at most this
    /// (default `None`: one collective per unit, Megatron-FSDP's bucket per unit module).
    pub bucket_size: Option<usize>,
}

impl Default for MegatronFsdpConfig {
    fn default() -> Self {
        Self {
            zero_dp_strategy: ZeroDpStrategy::default(),
            grad_reduce_in_fp32: false,
            overlap_param_gather: true,
            bucket_size: None,
        }
    }
}

/// FSDP2's CPU offload: with `offload_params`, shards, their gradients and the optimizer step
/// live on the host (a CPU device); each gather first copies the shard to the compute device.
/// On a CPU compute device the host is the compute device itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct OffloadConfig {
    /// Keep shards, their gradients and the optimizer step on the host (default `false`).
    pub offload_params: bool,
}

/// `tp_shard_plan`: a named plan (`"llama"`) or a map from module path (with `*`) to a style.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TpShardPlan {
    /// A plan the model provides by name (`llama`, or `llama-sp` for its sequence-parallel
    /// variant).
    Named(String),
    /// Module path pattern (with `*`) to style name (`colwise`, `rowwise`,
    /// `colwise_fused(3)`, ...; see [`style_by_name`]).
    Map(BTreeMap<String, String>),
}

/// The mesh dimension names (NeMo's defaults).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MeshNames {
    /// The replicate (HSDP) dimension (default `dp_replicate`).
    pub dp_replicate: String,
    /// The FSDP shard dimension (default `dp_shard_cp`).
    pub dp_shard: String,
    /// The tensor-parallel dimension (default `tp`).
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
    /// How the model and batch are spread over the ranks (default `fsdp2`).
    pub strategy: Strategy,
    /// The number of ranks the job expects; checked against the world when set (default
    /// `None`: not checked).
    pub world_size: Option<usize>,
    /// Data-parallel shard size; inferred as `world / (pp * dp_replicate * tp * cp)` when unset
    /// (the default).
    pub dp_size: Option<usize>,
    /// HSDP replicas, each sharding the model over dp_shard (default 1: plain FSDP).
    pub dp_replicate_size: usize,
    /// Tensor-parallel ranks (default 1: none; under `tp`, 1 means every rank).
    pub tp_size: usize,
    /// Context-parallel ranks (default 1): each sequence is split over `cp` ranks (head-tail
    /// load balancing) and FSDP shards over the flattened `dp_shard x cp` (strategies fsdp2,
    /// hsdp and fsdp2_tp).
    pub cp_size: usize,
    /// Pipeline stages (default 1: none): the outermost mesh dimension, each stage holding
    /// consecutive layers and every other dimension living within one stage (strategies
    /// fsdp2, hsdp and fsdp2_tp; not yet with cp or ep).
    pub pp_size: usize,
    /// Expert-parallel ranks (default 1: none): a MoE model's experts are split over `ep`
    /// consecutive dp_shard ranks, which exchange tokens; `ep_size` must divide the dp_shard
    /// size (strategies ddp, fsdp2, hsdp, fsdp2_tp and megatron_fsdp).
    pub ep_size: usize,
    /// The mesh dimension names (default NeMo's: `dp_replicate`, `dp_shard_cp`, `tp`).
    pub mesh_names: MeshNames,
    /// Shard activations along the sequence between tensor-parallel regions (default `false`;
    /// needs more than one tp rank).
    pub sequence_parallel: bool,
    /// Activation checkpointing: recompute activations in backward (default `false`), as
    /// `activation_checkpointing_mode` says.
    pub activation_checkpointing: bool,
    /// TorchTitan's `mode` (default `"full"`): every decoder layer keeps only its input and is
    /// recomputed in backward, one layer at a time. That needs a model whose forward runs its
    /// layers through `fsdp::forward_units_checkpointed` with a `#[checkpoint]` field (the
    /// Llama family does); for another model `"full"` is Burn's whole-model checkpointing
    /// device. `"selective"` follows `selective_ac_option`.
    pub activation_checkpointing_mode: String,
    /// TorchTitan's `selective_ac_option` under `"selective"` mode (default `"op"`): `"op"`
    /// keeps the matmul outputs and recomputes the element-wise ops (Burn's checkpointing
    /// device, `device.gradient_checkpointing()`); a positive integer k checkpoints every k-th
    /// layer (layers k-1, 2k-1, ... from 0).
    pub selective_ac_option: String,
    /// Which layers activation checkpointing covers: `"all"` (default), `"none"` (off), or a
    /// part the model declares with `#[parallelize(part = "..")]` on a nested field, such as
    /// `"language"` or `"vision"` (only the `#[checkpoint]` fields below it). A part takes
    /// per-layer modes; a part the model does not declare is an error listing those it does.
    pub activation_checkpointing_scope: String,
    /// The mixed-precision policy (default: no casts).
    pub mp_policy: MixedPrecisionConfig,
    /// CPU offload of shards, gradients and the optimizer step (default `None`: off).
    pub offload_policy: Option<OffloadConfig>,
    /// A TP plan replacing the one the model declares (default `None`: the model's own).
    pub tp_shard_plan: Option<TpShardPlan>,
    /// `None` (the default): NeMo's policy, every unit but the last reshards and the root never
    /// does.
    pub reshard_after_forward: Option<bool>,
    /// Prefetch on (`fsdp2_forward_prefetch_depth` and `fsdp2_backward_prefetch_depth` units)
    /// or off (default on).
    pub enable_fsdp2_prefetch: bool,
    /// Units whose all-gather is in flight ahead of the one computing (`fsdp::forward_units`;
    /// default 1; at most 16: each holds its gathered weights).
    pub fsdp2_forward_prefetch_depth: usize,
    /// Units before the one whose backward starts whose re-gather is issued at that moment,
    /// for units that reshard after forward (`fsdp::FsdpConfig::backward_prefetch_depth`;
    /// default 2; at most 16: each holds its gathered weights until its backward).
    pub fsdp2_backward_prefetch_depth: usize,
    /// Burn's kernel fusion (default `false`): on a CubeCL device (wgpu, cuda) of a build with
    /// the `fusion` feature, operations run as fused kernels (`torch.compile`'s role). A named
    /// error on flex, ndarray and tch, and without the feature. Fused or eager is one choice per
    /// process (`burn_parallel_comm::compile`).
    pub enable_compile: bool,
    /// Async tensor parallelism (default `false`): under `sequence_parallel` (required), the
    /// linear layers' sequence all-gather and reduce-scatter run in ring steps, each exchange
    /// overlapping the matmul of a chunk (PyTorch's micro-pipelined TP).
    pub enable_async_tensor_parallel: bool,
    /// With `true` (the default), `MeshContext::set_requires_gradient_sync(false)` around the
    /// micro-steps of gradient accumulation keeps FSDP from reducing until the synced step;
    /// with `false` every micro-step reduces its gradients (the switch is ignored).
    pub defer_fsdp_grad_sync: bool,
    /// DDP all-reduce bucket size in MiB (PyTorch DDP's `bucket_cap_mb`; default 25).
    pub ddp_bucket_cap_mb: f64,
    /// Megatron-FSDP's options (strategy `megatron_fsdp` only; a `[megatron_fsdp]` table).
    pub megatron_fsdp: MegatronFsdpConfig,
    /// Where wholly frozen units go under the sharding strategies: `per_layer` (the default),
    /// `root` or `replicate` (see [`FrozenModuleSharding`]).
    pub frozen_multimodal_sharding: FrozenModuleSharding,
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
            pp_size: 1,
            ep_size: 1,
            mesh_names: MeshNames::default(),
            sequence_parallel: false,
            activation_checkpointing: false,
            activation_checkpointing_mode: "full".into(),
            selective_ac_option: "op".into(),
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
            megatron_fsdp: MegatronFsdpConfig::default(),
            frozen_multimodal_sharding: FrozenModuleSharding::default(),
        }
    }
}

/// The sizes of the mesh a config asks for: `pp x dp_replicate x dp_shard x cp x tp`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshSizes {
    /// HSDP replicas.
    pub dp_replicate: usize,
    /// Data-parallel ranks per replica the parameters are sharded over (with `cp > 1` FSDP
    /// shards over `dp_shard x cp`).
    pub dp_shard: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Context-parallel ranks: each sequence split over them; FSDP shards over
    /// `dp_shard x cp`.
    pub cp: usize,
    /// Pipeline stages (the outermost dimension; 1: none).
    pub pp: usize,
    /// Expert-parallel ranks: consecutive dp_shard ranks that split a MoE model's experts
    /// (1: none).
    pub ep: usize,
}

impl MeshSizes {
    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp
    }

    /// The data-parallel size: the number of distinct slices of a batch.
    pub fn dp(&self) -> usize {
        self.dp_replicate * self.dp_shard
    }
}

fn invalid(error: ConfigError) -> ParallelError {
    ParallelError::Config(error)
}

impl DistributedConfig {
    /// The TP plan the config names, if any: a plan the model provides by name (`llama`, or
    /// `llama-sp` for its sequence-parallel variant; `sequence_parallel` selects the variant
    /// too), or a map of module paths to style names (`colwise`, `rowwise`, `colwise_sp`, ...;
    /// sequence-parallel styles shard dim 1).
    pub fn tp_plan_override(
        &self,
        description: &ModelDescription,
    ) -> Result<Option<burn_parallel_tp::TpPlan>, ParallelError> {
        let Some(plan) = &self.tp_shard_plan else {
            return Ok(None);
        };
        match plan {
            TpShardPlan::Named(name) => {
                let (base, sp) = plan_name(name);
                let name = if sp || self.sequence_parallel {
                    format!("{base}{SEQUENCE_PARALLEL_SUFFIX}")
                } else {
                    base.to_string()
                };
                let plan = description
                    .named_plan(&name)
                    .map_err(|e| invalid(ConfigError::TpPlan(e.to_string())))?;
                Ok(Some(plan))
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

/// A `ParallelStyle` by its config name, as `#[tp(..)]` writes it: `colwise`, `rowwise_sp`
/// (sequence dim 1 of `[batch, seq, hidden]`), `rowwise_sp(2)`, `colwise_fused(3)` (a fused
/// projection of 3 equal parts). The names are burn-parallel-styles' one table.
pub fn style_by_name(name: &str) -> Result<ParallelStyle, ParallelError> {
    ParallelStyle::by_name(name).map_err(|e| invalid(ConfigError::TpPlan(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn megatron(options: MegatronFsdpConfig) -> DistributedConfig {
        DistributedConfig {
            strategy: Strategy::MegatronFsdp,
            megatron_fsdp: options,
            mp_policy: MixedPrecisionConfig {
                param_dtype: Some(Dtype::Bf16),
                ..MixedPrecisionConfig::default()
            },
            ..DistributedConfig::default()
        }
    }

    #[test]
    fn grad_reduce_in_fp32_reduces_in_f32_whatever_the_param_dtype() {
        let plain = megatron(MegatronFsdpConfig::default());
        let policy = |c: &DistributedConfig| c.plan(2).unwrap().mixed_precision();
        assert_eq!(policy(&plain).reduce_dtype, None);
        let fp32 = megatron(MegatronFsdpConfig {
            grad_reduce_in_fp32: true,
            ..MegatronFsdpConfig::default()
        });
        assert_eq!(policy(&fp32).reduce_dtype, Some(FloatDType::F32));
        assert_eq!(policy(&fp32).param_dtype, Some(FloatDType::BF16));
        let mut contradicting = fp32.clone();
        contradicting.mp_policy.reduce_dtype = Some(Dtype::Bf16);
        let err = contradicting.validate(2).unwrap_err().to_string();
        assert!(err.contains("grad_reduce_in_fp32"), "{err}");
    }

    #[test]
    fn one_name_table_serves_display_parsing_serde_and_errors() {
        for &s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>().unwrap(), s);
            let written = serde_json::to_value(s).unwrap();
            assert_eq!(written, serde_json::json!(s.to_string()));
            assert_eq!(serde_json::from_value::<Strategy>(written).unwrap(), s);
        }
        // Aliases and ZeRO stages as integers read; names are what is written.
        assert_eq!(
            serde_json::from_str::<Dtype>("\"bfloat16\"").unwrap(),
            Dtype::Bf16
        );
        let stage: ZeroDpStrategy = serde_json::from_str("1").unwrap();
        assert_eq!((stage, stage.name()), (ZeroDpStrategy::Optim, "optim"));
        let err = serde_json::from_str::<Strategy>("\"zero3\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown strategy `zero3`"), "{err}");
        assert!(Strategy::NAMES.iter().all(|n| err.contains(n)), "{err}");
        let err = style_by_name("colwize").unwrap_err().to_string();
        assert!(err.contains("colwise_gathered") && err.contains("sequence_parallel"));
        assert!(err.contains("colwise_fused;"), "{err}");
    }

    #[test]
    fn the_fused_style_is_named_with_its_parts() {
        assert_eq!(
            style_by_name("colwise_fused(3)").unwrap(),
            ParallelStyle::colwise_fused(3)
        );
        assert_eq!(
            style_by_name("colwise_fused( 2 )").unwrap(),
            ParallelStyle::colwise_fused(2)
        );
        for bad in ["colwise_fused", "colwise_fused(0)", "colwise_fused(x)"] {
            let err = style_by_name(bad).unwrap_err().to_string();
            assert!(err.contains("`colwise_fused(3)`"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_file_over_a_base_replaces_only_the_keys_it_sets() {
        let path = std::env::temp_dir().join(format!("over-{}.toml", std::process::id()));
        std::fs::write(&path, "tp_size = 2\n[mp_policy]\nparam_dtype = \"bf16\"\n").unwrap();
        let base = DistributedConfig {
            strategy: Strategy::Fsdp2Tp,
            world_size: Some(4),
            reshard_after_forward: Some(true),
            mp_policy: MixedPrecisionConfig {
                cast_forward_inputs: true,
                reduce_dtype: Some(Dtype::F32),
                ..MixedPrecisionConfig::default()
            },
            ..DistributedConfig::default()
        };
        let over = DistributedConfig::from_file_over(&path, &base).unwrap();
        let mut want = base.clone();
        want.tp_size = 2;
        want.mp_policy.param_dtype = Some(Dtype::Bf16);
        assert_eq!(over, want);
        // The file's own errors come first, naming it.
        std::fs::write(&path, "tp_sise = 2\n").unwrap();
        let err = DistributedConfig::from_file_over(&path, &base)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tp_sise") && err.contains("over-"), "{err}");
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn zero_stages_below_3_keep_gathered_weights() {
        for (zero, reshards) in [
            (ZeroDpStrategy::Optim, Some(false)),
            (ZeroDpStrategy::OptimGrads, Some(false)),
            (ZeroDpStrategy::OptimGradsParams, None),
        ] {
            let config = megatron(MegatronFsdpConfig {
                zero_dp_strategy: zero,
                ..MegatronFsdpConfig::default()
            });
            assert_eq!(config.plan(2).unwrap().resharding(), reshards, "{zero}");
            assert_eq!(
                zero.stage().to_string().parse::<ZeroDpStrategy>().unwrap(),
                zero
            );
            assert_eq!(zero.name().parse::<ZeroDpStrategy>().unwrap(), zero);
        }
        let err = "4".parse::<ZeroDpStrategy>().unwrap_err();
        assert!(err.contains("optim_grads_params/3"), "{err}");
    }
}
