// NdArray is deprecated in Burn 0.22 but remains the default test backend until 0.23.
#![allow(deprecated)]

//! Fused blocks of the Llama: SwiGLU's `silu(gate) * up`, RMSNorm, the rotary embedding and
//! causal attention, each one autodiff node with its own backward.
//!
//! Written with Burn's plain ops, each block is a chain of nodes that saves its intermediates
//! for backward (RMSNorm alone: the f32 input, its square, the mean, the root, the reciprocal,
//! the product) and allocates a tensor per op in both passes. Here each block is one node that
//! saves its inputs (attention also its probabilities) and runs one kernel per pass.
//! [`FusedBackend`] is a Burn backend extension: on flex (the default CPU backend) the
//! element-wise blocks are single loops over f32 or bf16 buffers (bf16 computed in f32 and
//! rounded where the plain ops round), and attention runs flex's matmuls around a one-loop
//! masked softmax; on every other backend, dtype or layout the kernels are the plain-op math
//! ([`plain`]), so the model has one path and the autodiff node is the same everywhere. Both are tested against [`reference`] (the blocks op by op, as transformers
//! writes them), values and gradients; `benches/kernels.rs` times them against it.

mod autodiff;
mod flex;
pub mod plain;
pub mod reference;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, NdArray, backend_extension};
use burn::tensor::Tensor;

/// Fused kernels for the Llama's element-wise blocks (see the module docs). The defaults are
/// the plain-op math; flex overrides them with fused loops, and the autodiff backend records
/// one node per block.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait FusedBackend: Backend {
    /// `silu(gate) * up`, element-wise; `gate` and `up` have one shape and dtype.
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        plain::swiglu::<Self>(gate, up)
    }

    /// The gradients of [`swiglu`](Self::swiglu) with respect to `gate` and `up`.
    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        plain::swiglu_backward::<Self>(gate, up, grad)
    }

    /// RMSNorm over the last dim, computed in f32: `x / sqrt(mean(x^2) + eps) * weight`, in
    /// `x`'s dtype; `weight` is `[last dim]` in `x`'s dtype.
    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        plain::rms_norm::<Self>(x, weight, eps)
    }

    /// The gradients of [`rms_norm`](Self::rms_norm) with respect to `x` and `weight`.
    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        plain::rms_norm_backward::<Self>(x, weight, grad, eps)
    }

    /// The rotate-half rotary embedding `x * cos + rotate_half(x) * sin` of `x`
    /// `[.., seq, head_dim]`, with `cos` and `sin` `[1, .., 1, seq, head_dim]`.
    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        plain::rotary::<Self>(x, cos, sin, false)
    }

    /// The gradient of [`rotary`](Self::rotary) with respect to `x`: the transposed rotation
    /// of `grad`.
    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        plain::rotary::<Self>(grad, cos, sin, true)
    }

    /// Causal self-attention with the softmax in f32 (transformers' eager attention): `q`, `k`
    /// and `v` `[batch, heads, seq, head_dim]` in one dtype (grouped-query heads already
    /// repeated), scores scaled by `scale`, keys after a query's position masked out.
    fn causal_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::causal_attention_forward(q, k, v, scale).0
    }

    /// [`causal_attention`](Self::causal_attention)'s output and its f32 probabilities
    /// `[batch, heads, seq, seq]` (what backward needs).
    fn causal_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        plain::causal_attention::<Self>(q, k, v, scale)
    }

    /// The gradients of [`causal_attention`](Self::causal_attention) with respect to `q`, `k`
    /// and `v`, from the forward's probabilities.
    fn causal_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        probs: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        plain::causal_attention_backward::<Self>(q, k, v, probs, grad, scale)
    }

    /// The softmax in f32 over the last dim of `scores * scale` `[.., seq, seq]`, with key `j`
    /// masked out of query row `i` where `j > i`.
    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        plain::causal_softmax::<Self>(scores, scale)
    }

    /// The softmax's backward in f32: `probs * (grad - sum(grad * probs))` over the last dim.
    fn softmax_backward(probs: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        plain::softmax_backward::<Self>(probs, grad)
    }
}

impl FusedBackend for NdArray {}

/// LibTorch: the plain-op math (its own kernels fuse nothing across these ops).
#[cfg(feature = "tch")]
impl FusedBackend for burn::backend::LibTorch {}

/// Burn's CubeCL backend (CUDA, wgpu): the plain-op math until a GPU kernel exists. With the
/// `fusion` feature `Cube` is Burn's fusion backend over it, which fuses those ops' kernels.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl FusedBackend for burn_cubecl::Cube {}

/// `silu(gate) * up` as one autodiff node (SwiGLU's gating), in the inputs' dtype.
pub fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::swiglu(
        gate.into_dispatch(),
        up.into_dispatch(),
    ))
}

/// RMSNorm of `x` over its last dim, computed in f32 and returned in `x`'s dtype, scaled by
/// `weight` (cast to `x`'s dtype first, as transformers does), as one autodiff node.
pub fn rms_norm<const D: usize>(x: Tensor<D>, weight: Tensor<1>, eps: f64) -> Tensor<D> {
    let weight = weight.cast(burn::tensor::FloatDType::from(x.dtype()));
    Tensor::from_dispatch(<Dispatch as FusedBackend>::rms_norm(
        x.into_dispatch(),
        weight.into_dispatch(),
        eps,
    ))
}

/// The rotate-half rotary embedding of `x` `[batch, heads, seq, head_dim]` with the constant
/// `cos` / `sin` of [`Rope::cos_sin`](crate::Rope::cos_sin), as one autodiff node. `cos` and
/// `sin` get no gradient (they are positions, not parameters).
pub fn rotary(x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as FusedBackend>::rotary(
        x.into_dispatch(),
        cos.clone().detach().into_dispatch(),
        sin.clone().detach().into_dispatch(),
    ))
}

/// Causal self-attention of `q`, `k`, `v` `[batch, heads, seq, head_dim]` (one shape; repeat
/// grouped-query heads first), scores scaled by `scale`, softmax in f32 as transformers' eager
/// attention, as one autodiff node that keeps the probabilities for backward.
pub fn causal_attention(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, scale: f64) -> Tensor<4> {
    assert_eq!(
        (q.dims(), k.dims()),
        (v.dims(), v.dims()),
        "causal_attention takes q, k and v of one shape"
    );
    Tensor::from_dispatch(<Dispatch as FusedBackend>::causal_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        scale,
    ))
}

#[cfg(test)]
pub(crate) mod tests;
