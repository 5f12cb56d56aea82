//! What a training run is: strategy and sizes, optimizer, precision, model and data.

use std::path::PathBuf;

use burn::tensor::Device;
use burn_parallel_comm::EngineKind;
use burn_parallel_describe::plan_name;
use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::{Strategy, ZeroDpStrategy};

use crate::error::TrainError;

macro_rules! named_enum {
    ($(#[$m:meta])* $name:ident {
        $($(#[$vm:meta])* $variant:ident = $text:literal),+ $(,)?
    }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name { $($(#[$vm])* $variant),+ }

        impl $name {
            /// The names the command line and `Display` use, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(match self { $($name::$variant => $text),+ })
            }
        }

        impl std::str::FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(format!(
                        "unknown {} `{s}` (expected one of: {})",
                        stringify!($name).to_lowercase(),
                        Self::NAMES.join(", ")
                    )),
                }
            }
        }
    };
}
pub(crate) use named_enum;

named_enum!(
    /// The backend each rank computes on: a CPU backend, or one GPU per rank (`cuda`: Burn's
    /// CUDA backend, build with `--features cuda`; `tch`: LibTorch on CUDA, `--features tch`).
    Backend {
        /// Burn's ndarray CPU backend (no bf16).
        Ndarray = "ndarray",
        /// Burn's flex CPU backend (with bf16).
        Flex = "flex",
        /// Burn's CUDA backend, one GPU per rank.
        Cuda = "cuda",
        /// LibTorch on CUDA, one GPU per rank.
        Tch = "tch",
    }
);

named_enum!(
    /// The optimizer a run steps with.
    OptimizerKind {
        /// Plain SGD: `p -= lr * g`.
        Sgd = "sgd",
        /// PyTorch's AdamW.
        AdamW = "adamw",
    }
);

named_enum!(
    /// A dtype of the mixed-precision policy.
    Precision {
        /// f32: no cast.
        F32 = "f32",
        /// bfloat16.
        Bf16 = "bf16",
    }
);

impl Backend {
    /// The autodiff device of a rank whose GPU (for `cuda` and `tch`) is `gpu`, or an error
    /// naming the cargo feature this build lacks.
    #[allow(deprecated)] // burn-ndarray and burn-tch are deprecated in Burn 0.22, not removed
    pub fn device(self, gpu: usize) -> Result<Device, TrainError> {
        #[cfg(any(feature = "cuda", feature = "tch"))]
        if matches!(self, Backend::Cuda | Backend::Tch) {
            burn_parallel_comm::nccl::check_gpu(gpu)
                .map_err(|e| TrainError::Config(format!("--backend {self}: {e}")))?;
        }
        let _ = gpu;
        let base = match self {
            Backend::Ndarray => Device::ndarray(),
            Backend::Flex => Device::flex(),
            #[cfg(feature = "cuda")]
            Backend::Cuda => Device::cuda(gpu),
            #[cfg(feature = "tch")]
            Backend::Tch => Device::libtorch_cuda(gpu),
            #[allow(unreachable_patterns)]
            other => {
                return Err(TrainError::Config(format!(
                    "--backend {other} is not in this build: build with `--features {other}`"
                )));
            }
        };
        Ok(base.autodiff())
    }

    /// Whether this build has the backend (see [`Backend::device`]).
    pub fn available(self) -> bool {
        match self {
            Backend::Ndarray | Backend::Flex => true,
            Backend::Cuda => cfg!(feature = "cuda"),
            Backend::Tch => cfg!(feature = "tch"),
        }
    }
}

/// A training run. [`TrainConfig::default`] is the README's first command: FSDP2 on 4 rank
/// threads, the built-in tiny Llama and synthetic corpus.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// How the model and the batch are spread over the ranks (default `fsdp2`).
    pub strategy: Strategy,
    /// Ranks to run (default 4).
    pub world_size: usize,
    /// Tensor-parallel size (tp and fsdp2_tp; `None`: the whole world for tp, 2 for fsdp2_tp).
    pub tp: Option<usize>,
    /// Replicas under hsdp (`None`: 2) and megatron_fsdp (`None`: 1).
    pub dp_replicate: Option<usize>,
    /// What megatron_fsdp shards (`None`: ZeRO-3, `optim_grads_params`).
    pub zero_dp_strategy: Option<ZeroDpStrategy>,
    /// Elements megatron_fsdp gathers in one collective for consecutive decoder layers
    /// (`None`: one collective per layer).
    pub bucket_size: Option<usize>,
    /// Expert-parallel size for a MoE model under ddp, fsdp2, hsdp, fsdp2_tp and megatron_fsdp
    /// (`None`: 1): its experts are split over `ep` consecutive data-parallel ranks.
    pub ep: Option<usize>,
    /// The tp plan: `llama` or `llama-sp` (sequence parallel; default `llama`).
    pub tp_plan: String,
    /// Total optimizer steps (default 40).
    pub steps: usize,
    /// Sequences per step over all data-parallel ranks (default 8).
    pub global_batch: usize,
    /// Tokens per sequence (default 64).
    pub seq_len: usize,
    /// The optimizer (default `adamw`).
    pub optimizer: OptimizerKind,
    /// Learning rate (default 3e-3).
    pub lr: f32,
    /// AdamW's decoupled weight decay (default 0).
    pub weight_decay: f32,
    /// AdamW's first-moment decay (default 0.9).
    pub beta1: f32,
    /// AdamW's second-moment decay (default 0.999).
    pub beta2: f32,
    /// AdamW's epsilon (default 1e-8).
    pub eps: f32,
    /// Clip the global gradient norm to this (None: no clipping; default 1.0).
    pub grad_clip: Option<f32>,
    /// The dtype weights are gathered and computed in (default `f32`).
    pub param_dtype: Precision,
    /// The dtype gradients are reduced in (default `f32`).
    pub reduce_dtype: Precision,
    /// Free gathered weights after forward and gather again in backward; runs on Burn's
    /// gradient-checkpointing device (default `true`).
    pub reshard_after_forward: bool,
    /// Start each layer's all-gather while the previous layer computes (default `true`).
    pub prefetch: bool,
    /// The backend each rank computes on (default `flex`).
    pub backend: Backend,
    /// A Hugging Face checkpoint directory (None, the default: `model` with a seeded init).
    pub checkpoint: Option<PathBuf>,
    /// The model when no checkpoint is given (default `LlamaConfig::tiny()`).
    pub model: LlamaConfig,
    /// Seed of the model's initial weights (default 0).
    pub seed: u64,
    /// A u16 token file (None, the default: the synthetic corpus).
    pub data: Option<PathBuf>,
    /// Where to save the trained model in the Hugging Face format (default None: not saved).
    pub save: Option<PathBuf>,
    /// Save a sharded training checkpoint every this many steps (and after the last step) into
    /// `save_dir/step-N` (default None: no checkpoints).
    pub save_every: Option<usize>,
    /// Where `save_every` saves checkpoints (default None).
    pub save_dir: Option<PathBuf>,
    /// Resume from this checkpoint (or a save directory's newest one): weights, optimizer
    /// state, step and data position, in any layout. `steps` stays the total step count
    /// (default None: a fresh run).
    pub resume: Option<PathBuf>,
    /// Ranks as threads of this process, or as the processes of an MPI job (default threads).
    pub engine: EngineKind,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            strategy: Strategy::Fsdp2,
            world_size: 4,
            tp: None,
            dp_replicate: None,
            ep: None,
            zero_dp_strategy: None,
            bucket_size: None,
            tp_plan: "llama".into(),
            steps: 40,
            global_batch: 8,
            seq_len: 64,
            optimizer: OptimizerKind::AdamW,
            lr: 3e-3,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            grad_clip: Some(1.0),
            param_dtype: Precision::F32,
            reduce_dtype: Precision::F32,
            reshard_after_forward: true,
            prefetch: true,
            backend: Backend::Flex,
            checkpoint: None,
            model: LlamaConfig::tiny(),
            seed: 0,
            data: None,
            save: None,
            save_every: None,
            save_dir: None,
            resume: None,
            engine: EngineKind::Threads,
        }
    }
}

impl TrainConfig {
    /// Whether `tp_plan` names the sequence-parallel variant (`llama-sp`).
    pub fn sequence_parallel(&self) -> bool {
        plan_name(&self.tp_plan).1
    }

    pub(crate) fn check(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Config(m));
        let (plan, _) = plan_name(&self.tp_plan);
        if plan != burn_parallel_models::LLAMA_PLAN.name {
            return bad(format!(
                "unknown tp plan `{}` (llama or llama-sp)",
                self.tp_plan
            ));
        }
        if self.steps == 0 {
            return bad("--steps must be at least 1".into());
        }
        if self.global_batch == 0 || self.seq_len == 0 {
            return bad("--global-batch and --seq-len must be at least 1".into());
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("--lr {} must be a non-negative number", self.lr));
        }
        match (self.save_every, &self.save_dir) {
            (Some(0), _) => return bad("--save-every must be at least 1".into()),
            (Some(_), None) => return bad("--save-every needs --save-dir".into()),
            (None, Some(_)) => return bad("--save-dir needs --save-every".into()),
            _ => {}
        }
        let bf16 = self.param_dtype == Precision::Bf16 || self.reduce_dtype == Precision::Bf16;
        if bf16 && self.backend == Backend::Ndarray {
            return bad("bf16 needs --backend flex (ndarray has no bf16)".into());
        }
        if !self.backend.available() {
            self.backend.device(0)?;
        }
        if !self.engine.available() {
            return bad(format!(
                "--engine {} is not in this build: build with `--features {}`",
                self.engine, self.engine
            ));
        }
        Ok(())
    }
}
