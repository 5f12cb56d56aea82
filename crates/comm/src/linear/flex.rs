//! Flex's linear kernels: bf16 operands multiply through [`bf16_gemm`] where the CPU has
//! AVX512-BF16; f32 and every other case keep Burn's kernels.

use burn::backend::flex::FlexTensor;
use burn::backend::ops::{FloatTensorOps, ModuleOps};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Shape, TensorData, bf16};

use super::LinearBackend;
use super::bf16_gemm;
use super::packing::Bf16Matrix;

/// A 2-D bf16 tensor as a strided matrix over its storage (`None` for other dtypes, ranks or
/// negative strides; a broadcast view's zero stride is walked as it is).
fn matrix(t: &FlexTensor) -> Option<Bf16Matrix<'_>> {
    let layout = t.layout();
    let (rows, cols, row_stride, col_stride) = layout.as_2d_strides()?;
    if t.dtype() != DType::BF16 || row_stride < 0 || col_stride < 0 {
        return None;
    }
    Some(Bf16Matrix {
        data: &t.storage::<bf16>()[layout.start_offset()..],
        rows,
        cols,
        row_stride: row_stride as usize,
        col_stride: col_stride as usize,
    })
}

/// `t` `[.., last]` as a `[rows, last]` matrix (a view where the layout allows).
fn rows_of(t: &FlexTensor) -> FlexTensor {
    let dims = t.shape().to_vec();
    let (last, leading) = dims
        .split_last()
        .expect("a linear layer's tensors have a last dim");
    t.reshape(Shape::new([leading.iter().product(), *last]))
}

/// `a @ b` when both are bf16 matrices and the CPU multiplies bf16 (`None` otherwise).
fn bf16_product(a: &FlexTensor, b: &FlexTensor) -> Option<FlexTensor> {
    let (a, b) = (matrix(a)?, matrix(b)?);
    let out = bf16_gemm::matmul(a, b);
    Some(FlexTensor::from_data(TensorData::new(
        out,
        [a.rows, b.cols],
    )))
}

/// Whether the bf16 kernel takes these operands: both bf16, and the CPU has it.
fn takes(a: &FlexTensor, b: &FlexTensor) -> bool {
    a.dtype() == DType::BF16 && b.dtype() == DType::BF16 && bf16_gemm::available()
}

/// `shape` with its last dim replaced by `last`.
fn with_last(shape: &Shape, last: usize) -> Shape {
    let mut dims = shape.to_vec();
    *dims
        .last_mut()
        .expect("a linear layer's tensors have a last dim") = last;
    Shape::from(dims)
}

impl LinearBackend for Flex {
    fn linear_forward(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        if !takes(&x, &weight) {
            return Self::linear(x, weight, None);
        }
        let shape = x.shape();
        match bf16_product(&rows_of(&x), &weight) {
            Some(out) => {
                let d_out = out.shape()[1];
                out.reshape(with_last(&shape, d_out))
            }
            None => Self::linear(x, weight, None),
        }
    }

    fn biased_linear_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !takes(&x, &weight) || bias.dtype() != DType::BF16 {
            return Self::linear(x, weight, Some(bias));
        }
        // The product rounded to bf16, then the bias added in bf16, as Burn's bf16 linear does.
        let ndims = x.shape().num_dims();
        let mut bias_dims = vec![1; ndims - 1];
        bias_dims.push(bias.shape()[0]);
        let out = Self::linear_forward(x, weight);
        Self::float_add(out, Self::float_reshape(bias, Shape::from(bias_dims)))
    }

    fn linear_input_grad(weight: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if !takes(&weight, &grad) {
            return Self::linear_x_backward(weight, grad);
        }
        let shape = grad.shape();
        let weight_t = weight.transpose(0, 1);
        match bf16_product(&rows_of(&grad), &weight_t) {
            Some(out) => {
                let d_in = out.shape()[1];
                out.reshape(with_last(&shape, d_in))
            }
            None => Self::linear_x_backward(weight, grad),
        }
    }

    fn linear_weight_grad(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        if !takes(&x, &grad) {
            return Self::linear_weight_backward(x, grad);
        }
        let x_t = rows_of(&x).transpose(0, 1);
        bf16_product(&x_t, &rows_of(&grad)).unwrap_or_else(|| Self::linear_weight_backward(x, grad))
    }
}
