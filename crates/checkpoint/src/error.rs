//! Errors of saving and loading checkpoints: each names the file, the tensor or the rank.

use std::path::{Path, PathBuf};

use burn_parallel_comm::CollectiveError;

/// Errors of saving and loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// Reading, writing, renaming or removing a file or directory failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// The metadata file cannot be read as a checkpoint of this format and version.
    #[error("{}: {reason}", path.display())]
    Format {
        /// The metadata file (or the directory that lacks one).
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A data file the metadata lists is not in the checkpoint directory.
    #[error("checkpoint file {} is missing (it holds {tensor})", file.display())]
    MissingFile {
        /// The missing file.
        file: PathBuf,
        /// The tensors it holds (the first, and how many more).
        tensor: String,
    },

    /// A file whose size, header or checksum disagrees with the metadata.
    #[error("checkpoint file {} is corrupted: {reason}", file.display())]
    Corrupted {
        /// The corrupted file.
        file: PathBuf,
        /// What disagrees.
        reason: String,
    },

    /// The checkpoint holds another model: the first parameter that differs.
    #[error("the checkpoint does not match the model: parameter `{param}` {reason}")]
    ModelMismatch {
        /// Path of the parameter.
        param: String,
        /// How it differs (missing, other shape or dtype, ...).
        reason: String,
    },

    /// The optimizer's state does not match its parameters, or the checkpoint's optimizer state
    /// (absent, another kind or other state fields).
    #[error("optimizer state: {0}")]
    Optimizer(String),

    /// Where a parameter's shard lies in the full tensor could not be worked out.
    #[error("cannot place the shard of `{param}`: {reason}")]
    Placement {
        /// Path of the parameter.
        param: String,
        /// Why it could not be placed.
        reason: String,
    },

    /// A collective exchanging metadata or status between ranks failed.
    #[error("checkpoint collective failed: {0}")]
    Collective(#[from] CollectiveError),

    /// Another job holds the save directory (its lock file names it).
    #[error(
        "save directory {} is in use by another job ({holder}): two jobs saving into one \
         directory overwrite each other's checkpoints. Give this run another --save-dir, or, \
         if that job has ended, remove {}",
        dir.display(),
        lock.display()
    )]
    SaveDirInUse {
        /// The save directory.
        dir: PathBuf,
        /// Who holds it.
        holder: String,
        /// The lock file.
        lock: PathBuf,
    },

    /// Another rank failed; every rank returns an error so none goes on alone.
    #[error("rank {rank} failed: {message}")]
    OtherRank {
        /// The rank that failed.
        rank: usize,
        /// Its error.
        message: String,
    },

    /// The save's test hook stopped this rank after its first file (see `SaveOptions`).
    #[error("rank {rank} stopped after writing {} (test hook)", file.display())]
    InjectedFailure {
        /// The rank stopped.
        rank: usize,
        /// The file it wrote last.
        file: PathBuf,
    },
    /// The whole-model `save` or `load` under pipeline parallelism: a rank holds stages, whose
    /// module paths are not the whole model's; refused on every rank before any file is
    /// touched.
    #[error(
        "under pipeline parallelism (pp_size {pp}) each rank holds pipeline stages, not the whole \
         model: use {instead} with the rank's stage chunks (their type implements \
         StageParamPaths, as LlamaStage does)"
    )]
    PipelineParallel {
        /// `pp_size`.
        pp: usize,
        /// The stage API to call instead (`save_stages`, `Checkpoint::load_stages`, ...).
        instead: &'static str,
    },
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
