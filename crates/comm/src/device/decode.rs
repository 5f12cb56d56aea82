//! A weight stored as 4-bit indices into a 16-value code book (QLoRA's NF4 base), decoded on
//! the device by backend ops, so that a quantized weight can be a step of a gather's list:
//! FSDP gathers the packed blocks, this step turns them into the weight, on every backend
//! (the same ops on the CPU and on a GPU).
//!
//! The packed layout, `[blocks, block / 4 + 1]` f32 values: the weight as PyTorch stores it
//! (`[d_out, d_in]`) flattened row-major and cut into blocks of `block` elements; per block,
//! `block / 4` values each holding four indices as an integer below 2^16 (the first index in
//! the highest nibble), then the block's absmax. A float holds those integers exactly, so the
//! blocks travel through every float collective; a cast to a half dtype would round them,
//! which is why decoding refuses any dtype but f32.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{DType, Shape, Slice, TensorData};

/// The indices each packed value holds.
pub const INDICES_PER_VALUE: usize = 4;

/// How a packed weight decodes: its code book, its block length and the weight's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CodedWeight {
    /// The 16 values the indices stand for (scaled by each block's absmax).
    pub code: [f32; 16],
    /// Elements per block; a multiple of [`INDICES_PER_VALUE`].
    pub block: usize,
    /// The weight's input features (Burn's dim 0).
    pub d_in: usize,
    /// The weight's output features (Burn's dim 1).
    pub d_out: usize,
}

impl CodedWeight {
    /// Elements of the weight.
    pub fn len(&self) -> usize {
        self.d_in * self.d_out
    }

    /// Whether the weight has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Blocks of the packed weight (the last may be partly padding).
    pub fn blocks(&self) -> usize {
        self.len().div_ceil(self.block)
    }

    /// Values per block of the packed layout: the packed indices and the absmax.
    pub fn row_len(&self) -> usize {
        self.block / INDICES_PER_VALUE + 1
    }

    /// The packed layout's shape, `[blocks, block / 4 + 1]`.
    pub fn packed_shape(&self) -> [usize; 2] {
        [self.blocks(), self.row_len()]
    }
}

fn slice_2d<B: Backend>(
    x: FloatTensor<B>,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
) -> FloatTensor<B> {
    let s = |r: std::ops::Range<usize>| Slice::new(r.start as isize, Some(r.end as isize), 1);
    B::float_slice(x, &[s(rows), s(cols)])
}

/// The weight of the packed blocks `x` (any shape holding `w.packed_shape()` elements), in
/// Burn's `[d_in, d_out]` layout, flattened, in f32. Panics when `x` is not f32 or does not
/// hold the packed elements (both are fixed when the weight is packed; a mixed-precision
/// policy that casts the blocks is refused where it is chosen).
pub fn decode<B: Backend>(x: FloatTensor<B>, w: &CodedWeight) -> FloatTensor<B> {
    assert_eq!(
        x.dtype(),
        DType::F32,
        "a 4-bit packed weight must stay f32 (a half dtype rounds its packed indices): keep \
         the quantized layers out of a mixed-precision param dtype"
    );
    let [blocks, row_len] = w.packed_shape();
    assert_eq!(
        x.shape().num_elements(),
        blocks * row_len,
        "a packed weight of {} values, expected {blocks} blocks of {row_len}",
        x.shape().num_elements()
    );
    let device = x.device();
    let per = row_len - 1;
    let x = B::float_reshape(x, Shape::new([blocks, row_len]));
    let packed = slice_2d::<B>(x.clone(), 0..blocks, 0..per);
    let absmax = slice_2d::<B>(x, 0..blocks, per..row_len);
    // floor(v / 16^j) is exact in f32 for the integers below 2^16 the values hold.
    let shifted =
        |j: i32| B::float_floor(B::float_div_scalar(packed.clone(), 16f64.powi(j).into()));
    let digits: Vec<FloatTensor<B>> = (0..INDICES_PER_VALUE as i32)
        .map(|k| {
            let (high, low) = (3 - k, 4 - k);
            let digit = B::float_sub(
                shifted(high),
                B::float_mul_scalar(shifted(low), 16f64.into()),
            );
            B::float_reshape(digit, Shape::new([blocks, per, 1]))
        })
        .collect();
    let indices = B::float_reshape(B::float_cat(digits, 2), Shape::new([blocks * w.block]));
    let indices = B::float_into_int(indices, get_or_init_device_settings::<B>(&device).int_dtype);
    let code = B::float_from_data(TensorData::new(w.code.to_vec(), [16]), &device);
    let values = B::float_reshape(
        B::float_select(code, 0, indices),
        Shape::new([blocks, w.block]),
    );
    let scale = B::float_expand(absmax, Shape::new([blocks, w.block]));
    let values = B::float_reshape(B::float_mul(values, scale), Shape::new([blocks * w.block]));
    let torch = B::float_slice(values, &[Slice::new(0, Some(w.len() as isize), 1)]);
    let torch = B::float_reshape(torch, Shape::new([w.d_out, w.d_in]));
    B::float_reshape(B::float_swap_dims(torch, 0, 1), Shape::new([w.len()]))
}
