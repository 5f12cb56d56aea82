//! burn-parallel-parallelizer: the model-owned parallelizer contract and the dispatcher.
//!
//! - [`Parallelize`] (from `burn-parallel-describe`, re-exported here): what a model tells the
//!   parallelizer (its FSDP units, TP styles, the plans it provides, head counts, and its
//!   sidecar type). `#[parallelize]` implements it from field attributes.
//! - [`ModelParallelizer`]: NeMo AutoModel's sidecar hooks as default methods;
//!   [`DefaultParallelizer`] is the shared default, and a model names its own with
//!   `#[parallelize(sidecar = MySidecar)]` to override any hook.
//! - [`DistributedConfig`] (TOML/JSON/YAML) and [`MeshContext`] (one rank's mesh and groups).
//! - [`parallelize_model`]: DDP, FSDP2, HSDP, TP, FSDP2 + TP, unsharded FSDP2 on one rank.
//! - [`Step`]: backward, gradient sync, global-norm clipping and the optimizer step, for a
//!   whole model ([`Step::run`]) or this rank's stages of a pipeline ([`Step::run_pipeline`]).
//!
//! A model's forward runs its FSDP units through `fsdp::forward_units` (a stack of layers with
//! the prefetch depth the config sets) or `fsdp::with_gathered_unit`, so each unit gathers with
//! one collective: Burn has no forward hooks to do it behind the model's back.

#![warn(missing_docs)]

mod agree;
mod config;
mod context;
pub mod ddp;
mod error;
mod full;
mod pipeline;
mod run_step;
mod sidecar;
mod step;

use burn_parallel_comm::compile::check_compile;
pub use burn_parallel_describe::{
    CheckpointScope, DefaultParallelizer, HeadCount, ModelDescription, NamedPlan, Parallelize,
    UnitMap, describe_unit_vec, map_unit_option, map_unit_vec,
};
pub use burn_parallel_fsdp::RowSource;
/// The pipeline schedules and layer splits, for callers without a burn-parallel-pp dependency.
pub use burn_parallel_pp::{ScheduleKind, StageSplit};
/// The one name table of a config enum (`Display`, `FromStr`, serde and the error listing the
/// accepted names), for crates that declare their own.
pub use burn_parallel_styles::named_enum;
pub use config::{
    Checkpointing, ConfigError, DataParallel, DistributedConfig, Dtype, FrozenModuleSharding,
    MegatronFsdpConfig, MeshNames, MeshSizes, MixedPrecisionConfig, OffloadConfig, Plan, Strategy,
    TpShardPlan, Unsupported, ZeroDpStrategy, style_by_name,
};
pub use context::{DP, ExpertGroups, LocalRows, MeshContext, PP, PP_BACKWARD, WORLD};
pub use error::ParallelError;
pub use full::{full_model, full_state_dict};
pub use pipeline::{PipelineReport, pipeline_eval_loss};
pub use run_step::Step;
pub use sidecar::{ModelParallelizer, fsdp_config};
pub use step::{
    Accumulated, OptimizerStep, StepReport, StepUpdate, global_grad_norm, sync_gradients,
};

/// A model whose sidecar implements the parallelizer's hooks: every `#[parallelize]` model
/// with the default sidecar, or with `sidecar = T` where `T: ModelParallelizer`.
pub trait ParallelizableModel: Parallelize<Sidecar: ModelParallelizer> {}

impl<M: Parallelize<Sidecar: ModelParallelizer>> ParallelizableModel for M {}

/// The model's own sidecar, or the default one.
pub fn get_model_parallelizer<M: ParallelizableModel>(_model: &M) -> M::Sidecar {
    M::Sidecar::default()
}

/// Applies every parallelism the context asks for through the model's sidecar. Collective:
/// every rank calls it with the same (replicated) model; except under DDP (which broadcasts
/// rank 0's weights), a rank whose weights differ from rank 0's is an error naming the first
/// differing parameter.
pub fn parallelize_model<M: ParallelizableModel>(
    model: M,
    ctx: &MeshContext,
) -> Result<M, ParallelError> {
    // First: the replica check already runs kernels, and an eager process must be chosen
    // before Burn's fusion starts.
    check_compile(ctx.plan().compile(), ctx.device())?;
    if !ctx.uses_ddp() {
        agree::check_replicas_agree(&model, ctx)?;
    }
    let model = get_model_parallelizer(&model).parallelize(model, ctx)?;
    // A pipeline stage may be wholly frozen: the gradient still flows through it to the
    // stages before it.
    if ctx.sizes().pp == 1 {
        check_something_trains(&model)?;
    }
    Ok(model)
}

/// A model (once its sidecar's `reapply_trainability` ran) whose parameters on an autodiff
/// device are all frozen is refused here, rather than by Burn inside the first backward.
/// Trainability is the same on every rank, so every rank refuses alike.
fn check_something_trains<M: burn::module::Module>(model: &M) -> Result<(), ParallelError> {
    let counts = burn_parallel_fsdp::trainability(model);
    match counts.wholly_frozen() {
        true => Err(ParallelError::NothingToTrain {
            frozen: counts.frozen,
        }),
        false => Ok(()),
    }
}

/// [`parallelize_model`] for a model whose parameters are lazy (uninitialized, as a model
/// built to be loaded has them): every FSDP-sharded parameter that is still lazy gets this
/// rank's rows from `source` (Burn's module path, id, full shape and row range of the
/// parameter), so no rank materializes the full model. The same dispatch and the same sidecar
/// hooks as [`parallelize_model`] (it is `parallelize_model` with
/// [`MeshContext::reading_rows`]), so a sidecar's `apply_fsdp_sharding` and
/// `fully_shard_module` apply however the weights arrive. Tensor parallelism, when asked, runs
/// first and materializes one full parameter at a time before slicing it; DDP replicates, so
/// every rank materializes everything. Build the lazy model on [`MeshContext::device`].
pub fn parallelize_model_from<M: ParallelizableModel, E: std::fmt::Display>(
    model: M,
    ctx: &MeshContext,
    source: impl FnMut(&burn_parallel_fsdp::RowRequest) -> Result<burn::tensor::TensorData, E>
    + Send
    + 'static,
) -> Result<M, ParallelError> {
    let rows = burn_parallel_fsdp::RowSource::new(source);
    parallelize_model(model, &ctx.reading_rows(rows))
}

/// NeMo's `compile_parallelized_model`: the model, run with Burn's kernel fusion on a CubeCL
/// device (wgpu, cuda) of a build with the `fusion` feature. Burn fuses lazily as operations
/// queue up, so nothing in the model changes: this checks that the build, the device and the
/// process run fused ([`burn_parallel_comm::compile`]) and settles the process fused. With
/// `enable_compile` off it returns the model as it is. An error names what is missing (the
/// feature; a flex, ndarray or tch device; a process already chosen eager).
pub fn compile_parallelized_model<M: ParallelizableModel>(
    model: M,
    ctx: &MeshContext,
) -> Result<M, ParallelError> {
    if ctx.plan().compile() {
        check_compile(true, ctx.device())?;
    }
    Ok(model)
}
