//! The plain option types a [`TrainConfig`](crate::TrainConfig) holds (what a non-finite step
//! does, the learning-rate schedule's kind, the LoRA settings, the pipeline schedule), without
//! the code that acts on them, so the config depends on nothing that depends on it.

use std::path::PathBuf;

use burn_parallel_parallelizer::{ScheduleKind, named_enum};

named_enum! {
    /// What a step whose loss or gradient norm is not finite does (`--on-nonfinite`).
    #[derive(Default)]
    pub enum OnNonFinite as "non-finite action" {
        /// End the run with an error naming the step and the value.
        #[default]
        Stop = "stop",
        /// Drop the step's update (weights and optimizer state stay as they were) on every
        /// rank alike; the step still counts and its data is consumed.
        Skip = "skip",
    }
}

named_enum! {
    /// The learning-rate schedule after warmup (`--lr-schedule`).
    #[derive(Default)]
    pub enum LrScheduleKind as "learning-rate schedule" {
        /// The peak learning rate throughout.
        #[default]
        Constant = "constant",
        /// Linear decay from the peak to `--min-lr` at `--steps`.
        Linear = "linear",
        /// Half-cosine decay from the peak to `--min-lr` at `--steps`.
        Cosine = "cosine",
    }
}

named_enum! {
    /// How a LoRA run stores its frozen base (`--lora-quantize`).
    pub enum LoraQuantize as "LoRA base quantization" {
        /// QLoRA: bitsandbytes' 4-bit NormalFloat, blocks of 64, an f32 absmax per block,
        /// computed in f32.
        Nf4 = "nf4",
    }
}

/// The Llama's seven projections, `--lora-targets`' default.
pub const DEFAULT_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// `--lora-targets`' default on a model whose checkpoint fuses q/k/v and gate/up (Phi-3):
/// every decoder linear, as [`DEFAULT_TARGETS`] on the Llama, by the modules peft sees.
pub const FUSED_DEFAULT_TARGETS: [&str; 4] = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"];

/// A run's LoRA settings ([`TrainConfig::lora`](crate::TrainConfig::lora)); the default (no
/// rank, no initial adapter) trains every parameter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraOptions {
    /// `--lora-rank`: adapters of this rank on `targets`, the base frozen.
    pub rank: Option<usize>,
    /// `--lora-alpha`: the scale numerator (default: the rank, a scale of 1).
    pub alpha: Option<f64>,
    /// `--lora-targets`: Hugging Face module names or dotted path suffixes (default
    /// [`DEFAULT_TARGETS`]; [`FUSED_DEFAULT_TARGETS`] on Phi-3).
    pub targets: Option<Vec<String>>,
    /// `--lora-rslora`: scale by `alpha / sqrt(r)`.
    pub rslora: bool,
    /// `--lora-init`: a peft adapter directory to start from; its `adapter_config.json` gives
    /// the rank, alpha, targets and scaling.
    pub init: Option<PathBuf>,
    /// `--save-adapter`: where rank 0 writes the trained adapter in peft's format.
    pub save_adapter: Option<PathBuf>,
    /// `--lora-quantize`: store every decoder linear's base in 4 bits (QLoRA); `None` keeps
    /// the checkpoint's precision.
    pub quantize: Option<LoraQuantize>,
}

/// The pipeline schedule of a `--pp` run, each `None` when not given.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PipelineOptions {
    /// `--pp-schedule` (default 1f1b).
    pub schedule: Option<ScheduleKind>,
    /// `--microbatches` each pipeline rank splits its rows into (default: the pp size).
    pub microbatches: Option<usize>,
    /// `--stages-per-rank` (default 2 under interleaved, else 1).
    pub stages_per_rank: Option<usize>,
}
