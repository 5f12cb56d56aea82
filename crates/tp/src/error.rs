//! Errors of tensor parallelism: each names the module path, the sizes or the head counts.

use burn_parallel_comm::CollectiveError;

/// Errors of tensor parallelism: sharding, running and unsharding `Tp` modules.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// A collective of the tp group failed inside the module at `path`.
    #[error("tensor-parallel collective failed in `{path}`: {source}")]
    Collective {
        /// Module path of the failing layer.
        path: String,
        /// The failed collective.
        // Boxed: CollectiveError is large and TpError travels in every Result.
        #[source]
        source: Box<CollectiveError>,
    },

    /// A collective outside a module (e.g. making the tp group), via `?`.
    #[error("tensor-parallel setup: {0}")]
    Setup(#[source] Box<CollectiveError>),

    /// The module kind cannot be sharded (or unsharded) with the requested style.
    #[error("style {style} cannot be applied to `{path}` ({module}): {reason}")]
    UnsupportedStyle {
        /// Module path.
        path: String,
        /// Module kind, [`TpLayer::KIND`](crate::TpLayer::KIND) ("Linear", ...).
        module: &'static str,
        /// The rejected style.
        style: String,
        /// Why it does not apply.
        reason: String,
    },

    /// A dim is smaller than the tp size, so a rank's chunk is empty (Burn rejects empty dims).
    #[error(
        "`{path}`: {what} of size {size} split over tp = {tp} leaves rank {rank} an empty shard"
    )]
    EmptyShard {
        /// Module path.
        path: String,
        /// Which dim is split ("d_output", "vocab", ...).
        what: &'static str,
        /// Size of the dim before sharding.
        size: usize,
        /// Size of the tp group.
        tp: usize,
        /// The rank left without a shard.
        rank: usize,
    },

    /// The gradient reduce dtype is one the module's device cannot compute in.
    #[error(
        "`{path}`: gradients are reduced in {dtype}, which device {device} cannot compute in \
         (ndarray has no bf16/f16: use flex, or reduce in f32)"
    )]
    UnsupportedReduceDtype {
        /// Module path.
        path: String,
        /// The requested reduce dtype.
        dtype: String,
        /// The device that lacks it.
        device: String,
    },

    /// A layer reused an input prepared by a sibling whose style needs another input collective.
    #[error(
        "`{path}` (style {style}) ran on an input prepared by `{prepared_by}` (style \
         {prepared_style}): layers sharing a prepared input need the same input collective; \
         give them the same style, or prepare the input for each"
    )]
    MismatchedSiblings {
        /// Path of the layer that ran.
        path: String,
        /// Its style.
        style: String,
        /// Path of the layer that prepared the input.
        prepared_by: String,
        /// That layer's style.
        prepared_style: String,
    },

    /// A `Tp` module was sharded a second time.
    #[error("`{path}` is already sharded with style {style}; a module is parallelized once")]
    AlreadySharded {
        /// Module path.
        path: String,
        /// The style it is already sharded with.
        style: String,
    },

    /// The query or key/value head count does not divide the tp size (or tp is 0).
    #[error(
        "attention heads must be divisible by the tp size: num_heads = {heads}, \
         num_kv_heads = {kv_heads}, tp = {tp} ({which} not divisible)"
    )]
    HeadsNotDivisible {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        kv_heads: usize,
        /// Size of the tp group.
        tp: usize,
        /// Which count is not divisible ("num_heads", "num_kv_heads" or both).
        which: &'static str,
    },

    /// `loss_parallel` got logits and targets whose shapes or devices do not match.
    #[error("loss_parallel: {0}")]
    Loss(String),

    /// Entries of a tp plan matched no `Tp` module of the model (listed, comma-separated).
    #[error("tp plan entries matched no Tp module: {0}")]
    UnmatchedEntries(String),
}

impl TpError {
    pub(crate) fn collective(path: &str) -> impl FnOnce(CollectiveError) -> TpError + '_ {
        move |source| TpError::Collective {
            path: path.to_string(),
            source: Box::new(source),
        }
    }
}

impl From<CollectiveError> for TpError {
    fn from(e: CollectiveError) -> Self {
        TpError::Setup(Box::new(e))
    }
}
