//! What sharding a module can fail with.

/// Errors of `fully_shard`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FsdpError {
    #[error("mixed-precision {role} {dtype} is not supported on device {device}")]
    UnsupportedDtype {
        role: &'static str,
        dtype: String,
        device: String,
    },
    #[error("a unit mixes parameters sharded over group {first} and group {other}")]
    MixedGroups { first: String, other: String },
    #[error("loading {path}: {message}")]
    Load { path: String, message: String },
    #[error(transparent)]
    Collective(#[from] burn_parallel_comm::CollectiveError),
}
