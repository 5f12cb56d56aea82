//! bitsandbytes' 4-bit NormalFloat (NF4), the storage of a QLoRA base: a weight flattened
//! row-major is cut into blocks of [`NF4_BLOCK`] consecutive elements; each block keeps its
//! largest magnitude (`absmax`, f32) and each element the index (4 bits) of the code-book value
//! nearest to `element / absmax`, two indices per byte, the first element in the high nibble.
//! A last block shorter than [`NF4_BLOCK`] keeps the elements it has; a block of zeros has
//! absmax 0 and dequantizes to zeros.

use burn_parallel_comm::collectives::INDICES_PER_VALUE;

/// Elements per quantization block (bitsandbytes' `blocksize` default for NF4).
pub const NF4_BLOCK: usize = 64;

/// NF4's 16 values (QLoRA's quantiles of a unit normal, scaled to [-1, 1]), as bitsandbytes
/// stores them.
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// A weight in NF4: packed indices and one absmax per block.
#[derive(Debug, Clone, PartialEq)]
pub struct Nf4 {
    /// Two 4-bit code indices per byte, the first element in the high nibble; an odd
    /// element count leaves the last low nibble 0.
    pub packed: Vec<u8>,
    /// Each block's largest magnitude.
    pub absmax: Vec<f32>,
    /// Elements quantized.
    pub len: usize,
}

/// The index of the code-book value nearest to `x` (in [-1, 1]), as bitsandbytes'
/// `dQuantizeNF4` finds it: `x` against the midpoints between neighbouring values (taken in
/// double precision, compared in f32), strictly above a midpoint taking the upper value, so a
/// value exactly halfway takes the lower.
fn nearest(x: f32) -> u8 {
    let mut index = 0;
    for i in 1..NF4_CODE.len() {
        let midpoint = ((NF4_CODE[i - 1] as f64 + NF4_CODE[i] as f64) / 2.0) as f32;
        if x > midpoint {
            index = i;
        }
    }
    index as u8
}

/// Quantizes `values` (a weight flattened row-major) to NF4.
pub fn quantize_nf4(values: &[f32]) -> Nf4 {
    let mut indices = Vec::with_capacity(values.len());
    let mut absmax = Vec::with_capacity(values.len().div_ceil(NF4_BLOCK));
    for block in values.chunks(NF4_BLOCK) {
        let max = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        absmax.push(max);
        // bitsandbytes multiplies by the reciprocal rather than dividing.
        let inverse = 1.0 / max;
        match max > 0.0 {
            true => indices.extend(block.iter().map(|v| nearest(v * inverse))),
            // An all-zero block: every element is the code's zero.
            false => indices.extend(block.iter().map(|_| 7u8)),
        }
    }
    let packed = indices
        .chunks(2)
        .map(|pair| (pair[0] << 4) | pair.get(1).copied().unwrap_or(0))
        .collect();
    Nf4 {
        packed,
        absmax,
        len: values.len(),
    }
}

impl Nf4 {
    /// The weight's values again, each `code[index] * absmax` of its block, in f32.
    pub fn dequantize(&self) -> Vec<f32> {
        (0..self.len)
            .map(|i| NF4_CODE[self.index(i) as usize] * self.absmax[i / NF4_BLOCK])
            .collect()
    }
}

impl Nf4 {
    /// The code index of element `i` (code zero, 7, past the end).
    fn index(&self, i: usize) -> u8 {
        if i >= self.len {
            return 7;
        }
        let byte = self.packed[i / 2];
        match i % 2 {
            0 => byte >> 4,
            _ => byte & 0x0f,
        }
    }

    /// The layout a device decodes (`comm::collectives::CodedWeight`): per block of
    /// [`NF4_BLOCK`] elements, `ceil(NF4_BLOCK / INDICES_PER_VALUE)` f32 values each holding
    /// that many indices (the first in the highest nibble; a short last block, and the last
    /// value of each block, padded with code zero), then the block's absmax.
    pub fn to_blocks(&self) -> Vec<f32> {
        let per = NF4_BLOCK.div_ceil(INDICES_PER_VALUE);
        let mut out = Vec::with_capacity(self.absmax.len() * (per + 1));
        for (b, absmax) in self.absmax.iter().enumerate() {
            for j in 0..per {
                let first = b * NF4_BLOCK + INDICES_PER_VALUE * j;
                let index = |k: usize| match INDICES_PER_VALUE * j + k < NF4_BLOCK {
                    true => self.index(first + k),
                    false => 7,
                };
                let value = (0..INDICES_PER_VALUE).fold(0u32, |v, k| (v << 4) | index(k) as u32);
                out.push(value as f32);
            }
            out.push(*absmax);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The code book written out independently of the code under test: bitsandbytes' values,
    /// as the decimal literals of its `create_normal_map` output.
    const CODE: [f64; 16] = [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ];

    /// `dequantize(quantize(values))` by direct search: for each element, the code value whose
    /// distance to `element / absmax` is smallest (ties are not in the data below), times the
    /// block's absmax.
    fn expected(values: &[f32]) -> Vec<f32> {
        let mut out = Vec::new();
        for block in values.chunks(64) {
            let max = block.iter().map(|v| v.abs() as f64).fold(0.0, f64::max);
            for &v in block {
                if max == 0.0 {
                    out.push(0.0);
                    continue;
                }
                let x = v as f64 / max;
                let best = CODE
                    .iter()
                    .min_by(|a, b| (*a - x).abs().total_cmp(&(*b - x).abs()))
                    .unwrap();
                out.push((*best as f32) * max as f32);
            }
        }
        out
    }

    fn pseudo_normal(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                let mut sum = 0.0;
                for _ in 0..4 {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    sum += (state >> 40) as f64 / (1u64 << 24) as f64 - 0.5;
                }
                (sum * 0.05) as f32
            })
            .collect()
    }

    #[test]
    fn the_code_book_is_bitsandbytes() {
        for (got, want) in NF4_CODE.iter().zip(CODE) {
            assert_eq!(*got, want as f32);
        }
    }

    #[test]
    fn round_trips_match_the_code_book_search() {
        // 64 * 3 + 29: the last block is short.
        let mut values = pseudo_normal(64 * 3 + 29, 7);
        // Block 1 all zeros; block 2 one huge value among small ones.
        values[64..128].iter_mut().for_each(|v| *v = 0.0);
        values[130] = 1.0e6;
        let q = quantize_nf4(&values);
        assert_eq!(q.absmax.len(), 4);
        assert_eq!(q.packed.len(), values.len().div_ceil(2));
        assert_eq!(q.absmax[1], 0.0);
        assert_eq!(q.absmax[2], 1.0e6);
        let got = q.dequantize();
        assert_eq!(got, expected(&values));
        assert!(got[64..128].iter().all(|v| *v == 0.0));
        assert_eq!(got[130], 1.0e6, "the block's largest value is exact");
    }

    #[test]
    fn nibbles_pack_first_element_high() {
        let q = quantize_nf4(&[-1.0, 1.0, 0.0]);
        assert_eq!(q.packed, vec![0x0f, 0x70]);
        assert_eq!(q.dequantize(), vec![-1.0, 1.0, 0.0]);
    }
}
