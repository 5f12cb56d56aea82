//! The Hugging Face architectures the decoder loads, as one table: each `model_type`, its class
//! name, and what it changes in the Llama decoder. The next architecture is one row here plus
//! whatever new block it needs.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ModelError;
use crate::json_keys::count_key;
use crate::moe_config::MoeFlavor;

/// A decoder family ([`LlamaConfig::family`](crate::LlamaConfig::family)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Family {
    /// `LlamaForCausalLM` (SmolLM, Llama 2/3).
    #[default]
    Llama,
    /// `MistralForCausalLM`: a Llama with sliding-window attention (`sliding_window`).
    Mistral,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v biases, no o_proj bias.
    Qwen2,
    /// `Qwen3ForCausalLM`: a per-head RMSNorm of queries and keys.
    Qwen3,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention, sparse MoE blocks.
    Qwen3Moe,
    /// `MixtralForCausalLM`: Mistral's attention, sparse MoE blocks.
    Mixtral,
    /// `Olmo2ForCausalLM`: norms after attention and after the MLP (none before), and a
    /// q/k RMSNorm over the whole projection.
    Olmo2,
    /// `Gemma2ForCausalLM`: Gemma's conventions (below), attention and final logit
    /// soft-capping, sliding window on every other layer.
    Gemma2,
    /// `Gemma3ForCausalLM` (`gemma3_text`): norms before and after attention and the MLP,
    /// RMSNorms scaling by `1 + w`, embeddings scaled by `sqrt(hidden)`, GeGLU (tanh GELU),
    /// per-head q/k norms, `query_pre_attn_scalar`, and sliding-window layers with their own
    /// rotary base.
    Gemma3,
    /// `Phi3ForCausalLM` (Phi-3, Phi-3.5, Phi-4-mini): q/k/v and gate/up fused in the
    /// checkpoint (`qkv_proj`, `gate_up_proj`), partial rotary (`partial_rotary_factor`), a
    /// sliding window on every layer when `sliding_window` is set.
    Phi3,
}

/// Where a family's decoder layer puts its norms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormLayout {
    /// Before attention and before the MLP (Llama).
    Pre,
    /// After attention and after the MLP, on their outputs (OLMo 2).
    Post,
    /// Before and after each (Gemma).
    Sandwich,
}

/// Where a family normalizes queries and keys before the rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// Not at all.
    None,
    /// Each head over its `head_dim` (Qwen3).
    PerHead,
    /// The whole projection, every head at once (OLMo 2).
    Whole,
}

/// Which layers a family's `sliding_window` applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowRule {
    /// The family has no sliding window.
    Never,
    /// Every layer, when `sliding_window` is set (Mistral, Mixtral).
    Always,
    /// Layers from `max_window_layers` on, when `use_sliding_window` (Qwen2, Qwen3), or those
    /// `layer_types` marks `sliding_attention`.
    Opted,
    /// Every layer but each `sliding_window_pattern`-th (default: the value given; Gemma 2
    /// slides on every other layer, Gemma 3 on five of six), or those `layer_types` marks.
    Pattern(usize),
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub struct FamilyRow {
    /// The family.
    pub family: Family,
    /// `config.json`'s `model_type`.
    pub model_type: &'static str,
    /// The class name `architectures` lists.
    pub architecture: &'static str,
    /// q/k/v always carry a bias and o_proj never (Qwen2); otherwise `attention_bias` applies
    /// to all four.
    pub qkv_bias: bool,
    /// The RMSNorm of queries and keys (`q_norm`, `k_norm`) before the rotary embedding.
    pub qk_norm: QkNorm,
    /// Where the decoder layer's norms are.
    pub norms: NormLayout,
    /// Gemma's conventions: RMSNorm scales by `1 + w`, the embeddings are multiplied by
    /// `sqrt(hidden)`, the head is tied by default, scores scale by `query_pre_attn_scalar`.
    pub gemma: bool,
    /// Sliding-window layers rotate with their own base, `rope_local_base_freq` (Gemma 3).
    pub local_rope: bool,
    /// Where `sliding_window` applies.
    pub window: WindowRule,
    /// The sparse MoE flavour, for MoE families.
    pub moe: Option<MoeFlavor>,
    /// The checkpoint stores q, k and v as one `qkv_proj` and gate and up as one `gate_up_proj`
    /// (Phi-3), which load as the decoder's own projections and are written back fused.
    pub fused: bool,
}

/// Every family the decoder loads.
pub const FAMILIES: [FamilyRow; 10] = [
    FamilyRow {
        family: Family::Llama,
        model_type: "llama",
        architecture: "LlamaForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::None,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Never,
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Mistral,
        model_type: "mistral",
        architecture: "MistralForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::None,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Always,
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Qwen2,
        model_type: "qwen2",
        architecture: "Qwen2ForCausalLM",
        qkv_bias: true,
        qk_norm: QkNorm::None,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Opted,
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Qwen3,
        model_type: "qwen3",
        architecture: "Qwen3ForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::PerHead,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Opted,
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Qwen3Moe,
        model_type: "qwen3_moe",
        architecture: "Qwen3MoeForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::PerHead,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Opted,
        moe: Some(MoeFlavor::Qwen3Moe),
        fused: false,
    },
    FamilyRow {
        family: Family::Mixtral,
        model_type: "mixtral",
        architecture: "MixtralForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::None,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Always,
        moe: Some(MoeFlavor::Mixtral),
        fused: false,
    },
    FamilyRow {
        family: Family::Olmo2,
        model_type: "olmo2",
        architecture: "Olmo2ForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::Whole,
        norms: NormLayout::Post,
        gemma: false,
        local_rope: false,
        window: WindowRule::Never,
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Gemma2,
        model_type: "gemma2",
        architecture: "Gemma2ForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::None,
        norms: NormLayout::Sandwich,
        gemma: true,
        local_rope: false,
        window: WindowRule::Pattern(2),
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Gemma3,
        model_type: "gemma3_text",
        architecture: "Gemma3ForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::PerHead,
        norms: NormLayout::Sandwich,
        gemma: true,
        local_rope: true,
        window: WindowRule::Pattern(6),
        moe: None,
        fused: false,
    },
    FamilyRow {
        family: Family::Phi3,
        model_type: "phi3",
        architecture: "Phi3ForCausalLM",
        qkv_bias: false,
        qk_norm: QkNorm::None,
        norms: NormLayout::Pre,
        gemma: false,
        local_rope: false,
        window: WindowRule::Always,
        moe: None,
        fused: true,
    },
];

impl Family {
    /// This family's row of [`FAMILIES`].
    pub fn row(self) -> &'static FamilyRow {
        FAMILIES
            .iter()
            .find(|r| r.family == self)
            .expect("every family has a row")
    }

    /// The `model_type`s the decoder loads, for errors.
    pub fn supported() -> String {
        FAMILIES.map(|r| r.model_type).join(", ")
    }
}

/// Attention over the last `size` keys only (each query sees keys `i - size < j <= i`), on the
/// layers `layers` marks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlidingWindow {
    /// Keys each query sees, itself included.
    pub size: usize,
    /// Per decoder layer, whether it uses the window.
    pub layers: Vec<bool>,
}

impl SlidingWindow {
    /// The window of layer `layer`, if it has one.
    pub fn of_layer(&self, layer: usize) -> Option<usize> {
        self.layers
            .get(layer)
            .copied()
            .unwrap_or(false)
            .then_some(self.size)
    }
}

fn bad(reason: String) -> ModelError {
    ModelError::BadConfig {
        path: "config.json".into(),
        reason,
    }
}

/// The row of `o`'s `model_type`, checked against `architectures` when given: another
/// architecture is an error that lists the supported ones.
pub(crate) fn family_row(o: &Map<String, Value>) -> Result<&'static FamilyRow, ModelError> {
    let model_type = o
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("no `model_type`".into()))?;
    let row = FAMILIES
        .iter()
        .find(|r| r.model_type == model_type)
        .ok_or_else(|| ModelError::UnsupportedArchitecture {
            what: "model_type",
            found: model_type.to_string(),
            supported: Family::supported(),
        })?;
    if let Some(archs) = o.get("architectures").and_then(Value::as_array) {
        let names: Vec<&str> = archs.iter().filter_map(Value::as_str).collect();
        let stem = row.architecture.trim_end_matches("ForCausalLM");
        if names.iter().any(|a| !a.starts_with(stem)) {
            return Err(ModelError::UnsupportedArchitecture {
                what: "architectures",
                found: names.join(", "),
                supported: Family::supported(),
            });
        }
    }
    Ok(row)
}

/// The sliding window of a config of `row`'s family with `layers` decoder layers, as
/// transformers reads it: `None` when the family has none, `sliding_window` is null, or the
/// family opts in and `use_sliding_window` is off.
pub(crate) fn sliding_window(
    o: &Map<String, Value>,
    row: &FamilyRow,
    layers: usize,
) -> Result<Option<SlidingWindow>, ModelError> {
    if row.window == WindowRule::Never {
        return Ok(None);
    }
    let Some(size) = count_key(o, "sliding_window")? else {
        return Ok(None);
    };
    if size == 0 {
        return Err(bad("sliding_window is 0 (a query must see itself)".into()));
    }
    let marked = match o.get("layer_types").and_then(Value::as_array) {
        Some(types) => {
            if types.len() != layers {
                return Err(bad(format!(
                    "layer_types has {} entries for {layers} layers",
                    types.len()
                )));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    other => Err(bad(format!(
                        "layer_types entry {other:?} (sliding_attention or full_attention)"
                    ))),
                })
                .collect::<Result<Vec<_>, _>>()?
        }
        None => match row.window {
            WindowRule::Always => vec![true; layers],
            WindowRule::Pattern(default) => {
                let pattern = count_key(o, "sliding_window_pattern")?
                    .unwrap_or(default)
                    .max(1);
                (0..layers).map(|l| (l + 1) % pattern != 0).collect()
            }
            _ => {
                let opted = o
                    .get("use_sliding_window")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let from = count_key(o, "max_window_layers")?.unwrap_or(layers);
                (0..layers).map(|l| opted && l >= from).collect()
            }
        },
    };
    Ok(marked.iter().any(|m| *m).then_some(SlidingWindow {
        size,
        layers: marked,
    }))
}

/// The keys `config.json` needs to give the window back (none without one).
pub(crate) fn window_keys(row: &FamilyRow, window: Option<&SlidingWindow>) -> Map<String, Value> {
    let mut keys = Map::new();
    let Some(w) = window else {
        if row.window != WindowRule::Never {
            keys.insert("sliding_window".into(), Value::Null);
        }
        return keys;
    };
    keys.insert("sliding_window".into(), w.size.into());
    if row.window == WindowRule::Opted {
        keys.insert("use_sliding_window".into(), true.into());
        let first = w.layers.iter().position(|s| *s).unwrap_or(w.layers.len());
        keys.insert("max_window_layers".into(), first.into());
    }
    // Every layer sliding under Mistral's rule is what `sliding_window` alone says (and
    // transformers 5 reads a Mistral config with layer_types as a Ministral).
    if row.window == WindowRule::Always && w.layers.iter().all(|s| *s) {
        return keys;
    }
    let types: Vec<Value> = w
        .layers
        .iter()
        .map(|s| match s {
            true => "sliding_attention".into(),
            false => "full_attention".into(),
        })
        .collect();
    keys.insert("layer_types".into(), types.into());
    keys
}

#[cfg(test)]
mod tests {
    use crate::LlamaConfig;

    use super::*;

    /// A config.json of `model_type` (3 layers) with `extra` keys.
    fn config(model_type: &str, architecture: &str, extra: &str) -> LlamaConfig {
        let text = format!(
            r#"{{"architectures":["{architecture}"],"model_type":"{model_type}",
            "vocab_size":101,"hidden_size":24,"intermediate_size":37,"num_hidden_layers":3,
            "num_attention_heads":6,"num_key_value_heads":2,"hidden_act":"silu"{extra}}}"#
        );
        LlamaConfig::from_json(&text).unwrap_or_else(|e| panic!("{model_type}: {e}"))
    }

    #[test]
    fn each_family_reads_what_it_changes() {
        let qwen2 = config(
            "qwen2",
            "Qwen2ForCausalLM",
            r#","sliding_window":4096,"use_sliding_window":false,"max_window_layers":2"#,
        );
        assert_eq!(qwen2.family, Family::Qwen2);
        assert!(qwen2.attention_bias && !qwen2.o_proj_bias());
        assert_eq!(qwen2.sliding_window, None, "use_sliding_window is off");
        let opted = config(
            "qwen2",
            "Qwen2ForCausalLM",
            r#","sliding_window":8,"use_sliding_window":true,"max_window_layers":1"#,
        );
        assert_eq!(
            (opted.window_of(0), opted.window_of(1), opted.window_of(2)),
            (None, Some(8), Some(8))
        );

        let qwen3 = config("qwen3", "Qwen3ForCausalLM", r#","head_dim":8"#);
        assert!(qwen3.qk_norm && !qwen3.attention_bias && qwen3.moe.is_none());
        assert_eq!(qwen3.head_dim, 8);

        let mistral = config("mistral", "MistralForCausalLM", r#","sliding_window":5"#);
        assert_eq!(
            (mistral.window_of(0), mistral.window_of(2)),
            (Some(5), Some(5))
        );
        let v03 = config("mistral", "MistralForCausalLM", r#","sliding_window":null"#);
        assert_eq!(v03.sliding_window, None);
        let typed = config(
            "mistral",
            "MistralForCausalLM",
            r#","sliding_window":5,"layer_types":["full_attention","sliding_attention","full_attention"]"#,
        );
        assert_eq!(
            (typed.window_of(0), typed.window_of(1), typed.window_of(2)),
            (None, Some(5), None)
        );

        let olmo2 = config("olmo2", "Olmo2ForCausalLM", "");
        assert!(olmo2.qk_norm_whole() && olmo2.family.row().norms == NormLayout::Post);
        assert!(!qwen3.qk_norm_whole());

        // Each reads back from the config.json it writes.
        for c in [qwen2, opted, qwen3, mistral, v03, typed, olmo2] {
            let mut back = LlamaConfig::from_json(&c.to_hf_json().to_string()).unwrap();
            back.dtype = None;
            assert_eq!(back, c, "{:?}", c.family);
        }
    }

    #[test]
    fn bad_windows_and_unknown_families_are_named() {
        let text = |model_type: &str, extra: &str| {
            format!(
                r#"{{"model_type":"{model_type}","vocab_size":11,"hidden_size":8,
                "intermediate_size":9,"num_hidden_layers":2,"num_attention_heads":2{extra}}}"#
            )
        };
        let err = |t: String| LlamaConfig::from_json(&t).unwrap_err().to_string();
        let msg = err(text("mistral", r#","sliding_window":0"#));
        assert!(msg.contains("sliding_window is 0"), "{msg}");
        let msg = err(text(
            "mistral",
            r#","sliding_window":4,"layer_types":["full_attention"]"#,
        ));
        assert!(
            msg.contains("layer_types has 1 entries for 2 layers"),
            "{msg}"
        );
        let msg = err(text("gpt_neox", ""));
        assert!(
            msg.contains("`gpt_neox`") && msg.contains(&Family::supported()),
            "{msg}"
        );
    }
}
