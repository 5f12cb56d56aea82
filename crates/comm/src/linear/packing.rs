//! What both bf16 kernels' packing shares: the strided matrix they read, and the bf16 pairs
//! along the summed dim that `vdpbf16ps` and `tdpbf16ps` both take (two bf16 in one u32).

use burn::tensor::bf16;

/// Columns of a packed B panel: two 16-lane vectors of the vector kernel, two AMX tiles.
pub(crate) const NR: usize = 32;

/// One 64-byte cache line of packed pairs.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

/// Packed pairs in memory aligned to cache lines: an AMX tile row is 64 bytes, and a row that
/// straddles two lines loads several times slower (measured: 15.6 against 3.4 ns a tile).
#[derive(Debug, Clone)]
pub(crate) struct Packed {
    lines: Vec<Line>,
    len: usize,
}

impl Packed {
    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            lines: vec![Line([0; 16]); len.div_ceil(16)],
            len,
        }
    }

    pub(crate) fn as_slice(&self) -> &[u32] {
        // SAFETY: the lines are `len.div_ceil(16) * 16` initialised u32s, contiguous.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u32] {
        // SAFETY: as `as_slice`, borrowed mutably once.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

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

/// Two bf16 as one u32, `low` in the low half (the order `vdpbf16ps` reads a lane's two
/// products in).
#[inline(always)]
fn pair(low: bf16, high: bf16) -> u32 {
    low.to_bits() as u32 | (high.to_bits() as u32) << 16
}

/// `out[i] = pair(data[low + i * stride], data[high + i * stride])`, zeros for a missing
/// `high` (past an odd last row); `stride` 0 is a broadcast view.
#[inline(always)]
pub(crate) fn interleave(
    out: &mut [u32],
    data: &[bf16],
    low: usize,
    high: Option<usize>,
    stride: usize,
) {
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
pub(crate) fn pairs_along(
    dst: &mut [u32],
    step: usize,
    data: &[bf16],
    start: usize,
    stride: usize,
    k: usize,
) {
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
