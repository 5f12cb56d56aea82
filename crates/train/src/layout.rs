//! What each strategy flag means: the mesh sizes it uses on `--world-size` ranks, checked
//! before any rank starts, and the `DistributedConfig` that `parallelize_model` runs it with.

use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::{
    DistributedConfig, Dtype, MixedPrecisionConfig, Strategy as DataParallel,
};
use burn_parallel_tp::local_heads;

use crate::config::{Precision, Strategy, TrainConfig};
use crate::error::TrainError;

/// The mesh `[dp_replicate, dp_shard, tp]` of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub replicate: usize,
    pub shard: usize,
    pub tp: usize,
}

impl Layout {
    pub fn world(&self) -> usize {
        self.replicate * self.shard * self.tp
    }

    /// Data-parallel size: the number of distinct batch slices.
    pub fn dp(&self) -> usize {
        self.replicate * self.shard
    }

    /// The sizes `strategy` uses on `cfg.world_size` ranks, or an error naming the size it
    /// cannot use.
    pub fn of(cfg: &TrainConfig, model: &LlamaConfig) -> Result<Self, TrainError> {
        let w = cfg.world_size;
        let s = cfg.strategy;
        let bad = |m: String| Err(TrainError::Config(format!("--strategy {s}: {m}")));
        if w == 0 {
            return bad("--world-size must be at least 1".into());
        }
        if cfg.tp.is_some() && !matches!(s, Strategy::Tp | Strategy::Fsdp2Tp) {
            return bad("--tp applies to tp and fsdp2_tp only".into());
        }
        if cfg.dp_replicate.is_some() && s != Strategy::Hsdp {
            return bad("--dp-replicate applies to hsdp only".into());
        }
        let layout = match s {
            Strategy::Single if w != 1 => {
                return bad(format!("runs on 1 rank, not --world-size {w}"));
            }
            Strategy::Single => Self {
                replicate: 1,
                shard: 1,
                tp: 1,
            },
            Strategy::Ddp => Self {
                replicate: w,
                shard: 1,
                tp: 1,
            },
            Strategy::Fsdp2 => Self {
                replicate: 1,
                shard: w,
                tp: 1,
            },
            Strategy::Hsdp => {
                let r = cfg.dp_replicate.unwrap_or(2);
                if r == 0 || !w.is_multiple_of(r) {
                    return bad(format!(
                        "--dp-replicate {r} does not divide --world-size {w}"
                    ));
                }
                Self {
                    replicate: r,
                    shard: w / r,
                    tp: 1,
                }
            }
            Strategy::Tp => {
                let t = cfg.tp.unwrap_or(w);
                if t != w {
                    return bad(format!(
                        "--tp {t} must equal --world-size {w} (use fsdp2_tp to combine)"
                    ));
                }
                Self {
                    replicate: 1,
                    shard: 1,
                    tp: t,
                }
            }
            Strategy::Fsdp2Tp => {
                let t = cfg.tp.unwrap_or(2);
                if t == 0 || !w.is_multiple_of(t) {
                    return bad(format!("--tp {t} does not divide --world-size {w}"));
                }
                Self {
                    replicate: 1,
                    shard: w / t,
                    tp: t,
                }
            }
        };
        if !matches!(cfg.tp_plan.as_str(), "llama" | "llama-sp") {
            return bad(format!(
                "unknown tp plan `{}` (llama or llama-sp)",
                cfg.tp_plan
            ));
        }
        if layout.tp > 1 {
            local_heads(
                model.num_attention_heads,
                model.num_key_value_heads,
                layout.tp,
            )?;
            if model.vocab_size < layout.tp || model.intermediate_size < layout.tp {
                return bad(format!(
                    "tp = {} leaves a rank an empty vocab or MLP shard",
                    layout.tp
                ));
            }
        }
        if cfg.global_batch < layout.dp() {
            return bad(format!(
                "--global-batch {} gives some of the {} data-parallel ranks no rows",
                cfg.global_batch,
                layout.dp()
            ));
        }
        Ok(layout)
    }

    /// Whether the model goes through `parallelize_model`: every strategy but an f32 `single`
    /// run, which trains the plain model (the reference the others are compared against).
    pub fn parallelized(&self, cfg: &TrainConfig) -> bool {
        self.world() > 1 || mixed_precision(cfg)
    }

    /// Whether parameters are FSDP-sharded (to be gathered before saving): everything
    /// parallelized except plain DDP.
    pub fn sharded(&self, cfg: &TrainConfig) -> bool {
        self.parallelized(cfg) && self.data_parallel(cfg) != DataParallel::Ddp
    }

    /// DDP replicates f32 parameters; with a mixed-precision policy it runs as HSDP with
    /// one-rank shard groups (PyTorch's `replicate` is FSDP with a shard size of one).
    fn data_parallel(&self, cfg: &TrainConfig) -> DataParallel {
        match cfg.strategy {
            Strategy::Ddp if !mixed_precision(cfg) => DataParallel::Ddp,
            Strategy::Ddp | Strategy::Hsdp if self.replicate > 1 => DataParallel::Hsdp,
            _ => DataParallel::Fsdp2,
        }
    }

    /// The parallelizer's config for this run.
    pub fn distributed_config(&self, cfg: &TrainConfig) -> DistributedConfig {
        let dtype = |p: Precision| match p {
            Precision::F32 => None,
            Precision::Bf16 => Some(Dtype::Bf16),
        };
        let strategy = self.data_parallel(cfg);
        let ddp = strategy == DataParallel::Ddp;
        DistributedConfig {
            strategy,
            world_size: Some(self.world()),
            // DDP's data-parallel group is the whole dp dimension.
            dp_size: Some(if ddp { self.dp() } else { self.shard }),
            dp_replicate_size: if ddp { 1 } else { self.replicate },
            tp_size: self.tp,
            sequence_parallel: self.tp > 1 && cfg.tp_plan == "llama-sp",
            mp_policy: MixedPrecisionConfig {
                param_dtype: dtype(cfg.param_dtype),
                reduce_dtype: dtype(cfg.reduce_dtype),
                output_dtype: None,
                cast_forward_inputs: true,
            },
            reshard_after_forward: Some(cfg.reshard_after_forward),
            enable_fsdp2_prefetch: cfg.prefetch,
            ..DistributedConfig::default()
        }
    }
}

fn mixed_precision(cfg: &TrainConfig) -> bool {
    cfg.param_dtype == Precision::Bf16 || cfg.reduce_dtype == Precision::Bf16
}
