//! [`Plan`]: what a [`DistributedConfig`] means on a world of ranks, made once by
//! [`DistributedConfig::plan`] after every check. The strategy's name is read here, where the
//! plan is made, and nowhere else: the context, the sidecar and the training step ask the plan
//! what to do.

use burn::tensor::FloatDType;
use burn_parallel_describe::ModelDescription;
use burn_parallel_fsdp::MixedPrecisionPolicy;
use burn_parallel_tp::TpPlan;

use super::{
    ConfigError, DistributedConfig, Dtype, FrozenModuleSharding, MegatronFsdpConfig, MeshNames,
    MeshSizes, Strategy, Unsupported, ZeroDpStrategy, invalid,
};
use crate::error::ParallelError;

/// How the data-parallel ranks hold the parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataParallel {
    /// Nothing to apply: one rank, or tensor parallelism alone, with no policy that casts or
    /// offloads. The model keeps its parameters as they are.
    None,
    /// DDP: every data-parallel rank holds the whole model; gradients are all-reduced after
    /// backward in buckets of `bucket_bytes`.
    Replicate {
        /// The bucket size (`ddp_bucket_cap_mb` in bytes).
        bucket_bytes: usize,
    },
    /// FSDP2: each parameter sharded by rows over dp_shard (flattened with cp), replicated over
    /// dp_replicate (HSDP). Also an FSDP2 with one-rank shards, which applies a policy that casts
    /// or offloads (one rank, or DDP that casts: PyTorch's `replicate`).
    Shard,
    /// Megatron-FSDP: each unit's parameters in one flat buffer split evenly over dp_shard.
    Flat {
        /// What is sharded (ZeRO-1, 2 or 3).
        zero: ZeroDpStrategy,
        /// Elements one collective may move for consecutive units (`None`: one per unit).
        bucket_elements: Option<usize>,
    },
}

/// A [`DistributedConfig`] resolved against a world: the mesh sizes, how data parallelism holds
/// the parameters, resharding, prefetch, precision and offload, and the switches the sidecar
/// reads. Only [`DistributedConfig::plan`] makes one, after every check, so holding a `Plan` is
/// proof that the config was validated for its world. [`MeshContext`](crate::MeshContext) holds
/// one.
///
/// Two plans are equal when they do the same thing, whatever strategy name they were written
/// with: `fsdp2` with `tp_size = 2` is `fsdp2_tp`, and `fsdp2` with `dp_replicate_size = 2` is
/// `hsdp`.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The config the plan was made from, as written (its strategy name is recorded in
    /// checkpoints).
    config: DistributedConfig,
    sizes: MeshSizes,
    data_parallel: DataParallel,
    resharding: Option<bool>,
    forward_prefetch_depth: usize,
    backward_prefetch_depth: usize,
    policy: MixedPrecisionPolicy,
    offload: bool,
}

impl PartialEq for Plan {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&self.config, &other.config);
        self.sizes == other.sizes
            && self.data_parallel == other.data_parallel
            && self.resharding == other.resharding
            && self.forward_prefetch_depth == other.forward_prefetch_depth
            && self.backward_prefetch_depth == other.backward_prefetch_depth
            && self.policy == other.policy
            && self.offload == other.offload
            && a.mesh_names == b.mesh_names
            && a.sequence_parallel == b.sequence_parallel
            && a.activation_checkpointing == b.activation_checkpointing
            && a.activation_checkpointing_mode == b.activation_checkpointing_mode
            && a.selective_ac_option == b.selective_ac_option
            && a.tp_shard_plan == b.tp_shard_plan
            && a.frozen_multimodal_sharding == b.frozen_multimodal_sharding
            && a.defer_fsdp_grad_sync == b.defer_fsdp_grad_sync
    }
}

impl Plan {
    /// The config the plan was made from, as written.
    pub fn config(&self) -> &DistributedConfig {
        &self.config
    }

    /// The mesh sizes: `pp x dp_replicate x dp_shard x cp x tp`, and ep within dp_shard x cp.
    pub fn sizes(&self) -> MeshSizes {
        self.sizes
    }

    /// How the data-parallel ranks hold the parameters.
    pub fn data_parallel(&self) -> DataParallel {
        self.data_parallel
    }

    /// Whether data parallelism is DDP proper (replicated parameters, bucketed all-reduce).
    pub fn uses_ddp(&self) -> bool {
        matches!(self.data_parallel, DataParallel::Replicate { .. })
    }

    /// Whether FSDP (per-parameter or flat) holds the parameters.
    pub fn shards_parameters(&self) -> bool {
        matches!(
            self.data_parallel,
            DataParallel::Shard | DataParallel::Flat { .. }
        )
    }

    /// Whether units drop their gathered weights after forward: `reshard_after_forward`, except
    /// under megatron_fsdp's ZeRO-1 and ZeRO-2, which keep them (`None`: each unit's default,
    /// every unit but the last reshards and the root never does).
    pub fn resharding(&self) -> Option<bool> {
        self.resharding
    }

    /// Whether resharding needs Burn's gradient-checkpointing device to take effect:
    /// Megatron-FSDP's flat units, whose parameters are views of one gathered buffer, reshard
    /// only by Burn recomputing the gather. FSDP2's units reshard on the plain device too (the
    /// layers that rebuild their weights in backward, see `fsdp::weight_rebuild`).
    pub fn reshards_by_recomputation(&self) -> bool {
        matches!(self.data_parallel, DataParallel::Flat { .. }) && self.resharding != Some(false)
    }

    /// Units whose all-gather is in flight ahead of the one computing (0 with prefetch off:
    /// `enable_fsdp2_prefetch = false`, or megatron_fsdp's `overlap_param_gather = false`).
    pub fn forward_prefetch_depth(&self) -> usize {
        self.forward_prefetch_depth
    }

    /// Units before the one whose backward starts whose re-gather is issued then (0 with
    /// prefetch off, as [`Self::forward_prefetch_depth`]).
    pub fn backward_prefetch_depth(&self) -> usize {
        self.backward_prefetch_depth
    }

    /// The mixed-precision policy FSDP applies: `mp_policy`, with f32 reduction under
    /// megatron_fsdp's `grad_reduce_in_fp32`.
    pub fn mixed_precision(&self) -> MixedPrecisionPolicy {
        self.policy
    }

    /// Whether shards, their gradients and the optimizer step live on the host.
    pub fn offloads(&self) -> bool {
        self.offload
    }

    /// Whether activations are recomputed in backward.
    pub fn activation_checkpointing(&self) -> bool {
        self.config.activation_checkpointing
    }

    /// How activations are recomputed, when they are (see [`Checkpointing`]): never with
    /// `activation_checkpointing = false` or `activation_checkpointing_scope = "none"`.
    pub fn checkpointing(&self) -> Option<Checkpointing> {
        let scope = self.config.activation_checkpointing_scope.as_str();
        match self.config.activation_checkpointing && scope != SCOPE_NONE {
            true => self.config.checkpointing().ok(),
            false => None,
        }
    }

    /// The part of the model activation checkpointing is limited to, when
    /// `activation_checkpointing_scope` names one (`"vision"`: the layers under fields
    /// declared `#[parallelize(part = "vision")]`); `None` for the whole model.
    pub fn checkpointed_part(&self) -> Option<&str> {
        match self.config.activation_checkpointing_scope.as_str() {
            SCOPE_ALL | SCOPE_NONE => None,
            part => Some(part),
        }
    }

    /// Whether the plan needs Burn's checkpointing device for activations: selective
    /// checkpointing by op.
    pub fn checkpoints_ops(&self) -> bool {
        self.checkpointing() == Some(Checkpointing::Ops)
    }

    /// Whether the run asks for Burn's kernel fusion (`enable_compile`).
    pub fn compile(&self) -> bool {
        self.config.enable_compile
    }

    /// Whether sequence-parallel collectives run in ring steps overlapping the matmuls
    /// (`enable_async_tensor_parallel`).
    pub fn async_tensor_parallel(&self) -> bool {
        self.config.enable_async_tensor_parallel
    }

    /// Whether activations are sharded along the sequence between tensor-parallel regions.
    pub fn sequence_parallel(&self) -> bool {
        self.config.sequence_parallel
    }

    /// Where wholly frozen units go.
    pub fn frozen_sharding(&self) -> FrozenModuleSharding {
        self.config.frozen_multimodal_sharding
    }

    /// Whether FSDP's gradient reduction may be deferred over accumulation micro-steps.
    pub fn defers_grad_sync(&self) -> bool {
        self.config.defer_fsdp_grad_sync
    }

    /// The mesh dimension names.
    pub fn mesh_names(&self) -> &MeshNames {
        &self.config.mesh_names
    }

    /// The TP plan a model runs under: the config's `tp_shard_plan` when given, else the one
    /// the model declares (its sequence-parallel variant under `sequence_parallel`).
    pub fn tp_plan(&self, description: &ModelDescription) -> Result<TpPlan, ParallelError> {
        Ok(match self.config.tp_plan_override(description)? {
            Some(plan) => plan,
            None => description.tp_plan(self.config.sequence_parallel),
        })
    }
}

impl Strategy {
    /// The `tp_size` and `dp_replicate_size` the strategy needs at least (fsdp2_tp splits
    /// over 2 tp ranks, hsdp over 2 replicas; 1 and 1 otherwise): what a program that takes
    /// only a strategy's name fills in.
    pub fn smallest_sizes(self) -> (usize, usize) {
        match self {
            Strategy::Fsdp2Tp => (2, 1),
            Strategy::Hsdp => (1, 2),
            _ => (1, 1),
        }
    }

    /// Whether the strategy keeps every unit's gathered weights through backward at ZeRO
    /// stage `zero` (megatron_fsdp's ZeRO-1 and ZeRO-2), so that `reshard_after_forward =
    /// true` is an error there.
    pub fn keeps_gathered_weights(self, zero: ZeroDpStrategy) -> bool {
        self == Strategy::MegatronFsdp && zero.keeps_gathered_weights()
    }
}

/// `activation_checkpointing_scope` for every layer of the model.
const SCOPE_ALL: &str = "all";
/// `activation_checkpointing_scope` for no layer: checkpointing off.
const SCOPE_NONE: &str = "none";

/// How activation checkpointing recomputes (`activation_checkpointing_mode` and
/// `selective_ac_option`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Checkpointing {
    /// Every k-th decoder layer keeps only its input and is recomputed whole in backward
    /// (k = 1: mode `"full"`). A model without a `#[checkpoint]` field gets Burn's
    /// checkpointing device instead under `"full"`.
    Layers(usize),
    /// Selective by op: Burn's checkpointing device keeps the matmul outputs and recomputes
    /// the element-wise ops.
    Ops,
}

impl DistributedConfig {
    /// What `activation_checkpointing_mode` and `selective_ac_option` ask for (whether or not
    /// `activation_checkpointing` is on).
    pub(crate) fn checkpointing(&self) -> Result<Checkpointing, ParallelError> {
        let mode = self.activation_checkpointing_mode.as_str();
        let option = self.selective_ac_option.trim();
        match (mode, option, option.parse::<usize>()) {
            ("full", _, _) => Ok(Checkpointing::Layers(1)),
            ("selective", "op", _) => Ok(Checkpointing::Ops),
            ("selective", _, Ok(k)) if k > 0 => Ok(Checkpointing::Layers(k)),
            _ => Err(ParallelError::Config(ConfigError::CheckpointingMode {
                mode: self.activation_checkpointing_mode.clone(),
                option: self.selective_ac_option.clone(),
            })),
        }
    }

    /// Checks the config against a world of `world_size` ranks and resolves what it means
    /// there. Every inconsistency is reported here, before any rank communicates.
    pub fn plan(&self, world_size: usize) -> Result<Plan, ParallelError> {
        let sizes = self.checked_sizes(world_size)?;
        let megatron = self.strategy == Strategy::MegatronFsdp;
        let offload = self.offload_policy.is_some_and(|o| o.offload_params);
        let data_parallel = match self.strategy {
            // A casting policy runs DDP as FSDP2 replicated over every rank (see `Strategy`).
            Strategy::Ddp if !self.mp_policy.casts() => DataParallel::Replicate {
                bucket_bytes: (self.ddp_bucket_cap_mb * 1024.0 * 1024.0) as usize,
            },
            Strategy::MegatronFsdp => DataParallel::Flat {
                zero: self.megatron_fsdp.zero_dp_strategy,
                bucket_elements: self.megatron_fsdp.bucket_size,
            },
            _ if sizes.dp() * sizes.cp > 1 || self.mp_policy.casts() || offload => {
                DataParallel::Shard
            }
            _ => DataParallel::None,
        };
        let zero = self.megatron_fsdp.zero_dp_strategy;
        let resharding = match self.strategy.keeps_gathered_weights(zero) {
            true => Some(false),
            false => self.reshard_after_forward,
        };
        let prefetches = match megatron {
            true => self.megatron_fsdp.overlap_param_gather,
            false => self.enable_fsdp2_prefetch,
        };
        let mut policy = self.mp_policy.policy();
        if megatron && self.megatron_fsdp.grad_reduce_in_fp32 {
            policy.reduce_dtype = Some(FloatDType::F32);
        }
        Ok(Plan {
            config: self.clone(),
            sizes,
            data_parallel,
            resharding,
            forward_prefetch_depth: if prefetches {
                self.fsdp2_forward_prefetch_depth
            } else {
                0
            },
            backward_prefetch_depth: if prefetches {
                self.fsdp2_backward_prefetch_depth
            } else {
                0
            },
            policy,
            offload,
        })
    }

    /// The mesh sizes the config gives on `world_size` ranks, after the checks of
    /// [`Self::plan`].
    pub fn validate(&self, world_size: usize) -> Result<MeshSizes, ParallelError> {
        Ok(self.plan(world_size)?.sizes())
    }

    /// Every check of the config against a world of `world_size` ranks, and the mesh sizes.
    fn checked_sizes(&self, world_size: usize) -> Result<MeshSizes, ParallelError> {
        if let Some(expected) = self.world_size
            && expected != world_size
        {
            return Err(invalid(ConfigError::WorldSize {
                configured: expected,
                launched: world_size,
            }));
        }
        self.check_supported()?;
        self.check_frozen_sharding()?;
        for (name, size) in [
            ("tp_size", self.tp_size),
            ("dp_replicate_size", self.dp_replicate_size),
            ("cp_size", self.cp_size),
            ("pp_size", self.pp_size),
            ("ep_size", self.ep_size),
        ] {
            if size == 0 {
                return Err(invalid(ConfigError::ZeroSize { name }));
            }
        }
        if self.dp_size == Some(0) {
            return Err(invalid(ConfigError::ZeroSize { name: "dp_size" }));
        }
        if self.sequence_parallel && self.tp_size == 1 && self.strategy != Strategy::Tp {
            return Err(invalid(ConfigError::SequenceParallelWithoutTp(
                "tp_size > 1",
            )));
        }
        // Written so NaN is rejected too.
        if self.ddp_bucket_cap_mb.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(invalid(ConfigError::BucketCap));
        }
        for (key, depth) in [
            (
                "fsdp2_forward_prefetch_depth",
                self.fsdp2_forward_prefetch_depth,
            ),
            (
                "fsdp2_backward_prefetch_depth",
                self.fsdp2_backward_prefetch_depth,
            ),
        ] {
            if depth > super::error::MAX_PREFETCH_DEPTH {
                return Err(invalid(ConfigError::PrefetchDepth { key, depth }));
            }
        }
        let sizes = self.strategy_sizes(world_size)?;
        if sizes.world() != world_size {
            return Err(invalid(ConfigError::MeshSize {
                dp_replicate: sizes.dp_replicate,
                dp_shard: sizes.dp_shard,
                tp: sizes.tp,
                world: world_size,
            }));
        }
        if self.sequence_parallel && sizes.tp == 1 {
            return Err(invalid(ConfigError::SequenceParallelWithoutTp(
                "more than one tp rank",
            )));
        }
        // Experts split over the flattened dp_shard x cp ranks (TorchTitan's dp_shard_cp):
        // under context parallelism the cp ranks of a sequence hold different experts too.
        if !(sizes.dp_shard * sizes.cp).is_multiple_of(self.ep_size) {
            return Err(invalid(ConfigError::ExpertGroups {
                ep: self.ep_size,
                dp_shard: sizes.dp_shard,
                cp: sizes.cp,
            }));
        }
        Ok(MeshSizes {
            ep: self.ep_size,
            ..sizes
        })
    }

    /// Options of the reference systems that do not exist here, each an error naming it.
    fn check_supported(&self) -> Result<(), ParallelError> {
        let unsupported = |what: Unsupported| Err(ParallelError::NotSupported(what));
        if self.strategy == Strategy::MegatronFsdp {
            self.check_megatron_fsdp()?;
        } else if self.megatron_fsdp != MegatronFsdpConfig::default() {
            return Err(invalid(ConfigError::MegatronOptions(self.strategy)));
        }
        let splits_experts = matches!(
            self.strategy,
            Strategy::Ddp
                | Strategy::Fsdp2
                | Strategy::Hsdp
                | Strategy::Fsdp2Tp
                | Strategy::MegatronFsdp
        );
        if self.ep_size > 1 && !splits_experts {
            return unsupported(Unsupported::ExpertParallel {
                ep: self.ep_size,
                strategy: self.strategy,
            });
        }
        if self.cp_size > 1
            && !matches!(
                self.strategy,
                Strategy::Fsdp2 | Strategy::Hsdp | Strategy::Fsdp2Tp | Strategy::MegatronFsdp
            )
        {
            return Err(invalid(ConfigError::ContextParallelStrategy {
                cp: self.cp_size,
                strategy: self.strategy,
            }));
        }
        if self.pp_size > 1 {
            self.check_pipeline()?;
        }
        if self.enable_async_tensor_parallel && !self.sequence_parallel {
            return Err(invalid(ConfigError::AsyncTpWithoutSequenceParallel));
        }
        if self.checkpointing()? == Checkpointing::Ops
            && self.activation_checkpointing
            && !matches!(
                self.activation_checkpointing_scope.as_str(),
                SCOPE_ALL | SCOPE_NONE
            )
        {
            return Err(invalid(ConfigError::ScopedOpCheckpointing {
                scope: self.activation_checkpointing_scope.clone(),
            }));
        }
        Ok(())
    }

    /// What pipeline parallelism composes with so far: the sharding strategies (fsdp2, hsdp,
    /// fsdp2_tp; expert parallelism with those that split experts), without context
    /// parallelism.
    fn check_pipeline(&self) -> Result<(), ParallelError> {
        let with = if !matches!(
            self.strategy,
            Strategy::Fsdp2 | Strategy::Hsdp | Strategy::Fsdp2Tp
        ) {
            Some(format!(
                "strategy {} (pp works with fsdp2, hsdp and fsdp2_tp)",
                self.strategy
            ))
        } else if self.cp_size > 1 {
            Some(format!("context parallelism (cp_size {})", self.cp_size))
        } else {
            None
        };
        match with {
            Some(with) => Err(ParallelError::NotSupported(Unsupported::PipelineParallel {
                pp: self.pp_size,
                with,
            })),
            None => Ok(()),
        }
    }

    /// `frozen_multimodal_sharding` places frozen units among FSDP units: under a strategy
    /// that shards nothing, a mode other than the default would silently do nothing.
    fn check_frozen_sharding(&self) -> Result<(), ParallelError> {
        let shards = matches!(
            self.strategy,
            Strategy::Fsdp2 | Strategy::Hsdp | Strategy::Fsdp2Tp | Strategy::MegatronFsdp
        );
        if shards || self.frozen_multimodal_sharding == FrozenModuleSharding::default() {
            return Ok(());
        }
        Err(invalid(ConfigError::FrozenSharding {
            mode: self.frozen_multimodal_sharding,
            strategy: self.strategy,
        }))
    }

    /// The combinations megatron_fsdp refuses, each named.
    fn check_megatron_fsdp(&self) -> Result<(), ParallelError> {
        let unsupported = |what: &'static str| {
            Err(ParallelError::NotSupported(Unsupported::MegatronFsdpWith(
                what,
            )))
        };
        if self.tp_size > 1 || self.sequence_parallel {
            return unsupported(
                "tensor or sequence parallelism (tp_size > 1): shard over data-parallel ranks \
                 only, or use fsdp2_tp",
            );
        }
        if self.offload_policy.is_some_and(|o| o.offload_params) {
            return unsupported("offload_policy (use fsdp2 to offload)");
        }
        if self.megatron_fsdp.bucket_size == Some(0) {
            return Err(invalid(ConfigError::MegatronFsdp(
                "bucket_size must be at least 1 element (leave it out for one collective per \
                 unit)"
                    .into(),
            )));
        }
        let zero = self.megatron_fsdp.zero_dp_strategy;
        if zero.keeps_gathered_weights() && self.reshard_after_forward == Some(true) {
            return Err(invalid(ConfigError::MegatronFsdp(format!(
                "zero_dp_strategy {} keeps the gathered weights through backward; \
                 reshard_after_forward = true is optim_grads_params (3)",
                zero.name()
            ))));
        }
        if self.megatron_fsdp.grad_reduce_in_fp32
            && self.mp_policy.reduce_dtype.is_some_and(|d| d != Dtype::F32)
        {
            return Err(invalid(ConfigError::MegatronFsdp(
                "grad_reduce_in_fp32 = true contradicts mp_policy.reduce_dtype; set one of them"
                    .into(),
            )));
        }
        Ok(())
    }

    /// What the strategy makes of the sizes: the mesh `dp_replicate x dp_shard x tp`.
    fn strategy_sizes(&self, world: usize) -> Result<MeshSizes, ParallelError> {
        let s = self.strategy;
        let bad = |reason: String| {
            Err(invalid(ConfigError::StrategySizes {
                strategy: s,
                reason,
            }))
        };
        let (replicate, tp) = (self.dp_replicate_size, self.tp_size);
        if matches!(s, Strategy::Single | Strategy::Ddp | Strategy::Tp) && replicate > 1 {
            return bad(format!(
                "dp_replicate_size {replicate} applies to hsdp, fsdp2 and megatron_fsdp only: leave \
                 it at 1"
            ));
        }
        let sizes = |dp_replicate, dp_shard, tp| MeshSizes {
            dp_replicate,
            dp_shard,
            tp,
            cp: 1,
            pp: 1,
            ep: 1,
        };
        match s {
            Strategy::Single if world != 1 => bad(format!("runs on 1 rank, not {world}")),
            Strategy::Single if tp > 1 => bad(format!("cannot use tp_size {tp} (use tp)")),
            Strategy::Single => Ok(sizes(1, 1, 1)),
            Strategy::Ddp if tp > 1 => bad(format!(
                "cannot use tp_size {tp} (use fsdp2_tp or fsdp2 with tp_size)"
            )),
            // A casting policy runs DDP as FSDP2 replicated over every rank (see `Strategy`).
            Strategy::Ddp if self.mp_policy.casts() => Ok(sizes(world, 1, 1)),
            Strategy::Ddp => Ok(sizes(1, self.dp_size.unwrap_or(world), 1)),
            Strategy::Tp => {
                let t = if tp == 1 { world } else { tp };
                if t != world {
                    return bad(format!(
                        "tp_size {t} must equal the world size {world} (use fsdp2_tp to combine \
                         with data parallelism)"
                    ));
                }
                Ok(sizes(1, 1, t))
            }
            Strategy::Fsdp2Tp if tp == 1 => bad("needs tp_size > 1".into()),
            Strategy::Fsdp2 | Strategy::Fsdp2Tp | Strategy::Hsdp | Strategy::MegatronFsdp => {
                // Pipeline stages are the outermost dimension: every other group lives within
                // one stage.
                let pp = self.pp_size;
                let model_parallel = tp * self.cp_size * replicate * pp;
                if pp > 1 && !world.is_multiple_of(model_parallel) {
                    return Err(invalid(ConfigError::StagesNotDivisible {
                        world,
                        pp,
                        dp_replicate: replicate,
                        tp,
                        cp: self.cp_size,
                    }));
                }
                if !world.is_multiple_of(model_parallel) {
                    return Err(invalid(ConfigError::NotDivisible {
                        world,
                        dp_replicate: replicate,
                        tp,
                        cp: self.cp_size,
                    }));
                }
                if s == Strategy::Hsdp && replicate < 2 {
                    return bad("needs dp_replicate_size >= 2 (with 1 it is fsdp2)".into());
                }
                let dp_shard = self.dp_size.unwrap_or(world / model_parallel);
                Ok(MeshSizes {
                    cp: self.cp_size,
                    pp,
                    ..sizes(replicate, dp_shard, tp)
                })
            }
        }
    }
}
