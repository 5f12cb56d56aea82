//! The trainer's command line (`examples/train_llama.rs`): its flags and the [`TrainConfig`]
//! they give. The distributed flags are [`DistributedFlags`].

use std::path::PathBuf;

use burn_parallel_comm::EngineKind;
use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::named_enum;

use crate::config::TrainConfig;
use crate::data::{DataOptions, EvalBatches};
use crate::error::TrainError;
use crate::flags::{DistributedFlags, one_of};
use crate::freeze::split_patterns;
use crate::generate::GenerateOptions;
use crate::lora::LoraFlags;
use crate::malloc::Malloc;

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
    /// Every setting that is a field of the run's config: steps, batch, optimizer, schedule,
    /// backend, checkpoints and saves, each with its flag and default declared there.
    #[command(flatten)]
    pub run: TrainConfig,
    /// A Hugging Face config.json to train from a seeded init (the same on every rank): a larger
    /// model without a checkpoint.
    #[arg(long, value_name = "FILE", conflicts_with = "checkpoint")]
    pub config: Option<PathBuf>,
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
    /// Refuse SFT or chat data holding an example with no trained token (a conversation
    /// without an assistant turn, an empty completion); without it they are counted in a
    /// warning.
    #[arg(long)]
    pub strict_data: bool,
    /// Batches of --global-batch rows per evaluation, from the start of --eval-data: all (the
    /// whole file once, the last batch partial) or a count.
    #[arg(long, value_name = "K|all", default_value_t = DataOptions::default().eval_batches)]
    pub eval_batches: EvalBatches,
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
    /// Tokens per sequence (default: `TrainConfig::default().seq_len`, 64). SFT and chat rows
    /// are padded to it when given, else to the step's longest row, and examples longer than
    /// it are truncated.
    #[arg(long)]
    pub seq_len: Option<usize>,
    /// Freeze these parameters: comma-separated Hugging Face parameter-name prefixes or globs
    /// (`model.embed_tokens,model.layers.0`, `model.layers.*.self_attn.*`).
    #[arg(long, value_name = "PATTERNS")]
    pub freeze: Option<String>,
    /// LoRA: `--lora-rank`, `--lora-alpha`, `--lora-targets`, `--lora-rslora`, `--lora-init`,
    /// `--save-adapter`.
    #[command(flatten)]
    pub lora: LoraFlags,
    /// Instead of training: decode after PROMPT from --checkpoint (a model directory, as --save
    /// writes it; the tokenizer from --tokenizer or the directory), the prompt rendered as a
    /// user message through the chat template, greedy unless --temperature; prints the text.
    #[arg(long, value_name = "PROMPT", requires = "checkpoint")]
    pub generate: Option<String>,
    /// New tokens at most for --generate (it stops earlier at an end-of-sequence id).
    #[arg(long, value_name = "N", default_value_t = GenerateOptions::default().max_new_tokens)]
    pub max_new_tokens: usize,
    /// Sample --generate's tokens at this temperature, seeded by --seed (default: greedy).
    #[arg(long, value_name = "T")]
    pub temperature: Option<f32>,
    /// One JSON object per step on stdout, nothing else.
    #[arg(long)]
    pub json: bool,
    /// threads | mpi | nccl (default: $BURN_PARALLEL_ENGINE, else mpi under mpirun/srun, else
    /// threads). mpi needs `--features mpi`; nccl `--features nccl` (or cuda) and one GPU per
    /// rank (one thread per GPU, or one process per GPU when the launcher sets RANK).
    #[arg(long)]
    pub engine: Option<EngineKind>,
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
    /// What `--generate` asks for: the prompt and how to decode it (`None` without the flag).
    pub fn generation(&self) -> Option<(&str, GenerateOptions)> {
        let prompt = self.generate.as_deref()?;
        let options = GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            temperature: self.temperature,
            seed: self.run.seed,
            ..GenerateOptions::default()
        };
        Some((prompt, options))
    }

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
        let data_options = DataOptions {
            tokenizer: self.tokenizer.clone(),
            pack: self.pack,
            shuffle_seed: self.shuffle_seed,
            pad_to_seq_len: self.seq_len.is_some(),
            eval_data: self.eval_data.clone(),
            eval_every: self.eval_every.unwrap_or(0),
            eval_batches: self.eval_batches,
            strict_data: self.strict_data,
        };
        let run = &self.run;
        Ok(TrainConfig {
            distributed: self.distributed.resolve()?,
            model,
            seq_len: self.seq_len.unwrap_or(run.seq_len),
            // 0 on the command line turns clipping off.
            grad_clip: run.grad_clip.filter(|&clip| clip > 0.0),
            data_options,
            fault: crate::fault::Fault::from_env()?,
            engine,
            freeze: self
                .freeze
                .as_deref()
                .map(split_patterns)
                .unwrap_or_default(),
            lora: self.lora.options(),
            pipeline: self.distributed.pipeline(),
            ..run.clone()
        })
    }
}
