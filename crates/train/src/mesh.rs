//! What the run's `DistributedConfig` means for the model: the mesh it gives on the run's
//! ranks, checked against the model's shapes (experts, heads, vocabulary) and the global batch
//! before any rank starts. Everything else about the config the parallelizer validates.

use burn_parallel_comm::chunk::chunk_sizes;
use burn_parallel_describe::plan_name;
use burn_parallel_models::{LLAMA_PLAN, LlamaConfig, ModelError};
use burn_parallel_parallelizer::{Checkpointing, Plan, TpShardPlan};
use burn_parallel_tp::local_heads;

use crate::config::TrainConfig;
use crate::error::{TrainError, flag_error};

/// What `cfg`'s distributed config means on its ranks (the plan each rank's `MeshContext` is
/// built from), or an error naming the setting or size it cannot use.
pub fn mesh_plan(cfg: &TrainConfig, model: &LlamaConfig) -> Result<Plan, TrainError> {
    let d = &cfg.distributed;
    let s = d.strategy;
    // Every refusal names the strategy, since it decides the sizes checked here.
    let bad = |m: String| Err(flag_error("--strategy", format!("{s}: {m}")));
    let world = cfg.world_size()?;
    if let Some(TpShardPlan::Named(name)) = &d.tp_shard_plan
        && plan_name(name).0 != LLAMA_PLAN.name
    {
        return bad(format!(
            "unknown tp plan `{name}` (the Llama's are llama and llama-sp)"
        ));
    }
    if d.ep_size > 1 {
        let ep = d.ep_size;
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
    let plan = d
        .plan(world)
        .map_err(|e| flag_error("--strategy", format!("{s}: {e}")))?;
    // Refused here rather than at the first forward of every rank.
    if model.moe.is_some() && matches!(plan.checkpointing(), Some(Checkpointing::Layers(_))) {
        return Err(ModelError::CheckpointedExperts.into());
    }
    let sizes = plan.sizes();
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
    if plan.async_tensor_parallel() && sizes.tp > 1 {
        // Each of the tp ranks' sequence chunks (of this cp rank's tokens) must hold a token.
        let tokens = cfg.seq_len / sizes.cp.max(1);
        if chunk_sizes(tokens, sizes.tp).contains(&0) {
            return Err(flag_error(
                "--seq-len",
                format!(
                    "{} leaves a tensor-parallel rank no token of the sequence under async TP \
                     ({tokens} tokens over tp = {}): use at least {} tokens, or \
                     enable_async_tensor_parallel = false",
                    cfg.seq_len,
                    sizes.tp,
                    min_tokens(sizes.tp) * sizes.cp.max(1)
                ),
            ));
        }
    }
    if sizes.cp > 1 {
        let cp = sizes.cp;
        if !cfg.seq_len.is_multiple_of(2 * cp) {
            return bad(format!(
                "--seq-len {} does not split over --cp {cp}: each row is cut in 2 x cp = {} \
                 equal chunks (head-tail load balancing); use a multiple of {}",
                cfg.seq_len,
                2 * cp,
                2 * cp
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
    Ok(plan)
}

/// The fewest tokens whose pad-to-ceil chunks over `tp` ranks leave none empty.
fn min_tokens(tp: usize) -> usize {
    (tp..)
        .find(|&t| !chunk_sizes(t, tp).contains(&0))
        .expect("tp x tp tokens always fill every chunk")
}
