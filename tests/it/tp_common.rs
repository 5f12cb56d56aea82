//! Helpers of the tensor-parallel tests: seeded modules (down to a Llama's attention and MLP),
//! shard slicing, param paths.

#![allow(dead_code)]

use std::ops::Range;

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::{Bool, Device, Gradients, Int, Tensor, TensorData};
use burn_parallel::fsdp::{PathVisitor, visit_with_paths};
use burn_parallel::parallelize;
use burn_parallel::tp::{Tp, forward_shared};

use crate::common::{assert_close, ndarray_ad, tensor, values, vec_of};

pub const TOL: f32 = 1e-5;

/// A Linear whose weight and bias come from seeds, identical on every rank thread.
pub fn linear(seed: u64, d_in: usize, d_out: usize) -> Linear {
    linear_on(&ndarray_ad(), seed, d_in, d_out)
}

pub fn linear_on(d: &Device, seed: u64, d_in: usize, d_out: usize) -> Linear {
    Linear {
        weight: Param::from_tensor(tensor(seed, [d_in, d_out], d)),
        bias: Some(Param::from_tensor(tensor(seed + 1000, [d_out], d))),
    }
}

pub fn embedding(seed: u64, vocab: usize, d_model: usize) -> Embedding {
    embedding_on(&ndarray_ad(), seed, vocab, d_model)
}

pub fn embedding_on(d: &Device, seed: u64, vocab: usize, d_model: usize) -> Embedding {
    Embedding {
        weight: Param::from_tensor(tensor(seed, [vocab, d_model], d)),
    }
}

/// The head layout of a grouped-query attention: `heads` query heads and `kv_heads` key/value
/// heads (each serving `heads / kv_heads` consecutive query heads) of `head_dim` features.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// The attention block `o(attend(q(x), k(x), v(x)))` of the projections `[q, k, v, o]`,
    /// q, k and v sharing one input collective (Megatron's single all-reduce/all-gather).
    pub fn attention(
        self,
        [q, k, v, o]: [&Tp<Linear>; 4],
        x: Tensor<3>,
        causal: bool,
    ) -> Tensor<3> {
        let [q, k, v] = forward_shared(x, [q, k, v]);
        o.forward(self.attend(q, k, v, causal))
    }

    /// `softmax(q k^T / sqrt(head_dim)) v` of projected `[batch, seq, _]` q, k and v, heads
    /// merged back; `causal` hides later positions. The one attention of the tp tests, so the
    /// models they compare against one device compute it alike.
    pub fn attend(self, q: Tensor<3>, k: Tensor<3>, v: Tensor<3>, causal: bool) -> Tensor<3> {
        let [b, s, _] = q.dims();
        let split = |t: Tensor<3>, h: usize| t.reshape([b, s, h, self.head_dim]).swap_dims(1, 2);
        // Each kv head serves `heads / kv_heads` consecutive query heads.
        let repeat = |t: Tensor<4>| {
            t.unsqueeze_dim::<5>(2)
                .repeat_dim(2, self.heads / self.kv_heads)
                .reshape([b, self.heads, s, self.head_dim])
        };
        let q = split(q, self.heads);
        let k = repeat(split(k, self.kv_heads));
        let v = repeat(split(v, self.kv_heads));
        let mut scores = q.matmul(k.swap_dims(2, 3)) / (self.head_dim as f64).sqrt();
        if causal {
            let mask = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device());
            scores = scores.mask_fill(mask.unsqueeze::<4>(), f32::NEG_INFINITY);
        }
        softmax(scores, 3)
            .matmul(v)
            .swap_dims(1, 2)
            .reshape([b, s, self.heads * self.head_dim])
    }
}

/// A Llama's grouped-query attention, seeded, for the Llama-shaped test models; the `#[tp]`
/// styles are its default plan (a plan given to `apply_plan` names its own).
#[parallelize]
#[derive(Module, Debug)]
pub struct Attention {
    #[tp(colwise)]
    q_proj: Tp<Linear>,
    #[tp(colwise)]
    k_proj: Tp<Linear>,
    #[tp(colwise)]
    v_proj: Tp<Linear>,
    #[tp(rowwise)]
    o_proj: Tp<Linear>,
    /// Heads this rank runs (all of them until tp is applied).
    #[module(skip)]
    #[tp(heads)]
    heads: usize,
    #[module(skip)]
    #[tp(kv_heads)]
    kv_heads: usize,
    #[module(skip)]
    head_dim: usize,
    /// Whether a position attends only to itself and earlier ones.
    #[module(skip)]
    causal: bool,
}

impl Attention {
    /// q, k, v and o on `d_model` features from seeds `seed..seed + 4`.
    pub fn seeded(d: &Device, seed: u64, d_model: usize, heads: Heads, causal: bool) -> Self {
        let Heads {
            heads,
            kv_heads,
            head_dim,
        } = heads;
        let (q, kv) = (heads * head_dim, kv_heads * head_dim);
        Self {
            q_proj: Tp::new(linear_on(d, seed, d_model, q)),
            k_proj: Tp::new(linear_on(d, seed + 1, d_model, kv)),
            v_proj: Tp::new(linear_on(d, seed + 2, d_model, kv)),
            o_proj: Tp::new(linear_on(d, seed + 3, q, d_model)),
            heads,
            kv_heads,
            head_dim,
            causal,
        }
    }

    /// q, k, v and o, in that order.
    pub fn projections(&self) -> [&Tp<Linear>; 4] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let heads = Heads {
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        };
        heads.attention(self.projections(), x, self.causal)
    }
}

/// A Llama's SwiGLU MLP, seeded, for the Llama-shaped test models; the `#[tp]` styles are its
/// default plan.
#[parallelize]
#[derive(Module, Debug)]
pub struct Mlp {
    #[tp(colwise)]
    gate_proj: Tp<Linear>,
    #[tp(colwise)]
    up_proj: Tp<Linear>,
    #[tp(rowwise)]
    down_proj: Tp<Linear>,
}

impl Mlp {
    /// gate, up and down between `d_model` and `inter` features from seeds `seed..seed + 3`.
    pub fn seeded(d: &Device, seed: u64, d_model: usize, inter: usize) -> Self {
        Self {
            gate_proj: Tp::new(linear_on(d, seed, d_model, inter)),
            up_proj: Tp::new(linear_on(d, seed + 1, d_model, inter)),
            down_proj: Tp::new(linear_on(d, seed + 2, inter, d_model)),
        }
    }

    /// gate, up and down, in that order.
    pub fn projections(&self) -> [&Tp<Linear>; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }

    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        // gate and up share one input collective.
        let [gate, up] = forward_shared(x, [&self.gate_proj, &self.up_proj]);
        self.down_proj.forward(silu(gate) * up)
    }
}

/// Deterministic token ids in `0..vocab`.
pub fn ids<const D: usize>(seed: u64, shape: [usize; D], vocab: usize) -> Tensor<D, Int> {
    ids_on(&ndarray_ad(), seed, shape, vocab)
}

pub fn ids_on<const D: usize>(
    d: &Device,
    seed: u64,
    shape: [usize; D],
    vocab: usize,
) -> Tensor<D, Int> {
    let n = shape.iter().product();
    let v: Vec<i64> = values(seed, n)
        .into_iter()
        .map(|x| (((x + 1.0) / 2.0 * vocab as f32) as i64).min(vocab as i64 - 1))
        .collect();
    Tensor::from_data(TensorData::new(v, shape), d)
}

pub fn grad<const D: usize>(p: &Param<Tensor<D>>, grads: &Gradients) -> Vec<f32> {
    vec_of(&p.val().grad(grads).expect("param has a gradient"))
}

pub fn tensor_grad<const D: usize>(t: &Tensor<D>, grads: &Gradients) -> Vec<f32> {
    vec_of(&t.grad(grads).expect("tensor has a gradient"))
}

/// Columns `range` of a row-major `[rows, cols]` matrix.
pub fn columns(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks(cols)
        .flat_map(|row| row[range.clone()].to_vec())
        .collect()
}

/// Rows `range` of a row-major matrix with `cols` columns (also: a slice along dim 0).
pub fn rows(m: &[f32], cols: usize, range: Range<usize>) -> Vec<f32> {
    m[range.start * cols..range.end * cols].to_vec()
}

/// Slice `range` of dim 1 of a row-major `[d0, d1, d2]` tensor.
pub fn mid(m: &[f32], d1: usize, d2: usize, range: Range<usize>) -> Vec<f32> {
    m.chunks(d1 * d2)
        .flat_map(|block| rows(block, d2, range.clone()))
        .collect()
}

/// Dotted paths of every float param, in visiting order.
pub fn param_paths<M: Module>(m: &M) -> Vec<String> {
    struct Paths(Vec<String>);
    impl PathVisitor for Paths {
        fn visit_float<const D: usize>(&mut self, path: &str, p: &Param<Tensor<D>>) {
            self.0.push(format!("{path} {:?}", p.shape().dims::<D>()));
        }
    }
    let mut v = Paths(Vec::new());
    visit_with_paths(m, &mut v);
    v.0
}

/// Gradients of a colwise `up` / rowwise `down` pair of linear layers.
pub struct MlpGrads {
    pub up_w: Vec<f32>,
    pub up_b: Vec<f32>,
    pub down_w: Vec<f32>,
    pub down_b: Vec<f32>,
}

impl MlpGrads {
    pub fn of(up: &Linear, down: &Linear, grads: &Gradients) -> Self {
        Self {
            up_w: grad(&up.weight, grads),
            up_b: grad(up.bias.as_ref().unwrap(), grads),
            down_w: grad(&down.weight, grads),
            down_b: grad(down.bias.as_ref().unwrap(), grads),
        }
    }

    /// Asserts that this rank's shard gradients are the slices `cols` (of `hidden`) of the
    /// single-device ones; the replicated `down` bias within `down_b_tol`.
    pub fn assert_shard_of(
        &self,
        full: &MlpGrads,
        hidden: usize,
        model: usize,
        cols: Range<usize>,
        down_b_tol: f32,
        ctx: impl Fn(&str) -> String,
    ) {
        let up_w = columns(&full.up_w, hidden, cols.clone());
        assert_close(&self.up_w, &up_w, TOL, &ctx("up w"));
        assert_close(&self.up_b, &full.up_b[cols.clone()], TOL, &ctx("up b"));
        let down_w = rows(&full.down_w, model, cols);
        assert_close(&self.down_w, &down_w, TOL, &ctx("down w"));
        assert_close(&self.down_b, &full.down_b, down_b_tol, &ctx("down b"));
    }
}
