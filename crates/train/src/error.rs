use std::fmt;

use burn_parallel_models::ModelError;

/// A command-line flag the run cannot use (most are found before any rank starts): which flag,
/// so that a program can tell which one to change, and why.
///
/// It prints as the flag, a space and the reason (`--seq-len 4096 is longer than ...`); a
/// reason that opens with punctuation (`: ...`, `, --microbatches ...`) follows the flag
/// directly, so that a message naming a group of flags reads as one sentence.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct FlagError {
    /// The flag as typed on the command line (`--seq-len`), or the first of several the
    /// message names together; a slash-joined group (`--param-dtype/--reduce-dtype`) is one.
    pub flag: &'static str,
    /// What is wrong with it and what to give instead: the message after the flag.
    pub reason: String,
}

impl FlagError {
    /// The error of `flag` for `reason` (the message after the flag).
    pub fn new(flag: &'static str, reason: impl Into<String>) -> Self {
        Self {
            flag,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Groups of flags are written as one phrase ("--a, --b and --c need ..."), so their
        // punctuation must not be pushed away from the first flag by a space.
        let sep = match self.reason.starts_with([':', ',']) {
            true => "",
            false => " ",
        };
        write!(f, "{}{sep}{}", self.flag, self.reason)
    }
}

/// `Err`'s value for a run whose `flag` cannot be used, for `reason` (see [`FlagError`]).
pub(crate) fn flag_error(flag: &'static str, reason: impl Into<String>) -> TrainError {
    TrainError::Flag(FlagError::new(flag, reason))
}

/// Why a training run could not start or failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag is invalid, or needs another flag or a feature this build lacks;
    /// [`FlagError::flag`] names it.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// A setting is invalid where no flag is to blame (an environment variable, the model
    /// against the layout, a file the run writes), or a library refused it: the message says
    /// which.
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
    /// A rank failed or panicked; the launcher's error, as text. `--max-restarts` restarts
    /// the run from its newest checkpoint on this error.
    #[error("training failed: {0}")]
    Ranks(String),
    /// Every rank failed alike (the same error, no panic: a guard all ranks decide on the same
    /// values, such as a non-finite loss): the run's own failure, which a restart would repeat.
    #[error("training failed: {0}")]
    AllRanks(String),
}
