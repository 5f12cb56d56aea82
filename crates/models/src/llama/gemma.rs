//! Gemma's conventions at the model's ends: embeddings scaled by `sqrt(hidden)` on the way in,
//! logits soft-capped on the way out (Gemma 2). The other families pass both through.

use burn::tensor::Tensor;

use crate::config::LlamaConfig;

/// The token embeddings as the model feeds them to its first layer: Gemma multiplies them by
/// `sqrt(hidden)` (in their dtype); the others use them as they are.
pub(crate) fn scale_embeddings(config: &LlamaConfig, x: Tensor<3>) -> Tensor<3> {
    match config.family.row().gemma {
        true => {
            let scale = (config.hidden_size as f64).sqrt() as f32;
            x.mul_scalar(scale)
        }
        false => x,
    }
}

/// The logits as the model returns them: `cap * tanh(logits / cap)` under Gemma 2's
/// `final_logit_softcapping` (elementwise, so a rank's vocab chunk under tensor parallelism
/// is capped alike).
pub(crate) fn cap_logits(config: &LlamaConfig, logits: Tensor<3>) -> Tensor<3> {
    match config.final_logit_softcapping {
        Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
        None => logits,
    }
}
