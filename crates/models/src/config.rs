//! `config.json` of a Hugging Face decoder of a family the table in [`crate::family`] lists
//! (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral), as transformers 4.x and 5.x write it.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::ModelError;
use crate::family::{
    Family, NormLayout, QkNorm, SlidingWindow, family_row, sliding_window, window_keys,
};
use crate::json_keys::count_key;
use crate::moe_config::{MoeConfig, MoeFlavor};

/// The architecture of a decoder of the Llama kind (every [`Family`]). Field names are Hugging
/// Face's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention; defaults to `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Dims per head (defaults to `hidden_size / num_attention_heads`).
    pub head_dim: usize,
    /// RMSNorm's epsilon (default 1e-6).
    pub rms_norm_eps: f64,
    /// Base of the rotary frequencies (default 10000).
    pub rope_theta: f64,
    /// Rotary frequency scaling (`None`: the default rope).
    pub rope_scaling: Option<RopeScaling>,
    /// Longest context the model was trained for (kept for the written config; default 2048).
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding table (default `false`).
    pub tie_word_embeddings: bool,
    /// Whether the attention projections have biases (default `false`; Qwen2: q/k/v only,
    /// see [`o_proj_bias`](Self::o_proj_bias)).
    pub attention_bias: bool,
    /// Whether the MLP projections have biases (default `false`).
    pub mlp_bias: bool,
    /// Standard deviation of the normal initial weights (default 0.02).
    pub initializer_range: f64,
    /// The dtype the checkpoint was saved in (`torch_dtype` / `dtype`), if given.
    pub dtype: Option<String>,
    /// Qwen3's RMSNorm of each query and key head before the rotary embedding.
    #[serde(default)]
    pub qk_norm: bool,
    /// The Hugging Face family (default Llama): the `model_type` written back and what the
    /// family changes (see [`crate::family::FAMILIES`]).
    #[serde(default)]
    pub family: Family,
    /// Sliding-window attention (Mistral; Qwen2/3 with `use_sliding_window`), `None`: every
    /// layer attends to all earlier keys.
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// The MLP's activation (default SiLU).
    #[serde(default)]
    pub hidden_act: Activation,
    /// Gemma's attention scale `query_pre_attn_scalar^-0.5` (`None`: `head_dim^-0.5`).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 3's rotary base of its sliding-window layers (`rope_local_base_freq`), which use
    /// no rope scaling (`None`: every layer rotates as `rope_theta` and `rope_scaling` say).
    #[serde(default)]
    pub rope_local_theta: Option<f64>,
    /// Gemma 2's soft cap of the attention scores, `cap * tanh(s / cap)` (`None`: none).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2's soft cap of the output logits (`None`: none).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// The mixture-of-experts settings of a Qwen3-MoE or Mixtral model (`None`: every layer
    /// has a dense MLP, as a Llama).
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// The share of each head's dims that rotate (Phi-4-mini's 0.75: the first
    /// `head_dim x factor` dims rotate, the rest pass through); `None`: every dim.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// The padding token (`pad_token_id`): transformers builds the embedding with it as
    /// `padding_idx`, so its row takes no gradient from the lookup.
    #[serde(default)]
    pub pad_token_id: Option<usize>,
}

/// The MLP's activation (`hidden_act`, Gemma's `hidden_activation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Activation {
    /// SwiGLU's SiLU (`silu`).
    #[default]
    Silu,
    /// GeGLU's GELU, tanh approximation (`gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    /// The name transformers gives it.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Silu => "silu",
            Self::GeluTanh => "gelu_pytorch_tanh",
        }
    }
}

/// Rotary-embedding frequency scaling (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's band-wise scaling.
    Llama3 {
        /// What low frequencies are divided by.
        factor: f64,
        /// Wavelengths above `original / low_freq_factor` are scaled fully (default 1).
        low_freq_factor: f64,
        /// Wavelengths below `original / high_freq_factor` are kept (default 4); between the
        /// two bands the scaling is interpolated.
        high_freq_factor: f64,
        /// The context length the model was pre-trained with (default 8192).
        original_max_position_embeddings: f64,
    },
}

impl LlamaConfig {
    /// A small model for examples and tests: sizes that 2, 3 and 4 ranks do not all divide.
    pub fn tiny() -> Self {
        Self {
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 172,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            attention_bias: false,
            mlp_bias: false,
            initializer_range: 0.02,
            dtype: None,
            qk_norm: false,
            family: Family::Llama,
            sliding_window: None,
            hidden_act: Activation::Silu,
            query_pre_attn_scalar: None,
            rope_local_theta: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            moe: None,
            partial_rotary_factor: None,
            pad_token_id: None,
        }
    }

    /// A tiny Qwen3-MoE for tests and examples: the [`tiny`](Self::tiny) Llama's attention
    /// with q/k norms, 8 experts of width 48 with top-2 routing (renormalized), the first
    /// layer dense.
    pub fn tiny_moe() -> Self {
        Self {
            qk_norm: true,
            family: Family::Qwen3Moe,
            moe: Some(MoeConfig {
                flavor: MoeFlavor::Qwen3Moe,
                num_experts: 8,
                num_experts_per_tok: 2,
                moe_intermediate_size: 48,
                norm_topk_prob: true,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![0],
                router_aux_loss_coef: 0.001,
                output_router_logits: false,
            }),
            ..Self::tiny()
        }
    }

    /// Whether o_proj has a bias: `attention_bias`, except in Qwen2 (biases on q/k/v only).
    pub fn o_proj_bias(&self) -> bool {
        self.attention_bias && !self.family.row().qkv_bias
    }

    /// Whether `q_norm` / `k_norm` normalize the whole projection (OLMo 2) rather than each
    /// head.
    pub fn qk_norm_whole(&self) -> bool {
        self.qk_norm && self.family.row().qk_norm == QkNorm::Whole
    }

    /// The sliding window of decoder layer `layer`, if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_window.as_ref().and_then(|w| w.of_layer(layer))
    }

    /// The dims of each head that the rotary embedding turns: `head_dim`, or its share
    /// `partial_rotary_factor` (transformers' `int(head_dim * factor)`).
    pub fn rotary_dim(&self) -> usize {
        match self.partial_rotary_factor {
            Some(f) => (self.head_dim as f64 * f) as usize,
            None => self.head_dim,
        }
    }

    /// Whether decoder layer `layer` has a sparse MoE block instead of a dense MLP.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// Reads `dir/config.json` (or the file itself).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ModelError> {
        let path = path.as_ref();
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file).map_err(ModelError::io(&file))?;
        Self::from_json(&text).map_err(|e| match e {
            ModelError::BadConfig { reason, .. } => ModelError::BadConfig { path: file, reason },
            other => other,
        })
    }

    /// Parses the text of a `config.json`. Rejects other architectures and settings this
    /// implementation does not compute (an activation other than SiLU, unknown rope types).
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let v: Value = serde_json::from_str(text).map_err(|e| bad_config(e.to_string()))?;
        let o = v
            .as_object()
            .ok_or_else(|| bad_config("not a JSON object".into()))?;
        let row = family_row(o)?;
        let usize_of = |k: &str| count_key(o, k);
        let need = |k: &str| required_count(o, k);
        let bool_of = |k: &str, default: bool| o.get(k).and_then(Value::as_bool).unwrap_or(default);

        let hidden_act = activation(o)?;
        refuse_unsupported(o)?;
        let (hidden_size, heads, kv_heads, head_dim) = attention_shape(o)?;
        let (rope_theta, rope_scaling, rope_local_theta) = rope_from_json(o, row.local_rope)?;
        let dtype = o
            .get("torch_dtype")
            .or_else(|| o.get("dtype"))
            .and_then(Value::as_str)
            .map(str::to_string);
        let intermediate_size = need("intermediate_size")?;
        let moe = match row.moe {
            None => None,
            Some(flavor) => Some(MoeConfig::from_json(flavor, o, intermediate_size)?),
        };
        let num_hidden_layers = need("num_hidden_layers")?;
        let config = Self {
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: f64_of("rms_norm_eps", o).unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: usize_of("max_position_embeddings")?.unwrap_or(2048),
            // transformers' LlamaConfig defaults to untied embeddings, Gemma's to tied.
            tie_word_embeddings: bool_of("tie_word_embeddings", row.gemma),
            attention_bias: row.qkv_bias || bool_of("attention_bias", false),
            mlp_bias: bool_of("mlp_bias", false),
            initializer_range: f64_of("initializer_range", o).unwrap_or(0.02),
            dtype,
            qk_norm: row.qk_norm != QkNorm::None,
            family: row.family,
            sliding_window: sliding_window(o, row, num_hidden_layers)?,
            hidden_act,
            query_pre_attn_scalar: f64_of("query_pre_attn_scalar", o),
            rope_local_theta,
            attn_logit_softcapping: f64_of("attn_logit_softcapping", o),
            final_logit_softcapping: f64_of("final_logit_softcapping", o),
            moe,
            partial_rotary_factor: partial_rotary_factor(o, head_dim)?,
            pad_token_id: None,
        };
        let config = Self {
            pad_token_id: pad_token_id(o, config.vocab_size)?,
            ..config
        };
        Ok(config)
    }

    /// The `config.json` transformers reads back (4.x keys; 5.x reads them too).
    pub fn to_hf_json(&self) -> Value {
        // A MoE config's flavour names its family, whatever `family` was left at.
        let row = match &self.moe {
            Some(moe) => moe.flavor.family().row(),
            None => self.family.row(),
        };
        let mut v = serde_json::json!({
            "architectures": [row.architecture],
            "model_type": row.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act.hf_name(),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "initializer_range": self.initializer_range,
            "torch_dtype": self.dtype.clone().unwrap_or_else(|| "float32".into()),
        });
        let scaling = match &self.rope_scaling {
            None => Value::Null,
            Some(RopeScaling::Linear { factor }) => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => serde_json::json!({
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings,
            }),
        };
        v["rope_scaling"] = scaling;
        if let Some(f) = self.partial_rotary_factor {
            v["partial_rotary_factor"] = f.into();
        }
        if let Some(p) = self.pad_token_id {
            v["pad_token_id"] = p.into();
        }
        if row.gemma {
            v["hidden_activation"] = self.hidden_act.hf_name().into();
            // transformers 5 checks the type: an int where the value is whole.
            v["query_pre_attn_scalar"] = match self.query_pre_attn_scalar {
                Some(q) if q.fract() == 0.0 => (q as i64).into(),
                other => other.into(),
            };
            if row.local_rope {
                v["rope_local_base_freq"] = self.rope_local_theta.into();
            }
            v["attn_logit_softcapping"] = self.attn_logit_softcapping.into();
            v["final_logit_softcapping"] = self.final_logit_softcapping.into();
        }
        if let Some(out) = v.as_object_mut() {
            out.extend(window_keys(row, self.sliding_window.as_ref()));
            if let Some(keys) = self
                .moe
                .as_ref()
                .and_then(|m| m.hf_keys().as_object().cloned())
            {
                out.extend(keys);
            }
        }
        v
    }

    /// Number of parameters of the model.
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let attn = h * q
            + 2 * h * kv
            + q * h
            + if self.attention_bias { q + 2 * kv } else { 0 }
            + if self.o_proj_bias() { h } else { 0 };
        let qk_norm = match (self.qk_norm, self.qk_norm_whole()) {
            (false, _) => 0,
            (true, false) => 2 * self.head_dim,
            (true, true) => q + kv,
        };
        let mlp = 3 * h * i + if self.mlp_bias { 2 * i + h } else { 0 };
        let layers: usize = (0..self.num_hidden_layers)
            .map(|l| {
                let ffn = match &self.moe {
                    Some(moe) if moe.is_sparse(l) => moe.block_params(h),
                    _ => mlp,
                };
                let norms = match self.family.row().norms {
                    NormLayout::Sandwich => 4,
                    NormLayout::Pre | NormLayout::Post => 2,
                };
                attn + qk_norm + ffn + norms * h
            })
            .sum();
        let head = if self.tie_word_embeddings { 0 } else { h * v };
        v * h + layers + h + head
    }
}

/// A `config.json` that cannot be read as a Llama's, for `reason`; [`LlamaConfig::load`]
/// replaces the path with the file's.
fn bad_config(reason: String) -> ModelError {
    ModelError::BadConfig {
        path: "config.json".into(),
        reason,
    }
}

/// `obj[k]` as a float, `None` when absent or not a number.
fn f64_of(k: &str, obj: &serde_json::Map<String, Value>) -> Option<f64> {
    obj.get(k).and_then(Value::as_f64)
}

/// `o[k]` as a count that must be there: an error naming the key when it is missing.
fn required_count(o: &serde_json::Map<String, Value>, k: &str) -> Result<usize, ModelError> {
    count_key(o, k)?.ok_or_else(|| bad_config(format!("missing `{k}`")))
}

/// A setting of Gemma's family that this decoder does not compute: bidirectional attention.
/// `pad_token_id` as the embedding's `padding_idx`: a negative one counts from the end, as
/// PyTorch's does; one outside the table is an error (transformers refuses it too).
fn pad_token_id(
    o: &serde_json::Map<String, Value>,
    vocab: usize,
) -> Result<Option<usize>, ModelError> {
    let Some(id) = o.get("pad_token_id").and_then(Value::as_i64) else {
        return Ok(None);
    };
    let row = if id < 0 { vocab as i64 + id } else { id };
    if row < 0 || row >= vocab as i64 {
        return Err(bad_config(format!(
            "pad_token_id {id} is not a row of the {vocab}-token embedding"
        )));
    }
    Ok(Some(row as usize))
}

/// `partial_rotary_factor` (transformers 5 keeps it in `rope_parameters`), when it is not 1:
/// a share in (0, 1] that leaves an even number of rotating dims.
fn partial_rotary_factor(
    o: &serde_json::Map<String, Value>,
    head_dim: usize,
) -> Result<Option<f64>, ModelError> {
    let in_params = || {
        let params = o.get("rope_parameters").and_then(Value::as_object)?;
        f64_of("partial_rotary_factor", params)
    };
    let Some(f) = f64_of("partial_rotary_factor", o).or_else(in_params) else {
        return Ok(None);
    };
    let dims = (head_dim as f64 * f) as usize;
    if !(f > 0.0 && f <= 1.0) || dims == 0 || !dims.is_multiple_of(2) {
        return Err(bad_config(format!(
            "partial_rotary_factor {f} of head_dim {head_dim} gives {dims} rotating dims: it \
             must be in (0, 1] and leave an even number of them"
        )));
    }
    Ok((f < 1.0).then_some(f))
}

fn refuse_unsupported(o: &serde_json::Map<String, Value>) -> Result<(), ModelError> {
    if o.get("use_bidirectional_attention") == Some(&Value::Bool(true)) {
        return Err(ModelError::Unsupported(
            "use_bidirectional_attention: the decoder is causal".into(),
        ));
    }
    Ok(())
}

/// The MLP's activation from `hidden_activation` (Gemma's key) or `hidden_act` (absent: SiLU);
/// another is an error naming it.
fn activation(o: &serde_json::Map<String, Value>) -> Result<Activation, ModelError> {
    let name = o
        .get("hidden_activation")
        .or_else(|| o.get("hidden_act"))
        .and_then(Value::as_str);
    match name {
        None | Some("silu") => Ok(Activation::Silu),
        Some("gelu_pytorch_tanh") => Ok(Activation::GeluTanh),
        Some(other) => Err(ModelError::Unsupported(format!(
            "hidden_act `{other}` (silu and gelu_pytorch_tanh are supported)"
        ))),
    }
}

/// `(hidden_size, num_attention_heads, num_key_value_heads, head_dim)`, with the defaults
/// filled in; heads that do not group or an odd head dim are errors.
fn attention_shape(
    o: &serde_json::Map<String, Value>,
) -> Result<(usize, usize, usize, usize), ModelError> {
    let usize_of = |k: &str| count_key(o, k);
    let need = |k: &str| required_count(o, k);
    let hidden_size = need("hidden_size")?;
    let heads = need("num_attention_heads")?;
    if heads == 0 {
        return Err(bad_config("num_attention_heads is 0".into()));
    }
    let kv_heads = usize_of("num_key_value_heads")?.unwrap_or(heads);
    if kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
        return Err(bad_config(format!(
            "num_attention_heads = {heads} is not a multiple of num_key_value_heads = {kv_heads}"
        )));
    }
    let head_dim = usize_of("head_dim")?.unwrap_or(hidden_size / heads);
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(bad_config(format!(
            "head_dim = {head_dim} must be even and positive"
        )));
    }
    Ok((hidden_size, heads, kv_heads, head_dim))
}

/// `rope_theta` (default 10000; Gemma 3 1e6) and the rotary scaling, read at the top level or,
/// for either, from `rope_parameters` / `rope_scaling`; and for Gemma 3 the sliding layers' base
/// (`rope_local_base_freq`, default 10000). transformers 5 writes Gemma's per layer type:
/// `rope_parameters: {full_attention: {..}, sliding_attention: {..}}`.
fn rope_from_json(
    o: &serde_json::Map<String, Value>,
    local_rope: bool,
) -> Result<(f64, Option<RopeScaling>, Option<f64>), ModelError> {
    // transformers 5.x moves rope_theta and the scaling into `rope_parameters`.
    let params = o
        .get("rope_parameters")
        .or_else(|| o.get("rope_scaling"))
        .and_then(Value::as_object);
    let per_type = |t: &str| params.and_then(|p| p.get(t)).and_then(Value::as_object);
    let (global, local) = match per_type("full_attention") {
        Some(full) => (Some(full), per_type("sliding_attention")),
        None => (params, None),
    };
    // Gemma 3's default base is 1e6; every other family's (Gemma 2's too) 10000.
    let default_theta = if local_rope { 1_000_000.0 } else { 10_000.0 };
    let rope_theta = f64_of("rope_theta", o)
        .or_else(|| global.and_then(|p| f64_of("rope_theta", p)))
        .unwrap_or(default_theta);
    let rope_scaling = match global {
        None => None,
        Some(p) => scaling_from_params(p)?,
    };
    let local_theta = local_rope.then(|| {
        f64_of("rope_local_base_freq", o)
            .or_else(|| local.and_then(|p| f64_of("rope_theta", p)))
            .unwrap_or(10_000.0)
    });
    Ok((rope_theta, rope_scaling, local_theta))
}

/// The scaling of the rope parameters `p` by their `rope_type` (or `type`): `None` for the
/// default rope; a type other than linear and llama3 is an error.
fn scaling_from_params(
    p: &serde_json::Map<String, Value>,
) -> Result<Option<RopeScaling>, ModelError> {
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || {
        f64_of("factor", p).ok_or_else(|| bad_config(format!("rope type {kind} needs `factor`")))
    };
    Ok(match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: f64_of("low_freq_factor", p).unwrap_or(1.0),
            high_freq_factor: f64_of("high_freq_factor", p).unwrap_or(4.0),
            original_max_position_embeddings: f64_of("original_max_position_embeddings", p)
                .unwrap_or(8192.0),
        }),
        other => {
            return Err(ModelError::Unsupported(format!(
                "rope type `{other}` (default, linear and llama3 are supported)"
            )));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
        "vocab_size":101,"hidden_size":24,"intermediate_size":37,"num_hidden_layers":2,
        "num_attention_heads":6,"num_key_value_heads":2,"rms_norm_eps":1e-6,
        "rope_theta":500000.0,"hidden_act":"silu","tie_word_embeddings":true}"#;

    #[test]
    fn reads_transformers_4_and_5_rope_theta() {
        let c = LlamaConfig::from_json(V4).unwrap();
        assert_eq!(
            (c.rope_theta, c.head_dim, c.num_key_value_heads),
            (5e5, 4, 2)
        );
        assert!(c.tie_word_embeddings && c.rope_scaling.is_none());
        let v5 = V4.replace(
            r#""rope_theta":500000.0"#,
            r#""rope_parameters":{"rope_theta":250000.0,"rope_type":"default"}"#,
        );
        assert_eq!(LlamaConfig::from_json(&v5).unwrap().rope_theta, 2.5e5);
        let back = LlamaConfig::from_json(&c.to_hf_json().to_string()).unwrap();
        assert_eq!(back.rope_theta, c.rope_theta);
        assert_eq!(back.num_params(), c.num_params());
    }

    #[test]
    fn rejects_other_architectures() {
        let msg = LlamaConfig::from_json(
            &V4.replace(r#""model_type":"llama""#, r#""model_type":"gpt_neox""#),
        )
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("gpt_neox") && msg.contains("llama, mistral, qwen2, qwen3"),
            "{msg}"
        );
        // A model_type the table knows with another family's class name.
        let msg = LlamaConfig::from_json(
            &V4.replace(r#""model_type":"llama""#, r#""model_type":"qwen2""#),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("LlamaForCausalLM"), "{msg}");
        let msg = LlamaConfig::from_json(&V4.replace("LlamaForCausalLM", "GPT2LMHeadModel"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("GPT2LMHeadModel"), "{msg}");
        let msg = LlamaConfig::from_json(&V4.replace(r#""silu""#, r#""gelu""#))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("gelu"), "{msg}");
    }
}
