//! The trainer's command line (`examples/train_llama.rs`): its flags and the [`TrainConfig`]
//! they give. The distributed flags are [`DistributedFlags`].

use std::ffi::OsString;
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
use crate::recipe::Recipe;
use crate::relaunch::{Relaunch, in_launched_job};

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
#[command(
    about = "Train a Llama with burn-parallel (ranks are threads, or MPI processes)",
    // A --recipe's flags come first: a flag given again on the command line overrides them.
    args_override_self = true
)]
pub struct TrainArgs {
    /// A recipe file (.yaml, .toml, .json) with every setting of the run, in NeMo AutoModel's
    /// sections (docs/recipes.md); flags given beside it override its values.
    #[arg(long, value_name = "FILE")]
    pub recipe: Option<PathBuf>,
    /// Print the run's resolved recipe (every default included) as YAML and exit.
    #[arg(long)]
    pub print_recipe: bool,
    /// Rows each data-parallel rank computes per micro-step (NeMo's local_batch_size): the
    /// --global-batch rows of a step are then taken in --global-batch / (N x data-parallel
    /// ranks) micro-steps of N rows per rank (gradient accumulation).
    #[arg(long, value_name = "N", conflicts_with = "grad_accum")]
    pub local_batch: Option<usize>,
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
    /// Start the ranks with this launcher ("mpirun -np 4", split at spaces) rather than
    /// training here: the trainer runs its own command line under it and, with --max-restarts
    /// N, starts a failed job again from the newest checkpoint in --save-dir, up to N times
    /// (TorchElastic's restarts, for engines whose ranks are processes).
    #[arg(long, value_name = "CMD")]
    pub launcher: Option<String>,
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
    /// The job `--launcher` asks for, run with this program's `args` (the program name first),
    /// or `None`: no launcher, or this process is a rank of a job a launcher started.
    pub fn relaunch(&self, args: &[OsString]) -> Result<Option<Relaunch>, TrainError> {
        let Some(launcher) = &self.launcher else {
            return Ok(None);
        };
        if in_launched_job() {
            return Ok(None);
        }
        let program = std::env::current_exe().map_err(|e| {
            TrainError::Config(format!("--launcher: cannot find this program's path: {e}"))
        })?;
        Ok(Some(Relaunch {
            launcher: launcher.split_whitespace().map(String::from).collect(),
            program,
            args: args.iter().skip(1).cloned().collect(),
            save_dir: self.run.save_dir.clone(),
            max_restarts: self.run.max_restarts,
        }))
    }

    /// The flags of `args` (the program name first), a `--recipe`'s values under them: the
    /// recipe's flags are parsed first, so that a flag on the command line overrides the
    /// recipe. A recipe that cannot be read is a clap error naming it, so that
    /// `unwrap_or_else(|e| e.exit())` reports every mistake alike.
    pub fn parse_with_recipe<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString>,
    {
        use clap::Parser;
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let recipe = recipe_path(&args)
            .map(|path| Recipe::read(&path))
            .transpose()
            .map_err(|e| {
                clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n"))
            })?
            .unwrap_or_default();
        let mut argv: Vec<std::ffi::OsString> = args.iter().take(1).cloned().collect();
        argv.extend(recipe.flags.into_iter().map(Into::into));
        argv.extend(args.into_iter().skip(1));
        let mut parsed = Self::try_parse_from(argv)?;
        parsed.distributed.recipe = recipe.distributed;
        Ok(parsed)
    }

    /// The recipe of `cfg` (the run these flags gave) as YAML, every default included: what
    /// `--print-recipe` prints, and reads back as the same run.
    pub fn recipe_yaml(&self, cfg: &TrainConfig) -> String {
        crate::recipe::resolved_yaml(cfg, self.config.as_deref(), &self.model.to_string())
    }

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
        let cfg = TrainConfig {
            distributed: self.distributed.resolve()?,
            model,
            seq_len: self.seq_len.unwrap_or(run.seq_len),
            // 0 on the command line turns clipping off.
            grad_clip: run.grad_clip.filter(|&clip| clip > 0.0),
            data_options,
            fault: crate::fault::Fault::from_env()?,
            // A launched job's restarts are its launcher's (see `Relaunch`).
            max_restarts: match in_launched_job() {
                true => 0,
                false => run.max_restarts,
            },
            engine,
            freeze: self
                .freeze
                .as_deref()
                .map(split_patterns)
                .unwrap_or_default(),
            lora: self.lora.options(),
            pipeline: self.distributed.pipeline(),
            ..run.clone()
        };
        match self.local_batch {
            Some(local) => with_local_batch(cfg, local),
            None => Ok(cfg),
        }
    }
}

/// `--recipe FILE` (or `--recipe=FILE`) among `args`.
fn recipe_path(args: &[std::ffi::OsString]) -> Option<PathBuf> {
    let mut args = args.iter().skip(1).map(|a| a.to_string_lossy());
    while let Some(arg) = args.next() {
        if arg == "--recipe" {
            return args.next().map(|p| PathBuf::from(p.as_ref()));
        }
        if let Some(path) = arg.strip_prefix("--recipe=") {
            return Some(PathBuf::from(path));
        }
    }
    None
}

/// `cfg` (whose `global_batch` is the rows of a whole step) as micro-steps of `local` rows per
/// data-parallel rank: `global_batch` = `local` x dp rows per micro-step, `grad_accum` = the
/// step's rows / that; an error naming the flags when they do not divide.
fn with_local_batch(cfg: TrainConfig, local: usize) -> Result<TrainConfig, TrainError> {
    let world = cfg.world_size()?;
    let dp = cfg
        .distributed
        .plan(world)
        .map_err(|e| crate::error::flag_error("--strategy", e.to_string()))?
        .sizes()
        .dp();
    let per_micro_step = local * dp;
    if local == 0 || !cfg.global_batch.is_multiple_of(per_micro_step) {
        return Err(crate::error::flag_error(
            "--local-batch",
            format!(
                "{local} on {dp} data-parallel ranks ({per_micro_step} rows per micro-step) \
                 does not divide --global-batch {}",
                cfg.global_batch
            ),
        ));
    }
    Ok(TrainConfig {
        grad_accum: cfg.global_batch / per_micro_step,
        global_batch: per_micro_step,
        ..cfg
    })
}
