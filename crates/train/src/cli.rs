//! The trainer's command line (`examples/train_llama.rs`): its flags and the [`TrainConfig`]
//! they give. The distributed flags are [`DistributedFlags`].

use std::path::PathBuf;

use burn_parallel_comm::EngineKind;
use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::named_enum;

use crate::config::{Backend, OptimizerKind, TrainConfig};
use crate::data::DataOptions;
use crate::error::TrainError;
use crate::flags::{DistributedFlags, one_of};
use crate::freeze::split_patterns;
use crate::lora::LoraFlags;
use crate::malloc::Malloc;
use crate::options::{LrScheduleKind, OnNonFinite};

named_enum! {
    /// The built-in models `--model` names.
    #[derive(Default)]
    pub enum BuiltinModel as "model" {
        /// A Llama ([`LlamaConfig::tiny`]).
        #[default]
        Tiny = "tiny",
        /// A Qwen3-MoE with 8 experts, top-2 ([`LlamaConfig::tiny_moe`]).
        TinyMoe = "tiny-moe",
    }
}

/// The trainer's flags. [`TrainArgs::config`] turns them into a run.
#[derive(clap::Parser, Debug, Clone)]
#[command(about = "Train a Llama with burn-parallel (ranks are threads, or MPI processes)")]
pub struct TrainArgs {
    /// Hugging Face checkpoint directory (default: the built-in tiny config, seeded init).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// A Hugging Face config.json to train from a seeded init (the same on every rank): a larger
    /// model without a checkpoint.
    #[arg(long, value_name = "FILE", conflicts_with = "checkpoint")]
    pub config: Option<PathBuf>,
    /// Training data: `.bin` (little-endian u16 ids), `.txt`, or `.jsonl` with {"text"},
    /// {"prompt", "completion"} (SFT) or {"messages"} (chat) records; text needs --tokenizer
    /// (default: a built-in synthetic corpus). docs/data.md describes the formats.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// A Hugging Face tokenizer.json for .txt and .jsonl data; bos/eos/pad and the chat
    /// template come from the tokenizer_config.json beside it.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Pack several SFT or chat examples into each row of --seq-len positions (attention does
    /// not cross examples; positions restart per example).
    #[arg(long)]
    pub pack: bool,
    /// Shuffle the data per epoch with this seed (default: file order).
    #[arg(long, value_name = "S")]
    pub shuffle_seed: Option<u64>,
    /// Evaluation data (any --data format): its loss under the same strategy, no update.
    #[arg(long, value_name = "FILE", requires = "eval_every")]
    pub eval_data: Option<PathBuf>,
    /// Evaluate every N steps and after the last step (`eval_loss` in the step's JSON).
    #[arg(long, value_name = "N", requires = "eval_data")]
    pub eval_every: Option<usize>,
    /// Batches of --global-batch rows per evaluation, from the start of --eval-data.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub eval_batches: usize,
    /// Micro-batches of --global-batch rows per optimizer step, gradients accumulated: equal
    /// to one step on a K times larger batch.
    #[arg(long, value_name = "K", default_value_t = 1)]
    pub grad_accum: usize,
    /// Strategy, sizes, precision and resharding: the run's `DistributedConfig`.
    #[command(flatten)]
    pub distributed: DistributedFlags,
    /// The built-in model when neither --checkpoint nor --config is given.
    #[arg(
        long,
        default_value = "tiny",
        help = one_of(
            "The built-in model without --checkpoint or --config (tiny: a Llama; tiny-moe: a \
             Qwen3-MoE with 8 experts, top-2)",
            BuiltinModel::NAMES
        )
    )]
    pub model: BuiltinModel,
    /// Total optimizer steps.
    #[arg(long, default_value_t = 40)]
    pub steps: usize,
    /// Sequences per step over all data-parallel ranks.
    #[arg(long, default_value_t = 8)]
    pub global_batch: usize,
    /// Tokens per sequence (default 64). SFT and chat rows are padded to it when given, else
    /// to the step's longest row, and examples longer than it are truncated.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// The optimizer.
    #[arg(long, default_value = "adamw", help = one_of("The optimizer", OptimizerKind::NAMES))]
    pub optimizer: OptimizerKind,
    /// Learning rate (the schedule's peak).
    #[arg(long, default_value_t = 3e-3)]
    pub lr: f32,
    /// The learning-rate schedule after warmup.
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
    /// Steps of linear warmup from 0: step s < N trains at lr * s / N.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_steps: usize,
    /// Where --lr-schedule linear or cosine decays to.
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f32,
    /// What a step whose loss or gradient norm is not finite does.
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
    /// Freeze these parameters: comma-separated Hugging Face parameter-name prefixes or globs
    /// (`model.embed_tokens,model.layers.0`, `model.layers.*.self_attn.*`).
    #[arg(long, value_name = "PATTERNS")]
    pub freeze: Option<String>,
    /// LoRA: `--lora-rank`, `--lora-alpha`, `--lora-targets`, `--lora-rslora`, `--lora-init`,
    /// `--save-adapter`.
    #[command(flatten)]
    pub lora: LoraFlags,
    /// Clip the global gradient norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f32,
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
    /// Seed of the model's initial weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Save the trained model here in the Hugging Face format.
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
    /// Resume from a checkpoint, or from the newest one in a save directory. --steps stays the
    /// total: resumed at step 5, --steps 10 trains steps 5 to 9.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Resume although --data, --seq-len or --global-batch differ from the checkpoint's (the
    /// data stream then continues at the same sample position of the other data).
    #[arg(long)]
    pub allow_data_change: bool,
    /// One JSON object per step on stdout, nothing else.
    #[arg(long)]
    pub json: bool,
    /// threads | mpi | nccl (default: $BURN_PARALLEL_ENGINE, else mpi under mpirun/srun, else
    /// threads). mpi needs `--features mpi`; nccl `--features nccl` (or cuda) and one GPU per
    /// rank (one thread per GPU, or one process per GPU when the launcher sets RANK).
    #[arg(long)]
    pub engine: Option<EngineKind>,
    /// Compute threads of each rank (default: $BURN_PARALLEL_THREADS_PER_RANK, else the cores
    /// divided by the ranks of this process).
    #[arg(long, value_name = "N")]
    pub threads_per_rank: Option<usize>,
    /// Whether freed memory stays in the process for the next step.
    #[arg(
        long,
        default_value = "kept",
        help = one_of(
            "Whether freed memory stays in the process for the next step (kept: FSDP's per-step \
             buffers then cost no page faults) or goes back to the system",
            Malloc::NAMES
        )
    )]
    pub malloc: Malloc,
}

impl TrainArgs {
    /// The run the flags describe, or an error naming the flag or file that cannot be used.
    pub fn config(&self) -> Result<TrainConfig, TrainError> {
        let engine = match self.engine {
            Some(engine) => engine,
            None => EngineKind::detect().map_err(|e| TrainError::Config(e.to_string()))?,
        };
        let model = match (&self.config, self.model) {
            (Some(file), _) => LlamaConfig::load(file)?,
            (None, BuiltinModel::TinyMoe) => LlamaConfig::tiny_moe(),
            (None, BuiltinModel::Tiny) => LlamaConfig::tiny(),
        };
        Ok(TrainConfig {
            distributed: self.distributed.resolve()?,
            model,
            steps: self.steps,
            global_batch: self.global_batch,
            seq_len: self.seq_len.unwrap_or(64),
            optimizer: self.optimizer,
            lr: self.lr,
            lr_schedule: self.lr_schedule,
            warmup_steps: self.warmup_steps,
            min_lr: self.min_lr,
            on_nonfinite: self.on_nonfinite,
            weight_decay: self.weight_decay,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            backend: self.backend,
            checkpoint: self.checkpoint.clone(),
            data: self.data.clone(),
            data_options: DataOptions {
                tokenizer: self.tokenizer.clone(),
                pack: self.pack,
                shuffle_seed: self.shuffle_seed,
                pad_to_seq_len: self.seq_len.is_some(),
                eval_data: self.eval_data.clone(),
                eval_every: self.eval_every.unwrap_or(0),
                eval_batches: self.eval_batches,
            },
            grad_accum: self.grad_accum,
            save: self.save.clone(),
            save_every: self.save_every,
            save_dir: self.save_dir.clone(),
            async_save: self.async_save,
            resume: self.resume.clone(),
            allow_data_change: self.allow_data_change,
            stop: None,
            fault: crate::fault::Fault::from_env()?,
            seed: self.seed,
            engine,
            threads_per_rank: self.threads_per_rank,
            freeze: self
                .freeze
                .as_deref()
                .map(split_patterns)
                .unwrap_or_default(),
            lora: self.lora.options(),
            pipeline: self.distributed.pipeline(),
        })
    }
}
