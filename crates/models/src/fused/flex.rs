//! Flex's fused kernels: one loop per pass over contiguous buffers, compiled for the CPU's
//! widest vectors ([`wide_fn`]). The element-wise blocks take f32 and bf16 ([`Elem`]): bf16 is
//! computed in f32 and rounded to bf16 wherever the plain ops round (each op's result), so both
//! dtypes give the plain ops' values; other dtypes take the plain-op math. Strided inputs are
//! made contiguous first (the plain ops would copy them too).

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::Shape;

use super::{FusedBackend, plain};
use crate::simd::{
    Elem, by_elem, contiguous, dot, elems, exp, rounded_tensor, sigmoid, sum, tensor, to_f32_vec,
    wide_fn,
};

/// SwiGLU, `silu(gate) * up`, rounding as `plain::swiglu`'s ops do: `s = sigmoid(gate)`,
/// `silu = gate * s` and the product with `up`, each rounded to `E`.
fn swiglu<E: Elem>(gate: &FlexTensor, up: &FlexTensor) -> Option<FlexTensor> {
    let (gate, up) = (contiguous::<E>(gate)?, contiguous::<E>(up)?);
    let mut out = vec![E::from_rounded(0.0); gate.shape().num_elements()];
    swiglu_loop(elems::<E>(&gate), elems::<E>(&up), &mut out);
    Some(tensor(out, gate.shape()))
}

wide_fn! {
    fn swiglu_loop<E: Elem>(g: &[E], u: &[E], out: &mut [E]) {
        for (o, (&g, &u)) in out.iter_mut().zip(g.iter().zip(u)) {
            let (g, u) = (g.to_f32(), u.to_f32());
            let silu = E::round(g * E::round(sigmoid(g)));
            *o = E::from_rounded(E::round(silu * u));
        }
    }
}

/// SwiGLU's backward, rounding as `plain::swiglu_backward`'s ops do.
fn swiglu_backward<E: Elem>(
    gate: &FlexTensor,
    up: &FlexTensor,
    grad: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let (gate, up, grad) = (
        contiguous::<E>(gate)?,
        contiguous::<E>(up)?,
        contiguous::<E>(grad)?,
    );
    let (shape, zero) = (gate.shape(), E::from_rounded(0.0));
    let n = shape.num_elements();
    let (mut d_gate, mut d_up) = (vec![zero; n], vec![zero; n]);
    let inputs = [&gate, &up, &grad].map(elems::<E>);
    swiglu_backward_loop(inputs, &mut d_gate, &mut d_up);
    Some((tensor(d_gate, shape.clone()), tensor(d_up, shape)))
}

wide_fn! {
    fn swiglu_backward_loop<E: Elem>(inputs: [&[E]; 3], d_gate: &mut [E], d_up: &mut [E]) {
        let [g, u, d] = inputs;
        let outs = d_gate.iter_mut().zip(d_up.iter_mut());
        for ((d_gate, d_up), ((&g, &u), &d)) in outs.zip(g.iter().zip(u).zip(d)) {
            let (g, u, d) = (g.to_f32(), u.to_f32(), d.to_f32());
            let s = E::round(sigmoid(g));
            let silu = E::round(g * s);
            *d_up = E::from_rounded(E::round(d * silu));
            let one_minus_s = E::round(-s + 1.0);
            let d_silu = E::round(s + E::round(silu * one_minus_s));
            *d_gate = E::from_rounded(E::round(E::round(d * u) * d_silu));
        }
    }
}

/// `1 / sqrt(mean(row^2) + eps)` in f32, as the plain ops compute it.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f64) -> f32 {
    1.0 / (dot(row, row) / row.len() as f32 + eps as f32).sqrt()
}

/// `row`'s elements in f32, into `into`.
#[inline(always)]
fn load<E: Elem>(row: &[E], into: &mut [f32]) {
    for (to, &v) in into.iter_mut().zip(row) {
        *to = v.to_f32();
    }
}

/// RMSNorm over the last dim in f32, as `plain::rms_norm`: the normalized row rounded to `E`,
/// then times the weight, rounded again.
fn rms_norm<E: Elem>(x: &FlexTensor, weight: &FlexTensor, eps: f64) -> Option<FlexTensor> {
    let shape = x.shape();
    let n = shape[shape.num_dims() - 1];
    let (xs, w) = (contiguous::<E>(x)?, to_f32_vec(weight)?);
    if w.len() != n || n == 0 {
        return None;
    }
    let mut out = vec![E::from_rounded(0.0); shape.num_elements()];
    rms_norm_loop(elems::<E>(&xs), &w, eps, &mut out);
    Some(tensor(out, shape))
}

wide_fn! {
    fn rms_norm_loop<E: Elem>(x: &[E], w: &[f32], eps: f64, out: &mut [E]) {
        let n = w.len();
        let mut row32 = vec![0.0f32; n];
        for (row, out) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            load(row, &mut row32);
            let r = inv_rms(&row32, eps);
            for ((o, &v), &w) in out.iter_mut().zip(&row32).zip(w) {
                *o = E::from_rounded(E::round(E::round(v * r) * w));
            }
        }
    }
}

/// RMSNorm's backward, as `plain::rms_norm_backward`: f32 math from `E`'s values, rounded to
/// `E` where the plain ops' results are `E` (`grad * weight`, each `grad * normed` term, `d x`);
/// the weight's gradient is summed over rows in f32 and rounded once.
fn rms_norm_backward<E: Elem>(
    x: &FlexTensor,
    weight: &FlexTensor,
    grad: &FlexTensor,
    eps: f64,
) -> Option<(FlexTensor, FlexTensor)> {
    let shape = x.shape();
    let n = shape[shape.num_dims() - 1];
    let (xs, w, d) = (
        contiguous::<E>(x)?,
        to_f32_vec(weight)?,
        contiguous::<E>(grad)?,
    );
    if w.len() != n || n == 0 || shape != grad.shape() {
        return None;
    }
    let mut d_x = vec![E::from_rounded(0.0); shape.num_elements()];
    let mut d_weight = vec![0.0f32; n];
    let inputs = [elems::<E>(&xs), elems::<E>(&d)];
    rms_norm_backward_loop(inputs, &w, eps, &mut d_x, &mut d_weight);
    Some((
        tensor(d_x, shape),
        rounded_tensor::<E>(&d_weight, Shape::new([n])),
    ))
}

wide_fn! {
    fn rms_norm_backward_loop<E: Elem>(
        inputs: [&[E]; 2],
        w: &[f32],
        eps: f64,
        d_x: &mut [E],
        d_weight: &mut [f32],
    ) {
        let [x, grad] = inputs;
        let n = w.len();
        let [mut row32, mut grad32, mut normed, mut d_normed] = [(); 4].map(|_| vec![0.0f32; n]);
        let rows = x.chunks_exact(n).zip(grad.chunks_exact(n));
        for ((row, g), d_x) in rows.zip(d_x.chunks_exact_mut(n)) {
            load(row, &mut row32);
            load(g, &mut grad32);
            let r = inv_rms(&row32, eps);
            for i in 0..n {
                normed[i] = row32[i] * r;
                d_normed[i] = E::round(grad32[i] * w[i]);
                d_weight[i] += E::round(grad32[i] * E::round(normed[i]));
            }
            let mean = dot(&d_normed, &normed) / n as f32;
            for i in 0..n {
                d_x[i] = E::from_rounded(E::round(r * (d_normed[i] - normed[i] * mean)));
            }
        }
    }
}

/// Runs a kernel generic over [`Elem`] on a tensor's dtype, else the plain-op math.
macro_rules! fused_or_plain {
    ($dtype:expr, $fused:ident ( $($arg:expr),* ), $plain:expr) => {
        match by_elem!($dtype, $fused($($arg),*)) {
            Some(out) => out,
            None => $plain,
        }
    };
}

impl FusedBackend for Flex {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        if gate.shape() != up.shape() {
            return plain::swiglu::<Self>(gate, up);
        }
        fused_or_plain!(
            gate.dtype(),
            swiglu(&gate, &up),
            plain::swiglu::<Self>(gate, up)
        )
    }

    fn swiglu_backward(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = gate.shape();
        if shape != up.shape() || shape != grad.shape() {
            return plain::swiglu_backward::<Self>(gate, up, grad);
        }
        fused_or_plain!(
            gate.dtype(),
            swiglu_backward(&gate, &up, &grad),
            plain::swiglu_backward::<Self>(gate, up, grad)
        )
    }

    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        fused_or_plain!(
            x.dtype(),
            rms_norm(&x, &weight, eps),
            plain::rms_norm::<Self>(x, weight, eps)
        )
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        fused_or_plain!(
            x.dtype(),
            rms_norm_backward(&x, &weight, &grad, eps),
            plain::rms_norm_backward::<Self>(x, weight, grad, eps)
        )
    }

    fn causal_softmax(scores: FloatTensor<Self>, scale: f64) -> FloatTensor<Self> {
        match causal_softmax(&scores, scale) {
            Some(probs) => probs,
            None => plain::causal_softmax::<Self>(scores, scale),
        }
    }

    fn softmax_backward(probs: FloatTensor<Self>, grad: FloatTensor<Self>) -> FloatTensor<Self> {
        match softmax_backward(&probs, &grad) {
            Some(d) => d,
            None => plain::softmax_backward::<Self>(probs, grad),
        }
    }

    fn rotary(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fused_or_plain!(
            x.dtype(),
            rotate(&x, &cos, &sin, false),
            plain::rotary::<Self>(x, cos, sin, false)
        )
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        fused_or_plain!(
            grad.dtype(),
            rotate(&grad, &cos, &sin, true),
            plain::rotary::<Self>(grad, cos, sin, true)
        )
    }
}

/// The rotation of `x` `[.., seq, dim]` by `cos`/`sin` (`seq * dim` elements), or its
/// transpose, rounding as `plain::rotary`'s ops do (`x * cos`, the rotated half times `sin`,
/// their sum); `None` where the loop does not apply (dtype, odd dim, other shapes).
fn rotate<E: Elem>(
    x: &FlexTensor,
    cos: &FlexTensor,
    sin: &FlexTensor,
    transposed: bool,
) -> Option<FlexTensor> {
    let shape = x.shape();
    let rank = shape.num_dims();
    if rank < 2 {
        return None;
    }
    let (seq, dim) = (shape[rank - 2], shape[rank - 1]);
    let (x, c, s) = (contiguous::<E>(x)?, to_f32_vec(cos)?, to_f32_vec(sin)?);
    if dim % 2 != 0 || dim == 0 || c.len() != seq * dim || s.len() != seq * dim {
        return None;
    }
    let mut out = vec![E::from_rounded(0.0); shape.num_elements()];
    rotate_loop(elems::<E>(&x), [&c, &s], dim, transposed, &mut out);
    Some(tensor(out, shape))
}

wide_fn! {
    /// [`rotate`]'s loop: `x` and `out` are `[.., seq, dim]`, the tables `[seq, dim]`.
    fn rotate_loop<E: Elem>(
        x: &[E],
        tables: [&[f32]; 2],
        dim: usize,
        transposed: bool,
        out: &mut [E],
    ) {
        let [cos, sin] = tables;
        let (half, r) = (dim / 2, E::round);
        let matrices = x.chunks_exact(cos.len()).zip(out.chunks_exact_mut(cos.len()));
        for (x, out) in matrices {
            let rows = x.chunks_exact(dim).zip(out.chunks_exact_mut(dim));
            for ((row, o), (c, s)) in rows.zip(cos.chunks_exact(dim).zip(sin.chunks_exact(dim))) {
                // Halves as their own slices, so the loops below carry no bounds checks.
                let ((x1, x2), (o1, o2)) = (row.split_at(half), o.split_at_mut(half));
                let ((c1, c2), (s1, s2)) = (c.split_at(half), s.split_at(half));
                let halves = x1.iter().zip(x2).zip(o1.iter_mut().zip(o2.iter_mut()));
                let tables = c1.iter().zip(c2).zip(s1.iter().zip(s2));
                for (((a, b), (o1, o2)), ((c1, c2), (s1, s2))) in halves.zip(tables) {
                    let (a, b) = (a.to_f32(), b.to_f32());
                    let (first, second) = match transposed {
                        true => (r(a * c1) + r(b * s2), r(b * c2) - r(a * s1)),
                        false => (r(a * c1) - r(b * s1), r(b * c2) + r(a * s2)),
                    };
                    *o1 = E::from_rounded(r(first));
                    *o2 = E::from_rounded(r(second));
                }
            }
        }
    }
}

/// Flex's attention softmax and its backward as loops over f32 rows; the matmuls around them
/// are flex's own (see `plain::causal_attention`).
pub(super) fn causal_softmax(scores: &FlexTensor, scale: f64) -> Option<FlexTensor> {
    let shape = scores.shape();
    let rank = shape.num_dims();
    if rank < 2 || shape[rank - 1] != shape[rank - 2] {
        return None;
    }
    let scores = contiguous::<f32>(scores)?;
    let mut out = vec![0.0f32; shape.num_elements()];
    causal_softmax_loop(
        elems::<f32>(&scores),
        shape[rank - 1],
        scale as f32,
        &mut out,
    );
    Some(tensor(out, shape))
}

wide_fn! {
    fn causal_softmax_loop(scores: &[f32], s: usize, scale: f32, out: &mut [f32]) {
        for (index, (row, p)) in scores.chunks_exact(s).zip(out.chunks_exact_mut(s)).enumerate() {
            // Query `i` sees keys `0..=i`; the rest stay 0 (exp(-inf)).
            let seen = index % s + 1;
            let max = row[..seen]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
            for (p, &x) in p[..seen].iter_mut().zip(&row[..seen]) {
                *p = exp(x * scale - max);
            }
            let sum = sum(&p[..seen]);
            p[..seen].iter_mut().for_each(|p| *p /= sum);
        }
    }
}

pub(super) fn softmax_backward(probs: &FlexTensor, grad: &FlexTensor) -> Option<FlexTensor> {
    let shape = probs.shape();
    if shape != grad.shape() {
        return None;
    }
    let n = shape[shape.num_dims() - 1];
    let (probs, grad) = (contiguous::<f32>(probs)?, contiguous::<f32>(grad)?);
    let mut out = vec![0.0f32; shape.num_elements()];
    softmax_backward_loop(elems::<f32>(&probs), elems::<f32>(&grad), n, &mut out);
    Some(tensor(out, shape))
}

wide_fn! {
    fn softmax_backward_loop(probs: &[f32], grad: &[f32], n: usize, out: &mut [f32]) {
        let rows = probs.chunks_exact(n).zip(grad.chunks_exact(n));
        for ((p, g), o) in rows.zip(out.chunks_exact_mut(n)) {
            let dot = dot(p, g);
            for ((o, p), g) in o.iter_mut().zip(p).zip(g) {
                *o = p * (g - dot);
            }
        }
    }
}
