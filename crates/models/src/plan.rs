//! The Llama's tensor-parallel plans: `llama`, and `llama-sp` with sequence parallelism.

use burn_parallel_describe::NamedPlan;
use burn_parallel_tp::{ParallelStyle, TpPlan};

/// The Llama's tensor-parallel plan by Hugging Face module path, as `#[parallelize(plan =
/// LLAMA_PLAN)]` declares it: `llama`, or `llama-sp` for its sequence-parallel variant.
pub const LLAMA_PLAN: NamedPlan = NamedPlan::new("llama", llama_plan);

/// q/k/v/gate/up colwise, o/down rowwise, a vocab-parallel `embed_tokens` and a colwise
/// `lm_head` (for `loss_parallel`); with `sequence_parallel`, activations are sharded on the
/// sequence dim (1 of `[batch, seq, hidden]`) between the tp regions, norms included: the
/// pre-norms, and the norms after attention and the MLP of the post-norm (OLMo 2) and sandwich
/// (Gemma) layers, which read the rowwise layers' sequence-sharded outputs. A model without
/// some of them (a Llama has no `post_feedforward_layernorm`) leaves those entries unmatched.
pub fn llama_plan(sequence_parallel: bool) -> TpPlan {
    use ParallelStyle as S;
    const SEQ: usize = 1;
    let (col, row, embed, head) = if sequence_parallel {
        (
            S::colwise_sp(SEQ),
            S::rowwise_sp(SEQ),
            S::vocab_parallel_sp(SEQ),
            S::colwise_sp(SEQ),
        )
    } else {
        (
            S::colwise(),
            S::rowwise(),
            S::vocab_parallel(),
            S::colwise(),
        )
    };
    let mut plan = TpPlan::new().with("embed_tokens", embed);
    for p in ["q_proj", "k_proj", "v_proj"] {
        plan = plan.with(format!("layers.*.self_attn.{p}"), col);
    }
    plan = plan.with("layers.*.self_attn.o_proj", row);
    for p in ["gate_proj", "up_proj"] {
        plan = plan.with(format!("layers.*.mlp.{p}"), col);
    }
    plan = plan.with("layers.*.mlp.down_proj", row);
    if sequence_parallel {
        for p in [
            "layers.*.input_layernorm",
            "layers.*.post_attention_layernorm",
            "norm",
        ] {
            plan = plan.with(p, S::sequence_parallel(SEQ));
        }
        // Only the post-norm and sandwich families have them.
        for p in [
            "layers.*.pre_feedforward_layernorm",
            "layers.*.post_feedforward_layernorm",
        ] {
            plan = plan.with_optional(p, S::sequence_parallel(SEQ));
        }
    }
    plan.with("lm_head", head)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_plans_name_the_llama_modules() {
        let plan = llama_plan(false);
        let style = |p: &str| plan.entries().iter().find(|(k, _)| k == p).map(|(_, s)| *s);
        assert_eq!(
            style("layers.*.self_attn.k_proj"),
            Some(ParallelStyle::colwise())
        );
        assert_eq!(
            style("layers.*.mlp.down_proj"),
            Some(ParallelStyle::rowwise())
        );
        assert_eq!(style("embed_tokens"), Some(ParallelStyle::vocab_parallel()));
        assert_eq!(style("lm_head"), Some(ParallelStyle::colwise()));
        assert_eq!(style("norm"), None);

        let sp = llama_plan(true);
        assert_eq!(sp.entries().len(), plan.entries().len() + 5);
        let style = |p: &str| sp.entries().iter().find(|(k, _)| k == p).map(|(_, s)| *s);
        assert_eq!(style("norm"), Some(ParallelStyle::sequence_parallel(1)));
        assert_eq!(
            style("layers.*.self_attn.o_proj").unwrap().to_string(),
            "Rowwise(Sharded(-1) -> Sharded(1))"
        );
    }
}
