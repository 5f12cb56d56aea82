//! The fused blocks' math in Burn's plain backend ops: the kernels of every backend without a
//! fused one (and of flex for dtypes or layouts its loops do not take).

use burn::backend::tensor::{Device, FloatTensor};
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{FloatDType, Shape, Slice, TensorData};

use super::FusedBackend;

/// `silu(gate) * up`.
pub fn swiglu<B: Backend>(gate: FloatTensor<B>, up: FloatTensor<B>) -> FloatTensor<B> {
    let silu = B::float_mul(gate.clone(), B::sigmoid(gate));
    B::float_mul(silu, up)
}

/// `(d gate, d up)` of [`swiglu`]: `grad * up * s * (1 + gate * (1 - s))` and
/// `grad * silu(gate)`, with `s = sigmoid(gate)`.
pub fn swiglu_backward<B: Backend>(
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    grad: FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let s = B::sigmoid(gate.clone());
    let silu = B::float_mul(gate, s.clone());
    let d_up = B::float_mul(grad.clone(), silu.clone());
    // d silu / d gate = s + silu * (1 - s)
    let one_minus_s = B::float_add_scalar(B::float_neg(s.clone()), 1.0.into());
    let d_silu = B::float_add(s, B::float_mul(silu, one_minus_s));
    let d_gate = B::float_mul(B::float_mul(grad, up), d_silu);
    (d_gate, d_up)
}

/// `1 / sqrt(mean(x^2) + eps)` over the last dim of the f32 `x`, keeping that dim as 1.
fn inv_rms<B: Backend>(x: FloatTensor<B>, eps: f64) -> FloatTensor<B> {
    let last = x.shape().num_dims() - 1;
    let mean_square = B::float_mean_dim(B::float_mul(x.clone(), x), last);
    B::float_recip(B::float_sqrt(B::float_add_scalar(mean_square, eps.into())))
}

/// `weight` `[n]` as `[1, .., 1, n]` of `rank` dims, to broadcast over rows.
fn as_row<B: Backend>(weight: FloatTensor<B>, rank: usize) -> FloatTensor<B> {
    let n = weight.shape().num_elements();
    let mut dims = vec![1; rank];
    dims[rank - 1] = n;
    B::float_reshape(weight, Shape::from(dims))
}

/// RMSNorm over the last dim, in f32, returned in `x`'s dtype and scaled by `weight` (in `x`'s
/// dtype): transformers' `LlamaRMSNorm`.
pub fn rms_norm<B: Backend>(x: FloatTensor<B>, weight: FloatTensor<B>, eps: f64) -> FloatTensor<B> {
    let dtype = FloatDType::from(x.dtype());
    let rank = x.shape().num_dims();
    let x = B::float_cast(x, FloatDType::F32);
    let normed = B::float_cast(B::float_mul(x.clone(), inv_rms::<B>(x, eps)), dtype);
    B::float_mul(normed, as_row::<B>(weight, rank))
}

/// `(d x, d weight)` of [`rms_norm`]. With `r = 1 / rms(x)`, `n = x r` and `dn = grad weight`:
/// `d x = r (dn - n mean(dn n))` and `d weight` the sum of `grad n` over the rows.
pub fn rms_norm_backward<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    grad: FloatTensor<B>,
    eps: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(x.dtype());
    let shape = x.shape();
    let (rank, n) = (shape.num_dims(), shape[shape.num_dims() - 1]);
    let x = B::float_cast(x, FloatDType::F32);
    let r = inv_rms::<B>(x.clone(), eps);
    let normed = B::float_mul(x, r.clone());
    let d_weight = B::float_mul(grad.clone(), B::float_cast(normed.clone(), dtype));
    let rows = shape.num_elements() / n;
    let d_weight = B::float_sum_dim(B::float_reshape(d_weight, Shape::new([rows, n])), 0);
    let d_weight = B::float_reshape(d_weight, Shape::new([n]));
    let d_normed = B::float_cast(
        B::float_mul(grad, as_row::<B>(weight, rank)),
        FloatDType::F32,
    );
    let dot = B::float_mean_dim(B::float_mul(d_normed.clone(), normed.clone()), rank - 1);
    let d_x = B::float_mul(r, B::float_sub(d_normed, B::float_mul(normed, dot)));
    (B::float_cast(d_x, dtype), d_weight)
}

/// `x`'s last dim split in halves `(x1, x2)`.
fn halves<B: Backend>(x: &FloatTensor<B>) -> (FloatTensor<B>, FloatTensor<B>) {
    let shape = x.shape();
    let rank = shape.num_dims();
    let half = shape[rank - 1] / 2;
    let piece = |range: std::ops::Range<usize>| {
        let mut slices: Vec<Slice> = shape.iter().map(|&d| Slice::from(0..d)).collect();
        slices[rank - 1] = Slice::from(range);
        B::float_slice(x.clone(), &slices)
    };
    (piece(0..half), piece(half..2 * half))
}

/// `x * cos + rotate_half(x) * sin` with `rotate_half(x) = [-x2, x1]`; `transposed`: the
/// gradient map `x * cos + [y2, -y1]` with `y = x * sin` (rotate_half's transpose).
pub fn rotary<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    transposed: bool,
) -> FloatTensor<B> {
    let last = x.shape().num_dims() - 1;
    let scaled = B::float_mul(x.clone(), cos);
    let rotated = match transposed {
        false => {
            let (x1, x2) = halves::<B>(&x);
            B::float_mul(B::float_cat(vec![B::float_neg(x2), x1], last), sin)
        }
        true => {
            let (y1, y2) = halves::<B>(&B::float_mul(x, sin));
            B::float_cat(vec![y2, B::float_neg(y1)], last)
        }
    };
    B::float_add(scaled, rotated)
}

/// `[1, .., 1, s, s]` (of `rank` dims) in f32: 0 where key `j <= i` (query `i`), -inf after.
fn causal_mask<B: Backend>(rank: usize, s: usize, device: &Device<B>) -> FloatTensor<B> {
    let mask: Vec<f32> = (0..s * s)
        .map(|at| match at % s > at / s {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    let mut dims = vec![1; rank];
    dims[rank - 2] = s;
    dims[rank - 1] = s;
    B::float_from_data(TensorData::new(mask, dims), device)
}

/// `x` with its last two dims swapped.
fn transposed<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    let rank = x.shape().num_dims();
    B::float_swap_dims(x, rank - 2, rank - 1)
}

/// The causal softmax in f32 of `scores * scale` (see [`FusedBackend::causal_softmax`]).
pub fn causal_softmax<B: Backend>(scores: FloatTensor<B>, scale: f64) -> FloatTensor<B> {
    let shape = scores.shape();
    let rank = shape.num_dims();
    let mask = causal_mask::<B>(rank, shape[rank - 1], &scores.device());
    let scores = B::float_cast(B::float_mul_scalar(scores, scale.into()), FloatDType::F32);
    let scores = B::float_add(scores, mask);
    let max = B::float_max_dim(scores.clone(), rank - 1);
    let exp = B::float_exp(B::float_sub(scores, max));
    let sum = B::float_sum_dim(exp.clone(), rank - 1);
    B::float_div(exp, sum)
}

/// `probs * (grad - sum(grad * probs))` over the last dim, in f32.
pub fn softmax_backward<B: Backend>(probs: FloatTensor<B>, grad: FloatTensor<B>) -> FloatTensor<B> {
    let rank = probs.shape().num_dims();
    let grad = B::float_cast(grad, FloatDType::F32);
    let dot = B::float_sum_dim(B::float_mul(grad.clone(), probs.clone()), rank - 1);
    B::float_mul(probs, B::float_sub(grad, dot))
}

/// Causal attention and its f32 probabilities, with the backend's softmax.
pub fn causal_attention<B: FusedBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(q.dtype());
    let probs = B::causal_softmax(B::float_matmul(q, transposed::<B>(k)), scale);
    let out = B::float_matmul(B::float_cast(probs.clone(), dtype), v);
    (out, probs)
}

/// `(d q, d k, d v)` of [`causal_attention`]: with `P` the probabilities and `dS` the softmax's
/// backward of `dO v^T`, `d v = P^T dO`, `d q = scale dS k`, `d k = scale dS^T q`.
pub fn causal_attention_backward<B: FusedBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    probs: FloatTensor<B>,
    grad: FloatTensor<B>,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(q.dtype());
    let probs_t = transposed::<B>(B::float_cast(probs.clone(), dtype));
    let d_v = B::float_matmul(probs_t, grad.clone());
    let d_probs = B::float_matmul(grad, transposed::<B>(v));
    let d_scores = B::softmax_backward(probs, d_probs);
    let d_scores = B::float_cast(B::float_mul_scalar(d_scores, scale.into()), dtype);
    let d_q = B::float_matmul(d_scores.clone(), k);
    let d_k = B::float_matmul(transposed::<B>(d_scores), q);
    (d_q, d_k, d_v)
}
