//! A bf16 matrix product on the CPU's bf16 dot products (AVX512-BF16's `vdpbf16ps`: per f32
//! lane, two bf16 products added to an f32 sum), which gemm 0.19 lacks: burn-flex multiplies
//! bf16 by converting both operands to f32 for gemm's f32 kernel and the product back. Here
//! the operands are packed as bf16 pairs along the summed dimension, the sums stay in f32, and
//! each output element is rounded once to bf16 (to nearest even), as the f32 route rounds it.
//! The products are exact in f32; only the order of the f32 additions differs from gemm's.

use burn::tensor::bf16;
use rayon::prelude::*;

/// Rows of a micro-tile (12 x 2 f32 accumulators, two B vectors and a broadcast fill 27 of
/// the 32 vector registers).
const MR: usize = 12;
/// Columns of a micro-tile: two 16-lane vectors.
const NR: usize = 32;
/// Rows of A one task packs and multiplies by every B panel (its packed rows stay in L2).
const MC: usize = 96;

/// A read-only bf16 matrix in strided storage: element `(r, c)` is
/// `data[r * row_stride + c * col_stride]`, so a transposed view is the same storage with the
/// strides swapped.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bf16Matrix<'a> {
    pub data: &'a [bf16],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Bf16Matrix<'_> {
    /// Element `(r, c)`'s bits, 0 (the bf16 zero) outside the matrix: packing pads with it.
    #[inline]
    fn bits(&self, r: usize, c: usize) -> u32 {
        if r < self.rows && c < self.cols {
            self.data[r * self.row_stride + c * self.col_stride].to_bits() as u32
        } else {
            0
        }
    }

    /// Elements `(r, c)` and `(r, c + 1)` as one pair, the first in the low half (the order
    /// `vdpbf16ps` reads a lane's two products in).
    #[inline]
    fn pair_along_row(&self, r: usize, c: usize) -> u32 {
        self.bits(r, c) | self.bits(r, c + 1) << 16
    }

    /// Elements `(r, c)` and `(r + 1, c)` as one pair.
    #[inline]
    fn pair_along_col(&self, r: usize, c: usize) -> u32 {
        self.bits(r, c) | self.bits(r + 1, c) << 16
    }
}

/// Whether this CPU has the instructions [`matmul`] needs (checked at run time, so one binary
/// runs everywhere: without them the caller keeps its f32 route).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `a @ b` into `out` (`a.rows x b.cols`, row-major), on the calling thread's rayon pool (a
/// rank's own compute threads). Panics when the shapes disagree or the CPU lacks the
/// instructions ([`available`] tells).
pub(crate) fn matmul(a: Bf16Matrix, b: Bf16Matrix, out: &mut [bf16]) {
    assert_eq!(a.cols, b.rows, "bf16 matmul: inner dimensions differ");
    assert_eq!(out.len(), a.rows * b.cols, "bf16 matmul: output size");
    assert!(available(), "bf16 matmul needs AVX512-BF16");
    let n = b.cols;
    if out.is_empty() {
        return;
    }
    let pairs = a.cols.div_ceil(2);
    if pairs == 0 {
        // An empty sum.
        out.fill(bf16::ZERO);
        return;
    }
    let packed_b = pack_b(b, pairs);
    out.par_chunks_mut(MC * n)
        .enumerate()
        .for_each(|(block, out_rows)| {
            let rows = out_rows.len() / n;
            let packed_a = pack_a(a, block * MC, rows, pairs);
            multiply_block(&packed_a, &packed_b, pairs, rows, n, out_rows);
        });
}

/// B's columns in panels of [`NR`]; within a panel, for each pair of rows, each column's two
/// elements as one u32 (zero padded past the last row and column).
fn pack_b(b: Bf16Matrix, pairs: usize) -> Vec<u32> {
    let mut packed = vec![0u32; b.cols.div_ceil(NR) * pairs * NR];
    packed
        .par_chunks_mut(pairs * NR)
        .enumerate()
        .for_each(|(panel, dst)| {
            for (kk, row) in dst.chunks_exact_mut(NR).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = b.pair_along_col(2 * kk, panel * NR + j);
                }
            }
        });
    packed
}

/// A's rows `first..first + rows` in tiles of [`MR`]; within a tile, for each pair of
/// columns, each row's two elements as one u32 (zero padded past the last row and column).
fn pack_a(a: Bf16Matrix, first: usize, rows: usize, pairs: usize) -> Vec<u32> {
    let mut packed = vec![0u32; rows.div_ceil(MR) * pairs * MR];
    for (tile, dst) in packed.chunks_exact_mut(pairs * MR).enumerate() {
        for r in 0..MR.min(rows - tile * MR) {
            let row = first + tile * MR + r;
            for kk in 0..pairs {
                dst[kk * MR + r] = a.pair_along_row(row, 2 * kk);
            }
        }
    }
    packed
}

/// One block of output rows: every B panel against every A tile of the block (a panel is
/// reused from cache across the block's tiles).
fn multiply_block(
    packed_a: &[u32],
    packed_b: &[u32],
    pairs: usize,
    rows: usize,
    n: usize,
    out: &mut [bf16],
) {
    let mut tile_out = [bf16::ZERO; MR * NR];
    for (panel, b) in packed_b.chunks_exact(pairs * NR).enumerate() {
        let col = panel * NR;
        let cols = NR.min(n - col);
        for (tile, a) in packed_a.chunks_exact(pairs * MR).enumerate() {
            // SAFETY: `matmul` checked the CPU features; `a` and `b` hold `pairs` steps each.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::tile(pairs, a, b, &mut tile_out)
            };
            for r in 0..MR.min(rows - tile * MR) {
                let at = (tile * MR + r) * n + col;
                out[at..at + cols].copy_from_slice(&tile_out[r * NR..r * NR + cols]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{MR, NR, bf16};

    /// One `MR x NR` tile over all `pairs`: f32 sums in registers, rounded to bf16 at the end.
    #[target_feature(enable = "avx512f,avx512bf16,avx512vl")]
    pub(super) unsafe fn tile(pairs: usize, a: &[u32], b: &[u32], out: &mut [bf16; MR * NR]) {
        assert!(a.len() >= pairs * MR && b.len() >= pairs * NR);
        let mut sums = [[_mm512_setzero_ps(); 2]; MR];
        for kk in 0..pairs {
            // SAFETY: in bounds by the assertion; unaligned loads; the casts reinterpret bits.
            unsafe {
                let b_at = b.as_ptr().add(kk * NR);
                let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b_at.cast()));
                let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b_at.add(16).cast()));
                let a_at = a.as_ptr().add(kk * MR);
                for (r, sum) in sums.iter_mut().enumerate() {
                    let pair: __m512bh =
                        std::mem::transmute(_mm512_set1_epi32(*a_at.add(r) as i32));
                    sum[0] = _mm512_dpbf16_ps(sum[0], pair, b0);
                    sum[1] = _mm512_dpbf16_ps(sum[1], pair, b1);
                }
            }
        }
        for (r, sum) in sums.iter().enumerate() {
            for (half, lanes) in sum.iter().enumerate() {
                // SAFETY: 16 bf16 at `r * NR + half * 16`, inside `out`.
                unsafe {
                    let rounded: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(*lanes));
                    let at = out.as_mut_ptr().add(r * NR + half * 16);
                    _mm256_storeu_si256(at.cast(), rounded);
                }
            }
        }
    }
}
