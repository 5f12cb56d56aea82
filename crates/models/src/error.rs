//! Errors of configs, checkpoints and data files, each naming the file or value at fault.

use std::path::PathBuf;

/// Errors of the models crate: configs, Hugging Face checkpoints, token data, and the
/// parallel errors a model's forward or gather returns.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Per-layer activation checkpointing of a mixture-of-experts model: its layers' router
    /// logits (for the load-balancing loss) would come out of the graph.
    #[error(
        "per-layer activation checkpointing of a mixture-of-experts model is not supported (the \
         router logits of a recomputed layer leave the graph); use activation_checkpointing_mode \
         = \"selective\" with selective_ac_option = \"op\""
    )]
    CheckpointedExperts,
    /// A file or directory could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file or directory could not be written (saving a model).
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `config.json` is not JSON, misses a required key, or holds inconsistent sizes.
    #[error("{path} is not a valid Llama config.json: {reason}")]
    BadConfig {
        /// The config file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The config's `model_type` or `architectures` names an architecture the decoder does not
    /// load.
    #[error(
        "{what} `{found}` is not an architecture this decoder loads (supported model_type: \
         {supported}); Phi-3 is not yet"
    )]
    UnsupportedArchitecture {
        /// The key (`model_type` or `architectures`).
        what: &'static str,
        /// Its value.
        found: String,
        /// The supported `model_type`s.
        supported: String,
    },
    /// The config asks for something this Llama does not compute (an activation other than
    /// SiLU, an unknown rope type).
    #[error("unsupported Llama config: {0}")]
    Unsupported(String),
    /// A Hugging Face checkpoint cannot be read or written (a bad index or header, an
    /// unsupported dtype, a size that does not add up, ...).
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint lacks a tensor the config needs.
    #[error("checkpoint has no tensor `{name}` (looked in {dir})")]
    MissingTensor {
        /// Hugging Face name of the tensor.
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor's shape is not the one the config gives it.
    #[error("tensor `{name}` has shape {found:?}, the config needs {expected:?}")]
    ShapeMismatch {
        /// Hugging Face name of the tensor.
        name: String,
        /// Its shape in the source.
        found: Vec<usize>,
        /// The shape the config needs.
        expected: Vec<usize>,
    },
    /// A sequence context parallelism cannot split: head-tail load balancing cuts each row in
    /// `2 * cp` equal chunks.
    #[error(
        "a sequence of {seq} tokens does not split over cp {cp}: it must be a multiple of \
         2 * cp = {}; pad the rows to such a length (or choose another seq_len / cp)",
        2 * cp
    )]
    ContextParallelSplit {
        /// The sequence length.
        seq: usize,
        /// The context-parallel size.
        cp: usize,
    },
    /// A token file is unreadable, too short, or holds ids outside the vocabulary.
    #[error("token data {path}: {reason}")]
    Data {
        /// The token file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Tensor parallelism failed (a collective in the forward, a plan).
    #[error(transparent)]
    Tp(#[from] burn_parallel_tp::TpError),
    /// FSDP failed (gathering the full model, a collective).
    #[error(transparent)]
    Fsdp(#[from] burn_parallel_fsdp::FsdpError),
    /// A tp plan name the model does not provide.
    #[error(transparent)]
    Plan(#[from] burn_parallel_describe::DescribeError),
    /// Expert parallelism failed (an ep size that does not divide the experts, an exchange).
    #[error(transparent)]
    Ep(#[from] burn_parallel_ep::EpError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }

    pub(crate) fn write(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Write { path, source }
    }
}
