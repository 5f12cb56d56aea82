use burn_parallel_models::ModelError;

/// Why a training run could not start or failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag or setting is invalid, or needs a feature this build lacks; raised before any
    /// rank starts.
    #[error("{0}")]
    Config(String),
    /// A data or tokenizer file cannot be used (`--data`, `--eval-data`, `--tokenizer`): the
    /// message names the file, the line or record, the field and what to do.
    #[error("{0}")]
    Data(String),
    /// Loading or saving the model, its checkpoint or the token data failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Tensor parallelism failed (head counts, loss, collectives).
    #[error(transparent)]
    Tp(#[from] burn_parallel_tp::TpError),
    /// FSDP failed (gathering the trained model, collectives).
    #[error(transparent)]
    Fsdp(#[from] burn_parallel_fsdp::FsdpError),
    /// A collective between ranks failed.
    #[error(transparent)]
    Collective(#[from] burn_parallel_comm::CollectiveError),
    /// The device mesh could not be built.
    #[error(transparent)]
    Mesh(#[from] burn_parallel_comm::MeshError),
    /// Parallelizing the model or a training step failed.
    #[error(transparent)]
    Parallel(#[from] burn_parallel_parallelizer::ParallelError),
    /// Saving or resuming a sharded training checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] burn_parallel_checkpoint::CheckpointError),
    /// A step's loss or gradient norm is not finite (training diverged); every rank stops at
    /// the same step, since both values are the ones all ranks agree on.
    #[error("step {step}: the {what} is {value}, not a finite number: training diverged. {hint}")]
    NonFinite {
        /// The step (0-based).
        step: usize,
        /// `loss` or `gradient norm`.
        what: &'static str,
        /// The value.
        value: f32,
        /// What to try.
        hint: String,
    },
    /// A rank failed or panicked; the launcher's error, as text.
    #[error("training failed: {0}")]
    Ranks(String),
}
