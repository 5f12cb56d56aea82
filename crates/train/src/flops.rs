//! The model FLOPs of a training step, the count GFLOP/s figures use (benches/step.rs and
//! scripts/bench-torch.py compute the same).

use burn_parallel_models::LlamaConfig;

/// FLOPs of one training step (forward and backward) of `model` over `rows x seq_len` tokens:
/// 6 x (the Linear and lm_head weights) x tokens, plus causal attention's
/// 6 x layers x seq_len x heads x head_dim x tokens (half of the full score and value
/// matmuls). Embedding lookups, norms and element-wise work are not counted. A mixture of
/// experts counts its `top_k` routed experts per token.
pub fn step_flops(model: &LlamaConfig, rows: usize, seq_len: usize) -> f64 {
    let (h, layers) = (model.hidden_size as f64, model.num_hidden_layers as f64);
    let q = (model.num_attention_heads * model.head_dim) as f64;
    let kv = (model.num_key_value_heads * model.head_dim) as f64;
    let mlp = match &model.moe {
        Some(moe) => 3.0 * h * (moe.moe_intermediate_size * moe.num_experts_per_tok) as f64,
        None => 3.0 * h * model.intermediate_size as f64,
    };
    let linear = layers * (h * q + 2.0 * h * kv + q * h + mlp) + h * model.vocab_size as f64;
    let tokens = (rows * seq_len) as f64;
    6.0 * linear * tokens + 6.0 * layers * seq_len as f64 * q * tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tiny_llamas_step_is_counted_by_hand() {
        // hidden 64, q 64, kv 32, intermediate 172, 4 layers, vocab 256; 8 x 128 tokens.
        let linear =
            4.0 * (64.0 * 64.0 * 2.0 + 2.0 * 64.0 * 32.0 + 3.0 * 64.0 * 172.0) + 64.0 * 256.0;
        let expected = 6.0 * linear * 1024.0 + 6.0 * 4.0 * 128.0 * 64.0 * 1024.0;
        assert_eq!(step_flops(&LlamaConfig::tiny(), 8, 128), expected);
    }
}
