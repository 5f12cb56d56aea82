// NdArray is deprecated in Burn 0.22 but remains our default test backend until 0.23.
#![allow(deprecated)]

//! The dense layer `x @ w + b` as one autodiff node whose three products are backend kernels
//! ([`LinearBackend`]): Burn's own linear kernels, except on flex, where each is one 2-D
//! product over the rows of every leading dim (transposed operands as views, not copies) and
//! bf16, where the CPU has AVX512-BF16, multiplies bf16 by bf16 into f32 sums ([`bf16_gemm`])
//! instead of burn-flex's conversion of both operands to f32. Every linear layer of the models,
//! LoRA and tensor parallelism runs through [`linear`], so the dtype decides the kernel, not
//! the layer.

#[cfg(target_arch = "x86_64")]
mod amx;
mod autodiff;
mod bf16_gemm;
mod flex;
mod packing;
#[cfg(test)]
mod tests;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, NdArray, backend_extension};
use burn::tensor::{DType, Tensor};

/// The kernels of a linear layer. The defaults are Burn's (`ModuleOps::linear` and its two
/// backward products); flex overrides them for bf16; the autodiff backend records one node
/// that calls them.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait LinearBackend: Backend {
    /// `x @ weight`: `x` `[.., d_in]`, `weight` `[d_in, d_out]`.
    fn linear_forward(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::linear(x, weight, None)
    }

    /// `x @ weight + bias`, `bias` `[d_out]`.
    fn biased_linear_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::linear(x, weight, Some(bias))
    }

    /// The input gradient `grad @ weight^T`, in `grad`'s shape with `d_in` last.
    fn linear_input_grad(weight: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::linear_x_backward(weight, grad)
    }

    /// The weight gradient `x^T @ grad`, summed over every leading dim: `[d_in, d_out]`.
    fn linear_weight_grad(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::linear_weight_backward(x, grad)
    }
}

impl LinearBackend for NdArray {}

/// CubeCL (wgpu, CUDA): Burn's kernels, which multiply bf16 natively.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl LinearBackend for burn_cubecl::Cube {}

/// LibTorch: Burn's kernels, which are LibTorch's own.
#[cfg(feature = "tch")]
impl LinearBackend for burn::backend::LibTorch {}

/// `x @ weight + bias` over `x`'s last dim (`weight` `[d_in, d_out]`, Burn's layout), as Burn's
/// `linear` computes it, as one autodiff node whose products are [`LinearBackend`] kernels:
/// the same values as Burn's `linear` except bf16 on a CPU with AVX512-BF16, where the sums
/// are added in another order (still in f32, rounded to bf16 once). A quantized weight takes
/// Burn's quantized route.
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    if matches!(weight.dtype(), DType::QFloat(_)) {
        return burn::tensor::module::linear(x, weight, bias);
    }
    if D == 1 {
        // A vector is one row, as Burn's linear treats it.
        let d_in = x.dims()[0];
        let y: Tensor<2> = linear(x.reshape([1, d_in]), weight, bias);
        let d_out = y.dims()[1];
        return Tensor::from_dispatch(y.reshape([d_out]).into_dispatch());
    }
    let (x, weight) = (x.into_dispatch(), weight.into_dispatch());
    Tensor::from_dispatch(match bias {
        Some(bias) => {
            <Dispatch as LinearBackend>::biased_linear_forward(x, weight, bias.into_dispatch())
        }
        None => <Dispatch as LinearBackend>::linear_forward(x, weight),
    })
}
