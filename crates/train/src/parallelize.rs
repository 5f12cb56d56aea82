//! Every strategy's wiring in one place (what the parallelizer's `parallelize_model` will
//! replace): the mesh sizes a strategy uses, and turning one replicated model into this
//! rank's parallel model.

use burn::tensor::{DType, FloatDType};
use burn_parallel_dist::DeviceMesh;
use burn_parallel_fsdp::{FsdpConfig, MixedPrecisionPolicy, fully_shard};
use burn_parallel_models::{Llama, LlamaConfig};
use burn_parallel_tp::{TpApplier, TpModule, local_heads};

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

    pub const DIMS: [&'static str; 3] = ["dp_replicate", "dp_shard", "tp"];

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
        if layout.tp > 1 && (cfg.param_dtype == Precision::Bf16) {
            // Tp<Embedding>'s vocab mask is f32 and Burn rejects mixed-dtype ops.
            return bad("bf16 compute with tensor parallelism is not supported yet (the vocab-parallel embedding mixes bf16 and f32); use --param-dtype f32".into());
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

    /// Whether the model goes through `fully_shard` (also on one rank, for the mixed-precision
    /// policy).
    pub fn uses_fsdp(&self, cfg: &TrainConfig) -> bool {
        self.dp() > 1 || cfg.param_dtype == Precision::Bf16 || cfg.reduce_dtype == Precision::Bf16
    }
}

fn dtype(p: Precision) -> Option<FloatDType> {
    match p {
        Precision::F32 => None,
        Precision::Bf16 => Some(FloatDType::BF16),
    }
}

/// This rank's parallel model. Every rank calls it with the same replicated model.
/// - tp > 1: the `llama` / `llama-sp` plan over the tp group (gradients of replicated
///   parameters in the sequence-parallel region reduced in the reduce dtype);
/// - then, with data parallelism or mixed precision, `fully_shard` over dp_shard (HSDP: plus
///   an all-reduce across dp_replicate; DDP is the case of a 1-rank shard group), each decoder
///   layer one FSDP unit with forward prefetch.
pub fn parallelize(
    model: Llama,
    cfg: &TrainConfig,
    layout: &Layout,
    mesh: &DeviceMesh,
) -> Result<Llama, TrainError> {
    let mut model = model;
    if layout.tp > 1 {
        let plan = model.tp_plan(&cfg.tp_plan)?;
        let mut cx = TpApplier::new(&plan, mesh.group("tp")?);
        if cfg.reduce_dtype == Precision::Bf16 {
            cx = cx.with_reduce_dtype(DType::BF16);
        }
        model = model.apply_tp("", &mut cx)?;
        cx.finish().check_entries()?;
    }
    if layout.uses_fsdp(cfg) {
        let shard = mesh.group("dp_shard")?.clone();
        let fsdp = if layout.replicate > 1 {
            FsdpConfig::hybrid(shard, mesh.group("dp_replicate")?.clone())
        } else {
            FsdpConfig::new(shard)
        };
        let policy = MixedPrecisionPolicy {
            param_dtype: dtype(cfg.param_dtype),
            reduce_dtype: dtype(cfg.reduce_dtype),
            output_dtype: None,
            cast_forward_inputs: true,
        };
        let fsdp = fsdp
            .reshard_after_forward(cfg.reshard_after_forward)
            .mixed_precision(policy);
        model = fully_shard(model, &fsdp)?.with_fsdp_units(cfg.prefetch);
    }
    Ok(model)
}
