//! Flex's attention kernels: the math of [`plain`](super::plain) (scores, softmax and gradients
//! in f32, the output in the inputs' dtype) on raw buffers, one task per batch row and head (per
//! key/value head in backward, which owns that head's `d k` and `d v`), tasks spread over the
//! rank's rayon threads. A block of [`QUERY_BLOCK`] queries is multiplied against the keys any
//! of them sees, with gemm's kernels for the four products, and softmaxed whole: its row of
//! scores, `QUERY_BLOCK x keys`, is the most a task holds (linear in the sequence). The mask
//! is read once per call into runs of visible keys per query, shared by every head.

use std::ops::Range;

use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Shape};
use rayon::prelude::*;

use super::{AttentionMask, QUERY_BLOCK};
use crate::simd::{Elem, contiguous, dot, elems, exp, max, rounded_tensor, sum, tensor, wide_fn};

/// A float tensor's elements in f32, contiguous (f32 and bf16; else `None`).
fn f32_elems<E: Elem>(x: &FlexTensor) -> Option<Vec<f32>> {
    let x = contiguous::<E>(x)?;
    Some(elems::<E>(&x).iter().map(|v| v.to_f32()).collect())
}

/// The shapes of one call: `q` `[batch, heads, queries, dim]`, `k` and `v` `[batch, kv_heads,
/// keys, dim]`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    dim: usize,
}

impl Dims {
    /// The dims of `q` and `k`, when they fit the mask and each other and none is empty (else
    /// the plain path is taken).
    fn of(q: &FlexTensor, k: &FlexTensor, v: &FlexTensor, mask: &AttentionMask) -> Option<Self> {
        let (qs, ks) = (q.shape(), k.shape());
        if qs.num_dims() != 4 || ks.num_dims() != 4 || v.shape() != ks {
            return None;
        }
        let dims = Self {
            batch: qs[0],
            heads: qs[1],
            kv_heads: ks[1],
            queries: qs[2],
            keys: ks[2],
            dim: qs[3],
        };
        let nonempty = [dims.batch, dims.heads, dims.queries, dims.keys, dims.dim]
            .iter()
            .all(|&n| n > 0);
        let fits = nonempty
            && ks[0] == dims.batch
            && ks[3] == dims.dim
            && dims.kv_heads > 0
            && dims.heads.is_multiple_of(dims.kv_heads)
            && (mask.queries(), mask.keys()) == (dims.queries, dims.keys)
            && mask.segment_batch().is_none_or(|b| b == dims.batch);
        fits.then_some(dims)
    }

    fn groups(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Which keys each query sees, as runs of consecutive visible keys, per mask row (one, or one
/// per batch row with segments) and query.
struct Runs {
    /// Each (mask row, query)'s runs: `runs[starts[r]..starts[r + 1]]`.
    starts: Vec<usize>,
    runs: Vec<Range<usize>>,
    queries: usize,
    per_batch: bool,
}

impl Runs {
    fn of(mask: &AttentionMask) -> Self {
        let (queries, keys) = (mask.queries(), mask.keys());
        let rows = mask.segment_batch().unwrap_or(1);
        let key_blocks = keys.div_ceil(super::KEY_BLOCK);
        let (mut starts, mut runs) = (vec![0], Vec::new());
        for b in 0..rows {
            for i in 0..queries {
                let mut open: Option<usize> = None;
                for block in 0..key_blocks {
                    let block_keys =
                        block * super::KEY_BLOCK..((block + 1) * super::KEY_BLOCK).min(keys);
                    let reachable = mask.block_reachable(i..i + 1, block);
                    for j in block_keys {
                        match (reachable && mask.visible(b, i, j), open) {
                            (true, None) => open = Some(j),
                            (false, Some(start)) => {
                                runs.push(start..j);
                                open = None;
                            }
                            _ => {}
                        }
                    }
                }
                if let Some(start) = open {
                    runs.push(start..keys);
                }
                starts.push(runs.len());
            }
        }
        Self {
            starts,
            runs,
            queries,
            per_batch: rows > 1,
        }
    }

    /// Query `i`'s runs in batch row `b`.
    fn of_query(&self, b: usize, i: usize) -> &[Range<usize>] {
        let row = if self.per_batch { b } else { 0 } * self.queries + i;
        &self.runs[self.starts[row]..self.starts[row + 1]]
    }

    /// Batch row `b`'s blocks of [`QUERY_BLOCK`] queries that see some key, each with the
    /// keys its queries see as one range.
    fn blocks(&self, b: usize) -> impl Iterator<Item = (Range<usize>, Range<usize>)> + '_ {
        (0..self.queries)
            .step_by(QUERY_BLOCK)
            .filter_map(move |start| {
                let block = start..(start + QUERY_BLOCK).min(self.queries);
                let span = self.span(b, &block);
                (!span.is_empty()).then_some((block, span))
            })
    }

    /// The keys some query of `queries` sees, as one range (empty when none does).
    fn span(&self, b: usize, queries: &Range<usize>) -> Range<usize> {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in queries.clone() {
            let runs = self.of_query(b, i);
            if let (Some(first), Some(last)) = (runs.first(), runs.last()) {
                lo = lo.min(first.start);
                hi = hi.max(last.end);
            }
        }
        if lo < hi { lo..hi } else { 0..0 }
    }
}

/// A row-major f32 matrix view: `rows x cols`, row `r` at `data[r * stride..]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    stride: usize,
}

impl<'a> View<'a> {
    fn new(data: &'a [f32], rows: usize, cols: usize, stride: usize) -> Self {
        assert!(
            rows == 0 || cols == 0 || (rows - 1) * stride + cols <= data.len(),
            "a matrix view past its buffer"
        );
        Self {
            data,
            rows,
            cols,
            stride,
        }
    }
}

/// `dst [m, n] (+)= a b`, where `a` is `[m, k]` (`a_t`: `a` holds its transpose, `[k, m]`) and
/// `b` is `[k, n]` (`b_t`: `b` holds `[n, k]`); `dst` is row-major with row stride
/// `dst_stride`. One thread (the tasks are already spread over the rank's threads).
fn product(
    dst: &mut [f32],
    dst_stride: usize,
    (a, a_t): (View, bool),
    (b, b_t): (View, bool),
    accumulate: bool,
) {
    let (m, k) = if a_t {
        (a.cols, a.rows)
    } else {
        (a.rows, a.cols)
    };
    let (kb, n) = if b_t {
        (b.cols, b.rows)
    } else {
        (b.rows, b.cols)
    };
    assert_eq!(k, kb, "product: inner dims");
    assert!(
        m == 0 || n == 0 || (m - 1) * dst_stride + n <= dst.len(),
        "product: the destination is too small"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_stride)
                .take(m)
                .for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    // (row stride, column stride) of each operand as the product reads it.
    let strides = |v: View, t: bool| match t {
        false => (v.stride as isize, 1),
        true => (1, v.stride as isize),
    };
    let ((a_rs, a_cs), (b_rs, b_cs)) = (strides(a, a_t), strides(b, b_t));
    // SAFETY: every index the product reads or writes is inside its slice: the views were
    // checked against their buffers, and `dst` against `m`, `n` and its stride above.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_stride as isize,
            accumulate,
            a.data.as_ptr(),
            a_cs,
            a_rs,
            b.data.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        );
    }
}

/// The scaled, soft-capped and masked scores of one row (`row` holds `q k^T` for keys
/// `span`), in place; under a soft cap also its slope `1 - tanh^2`, into `slope` if given.
fn prepare_scores(
    row: &mut [f32],
    span: &Range<usize>,
    runs: &[Range<usize>],
    scale: f32,
    softcap: Option<f32>,
    slope: Option<&mut [f32]>,
) {
    scale_scores(row, scale);
    match (softcap, slope) {
        (Some(cap), Some(slope)) => {
            for (s, d) in row.iter_mut().zip(slope.iter_mut()) {
                let t = (*s / cap).tanh();
                *s = t * cap;
                *d = 1.0 - t * t;
            }
        }
        (Some(cap), None) => row.iter_mut().for_each(|s| *s = (*s / cap).tanh() * cap),
        (None, _) => {}
    }
    // Hide the keys between and around the visible runs.
    let mut from = span.start;
    for run in runs {
        row[from - span.start..run.start - span.start].fill(f32::NEG_INFINITY);
        from = run.end;
    }
    row[from - span.start..].fill(f32::NEG_INFINITY);
}

wide_fn! {
    fn scale_scores(row: &mut [f32], scale: f32) {
        row.iter_mut().for_each(|s| *s *= scale);
    }
}

wide_fn! {
    /// `row = exp(row - shift)` (masked `-inf` entries become 0).
    fn exp_shifted(row: &mut [f32], shift: f32) {
        row.iter_mut().for_each(|s| *s = exp(*s - shift) * f32::from(*s != f32::NEG_INFINITY));
    }
}

wide_fn! {
    /// The softmax's backward in place, `dp <- p (dp - rowsum(p dp)) scale` (times the soft
    /// cap's slope).
    fn scores_grad(p: &[f32], dp: &mut [f32], slope: Option<&[f32]>, scale: f32) {
        let delta = dot(p, dp);
        for (d, &p) in dp.iter_mut().zip(p) {
            *d = p * (*d - delta);
        }
        if let Some(slope) = slope {
            dp.iter_mut().zip(slope).for_each(|(d, s)| *d *= s);
        }
        dp.iter_mut().for_each(|d| *d *= scale);
    }
}

/// Forward: the output in `E` and the f32 log-sum-exp `[batch, heads, queries]`.
pub(super) fn forward<E: Elem>(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    mask: &AttentionMask,
    scale: f64,
) -> Option<(FlexTensor, FlexTensor)> {
    let dims = Dims::of(q, k, v, mask)?;
    let (q, k, v) = (f32_elems::<E>(q)?, f32_elems::<E>(k)?, f32_elems::<E>(v)?);
    let Dims {
        heads,
        queries,
        keys,
        dim,
        ..
    } = dims;
    let runs = Runs::of(mask);
    let (scale, softcap) = (scale as f32, mask.softcap().map(|c| c as f32));
    let mut out = vec![0.0f32; q.len()];
    let mut lse = vec![f32::NEG_INFINITY; dims.batch * heads * queries];
    let tasks = out
        .par_chunks_mut(queries * dim)
        .zip(lse.par_chunks_mut(queries));
    tasks.enumerate().for_each(|(task, (out, lse))| {
        let (b, h) = (task / heads, task % heads);
        let kv = b * dims.kv_heads + h / dims.groups();
        let q = &q[task * queries * dim..][..queries * dim];
        let (k, v) = (
            &k[kv * keys * dim..][..keys * dim],
            &v[kv * keys * dim..][..keys * dim],
        );
        let mut scores = Vec::new();
        for (block, span) in runs.blocks(b) {
            let (start, n, width) = (block.start, block.len(), span.len());
            scores.resize(n * width, 0.0);
            let q_block = View::new(&q[start * dim..], n, dim, dim);
            let k_span = View::new(&k[span.start * dim..], width, dim, dim);
            product(&mut scores, width, (q_block, false), (k_span, true), false);
            for (r, row) in scores.chunks_exact_mut(width).enumerate() {
                let i = start + r;
                let row_runs = runs.of_query(b, i);
                prepare_scores(row, &span, row_runs, scale, softcap, None);
                if row_runs.is_empty() {
                    row.fill(0.0);
                    continue;
                }
                let top = max(row);
                exp_shifted(row, top);
                let total = sum(row);
                lse[i] = top + total.ln();
                row.iter_mut().for_each(|p| *p /= total);
            }
            let v_span = View::new(&v[span.start * dim..], width, dim, dim);
            let probs = View::new(&scores, n, width, width);
            let out = &mut out[start * dim..][..n * dim];
            product(out, dim, (probs, false), (v_span, false), false);
        }
    });
    let shape = Shape::new([dims.batch, heads, queries, dim]);
    Some((
        rounded_tensor::<E>(&out, shape),
        tensor(lse, Shape::new([dims.batch, heads, queries])),
    ))
}

/// Backward: `(d q, d k, d v)` in `E`, the probabilities recomputed from `lse` and the row
/// sum taken over them (as [`plain::backward`](super::plain::backward)).
#[allow(clippy::too_many_arguments)]
pub(super) fn backward<E: Elem>(
    q: &FlexTensor,
    k: &FlexTensor,
    v: &FlexTensor,
    lse: &FlexTensor,
    grad: &FlexTensor,
    mask: &AttentionMask,
    scale: f64,
) -> Option<(FlexTensor, FlexTensor, FlexTensor)> {
    let dims = Dims::of(q, k, v, mask)?;
    if grad.shape() != q.shape() || lse.dtype() != DType::F32 {
        return None;
    }
    let (q, k, v) = (f32_elems::<E>(q)?, f32_elems::<E>(k)?, f32_elems::<E>(v)?);
    let (grad, lse) = (f32_elems::<E>(grad)?, f32_elems::<f32>(lse)?);
    let Dims {
        queries, keys, dim, ..
    } = dims;
    let groups = dims.groups();
    let runs = Runs::of(mask);
    let (scale, softcap) = (scale as f32, mask.softcap().map(|c| c as f32));
    let (mut d_q, mut d_k, mut d_v) = (
        vec![0.0f32; q.len()],
        vec![0.0f32; k.len()],
        vec![0.0f32; k.len()],
    );
    let head = queries * dim;
    let tasks = d_q
        .par_chunks_mut(groups * head)
        .zip(d_k.par_chunks_mut(keys * dim))
        .zip(d_v.par_chunks_mut(keys * dim));
    tasks.enumerate().for_each(|(kv, ((d_q, d_k), d_v))| {
        let b = kv / dims.kv_heads;
        let (k, v) = (
            &k[kv * keys * dim..][..keys * dim],
            &v[kv * keys * dim..][..keys * dim],
        );
        let (mut p, mut dp, mut slope) = (Vec::new(), Vec::new(), Vec::new());
        for g in 0..groups {
            let h = kv * groups + g;
            let (q, grad) = (&q[h * head..][..head], &grad[h * head..][..head]);
            let lse = &lse[h * queries..][..queries];
            let d_q = &mut d_q[g * head..][..head];
            for (block, span) in runs.blocks(b) {
                let (start, n, width) = (block.start, block.len(), span.len());
                p.resize(n * width, 0.0);
                dp.resize(n * width, 0.0);
                slope.resize(if softcap.is_some() { n * width } else { 0 }, 0.0);
                let q_block = View::new(&q[start * dim..], n, dim, dim);
                let g_block = View::new(&grad[start * dim..], n, dim, dim);
                let k_span = View::new(&k[span.start * dim..], width, dim, dim);
                let v_span = View::new(&v[span.start * dim..], width, dim, dim);
                product(&mut p, width, (q_block, false), (k_span, true), false);
                product(&mut dp, width, (g_block, false), (v_span, true), false);
                let mut slopes = slope.chunks_exact_mut(width.max(1));
                let rows = p.chunks_exact_mut(width).zip(dp.chunks_exact_mut(width));
                for (r, (p, dp)) in rows.enumerate() {
                    let i = start + r;
                    let row_runs = runs.of_query(b, i);
                    let mut slope = softcap.map(|_| slopes.next().expect("a slope row"));
                    if row_runs.is_empty() {
                        p.fill(0.0);
                        dp.fill(0.0);
                        continue;
                    }
                    prepare_scores(p, &span, row_runs, scale, softcap, slope.as_deref_mut());
                    exp_shifted(p, lse[i]);
                    scores_grad(p, dp, slope.as_deref(), scale);
                }
                // `dp` now holds d S (scaled): d q = dS k, d k += dS^T q, d v += P^T dO.
                let (d_scores, probs) = (
                    View::new(&dp, n, width, width),
                    View::new(&p, n, width, width),
                );
                product(
                    &mut d_q[start * dim..][..n * dim],
                    dim,
                    (d_scores, false),
                    (k_span, false),
                    false,
                );
                let d_k = &mut d_k[span.start * dim..][..width * dim];
                product(d_k, dim, (d_scores, true), (q_block, false), true);
                let d_v = &mut d_v[span.start * dim..][..width * dim];
                product(d_v, dim, (probs, true), (g_block, false), true);
            }
        }
    });
    let (q_shape, k_shape) = (
        Shape::new([dims.batch, dims.heads, queries, dim]),
        Shape::new([dims.batch, dims.kv_heads, keys, dim]),
    );
    Some((
        rounded_tensor::<E>(&d_q, q_shape),
        rounded_tensor::<E>(&d_k, k_shape.clone()),
        rounded_tensor::<E>(&d_v, k_shape),
    ))
}
