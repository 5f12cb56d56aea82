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

/// Whether this CPU has the instructions [`matmul`] needs (checked at run time, so one binary
/// runs everywhere: without them the caller keeps its f32 route).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
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

/// Two bf16 as one u32, `low` in the low half (the order `vdpbf16ps` reads a lane's two
/// products in).
#[inline(always)]
fn pair(low: bf16, high: bf16) -> u32 {
    low.to_bits() as u32 | (high.to_bits() as u32) << 16
}

/// `out[i] = pair(data[low + i * stride], data[high + i * stride])`, zeros for a missing
/// `high` (past an odd last row); `stride` 0 is a broadcast view.
#[inline(always)]
fn interleave(out: &mut [u32], data: &[bf16], low: usize, high: Option<usize>, stride: usize) {
    let n = out.len();
    if stride == 1 {
        // Two contiguous runs: the loop vectorizes.
        let lows = &data[low..low + n];
        match high {
            Some(high) => {
                let highs = &data[high..high + n];
                for ((o, &l), &h) in out.iter_mut().zip(lows).zip(highs) {
                    *o = pair(l, h);
                }
            }
            None => {
                for (o, &l) in out.iter_mut().zip(lows) {
                    *o = pair(l, bf16::ZERO);
                }
            }
        }
        return;
    }
    for (i, o) in out.iter_mut().enumerate() {
        let h = high.map_or(bf16::ZERO, |h| data[h + i * stride]);
        *o = pair(data[low + i * stride], h);
    }
}

/// The pairs of a run of `k` elements along the summed dim from `start`, `stride` apart, into
/// every `step`-th element of `dst` (an odd last one pairs with zero).
#[inline(always)]
fn pairs_along(dst: &mut [u32], step: usize, data: &[bf16], start: usize, stride: usize, k: usize) {
    let mut slots = dst.iter_mut().step_by(step);
    if stride == 1 {
        // Adjacent pairs: the common row-major case, read two at a time.
        let chunks = data[start..start + k].chunks_exact(2);
        let last = chunks.remainder().first().copied();
        for (two, slot) in chunks.zip(&mut slots) {
            *slot = pair(two[0], two[1]);
        }
        if let (Some(last), Some(slot)) = (last, slots.next()) {
            *slot = pair(last, bf16::ZERO);
        }
        return;
    }
    for (kk, slot) in slots.take(k.div_ceil(2)).enumerate() {
        let high = (2 * kk + 1 < k).then(|| data[start + (2 * kk + 1) * stride]);
        *slot = pair(data[start + 2 * kk * stride], high.unwrap_or(bf16::ZERO));
    }
}

/// B's columns `first..first + cols` as one panel: for each pair of rows, each column's two
/// elements as one u32 (`dst` zeroed past the last row and column).
#[inline(always)]
fn pack_b_panel(b: Bf16Matrix, first: usize, cols: usize, dst: &mut [u32]) {
    let k = b.rows;
    // Walk memory in order: down each column when the summed dim is the contiguous one (a
    // transposed weight), along the rows otherwise.
    if b.row_stride == 1 {
        for j in 0..cols {
            pairs_along(&mut dst[j..], NR, b.data, (first + j) * b.col_stride, 1, k);
        }
    } else {
        for (kk, out) in dst.chunks_exact_mut(NR).enumerate() {
            let low = 2 * kk * b.row_stride + first * b.col_stride;
            let high = (2 * kk + 1 < k).then(|| low + b.row_stride);
            interleave(&mut out[..cols], b.data, low, high, b.col_stride);
        }
    }
}

/// A's rows `top..top + rows` as one tile: for each pair of columns, each row's two elements
/// as one u32 (`dst` zeroed past the last row and column).
#[inline(always)]
fn pack_a_tile(a: Bf16Matrix, top: usize, rows: usize, dst: &mut [u32]) {
    let k = a.cols;
    // Walk memory in order: across the tile's rows when they are the contiguous dim (a
    // transposed input), along each row otherwise.
    if a.row_stride == 1 {
        for (kk, out) in dst.chunks_exact_mut(MR).enumerate() {
            let low = top + 2 * kk * a.col_stride;
            let high = (2 * kk + 1 < k).then(|| low + a.col_stride);
            interleave(&mut out[..rows], a.data, low, high, 1);
        }
    } else {
        for r in 0..rows {
            pairs_along(
                &mut dst[r..],
                MR,
                a.data,
                (top + r) * a.row_stride,
                a.col_stride,
                k,
            );
        }
    }
}

/// B's columns in panels of [`NR`]; within a panel, for each pair of rows, each column's two
/// elements as one u32, zero padded past the last row and column.
fn pack_b(b: Bf16Matrix, pairs: usize) -> Vec<u32> {
    let n = b.cols;
    let mut packed = vec![0u32; n.div_ceil(NR) * pairs * NR];
    packed
        .par_chunks_mut(pairs * NR)
        .enumerate()
        .for_each(|(panel, dst)| {
            let first = panel * NR;
            // SAFETY: `matmul` checked the CPU features.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::pack_b_panel(b, first, NR.min(n - first), dst)
            };
        });
    packed
}

/// A's rows `first..first + rows` in tiles of [`MR`]; within a tile, for each pair of
/// columns, each row's two elements as one u32 (zero padded past the last row and column).
fn pack_a(a: Bf16Matrix, first: usize, rows: usize, pairs: usize) -> Vec<u32> {
    let mut packed = vec![0u32; rows.div_ceil(MR) * pairs * MR];
    for (tile, dst) in packed.chunks_exact_mut(pairs * MR).enumerate() {
        let top = first + tile * MR;
        // SAFETY: `matmul` checked the CPU features.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            x86::pack_a_tile(a, top, MR.min(rows - tile * MR), dst)
        };
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

    use super::{Bf16Matrix, MR, NR, bf16};

    /// [`pack_b_panel`](super::pack_b_panel) compiled for the vectors [`super::available`]
    /// checked.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_b_panel(b: Bf16Matrix, first: usize, cols: usize, dst: &mut [u32]) {
        super::pack_b_panel(b, first, cols, dst)
    }

    /// [`pack_a_tile`](super::pack_a_tile) compiled for the vectors [`super::available`]
    /// checked.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn pack_a_tile(a: Bf16Matrix, top: usize, rows: usize, dst: &mut [u32]) {
        super::pack_a_tile(a, top, rows, dst)
    }

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
