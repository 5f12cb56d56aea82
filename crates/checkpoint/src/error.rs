//! Errors of saving and loading checkpoints: each names the file, the tensor or the rank.

use std::path::{Path, PathBuf};

use burn_parallel_comm::CollectiveError;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The metadata file cannot be read as a checkpoint of this format and version.
    #[error("{}: {reason}", path.display())]
    Format { path: PathBuf, reason: String },

    #[error("checkpoint file {} is missing (it holds {tensor})", file.display())]
    MissingFile { file: PathBuf, tensor: String },

    /// A file whose size, header or checksum disagrees with the metadata.
    #[error("checkpoint file {} is corrupted: {reason}", file.display())]
    Corrupted { file: PathBuf, reason: String },

    /// The checkpoint holds another model: the first parameter that differs.
    #[error("the checkpoint does not match the model: parameter `{param}` {reason}")]
    ModelMismatch { param: String, reason: String },

    #[error("optimizer state: {0}")]
    Optimizer(String),

    /// Where a parameter's shard lies in the full tensor could not be worked out.
    #[error("cannot place the shard of `{param}`: {reason}")]
    Placement { param: String, reason: String },

    #[error("checkpoint collective failed: {0}")]
    Collective(#[from] CollectiveError),

    /// Another rank failed; every rank returns an error so none goes on alone.
    #[error("rank {rank} failed: {message}")]
    OtherRank { rank: usize, message: String },

    /// The save's test hook stopped this rank after its first file (see `SaveOptions`).
    #[error("rank {rank} stopped after writing {} (test hook)", file.display())]
    InjectedFailure { rank: usize, file: PathBuf },
}

impl CheckpointError {
    pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
        move |source| CheckpointError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn corrupted(file: &Path, reason: impl Into<String>) -> Self {
        CheckpointError::Corrupted {
            file: file.to_path_buf(),
            reason: reason.into(),
        }
    }
}
