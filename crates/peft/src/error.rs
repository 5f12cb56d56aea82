//! What can go wrong attaching, sharding or merging LoRA adapters.

use burn_parallel_tp::TpError;

/// An error of the LoRA decorator; each names the module path and what to do.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// The config cannot build an adapter (a rank of 0, no targets, a bad alpha).
    #[error("invalid LoRA config: {0}")]
    InvalidConfig(String),
    /// Targets that matched no `Lora` module of the model (peft refuses these too).
    #[error(
        "LoRA targets {targets} matched no Lora module of the model (its Lora modules: \
         {available}); a target is a module name or a dotted suffix of its path, e.g. `q_proj` \
         or `self_attn.q_proj`, and the field must be typed `Lora<..>` or `Tp<Lora<..>>`"
    )]
    UnmatchedTargets {
        /// The targets that matched nothing, comma separated.
        targets: String,
        /// The paths of the model's `Lora` modules, comma separated.
        available: String,
    },
    /// An adapter attached twice.
    #[error("`{path}` already has a LoRA adapter; merge it first (merge_lora) to attach a new one")]
    AlreadyAdapted {
        /// Module path.
        path: String,
    },
    /// An adapter attached to or merged into a layer that tensor parallelism already split.
    #[error(
        "`{path}` is already split by tensor parallelism ({style}); {what} on the whole model: \
         attach adapters before parallelize_model, merge after full_model"
    )]
    Sharded {
        /// Module path.
        path: String,
        /// The layer's style.
        style: String,
        /// What was asked ("attach LoRA adapters", "merge LoRA adapters").
        what: &'static str,
    },
    /// A peft adapter directory or file that cannot be read or written.
    #[error("PEFT adapter `{path}`: {reason}")]
    AdapterFile {
        /// The directory or file.
        path: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A tensor-parallel step (sharding, gathering) failed.
    #[error(transparent)]
    Tp(#[from] TpError),
}

impl LoraError {
    /// An [`AdapterFile`](Self::AdapterFile) error about `path`.
    pub(crate) fn file(path: &std::path::Path, reason: impl Into<String>) -> Self {
        Self::AdapterFile {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }
}
