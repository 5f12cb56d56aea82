//! What a config can get wrong, as values a program can match on: [`ConfigError`] for a config
//! that contradicts itself, the world or the model, [`Unsupported`] for an option of the
//! reference systems that does not exist here. Each message says what to change.

use super::placement::{FrozenModuleSharding, Strategy};

/// The deepest forward prefetch accepted: a depth the model cannot use (beyond its unit count)
/// is fine, one past this is a mistake (each unit in flight holds its gathered weights).
pub(crate) const MAX_PREFETCH_DEPTH: usize = 16;

/// A distributed config that contradicts itself, the world or the model; raised by
/// `MeshContext::new` or `parallelize_model` before any rank communicates.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `world_size` is set and differs from the launched world.
    #[error("world_size is {configured} but the job has {launched} ranks")]
    WorldSize {
        /// The config's `world_size`.
        configured: usize,
        /// The ranks the job has.
        launched: usize,
    },
    /// A mesh size (`tp_size`, `dp_size`, ...) is 0.
    #[error("{name} must be at least 1")]
    ZeroSize {
        /// The key.
        name: &'static str,
    },
    /// `sequence_parallel` without tensor-parallel ranks.
    #[error("sequence_parallel requires {0}")]
    SequenceParallelWithoutTp(&'static str),
    /// `activation_checkpointing_mode` or `selective_ac_option` is not one of TorchTitan's.
    #[error(
        "activation_checkpointing_mode {mode:?} with selective_ac_option {option:?}: the mode is \
         \"full\" or \"selective\", the option \"op\" or a positive layer interval such as \"2\""
    )]
    CheckpointingMode {
        /// `activation_checkpointing_mode`.
        mode: String,
        /// `selective_ac_option`.
        option: String,
    },
    /// Every-k layer checkpointing on a model that declares no `#[checkpoint]` field.
    #[error(
        "selective_ac_option = k checkpoints every k-th layer, and the model declares no \
         #[checkpoint] LayerCheckpointing field for its forward to run its layers with \
         (fsdp::forward_units_checkpointed); add one, or use selective_ac_option = \"op\""
    )]
    NoLayerCheckpointing,
    /// `activation_checkpointing_scope` names a part the model does not declare.
    #[error(
        "activation_checkpointing_scope {scope:?} names no part of the model (it declares: \
         {declared}); use \"all\", \"none\" or a declared part, and declare parts with \
         #[parallelize(part = \"vision\")] on the #[nested] fields that hold them"
    )]
    UndeclaredCheckpointingPart {
        /// The scope asked for.
        scope: String,
        /// The parts the model declares, comma-separated (`no parts` if none).
        declared: String,
    },
    /// `activation_checkpointing_scope` names a declared part that holds no `#[checkpoint]`
    /// field.
    #[error(
        "activation_checkpointing_scope {scope:?}: that part of the model has no #[checkpoint] \
         LayerCheckpointing field for its forward to run its layers with \
         (fsdp::forward_units_checkpointed); add one to the module that runs the part's layers"
    )]
    NoLayerCheckpointingInPart {
        /// The part.
        scope: String,
    },
    /// Selective checkpointing by op limited to one part of the model.
    #[error(
        "activation_checkpointing_scope {scope:?} with selective_ac_option = \"op\": checkpointing \
         by op is Burn's checkpointing device, which covers the whole model; limit a part with \
         activation_checkpointing_mode = \"full\" or selective_ac_option = k, or use scope \"all\""
    )]
    ScopedOpCheckpointing {
        /// The scope asked for.
        scope: String,
    },
    /// `enable_async_tensor_parallel` without `sequence_parallel`.
    #[error(
        "enable_async_tensor_parallel needs sequence_parallel = true (the ring steps split the \
         sequence all-gather and reduce-scatter, which only sequence parallelism has; \
         tp_shard_plan = \"llama-sp\" for the Llama)"
    )]
    AsyncTpWithoutSequenceParallel,
    /// `ddp_bucket_cap_mb` is zero, negative or NaN.
    #[error("ddp_bucket_cap_mb must be positive")]
    BucketCap,
    /// `fsdp2_forward_prefetch_depth` or `fsdp2_backward_prefetch_depth` is past any use: each
    /// unit in flight holds its gathered weights, so a depth in the dozens would gather most of
    /// the model at once.
    #[error(
        "{key} {depth} would hold that many gathered units at once: give at most {max} (1 or 2 \
         hides a gather behind a unit's compute; 0 or enable_fsdp2_prefetch = false turns \
         prefetch off)",
        max = MAX_PREFETCH_DEPTH
    )]
    PrefetchDepth {
        /// The key.
        key: &'static str,
        /// Its value.
        depth: usize,
    },
    /// The world does not split into `dp_replicate x tp x cp` blocks.
    #[error(
        "world size {world} is not divisible by dp_replicate_size {dp_replicate} x tp_size {tp} \
         x cp_size {cp}"
    )]
    NotDivisible {
        /// The ranks the job has.
        world: usize,
        /// `dp_replicate_size`.
        dp_replicate: usize,
        /// `tp_size`.
        tp: usize,
        /// `cp_size`.
        cp: usize,
    },
    /// Under pipeline parallelism, the world does not split into `pp` stages of
    /// `dp_replicate x tp x cp` blocks.
    #[error(
        "world size {world} is not divisible by pp_size {pp} x dp_replicate_size {dp_replicate} \
         x tp_size {tp} x cp_size {cp}"
    )]
    StagesNotDivisible {
        /// The ranks the job has.
        world: usize,
        /// `pp_size`.
        pp: usize,
        /// `dp_replicate_size`.
        dp_replicate: usize,
        /// `tp_size`.
        tp: usize,
        /// `cp_size`.
        cp: usize,
    },
    /// The mesh's sizes multiply to another world size (an explicit `dp_size`).
    #[error(
        "mesh dp_replicate {dp_replicate} x dp_shard {dp_shard} x tp {tp} has {} ranks but the \
         world has {world}", dp_replicate * dp_shard * tp
    )]
    MeshSize {
        /// Replicas.
        dp_replicate: usize,
        /// Shards per replica.
        dp_shard: usize,
        /// Tensor-parallel ranks.
        tp: usize,
        /// The ranks the job has.
        world: usize,
    },
    /// `cp_size > 1` under a strategy that cannot shard over the cp ranks.
    #[error(
        "cp_size {cp} with strategy {strategy}: context parallelism shards the model over \
         dp_shard x cp, which only fsdp2, hsdp, fsdp2_tp and megatron_fsdp do; use one of them \
         (or cp_size 1)"
    )]
    ContextParallelStrategy {
        /// `cp_size`.
        cp: usize,
        /// The strategy.
        strategy: Strategy,
    },
    /// A configured mesh dimension name clashes with a dimension context parallelism adds.
    #[error(
        "mesh name {0:?} is taken by context parallelism's own dimensions (`dp_shard`, `cp`): \
         rename it in mesh_names"
    )]
    ContextParallelMeshName(String),
    /// `ep_size` does not divide the ranks experts are split over (`dp_shard x cp`).
    #[error(
        "ep_size {ep} does not divide the dp_shard size {dp_shard}{}: experts are split over \
         consecutive dp_shard ranks",
        if *cp > 1 { format!(" times cp {cp}") } else { String::new() }
    )]
    ExpertGroups {
        /// `ep_size`.
        ep: usize,
        /// The dp_shard size (without the cp ranks).
        dp_shard: usize,
        /// The cp size: experts are split over `dp_shard x cp` ranks.
        cp: usize,
    },
    /// The strategy cannot use the sizes given.
    #[error("strategy {strategy}: {reason}")]
    StrategySizes {
        /// The strategy.
        strategy: Strategy,
        /// What it cannot do, and what to use instead.
        reason: String,
    },
    /// `[megatron_fsdp]` options under another strategy.
    #[error(
        "[megatron_fsdp] options apply to strategy megatron_fsdp, not {0}: remove them or set \
         strategy = \"megatron_fsdp\""
    )]
    MegatronOptions(Strategy),
    /// A megatron_fsdp option that contradicts another.
    #[error("megatron_fsdp {0}")]
    MegatronFsdp(String),
    /// `frozen_multimodal_sharding` under a strategy that shards nothing.
    #[error(
        "frozen_multimodal_sharding = \"{mode}\" places frozen modules among FSDP units, but \
         strategy {strategy} shards nothing: remove it, or use fsdp2, hsdp, fsdp2_tp or \
         megatron_fsdp"
    )]
    FrozenSharding {
        /// The mode asked for.
        mode: FrozenModuleSharding,
        /// The strategy.
        strategy: Strategy,
    },
    /// `tp_shard_plan` names no plan of the model, or a style that does not exist.
    #[error("tp_shard_plan: {0}")]
    TpPlan(String),
    /// `tp_size > 1` with nothing to split.
    #[error(
        "tp_size is {tp} but the model declares no TP plan (no #[tp(..)] fields or plan name) \
         and the config gives no tp_shard_plan"
    )]
    NoTpPlan {
        /// `tp_size`.
        tp: usize,
    },
    /// An attention's heads do not split over the tensor-parallel ranks.
    #[error("attention at {path:?}: {reason}")]
    Heads {
        /// The attention module's path.
        path: String,
        /// Which count does not divide.
        reason: String,
    },
    /// Plain colwise on a fused projection (see `check_fused_colwise`).
    #[error("{0}")]
    FusedProjection(String),
    /// `ep_size > 1` on a model without experts.
    #[error(
        "ep_size is {ep} but the model has no mixture-of-experts module: mark the field holding \
         each layer's experts #[experts] (its type implements ExpertModule)"
    )]
    NoExperts {
        /// `ep_size`.
        ep: usize,
    },
    /// An option that needs Burn's gradient-checkpointing device, on another device.
    #[error(
        "{needs} only on Burn's gradient-checkpointing device, and {device} is not one: pass \
         `device.gradient_checkpointing()` to MeshContext::new (and build the model's inputs on \
         it)"
    )]
    NeedsCheckpointingDevice {
        /// The option and why it needs the device.
        needs: &'static str,
        /// The device given.
        device: String,
    },
}

/// An option of the reference systems (PyTorch FSDP2, TorchTitan, NeMo AutoModel, Megatron)
/// that does not exist here (yet).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Unsupported {
    /// Expert parallelism under a strategy that does not split experts.
    #[error(
        "expert parallelism (ep_size {ep}) with strategy {strategy} (ep works with ddp, fsdp2, \
         hsdp, fsdp2_tp and megatron_fsdp)"
    )]
    ExpertParallel {
        /// `ep_size`.
        ep: usize,
        /// The strategy.
        strategy: Strategy,
    },
    /// `pp_size > 1` with a strategy or dimension pipelines do not compose with yet.
    #[error("pipeline parallelism (pp_size {pp}) with {with}")]
    PipelineParallel {
        /// `pp_size`.
        pp: usize,
        /// What it was combined with, and what works.
        with: String,
    },
    /// A combination megatron_fsdp refuses.
    #[error("megatron_fsdp with {0}")]
    MegatronFsdpWith(&'static str),
    /// Something a user's own sidecar hook does not support, in its words.
    #[error("{0}")]
    Other(String),
}
