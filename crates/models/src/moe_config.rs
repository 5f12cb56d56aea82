//! The mixture-of-experts part of a `config.json`: Qwen3-MoE's and Mixtral's keys, with
//! transformers' defaults.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::ModelError;
use crate::json_keys::count_key;

/// Which Hugging Face family a MoE model follows: it decides the checkpoint names and the
/// config keys written back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoeFlavor {
    /// `Qwen3MoeForCausalLM`: `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`, q/k norms.
    Qwen3Moe,
    /// `MixtralForCausalLM`: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`.
    Mixtral,
}

impl MoeFlavor {
    /// The `model_type` of `config.json`.
    pub fn model_type(self) -> &'static str {
        self.family().row().model_type
    }

    /// The class name in `architectures`.
    pub fn architecture(self) -> &'static str {
        self.family().row().architecture
    }

    /// The decoder family of this flavour.
    pub fn family(self) -> crate::Family {
        match self {
            Self::Qwen3Moe => crate::Family::Qwen3Moe,
            Self::Mixtral => crate::Family::Mixtral,
        }
    }
}

/// One of an expert's three SwiGLU projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertProj {
    /// `gate_proj` / Mixtral's `w1`, `hidden -> intermediate`.
    Gate,
    /// `up_proj` / `w3`, `hidden -> intermediate`.
    Up,
    /// `down_proj` / `w2`, `intermediate -> hidden`.
    Down,
}

impl ExpertProj {
    /// The three, in the order [`Experts`](crate::Experts) holds them.
    pub const ALL: [Self; 3] = [Self::Gate, Self::Up, Self::Down];
}

impl MoeFlavor {
    /// The MoE block's checkpoint prefix in decoder layer `layer` (`model.layers.{i}`).
    pub fn block_prefix(self, layer: &str) -> String {
        match self {
            Self::Qwen3Moe => format!("{layer}.mlp"),
            Self::Mixtral => format!("{layer}.block_sparse_moe"),
        }
    }

    /// The router's weight name in decoder layer `layer`.
    pub fn router_name(self, layer: &str) -> String {
        format!("{}.gate.weight", self.block_prefix(layer))
    }

    /// Expert `expert`'s `proj` weight name in decoder layer `layer` (one tensor per expert,
    /// as the hub stores them).
    pub fn expert_name(self, layer: &str, expert: usize, proj: ExpertProj) -> String {
        let leaf = match (self, proj) {
            (Self::Qwen3Moe, ExpertProj::Gate) => "gate_proj",
            (Self::Qwen3Moe, ExpertProj::Up) => "up_proj",
            (Self::Qwen3Moe, ExpertProj::Down) => "down_proj",
            (Self::Mixtral, ExpertProj::Gate) => "w1",
            (Self::Mixtral, ExpertProj::Up) => "w3",
            (Self::Mixtral, ExpertProj::Down) => "w2",
        };
        format!(
            "{}.experts.{expert}.{leaf}.weight",
            self.block_prefix(layer)
        )
    }
}

/// A sparse MoE layer's settings: `num_experts` SwiGLU experts of width
/// `moe_intermediate_size`, each token routed to `num_experts_per_tok` of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// The Hugging Face family (names and keys).
    pub flavor: MoeFlavor,
    /// Experts per sparse layer (`num_experts`, or Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Width of each expert's hidden layer (Mixtral: `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Whether the top-k routing weights are renormalized to sum to one (always for Mixtral).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse (Qwen3-MoE; 1 = every layer).
    pub decoder_sparse_step: usize,
    /// Layers that stay dense whatever the step (Qwen3-MoE).
    pub mlp_only_layers: Vec<usize>,
    /// Weight of the load-balancing loss in the training loss.
    pub router_aux_loss_coef: f64,
    /// Whether the model adds the load-balancing loss (transformers' `output_router_logits`).
    pub output_router_logits: bool,
}

impl MoeConfig {
    /// Whether decoder layer `layer` is sparse: transformers' rule,
    /// `layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0`.
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// The keys of `config.json` this config writes (besides the dense model's).
    pub fn hf_keys(&self) -> Value {
        match self.flavor {
            MoeFlavor::Qwen3Moe => serde_json::json!({
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob,
                "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": self.mlp_only_layers,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": self.output_router_logits,
                "use_sliding_window": false,
            }),
            MoeFlavor::Mixtral => serde_json::json!({
                "num_local_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "router_aux_loss_coef": self.router_aux_loss_coef,
                "output_router_logits": self.output_router_logits,
                "sliding_window": null,
            }),
        }
    }

    /// The MoE settings of a `config.json` object of `flavor`, with transformers' defaults for
    /// missing keys. `intermediate_size` is the dense MLP width (Mixtral's experts use it).
    pub(crate) fn from_json(
        flavor: MoeFlavor,
        o: &Map<String, Value>,
        intermediate_size: usize,
    ) -> Result<Self, ModelError> {
        let bad = |reason: String| ModelError::BadConfig {
            path: "config.json".into(),
            reason,
        };
        let count = |k: &str| count_key(o, k);
        let flag = |k: &str, default: bool| o.get(k).and_then(Value::as_bool).unwrap_or(default);
        let coef = o
            .get("router_aux_loss_coef")
            .and_then(Value::as_f64)
            .unwrap_or(0.001);
        // Both names are accepted for either family; the family's own name wins.
        let experts = |own: &str, other: &str, default: usize| -> Result<usize, ModelError> {
            Ok(count(own)?.or(count(other)?).unwrap_or(default))
        };
        if let Some(noise) = o.get("router_jitter_noise").and_then(Value::as_f64)
            && noise != 0.0
        {
            return Err(ModelError::Unsupported(format!(
                "router_jitter_noise = {noise} (random router noise; set it to 0)"
            )));
        }
        let config = match flavor {
            MoeFlavor::Qwen3Moe => {
                if flag("use_sliding_window", false) {
                    return Err(ModelError::Unsupported(
                        "use_sliding_window = true (sliding-window attention)".into(),
                    ));
                }
                let mlp_only_layers = match o.get("mlp_only_layers") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(v) => serde_json::from_value(v.clone()).map_err(|_| {
                        bad(format!(
                            "`mlp_only_layers` is not a list of layer indices: {v}"
                        ))
                    })?,
                };
                Self {
                    flavor,
                    num_experts: experts("num_experts", "num_local_experts", 128)?,
                    num_experts_per_tok: count("num_experts_per_tok")?.unwrap_or(8),
                    moe_intermediate_size: count("moe_intermediate_size")?.unwrap_or(768),
                    norm_topk_prob: flag("norm_topk_prob", false),
                    decoder_sparse_step: count("decoder_sparse_step")?.unwrap_or(1),
                    mlp_only_layers,
                    router_aux_loss_coef: coef,
                    output_router_logits: flag("output_router_logits", false),
                }
            }
            MoeFlavor::Mixtral => {
                let window = count("sliding_window")?;
                let context = count("max_position_embeddings")?.unwrap_or(2048);
                if let Some(window) = window.filter(|w| *w < context) {
                    return Err(ModelError::Unsupported(format!(
                        "sliding_window = {window} below max_position_embeddings = {context} (sliding-window attention)"
                    )));
                }
                Self {
                    flavor,
                    num_experts: experts("num_local_experts", "num_experts", 8)?,
                    num_experts_per_tok: count("num_experts_per_tok")?.unwrap_or(2),
                    moe_intermediate_size: intermediate_size,
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: Vec::new(),
                    router_aux_loss_coef: coef,
                    output_router_logits: flag("output_router_logits", false),
                }
            }
        };
        config.validate().map_err(bad)?;
        Ok(config)
    }

    /// The checks every MoE config must pass, as a reason for the error.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.num_experts == 0 {
            return Err("a MoE model needs num_experts > 0".into());
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(format!(
                "num_experts_per_tok = {} must be between 1 and num_experts = {}",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.decoder_sparse_step == 0 {
            return Err("decoder_sparse_step must be at least 1".into());
        }
        if self.moe_intermediate_size == 0 {
            return Err("moe_intermediate_size must be positive".into());
        }
        Ok(())
    }

    /// Parameters of one sparse layer's MoE block (router and experts) for `hidden` wide
    /// tokens.
    pub fn block_params(&self, hidden: usize) -> usize {
        hidden * self.num_experts + self.num_experts * 3 * hidden * self.moe_intermediate_size
    }
}

#[cfg(test)]
mod tests {
    use crate::LlamaConfig;

    const QWEN: &str = r#"{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
        "vocab_size":101,"hidden_size":24,"intermediate_size":40,"num_hidden_layers":4,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":6,"num_experts":8,
        "num_experts_per_tok":2,"moe_intermediate_size":14,"decoder_sparse_step":2,
        "mlp_only_layers":[3]}"#;

    #[test]
    fn reads_either_expert_count_key_and_the_sparse_layers() {
        let c = LlamaConfig::from_json(QWEN).unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!((moe.num_experts, moe.norm_topk_prob), (8, false));
        assert!(c.qk_norm);
        // (i + 1) % 2 == 0 and not in mlp_only_layers: layer 1 only.
        let sparse: Vec<usize> = (0..4).filter(|&l| c.is_sparse_layer(l)).collect();
        assert_eq!(sparse, vec![1]);
        let other_key = QWEN.replace("\"num_experts\":8", "\"num_local_experts\":6");
        let c = LlamaConfig::from_json(&other_key).unwrap();
        assert_eq!(c.moe.unwrap().num_experts, 6);
        let tiny = LlamaConfig::tiny_moe();
        let back = LlamaConfig::from_json(&tiny.to_hf_json().to_string()).unwrap();
        assert_eq!((back.moe, back.qk_norm), (tiny.moe, tiny.qk_norm));
    }
}
