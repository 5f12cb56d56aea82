//! Builds the model from a [`TensorSource`] by Hugging Face parameter name: seeded
//! initialisation or a checkpoint, whole or (expert parallelism) one rank's experts.

use burn::module::{Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::checkpoint::LayerCheckpointing;
use burn_parallel_ep::ExpertShard;
use burn_parallel_tp::Tp;

use super::Llama;
use super::blocks::{Attention, DecoderLayer, Mlp, RmsNorm};
use crate::config::LlamaConfig;
use crate::error::ModelError;
use crate::family::NormLayout;
use crate::init::{ParamKind, SeededInit, TensorSource};
use crate::moe::{Experts, SparseMoe};
use crate::moe_config::{ExpertProj, MoeConfig};
use crate::rope::Rope;

/// Parameter `name` of `shape` read from `source` in f32, or deferred when the source reads
/// it lazily; a shape other than `shape` is an error naming the parameter.
pub(crate) fn param<const D: usize>(
    source: &mut dyn TensorSource,
    name: &str,
    shape: [usize; D],
    kind: ParamKind,
    device: &Device,
) -> Result<Param<Tensor<D>>, ModelError> {
    let id = ParamId::new();
    if let Some(read) = source.deferred(id, name, &shape, kind)? {
        let name = name.to_string();
        let init = move |device: &Device, require_grad: bool| {
            // Reached only when a lazy model is used whole (unsharded, DDP, or a tp split);
            // the checkpoint was validated when the model was built.
            let data = read().unwrap_or_else(|e| panic!("loading `{name}`: {e}"));
            let t = Tensor::<D>::from_data(data.convert_dtype(DType::F32), device);
            if require_grad { t.require_grad() } else { t }
        };
        return Ok(Param::uninitialized(
            id,
            init,
            device.clone(),
            true,
            shape.into(),
        ));
    }
    let data = source.tensor(name, &shape, kind)?;
    if data.shape().dims::<D>() != shape {
        return Err(ModelError::ShapeMismatch {
            name: name.to_string(),
            found: data.shape().to_vec(),
            expected: shape.to_vec(),
        });
    }
    let data = data.convert_dtype(DType::F32);
    Ok(Param::from_tensor(Tensor::from_data(data, device)))
}

/// A linear layer read from `source`, as `L`: a plain `Linear` (the LM head) or a
/// `Lora<Linear>` without adapter (the projections), which is exactly its base.
pub(crate) fn linear<L: From<Linear>>(
    source: &mut dyn TensorSource,
    prefix: &str,
    d_in: usize,
    d_out: usize,
    bias: bool,
    device: &Device,
) -> Result<Tp<L>, ModelError> {
    let weight = param(
        source,
        &format!("{prefix}.weight"),
        [d_in, d_out],
        ParamKind::LinearWeight,
        device,
    )?;
    let bias = if bias {
        Some(param(
            source,
            &format!("{prefix}.bias"),
            [d_out],
            ParamKind::Bias,
            device,
        )?)
    } else {
        None
    };
    Ok(Tp::new(L::from(Linear { weight, bias })))
}

/// The RMSNorm `{name}.weight` `[hidden]`, with the config's epsilon.
pub(crate) fn rms_norm(
    source: &mut dyn TensorSource,
    name: &str,
    c: &LlamaConfig,
    device: &Device,
) -> Result<Tp<RmsNorm>, ModelError> {
    Ok(Tp::new(RmsNorm {
        weight: param(
            source,
            &format!("{name}.weight"),
            [c.hidden_size],
            ParamKind::Norm,
            device,
        )?,
        eps: c.rms_norm_eps,
        offset: norm_offset(c),
    }))
}

/// What `c`'s RMSNorms add to their weight: Gemma's `1 + w`, else nothing.
fn norm_offset(c: &LlamaConfig) -> f64 {
    match c.family.row().gemma {
        true => 1.0,
        false => 0.0,
    }
}

/// A dense layer's SwiGLU MLP `{layer}.mlp.*`.
fn dense_mlp(
    s: &mut dyn TensorSource,
    layer: &str,
    c: &LlamaConfig,
    device: &Device,
) -> Result<Mlp, ModelError> {
    let (h, i, b) = (c.hidden_size, c.intermediate_size, c.mlp_bias);
    Ok(Mlp {
        gate_proj: linear(s, &format!("{layer}.mlp.gate_proj"), h, i, b, device)?,
        up_proj: linear(s, &format!("{layer}.mlp.up_proj"), h, i, b, device)?,
        down_proj: linear(s, &format!("{layer}.mlp.down_proj"), i, h, b, device)?,
        act: c.hidden_act,
        gate_up_fused: c.family.row().fused,
    })
}

/// A sparse layer's router and experts; with `shard`, only this rank's experts are read.
fn sparse_moe(
    s: &mut dyn TensorSource,
    layer: &str,
    c: &LlamaConfig,
    moe: &MoeConfig,
    shard: Option<ExpertShard>,
    device: &Device,
) -> Result<SparseMoe, ModelError> {
    let (h, i, flavor) = (c.hidden_size, moe.moe_intermediate_size, moe.flavor);
    let router = param(
        s,
        &flavor.router_name(layer),
        [h, moe.num_experts],
        ParamKind::LinearWeight,
        device,
    )?;
    let local = match &shard {
        Some(shard) => shard.local_experts(),
        None => 0..moe.num_experts,
    };
    let mut stack =
        |proj: ExpertProj| -> Result<Param<Tensor<3>>, ModelError> {
            let shape = match proj {
                ExpertProj::Gate | ExpertProj::Up => [h, i],
                ExpertProj::Down => [i, h],
            };
            let mut values = Vec::with_capacity(local.len() * h * i);
            for e in local.clone() {
                let name = flavor.expert_name(layer, e, proj);
                let data = s.tensor(&name, &shape, ParamKind::LinearWeight)?;
                if data.shape().dims::<2>() != shape {
                    return Err(ModelError::ShapeMismatch {
                        name,
                        found: data.shape().to_vec(),
                        expected: shape.to_vec(),
                    });
                }
                values.extend(data.convert::<f32>().try_into_vec::<f32>().map_err(|e| {
                    ModelError::Unsupported(format!("expert weight `{name}`: {e:?}"))
                })?);
            }
            let data = TensorData::new(values, [local.len(), shape[0], shape[1]]);
            Ok(Param::from_tensor(Tensor::from_data(data, device)))
        };
    let experts = Experts {
        gate_proj: stack(ExpertProj::Gate)?,
        up_proj: stack(ExpertProj::Up)?,
        down_proj: stack(ExpertProj::Down)?,
        num_experts: moe.num_experts,
        shard,
    };
    Ok(SparseMoe {
        gate: Linear {
            weight: router,
            bias: None,
        },
        experts,
        top_k: moe.num_experts_per_tok,
        norm_topk_prob: moe.norm_topk_prob,
    })
}

/// The token embedding `model.embed_tokens.weight` `[vocab, hidden]`.
pub(crate) fn embedding(
    source: &mut dyn TensorSource,
    c: &LlamaConfig,
    device: &Device,
) -> Result<Tp<Embedding>, ModelError> {
    Ok(Tp::new(Embedding {
        weight: param(
            source,
            "model.embed_tokens.weight",
            [c.vocab_size, c.hidden_size],
            ParamKind::Embedding,
            device,
        )?,
    }))
}

/// Decoder layer `i` of `c` read from `source` (Hugging Face names `model.layers.{i}.*`); a
/// sparse layer's experts are only `shard`'s when given.
pub(crate) fn decoder_layer(
    source: &mut dyn TensorSource,
    i: usize,
    c: &LlamaConfig,
    shard: Option<&ExpertShard>,
    device: &Device,
) -> Result<DecoderLayer, ModelError> {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let p = format!("model.layers.{i}");
    let ab = c.attention_bias;
    let s = &mut *source;
    let head_norm = |s: &mut dyn TensorSource, which: &str| -> Result<_, ModelError> {
        if !c.qk_norm {
            return Ok(None);
        }
        // Per head, or (OLMo 2) over the whole projection.
        let width = match (c.qk_norm_whole(), which) {
            (false, _) => hd,
            (true, "q_norm") => q,
            (true, _) => kv,
        };
        let name = format!("{p}.self_attn.{which}.weight");
        Ok(Some(RmsNorm {
            weight: param(s, &name, [width], ParamKind::Norm, device)?,
            eps: c.rms_norm_eps,
            offset: norm_offset(c),
        }))
    };
    let self_attn = Attention {
        q_proj: linear(s, &format!("{p}.self_attn.q_proj"), h, q, ab, device)?,
        k_proj: linear(s, &format!("{p}.self_attn.k_proj"), h, kv, ab, device)?,
        v_proj: linear(s, &format!("{p}.self_attn.v_proj"), h, kv, ab, device)?,
        o_proj: linear(
            s,
            &format!("{p}.self_attn.o_proj"),
            q,
            h,
            c.o_proj_bias(),
            device,
        )?,
        q_norm: head_norm(s, "q_norm")?,
        k_norm: head_norm(s, "k_norm")?,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: hd,
        qk_norm_whole: c.qk_norm_whole(),
        qkv_fused: c.family.row().fused,
        sliding_window: c.window_of(i),
        scale: 1.0 / c.query_pre_attn_scalar.unwrap_or(hd as f64).sqrt(),
        softcap: c.attn_logit_softcapping,
    };
    let (mlp, moe) = match &c.moe {
        Some(m) if m.is_sparse(i) => (None, Some(sparse_moe(s, &p, c, m, shard.cloned(), device)?)),
        _ => (Some(dense_mlp(s, &p, c, device)?), None),
    };
    let layout = c.family.row().norms;
    let norm_if = |s: &mut dyn TensorSource, on: bool, name: &str| -> Result<_, ModelError> {
        match on {
            true => Ok(Some(rms_norm(s, &format!("{p}.{name}"), c, device)?)),
            false => Ok(None),
        }
    };
    let input_layernorm = norm_if(s, layout != NormLayout::Post, "input_layernorm")?;
    let post_attention_layernorm =
        rms_norm(s, &format!("{p}.post_attention_layernorm"), c, device)?;
    let pre_feedforward_layernorm = norm_if(
        s,
        layout == NormLayout::Sandwich,
        "pre_feedforward_layernorm",
    )?;
    let post_feedforward_layernorm =
        norm_if(s, layout != NormLayout::Pre, "post_feedforward_layernorm")?;
    Ok(DecoderLayer {
        input_layernorm,
        self_attn,
        post_attention_layernorm,
        mlp,
        moe,
        post_feedforward_layernorm,
        pre_feedforward_layernorm,
    })
}

impl Llama {
    /// A model with Hugging Face's initialisation, identical on every rank for one `seed`.
    pub fn seeded(config: &LlamaConfig, seed: u64, device: &Device) -> Self {
        Self::from_source(config, &mut SeededInit::new(config, seed), device)
            .expect("seeded parameters have the config's shapes")
    }

    /// A model whose parameters come from `source`, by Hugging Face name.
    pub fn from_source(
        config: &LlamaConfig,
        source: &mut dyn TensorSource,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_source_ep(config, source, device, None)
    }

    /// As [`from_source`](Self::from_source), with a MoE model's experts split over
    /// `ep_group` (expert parallelism): each rank reads and holds only its own experts. An
    /// expert count the group size does not divide is an error naming both.
    pub fn from_source_ep(
        config: &LlamaConfig,
        source: &mut dyn TensorSource,
        device: &Device,
        ep_group: Option<&ProcessGroup>,
    ) -> Result<Self, ModelError> {
        let c = config;
        let h = c.hidden_size;
        let shard = match (&c.moe, ep_group) {
            (Some(moe), Some(group)) => Some(ExpertShard::new(group.clone(), moe.num_experts)?),
            _ => None,
        };
        let embed_tokens = embedding(source, c, device)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            layers.push(decoder_layer(source, i, c, shard.as_ref(), device)?);
        }
        let norm = rms_norm(source, "model.norm", c, device)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(linear(source, "lm_head", h, c.vocab_size, false, device)?)
        };
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            lm_head,
            config: config.clone(),
            rope: Rope::new(config),
            rope_local: Rope::local(config),
            checkpointing: LayerCheckpointing::Off,
        })
    }
}
