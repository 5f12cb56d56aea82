//! The bf16 product on Intel's AMX tiles (`tdpbf16ps`: a 16 x 32 bf16 tile of A times a
//! 16 x 16 tile of B's bf16 pairs, added to 16 x 16 f32 sums), where the CPU has them and
//! Linux grants this process their state. Each micro-kernel keeps a 32 x 32 block of f32 sums
//! in four tiles and streams A's and B's tiles over the summed dim; B is packed as
//! `super::bf16_gemm` packs it for `vdpbf16ps` (pairs of rows by 32 columns, which is two
//! B tiles side by side), A in tiles of 16 rows by 16 pairs. Each sum is rounded to bf16
//! once, as the other kernels round it.
//!
//! Rust has no stable AMX intrinsics: the instructions are written as inline assembly on
//! fixed tile registers (tmm0-3 the sums, tmm4-5 A, tmm6-7 B), which the compiler never uses.

use std::arch::asm;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

use super::packing::{Bf16Matrix, NR, Packed, interleave, pairs_along};
use burn::tensor::bf16;

/// Rows of an AMX tile.
const TILE_ROWS: usize = 16;
/// bf16 pairs along the summed dim in one tile row (64 bytes).
const TILE_PAIRS: usize = 16;
/// Rows of a micro-kernel's block of sums: two A tiles.
const MICRO_ROWS: usize = 2 * TILE_ROWS;

/// Whether this process can run [`tile_block`]: the CPU has AMX-TILE and AMX-BF16 (CPUID
/// leaf 7) and Linux granted the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`). Asked
/// once per process: the grant is the process's, and the CPU does not change.
pub(crate) fn available() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| cpu_has_amx_bf16() && linux_grants_tile_data())
}

fn cpu_has_amx_bf16() -> bool {
    // CPUID leaf 7's EDX: bit 22 AMX-BF16, bit 24 AMX-TILE (where the CPU has leaf 7).
    let leaf7 = __cpuid(0).eax >= 7 && (__cpuid_count(7, 0).edx >> 22) & 0b101 == 0b101;
    leaf7 && std::arch::is_x86_feature_detected!("avx512bf16")
}

#[cfg(target_os = "linux")]
fn linux_grants_tile_data() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments; it fails cleanly on kernels
    // without AMX support.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(target_os = "linux"))]
fn linux_grants_tile_data() -> bool {
    false
}

/// Pairs along the summed dim rounded up to whole tiles (the packed operands are zero there).
pub(crate) fn padded_pairs(pairs: usize) -> usize {
    pairs.div_ceil(TILE_PAIRS) * TILE_PAIRS
}

/// A's rows `first..first + rows` in tiles of 16 rows (an even number of them, so that every
/// micro-kernel has two), each tile as its `padded_pairs / 16` chunks of 16 rows by 16 pairs,
/// zero past the last row and pair.
pub(crate) fn pack_a(a: Bf16Matrix, first: usize, rows: usize, padded_pairs: usize) -> Packed {
    let tiles = rows.div_ceil(MICRO_ROWS) * 2;
    let mut packed = Packed::zeroed(tiles * TILE_ROWS * padded_pairs);
    // SAFETY: AMX runs only where AVX-512 does (`bf16_gemm::Kernel::runs_here`).
    unsafe { pack_a_rows(a, first, rows, padded_pairs, packed.as_mut_slice()) };
    packed
}

/// [`pack_a`]'s loops, compiled for AVX-512, reading A in memory order.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn pack_a_rows(
    a: Bf16Matrix,
    first: usize,
    rows: usize,
    padded_pairs: usize,
    packed: &mut [u32],
) {
    let (k, run) = (a.cols, 2 * TILE_PAIRS);
    if a.row_stride == 1 {
        // A transposed input (the weight gradient's): its rows are the contiguous dim, so
        // walk down each pair of columns, 16 rows at a time, and place each row's pair.
        for (t, tile) in packed
            .chunks_exact_mut(TILE_ROWS * padded_pairs)
            .enumerate()
        {
            let Some(height) = rows.checked_sub(t * TILE_ROWS).filter(|&h| h > 0) else {
                break;
            };
            let (height, top) = (height.min(TILE_ROWS), first + t * TILE_ROWS);
            let mut column = [0u32; TILE_ROWS];
            for kk in 0..k.div_ceil(2) {
                let low = top + 2 * kk * a.col_stride;
                let high = (2 * kk + 1 < k).then(|| low + a.col_stride);
                interleave(&mut column[..height], a.data, low, high, 1);
                let chunk = &mut tile[(kk / TILE_PAIRS) * TILE_ROWS * TILE_PAIRS..];
                for (r, &pair) in column[..height].iter().enumerate() {
                    chunk[r * TILE_PAIRS + kk % TILE_PAIRS] = pair;
                }
            }
        }
        return;
    }
    for r in 0..rows {
        let row = (first + r) * a.row_stride;
        let tile = &mut packed[(r / TILE_ROWS) * TILE_ROWS * padded_pairs..];
        for chunk in 0..k.div_ceil(run) {
            let at = chunk * TILE_ROWS * TILE_PAIRS + (r % TILE_ROWS) * TILE_PAIRS;
            let done = chunk * run;
            let (start, len) = (row + done * a.col_stride, run.min(k - done));
            pairs_along(
                &mut tile[at..at + TILE_PAIRS],
                1,
                a.data,
                start,
                a.col_stride,
                len,
            );
        }
    }
}

/// The tile shapes every kernel uses: eight tiles of 16 rows by 64 bytes (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// A micro-kernel's 32 x 32 f32 sums, each row of a tile on its own cache line.
#[repr(C, align(64))]
struct Sums([f32; MICRO_ROWS * NR]);

/// One block of output rows on AMX: every B panel against every pair of A tiles. `packed_a`
/// is [`pack_a`]'s, `packed_b` B's panels of [`NR`] columns over `padded_pairs` pairs, both
/// 64-byte aligned ([`Packed`]).
///
/// # Safety
/// [`available`] must have returned true.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vl")]
pub(crate) unsafe fn tile_block(
    packed_a: &[u32],
    packed_b: &[u32],
    padded_pairs: usize,
    rows: usize,
    n: usize,
    out: &mut [MaybeUninit<bf16>],
) {
    let chunks = padded_pairs / TILE_PAIRS;
    let a_tile = TILE_ROWS * padded_pairs;
    assert!(packed_a.len() >= rows.div_ceil(MICRO_ROWS) * 2 * a_tile);
    assert!(packed_b.len() >= n.div_ceil(NR) * padded_pairs * NR);
    let mut sums = Sums([0f32; MICRO_ROWS * NR]);
    // SAFETY: AMX is granted (the caller's contract); the config is 64 bytes, aligned.
    unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly, preserves_flags)) };
    for (panel, b) in packed_b.chunks_exact(padded_pairs * NR).enumerate() {
        let col = panel * NR;
        let cols = NR.min(n - col);
        for micro in 0..rows.div_ceil(MICRO_ROWS) {
            let a = &packed_a[2 * micro * a_tile..];
            // SAFETY: the assertions bound every tile read; `sums` holds 32 x 32 f32.
            unsafe { micro_kernel(chunks, a.as_ptr(), a_tile, b.as_ptr(), &mut sums.0) };
            let top = micro * MICRO_ROWS;
            for r in 0..MICRO_ROWS.min(rows - top) {
                let at = (top + r) * n + col;
                // SAFETY: the CPU has AVX512-BF16 and BW (this function's features).
                unsafe { round_row(&sums.0[r * NR..(r + 1) * NR], &mut out[at..at + cols]) };
            }
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
}

/// The 32 x 32 f32 sums of two A tiles (`a`, `a + a_tile`) by one B panel (`b`, two tiles
/// side by side) over `chunks` steps of 16 pairs, stored row-major into `sums`.
///
/// # Safety
/// The tiles are configured; `a` holds two tiles of `chunks` chunks, `b` `chunks * 16` rows
/// of [`NR`] pairs.
#[inline(always)]
unsafe fn micro_kernel(
    chunks: usize,
    a: *const u32,
    a_tile: usize,
    b: *const u32,
    sums: &mut [f32; MICRO_ROWS * NR],
) {
    let (a_stride, b_stride) = (TILE_PAIRS * 4, NR * 4);
    // SAFETY (every block): the caller's bounds; tmm0-7 are not the compiler's.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem, preserves_flags)
        );
        for chunk in 0..chunks {
            let a0 = a.add(chunk * TILE_ROWS * TILE_PAIRS);
            let b0 = b.add(chunk * TILE_PAIRS * NR);
            asm!(
                "tileloadd tmm4, [{a0} + {a_stride}]",
                "tileloadd tmm5, [{a1} + {a_stride}]",
                "tileloadd tmm6, [{b0} + {b_stride}]",
                "tileloadd tmm7, [{b1} + {b_stride}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0,
                a1 = in(reg) a0.add(a_tile),
                b0 = in(reg) b0,
                b1 = in(reg) b0.add(TILE_PAIRS),
                a_stride = in(reg) a_stride,
                b_stride = in(reg) b_stride,
                options(nostack, readonly, preserves_flags)
            );
        }
        let c = sums.as_mut_ptr();
        let lower = c.add(TILE_ROWS * NR);
        asm!(
            "tilestored [{c0} + {stride}], tmm0",
            "tilestored [{c1} + {stride}], tmm1",
            "tilestored [{c2} + {stride}], tmm2",
            "tilestored [{c3} + {stride}], tmm3",
            c0 = in(reg) c,
            c1 = in(reg) c.add(16),
            c2 = in(reg) lower,
            c3 = in(reg) lower.add(16),
            stride = in(reg) NR * 4,
            options(nostack, preserves_flags)
        );
    }
}

/// `out[i] = bf16(sums[i])`, to nearest even, for the first `out.len()` (at most 32), stored
/// straight into `out` under a mask (a short copy per row cost a call to `memmove`).
#[inline(always)]
unsafe fn round_row(sums: &[f32], out: &mut [MaybeUninit<bf16>]) {
    assert!(out.len() <= NR && sums.len() >= NR);
    for lane0 in (0..out.len()).step_by(16) {
        let width = (out.len() - lane0).min(16);
        let mask = (u32::MAX >> (32 - width)) as __mmask16;
        // SAFETY: 16 f32 read inside `sums`; `width` bf16 written inside `out`; AVX512-BF16
        // and BW by the caller.
        unsafe {
            let lanes = _mm512_loadu_ps(sums.as_ptr().add(lane0));
            let pbh: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(lanes));
            _mm256_mask_storeu_epi16(out.as_mut_ptr().add(lane0).cast(), mask, pbh);
        }
    }
}
