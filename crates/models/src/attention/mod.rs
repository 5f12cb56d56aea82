// NdArray is deprecated in Burn 0.22 but remains the default test backend until 0.23.
#![allow(deprecated)]

//! Memory-efficient attention (flash-attention style): the scores `[seq, seq]` are never held.
//!
//! Keys are visited in blocks with an online softmax (a running maximum and sum per query row,
//! the partial output rescaled when the maximum grows); forward keeps only each row's
//! log-sum-exp besides q, k and v, and backward recomputes the probabilities block by block from
//! it (`P = exp(S - lse)`, `dS = P (dP - rowsum(P dP))`). Which keys a query sees is an
//! [`AttentionMask`]: causal by each token's index in its full sequence (so a context-parallel
//! rank's query chunks attend to gathered keys by their global order), and optionally only
//! within the same segment (packed rows: no attention across documents). Grouped-query heads
//! are read in place (query head `h` uses key/value head `h / (heads / kv_heads)`), not
//! repeated.
//!
//! [`FlashBackend`] is a Burn backend extension whose autodiff implementation is one node with
//! its own backward (forward keeps q, k, v and the log-sum-exp; backward recomputes). Its
//! kernels are the blockwise algorithm in Burn's backend ops ([`plain`]), scores and softmax in
//! f32; flex overrides the two methods with the same math on raw buffers (`flex.rs`), other
//! backends run the plain ops. They are tested against [`reference_attention`] (the dense
//! masked softmax, op by op) and against f64 math, values and gradients.

mod autodiff;
mod flex;
pub mod plain;

use std::sync::Arc;

use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, Dispatch, NdArray, backend_extension};
use burn::tensor::activation::softmax;
use burn::tensor::{FloatDType, Tensor, TensorData};

/// Which keys each query sees: key `j` is visible to query `i` of batch row `b` when
/// `key_index[j] <= query_index[i]` (causal by the tokens' indices in the full sequence), with
/// a sliding window also `query_index[i] - key_index[j] < window`, and, with segments,
/// `query_segments[b][i] == key_segments[b][j]` (packed rows). Every query must
/// see at least one key (its own, in the masks the model builds). Cheap to clone.
#[derive(Debug, Clone)]
pub struct AttentionMask {
    inner: Arc<MaskInner>,
}

#[derive(Debug, Clone)]
struct MaskInner {
    query_index: Vec<i64>,
    key_index: Vec<i64>,
    /// `(batch, query segments [batch * queries], key segments [batch * keys])`.
    segments: Option<(usize, Vec<i64>, Vec<i64>)>,
    /// Per block of [`KEY_BLOCK`] keys, the smallest and largest key index (to skip blocks no
    /// query of a row can see: after every query, or a window or more behind every one).
    key_block_min: Vec<i64>,
    key_block_max: Vec<i64>,
    /// Sliding-window attention: keys `window` or more positions back are not seen.
    window: Option<usize>,
    /// Gemma 2's soft cap of the scaled scores, `cap * tanh(s / cap)`, before the mask.
    softcap: Option<f64>,
}

/// Keys per block in both kernels.
pub const KEY_BLOCK: usize = 64;
/// Query rows per block in the plain-op kernel.
pub const QUERY_BLOCK: usize = 64;

impl AttentionMask {
    /// Plain causal attention over a sequence of `seq` tokens: query `i` sees keys `0..=i`.
    pub fn causal(seq: usize) -> Self {
        let index: Vec<i64> = (0..seq as i64).collect();
        Self::indexed(index.clone(), index)
    }

    /// Causal attention by the tokens' indices in their full sequence: `query_index` of this
    /// rank's queries, `key_index` of the keys (a context-parallel rank's chunks and the
    /// gathered keys, in the order the tensors hold them).
    pub fn indexed(query_index: Vec<i64>, key_index: Vec<i64>) -> Self {
        let key_block_min = key_index
            .chunks(KEY_BLOCK)
            .map(|c| c.iter().copied().min().unwrap_or(i64::MAX))
            .collect();
        let key_block_max = key_index
            .chunks(KEY_BLOCK)
            .map(|c| c.iter().copied().max().unwrap_or(i64::MIN))
            .collect();
        Self {
            inner: Arc::new(MaskInner {
                query_index,
                key_index,
                segments: None,
                key_block_min,
                key_block_max,
                window: None,
                softcap: None,
            }),
        }
    }

    /// Packed rows of `seq` tokens (`segments` `[batch * seq]`, row-major, each token's
    /// example): causal, and no attention across examples.
    pub fn packed(segments: &[i64], batch: usize) -> Self {
        let seq = segments.len() / batch.max(1);
        Self::causal(seq).with_segments(batch, segments.to_vec(), segments.to_vec())
    }

    /// This mask, keys visible only within the same segment: `query_segments`
    /// `[batch * queries]` and `key_segments` `[batch * keys]`, row-major. Panics when the
    /// lengths do not match the indices (a caller's bug).
    pub fn with_segments(
        self,
        batch: usize,
        query_segments: Vec<i64>,
        key_segments: Vec<i64>,
    ) -> Self {
        let inner = &self.inner;
        assert_eq!(
            (query_segments.len(), key_segments.len()),
            (
                batch * inner.query_index.len(),
                batch * inner.key_index.len()
            ),
            "segments must be [batch * queries] and [batch * keys]"
        );
        self.changed(|m| m.segments = Some((batch, query_segments, key_segments)))
    }

    /// This mask, each query seeing only the keys fewer than `window` positions back (its
    /// own included), as transformers' sliding window (`kv_idx > q_idx - window`); `None`
    /// keeps it. Panics on a window of 0 (a query must see itself; configs refuse it).
    pub fn with_window(self, window: Option<usize>) -> Self {
        let Some(size) = window else {
            return self;
        };
        assert!(size > 0, "a sliding window of 0 keys");
        self.changed(|m| m.window = Some(size))
    }

    /// A copy of this mask with `change` made to it.
    fn changed(&self, change: impl FnOnce(&mut MaskInner)) -> Self {
        let mut inner = (*self.inner).clone();
        change(&mut inner);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// This mask with the scaled scores soft-capped, `cap * tanh(s / cap)` (Gemma 2's
    /// `attn_logit_softcapping`), before the keys it hides are masked; `None` keeps it.
    pub fn with_softcap(self, cap: Option<f64>) -> Self {
        match cap {
            Some(cap) => self.changed(|m| m.softcap = Some(cap)),
            None => self,
        }
    }

    /// The soft cap of the scores, if any.
    pub fn softcap(&self) -> Option<f64> {
        self.inner.softcap
    }

    /// The number of queries.
    pub fn queries(&self) -> usize {
        self.inner.query_index.len()
    }

    /// The number of keys.
    pub fn keys(&self) -> usize {
        self.inner.key_index.len()
    }

    /// The batch size the segments were given for (`None` without segments).
    pub fn segment_batch(&self) -> Option<usize> {
        self.inner.segments.as_ref().map(|s| s.0)
    }

    /// Whether query `i` of batch row `b` sees key `j`.
    #[inline]
    pub fn visible(&self, b: usize, i: usize, j: usize) -> bool {
        let m = &self.inner;
        if m.key_index[j] > m.query_index[i] {
            return false;
        }
        if let Some(w) = m.window
            && m.query_index[i] - m.key_index[j] >= w as i64
        {
            return false;
        }
        match &m.segments {
            None => true,
            Some((_, qs, ks)) => qs[b * m.query_index.len() + i] == ks[b * m.key_index.len() + j],
        }
    }

    /// Whether some query of `queries` might see some key of key block `block` (a block with
    /// none is skipped): not when every key comes after every query, nor, under a sliding
    /// window, when every key is a window or more behind every query. Conservative: segments
    /// are not looked at.
    fn block_reachable(&self, queries: std::ops::Range<usize>, block: usize) -> bool {
        let m = &self.inner;
        let queries = &m.query_index[queries];
        let max_q = queries.iter().copied().max().unwrap_or(i64::MIN);
        let min_q = queries.iter().copied().min().unwrap_or(i64::MAX);
        let behind = match m.window {
            Some(w) => m.key_block_max[block].saturating_add(w as i64) <= min_q,
            None => false,
        };
        m.key_block_min[block] <= max_q && !behind
    }

    /// The dense mask `[batch or 1, 1, queries, keys]`: 0 where visible, -inf where not.
    pub fn dense(&self, device: &burn::tensor::Device) -> Tensor<4> {
        let (sq, sk) = (self.queries(), self.keys());
        let batch = self.segment_batch().unwrap_or(1);
        let mut values = Vec::with_capacity(batch * sq * sk);
        for b in 0..batch {
            for i in 0..sq {
                values.extend((0..sk).map(|j| match self.visible(b, i, j) {
                    true => 0.0f32,
                    false => f32::NEG_INFINITY,
                }));
            }
        }
        Tensor::from_data(TensorData::new(values, [batch, 1, sq, sk]), device)
    }
}

/// Memory-efficient attention kernels (see the module docs). The defaults are the blockwise
/// plain-op math; the autodiff backend records one node that keeps the log-sum-exp, never the
/// probabilities.
#[backend_extension(
    Autodiff,
    NdArray,
    Flex,
    Cube: cfg(any(feature = "cuda", feature = "wgpu")),
    LibTorch: cfg(feature = "tch")
)]
pub trait FlashBackend: Backend {
    /// Attention of `q` `[batch, heads, queries, head_dim]` over `k`, `v` `[batch, kv_heads,
    /// keys, head_dim]` (`kv_heads` dividing `heads`), scores scaled by `scale` and softmaxed
    /// in f32 over the keys `mask` shows; the output has `q`'s shape and dtype.
    fn flash_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::flash_attention_forward(q, k, v, mask, scale).0
    }

    /// [`flash_attention`](Self::flash_attention)'s output and each query row's f32
    /// log-sum-exp of the scaled scores, `[batch, heads, queries]` (what backward needs).
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        plain::forward::<Self>(q, k, v, &mask, scale)
    }

    /// The gradients of [`flash_attention`](Self::flash_attention) with respect to `q`, `k`
    /// and `v`, the probabilities recomputed from the forward's `lse`.
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        plain::backward::<Self>(q, k, v, lse, grad, &mask, scale)
    }
}

impl FlashBackend for NdArray {}

/// Flex: the same math on raw buffers with gemm's kernels ([`flex`]) for f32 and bf16 (the
/// blockwise plain ops for other dtypes): one pass of a few loops per block instead of a dozen
/// tensor ops, each allocating. (A row-by-row loop without matmuls was 25-30x slower than
/// eager attention: the products need gemm's kernels.)
impl FlashBackend for burn::backend::Flex {
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let same = q.dtype() == k.dtype() && k.dtype() == v.dtype();
        let fused = same
            .then(|| crate::simd::by_elem!(q.dtype(), flex::forward(&q, &k, &v, &mask, scale)))
            .flatten();
        fused.unwrap_or_else(|| plain::forward::<Self>(q, k, v, &mask, scale))
    }

    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        mask: AttentionMask,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let dtype = q.dtype();
        let same = [k.dtype(), v.dtype(), grad.dtype()]
            .iter()
            .all(|&d| d == dtype);
        let fused = same
            .then(|| {
                crate::simd::by_elem!(dtype, flex::backward(&q, &k, &v, &lse, &grad, &mask, scale))
            })
            .flatten();
        fused.unwrap_or_else(|| plain::backward::<Self>(q, k, v, lse, grad, &mask, scale))
    }
}

/// LibTorch: the blockwise plain-op math.
#[cfg(feature = "tch")]
impl FlashBackend for burn::backend::LibTorch {}

/// Burn's CubeCL backend (CUDA, wgpu): the blockwise plain-op math until a GPU kernel exists
/// (fused by Burn's fusion backend, which `Cube` is with the `fusion` feature).
#[cfg(any(feature = "cuda", feature = "wgpu"))]
impl FlashBackend for burn_cubecl::Cube {}

/// Memory-efficient attention of `q` `[batch, heads, queries, head_dim]` over `k`, `v`
/// `[batch, kv_heads, keys, head_dim]` under `mask`, scores scaled by `scale`, as one autodiff
/// node (see the module docs). Panics on shapes that do not fit together or do not match the
/// mask (a caller's bug).
pub fn flash_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
) -> Tensor<4> {
    let ([b, h, sq, d], [bk, hk, sk, dk]) = (q.dims(), k.dims());
    assert!(
        b == bk && d == dk && k.dims() == v.dims() && hk > 0 && h.is_multiple_of(hk),
        "flash_attention: q {:?}, k {:?}, v {:?} do not fit (kv heads must divide heads)",
        q.dims(),
        k.dims(),
        v.dims()
    );
    assert_eq!(
        (sq, sk),
        (mask.queries(), mask.keys()),
        "flash_attention: the mask is for other lengths than q and k"
    );
    if let Some(batch) = mask.segment_batch() {
        assert_eq!(
            batch, b,
            "flash_attention: the mask's segments are for another batch"
        );
    }
    Tensor::from_dispatch(<Dispatch as FlashBackend>::flash_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        mask.clone(),
        scale,
    ))
}

/// The dense reference, op by op as transformers' eager attention: key/value heads repeated,
/// scores in f32 plus the dense mask, softmax in f32, cast back, times `v`. What
/// [`flash_attention`] must equal (values and, through Burn's autodiff, gradients).
pub fn reference_attention(
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
) -> Tensor<4> {
    let [b, h, _, d] = q.dims();
    let [_, hk, sk, _] = k.dims();
    let dtype = q.dtype();
    let repeat = |t: Tensor<4>| {
        t.unsqueeze_dim::<5>(2)
            .repeat_dim(2, h / hk)
            .reshape([b, h, sk, d])
    };
    let (k, v) = (repeat(k), repeat(v));
    let scores = q
        .cast(FloatDType::F32)
        .matmul(k.cast(FloatDType::F32).swap_dims(2, 3))
        .mul_scalar(scale);
    let scores = match mask.softcap() {
        Some(cap) => scores.div_scalar(cap).tanh().mul_scalar(cap),
        None => scores,
    };
    let mask = mask.dense(&scores.device());
    let probs = softmax(scores + mask, 3).cast(dtype);
    probs.matmul(v)
}

#[cfg(test)]
mod tests;
