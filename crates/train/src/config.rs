//! What a training run is: its `DistributedConfig` (strategy, sizes, precision, resharding),
//! the optimizer, the model and the data.

use std::path::PathBuf;

use burn::tensor::Device;
use burn_parallel_comm::EngineKind;
use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::{DistributedConfig, Strategy, ZeroDpStrategy, named_enum};

use crate::data::DataOptions;
use crate::error::{TrainError, flag_error};
use crate::flags::trainer_defaults;
use crate::options::{LoraOptions, LrScheduleKind, OnNonFinite, PipelineOptions};

named_enum! {
    /// The backend each rank computes on: a CPU backend, one GPU per rank (`cuda`: Burn's
    /// CUDA backend, build with `--features cuda`; `tch`: LibTorch on CUDA, `--features tch`),
    /// or one wgpu device every rank shares (`wgpu`, `--features wgpu`).
    pub enum Backend as "backend" {
        /// Burn's ndarray CPU backend (no bf16).
        Ndarray = "ndarray",
        /// Burn's flex CPU backend (with bf16).
        Flex = "flex",
        /// Burn's CUDA backend, one GPU per rank.
        Cuda = "cuda",
        /// LibTorch on CUDA, one GPU per rank.
        Tch = "tch",
        /// Burn's CubeCL backend on wgpu's default adapter (Vulkan, Metal or DX12; Mesa's
        /// llvmpipe on a machine without a GPU), one device every rank shares.
        Wgpu = "wgpu",
    }
}

named_enum! {
    /// The optimizer a run steps with.
    pub enum OptimizerKind as "optimizer" {
        /// Plain SGD: `p -= lr * g`.
        Sgd = "sgd",
        /// PyTorch's AdamW.
        AdamW = "adamw",
    }
}

impl Backend {
    /// The autodiff device of a rank whose GPU (for `cuda` and `tch`) is `gpu`, or an error
    /// naming the cargo feature this build lacks (or, for `wgpu`, the missing driver).
    #[allow(deprecated)] // burn-ndarray and burn-tch are deprecated in Burn 0.22, not removed
    pub fn device(self, gpu: usize) -> Result<Device, TrainError> {
        #[cfg(any(feature = "cuda", feature = "tch"))]
        if matches!(self, Backend::Cuda | Backend::Tch) {
            burn_parallel_comm::nccl::check_gpu(gpu)
                .map_err(|e| flag_error("--backend", format!("{self}: {e}")))?;
        }
        let _ = gpu;
        let base = match self {
            Backend::Ndarray => Device::ndarray(),
            Backend::Flex => Device::flex(),
            #[cfg(feature = "cuda")]
            Backend::Cuda => Device::cuda(gpu),
            #[cfg(feature = "tch")]
            Backend::Tch => Device::libtorch_cuda(gpu),
            #[cfg(feature = "wgpu")]
            // One device every rank shares (rank identity comes from the communicator).
            Backend::Wgpu => crate::wgpu_device::wgpu_adapter()
                .map_err(|e| flag_error("--backend", format!("wgpu: {e}")))?
                .device
                .clone(),
            #[allow(unreachable_patterns)]
            other => {
                return Err(flag_error(
                    "--backend",
                    format!("{other} is not in this build: build with `--features {other}`"),
                ));
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
            Backend::Wgpu => cfg!(feature = "wgpu"),
        }
    }
}

/// A training run. [`TrainConfig::default`] is the README's first command: FSDP2 on 4 rank
/// threads, the built-in tiny Llama and synthetic corpus.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// How the model and the batch are spread over the ranks: strategy, world size, mesh
    /// sizes, mixed precision, resharding, prefetch. `world_size` must be set (it is the number
    /// of ranks the run starts). Default: the trainer's defaults
    /// ([`trainer_defaults`]), fsdp2 on 4 ranks.
    pub distributed: DistributedConfig,
    /// Total optimizer steps (default 40).
    pub steps: usize,
    /// Sequences per step over all data-parallel ranks (default 8).
    pub global_batch: usize,
    /// Tokens per sequence (default 64).
    pub seq_len: usize,
    /// The optimizer (default `adamw`).
    pub optimizer: OptimizerKind,
    /// Learning rate: the peak of the schedule (default 3e-3).
    pub lr: f32,
    /// The schedule after warmup: constant, linear or cosine decay to `min_lr` at `steps`
    /// (default constant; formulas in `--lr-schedule`'s help and docs/llama.md).
    pub lr_schedule: LrScheduleKind,
    /// Steps of linear warmup from 0 to `lr`: step s < N trains at `lr * s / N` (default 0).
    pub warmup_steps: usize,
    /// Where a linear or cosine schedule decays to (default 0).
    pub min_lr: f32,
    /// What a step whose loss or gradient norm is not finite does: stop the run (default) or
    /// skip its update on every rank.
    pub on_nonfinite: OnNonFinite,
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
    /// How `data` is read: the tokenizer for text and JSONL, packing, shuffling, padding and
    /// the evaluation data (docs/data.md; default: none of them).
    pub data_options: DataOptions,
    /// Micro-batches of `global_batch` rows per optimizer step, their gradients accumulated:
    /// one step on a batch `grad_accum` times larger (default 1).
    pub grad_accum: usize,
    /// Where to save the trained model in the Hugging Face format (default None: not saved).
    pub save: Option<PathBuf>,
    /// Save a sharded training checkpoint every this many steps (and after the last step) into
    /// `save_dir/step-N` (default None: no checkpoints).
    pub save_every: Option<usize>,
    /// Where `save_every` saves checkpoints (default None).
    pub save_dir: Option<PathBuf>,
    /// Write checkpoints on a background thread while training goes on, at most one in flight
    /// (default false: each save finishes before the next step).
    pub async_save: bool,
    /// Resume from this checkpoint (or a save directory's newest one): weights, optimizer
    /// state, step and data position, in any layout. `steps` stays the total step count
    /// (default None: a fresh run).
    pub resume: Option<PathBuf>,
    /// Resume although `data`, `seq_len` or `global_batch` differ from what the checkpoint
    /// recorded (default false: such a resume is an error naming each difference).
    pub allow_data_change: bool,
    /// Stop after the step in progress when this flag is raised (a preemption signal): the
    /// step is saved to `save_dir` if there is one, and the summary's `stopped_at` says where
    /// the run ended (default None: runs to `steps`).
    pub stop: Option<crate::stop::StopFlag>,
    /// An injected fault (`BURN_PARALLEL_FAULT=rank:step:kind`, for tests and recovery drills;
    /// default None).
    pub fault: Option<crate::fault::Fault>,
    /// Ranks as threads of this process, or as the processes of an MPI job (default threads).
    pub engine: EngineKind,
    /// Compute threads of each CPU rank (default None: `BURN_PARALLEL_THREADS_PER_RANK`, else
    /// the cores divided by the ranks of the process, so ranks x threads <= cores).
    pub threads_per_rank: Option<usize>,
    /// Hugging Face parameter-name prefixes or globs whose parameters are frozen (no gradient,
    /// reduction or optimizer state) before the model is parallelized, e.g.
    /// `model.embed_tokens` or `model.layers.*.self_attn` (default: none). A pattern that
    /// matches nothing is an error naming it.
    pub freeze: Vec<String>,
    /// LoRA adapters to train instead of the whole model, from flags or a peft adapter, and
    /// where to save them (default: none, full training).
    pub lora: LoraOptions,
    /// The schedule of a pipeline-parallel run (`distributed.pp_size > 1`): `--pp-schedule`,
    /// `--microbatches`, `--stages-per-rank` (default: none given, 1F1B over pp microbatches).
    pub pipeline: PipelineOptions,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            distributed: trainer_defaults(Strategy::default(), ZeroDpStrategy::default()),
            steps: 40,
            global_batch: 8,
            seq_len: 64,
            optimizer: OptimizerKind::AdamW,
            lr: 3e-3,
            lr_schedule: LrScheduleKind::Constant,
            warmup_steps: 0,
            min_lr: 0.0,
            on_nonfinite: OnNonFinite::Stop,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            grad_clip: Some(1.0),
            backend: Backend::Flex,
            checkpoint: None,
            model: LlamaConfig::tiny(),
            seed: 0,
            data: None,
            data_options: DataOptions::default(),
            grad_accum: 1,
            save: None,
            save_every: None,
            save_dir: None,
            async_save: false,
            resume: None,
            allow_data_change: false,
            stop: None,
            fault: None,
            engine: EngineKind::Threads,
            threads_per_rank: None,
            freeze: Vec::new(),
            lora: LoraOptions::default(),
            pipeline: Default::default(),
        }
    }
}

impl TrainConfig {
    /// The number of ranks the run starts: `distributed.world_size`, or an error saying to set
    /// it.
    pub fn world_size(&self) -> Result<usize, TrainError> {
        match self.distributed.world_size {
            Some(n) if n > 0 => Ok(n),
            Some(_) => Err(flag_error("--world-size", "must be at least 1")),
            None => Err(TrainError::Config(
                "the run's world size is not set: give --world-size, or world_size in the \
                 distributed config"
                    .into(),
            )),
        }
    }
}

#[cfg(all(test, not(feature = "wgpu")))]
mod tests {
    use super::*;

    /// Without the cargo feature, `--backend wgpu` is an error that says how to build it.
    #[test]
    fn backend_wgpu_without_the_feature_names_it() {
        assert!(!Backend::Wgpu.available());
        let e = Backend::Wgpu.device(0).unwrap_err().to_string();
        assert!(e.contains("`--features wgpu`"), "{e}");
    }
}
