//! What can stop a parallel Learner run, each saying what to do.

use burn_parallel_checkpoint::CheckpointError;
use burn_parallel_comm::{CollectiveError, LaunchError};
use burn_parallel_parallelizer::ParallelError;

/// An error of [`ParallelStrategy`](crate::ParallelStrategy). The Learner reports it as its
/// `LearningResult::error` (burn-train's `TrainingError::Workers`, naming the rank).
#[derive(Debug, thiserror::Error)]
pub enum LearnerError {
    /// Building the mesh, parallelizing the model, or a step's collectives failed.
    #[error(transparent)]
    Parallel(#[from] ParallelError),
    /// A collective of the strategy itself (metrics, agreement) failed.
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// Launching the ranks failed, or some rank failed.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// Saving, deleting or loading a sharded checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// A batch whose rows do not split evenly over the data-parallel ranks.
    #[error(
        "a batch of {batch} items does not split evenly over {dp} data-parallel ranks: burn-train's \
         TrainStep returns the gradients of each rank's mean loss, which only average to the \
         global batch's when every rank holds as many rows; use a batch size and a dataset size \
         that are multiples of {dp}"
    )]
    UnevenBatch {
        /// The batch's rows.
        batch: usize,
        /// The data-parallel size.
        dp: usize,
    },
    /// Something the Learner was configured with that the strategy cannot honour.
    #[error("{0}")]
    Unsupported(String),
    /// A checkpoint directory could not be read or removed.
    #[error("checkpoint directory {path}: {source}")]
    Io {
        /// The directory.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
