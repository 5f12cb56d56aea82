//! A bf16 matrix product on the CPU's bf16 dot products (AVX512-BF16's `vdpbf16ps`: per f32
//! lane, two bf16 products added to an f32 sum), which gemm 0.19 lacks: burn-flex multiplies
//! bf16 by converting both operands to f32 for gemm's f32 kernel and the product back. Here
//! the operands are packed as bf16 pairs along the summed dimension, the sums stay in f32, and
//! each output element is rounded once to bf16 (to nearest even), as the f32 route rounds it.
//! The products are exact in f32; only the order of the f32 additions differs from gemm's.
//! Where the CPU has AMX and the OS grants it, the same packed B feeds AMX tiles instead
//! ([`Kernel::Tiles`], `super::amx`).

use std::mem::MaybeUninit;

use burn::tensor::bf16;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::amx;
use super::packing::{Bf16Matrix, NR, Packed, interleave, pairs_along};

/// Rows of a micro-tile (12 x 2 f32 accumulators, two B vectors and a broadcast fill 27 of
/// the 32 vector registers).
const MR: usize = 12;
/// Rows of A one task packs and multiplies by every B panel (its packed rows stay in L2).
const MC: usize = 96;

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

/// The instructions a product runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// AVX512-BF16's `vdpbf16ps` on vector registers.
    Vectors,
    /// AMX tiles ([`amx`]), where the CPU and the OS allow them.
    Tiles,
}

impl Kernel {
    /// The fastest kernel this process may run: tiles where granted, else vectors.
    pub(crate) fn best() -> Kernel {
        if available() && tiles_granted() {
            Kernel::Tiles
        } else {
            Kernel::Vectors
        }
    }

    /// Whether this process may run the kernel.
    pub(crate) fn runs_here(self) -> bool {
        match self {
            Kernel::Vectors => available(),
            Kernel::Tiles => available() && tiles_granted(),
        }
    }
}

/// `a @ b` (`a.rows x b.cols`, row-major) on [`Kernel::best`], on the calling thread's rayon
/// pool (a rank's own compute threads). Panics when the shapes disagree or the CPU lacks the
/// instructions ([`available`] tells).
pub(crate) fn matmul(a: Bf16Matrix, b: Bf16Matrix) -> Vec<bf16> {
    let len = a.rows * b.cols;
    let mut out = Vec::with_capacity(len);
    matmul_on(Kernel::best(), a, b, &mut out.spare_capacity_mut()[..len]);
    // SAFETY: `matmul_on` wrote every one of the `len` elements (the kernels write each output
    // row in full; an empty sum fills zeros). Skipping the zero fill saves a pass over memory.
    unsafe { out.set_len(len) };
    out
}

/// `a @ b` into `out`, every element written, on the given kernel (which must
/// [run here](Kernel::runs_here)).
pub(crate) fn matmul_on(
    kernel: Kernel,
    a: Bf16Matrix,
    b: Bf16Matrix,
    out: &mut [MaybeUninit<bf16>],
) {
    assert_eq!(a.cols, b.rows, "bf16 matmul: inner dimensions differ");
    assert_eq!(out.len(), a.rows * b.cols, "bf16 matmul: output size");
    assert!(
        kernel.runs_here(),
        "bf16 matmul: this CPU cannot run {kernel:?}"
    );
    let n = b.cols;
    if out.is_empty() {
        return;
    }
    let pairs = a.cols.div_ceil(2);
    if pairs == 0 {
        // An empty sum.
        out.iter_mut().for_each(|o| _ = o.write(bf16::ZERO));
        return;
    }
    match kernel {
        Kernel::Vectors => {
            let packed_b = pack_b(b, pairs, pairs);
            out.par_chunks_mut(MC * n)
                .enumerate()
                .for_each(|(block, out_rows)| {
                    let rows = out_rows.len() / n;
                    let packed_a = pack_a(a, block * MC, rows, pairs);
                    multiply_block(&packed_a, packed_b.as_slice(), pairs, rows, n, out_rows);
                });
        }
        // `runs_here` holds only on x86-64.
        #[cfg(target_arch = "x86_64")]
        Kernel::Tiles => {
            let padded = amx::padded_pairs(pairs);
            let packed_b = pack_b(b, pairs, padded);
            out.par_chunks_mut(MC * n)
                .enumerate()
                .for_each(|(block, out_rows)| {
                    let rows = out_rows.len() / n;
                    let packed_a = amx::pack_a(a, block * MC, rows, padded);
                    // SAFETY: `runs_here` checked the CPU and the OS's grant.
                    unsafe {
                        amx::tile_block(
                            packed_a.as_slice(),
                            packed_b.as_slice(),
                            padded,
                            rows,
                            n,
                            out_rows,
                        )
                    };
                });
        }
        #[cfg(not(target_arch = "x86_64"))]
        Kernel::Tiles => unreachable!("AMX is x86-64's"),
    }
}

/// Whether AMX tiles run here (x86-64 only).
fn tiles_granted() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
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
/// elements as one u32, zero padded past the last row and column, and to `padded` pairs.
fn pack_b(b: Bf16Matrix, pairs: usize, padded: usize) -> Packed {
    let n = b.cols;
    let mut packed = Packed::zeroed(n.div_ceil(NR) * padded * NR);
    packed
        .as_mut_slice()
        .par_chunks_mut(padded * NR)
        .enumerate()
        .for_each(|(panel, dst)| {
            let first = panel * NR;
            // SAFETY: `matmul` checked the CPU features.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                x86::pack_b_panel(b, first, NR.min(n - first), &mut dst[..pairs * NR])
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
    out: &mut [MaybeUninit<bf16>],
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
                out[at..at + cols].write_copy_of_slice(&tile_out[r * NR..r * NR + cols]);
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
