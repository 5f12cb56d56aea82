//! What a run's flags mean for the parallelizer: the `DistributedConfig` it runs with and the
//! mesh that gives on `--world-size` ranks, checked (with the model's shapes) before any rank
//! starts.

use burn_parallel_models::LlamaConfig;
use burn_parallel_parallelizer::{
    DistributedConfig, Dtype, MegatronFsdpConfig, MeshSizes, MixedPrecisionConfig, Strategy,
    ZeroDpStrategy,
};
use burn_parallel_tp::local_heads;

use crate::config::{Precision, TrainConfig};
use crate::error::TrainError;

/// The parallelizer's config for a run.
pub fn distributed_config(cfg: &TrainConfig) -> DistributedConfig {
    let dtype = |p: Precision| match p {
        Precision::F32 => None,
        Precision::Bf16 => Some(Dtype::Bf16),
    };
    let tp_size = match cfg.strategy {
        Strategy::Fsdp2Tp => cfg.tp.unwrap_or(2),
        _ => cfg.tp.unwrap_or(1),
    };
    let zero = cfg.zero_dp_strategy.unwrap_or_default();
    // ZeRO-1 and ZeRO-2 keep gathered weights through backward whatever the resharding flag
    // (whose default is on) says.
    let reshard = match cfg.strategy {
        Strategy::MegatronFsdp if zero != ZeroDpStrategy::OptimGradsParams => None,
        _ => Some(cfg.reshard_after_forward),
    };
    DistributedConfig {
        strategy: cfg.strategy,
        world_size: Some(cfg.world_size),
        dp_replicate_size: match cfg.strategy {
            Strategy::Hsdp => cfg.dp_replicate.unwrap_or(2),
            _ => cfg.dp_replicate.unwrap_or(1),
        },
        tp_size,
        ep_size: cfg.ep.unwrap_or(1),
        sequence_parallel: cfg.sequence_parallel(),
        mp_policy: MixedPrecisionConfig {
            param_dtype: dtype(cfg.param_dtype),
            reduce_dtype: dtype(cfg.reduce_dtype),
            output_dtype: None,
            cast_forward_inputs: true,
        },
        reshard_after_forward: reshard,
        enable_fsdp2_prefetch: cfg.prefetch,
        megatron_fsdp: match cfg.strategy {
            Strategy::MegatronFsdp => MegatronFsdpConfig {
                zero_dp_strategy: zero,
                overlap_param_gather: cfg.prefetch,
                bucket_size: cfg.bucket_size,
                ..MegatronFsdpConfig::default()
            },
            _ => MegatronFsdpConfig::default(),
        },
        ..DistributedConfig::default()
    }
}

/// The mesh `cfg` runs on, or an error naming the flag or size it cannot use.
pub fn mesh_sizes(cfg: &TrainConfig, model: &LlamaConfig) -> Result<MeshSizes, TrainError> {
    let s = cfg.strategy;
    let bad = |m: String| Err(TrainError::Config(format!("--strategy {s}: {m}")));
    if cfg.world_size == 0 {
        return bad("--world-size must be at least 1".into());
    }
    if cfg.tp.is_some() && !matches!(s, Strategy::Tp | Strategy::Fsdp2Tp) {
        return bad("--tp applies to tp and fsdp2_tp only".into());
    }
    if cfg.dp_replicate.is_some() && !matches!(s, Strategy::Hsdp | Strategy::MegatronFsdp) {
        return bad("--dp-replicate applies to hsdp and megatron_fsdp only".into());
    }
    if (cfg.zero_dp_strategy.is_some() || cfg.bucket_size.is_some()) && s != Strategy::MegatronFsdp
    {
        return bad("--zero-dp-strategy and --bucket-size apply to megatron_fsdp only".into());
    }
    if let Some(ep) = cfg.ep.filter(|&ep| ep > 1) {
        let Some(moe) = &model.moe else {
            return bad(format!(
                "--ep {ep} needs a mixture-of-experts model (--model tiny-moe, or a qwen3_moe or \
                 mixtral config or checkpoint)"
            ));
        };
        if !moe.num_experts.is_multiple_of(ep) {
            return bad(format!(
                "--ep {ep} does not divide the model's {} experts",
                moe.num_experts
            ));
        }
    }
    let sizes = distributed_config(cfg)
        .validate(cfg.world_size)
        .map_err(|e| TrainError::Config(format!("--strategy {s}: {e}")))?;
    if sizes.tp > 1 {
        local_heads(
            model.num_attention_heads,
            model.num_key_value_heads,
            sizes.tp,
        )?;
        if model.vocab_size < sizes.tp || model.intermediate_size < sizes.tp {
            return bad(format!(
                "tp = {} leaves a rank an empty vocab or MLP shard",
                sizes.tp
            ));
        }
    }
    if cfg.global_batch < sizes.dp() {
        return bad(format!(
            "--global-batch {} gives some of the {} data-parallel ranks no rows",
            cfg.global_batch,
            sizes.dp()
        ));
    }
    Ok(sizes)
}
