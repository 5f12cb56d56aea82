//! burn-parallel: model parallelism for Burn. The facade re-exports the workspace crates:
//! [`dist`] (mesh, groups, engines, differentiable collectives), [`fsdp`] (fully sharded data
//! parallelism) and [`tp`] (tensor and sequence parallelism).

pub use burn_parallel_dist as dist;
pub use burn_parallel_fsdp as fsdp;
pub use burn_parallel_models as models;
pub use burn_parallel_tp as tp;
pub use burn_parallel_train as train;
