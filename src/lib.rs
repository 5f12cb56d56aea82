//! burn-parallel: model parallelism for Burn. The facade re-exports the workspace crates:
//! [`comm`] (mesh, groups, engines, differentiable collectives), [`fsdp`] (fully sharded data
//! parallelism), [`tp`] (tensor and sequence parallelism), [`describe`] (the contract a model
//! implements, through the [`parallelize`] attribute macro), [`parallelizer`]
//! (`parallelize_model` and its dispatch), [`peft`] (LoRA adapters as a module decorator),
//! [`checkpoint`] (sharded training checkpoints that resume in any layout), [`pp`] (pipeline
//! parallelism: stages, point-to-point, schedules), [`learner`]
//! (burn-train's Learner under every strategy), [`models`] and [`train`].

#![warn(missing_docs)]

pub use burn_parallel_checkpoint as checkpoint;
pub use burn_parallel_comm as comm;
pub use burn_parallel_describe as describe;
pub use burn_parallel_ep as ep;
pub use burn_parallel_fsdp as fsdp;
pub use burn_parallel_learner as learner;
pub use burn_parallel_models as models;
pub use burn_parallel_parallelizer as parallelizer;
pub use burn_parallel_peft as peft;
pub use burn_parallel_pp as pp;
pub use burn_parallel_tp as tp;
pub use burn_parallel_train as train;

pub use burn_parallel_macros::parallelize;

/// What a model file and its training loop need: the attribute, the decorator and the calls
/// of a model's forward, the config, the context, the launch, the step and the whole model back.
pub mod prelude {
    pub use burn_parallel_comm::run_ranks;
    pub use burn_parallel_fsdp::{forward_units, with_module_unit};
    pub use burn_parallel_macros::parallelize;
    pub use burn_parallel_parallelizer::{
        DistributedConfig, LocalRows, MeshContext, OptimizerStep, Parallelize, Step, Strategy,
        full_model, full_state_dict, parallelize_model,
    };
    pub use burn_parallel_tp::{Tp, forward_shared, loss_parallel};
}
