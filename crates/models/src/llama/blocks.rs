//! The decoder layer's building blocks and their forwards: the RMSNorm (in f32), grouped-query
//! causal self-attention with rotate-half rotary embeddings, the SwiGLU MLP and the pre-norm
//! decoder layer that chains them. Field names are the Hugging Face module paths.

use burn::module::{Module, Param};
use burn::nn::Linear;
use std::ops::Range;

use burn::tensor::{FloatDType, Tensor};
use burn_parallel_comm::ProcessGroup;
use burn_parallel_comm::collectives as coll;
use burn_parallel_macros::parallelize;
use burn_parallel_peft::Lora;
use burn_parallel_tp::{Tp, forward_shared};

use crate::attention::AttentionMask;
use crate::config::Activation;
use crate::context_parallel::TokenLayout;
use crate::fused;
use crate::moe::SparseMoe;
use crate::rope::Rope;

/// Root-mean-square norm, computed in f32 whatever the activation dtype (as transformers).
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// Per-feature scale, `[hidden]`.
    pub weight: Param<Tensor<1>>,
    /// Added to the mean square before the square root.
    #[module(skip)]
    pub eps: f64,
    /// Added to the weight before it scales (Gemma's `1 + w`; 0 elsewhere).
    #[module(skip)]
    pub offset: f64,
}

impl RmsNorm {
    /// `x / rms(x) * (offset + weight)` over the last dim, in `x`'s dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        self.forward_scaled(x, self.weight.val())
    }

    /// The norm of `x` whose last dim holds `columns` of the normalized width, the rest on the
    /// other ranks of `group` (a whole-projection q/k norm, OLMo 2's, on heads split by tensor
    /// parallelism): the squares are summed over the group, in forward and in backward, and
    /// each rank scales by its columns of the weight (whose gradient is summed over the group,
    /// as the weight is replicated). The same arithmetic as [`forward`](Self::forward).
    fn forward_split(
        &self,
        x: Tensor<3>,
        columns: Range<usize>,
        group: &ProcessGroup,
    ) -> Tensor<3> {
        // The gathered value's width: under FSDP the stored parameter is a shard.
        let weight = self.weight.val();
        let width = weight.dims()[0];
        let dtype = FloatDType::from(x.dtype());
        let x = x.cast(FloatDType::F32);
        let squares = x.clone().powi_scalar(2).sum_dim(2);
        // copy_to_group's backward and reduce_from_group's forward: a sum both ways.
        let squares = coll::reduce_from_group(coll::copy_to_group(squares, group), group)
            .unwrap_or_else(|e| panic!("the whole-projection q/k norm's sum of squares: {e}"));
        let inv_rms = squares
            .div_scalar(width as f64)
            .add_scalar(self.eps)
            .sqrt()
            .recip();
        let normed = (x * inv_rms).cast(dtype);
        let weight = coll::copy_to_group(weight, group).slice([columns]);
        let weight = match self.offset {
            0.0 => weight,
            offset => weight.add_scalar(offset),
        };
        normed * weight.cast(dtype).unsqueeze::<3>()
    }

    /// The norm with `weight` (plus the offset) as its scale (the parameter's value, or it
    /// after a collective).
    fn forward_scaled<const D: usize>(&self, x: Tensor<D>, weight: Tensor<1>) -> Tensor<D> {
        let weight = match self.offset {
            0.0 => weight,
            offset => weight.add_scalar(offset),
        };
        fused::rms_norm(x, weight, self.eps)
    }
}

/// Grouped-query causal self-attention, optionally over a sliding window. Under tensor
/// parallelism q/k/v are colwise and o rowwise, and `heads` / `kv_heads` are this rank's
/// counts.
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
    /// The RMSNorm of the queries before the rotary embedding: of each head over `head_dim`
    /// (Qwen3), or of the whole projection (OLMo 2, `qk_norm_whole`).
    pub q_norm: Option<RmsNorm>,
    /// The RMSNorm of the keys, as `q_norm`.
    pub k_norm: Option<RmsNorm>,
    /// Whether `q_norm` / `k_norm` span the whole projection (every head at once).
    #[module(skip)]
    pub qk_norm_whole: bool,
    /// Whether Hugging Face holds q/k/v as one `qkv_proj` (Phi-3): LoRA then adapts them as
    /// that one module (one `a` shared by the three).
    #[module(skip)]
    pub qkv_fused: bool,
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
    /// Keys each query sees under sliding-window attention, itself included (`None`: all
    /// earlier keys).
    #[module(skip)]
    pub sliding_window: Option<usize>,
    /// The scores' scale (`head_dim^-0.5`; Gemma's `query_pre_attn_scalar^-0.5`).
    #[module(skip)]
    pub scale: f64,
    /// Gemma 2's soft cap of the scaled scores (`None`: none).
    #[module(skip)]
    pub softcap: Option<f64>,
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
        let (q, k) = match self.qk_norm_whole {
            true => {
                // Over every head: under TP each rank holds its heads' columns of the width.
                let whole = |n: &Option<RmsNorm>, t: Tensor<3>, proj: &Tp<Lora<Linear>>| match (
                    n,
                    proj.sharding(),
                ) {
                    (None, _) => t,
                    (Some(n), None) => n.forward(t),
                    (Some(n), Some(s)) => {
                        let columns = s
                            .spec
                            .as_ref()
                            .map(|spec| spec.range.clone())
                            .expect("a colwise q/k projection has a column range");
                        n.forward_split(t, columns, &s.group)
                    }
                };
                (
                    whole(&self.q_norm, q, &self.q_proj),
                    whole(&self.k_norm, k, &self.k_proj),
                )
            }
            false => (q, k),
        };
        let head_norm = |n: &Option<RmsNorm>, t: Tensor<4>| match (n, &tp_group) {
            _ if self.qk_norm_whole => t,
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
        let scale = self.scale;
        let out = match layout {
            None => {
                let mask = AttentionMask::causal(s)
                    .with_window(self.sliding_window)
                    .with_softcap(self.softcap);
                crate::attention::flash_attention(q, k, v, &mask, scale)
            }
            Some(layout) => layout.attend(q, k, v, scale, |m| {
                m.with_window(self.sliding_window)
                    .with_softcap(self.softcap)
            }),
        };
        let out = out.swap_dims(1, 2).reshape([b, s, self.heads * hd]);
        self.o_proj.forward(out)
    }
}

/// SwiGLU `down(silu(gate(x)) * up(x))`, or GeGLU with the tanh GELU (Gemma).
#[parallelize]
#[derive(Module, Debug)]
pub struct Mlp {
    /// Gate projection, `hidden -> intermediate`.
    pub gate_proj: Tp<Lora<Linear>>,
    /// Up projection, `hidden -> intermediate`.
    pub up_proj: Tp<Lora<Linear>>,
    /// Down projection, `intermediate -> hidden`.
    pub down_proj: Tp<Lora<Linear>>,
    /// The gate's activation.
    #[module(skip)]
    pub act: Activation,
    /// Whether Hugging Face holds gate and up as one `gate_up_proj` (Phi-3): LoRA then adapts
    /// them as that one module.
    #[module(skip)]
    pub gate_up_fused: bool,
}

impl Mlp {
    /// The MLP of `x` `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // gate and up read the same input: one input collective serves both.
        let [gate, up] = forward_shared(x, [&self.gate_proj, &self.up_proj]);
        let hidden = match self.act {
            Activation::Silu => fused::swiglu(gate, up),
            Activation::GeluTanh => gelu_tanh(gate) * up,
        };
        self.down_proj.forward(hidden)
    }
}

/// PyTorch's `gelu(x, approximate="tanh")`: `x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715
/// x^3)))`.
fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    let inner = (x.clone() + x.clone().powi_scalar(3).mul_scalar(0.044715))
        .mul_scalar((2.0 / std::f64::consts::PI).sqrt());
    x.clone().mul_scalar(0.5) * inner.tanh().add_scalar(1.0)
}

/// One decoder layer: pre-norm (Llama) `h = x + attn(norm(x))`, then `h + ffn(norm(h))`;
/// post-norm (OLMo 2, no `input_layernorm`) `h = x + norm(attn(x))`, then `h + norm(ffn(h))`;
/// or sandwich (Gemma) `h = x + norm(attn(norm(x)))`, then `h + norm(ffn(norm(h)))`.
/// The feed-forward `ffn` is the dense `mlp` or, in a sparse layer of a MoE model, `moe`.
#[parallelize]
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// The norm before attention (`None` in a post-norm layer).
    pub input_layernorm: Option<Tp<RmsNorm>>,
    /// Self-attention.
    #[nested]
    pub self_attn: Attention,
    /// The norm before the MLP (of attention's output in a post-norm layer).
    pub post_attention_layernorm: Tp<RmsNorm>,
    /// The SwiGLU MLP (`None` in a sparse layer).
    #[nested]
    pub mlp: Option<Mlp>,
    /// The sparse mixture-of-experts block (`None` in a dense layer).
    #[nested]
    pub moe: Option<SparseMoe>,
    /// The norm of the feed-forward's output in a post-norm or sandwich layer (`None` in a
    /// pre-norm one).
    pub post_feedforward_layernorm: Option<Tp<RmsNorm>>,
    /// The norm of the feed-forward's input in a sandwich layer (Gemma).
    pub pre_feedforward_layernorm: Option<Tp<RmsNorm>>,
}

/// The norm `n` of `x`, with its tensor-parallel style's collectives around it (none when
/// unsharded).
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
        let attn_in = match &self.input_layernorm {
            Some(n) => norm(n, x.clone()),
            None => x.clone(),
        };
        let attn = self.self_attn.forward_masked(attn_in, cos, sin, layout);
        let (h, normed) = match &self.post_feedforward_layernorm {
            None => {
                let h = x + attn;
                let normed = norm(&self.post_attention_layernorm, h.clone());
                (h, normed)
            }
            Some(_) => {
                let h = x + norm(&self.post_attention_layernorm, attn);
                let ffn_in = match &self.pre_feedforward_layernorm {
                    Some(n) => norm(n, h.clone()),
                    None => h.clone(),
                };
                (h, ffn_in)
            }
        };
        let (ffn, router_logits) = match (&self.mlp, &self.moe) {
            (Some(mlp), _) => (mlp.forward(normed), None),
            (None, Some(moe)) => {
                let (out, logits) = moe.forward(normed).unwrap_or_else(|e| panic!("{e}"));
                (out, Some(logits))
            }
            (None, None) => panic!("a decoder layer needs a dense MLP or a MoE block"),
        };
        let ffn = match &self.post_feedforward_layernorm {
            Some(n) => norm(n, ffn),
            None => ffn,
        };
        (h + ffn, router_logits)
    }
}
