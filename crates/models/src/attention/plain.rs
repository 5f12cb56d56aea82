//! The blockwise algorithm in Burn's plain backend ops: the kernel of every backend without a
//! fused one (flex included: its matmuls do the work). Scores, the online softmax and the
//! gradients are f32, whatever the inputs' dtype. Forward holds one `QUERY_BLOCK x KEY_BLOCK`
//! block of scores per (batch, kv head) at a time; backward the probabilities of one row block
//! against the keys it reaches (linear in the sequence, never `[seq, seq]`).
//!
//! Grouped-query heads are folded into rows: `q` `[batch, heads, queries, dim]` is read as
//! `[batch, kv_heads, groups * queries, dim]` (query head `h = kv * groups + g`), so every row
//! block multiplies its own key/value head without repeating it.

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, TensorMetadata};
use burn::tensor::{FloatDType, Shape, Slice, TensorData};

use super::{AttentionMask, KEY_BLOCK, QUERY_BLOCK};

/// The finite running maximum a row starts from: a block whose scores are all masked (-inf)
/// leaves it unchanged and adds exp(-inf) = 0, instead of exp(-inf - -inf) = NaN.
const START_MAX: f32 = -1e30;

fn dims4<B: Backend>(x: &FloatTensor<B>) -> [usize; 4] {
    x.shape().dims::<4>()
}

/// Rows `range` of dim 2 of a 4-d tensor.
fn rows<B: Backend>(x: &FloatTensor<B>, range: std::ops::Range<usize>) -> FloatTensor<B> {
    let [a, b, _, d] = dims4::<B>(x);
    B::float_slice(
        x.clone(),
        &[
            Slice::from(0..a),
            Slice::from(0..b),
            Slice::from(range),
            Slice::from(0..d),
        ],
    )
}

fn transposed<B: Backend>(x: FloatTensor<B>) -> FloatTensor<B> {
    B::float_swap_dims(x, 2, 3)
}

/// The blocks of `n` items of `size`.
fn blocks(n: usize, size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..n.div_ceil(size)).map(move |b| b * size..((b + 1) * size).min(n))
}

/// The geometry of one call: folded rows, queries per head, groups.
struct Geometry {
    batch: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    dim: usize,
    rows: usize,
}

impl Geometry {
    fn of<B: Backend>(q: &FloatTensor<B>, k: &FloatTensor<B>) -> Self {
        let [batch, heads, queries, dim] = dims4::<B>(q);
        let [_, kv_heads, keys, _] = dims4::<B>(k);
        Self {
            batch,
            kv_heads,
            queries,
            keys,
            dim,
            rows: heads / kv_heads * queries,
        }
    }

    /// `x` `[batch, heads, queries, dim]` as f32 `[batch, kv_heads, rows, dim]`.
    fn fold<B: Backend>(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        let x = B::float_cast(x, FloatDType::F32);
        let last = x.shape()[3];
        B::float_reshape(x, Shape::new([self.batch, self.kv_heads, self.rows, last]))
    }

    /// Whether some row of `rows` may see some key of key block `block`.
    fn reachable(&self, mask: &AttentionMask, rows: &std::ops::Range<usize>, block: usize) -> bool {
        let queries = if rows.len() >= self.queries {
            0..self.queries
        } else {
            let (start, end) = (rows.start % self.queries, (rows.end - 1) % self.queries);
            if start <= end {
                start..end + 1
            } else {
                0..self.queries
            }
        };
        mask.block_reachable(queries, block)
    }

    /// The additive f32 mask of rows `rows` and keys `keys`, `[batch or 1, 1, rows, keys]`;
    /// `None` when every entry is visible.
    fn mask_block<B: Backend>(
        &self,
        mask: &AttentionMask,
        rows: &std::ops::Range<usize>,
        keys: &std::ops::Range<usize>,
        device: &burn::backend::tensor::Device<B>,
    ) -> Option<FloatTensor<B>> {
        let batch = mask.segment_batch().unwrap_or(1);
        let mut values = Vec::with_capacity(batch * rows.len() * keys.len());
        let mut hidden = false;
        for b in 0..batch {
            for r in rows.clone() {
                let i = r % self.queries;
                for j in keys.clone() {
                    let seen = mask.visible(b, i, j);
                    hidden |= !seen;
                    values.push(if seen { 0.0f32 } else { f32::NEG_INFINITY });
                }
            }
        }
        hidden.then(|| {
            B::float_from_data(
                TensorData::new(values, [batch, 1, rows.len(), keys.len()]),
                device,
            )
        })
    }

    /// `q k^T * scale` (soft-capped when the mask says) plus the mask, for one block, and
    /// under a soft cap its slope `1 - tanh^2(s / cap)`, by which backward multiplies the
    /// scores' gradient.
    #[allow(clippy::too_many_arguments)]
    fn scores_and_slope<B: Backend>(
        &self,
        q: &FloatTensor<B>,
        k_t: &FloatTensor<B>,
        mask: &AttentionMask,
        rows: &std::ops::Range<usize>,
        keys: &std::ops::Range<usize>,
        scale: f64,
    ) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
        let s = B::float_mul_scalar(B::float_matmul(q.clone(), k_t.clone()), scale.into());
        let (s, slope) = match mask.softcap() {
            None => (s, None),
            Some(cap) => {
                let t = B::float_tanh(B::float_div_scalar(s, cap.into()));
                let slope = B::float_neg(B::float_sub_scalar(
                    B::float_mul(t.clone(), t.clone()),
                    1.0.into(),
                ));
                (B::float_mul_scalar(t, cap.into()), Some(slope))
            }
        };
        let s = match self.mask_block::<B>(mask, rows, keys, &q.device()) {
            Some(m) => B::float_add(s, m),
            None => s,
        };
        (s, slope)
    }
}

/// Blockwise attention with an online softmax: the output in `q`'s dtype and the f32
/// log-sum-exp `[batch, heads, queries]`.
pub fn forward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    mask: &AttentionMask,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let dtype = FloatDType::from(q.dtype());
    let shape = q.shape();
    let g = Geometry::of::<B>(&q, &k);
    let device = q.device();
    let q = g.fold::<B>(q);
    let k_t = transposed::<B>(B::float_cast(k, FloatDType::F32));
    let v = B::float_cast(v, FloatDType::F32);
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for row_block in blocks(g.rows, QUERY_BLOCK) {
        let n = row_block.len();
        let qb = rows::<B>(&q, row_block.clone());
        let stat = Shape::new([g.batch, g.kv_heads, n, 1]);
        let mut max = B::float_full(stat.clone(), START_MAX.into(), &device, FloatDType::F32);
        let mut sum = B::float_zeros(stat, &device, FloatDType::F32);
        let mut acc = B::float_zeros(
            Shape::new([g.batch, g.kv_heads, n, g.dim]),
            &device,
            FloatDType::F32,
        );
        for (block, keys) in blocks(g.keys, KEY_BLOCK).enumerate() {
            if !g.reachable(mask, &row_block, block) {
                continue;
            }
            let kb_t = B::float_slice(
                k_t.clone(),
                &[
                    Slice::from(0..g.batch),
                    Slice::from(0..g.kv_heads),
                    Slice::from(0..g.dim),
                    Slice::from(keys.clone()),
                ],
            );
            let (s, _) = g.scores_and_slope::<B>(&qb, &kb_t, mask, &row_block, &keys, scale);
            let block_max = B::float_max_dim(s.clone(), 3);
            let new_max = B::float_max_dim(B::float_cat(vec![max.clone(), block_max], 3), 3);
            let correction = B::float_exp(B::float_sub(max, new_max.clone()));
            let p = B::float_exp(B::float_sub(s, new_max.clone()));
            sum = B::float_add(
                B::float_mul(sum, correction.clone()),
                B::float_sum_dim(p.clone(), 3),
            );
            let pv = B::float_matmul(p, rows::<B>(&v, keys));
            acc = B::float_add(B::float_mul(acc, correction), pv);
            max = new_max;
        }
        outs.push(B::float_div(acc, sum.clone()));
        lses.push(B::float_add(max, B::float_log(sum)));
    }
    let out = B::float_reshape(B::float_cat(outs, 2), shape.clone());
    let lse = B::float_reshape(
        B::float_cat(lses, 2),
        Shape::new([shape[0], shape[1], shape[2]]),
    );
    (B::float_cast(out, dtype), lse)
}

/// The gradients `(d q, d k, d v)` of [`forward`], recomputing each block's probabilities
/// from `lse`: `P = exp(S - lse)`, `dP = dO v^T`, `d v = P^T dO`, `dS = P (dP - rowsum(P dP))`,
/// `d q = scale dS k`, `d k = scale dS^T q`. One row block at a time: its `P` and `dP` over
/// the keys it reaches are kept (linear in the sequence), so that the row sum is taken over
/// the very probabilities the gradients use (as the dense softmax's backward does) rather than
/// from the rounded output (`rowsum(dO O)`, flash attention's shortcut).
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    lse: FloatTensor<B>,
    grad: FloatTensor<B>,
    mask: &AttentionMask,
    scale: f64,
) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
    let (q_dtype, k_dtype) = (FloatDType::from(q.dtype()), FloatDType::from(k.dtype()));
    let (q_shape, k_shape) = (q.shape(), k.shape());
    let g = Geometry::of::<B>(&q, &k);
    let device = q.device();
    let q = g.fold::<B>(q);
    let grad = g.fold::<B>(grad);
    let lse = B::float_reshape(
        B::float_cast(lse, FloatDType::F32),
        Shape::new([g.batch, g.kv_heads, g.rows, 1]),
    );
    let kb = KeyBlocks::<B>::of(&g, k, v);
    let mut d_k: Vec<Option<FloatTensor<B>>> = vec![None; kb.ranges.len()];
    let mut d_v: Vec<Option<FloatTensor<B>>> = vec![None; kb.ranges.len()];
    let zeros = |n: usize| {
        B::float_zeros(
            Shape::new([g.batch, g.kv_heads, n, g.dim]),
            &device,
            FloatDType::F32,
        )
    };
    let mut d_q = Vec::new();
    for row_block in blocks(g.rows, QUERY_BLOCK) {
        let (qb, gb, lb) = (
            rows::<B>(&q, row_block.clone()),
            rows::<B>(&grad, row_block.clone()),
            rows::<B>(&lse, row_block.clone()),
        );
        let (reached, delta) = kb.reached(&g, mask, &row_block, [&qb, &gb, &lb], scale);
        let d_kv = [d_k.as_mut_slice(), d_v.as_mut_slice()];
        let dq = delta.and_then(|delta| kb.add_grads(reached, &delta, [&qb, &gb], scale, d_kv));
        d_q.push(dq.unwrap_or_else(|| zeros(row_block.len())));
    }
    let whole = |parts: Vec<Option<FloatTensor<B>>>| -> Vec<FloatTensor<B>> {
        parts
            .into_iter()
            .zip(&kb.ranges)
            .map(|(d, r)| d.unwrap_or_else(|| zeros(r.len())))
            .collect()
    };
    let d_q = B::float_reshape(B::float_cat(d_q, 2), q_shape);
    let d_k = B::float_reshape(B::float_cat(whole(d_k), 2), k_shape.clone());
    let d_v = B::float_reshape(B::float_cat(whole(d_v), 2), k_shape);
    (
        B::float_cast(d_q, q_dtype),
        B::float_cast(d_k, k_dtype),
        B::float_cast(d_v, k_dtype),
    )
}

/// `acc + x`, or `x` when nothing is accumulated yet.
fn accumulate<B: Backend>(acc: Option<FloatTensor<B>>, x: FloatTensor<B>) -> FloatTensor<B> {
    match acc {
        Some(acc) => B::float_add(acc, x),
        None => x,
    }
}

/// `P` and `dP` of one key block a row block reaches, and the soft cap's slope there:
/// `(block, P, dP, slope)`.
type Reached<B> = (
    usize,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
);

/// [`backward`]'s keys and values in f32, cut once into key blocks that every row block reads.
struct KeyBlocks<B: Backend> {
    /// Each block's key range.
    ranges: Vec<std::ops::Range<usize>>,
    /// Each block's keys, `[batch, kv_heads, block keys, dim]`.
    ks: Vec<FloatTensor<B>>,
    /// Each block's values transposed, `[batch, kv_heads, dim, block keys]`.
    vs_t: Vec<FloatTensor<B>>,
}

impl<B: Backend> KeyBlocks<B> {
    /// `k` and `v` `[batch, kv_heads, keys, dim]` cut into blocks of `KEY_BLOCK` keys.
    fn of(g: &Geometry, k: FloatTensor<B>, v: FloatTensor<B>) -> Self {
        let k = B::float_cast(k, FloatDType::F32);
        let v = B::float_cast(v, FloatDType::F32);
        let ranges: Vec<_> = blocks(g.keys, KEY_BLOCK).collect();
        let ks: Vec<_> = ranges.iter().map(|r| rows::<B>(&k, r.clone())).collect();
        let vs_t: Vec<_> = ranges
            .iter()
            .map(|r| transposed::<B>(rows::<B>(&v, r.clone())))
            .collect();
        Self { ranges, ks, vs_t }
    }

    /// P and dP of every key block the rows `row_block` (their `q`, `dO` and log-sum-exp
    /// `[qb, gb, lb]`) reach, and rowsum(P dP) over all of them (`None`: they reach none).
    fn reached(
        &self,
        g: &Geometry,
        mask: &AttentionMask,
        row_block: &std::ops::Range<usize>,
        [qb, gb, lb]: [&FloatTensor<B>; 3],
        scale: f64,
    ) -> (Vec<Reached<B>>, Option<FloatTensor<B>>) {
        let mut reached = Vec::new();
        let mut delta = None;
        for (block, keys) in self.ranges.iter().enumerate() {
            if !g.reachable(mask, row_block, block) {
                continue;
            }
            let k_t = transposed::<B>(self.ks[block].clone());
            let (s, slope) = g.scores_and_slope::<B>(qb, &k_t, mask, row_block, keys, scale);
            let p = B::float_exp(B::float_sub(s, lb.clone()));
            let dp = B::float_matmul(gb.clone(), self.vs_t[block].clone());
            delta = Some(accumulate::<B>(
                delta,
                B::float_sum_dim(B::float_mul(p.clone(), dp.clone()), 3),
            ));
            reached.push((block, p, dp, slope));
        }
        (reached, delta)
    }

    /// Adds one row block's `d k` and `d v` into `[d_k, d_v]` per key block it reached, and
    /// returns its `d q` (`None` when it reached none). `[qb, gb]` are its `q` and `dO`.
    fn add_grads(
        &self,
        reached: Vec<Reached<B>>,
        delta: &FloatTensor<B>,
        [qb, gb]: [&FloatTensor<B>; 2],
        scale: f64,
        [d_k, d_v]: [&mut [Option<FloatTensor<B>>]; 2],
    ) -> Option<FloatTensor<B>> {
        let mut dq = None;
        for (block, p, dp, slope) in reached {
            d_v[block] = Some(accumulate::<B>(
                d_v[block].take(),
                B::float_matmul(transposed::<B>(p.clone()), gb.clone()),
            ));
            let ds = B::float_mul(p, B::float_sub(dp, delta.clone()));
            // Through the soft cap: d s = d capped * (1 - tanh^2).
            let ds = match slope {
                Some(slope) => B::float_mul(ds, slope),
                None => ds,
            };
            let ds = B::float_mul_scalar(ds, scale.into());
            dq = Some(accumulate::<B>(
                dq,
                B::float_matmul(ds.clone(), self.ks[block].clone()),
            ));
            d_k[block] = Some(accumulate::<B>(
                d_k[block].take(),
                B::float_matmul(transposed::<B>(ds), qb.clone()),
            ));
        }
        dq
    }
}
