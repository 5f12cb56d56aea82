//! What a training run is: its `DistributedConfig` (strategy, sizes, precision, resharding),
//! the optimizer, the model and the data.

use std::path::PathBuf;

use burn::tensor::Device;
use burn_parallel_comm::EngineKind;
use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::{DistributedConfig, Strategy, ZeroDpStrategy, named_enum};

use crate::data::DataOptions;
use crate::error::{TrainError, flag_error};
use crate::flags::{one_of, trainer_defaults};
use crate::options::{LoraOptions, LrScheduleKind, OnNonFinite, PipelineOptions};

named_enum! {
    /// The backend each rank computes on: a CPU backend, one GPU per rank (`cuda`: Burn's
    /// CUDA backend, build with `--features cuda`; `tch`: LibTorch, `--features tch`, on CUDA
    /// when LibTorch sees a GPU, else on the CPU), or one wgpu device every rank shares
    /// (`wgpu`, `--features wgpu`).
    pub enum Backend as "backend" {
        /// Burn's ndarray CPU backend (no bf16).
        Ndarray = "ndarray",
        /// Burn's flex CPU backend (with bf16).
        Flex = "flex",
        /// Burn's CUDA backend, one GPU per rank.
        Cuda = "cuda",
        /// LibTorch: one GPU per rank when LibTorch sees CUDA, else the CPU every rank shares
        /// (PyTorch's `"cuda" if torch.cuda.is_available() else "cpu"`).
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

/// Whether LibTorch sees a CUDA device (its CUDA runtime loads and finds a GPU).
#[cfg(feature = "tch")]
fn libtorch_sees_cuda() -> bool {
    tch::Cuda::is_available()
}

#[cfg(all(feature = "cuda", not(feature = "tch")))]
fn libtorch_sees_cuda() -> bool {
    false
}

impl Backend {
    /// The autodiff device of a rank whose GPU (for `cuda` and `tch`) is `gpu`, or an error
    /// naming the cargo feature this build lacks (or, for `wgpu`, the missing driver).
    #[allow(deprecated)] // burn-ndarray and burn-tch are deprecated in Burn 0.22, not removed
    pub fn device(self, gpu: usize) -> Result<Device, TrainError> {
        #[cfg(any(feature = "cuda", feature = "tch"))]
        if matches!(self, Backend::Cuda) || (self == Backend::Tch && libtorch_sees_cuda()) {
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
            Backend::Tch if libtorch_sees_cuda() => Device::libtorch_cuda(gpu),
            #[cfg(feature = "tch")]
            Backend::Tch => Device::libtorch(),
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
///
/// The trainer's command line parses into it ([`TrainArgs`](crate::TrainArgs) flattens it):
/// each field that is a flag declares its flag and default here, once, and
/// [`TrainConfig::default`] is what an empty command line gives (`train_llama --help` lists
/// them). The fields without a flag of their own are set from the flags that describe them
/// (`--strategy` and the other distributed flags, `--config`/`--model`, the data and LoRA
/// flags).
#[derive(Debug, Clone, PartialEq, clap::Args)]
pub struct TrainConfig {
    /// How the model and the batch are spread over the ranks: strategy, world size, mesh
    /// sizes, mixed precision, resharding, prefetch. `world_size` must be set (it is the number
    /// of ranks the run starts). Default: the trainer's defaults
    /// ([`trainer_defaults`]), fsdp2 on 4 ranks.
    #[arg(skip = trainer_defaults(Strategy::default(), ZeroDpStrategy::default()))]
    pub distributed: DistributedConfig,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 40)]
    pub steps: usize,
    /// Sequences per step over all data-parallel ranks.
    #[arg(long, default_value_t = 8)]
    pub global_batch: usize,
    /// Tokens per sequence (default 64; the flag is `TrainArgs`' `--seq-len`, which also says
    /// whether rows are padded to it).
    #[arg(skip = 64_usize)]
    pub seq_len: usize,
    /// The optimizer.
    #[arg(long, default_value = "adamw", help = one_of("The optimizer", OptimizerKind::NAMES))]
    pub optimizer: OptimizerKind,
    /// Learning rate: the peak of the schedule.
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// The schedule after warmup: constant, linear or cosine decay to `min_lr` at `steps`
    /// (formulas in docs/llama.md).
    #[arg(
        long,
        default_value = "constant",
        help = one_of(
            "The learning-rate schedule after --warmup-steps (linear: lr decays linearly to \
             --min-lr at --steps; cosine: as half a cosine)",
            LrScheduleKind::NAMES
        )
    )]
    pub lr_schedule: LrScheduleKind,
    /// Steps of linear warmup from 0 to `lr`: step s < N trains at lr * s / N.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_steps: usize,
    /// Where a linear or cosine schedule decays to.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f32,
    /// What a step whose loss or gradient norm is not finite does: stop the run (the default)
    /// or skip its update on every rank.
    #[arg(
        long,
        default_value = "stop",
        help = one_of(
            "A step whose loss or gradient norm is not finite (stop: the run ends with an error \
             naming it; skip: its update is dropped on every rank, `skipped: true` in its JSON)",
            OnNonFinite::NAMES
        )
    )]
    pub on_nonfinite: OnNonFinite,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f32,
    /// AdamW's first-moment decay.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f32,
    /// AdamW's second-moment decay.
    #[arg(long, default_value_t = 0.999)]
    pub beta2: f32,
    /// AdamW's epsilon.
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f32,
    /// Clip the global gradient norm to this (`None`, or 0 on the command line: no clipping).
    #[arg(long, default_value = "1.0")]
    pub grad_clip: Option<f32>,
    /// The backend each rank computes on.
    #[arg(
        long,
        default_value = "flex",
        help = one_of(
            "The backend each rank computes on (cuda and tch: one GPU per rank, --features \
             cuda|tch; wgpu: one device all ranks share, --features wgpu)",
            Backend::NAMES
        )
    )]
    pub backend: Backend,
    /// A Hugging Face checkpoint directory (`None`: `model` with a seeded init).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// The model when no checkpoint is given (default `LlamaConfig::tiny()`; the flags are
    /// `--config` and `--model`).
    #[arg(skip = LlamaConfig::tiny())]
    pub model: LlamaConfig,
    /// Seed of the model's initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Training data: `.bin` (little-endian u16 ids), `.txt`, or `.jsonl` with {"text"},
    /// {"prompt", "completion"} (SFT) or {"messages"} (chat) records; text needs --tokenizer
    /// (default: a built-in synthetic corpus). docs/data.md describes the formats.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// How `data` is read: the tokenizer for text and JSONL, packing, shuffling, padding and
    /// the evaluation data (docs/data.md; default: none of them).
    #[arg(skip = DataOptions::default())]
    pub data_options: DataOptions,
    /// Micro-batches of --global-batch rows per optimizer step, gradients accumulated: equal
    /// to one step on a K times larger batch.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub grad_accum: usize,
    /// Save the trained model here in the Hugging Face format (`None`: not saved).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save a sharded training checkpoint every N steps and after the last one
    /// (`--save-dir/step-N`; resumable under any strategy and world size).
    #[arg(long, value_name = "N")]
    pub save_every: Option<usize>,
    /// Where --save-every writes its checkpoints.
    #[arg(long, value_name = "DIR")]
    pub save_dir: Option<PathBuf>,
    /// Write each checkpoint on a background thread while training goes on (at most one in
    /// flight; it becomes the newest checkpoint once written by every rank).
    #[arg(long)]
    pub async_save: bool,
    /// Resume from a checkpoint, or from the newest one in a save directory: weights,
    /// optimizer state, step and data position, in any layout. --steps stays the total:
    /// resumed at step 5, --steps 10 trains steps 5 to 9.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Restart a run whose ranks fail up to N times, from the newest checkpoint in --save-dir
    /// (or from the start without one), in this process: rank threads only (TorchElastic's
    /// --max-restarts).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: usize,
    /// Resume although --data, --seq-len or --global-batch differ from the checkpoint's (the
    /// data stream then continues at the same sample position of the other data; without it
    /// such a resume is an error naming each difference).
    #[arg(long)]
    pub allow_data_change: bool,
    /// Stop after the step in progress when this flag is raised (a preemption signal): the
    /// step is saved to `save_dir` if there is one, and the summary's `stopped_at` says where
    /// the run ended (default None: runs to `steps`).
    #[arg(skip)]
    pub stop: Option<crate::stop::StopFlag>,
    /// An injected fault (`BURN_PARALLEL_FAULT=rank:step:kind`, for tests and recovery drills;
    /// default None).
    #[arg(skip)]
    pub fault: Option<crate::fault::Fault>,
    /// Ranks as threads of this process, or as the processes of an MPI job (default threads;
    /// the flag is `--engine`, which detects the engine when not given).
    #[arg(skip = EngineKind::Threads)]
    pub engine: EngineKind,
    /// Compute threads of each rank (default: $BURN_PARALLEL_THREADS_PER_RANK, else the cores
    /// divided by the ranks of this process, so ranks x threads <= cores).
    #[arg(long, value_name = "N")]
    pub threads_per_rank: Option<usize>,
    /// Hugging Face parameter-name prefixes or globs whose parameters are frozen (no gradient,
    /// reduction or optimizer state) before the model is parallelized, e.g.
    /// `model.embed_tokens` or `model.layers.*.self_attn` (default: none; the flag is
    /// `--freeze`, comma-separated). A pattern that matches nothing is an error naming it.
    #[arg(skip)]
    pub freeze: Vec<String>,
    /// LoRA adapters to train instead of the whole model, from flags or a peft adapter, and
    /// where to save them (default: none, full training).
    #[arg(skip)]
    pub lora: LoraOptions,
    /// The schedule of a pipeline-parallel run (`distributed.pp_size > 1`): `--pp-schedule`,
    /// `--microbatches`, `--stages-per-rank` (default: none given, 1F1B over pp microbatches).
    #[arg(skip)]
    pub pipeline: PipelineOptions,
}

impl Default for TrainConfig {
    /// What an empty command line gives: every flag's default, declared once on its field.
    fn default() -> Self {
        use clap::{Args, FromArgMatches};
        let command = Self::augment_args(clap::Command::new("defaults"));
        let matches = command
            .try_get_matches_from(["defaults"])
            .expect("every flag of TrainConfig has a default");
        Self::from_arg_matches(&matches).expect("the defaults parse")
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

#[cfg(test)]
mod tests {
    #[allow(unused_imports)] // each test needs a build without its feature
    use super::*;

    /// Without the cargo feature, `--backend wgpu` is an error that says how to build it.
    #[cfg(not(feature = "wgpu"))]
    #[test]
    fn backend_wgpu_without_the_feature_names_it() {
        assert!(!Backend::Wgpu.available());
        let e = Backend::Wgpu.device(0).unwrap_err().to_string();
        assert!(e.contains("`--features wgpu`"), "{e}");
    }

    /// Without the cargo feature, `--backend tch` is an error that says how to build it.
    #[cfg(not(feature = "tch"))]
    #[test]
    fn backend_tch_without_the_feature_names_it() {
        assert!(!Backend::Tch.available());
        let e = Backend::Tch.device(0).unwrap_err().to_string();
        assert!(e.contains("`--features tch`"), "{e}");
    }
}
