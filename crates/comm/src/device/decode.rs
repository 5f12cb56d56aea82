//! A weight stored as 4-bit indices into a 16-value code book (QLoRA's NF4 base), decoded on
//! the device by backend ops, so that a quantized weight can be a step of a gather's list:
//! FSDP gathers the packed blocks, this step turns them into the weight, on every backend
//! (the same ops on the CPU and on a GPU).
//!
//! The packed layout, `[blocks, ceil(block / 6) + 1]` f32 values: the weight as PyTorch stores
//! it (`[d_out, d_in]`) flattened row-major and cut into blocks of `block` elements; per block,
//! `ceil(block / 6)` values each holding six indices as an integer below 2^24 (the first index
//! in the highest nibble; the last value of a block padded with code zero), then the block's
//! absmax: 6 bits an element for NF4's blocks of 64 (bitsandbytes' bytes take 4.5). An f32
//! holds integers below 2^24 exactly (its 24-bit significand), so the blocks travel through
//! every float collective, and Burn has no bit cast to carry 8 indices in one; a cast to a half
//! dtype would round them, which is why decoding refuses any dtype but f32.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata, get_or_init_device_settings};
use burn::tensor::{DType, Shape, Slice, TensorData};

/// The indices each packed value holds: 6 x 4 bits, the integers an f32 holds exactly.
pub const INDICES_PER_VALUE: usize = 6;

/// How a packed weight decodes: its code book, its block length and the weight's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CodedWeight {
    /// The 16 values the indices stand for (scaled by each block's absmax).
    pub code: [f32; 16],
    /// Elements per block.
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
        self.block.div_ceil(INDICES_PER_VALUE) + 1
    }

    /// The packed layout's shape, `[blocks, ceil(block / 6) + 1]`.
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
    // floor(v / 16^j), exact in f32 for the integers below 2^24 the values hold (j = 6 gives 0).
    let shifted: Vec<FloatTensor<B>> = (0..=INDICES_PER_VALUE as i32)
        .map(|j| B::float_floor(B::float_div_scalar(packed.clone(), 16f64.powi(j).into())))
        .collect();
    let digits: Vec<FloatTensor<B>> = (0..INDICES_PER_VALUE)
        .map(|k| {
            let high = INDICES_PER_VALUE - 1 - k;
            let above = B::float_mul_scalar(shifted[high + 1].clone(), 16f64.into());
            let digit = B::float_sub(shifted[high].clone(), above);
            B::float_reshape(digit, Shape::new([blocks, per, 1]))
        })
        .collect();
    let slots = B::float_reshape(
        B::float_cat(digits, 2),
        Shape::new([blocks, per * INDICES_PER_VALUE]),
    );
    let indices = slice_2d::<B>(slots, 0..blocks, 0..w.block);
    let indices = B::float_reshape(indices, Shape::new([blocks * w.block]));
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
