//! burn-parallel: model parallelism for Burn. The facade re-exports the workspace crates:
//! [`dist`] (mesh, groups, engines, differentiable collectives), [`fsdp`] (fully sharded data
//! parallelism), [`tp`] (tensor and sequence parallelism), [`parallelizer`] (the model-owned
//! parallelizer contract and `parallelize_model`) and the [`parallelize`] attribute macro.

pub use burn_parallel_dist as dist;
pub use burn_parallel_fsdp as fsdp;
pub use burn_parallel_models as models;
pub use burn_parallel_parallelizer as parallelizer;
pub use burn_parallel_tp as tp;
pub use burn_parallel_train as train;

pub use burn_parallel_macros::parallelize;

/// What a model file needs: the attribute, the contract, the entry point and its context.
pub mod prelude {
    pub use burn_parallel_macros::parallelize;
    pub use burn_parallel_parallelizer::{
        DistributedConfig, MeshContext, Parallelize, parallelize_model,
    };
    pub use burn_parallel_tp::Tp;
}
