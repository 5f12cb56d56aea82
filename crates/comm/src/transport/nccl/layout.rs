//! Where the bytes of an uneven all_gather / reduce_scatter / all_to_all go, as strided copies.
//!
//! NCCL's all_gather and reduce_scatter move equal, flat, rank-major pieces. Our collectives
//! work along any dimension with per-rank sizes that may differ (FSDP2's pad-to-ceil chunks,
//! [`crate::transport::chunk`]). Seen along `dim`, a tensor is `[outer, len, inner]`; each rank's piece is
//! padded to the largest size along `dim`, so every piece is `outer x pad x inner` elements, and
//! moving a piece into or out of its padded slot is one strided 2-D copy (`cuMemcpy2DAsync`:
//! `height` rows of `width` bytes, rows `pitch` bytes apart). The plans here are pure; the
//! engine runs them on device buffers, and the tests run them on host bytes against the threads
//! engine's byte-level concat/narrow.

use crate::transport::chunk::offsets;

/// One strided copy: `height` rows of `width` bytes; row `r` goes from
/// `src_offset + r * src_pitch` to `dst_offset + r * dst_pitch` (all in bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy2d {
    /// Where the first row starts in the source.
    pub src_offset: usize,
    /// Bytes between rows in the source.
    pub src_pitch: usize,
    /// Where the first row goes in the destination.
    pub dst_offset: usize,
    /// Bytes between rows in the destination.
    pub dst_pitch: usize,
    /// Bytes per row.
    pub width: usize,
    /// Number of rows.
    pub height: usize,
}

impl Copy2d {
    /// Whether the copy moves no bytes (a rank with an empty piece).
    pub fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0
    }

    /// The same copy between buffers whose regions start `src` and `dst` bytes further on.
    pub fn shifted(self, src: usize, dst: usize) -> Self {
        Self {
            src_offset: self.src_offset + src,
            dst_offset: self.dst_offset + dst,
            ..self
        }
    }

    /// Runs the copy on host bytes (tests, and the reference for the device copy).
    pub fn apply(&self, src: &[u8], dst: &mut [u8]) {
        for r in 0..self.height {
            let s = self.src_offset + r * self.src_pitch;
            let d = self.dst_offset + r * self.dst_pitch;
            dst[d..d + self.width].copy_from_slice(&src[s..s + self.width]);
        }
    }
}

/// How the device runs a [`Copy2d`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPlan {
    /// Nothing to move.
    Empty,
    /// One contiguous run of `bytes` (height 1, or rows back to back on both sides): a linear
    /// copy, which has no pitch limit.
    Linear {
        /// Where the run starts in the source.
        src_offset: usize,
        /// Where it goes in the destination.
        dst_offset: usize,
        /// Its length.
        bytes: usize,
    },
    /// One strided 2-D copy (pitches within the device's limit).
    Strided(Copy2d),
    /// One linear copy per row: a pitch past the device's limit for 2-D copies.
    Rows(Copy2d),
}

/// The largest pitch a 2-D device copy takes (`cuMemcpy2D`'s limit on current GPUs).
pub const MAX_COPY_PITCH: usize = i32::MAX as usize;

impl Copy2d {
    /// How to run this copy on a device whose 2-D copies take pitches up to `max_pitch`.
    pub fn plan(&self, max_pitch: usize) -> CopyPlan {
        let contiguous = |pitch: usize| pitch == self.width || self.height == 1;
        if self.is_empty() {
            CopyPlan::Empty
        } else if contiguous(self.src_pitch) && contiguous(self.dst_pitch) {
            CopyPlan::Linear {
                src_offset: self.src_offset,
                dst_offset: self.dst_offset,
                bytes: self.width * self.height,
            }
        } else if self.src_pitch.max(self.dst_pitch) > max_pitch {
            CopyPlan::Rows(*self)
        } else {
            CopyPlan::Strided(*self)
        }
    }
}

/// A shape seen along `dim`: `outer` runs of `len` rows of `row` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AlongDim {
    /// Product of the dimensions before `dim`.
    pub outer: usize,
    /// Size along `dim`.
    pub len: usize,
    /// Bytes of one row: the elements after `dim`, times the element size.
    pub row: usize,
}

impl AlongDim {
    /// `shape` seen along `dim`, for elements of `elem_bytes` bytes.
    pub fn new(shape: &[usize], dim: usize, elem_bytes: usize) -> Self {
        Self {
            outer: shape[..dim].iter().product(),
            len: shape[dim],
            row: shape[dim + 1..].iter().product::<usize>() * elem_bytes,
        }
    }

    /// Bytes of a tensor of this shape with `len` rows along the dimension.
    pub fn bytes_with(&self, len: usize) -> usize {
        self.outer * len * self.row
    }
}

/// Copies rows `start..start + len` along the dimension out of a tensor into a contiguous
/// piece.
pub fn narrow_copy(view: AlongDim, start: usize, len: usize) -> Copy2d {
    Copy2d {
        src_offset: start * view.row,
        src_pitch: view.len * view.row,
        dst_offset: 0,
        dst_pitch: len * view.row,
        width: len * view.row,
        height: view.outer,
    }
}

/// Copies a contiguous piece of `len` rows into a tensor of `out_len` rows at row `at`.
pub fn place_copy(view: AlongDim, len: usize, at: usize, out_len: usize) -> Copy2d {
    Copy2d {
        src_offset: 0,
        src_pitch: len * view.row,
        dst_offset: at * view.row,
        dst_pitch: out_len * view.row,
        width: len * view.row,
        height: view.outer,
    }
}

/// Whether the rank-major NCCL buffer differs from the tensor (pieces of `sizes` rows, padded
/// to `pad`), so that each piece needs its own copy: with equal pieces and a single outer run
/// the two are the same bytes.
fn needs_slot_copies(view: AlongDim, sizes: &[usize], pad: usize) -> bool {
    let uniform = sizes.iter().all(|s| *s == pad);
    !(uniform && view.outer <= 1)
}

/// One copy per rank between its piece of the tensor and its padded slot of the NCCL buffer,
/// empty pieces left out: `copy(j, at, len)` is rank `j`'s, whose piece is rows `at..at + len`
/// along the dimension. Gather and scatter differ only in the direction of `copy`.
fn slot_copies(sizes: &[usize], copy: impl Fn(usize, usize, usize) -> Copy2d) -> Vec<Copy2d> {
    offsets(sizes)
        .into_iter()
        .zip(sizes)
        .enumerate()
        .map(|(j, (at, len))| copy(j, at, *len))
        .filter(|c| !c.is_empty())
        .collect()
}

/// How an all_gather of pieces with `sizes` rows along the dimension runs as one padded NCCL
/// all_gather.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatherLayout {
    /// Bytes each rank contributes to the NCCL call (its padded piece).
    pub piece_bytes: usize,
    /// Own input -> send buffer of `piece_bytes`; `None` when the input is sent as it is.
    pub pack: Option<Copy2d>,
    /// Gathered buffer (`ranks x piece_bytes`) -> output; `None` when the gathered buffer is
    /// the output.
    pub unpack: Option<Vec<Copy2d>>,
    /// Output bytes.
    pub out_bytes: usize,
}

/// The layout of an all_gather along a dimension seen as `view` (this rank's piece, whose
/// `len` is `sizes[rank]`), where rank `j` holds `sizes[j]` rows.
pub fn gather_layout(view: AlongDim, sizes: &[usize], rank: usize) -> GatherLayout {
    debug_assert_eq!(view.len, sizes[rank]);
    let pad = sizes.iter().copied().max().unwrap_or(0);
    let total: usize = sizes.iter().sum();
    let piece_bytes = view.bytes_with(pad);
    let pack = (sizes[rank] != pad && view.outer > 0)
        .then(|| {
            narrow_copy(
                AlongDim {
                    len: sizes[rank],
                    ..view
                },
                0,
                sizes[rank],
            )
        })
        .map(|c| Copy2d {
            dst_pitch: pad * view.row,
            ..c
        });
    let unpack = needs_slot_copies(view, sizes, pad).then(|| {
        slot_copies(sizes, |j, at, len| {
            Copy2d {
                src_pitch: pad * view.row,
                ..place_copy(view, len, at, total)
            }
            .shifted(j * piece_bytes, 0)
        })
    });
    GatherLayout {
        piece_bytes,
        pack,
        unpack,
        out_bytes: view.bytes_with(total),
    }
}

/// How a reduce_scatter of a tensor (seen as `view`, `len` = the sum of `sizes`) into pieces of
/// `sizes` rows runs as one padded NCCL reduce_scatter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterLayout {
    /// Bytes of each rank's padded piece (the NCCL receive count, in bytes).
    pub piece_bytes: usize,
    /// Input -> send buffer (`ranks x piece_bytes`); `None` when the input is sent as it is.
    pub pack: Option<Vec<Copy2d>>,
    /// Received padded piece -> output; `None` when the received piece is the output.
    pub unpack: Option<Copy2d>,
    /// Output bytes (this rank's piece).
    pub out_bytes: usize,
}

/// The layout of a reduce_scatter of `view` into pieces of `sizes` rows, for `rank`.
pub fn scatter_layout(view: AlongDim, sizes: &[usize], rank: usize) -> ScatterLayout {
    debug_assert_eq!(view.len, sizes.iter().sum::<usize>());
    let pad = sizes.iter().copied().max().unwrap_or(0);
    let piece_bytes = view.bytes_with(pad);
    let pack = needs_slot_copies(view, sizes, pad).then(|| {
        slot_copies(sizes, |j, at, len| {
            Copy2d {
                dst_pitch: pad * view.row,
                ..narrow_copy(view, at, len)
            }
            .shifted(0, j * piece_bytes)
        })
    });
    let mine = sizes[rank];
    let unpack = (mine != pad && view.outer > 0).then(|| Copy2d {
        src_pitch: pad * view.row,
        ..narrow_copy(AlongDim { len: mine, ..view }, 0, mine)
    });
    ScatterLayout {
        piece_bytes,
        pack,
        unpack,
        out_bytes: view.bytes_with(mine),
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::TensorData;

    use super::*;
    use crate::transport::chunk::chunk_sizes;
    use crate::transport::data::ReduceOp;
    use crate::transport::data::{concat, narrow, reduce_slice};

    fn tensor(shape: &[usize], seed: f32) -> TensorData {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| seed + i as f32 * 0.5).collect();
        TensorData::new(values, shape.to_vec())
    }

    fn run(copies: &[Copy2d], src: &[u8], dst: &mut [u8]) {
        for c in copies {
            c.apply(src, dst);
        }
    }

    /// What NCCL all_gather does: concatenate the padded pieces, rank-major.
    fn nccl_all_gather(pieces: &[Vec<u8>]) -> Vec<u8> {
        pieces.concat()
    }

    /// What NCCL reduce_scatter (sum) does on f32: element-wise sum, piece `rank` kept.
    fn nccl_reduce_scatter(inputs: &[Vec<u8>], piece: usize, rank: usize) -> Vec<u8> {
        let floats = |b: &[u8]| -> Vec<f32> {
            b.chunks(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let mut sum = vec![0f32; piece / 4];
        for input in inputs {
            for (s, x) in sum
                .iter_mut()
                .zip(floats(&input[rank * piece..(rank + 1) * piece]))
            {
                *s += x;
            }
        }
        sum.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn cases() -> Vec<(Vec<usize>, usize, Vec<usize>)> {
        // (shape with the full dimension, dim, per-rank sizes)
        let mut out = Vec::new();
        for (shape, dim) in [
            (vec![10, 3], 0),
            (vec![3, 10], 1),
            (vec![2, 7, 3], 1),
            (vec![5], 0),
            (vec![2, 3, 4], 2),
            (vec![8, 2], 0),
        ] {
            for parts in 1..5 {
                out.push((shape.clone(), dim, chunk_sizes(shape[dim], parts)));
            }
        }
        out.push((vec![2, 6, 2], 1, vec![0, 4, 2]));
        out
    }

    #[test]
    fn padded_all_gather_equals_concatenation() {
        for (shape, dim, sizes) in cases() {
            let pieces: Vec<TensorData> = sizes
                .iter()
                .enumerate()
                .map(|(r, s)| {
                    let mut sh = shape.clone();
                    sh[dim] = *s;
                    tensor(&sh, r as f32 * 100.0)
                })
                .collect();
            let expected = concat(&pieces.iter().collect::<Vec<_>>(), dim);
            for rank in 0..sizes.len() {
                let layouts: Vec<GatherLayout> = (0..sizes.len())
                    .map(|r| gather_layout(AlongDim::new(pieces[r].shape(), dim, 4), &sizes, r))
                    .collect();
                let sends: Vec<Vec<u8>> = layouts
                    .iter()
                    .zip(&pieces)
                    .map(|(l, p)| match l.pack {
                        Some(c) => {
                            let mut buf = vec![0xAB; l.piece_bytes];
                            c.apply(p.as_bytes(), &mut buf);
                            buf
                        }
                        None => p.as_bytes().to_vec(),
                    })
                    .collect();
                assert!(sends.iter().all(|s| s.len() == layouts[rank].piece_bytes));
                let gathered = nccl_all_gather(&sends);
                let l = &layouts[rank];
                let out = match &l.unpack {
                    Some(copies) => {
                        let mut out = vec![0; l.out_bytes];
                        run(copies, &gathered, &mut out);
                        out
                    }
                    None => gathered,
                };
                assert_eq!(
                    out,
                    expected.as_bytes(),
                    "{shape:?} dim {dim} sizes {sizes:?}"
                );
            }
        }
    }

    #[test]
    fn padded_reduce_scatter_equals_sliced_sum() {
        for (shape, dim, sizes) in cases() {
            let inputs: Vec<TensorData> = (0..sizes.len())
                .map(|r| tensor(&shape, r as f32 * 3.0))
                .collect();
            let view = AlongDim::new(&shape, dim, 4);
            let starts = offsets(&sizes);
            for rank in 0..sizes.len() {
                let l = scatter_layout(view, &sizes, rank);
                let sends: Vec<Vec<u8>> = inputs
                    .iter()
                    .map(|t| match &l.pack {
                        Some(copies) => {
                            let mut buf = vec![0; sizes.len() * l.piece_bytes];
                            run(copies, t.as_bytes(), &mut buf);
                            buf
                        }
                        None => t.as_bytes().to_vec(),
                    })
                    .collect();
                let received = nccl_reduce_scatter(&sends, l.piece_bytes, rank);
                let out = match l.unpack {
                    Some(c) => {
                        let mut out = vec![0; l.out_bytes];
                        c.apply(&received, &mut out);
                        out
                    }
                    None => received,
                };
                let refs: Vec<&TensorData> = inputs.iter().collect();
                let expected = reduce_slice(&refs, dim, starts[rank], sizes[rank], ReduceOp::Sum);
                assert_eq!(
                    out,
                    expected.as_bytes(),
                    "{shape:?} dim {dim} sizes {sizes:?}"
                );
            }
        }
    }

    #[test]
    fn narrow_and_place_match_byte_level_ops() {
        let t = tensor(&[3, 5, 2], 1.0);
        let view = AlongDim::new(t.shape(), 1, 4);
        let c = narrow_copy(view, 1, 3);
        let mut piece = vec![0; view.bytes_with(3)];
        c.apply(t.as_bytes(), &mut piece);
        assert_eq!(piece, narrow(&t, 1, 1, 3).as_bytes());
        let a = narrow(&t, 1, 0, 2);
        let b = narrow(&t, 1, 2, 3);
        let mut out = vec![0; t.as_bytes().len()];
        place_copy(view, 2, 0, 5).apply(a.as_bytes(), &mut out);
        place_copy(view, 3, 2, 5).apply(b.as_bytes(), &mut out);
        assert_eq!(out, t.as_bytes());
    }
}

#[cfg(test)]
mod copy_plan_tests {
    use super::*;

    fn copy(width: usize, height: usize, src_pitch: usize, dst_pitch: usize) -> Copy2d {
        Copy2d {
            src_offset: 8,
            src_pitch,
            dst_offset: 16,
            dst_pitch,
            width,
            height,
        }
    }

    /// Every plan moves exactly the bytes the 2-D copy names, checked on host bytes.
    fn run_plan(plan: CopyPlan, src: &[u8], dst: &mut [u8]) {
        match plan {
            CopyPlan::Empty => {}
            CopyPlan::Linear {
                src_offset,
                dst_offset,
                bytes,
            } => dst[dst_offset..dst_offset + bytes]
                .copy_from_slice(&src[src_offset..src_offset + bytes]),
            CopyPlan::Strided(c) | CopyPlan::Rows(c) => c.apply(src, dst),
        }
    }

    #[test]
    fn height_one_and_back_to_back_rows_are_linear_copies() {
        // A height-1 copy with a pitch far past the 2-D limit is still one linear copy.
        let huge = copy(100, 1, 1 << 40, 1 << 40);
        assert!(matches!(
            huge.plan(MAX_COPY_PITCH),
            CopyPlan::Linear { bytes: 100, .. }
        ));
        assert!(matches!(
            copy(4, 3, 4, 4).plan(MAX_COPY_PITCH),
            CopyPlan::Linear { bytes: 12, .. }
        ));
        assert_eq!(
            copy(4, 3, 6, 4).plan(MAX_COPY_PITCH),
            CopyPlan::Strided(copy(4, 3, 6, 4))
        );
        assert_eq!(copy(4, 3, 6, 4).plan(5), CopyPlan::Rows(copy(4, 3, 6, 4)));
        assert_eq!(copy(0, 3, 6, 4).plan(5), CopyPlan::Empty);
        for c in [
            copy(4, 3, 4, 4),
            copy(4, 3, 6, 4),
            copy(4, 1, 9, 9),
            copy(3, 2, 3, 7),
        ] {
            let src: Vec<u8> = (0..64).collect();
            let (mut want, mut got) = (vec![0u8; 64], vec![0u8; 64]);
            c.apply(&src, &mut want);
            for max_pitch in [5, MAX_COPY_PITCH] {
                got.fill(0);
                run_plan(c.plan(max_pitch), &src, &mut got);
                assert_eq!(got, want, "{c:?}");
            }
        }
    }
}
