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
    /// A unit sharded into one flat buffer has parameters of different dtypes.
    #[error(
        "the flat-buffer layout keeps a unit's parameters in one buffer of one dtype, but \
         {path} is {dtype} where the unit's first parameter is {first}: cast the module to one \
         dtype before sharding, or make that parameter its own unit"
    )]
    FlatDtypes {
        /// Path of the parameter whose dtype differs.
        path: String,
        /// Its dtype.
        dtype: String,
        /// The dtype of the unit's first parameter.
        first: String,
    },
    /// A module gathered as one flat-buffer unit does not hold exactly that unit's parameters.
    #[error("{0}")]
    FlatUnit(String),
    /// A collective (gather, reduce-scatter, ...) failed.
    #[error(transparent)]
    Collective(#[from] burn_parallel_comm::CollectiveError),
}
