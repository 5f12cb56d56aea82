//! What can go wrong in a pipeline, each error naming the stage and what disagrees.

use burn_parallel_comm::CollectiveError;

/// Why a pipeline could not be built or could not run a step.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The layers cannot be split over the stages as asked.
    #[error("pipeline split: {0}")]
    Split(String),
    /// The neighbours of a link declared different activation shapes: found by the handshake
    /// before any activation moves, and reported by both stages with the same text.
    #[error(
        "pipeline ranks {sender} and {receiver} disagree on the activation shapes of the \
         microbatches: rank {sender} sends {sent:?}, rank {receiver} expects {expected:?}"
    )]
    ShapeMismatch {
        /// The pipeline rank that sends activations over the link (its stage, with one stage
        /// per rank).
        sender: usize,
        /// The pipeline rank that receives them.
        receiver: usize,
        /// The shapes the sender declares, one per message (per microbatch, chunk by chunk).
        sent: Vec<Vec<usize>>,
        /// The shapes the receiver expects, one per message.
        expected: Vec<Vec<usize>>,
    },
    /// A tensor about to be sent, or just received, does not have the shape its stage declared.
    #[error(
        "pipeline stage {stage}, microbatch {microbatch}: the {what} has shape {found:?}, the \
         declared shape is {declared:?}"
    )]
    UndeclaredShape {
        /// The stage that found it.
        stage: usize,
        /// The microbatch.
        microbatch: usize,
        /// Which tensor: `activation sent`, `gradient received`, ...
        what: &'static str,
        /// The tensor's shape.
        found: Vec<usize>,
        /// The shape the stages agreed.
        declared: Vec<usize>,
    },
    /// A stage's forward returned the wrong kind of output for its place in the pipeline.
    #[error("pipeline stage {stage} of {stages}: {message}")]
    Stage {
        /// The stage.
        stage: usize,
        /// The number of stages.
        stages: usize,
        /// What went wrong.
        message: String,
    },
    /// The schedule cannot run with these settings.
    #[error("pipeline schedule: {0}")]
    Schedule(String),
    /// A point-to-point exchange between stages failed (a peer failed, a timeout, ...).
    #[error("pipeline point-to-point: {0}")]
    Collective(#[from] CollectiveError),
}
