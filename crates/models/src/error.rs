//! Errors of configs, checkpoints and data files, each naming the file or value at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid Llama config.json: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error(
        "{what} is not a Llama model ({found}); only LlamaForCausalLM checkpoints are supported"
    )]
    NotLlama { what: &'static str, found: String },
    #[error("unsupported Llama config: {0}")]
    Unsupported(String),
    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: PathBuf, reason: String },
    #[error("checkpoint has no tensor `{name}` (looked in {dir})")]
    MissingTensor { name: String, dir: PathBuf },
    #[error("tensor `{name}` has shape {found:?}, the config needs {expected:?}")]
    ShapeMismatch {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("token data {path}: {reason}")]
    Data { path: PathBuf, reason: String },
    #[error(transparent)]
    Tp(#[from] burn_parallel_tp::TpError),
    #[error(transparent)]
    Fsdp(#[from] burn_parallel_fsdp::FsdpError),
    #[error(transparent)]
    Plan(#[from] burn_parallel_describe::DescribeError),
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
