//! The Llama of Hugging Face transformers' `LlamaForCausalLM`: RMSNorm in f32, rotate-half
//! rotary embeddings, grouped-query causal attention scaled by 1/sqrt(head_dim), SwiGLU,
//! optional biases, tied or untied LM head. Field names are the Hugging Face module paths
//! (the tp plans and checkpoints address parameters by them).

use burn::module::{Module, Param, ParamId};
use burn::nn::{Embedding, Linear};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use burn_parallel_comm::collectives as coll;
use burn_parallel_macros::parallelize;
use burn_parallel_peft::{Lora, LoraError, LoraFn, LoraModule};
use burn_parallel_tp::{Layout, ParallelStyle, Tp, child_path, forward_shared};

use burn_parallel_comm::ProcessGroup;
use burn_parallel_ep::{ExpertModule, ExpertShard};

use crate::attention::AttentionMask;
use crate::config::LlamaConfig;
use crate::context_parallel::{TokenLayout, check_split};
use crate::error::ModelError;
use crate::fused;
use crate::init::{ParamKind, SeededInit, TensorSource};
use crate::moe::{Experts, SparseMoe};
use crate::moe_config::{ExpertProj, MoeConfig};
use crate::rope::Rope;

/// Root-mean-square norm, computed in f32 whatever the activation dtype (as transformers).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Per-feature scale, `[hidden]`.
    pub weight: Param<Tensor<1>>,
    /// Added to the mean square before the square root.
    #[module(skip)]
    pub eps: f64,
}

impl RmsNorm {
    /// `x / rms(x) * weight` over the last dim, in `x`'s dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_scaled(x, self.weight.val())
    }

    /// The norm with `weight` as its scale (the parameter's value, or it after a collective).
    fn forward_scaled<const D: usize>(&self, x: Tensor<D>, weight: Tensor<1>) -> Tensor<D> {
        fused::rms_norm(x, weight, self.eps)
    }
}

/// Grouped-query causal self-attention. Under tensor parallelism q/k/v are colwise and o
/// rowwise, and `heads` / `kv_heads` are this rank's counts.
#[parallelize]
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection, `hidden -> heads * head_dim`.
    pub q_proj: Tp<Lora<Linear>>,
    /// Key projection, `hidden -> kv_heads * head_dim`.
    pub k_proj: Tp<Lora<Linear>>,
    /// Value projection, `hidden -> kv_heads * head_dim`.
    pub v_proj: Tp<Lora<Linear>>,
    /// Output projection, `heads * head_dim -> hidden`.
    pub o_proj: Tp<Lora<Linear>>,
    /// Qwen3's RMSNorm of each query head, over `head_dim`, before the rotary embedding.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's RMSNorm of each key head.
    pub k_norm: Option<RmsNorm>,
    /// Query heads.
    #[module(skip)]
    #[tp(heads)]
    pub heads: usize,
    /// Key/value heads (each shared by `heads / kv_heads` query heads).
    #[module(skip)]
    #[tp(kv_heads)]
    pub kv_heads: usize,
    /// Dims per head.
    #[module(skip)]
    pub head_dim: usize,
}

impl Attention {
    /// Attention over `x` `[batch, seq, hidden]`, with the rotary `cos`/`sin` of
    /// [`Rope::cos_sin`].
    pub fn forward(&self, x: Tensor<3>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<3> {
        self.forward_masked(x, cos, sin, None)
    }

    /// As [`forward`](Self::forward), under `layout` when given: its mask (packed rows'
    /// block-diagonal causal mask, a context-parallel rank's global order) and, under context
    /// parallelism, K and V gathered over its cp group ([`TokenLayout::attend`]). Per-row `cos`
    /// / `sin` (`[batch, 1, seq, head_dim]`, [`Rope::cos_sin_at`]) take the plain rotary ops.
    /// Attention is the memory-efficient [`flash_attention`](crate::attention::flash_attention)
    /// either way.
    pub fn forward_masked(
        &self,
        x: Tensor<3>,
        cos: &Tensor<4>,
        sin: &Tensor<4>,
        layout: Option<&TokenLayout>,
    ) -> Tensor<3> {
        // q, k and v read the same input: one input collective serves the three.
        let [q, k, v] = forward_shared(x, [&self.q_proj, &self.k_proj, &self.v_proj]);
        let [b, s, _] = q.dims();
        let hd = self.head_dim;
        let split = |t: Tensor<3>, h: usize| t.reshape([b, s, h, hd]).swap_dims(1, 2);
        // Under tensor parallelism each rank norms its own heads with the shared scale, whose
        // gradient is then partial: copy_to_group sums it over the tp ranks in backward.
        let tp_group = self.q_proj.sharding().map(|s| s.group.clone());
        let head_norm = |n: &Option<RmsNorm>, t: Tensor<4>| match (n, &tp_group) {
            (Some(n), Some(group)) => {
                n.forward_scaled(t, coll::copy_to_group(n.weight.val(), group))
            }
            (Some(n), None) => n.forward(t),
            (None, _) => t,
        };
        let rope = |t: Tensor<4>| match cos.dims()[0] {
            1 => Rope::apply(t, cos, sin),
            _ => Rope::apply_plain(t, cos, sin),
        };
        let q = rope(head_norm(&self.q_norm, split(q, self.heads)));
        let k = rope(head_norm(&self.k_norm, split(k, self.kv_heads)));
        let v = split(v, self.kv_heads);
        // Grouped-query heads are read in place by the attention kernel (not repeated).
        let scale = 1.0 / (hd as f64).sqrt();
        let out = match layout {
            None => crate::attention::flash_attention(q, k, v, &AttentionMask::causal(s), scale),
            Some(layout) => layout.attend(q, k, v, scale),
        };
        let out = out.swap_dims(1, 2).reshape([b, s, self.heads * hd]);
        self.o_proj.forward(out)
    }
}

/// SwiGLU: `down(silu(gate(x)) * up(x))`.
#[parallelize]
#[derive(Module, Debug)]
pub struct Mlp {
    /// Gate projection, `hidden -> intermediate`.
    pub gate_proj: Tp<Lora<Linear>>,
    /// Up projection, `hidden -> intermediate`.
    pub up_proj: Tp<Lora<Linear>>,
    /// Down projection, `intermediate -> hidden`.
    pub down_proj: Tp<Lora<Linear>>,
}

impl Mlp {
    /// The MLP of `x` `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // gate and up read the same input: one input collective serves both.
        let [gate, up] = forward_shared(x, [&self.gate_proj, &self.up_proj]);
        self.down_proj.forward(fused::swiglu(gate, up))
    }
}

/// One pre-norm decoder layer: `h = x + attn(norm(x))`, then `h + ffn(norm(h))`, the
/// feed-forward `ffn` being the dense `mlp` or, in a sparse layer of a MoE model, `moe`.
#[parallelize]
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// The norm before attention.
    pub input_layernorm: Tp<RmsNorm>,
    /// Self-attention.
    #[nested]
    pub self_attn: Attention,
    /// The norm before the MLP.
    pub post_attention_layernorm: Tp<RmsNorm>,
    /// The SwiGLU MLP (`None` in a sparse layer).
    #[nested]
    pub mlp: Option<Mlp>,
    /// The sparse mixture-of-experts block (`None` in a dense layer).
    #[nested]
    pub moe: Option<SparseMoe>,
}

pub(crate) fn norm<const D: usize>(n: &Tp<RmsNorm>, x: Tensor<D>) -> Tensor<D> {
    n.forward_with(x, |m, x| m.forward(x))
}

impl DecoderLayer {
    /// The layer on `x` `[batch, seq, hidden]`, with the rotary `cos`/`sin`.
    pub fn forward(&self, x: Tensor<3>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<3> {
        self.forward_routed(x, cos, sin).0
    }

    /// As [`forward`](Self::forward), also returning a sparse layer's router logits
    /// `[batch * seq, experts]`. Collective over the ep group when the experts are sharded.
    pub fn forward_routed(
        &self,
        x: Tensor<3>,
        cos: &Tensor<4>,
        sin: &Tensor<4>,
    ) -> (Tensor<3>, Option<Tensor<2>>) {
        self.forward_masked(x, cos, sin, None)
    }

    /// As [`forward_routed`](Self::forward_routed), attention under `layout` when given (see
    /// [`Attention::forward_masked`]).
    pub fn forward_masked(
        &self,
        x: Tensor<3>,
        cos: &Tensor<4>,
        sin: &Tensor<4>,
        layout: Option<&TokenLayout>,
    ) -> (Tensor<3>, Option<Tensor<2>>) {
        let h = x.clone()
            + self
                .self_attn
                .forward_masked(norm(&self.input_layernorm, x), cos, sin, layout);
        let normed = norm(&self.post_attention_layernorm, h.clone());
        let (ffn, router_logits) = match (&self.mlp, &self.moe) {
            (Some(mlp), _) => (mlp.forward(normed), None),
            (None, Some(moe)) => {
                let (out, logits) = moe.forward(normed).unwrap_or_else(|e| panic!("{e}"));
                (out, Some(logits))
            }
            (None, None) => panic!("a decoder layer needs a dense MLP or a MoE block"),
        };
        (h + ffn, router_logits)
    }
}

/// `LlamaForCausalLM`. `lm_head` is `None` when the embeddings are tied. Its tp plan is
/// [`LLAMA_PLAN`](crate::LLAMA_PLAN) (`llama`, `llama-sp` with sequence parallelism).
#[parallelize(plan = crate::plan::LLAMA_PLAN)]
#[derive(Module, Debug)]
pub struct Llama {
    /// The token embedding table, `[vocab, hidden]`.
    pub embed_tokens: Tp<Embedding>,
    /// The decoder layers, each an FSDP unit.
    #[nested]
    #[fsdp(unit)]
    pub layers: Vec<DecoderLayer>,
    /// The final norm.
    pub norm: Tp<RmsNorm>,
    /// The LM head, `hidden -> vocab` (`None`: tied to `embed_tokens`).
    pub lm_head: Option<Tp<Linear>>,
    /// The config the model was built from.
    #[module(skip)]
    pub config: LlamaConfig,
    /// The rotary frequencies.
    #[module(skip)]
    pub rope: Rope,
}

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
    }))
}

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
        let name = format!("{p}.self_attn.{which}.weight");
        Ok(Some(RmsNorm {
            weight: param(s, &name, [hd], ParamKind::Norm, device)?,
            eps: c.rms_norm_eps,
        }))
    };
    let self_attn = Attention {
        q_proj: linear(s, &format!("{p}.self_attn.q_proj"), h, q, ab, device)?,
        k_proj: linear(s, &format!("{p}.self_attn.k_proj"), h, kv, ab, device)?,
        v_proj: linear(s, &format!("{p}.self_attn.v_proj"), h, kv, ab, device)?,
        o_proj: linear(s, &format!("{p}.self_attn.o_proj"), q, h, ab, device)?,
        q_norm: head_norm(s, "q_norm")?,
        k_norm: head_norm(s, "k_norm")?,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: hd,
    };
    let (mlp, moe) = match &c.moe {
        Some(m) if m.is_sparse(i) => (None, Some(sparse_moe(s, &p, c, m, shard.cloned(), device)?)),
        _ => (Some(dense_mlp(s, &p, c, device)?), None),
    };
    Ok(DecoderLayer {
        input_layernorm: rms_norm(s, &format!("{p}.input_layernorm"), c, device)?,
        self_attn,
        post_attention_layernorm: rms_norm(s, &format!("{p}.post_attention_layernorm"), c, device)?,
        mlp,
        moe,
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
        })
    }

    /// Logits `[batch, seq, vocab]` of token ids `[batch, seq]`. Under tensor parallelism the
    /// last dim is this rank's vocab chunk (for `loss_parallel`).
    pub fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.try_forward(ids).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`forward`](Self::forward), returning the embedding's and the LM head's
    /// tensor-parallel errors (the decoder layers panic on theirs).
    pub fn try_forward(&self, ids: Tensor<2, Int>) -> Result<Tensor<3>, ModelError> {
        Ok(self.try_forward_routed(ids)?.0)
    }

    /// As [`try_forward`](Self::try_forward), also returning the router logits
    /// `[batch * seq, experts]` of every sparse layer in order (empty for a dense model), for
    /// [`load_balancing_loss`](Self::load_balancing_loss).
    pub fn try_forward_routed(
        &self,
        ids: Tensor<2, Int>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        // Under FSDP the root's own parameters (embedding, final norm, LM head) are gathered
        // once, together, for the whole forward.
        burn_parallel_fsdp::try_with_module_unit(self, || self.forward_body(ids, None))?
    }

    /// As [`try_forward_routed`](Self::try_forward_routed) on packed rows (several examples
    /// per row, as transformers' flattening collator with position ids): `positions` and
    /// `segments` (`[batch, seq]`, row-major) give each token's position, restarting per
    /// example, and its example; attention does not cross examples, so each example's logits
    /// are the ones it has alone.
    pub fn try_forward_packed(
        &self,
        ids: Tensor<2, Int>,
        positions: &[i64],
        segments: &[i64],
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        let packed = Some((positions, segments));
        burn_parallel_fsdp::try_with_module_unit(self, || self.forward_body(ids, packed))?
    }

    /// As [`try_forward_routed`](Llama::try_forward_routed) under context parallelism: `ids`
    /// `[batch, seq / cp]` are this cp rank's head-tail part of each row
    /// ([`split_rows`](crate::context_parallel::split_rows)), `group` the ranks holding the
    /// other parts (each runs this with its own part). The logits are those of this rank's
    /// tokens, equal to the same tokens' logits of the whole rows. `packed` (optional) gives
    /// the WHOLE rows' positions and examples (`[batch, seq]`) as in
    /// [`try_forward_packed`](Llama::try_forward_packed). Collective over `group`. A local
    /// length that does not come from a split of whole rows (odd) is an error before any
    /// collective.
    pub fn try_forward_context_parallel(
        &self,
        ids: Tensor<2, Int>,
        group: &ProcessGroup,
        packed: Option<(&[i64], &[i64])>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        // Checked before the first collective, so that every rank returns the error.
        check_split(ids.dims()[1] * group.size(), group.size())?;
        burn_parallel_fsdp::try_with_module_unit(self, || {
            self.forward_body_in(ids, packed, Some(group))
        })?
    }

    fn forward_body(
        &self,
        ids: Tensor<2, Int>,
        packed: Option<(&[i64], &[i64])>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        self.forward_body_in(ids, packed, None)
    }

    /// The forward of [`forward_body`](Self::forward_body), this rank holding its head-tail part
    /// of each row under context parallelism over `cp` (see [`crate::context_parallel`]).
    pub(crate) fn forward_body_in(
        &self,
        ids: Tensor<2, Int>,
        packed: Option<(&[i64], &[i64])>,
        cp: Option<&ProcessGroup>,
    ) -> Result<(Tensor<3>, Vec<Tensor<2>>), ModelError> {
        let [batch, seq] = ids.dims();
        let x = self.embed_tokens.try_forward(ids)?;
        // Positions span the whole sequence: under sequence parallelism attention gathers it.
        let layout = match (packed, cp) {
            (None, None) => None,
            _ => Some(TokenLayout::new(
                &self.rope,
                batch,
                seq,
                packed,
                cp,
                &x.device(),
                x.dtype(),
            )?),
        };
        let (cos, sin) = match &layout {
            None => self.rope.cos_sin(seq, &x.device(), x.dtype()),
            Some(layout) => (layout.cos.clone(), layout.sin.clone()),
        };
        let mut router_logits = Vec::new();
        let layer = |l: &DecoderLayer, x: Tensor<3>| {
            let (x, logits) = l.forward_masked(x, &cos, &sin, layout.as_ref());
            router_logits.extend(logits);
            x
        };
        // Each decoder layer is one FSDP unit when sharded; a plain loop otherwise.
        let x = burn_parallel_fsdp::forward_units(&self.layers, x, layer);
        let x = norm(&self.norm, x);
        let logits = match &self.lm_head {
            Some(head) => head.try_forward(x)?,
            None => self.tied_logits(x)?,
        };
        Ok((logits, router_logits))
    }

    /// transformers' load-balancing loss of a MoE model's router logits (as
    /// [`try_forward_routed`](Self::try_forward_routed) returns them), unweighted: the
    /// training loss adds `router_aux_loss_coef` times it when `output_router_logits` is on.
    /// `None` for a dense model.
    pub fn load_balancing_loss(&self, router_logits: &[Tensor<2>]) -> Option<Tensor<1>> {
        let moe = self.config.moe.as_ref()?;
        (!router_logits.is_empty())
            .then(|| crate::moe::load_balancing_loss(router_logits, moe.num_experts_per_tok))
    }

    /// Splits every sparse layer's experts over `ep_group` (expert parallelism): each rank
    /// keeps its `experts / ep` experts. Collective in the forward and backward that follow:
    /// every rank of the group runs the same layers. An expert count the group size does not
    /// divide is an error naming both; a dense model is returned as it is.
    pub fn shard_experts(mut self, ep_group: &ProcessGroup) -> Result<Self, ModelError> {
        for layer in &mut self.layers {
            if let Some(moe) = layer.moe.take() {
                layer.moe = Some(SparseMoe {
                    experts: moe.experts.shard_experts(ep_group)?,
                    ..moe
                });
            }
        }
        Ok(self)
    }

    /// The LM head tied to the embedding table `[vocab, hidden]`. A vocab-parallel table gives
    /// this rank's vocab chunk of the logits, as a colwise head would (same collectives).
    fn tied_logits(&self, x: Tensor<3>) -> Result<Tensor<3>, ModelError> {
        let x = match self.embed_tokens.sharding() {
            None => x,
            Some(s) => match s.style {
                ParallelStyle::Rowwise {
                    output: Layout::SequenceSharded { dim },
                    ..
                } => coll::all_gather(x, &s.group, dim).map_err(|e| {
                    burn_parallel_tp::TpError::Collective {
                        path: "lm_head (tied)".into(),
                        source: Box::new(e),
                    }
                })?,
                _ => coll::copy_to_group(x, &s.group),
            },
        };
        let table = self.embed_tokens.inner().weight.val();
        let table = table.clone().cast(x.dtype());
        Ok(x.matmul(table.transpose().unsqueeze::<3>()))
    }
}

// The walks `apply_lora` and `merge_lora` take, by Hugging Face module path
// (`model.layers.0.self_attn.q_proj`): a target may be a module name or any dotted suffix of it.
impl LoraModule for Attention {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            q_proj: self.q_proj.map_lora(&child_path(path, "q_proj"), f)?,
            k_proj: self.k_proj.map_lora(&child_path(path, "k_proj"), f)?,
            v_proj: self.v_proj.map_lora(&child_path(path, "v_proj"), f)?,
            o_proj: self.o_proj.map_lora(&child_path(path, "o_proj"), f)?,
            ..self
        })
    }
}

impl LoraModule for Mlp {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            gate_proj: self.gate_proj.map_lora(&child_path(path, "gate_proj"), f)?,
            up_proj: self.up_proj.map_lora(&child_path(path, "up_proj"), f)?,
            down_proj: self.down_proj.map_lora(&child_path(path, "down_proj"), f)?,
        })
    }
}

impl LoraModule for DecoderLayer {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        Ok(Self {
            self_attn: self.self_attn.map_lora(&child_path(path, "self_attn"), f)?,
            mlp: self.mlp.map_lora(&child_path(path, "mlp"), f)?,
            ..self
        })
    }
}

/// The projections' paths are Hugging Face's, under `model.` (`model.layers.0.mlp.up_proj`),
/// as peft names them inside `LlamaForCausalLM`; the LM head is not a LoRA target.
impl LoraModule for Llama {
    fn map_lora(self, path: &str, f: &mut LoraFn<'_>) -> Result<Self, LoraError> {
        let layers = child_path(&child_path(path, "model"), "layers");
        Ok(Self {
            layers: self.layers.map_lora(&layers, f)?,
            ..self
        })
    }
}
