//! What sharding a module can fail with.

/// Errors of `fully_shard`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FsdpError {
    /// A mixed-precision dtype of the policy is one the device cannot compute in.
    #[error("mixed-precision {role} {dtype} is not supported on device {device}")]
    UnsupportedDtype {
        /// Which policy setting ("param_dtype" or "reduce_dtype").
        role: &'static str,
        /// The requested dtype.
        dtype: String,
        /// The device that lacks it.
        device: String,
    },
    /// The parameters gathered as one unit are sharded over different groups.
    #[error("a unit mixes parameters sharded over group {first} and group {other}")]
    MixedGroups {
        /// Label of the unit's first group.
        first: String,
        /// Label of a group that differs from it.
        other: String,
    },
    /// A sharded load's source failed, or returned rows of the wrong shape or a non-float dtype.
    #[error("loading {path}: {message}")]
    Load {
        /// Path of the parameter being loaded.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A collective (gather, reduce-scatter, ...) failed.
    #[error(transparent)]
    Collective(#[from] burn_parallel_comm::CollectiveError),
}
