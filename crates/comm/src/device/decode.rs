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

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Flex, TensorMetadata, get_or_init_device_settings};
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

/// [`decode`] on flex as one pass over the packed values, written straight into Burn's layout
/// (the plain ops make about twenty passes, as many weight-sized temporaries and a transposed
/// copy, on every gather of a quantized layer in forward and again in backward). Equal to
/// [`decode`] bit for bit: each value is one code times its block's absmax. A tensor `decode`
/// would refuse goes to it for its message.
pub fn decode_flex(x: FlexTensor, w: &CodedWeight) -> FlexTensor {
    let [blocks, row_len] = w.packed_shape();
    if x.dtype() != DType::F32 || x.shape().num_elements() != blocks * row_len {
        return decode::<Flex>(x, w);
    }
    let x = match x.as_slice::<f32>() {
        Some(_) => x,
        None => x.to_contiguous(),
    };
    let packed = x.as_slice::<f32>().expect("contiguous f32");
    let per = row_len - 1;
    let mut out = vec![0f32; w.len()];
    let mut writer = TransposingWriter::new(&mut out, w.d_in, w.d_out);
    let mut left = w.len();
    for row in packed.chunks_exact(row_len) {
        let absmax = row[per];
        let mut in_block = w.block.min(left);
        left -= in_block;
        for &value in &row[..per] {
            let digits = value as u32;
            for k in 0..INDICES_PER_VALUE.min(in_block) {
                let shift = 4 * (INDICES_PER_VALUE - 1 - k);
                writer.push(w.code[((digits >> shift) & 15) as usize] * absmax);
            }
            in_block = in_block.saturating_sub(INDICES_PER_VALUE);
        }
    }
    writer.flush();
    FlexTensor::from_data(TensorData::new(out, [w.len()]))
}

/// Rows of PyTorch's `[d_out, d_in]` taken at once: each flush writes runs of this many
/// consecutive elements of Burn's `[d_in, d_out]` (a cache line of f32).
const ROWS_AT_ONCE: usize = 16;

/// Takes a `[d_out, d_in]` weight's elements in row-major order and writes them transposed,
/// `[d_in, d_out]`, a few rows at a time so that the writes stay in cache lines.
struct TransposingWriter<'a> {
    out: &'a mut [f32],
    rows: Vec<f32>,
    filled: usize,
    first_row: usize,
    d_in: usize,
    d_out: usize,
}

impl<'a> TransposingWriter<'a> {
    fn new(out: &'a mut [f32], d_in: usize, d_out: usize) -> Self {
        Self {
            out,
            rows: vec![0.0; ROWS_AT_ONCE * d_in],
            filled: 0,
            first_row: 0,
            d_in,
            d_out,
        }
    }

    fn push(&mut self, value: f32) {
        self.rows[self.filled] = value;
        self.filled += 1;
        if self.filled == self.rows.len() {
            self.flush();
        }
    }

    /// Writes the complete rows taken so far.
    fn flush(&mut self) {
        let n = self.filled.checked_div(self.d_in).unwrap_or(0);
        for i in 0..self.d_in {
            let start = i * self.d_out + self.first_row;
            for (g, slot) in self.out[start..start + n].iter_mut().enumerate() {
                *slot = self.rows[g * self.d_in + i];
            }
        }
        self.first_row += n;
        self.filled = 0;
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::flex::FlexTensor;
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::TensorData;

    use super::{CodedWeight, INDICES_PER_VALUE, decode, decode_flex};

    /// Packed blocks of pseudo-random indices and absmaxes (an all-zero block among them).
    fn packed(w: &CodedWeight) -> Vec<f32> {
        let [blocks, row_len] = w.packed_shape();
        let mut state = 7u32;
        let mut next = || {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
            state >> 8
        };
        let mut out = Vec::new();
        for b in 0..blocks {
            for _ in 0..row_len - 1 {
                let digits = next() & ((1 << (4 * INDICES_PER_VALUE)) - 1);
                out.push(if b == 1 { 0.0 } else { digits as f32 });
            }
            out.push(if b == 1 {
                0.0
            } else {
                0.5 + (next() % 100) as f32
            });
        }
        out
    }

    #[test]
    fn flex_decodes_as_the_plain_ops_do_on_uneven_shapes() {
        let code: [f32; 16] = std::array::from_fn(|i| i as f32 / 7.5 - 1.0);
        // A length that is not a multiple of the block, a block that is not one of six, more
        // output rows than one flush takes, and a partial last flush.
        for (d_in, d_out, block) in [
            (5, 7, 64),
            (64, 3, 64),
            (10, 37, 16),
            (3, 1, 4),
            (9, 40, 64),
        ] {
            let w = CodedWeight {
                code,
                block,
                d_in,
                d_out,
            };
            let data = TensorData::new(packed(&w), w.packed_shape());
            let plain = decode::<Flex>(FlexTensor::from_data(data.clone()), &w);
            let fast = decode_flex(FlexTensor::from_data(data), &w);
            assert_eq!(fast.shape(), plain.shape());
            let (fast, plain) = (fast.into_data(), plain.into_data());
            assert_eq!(
                fast.as_slice::<f32>().unwrap(),
                plain.as_slice::<f32>().unwrap(),
                "{d_in} x {d_out}, blocks of {block}"
            );
        }
    }
}
