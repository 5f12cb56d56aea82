//! The projections a family's checkpoint stores fused (Phi-3): one table that the reader
//! splits by, the writer joins by, and the trainer's LoRA check names.

use crate::config::LlamaConfig;

/// Each fused projection's module path within a layer, and its parts' paths in row order (the
/// decoder's own projections).
pub const FUSED_PROJECTIONS: [(&str, &[&str]); 2] = [
    (
        "self_attn.qkv_proj",
        &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ),
    ("mlp.gate_up_proj", &["mlp.gate_proj", "mlp.up_proj"]),
];

/// The output rows of each part of `fused` (a [`FUSED_PROJECTIONS`] path) under `config`: q by
/// the query heads, k and v by the kv heads; gate and up by the MLP's width.
pub(crate) fn part_rows(config: &LlamaConfig, fused: &str) -> Vec<usize> {
    let kv = config.num_key_value_heads * config.head_dim;
    match fused {
        "self_attn.qkv_proj" => vec![config.num_attention_heads * config.head_dim, kv, kv],
        _ => vec![config.intermediate_size; 2],
    }
}

/// The module name (last path segment) of a [`FUSED_PROJECTIONS`] path (`qkv_proj`).
pub fn module_name(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

/// Each part's module name with its fused projection's (`("q_proj", "qkv_proj")`).
pub fn fused_part_names() -> impl Iterator<Item = (&'static str, &'static str)> {
    FUSED_PROJECTIONS.iter().flat_map(|(fused, parts)| {
        parts
            .iter()
            .map(move |part| (module_name(part), module_name(fused)))
    })
}
