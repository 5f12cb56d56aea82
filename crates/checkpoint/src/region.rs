//! Regions: the box of a tensor one shard covers (a start and a length per dim), their
//! intersections, copying the intersection of two row-major boxes, and the boxes a contiguous
//! run of row-major elements (a piece of an FSDP flat buffer) splits into.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A box of a tensor: `start[d] .. start[d] + shape[d]` along each dim `d`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// The first index along each dim.
    pub start: Vec<usize>,
    /// The length along each dim.
    pub shape: Vec<usize>,
}

impl Region {
    /// The whole of a tensor of `shape`.
    pub fn full(shape: &[usize]) -> Self {
        Self {
            start: vec![0; shape.len()],
            shape: shape.to_vec(),
        }
    }

    /// Elements in the box.
    pub fn volume(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the box holds no element.
    pub fn is_empty(&self) -> bool {
        self.volume() == 0
    }

    /// Whether the box lies inside a tensor of `shape`.
    pub fn fits(&self, shape: &[usize]) -> bool {
        self.start.len() == shape.len()
            && self.shape.len() == shape.len()
            && (0..shape.len()).all(|d| self.start[d] + self.shape[d] <= shape[d])
    }

    /// The common box of `self` and `other`, `None` when they share no element.
    pub fn intersect(&self, other: &Region) -> Option<Region> {
        if self.start.len() != other.start.len() {
            return None;
        }
        let mut start = Vec::with_capacity(self.start.len());
        let mut shape = Vec::with_capacity(self.start.len());
        for d in 0..self.start.len() {
            let lo = self.start[d].max(other.start[d]);
            let hi = (self.start[d] + self.shape[d]).min(other.start[d] + other.shape[d]);
            if hi <= lo {
                return None;
            }
            start.push(lo);
            shape.push(hi - lo);
        }
        Some(Region { start, shape })
    }

    /// `[a..b, c..d]`, for messages.
    pub fn describe(&self) -> String {
        let dims: Vec<String> = (0..self.start.len())
            .map(|d| format!("{}..{}", self.start[d], self.start[d] + self.shape[d]))
            .collect();
        format!("[{}]", dims.join(", "))
    }
}

/// Copies the elements of `part` (a box inside both `src_box` and `dst_box`) from `src`, laid
/// out row-major over `src_box`, into `dst`, laid out row-major over `dst_box`. Elements are
/// `elem` bytes. Contiguous runs are copied whole: the trailing dims that `part` covers
/// entirely in both boxes are merged into one run.
pub fn copy_part(
    src: &[u8],
    src_box: &Region,
    dst: &mut [u8],
    dst_box: &Region,
    part: &Region,
    elem: usize,
) {
    let rank = part.shape.len();
    if part.volume() == 0 {
        return;
    }
    if rank == 0 {
        dst[..elem].copy_from_slice(&src[..elem]);
        return;
    }
    // Merge trailing dims while both boxes are covered whole along them: one memcpy per run.
    let mut run_dims = 1;
    while run_dims < rank {
        let d = rank - run_dims;
        let whole = |b: &Region| b.shape[d] == part.shape[d];
        if whole(src_box) && whole(dst_box) {
            run_dims += 1;
        } else {
            break;
        }
    }
    let inner = rank - run_dims;
    let run: usize = part.shape[inner..].iter().product::<usize>() * elem;
    let strides = |b: &Region| {
        let mut s = vec![elem; rank];
        for d in (0..rank - 1).rev() {
            s[d] = s[d + 1] * b.shape[d + 1];
        }
        s
    };
    let (src_strides, dst_strides) = (strides(src_box), strides(dst_box));
    let offset = |b: &Region, strides: &[usize], index: &[usize]| -> usize {
        (0..rank)
            .map(|d| (part.start[d] + index[d] - b.start[d]) * strides[d])
            .sum()
    };
    // Walk every index of the outer dims (those before the merged run).
    let mut index = vec![0usize; rank];
    loop {
        let s = offset(src_box, &src_strides, &index);
        let t = offset(dst_box, &dst_strides, &index);
        dst[t..t + run].copy_from_slice(&src[s..s + run]);
        let mut d = inner;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < part.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// The boxes, in element order, whose concatenation (each read row-major) is exactly the
/// elements `elements` of a tensor of `shape` flattened row-major: how a contiguous piece that
/// need not be whole rows (an FSDP flat-buffer shard) is described as regions. Splits on dim 0
/// into a partial leading row (split further along the trailing dims), a block of whole rows
/// and a partial trailing row, so a piece of a `D`-dim tensor needs at most `2D - 1` boxes.
/// Every box is non-empty; an empty range gives none.
///
/// # Panics
/// When `elements` reaches past the tensor's last element (callers check it first).
pub fn boxes_of_range(shape: &[usize], elements: Range<usize>) -> Vec<Region> {
    let total: usize = shape.iter().product();
    assert!(
        elements.end <= total || elements.is_empty(),
        "elements {elements:?} outside a tensor of shape {shape:?} ({total} elements)"
    );
    let mut out = Vec::new();
    push_boxes(shape, elements, &mut Vec::new(), &mut out);
    out
}

/// Appends the boxes of `elements` of the sub-tensor of `shape` that the leading indices
/// `prefix` (one element each along the dims before it) select.
fn push_boxes(
    shape: &[usize],
    elements: Range<usize>,
    prefix: &mut Vec<usize>,
    out: &mut Vec<Region>,
) {
    if elements.is_empty() {
        return;
    }
    let Some((_, inner)) = shape.split_first() else {
        // A scalar (the only non-empty range of it is its one element).
        out.push(prefixed(prefix, Region::full(&[])));
        return;
    };
    let row: usize = inner.iter().product();
    let (first, lead) = (elements.start / row, elements.start % row);
    let (last, tail) = (elements.end / row, elements.end % row);
    if first == last {
        // Inside one row: the piece is a range of that row.
        prefix.push(first);
        push_boxes(inner, lead..tail, prefix, out);
        prefix.pop();
        return;
    }
    let mut whole = first;
    if lead != 0 {
        prefix.push(first);
        push_boxes(inner, lead..row, prefix, out);
        prefix.pop();
        whole += 1;
    }
    if last > whole {
        let mut block = Region::full(shape);
        block.start[0] = whole;
        block.shape[0] = last - whole;
        out.push(prefixed(prefix, block));
    }
    if tail != 0 {
        prefix.push(last);
        push_boxes(inner, 0..tail, prefix, out);
        prefix.pop();
    }
}

/// `region` of the sub-tensor at the leading indices `prefix`, as a box of the whole tensor.
fn prefixed(prefix: &[usize], region: Region) -> Region {
    Region {
        start: prefix.iter().copied().chain(region.start).collect(),
        shape: prefix.iter().map(|_| 1).chain(region.shape).collect(),
    }
}

/// Whether `boxes` (distinct, non-empty) tile a tensor of `shape` exactly: inside it, pairwise
/// disjoint, and together as large as it.
pub fn tiles(boxes: &[&Region], shape: &[usize]) -> bool {
    let total: usize = shape.iter().product();
    if !boxes.iter().all(|b| b.fits(shape)) {
        return false;
    }
    for (i, a) in boxes.iter().enumerate() {
        if boxes[i + 1..].iter().any(|b| a.intersect(b).is_some()) {
            return false;
        }
    }
    boxes.iter().map(|b| b.volume()).sum::<usize>() == total
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A box from its start and shape (shared with the placement tests).
    pub(crate) fn region(start: &[usize], shape: &[usize]) -> Region {
        Region {
            start: start.to_vec(),
            shape: shape.to_vec(),
        }
    }

    /// The values of `b` when element `[i, j]` of the full tensor is `i * cols + j`.
    fn fill(b: &Region, cols: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in b.start[0]..b.start[0] + b.shape[0] {
            for j in b.start[1]..b.start[1] + b.shape[1] {
                out.extend_from_slice(&((i * cols + j) as u32).to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn copying_intersections_reassembles_any_box_from_any_tiling() {
        let (rows, cols) = (7, 5);
        // Saved as column blocks (a tp split), read as row blocks (fsdp), and the reverse.
        let col_blocks = [region(&[0, 0], &[7, 3]), region(&[0, 3], &[7, 2])];
        let row_blocks = [
            region(&[0, 0], &[3, 5]),
            region(&[3, 0], &[3, 5]),
            region(&[6, 0], &[1, 5]),
        ];
        let odd = [region(&[2, 1], &[4, 3]), region(&[0, 0], &[7, 5])];
        for (saved, wanted) in [
            (&col_blocks[..], &row_blocks[..]),
            (&row_blocks, &col_blocks),
        ] {
            for want in wanted.iter().chain(&odd) {
                let mut dst = vec![0u8; want.volume() * 4];
                let mut copied = 0;
                for src_box in saved {
                    if let Some(part) = src_box.intersect(want) {
                        copy_part(&fill(src_box, cols), src_box, &mut dst, want, &part, 4);
                        copied += part.volume();
                    }
                }
                assert_eq!(copied, want.volume());
                assert_eq!(dst, fill(want, cols), "{want:?} from {saved:?}");
            }
            assert!(tiles(&saved.iter().collect::<Vec<_>>(), &[rows, cols]));
        }
    }

    #[test]
    fn tiling_rejects_gaps_overlaps_and_boxes_outside() {
        let a = region(&[0, 0], &[2, 4]);
        let b = region(&[2, 0], &[2, 4]);
        assert!(tiles(&[&a, &b], &[4, 4]));
        assert!(!tiles(&[&a], &[4, 4]), "a gap");
        let c = region(&[1, 0], &[3, 4]);
        assert!(!tiles(&[&a, &c], &[4, 4]), "an overlap");
        let d = region(&[2, 0], &[3, 4]);
        assert!(!tiles(&[&a, &d], &[4, 4]), "outside");
    }

    /// Every shape of `dims` dims, each of size 1..=4.
    fn small_shapes(dims: usize) -> Vec<Vec<usize>> {
        (0..dims).fold(vec![Vec::new()], |shapes, _| {
            shapes
                .iter()
                .flat_map(|s| (1..=4).map(move |n| [s.clone(), vec![n]].concat()))
                .collect()
        })
    }

    /// Every index of a box of `shape`, row-major.
    fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
        shape.iter().fold(vec![Vec::new()], |acc, &n| {
            acc.iter()
                .flat_map(|i| (0..n).map(move |j| [i.clone(), vec![j]].concat()))
                .collect()
        })
    }

    /// The row-major flat indices, in `shape`, of the elements of `b` read row-major.
    fn flat_elements(shape: &[usize], b: &Region) -> Vec<usize> {
        indices(&b.shape)
            .iter()
            .map(|i| (0..shape.len()).fold(0, |at, d| at * shape[d] + b.start[d] + i[d]))
            .collect()
    }

    /// Every non-empty box of `shape` whose row-major elements are a contiguous run of the
    /// flattened tensor, as (first element, length).
    fn contiguous_boxes(shape: &[usize]) -> Vec<(usize, usize)> {
        let ranges = shape
            .iter()
            .fold(vec![(Vec::new(), Vec::new())], |acc, &n| {
                let spans: Vec<(usize, usize)> = (0..n)
                    .flat_map(|s| (1..=n - s).map(move |l| (s, l)))
                    .collect();
                acc.iter()
                    .flat_map(|(st, sh): &(Vec<usize>, Vec<usize>)| {
                        spans.iter().map(move |&(s, l)| {
                            (
                                [st.clone(), vec![s]].concat(),
                                [sh.clone(), vec![l]].concat(),
                            )
                        })
                    })
                    .collect()
            });
        ranges
            .into_iter()
            .map(|(start, shape_)| flat_elements(shape, &region(&start, &shape_)))
            .filter(|e| e.windows(2).all(|w| w[1] == w[0] + 1))
            .map(|e| (e[0], e.len()))
            .collect()
    }

    /// The fewest contiguous boxes, in element order, that make up `elements`.
    fn fewest_boxes(runs: &[(usize, usize)], elements: Range<usize>) -> usize {
        let mut best = vec![usize::MAX; elements.end + 1];
        best[elements.start] = 0;
        for at in elements.clone() {
            if best[at] == usize::MAX {
                continue;
            }
            for &(first, len) in runs.iter().filter(|(first, _)| *first == at) {
                if first + len <= elements.end {
                    best[first + len] = best[first + len].min(best[at] + 1);
                }
            }
        }
        best[elements.end]
    }

    #[test]
    fn boxes_of_every_range_of_small_shapes_are_exactly_it_and_fewest() {
        for dims in 1..=3 {
            for shape in small_shapes(dims) {
                let total: usize = shape.iter().product();
                let runs = contiguous_boxes(&shape);
                for start in 0..=total {
                    for end in start..=total {
                        let boxes = boxes_of_range(&shape, start..end);
                        let read: Vec<usize> = boxes
                            .iter()
                            .flat_map(|b| flat_elements(&shape, b))
                            .collect();
                        let what = format!("{shape:?} {start}..{end}: {boxes:?}");
                        assert_eq!(read, (start..end).collect::<Vec<_>>(), "{what}");
                        assert!(
                            boxes.iter().all(|b| b.fits(&shape) && !b.is_empty()),
                            "{what}"
                        );
                        if start < end {
                            assert_eq!(boxes.len(), fewest_boxes(&runs, start..end), "{what}");
                            assert!(boxes.len() < 2 * dims, "{what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_piece_of_a_three_dim_tensor_is_a_partial_row_a_block_and_whole_rows() {
        assert_eq!(
            boxes_of_range(&[2, 3, 4], 3..24),
            vec![
                region(&[0, 0, 3], &[1, 1, 1]),
                region(&[0, 1, 0], &[1, 2, 4]),
                region(&[1, 0, 0], &[1, 3, 4]),
            ]
        );
        assert_eq!(
            boxes_of_range(&[2, 3, 4], 5..7),
            vec![region(&[0, 1, 1], &[1, 1, 2])]
        );
        assert_eq!(
            boxes_of_range(&[2, 3, 4], 0..24),
            vec![region(&[0, 0, 0], &[2, 3, 4])]
        );
        assert_eq!(boxes_of_range(&[2, 3, 4], 7..7), Vec::<Region>::new());
        assert_eq!(boxes_of_range(&[0, 3], 0..0), Vec::<Region>::new());
        assert_eq!(boxes_of_range(&[], 0..1), vec![region(&[], &[])]);
    }

    #[test]
    fn a_one_dim_box_and_a_scalar_copy_too() {
        let src: Vec<u8> = (0u8..10).collect();
        let mut dst = vec![0u8; 4];
        let (s, t) = (region(&[0], &[10]), region(&[3], &[4]));
        copy_part(&src, &s, &mut dst, &t, &t, 1);
        assert_eq!(dst, vec![3, 4, 5, 6]);
        let mut one = vec![0u8; 2];
        copy_part(
            &[7, 9],
            &region(&[], &[]),
            &mut one,
            &region(&[], &[]),
            &region(&[], &[]),
            2,
        );
        assert_eq!(one, vec![7, 9]);
    }
}
