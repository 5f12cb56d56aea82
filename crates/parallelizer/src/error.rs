use burn_parallel_comm::{CollectiveError, MeshError};
use burn_parallel_fsdp::FsdpError;
use burn_parallel_tp::TpError;

use crate::config::error::{ConfigError, Unsupported};

/// Why a model could not be parallelized or trained.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// The configuration contradicts itself or the world; raised before any communication.
    #[error("invalid distributed config: {0}")]
    Config(#[from] ConfigError),
    /// A strategy or option that exists in the reference systems but not here yet.
    #[error("{0} is not yet supported")]
    NotSupported(#[from] Unsupported),
    /// Applying tensor parallelism failed.
    #[error("tensor parallel: {0}")]
    Tp(#[from] TpError),
    /// Fully sharding a unit failed.
    #[error("fsdp: {0}")]
    Fsdp(#[from] FsdpError),
    /// The device mesh could not be built.
    #[error("expert parallel: {0}")]
    Ep(#[from] burn_parallel_ep::EpError),
    /// A mesh could not be built.
    #[error("mesh: {0}")]
    Mesh(#[from] MeshError),
    /// A pipeline stage could not be built or run its schedule.
    #[error("pipeline parallel: {0}")]
    Pipeline(#[from] burn_parallel_pp::PipelineError),
    /// `enable_compile` does not fit the build, the device or the process's kernel fusion.
    #[error("{0}")]
    Compile(#[from] burn_parallel_comm::compile::CompileError),
    /// A collective (a DDP all-reduce, the replica check, ...) failed.
    #[error("collective: {0}")]
    Collective(#[from] CollectiveError),
    /// A rank built different initial weights than rank 0.
    #[error(
        "rank {rank} holds different initial weights than rank 0 (first differing parameter \
         `{param}`): build the model on every rank from the same seeds or checkpoint (Burn's \
         random initializers are not reproducible across rank threads)"
    )]
    ReplicasDiffer {
        /// The rank whose weights differ.
        rank: usize,
        /// Path of the first parameter that differs.
        param: String,
    },
    /// Every parameter of the model is frozen: backward would have nothing to compute.
    #[error(
        "the model has no trainable parameter: all {frozen} of its parameters have require_grad \
         false, so training it would compute no gradient (Burn's backward refuses an untracked \
         loss); unfreeze at least one (Param::set_require_grad(true), or a sidecar's \
         reapply_trainability), build the model on MeshContext::device() (parameters made on a \
         device without autodiff arrive frozen), or run it for inference without \
         parallelize_model"
    )]
    NothingToTrain {
        /// How many parameters are frozen.
        frozen: usize,
    },
    /// A config file that could not be read or parsed.
    #[error("config file {path}: {message}")]
    ConfigFile {
        /// The file.
        path: String,
        /// Why it could not be read, parsed or written.
        message: String,
    },
}
