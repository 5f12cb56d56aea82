//! Flex's linear kernels: each product is one 2-D product over the rows of every leading dim;
//! bf16 operands multiply through [`bf16_gemm`] where the CPU has AVX512-BF16, every other
//! case on burn-flex's matmul.

use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
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

/// `a @ b` for 2-D operands: the bf16 kernel where it takes them, else burn-flex's strided
/// product (gemm reads a transposed view in place).
fn product(a: FlexTensor, b: FlexTensor) -> FlexTensor {
    let bf16 = takes(&a, &b).then(|| bf16_product(&a, &b)).flatten();
    bf16.unwrap_or_else(|| Flex::float_matmul(a, b))
}

/// Every product as one 2-D product over the rows of all leading dims, transposed operands as
/// views: Burn's route multiplies batch by batch where its policy keeps the batches (packing
/// the weight again for each) and copies a transposed weight to make it contiguous for the
/// input gradient (measured at 95M in f32: 8% of a step in that copy).
impl LinearBackend for Flex {
    fn linear_forward(x: FloatTensor<Self>, weight: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = x.shape();
        let out = product(rows_of(&x), weight);
        let d_out = out.shape()[1];
        out.reshape(with_last(&shape, d_out))
    }

    fn biased_linear_forward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        // The product rounded to its dtype, then the bias added, as Burn's linear does.
        let ndims = x.shape().num_dims();
        let mut bias_dims = vec![1; ndims - 1];
        bias_dims.push(bias.shape()[0]);
        let out = Self::linear_forward(x, weight);
        Self::float_add(out, Self::float_reshape(bias, Shape::from(bias_dims)))
    }

    fn linear_input_grad(weight: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = grad.shape();
        let out = product(rows_of(&grad), weight.transpose(0, 1));
        let d_in = out.shape()[1];
        out.reshape(with_last(&shape, d_in))
    }

    fn linear_weight_grad(x: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        product(rows_of(&x).transpose(0, 1), rows_of(&grad))
    }
}
