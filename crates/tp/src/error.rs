//! Errors of tensor parallelism: each names the module path, the sizes or the head counts.

use burn_parallel_comm::CollectiveError;

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error("tensor-parallel collective failed in `{path}`: {source}")]
    Collective {
        path: String,
        // Boxed: CollectiveError is large and TpError travels in every Result.
        #[source]
        source: Box<CollectiveError>,
    },

    /// A collective outside a module (e.g. making the tp group), via `?`.
    #[error("tensor-parallel setup: {0}")]
    Setup(#[source] Box<CollectiveError>),

    #[error("style {style} cannot be applied to `{path}` ({module}): {reason}")]
    UnsupportedStyle {
        path: String,
        module: &'static str,
        style: String,
        reason: String,
    },

    #[error(
        "`{path}`: {what} of size {size} split over tp = {tp} leaves rank {rank} an empty shard"
    )]
    EmptyShard {
        path: String,
        what: &'static str,
        size: usize,
        tp: usize,
        rank: usize,
    },

    #[error(
        "`{path}`: gradients are reduced in {dtype}, which device {device} cannot compute in \
         (ndarray has no bf16/f16: use flex, or reduce in f32)"
    )]
    UnsupportedReduceDtype {
        path: String,
        dtype: String,
        device: String,
    },

    #[error(
        "`{path}` (style {style}) ran on an input prepared by `{prepared_by}` (style \
         {prepared_style}): layers sharing a prepared input need the same input collective; \
         give them the same style, or prepare the input for each"
    )]
    MismatchedSiblings {
        path: String,
        style: String,
        prepared_by: String,
        prepared_style: String,
    },

    #[error("`{path}` is already sharded with style {style}; a module is parallelized once")]
    AlreadySharded { path: String, style: String },

    #[error(
        "attention heads must be divisible by the tp size: num_heads = {heads}, \
         num_kv_heads = {kv_heads}, tp = {tp} ({which} not divisible)"
    )]
    HeadsNotDivisible {
        heads: usize,
        kv_heads: usize,
        tp: usize,
        which: &'static str,
    },

    #[error("loss_parallel: {0}")]
    Loss(String),

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
