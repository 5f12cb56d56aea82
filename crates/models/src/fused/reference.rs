//! The fused blocks written op by op with Burn's tensor API, as transformers writes them: what
//! the fused kernels must equal (the tests compare values and gradients) and what
//! `benches/kernels.rs` times them against.

use burn::tensor::activation::{silu, softmax};
use burn::tensor::{FloatDType, Tensor, TensorData};

/// `silu(gate) * up`.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    silu(gate) * up
}

/// transformers' `LlamaRMSNorm`: in f32, back to `x`'s dtype, times `weight` in that dtype.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Tensor<D> {
    let dtype = x.dtype();
    let x = x.cast(FloatDType::F32);
    let inv_rms = x
        .clone()
        .square()
        .mean_dim(D - 1)
        .add_scalar(eps)
        .sqrt()
        .recip();
    (x * inv_rms).cast(dtype) * weight.cast(dtype).unsqueeze::<D>()
}

/// `x * cos + rotate_half(x) * sin`, `rotate_half(x) = [-x2, x1]`.
pub fn rotary(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    let half = x.dims()[3] / 2;
    let x1 = x.clone().narrow(3, 0, half);
    let x2 = x.clone().narrow(3, half, half);
    let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
    x * cos.clone() + rotated * sin.clone()
}

/// transformers' eager attention: scaled scores, the causal mask added in f32, softmax in f32,
/// cast back, times `v`.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f64) -> Tensor<4> {
    let s = q.dims()[2];
    let dtype = q.dtype();
    let mask: Vec<f32> = (0..s * s)
        .map(|at| match at % s > at / s {
            true => f32::NEG_INFINITY,
            false => 0.0,
        })
        .collect();
    let mask = Tensor::<4>::from_data(TensorData::new(mask, [1, 1, s, s]), &q.device());
    let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(scale);
    let probs = softmax(scores.cast(FloatDType::F32) + mask, 3).cast(dtype);
    probs.matmul(v)
}
