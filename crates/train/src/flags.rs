//! The distributed half of the trainer's command line. Each flag, when given, sets one field of
//! the run's `DistributedConfig`, and `--distributed-config FILE` reads one. A run gets, later
//! layers winning: the trainer's defaults ([`trainer_defaults`]), the keys the file sets, the
//! flags given. The same run written as flags or as a file is therefore the same config.

use std::path::PathBuf;

use burn_parallel_parallelizer::{
    DistributedConfig, Dtype, MixedPrecisionConfig, ScheduleKind, Strategy, ZeroDpStrategy,
    named_enum,
};

use crate::error::TrainError;
use crate::options::PipelineOptions;

named_enum! {
    /// The Llama's tensor-parallel plans, as `--tp-plan` names them.
    #[derive(Default)]
    pub enum TpPlanName as "tp plan" {
        /// Heads, MLP and vocabulary split; activations replicated between regions.
        #[default]
        Llama = "llama",
        /// `llama` with sequence parallelism (`sequence_parallel = true`): activations
        /// sharded along the sequence between tensor-parallel regions.
        LlamaSp = "llama-sp",
    }
}

/// The trainer's distributed flags, each `None` when not given (see the module doc for how
/// they combine with the defaults and a file). [`crate::TrainArgs`] parses them; a program
/// can fill them in directly and [`resolve`](Self::resolve) them.
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct DistributedFlags {
    /// `--distributed-config FILE`: a `DistributedConfig` in TOML, JSON or YAML.
    #[arg(
        long,
        value_name = "FILE",
        help = "A DistributedConfig file (.toml, .json, .yaml): its keys replace the trainer's \
                defaults, and the flags given replace its keys"
    )]
    pub distributed_config: Option<PathBuf>,
    /// `--strategy`: `strategy`.
    #[arg(long, help = one_of("How the model and batch are spread (default fsdp2)", Strategy::NAMES))]
    pub strategy: Option<Strategy>,
    /// `--world-size`: `world_size`, the ranks to run.
    #[arg(long, help = "Ranks to run (default 4)")]
    pub world_size: Option<usize>,
    /// `--tp`: `tp_size`.
    #[arg(
        long,
        help = "Tensor-parallel size (tp: the world size; fsdp2_tp: default 2; fsdp2: default 1)"
    )]
    pub tp: Option<usize>,
    /// `--dp-replicate`: `dp_replicate_size`.
    #[arg(
        long,
        help = "Replica count under hsdp (default 2), fsdp2 and megatron_fsdp (default 1)"
    )]
    pub dp_replicate: Option<usize>,
    /// `--cp`: `cp_size`.
    #[arg(
        long,
        help = "Context-parallel size (fsdp2, hsdp, fsdp2_tp): each sequence is split over this \
                many ranks (head-tail), which read the same rows; FSDP shards over dp_shard x cp; \
                --seq-len must be a multiple of 2 x cp (default 1)"
    )]
    pub cp: Option<usize>,
    /// `--ep`: `ep_size`.
    #[arg(
        long,
        help = "Expert-parallel size for a MoE model (ddp, fsdp2, hsdp, fsdp2_tp, megatron_fsdp): \
                its experts are split over this many consecutive data-parallel ranks (default 1)"
    )]
    pub ep: Option<usize>,
    /// `--pp`: `pp_size`.
    #[arg(
        long,
        help = "Pipeline-parallel size: the Llama's layers split into stages over this many \
                ranks (outermost mesh dim; default 1)"
    )]
    pub pp: Option<usize>,
    /// `--pp-schedule`: the pipeline schedule ([`PipelineOptions::schedule`]).
    #[arg(long, help = one_of("The pipeline schedule under --pp (default 1f1b)", ScheduleKind::NAMES))]
    pub pp_schedule: Option<ScheduleKind>,
    /// `--microbatches`: microbatches per step under `--pp` ([`PipelineOptions::microbatches`]).
    #[arg(
        long,
        help = "Microbatches each pipeline rank splits its rows of the step into, as evenly as \
                possible (default: the --pp size)"
    )]
    pub microbatches: Option<usize>,
    /// `--stages-per-rank`: chunks per pipeline rank ([`PipelineOptions::stages_per_rank`]).
    #[arg(
        long,
        help = "Stages (chunks) each pipeline rank holds under --pp-schedule interleaved \
                (default 2; 1 under the others)"
    )]
    pub stages_per_rank: Option<usize>,
    /// `--zero-dp-strategy`: `megatron_fsdp.zero_dp_strategy`.
    #[arg(
        long,
        help = one_of(
            "What megatron_fsdp shards (default optim_grads_params; 1 and 2 keep the gathered \
             weights through backward)",
            ZeroDpStrategy::NAMES
        )
    )]
    pub zero_dp_strategy: Option<ZeroDpStrategy>,
    /// `--bucket-size`: `megatron_fsdp.bucket_size`.
    #[arg(
        long,
        value_name = "ELEMENTS",
        help = "megatron_fsdp: elements one collective may gather for consecutive decoder \
                layers (default: one collective per layer)"
    )]
    pub bucket_size: Option<usize>,
    /// `--tp-plan`: `sequence_parallel` (false for `llama`, true for `llama-sp`).
    #[arg(long, help = one_of("The tp plan (default llama)", TpPlanName::NAMES))]
    pub tp_plan: Option<TpPlanName>,
    /// `--param-dtype`: `mp_policy.param_dtype` (`f32` is no cast).
    #[arg(
        long,
        help = one_of(
            "The dtype weights are gathered and computed in (default f32: no cast; bf16 and \
             f16 need --backend flex)",
            Dtype::NAMES
        )
    )]
    pub param_dtype: Option<Dtype>,
    /// `--reduce-dtype`: `mp_policy.reduce_dtype` (`f32` is no cast).
    #[arg(
        long,
        help = one_of("The dtype gradients are reduced in (default f32: no cast)", Dtype::NAMES)
    )]
    pub reduce_dtype: Option<Dtype>,
    /// `--reshard-after-forward`: `reshard_after_forward`.
    #[arg(
        long,
        action = clap::ArgAction::Set,
        help = "Free gathered weights after forward and gather again in backward (default \
                true; megatron_fsdp ZeRO-1 and 2 keep them)"
    )]
    pub reshard_after_forward: Option<bool>,
    /// A `--recipe`'s `distributed` section (`DistributedConfig` keys): a layer under
    /// `--distributed-config` and the flags.
    #[arg(skip)]
    pub recipe: Option<serde_json::Value>,
}

/// A flag's help line: what it sets, then the names its enum's table accepts.
pub(crate) fn one_of(what: &str, names: &[&str]) -> String {
    format!("{what}: {}", names.join(" | "))
}

/// The trainer's defaults for a run of `strategy` (at ZeRO stage `zero` under megatron_fsdp):
/// `DistributedConfig::default()` except
/// - `world_size` 4; `tp_size` 2 under fsdp2_tp; `dp_replicate_size` 2 under hsdp;
/// - `reshard_after_forward` true (every unit, the root too, frees its gathered weights after
///   forward), except under megatron_fsdp's ZeRO-1 and ZeRO-2, which keep them (unset);
/// - `mp_policy.cast_forward_inputs` true (inputs follow `--param-dtype`).
pub fn trainer_defaults(strategy: Strategy, zero: ZeroDpStrategy) -> DistributedConfig {
    let keeps_gathered = strategy.keeps_gathered_weights(zero);
    let (tp_size, dp_replicate_size) = strategy.smallest_sizes();
    DistributedConfig {
        strategy,
        world_size: Some(4),
        tp_size,
        dp_replicate_size,
        reshard_after_forward: (!keeps_gathered).then_some(true),
        mp_policy: MixedPrecisionConfig {
            cast_forward_inputs: true,
            ..MixedPrecisionConfig::default()
        },
        ..DistributedConfig::default()
    }
}

impl DistributedFlags {
    /// The flags `--strategy strategy --world-size world_size`, nothing else given.
    pub fn on(strategy: Strategy, world_size: usize) -> Self {
        Self {
            strategy: Some(strategy),
            world_size: Some(world_size),
            ..Self::default()
        }
    }

    /// The run's config: the trainer's defaults for the strategy and ZeRO stage the flags (else
    /// the file) name, the file's keys over them, the flags given over those. Errors name the
    /// file and what in it cannot be read.
    pub fn resolve(&self) -> Result<DistributedConfig, TrainError> {
        let file = self.distributed_config.as_deref();
        const RECIPE: &str = "the --recipe's distributed section";
        let recipe = match &self.recipe {
            Some(keys) => Some(DistributedConfig::from_value_over(
                keys.clone(),
                &DistributedConfig::default(),
                RECIPE,
            )?),
            None => None,
        };
        // The defaults depend on the strategy and ZeRO stage, wherever they are given: the
        // flags, else the file, else the recipe.
        let (strategy, zero) = match (file, &recipe) {
            (Some(path), _) => {
                let own = DistributedConfig::from_file(path)?;
                (own.strategy, own.megatron_fsdp.zero_dp_strategy)
            }
            (None, Some(own)) => (own.strategy, own.megatron_fsdp.zero_dp_strategy),
            (None, None) => Default::default(),
        };
        let base = trainer_defaults(
            self.strategy.unwrap_or(strategy),
            self.zero_dp_strategy.unwrap_or(zero),
        );
        let base = match &self.recipe {
            Some(keys) => DistributedConfig::from_value_over(keys.clone(), &base, RECIPE)?,
            None => base,
        };
        let mut config = match file {
            Some(path) => DistributedConfig::from_file_over(path, &base)?,
            None => base,
        };
        self.apply(&mut config);
        Ok(config)
    }

    /// The pipeline flags (`--pp-schedule`, `--microbatches`, `--stages-per-rank`); `--pp`
    /// itself is the config's `pp_size`.
    pub fn pipeline(&self) -> PipelineOptions {
        PipelineOptions {
            schedule: self.pp_schedule,
            microbatches: self.microbatches,
            stages_per_rank: self.stages_per_rank,
        }
    }

    /// Writes every flag given into `config`.
    fn apply(&self, config: &mut DistributedConfig) {
        // f32 is the model's own dtype: no cast, as the trainer has always run it.
        let cast = |d: Dtype| (d != Dtype::F32).then_some(d);
        let c = config;
        set(&mut c.strategy, self.strategy);
        set(&mut c.world_size, self.world_size.map(Some));
        set(&mut c.tp_size, self.tp);
        set(&mut c.dp_replicate_size, self.dp_replicate);
        set(&mut c.ep_size, self.ep);
        set(&mut c.cp_size, self.cp);
        set(&mut c.pp_size, self.pp);
        set(&mut c.megatron_fsdp.zero_dp_strategy, self.zero_dp_strategy);
        set(&mut c.megatron_fsdp.bucket_size, self.bucket_size.map(Some));
        let sp = self.tp_plan.map(|p| p == TpPlanName::LlamaSp);
        set(&mut c.sequence_parallel, sp);
        set(&mut c.mp_policy.param_dtype, self.param_dtype.map(cast));
        set(&mut c.mp_policy.reduce_dtype, self.reduce_dtype.map(cast));
        let reshard = self.reshard_after_forward.map(Some);
        set(&mut c.reshard_after_forward, reshard);
    }
}

/// `field = value` when the flag was given.
fn set<T>(field: &mut T, value: Option<T>) {
    if let Some(value) = value {
        *field = value;
    }
}
