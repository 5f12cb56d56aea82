//! Byte-level work on `TensorData`: concatenating, slicing and reducing along one dimension.
//! Engines that move bytes (threads, MPI) share these, so every engine computes the same
//! results in the same order.
//!
//! A tensor of shape `[.., n, ..]` is seen along `dim` as `[outer, n, inner]`: a slice of the
//! dimension is `outer` contiguous runs of `len * inner` elements.

use burn::tensor::{DType, TensorData, bf16, f16};

use crate::transport::buffer::{into_tensor_data, output_buffer};

/// The three-factor view of a shape along `dim`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DimView {
    pub outer: usize,
    pub len: usize,
    /// Bytes of one index along `dim` (inner elements times element size).
    pub row_bytes: usize,
}

impl DimView {
    pub fn new(shape: &[usize], dim: usize, elem_bytes: usize) -> Self {
        let outer = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        Self {
            outer,
            len: shape[dim],
            row_bytes: inner * elem_bytes,
        }
    }
}

pub(crate) fn elem_bytes(dtype: DType) -> usize {
    dtype.size()
}

pub(crate) fn shape_of(data: &TensorData) -> Vec<usize> {
    data.shape().to_vec()
}

/// Concatenates `parts` along `dim`. All parts must agree on every other dimension and dtype
/// (checked by the caller).
pub(crate) fn concat(parts: &[&TensorData], dim: usize) -> TensorData {
    let runs: Vec<(&[u8], &[usize])> = parts
        .iter()
        .map(|p| (p.as_bytes(), &p.shape()[..]))
        .collect();
    concat_bytes(&runs, dim, parts[0].dtype())
}

/// Concatenates along `dim` tensors given as (bytes, shape) of one `dtype`, e.g. pieces that
/// arrived in one receive buffer.
pub(crate) fn concat_bytes(parts: &[(&[u8], &[usize])], dim: usize, dtype: DType) -> TensorData {
    let eb = elem_bytes(dtype);
    let mut shape = parts[0].1.to_vec();
    shape[dim] = parts.iter().map(|p| p.1[dim]).sum();
    let total: usize = shape.iter().product::<usize>() * eb;
    let mut out = output_buffer(total);
    let views: Vec<DimView> = parts.iter().map(|p| DimView::new(p.1, dim, eb)).collect();
    let outer = views[0].outer;
    for o in 0..outer {
        for ((bytes, _), view) in parts.iter().zip(&views) {
            let run = view.len * view.row_bytes;
            out.extend_from_slice(&bytes[o * run..(o + 1) * run]);
        }
    }
    into_tensor_data(out, shape, dtype)
}

/// The slices of `data` along `dim` of consecutive `sizes`, each made contiguous, one after the
/// other in one buffer: what a rank sends when slice `j` goes to rank `j`. (Only the `mpi`
/// engine sends such a buffer.)
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub(crate) fn split_bytes(data: &TensorData, dim: usize, sizes: &[usize]) -> Vec<u8> {
    let view = DimView::new(data.shape(), dim, elem_bytes(data.dtype()));
    let run = view.len * view.row_bytes;
    let bytes = data.as_bytes();
    let mut out = output_buffer(bytes.len());
    let mut start = 0;
    for size in sizes {
        for o in 0..view.outer {
            let from = o * run + start * view.row_bytes;
            out.extend_from_slice(&bytes[from..from + size * view.row_bytes]);
        }
        start += size;
    }
    out
}

/// The slice `start..start + len` of `data` along `dim`.
pub(crate) fn narrow(data: &TensorData, dim: usize, start: usize, len: usize) -> TensorData {
    let dtype = data.dtype();
    let view = DimView::new(data.shape(), dim, elem_bytes(dtype));
    let mut shape = shape_of(data);
    shape[dim] = len;
    let run = view.len * view.row_bytes;
    let mut out = output_buffer(view.outer * len * view.row_bytes);
    let bytes = data.as_bytes();
    for o in 0..view.outer {
        let from = o * run + start * view.row_bytes;
        out.extend_from_slice(&bytes[from..from + len * view.row_bytes]);
    }
    into_tensor_data(out, shape, dtype)
}

/// Elementwise reductions a collective can apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReduceOp {
    /// Sum, in rank order.
    Sum,
    /// Sum in rank order, then divided by the group size.
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        };
        f.write_str(name)
    }
}

/// Whether `reduce` supports this dtype.
pub(crate) fn reducible(dtype: DType) -> bool {
    matches!(dtype, DType::F64 | DType::F32 | DType::F16 | DType::BF16)
}

/// Reduces the slice `start..start + len` along `dim` of every input, element by element in
/// rank order, into a new tensor of that slice's shape. Half-precision inputs accumulate in
/// f32 and round once, so the result does not depend on how many ranks there are beyond the
/// order of the additions.
pub(crate) fn reduce_slice(
    inputs: &[&TensorData],
    dim: usize,
    start: usize,
    len: usize,
    op: ReduceOp,
) -> TensorData {
    let first = inputs[0];
    let dtype = first.dtype();
    let view = DimView::new(first.shape(), dim, elem_bytes(dtype));
    let mut shape = shape_of(first);
    shape[dim] = len;
    let run = view.len * view.row_bytes;
    let piece = len * view.row_bytes;
    let mut out = output_buffer(view.outer * piece);
    for o in 0..view.outer {
        let from = o * run + start * view.row_bytes;
        let sources: Vec<&[u8]> = inputs
            .iter()
            .map(|d| &d.as_bytes()[from..from + piece])
            .collect();
        reduce_into(&sources, &mut out, dtype, op);
    }
    into_tensor_data(out, shape, dtype)
}

/// Reduces equally long byte runs of `dtype` elements, element by element in order.
pub(crate) fn reduce_bytes(sources: &[&[u8]], dtype: DType, op: ReduceOp) -> Vec<u8> {
    let mut out = output_buffer(sources[0].len());
    reduce_into(sources, &mut out, dtype, op);
    out
}

/// Appends the reduction of `sources` to `dst`: written once, never zero-filled first.
pub(crate) fn reduce_into(sources: &[&[u8]], dst: &mut Vec<u8>, dtype: DType, op: ReduceOp) {
    match dtype {
        DType::F64 => reduce_run::<F64>(sources, dst, op),
        DType::F32 => reduce_run::<F32>(sources, dst, op),
        DType::F16 => reduce_run::<F16>(sources, dst, op),
        DType::BF16 => reduce_run::<BF16>(sources, dst, op),
        other => unreachable!("reduction called with unsupported dtype {other:?}"),
    }
}

/// An element type as stored in bytes, with the type it accumulates in.
trait Stored {
    const BYTES: usize;
    type Acc: Copy
        + std::ops::Add<Output = Self::Acc>
        + std::ops::Div<Output = Self::Acc>
        + PartialOrd;
    fn load(bytes: &[u8]) -> Self::Acc;
    fn store(value: Self::Acc, bytes: &mut [u8]);
    fn count(n: usize) -> Self::Acc;
}

struct F64;
struct F32;
struct F16;
struct BF16;

impl Stored for F64 {
    const BYTES: usize = 8;
    type Acc = f64;
    fn load(b: &[u8]) -> f64 {
        f64::from_ne_bytes(b.try_into().unwrap())
    }
    fn store(v: f64, b: &mut [u8]) {
        b.copy_from_slice(&v.to_ne_bytes())
    }
    fn count(n: usize) -> f64 {
        n as f64
    }
}

impl Stored for F32 {
    const BYTES: usize = 4;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        f32::from_ne_bytes(b.try_into().unwrap())
    }
    fn store(v: f32, b: &mut [u8]) {
        b.copy_from_slice(&v.to_ne_bytes())
    }
    fn count(n: usize) -> f32 {
        n as f32
    }
}

impl Stored for F16 {
    const BYTES: usize = 2;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        f16::from_ne_bytes(b.try_into().unwrap()).to_f32()
    }
    fn store(v: f32, b: &mut [u8]) {
        b.copy_from_slice(&f16::from_f32(v).to_ne_bytes())
    }
    fn count(n: usize) -> f32 {
        n as f32
    }
}

impl Stored for BF16 {
    const BYTES: usize = 2;
    type Acc = f32;
    fn load(b: &[u8]) -> f32 {
        bf16::from_ne_bytes(b.try_into().unwrap()).to_f32()
    }
    fn store(v: f32, b: &mut [u8]) {
        b.copy_from_slice(&bf16::from_f32(v).to_ne_bytes())
    }
    fn count(n: usize) -> f32 {
        n as f32
    }
}

/// Elements per block: the accumulator block stays in L1 while each rank's run streams by.
const BLOCK: usize = 2048;

fn reduce_run<S: Stored>(sources: &[&[u8]], dst: &mut Vec<u8>, op: ReduceOp) {
    let n = sources[0].len() / S::BYTES;
    let mut encoded = [0u8; BLOCK * 8];
    let mut acc: Vec<S::Acc> = Vec::with_capacity(BLOCK.min(n));
    let mut begin = 0;
    while begin < n {
        let end = (begin + BLOCK).min(n);
        let bytes = begin * S::BYTES..end * S::BYTES;
        acc.clear();
        acc.extend(
            sources[0][bytes.clone()]
                .chunks_exact(S::BYTES)
                .map(S::load),
        );
        for src in &sources[1..] {
            let values = src[bytes.clone()].chunks_exact(S::BYTES).map(S::load);
            match op {
                ReduceOp::Sum | ReduceOp::Avg => {
                    acc.iter_mut().zip(values).for_each(|(a, v)| *a = *a + v)
                }
                ReduceOp::Max => acc.iter_mut().zip(values).for_each(|(a, v)| {
                    if v > *a || v.partial_cmp(&v).is_none() {
                        *a = v
                    }
                }),
                ReduceOp::Min => acc.iter_mut().zip(values).for_each(|(a, v)| {
                    if v < *a || v.partial_cmp(&v).is_none() {
                        *a = v
                    }
                }),
            }
        }
        if op == ReduceOp::Avg {
            let count = S::count(sources.len());
            acc.iter_mut().for_each(|a| *a = *a / count);
        }
        let block = &mut encoded[..bytes.len()];
        for (value, out) in acc.iter().zip(block.chunks_exact_mut(S::BYTES)) {
            S::store(*value, out);
        }
        dst.extend_from_slice(block);
        begin = end;
    }
}

/// Elementwise sum, in order, of tensors of one shape and dtype (host-side accumulation, e.g.
/// of unsynchronised gradients).
pub fn sum(parts: &[&TensorData]) -> TensorData {
    let bytes: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
    let out = reduce_bytes(&bytes, parts[0].dtype(), ReduceOp::Sum);
    into_tensor_data(out, parts[0].shape().to_vec(), parts[0].dtype())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(shape: &[usize], offset: f32) -> TensorData {
        let n: usize = shape.iter().product();
        TensorData::new(
            (0..n).map(|i| i as f32 + offset).collect::<Vec<_>>(),
            shape.to_vec(),
        )
    }

    #[test]
    fn concat_then_narrow_round_trips_on_every_dim() {
        for dim in 0..3 {
            let mut a_shape = vec![2, 3, 4];
            let mut b_shape = a_shape.clone();
            a_shape[dim] = 1;
            b_shape[dim] = 2;
            let a = seq(&a_shape, 0.0);
            let b = seq(&b_shape, 100.0);
            let cat = concat(&[&a, &b], dim);
            assert_eq!(cat.shape()[dim], 3);
            assert_eq!(narrow(&cat, dim, 0, 1), a);
            assert_eq!(narrow(&cat, dim, 1, 2), b);
        }
    }

    #[test]
    fn split_bytes_lays_out_the_narrowed_slices_one_after_the_other() {
        let data = seq(&[2, 5, 3], 0.0);
        let sizes = [2, 0, 3];
        let packed = split_bytes(&data, 1, &sizes);
        let mut want = Vec::new();
        let mut start = 0;
        for size in sizes {
            want.extend_from_slice(narrow(&data, 1, start, size).as_bytes());
            start += size;
        }
        assert_eq!(packed, want);
    }

    #[test]
    fn reduce_sums_in_rank_order_and_averages() {
        let a = TensorData::new(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2]);
        let b = TensorData::new(vec![10.0f32, 20.0, 30.0, 40.0], [2, 2]);
        let sum = reduce_slice(&[&a, &b], 1, 1, 1, ReduceOp::Sum);
        assert_eq!(sum, TensorData::new(vec![22.0f32, 44.0], [2, 1]));
        let avg = reduce_slice(&[&a, &b], 0, 0, 2, ReduceOp::Avg);
        assert_eq!(avg, TensorData::new(vec![5.5f32, 11.0, 16.5, 22.0], [2, 2]));
        let max = reduce_slice(&[&a, &b], 0, 0, 2, ReduceOp::Max);
        assert_eq!(max, b);
        let min = reduce_slice(&[&a, &b], 0, 0, 2, ReduceOp::Min);
        assert_eq!(min, a);
    }
}
