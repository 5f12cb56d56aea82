// NdArray is deprecated in Burn 0.22 but remains our default test backend until 0.23.
#![allow(deprecated)]

//! AdamW's element-wise update as a backend kernel ([`AdamWBackend`]): Burn's plain ops on
//! every backend, one pass over the buffers on flex, in the same operation order (so the same
//! values).

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, NdArray, backend_extension};

/// One AdamW step's scalars, in f32, as the update applies them to every element:
/// `m = beta1 m + one_minus_beta1 g`, `v = beta2 v + one_minus_beta2 g^2`,
/// `p = decay p - (m / (sqrt(v) / bias2_sqrt + eps)) step_size`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// First-moment decay.
    pub beta1: f32,
    /// `1 - beta1`.
    pub one_minus_beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// `1 - beta2`.
    pub one_minus_beta2: f32,
    /// `sqrt(1 - beta2^step)`, the second moment's bias correction.
    pub bias2_sqrt: f32,
    /// Added to the corrected `sqrt(v)`.
    pub eps: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `1 - lr * weight_decay`, or `None` without weight decay.
    pub decay: Option<f32>,
}

/// The AdamW update of a flattened parameter `[n]` from its gradient and moments (all `[n]`,
/// f32), returning the parameter and both moments. The defaults are Burn's plain ops; flex
/// runs one loop.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait AdamWBackend: Backend {
    /// The first step: both moments start at zero.
    fn adamw_first_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        plain_first_step::<Self>(param, grad, s)
    }

    /// A later step, from the moments the previous one returned.
    fn adamw_step(
        param: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        m: FloatTensor<Self>,
        v: FloatTensor<Self>,
        s: AdamWScalars,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        plain_step::<Self>(param, grad, m, v, s)
    }
}

/// [`AdamWBackend::adamw_first_step`] in Burn's plain ops.
pub(super) fn plain_first_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    s: AdamWScalars,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let m = mul::<B>(grad.clone(), s.one_minus_beta1);
    let v = mul::<B>(B::float_mul(grad.clone(), grad), s.one_minus_beta2);
    finish::<B>(param, m, v, s)
}

/// [`AdamWBackend::adamw_step`] in Burn's plain ops.
pub(super) fn plain_step<B: Backend>(
    param: FloatTensor<B>,
    grad: FloatTensor<B>,
    m: FloatTensor<B>,
    v: FloatTensor<B>,
    s: AdamWScalars,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let m = B::float_add(
        mul::<B>(m, s.beta1),
        mul::<B>(grad.clone(), s.one_minus_beta1),
    );
    let g2 = B::float_mul(grad.clone(), grad);
    let v = B::float_add(mul::<B>(v, s.beta2), mul::<B>(g2, s.one_minus_beta2));
    finish::<B>(param, m, v, s)
}

fn mul<B: Backend>(x: FloatTensor<B>, c: f32) -> FloatTensor<B> {
    B::float_mul_scalar(x, (c as f64).into())
}

/// The parameter's update from the new moments: `(p, m, v)`.
fn finish<B: Backend>(
    param: FloatTensor<B>,
    m: FloatTensor<B>,
    v: FloatTensor<B>,
    s: AdamWScalars,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let corrected = B::float_div_scalar(B::float_sqrt(v.clone()), (s.bias2_sqrt as f64).into());
    let denom = B::float_add_scalar(corrected, (s.eps as f64).into());
    let update = mul::<B>(B::float_div(m.clone(), denom), s.step_size);
    let param = match s.decay {
        Some(decay) => mul::<B>(param, decay),
        None => param,
    };
    (B::float_sub(param, update), m, v)
}

impl AdamWBackend for NdArray {}

/// CubeCL (wgpu, CUDA): Burn's kernels, fused by Burn's fusion where it is built in.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl AdamWBackend for burn_cubecl::Cube {}

/// LibTorch: Burn's ops, which are LibTorch's own.
#[cfg(feature = "tch")]
impl AdamWBackend for burn::backend::LibTorch {}

/// The optimizer steps inner (non-autodiff) tensors; a tracked tensor takes the plain ops.
impl<B: AdamWBackend, C: burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy>
    AdamWBackend for burn::backend::Autodiff<B, C>
{
}
