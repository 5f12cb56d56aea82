//! Flex's fused kernels: one loop per pass over contiguous f32 buffers. Other dtypes take the
//! plain-op math; strided inputs are made contiguous first (the plain ops would copy them too).

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Shape, TensorData};

use super::{FusedBackend, plain};

/// `x`, contiguous, when it holds f32.
fn contiguous_f32(x: FlexTensor) -> Option<FlexTensor> {
    if x.dtype() != DType::F32 {
        return None;
    }
    Some(match x.as_slice::<f32>() {
        Some(_) => x,
        None => x.to_contiguous(),
    })
}

/// The f32 elements of a tensor [`contiguous_f32`] returned.
fn elems(x: &FlexTensor) -> &[f32] {
    x.as_slice::<f32>().expect("contiguous f32")
}

fn tensor(values: Vec<f32>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `1 / sqrt(mean(row^2) + eps)`, the mean summed in f64 and rounded to f32 as the plain ops
/// keep it.
fn inv_rms(row: &[f32], eps: f64) -> f32 {
    let mean_square = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / row.len() as f64;
    1.0 / ((mean_square as f32) + eps as f32).sqrt()
}

impl FusedBackend for Flex {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = gate.shape();
        if shape != up.shape() {
            return plain::swiglu::<Self>(gate, up);
        }
        let (Some(gate), Some(up)) = (contiguous_f32(gate.clone()), contiguous_f32(up.clone()))
        else {
            return plain::swiglu::<Self>(gate, up);
        };
        let out = elems(&gate)
            .iter()
            .zip(elems(&up))
            .map(|(&g, &u)| g * sigmoid(g) * u)
            .collect();
        tensor(out, shape)
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
        let (Some(g), Some(u), Some(d)) = (
            contiguous_f32(gate.clone()),
            contiguous_f32(up.clone()),
            contiguous_f32(grad.clone()),
        ) else {
            return plain::swiglu_backward::<Self>(gate, up, grad);
        };
        let n = shape.num_elements();
        let (mut d_gate, mut d_up) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for ((&g, &u), &d) in elems(&g).iter().zip(elems(&u)).zip(elems(&d)) {
            let s = sigmoid(g);
            let silu = g * s;
            d_up.push(d * silu);
            d_gate.push(d * u * (s + silu * (1.0 - s)));
        }
        (tensor(d_gate, shape.clone()), tensor(d_up, shape))
    }

    fn rms_norm(x: FloatTensor<Self>, weight: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        let shape = x.shape();
        let n = shape[shape.num_dims() - 1];
        let (Some(xs), Some(w)) = (contiguous_f32(x.clone()), contiguous_f32(weight.clone()))
        else {
            return plain::rms_norm::<Self>(x, weight, eps);
        };
        let w = elems(&w);
        if w.len() != n || n == 0 {
            return plain::rms_norm::<Self>(x, weight, eps);
        }
        let mut out = Vec::with_capacity(shape.num_elements());
        for row in elems(&xs).chunks_exact(n) {
            let r = inv_rms(row, eps);
            out.extend(row.iter().zip(w).map(|(&v, &w)| (v * r) * w));
        }
        tensor(out, shape)
    }

    fn rms_norm_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        eps: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let shape = x.shape();
        let n = shape[shape.num_dims() - 1];
        let (Some(xs), Some(w), Some(d)) = (
            contiguous_f32(x.clone()),
            contiguous_f32(weight.clone()),
            contiguous_f32(grad.clone()),
        ) else {
            return plain::rms_norm_backward::<Self>(x, weight, grad, eps);
        };
        let w = elems(&w);
        if w.len() != n || n == 0 || shape != grad.shape() {
            return plain::rms_norm_backward::<Self>(x, weight, grad, eps);
        }
        let mut d_x = Vec::with_capacity(shape.num_elements());
        let mut d_weight = vec![0.0f64; n];
        let mut d_normed = vec![0.0f32; n];
        for (row, g) in elems(&xs).chunks_exact(n).zip(elems(&d).chunks_exact(n)) {
            let r = inv_rms(row, eps);
            let mut dot = 0.0f64;
            for i in 0..n {
                let normed = row[i] * r;
                d_normed[i] = g[i] * w[i];
                dot += (d_normed[i] * normed) as f64;
                d_weight[i] += (g[i] * normed) as f64;
            }
            let mean = (dot / n as f64) as f32;
            d_x.extend((0..n).map(|i| r * (d_normed[i] - row[i] * r * mean)));
        }
        let d_weight = d_weight.into_iter().map(|v| v as f32).collect();
        (tensor(d_x, shape), tensor(d_weight, Shape::new([n])))
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
        match rotate(&x, &cos, &sin, false) {
            Some(out) => out,
            None => plain::rotary::<Self>(x, cos, sin, false),
        }
    }

    fn rotary_backward(
        grad: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        match rotate(&grad, &cos, &sin, true) {
            Some(out) => out,
            None => plain::rotary::<Self>(grad, cos, sin, true),
        }
    }
}

/// The rotation of `x` `[.., seq, dim]` by `cos`/`sin` (`seq * dim` elements), or its
/// transpose; `None` where the loop does not apply (dtype, odd dim, other shapes).
fn rotate(
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
    let (x, cos, sin) = (
        contiguous_f32(x.clone())?,
        contiguous_f32(cos.clone())?,
        contiguous_f32(sin.clone())?,
    );
    let (c, s) = (elems(&cos), elems(&sin));
    if dim % 2 != 0 || dim == 0 || c.len() != seq * dim || s.len() != seq * dim {
        return None;
    }
    let half = dim / 2;
    let mut out = vec![0.0f32; shape.num_elements()];
    for (index, (row, o)) in elems(&x)
        .chunks_exact(dim)
        .zip(out.chunks_exact_mut(dim))
        .enumerate()
    {
        let at = (index % seq) * dim;
        let (c, s) = (&c[at..at + dim], &s[at..at + dim]);
        for i in 0..half {
            let (a, b) = (row[i], row[i + half]);
            if transposed {
                o[i] = a * c[i] + b * s[i + half];
                o[i + half] = b * c[i + half] - a * s[i];
            } else {
                o[i] = a * c[i] - b * s[i];
                o[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
    Some(tensor(out, shape))
}

/// Flex's attention softmax and its backward as loops over f32 rows; the matmuls around them
/// are flex's own (see `plain::causal_attention`).
pub(super) fn causal_softmax(scores: &FlexTensor, scale: f64) -> Option<FlexTensor> {
    let shape = scores.shape();
    let rank = shape.num_dims();
    if rank < 2 || shape[rank - 1] != shape[rank - 2] {
        return None;
    }
    let s = shape[rank - 1];
    let scores = contiguous_f32(scores.clone())?;
    let scale = scale as f32;
    let mut out = vec![0.0f32; shape.num_elements()];
    for (index, (row, p)) in elems(&scores)
        .chunks_exact(s)
        .zip(out.chunks_exact_mut(s))
        .enumerate()
    {
        // Query `i` sees keys `0..=i`; the rest stay 0 (exp(-inf)).
        let seen = index % s + 1;
        let max = row[..seen]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
        let mut sum = 0.0f32;
        for (p, &x) in p[..seen].iter_mut().zip(&row[..seen]) {
            *p = (x * scale - max).exp();
            sum += *p;
        }
        p[..seen].iter_mut().for_each(|p| *p /= sum);
    }
    Some(tensor(out, shape))
}

pub(super) fn softmax_backward(probs: &FlexTensor, grad: &FlexTensor) -> Option<FlexTensor> {
    let shape = probs.shape();
    if shape != grad.shape() {
        return None;
    }
    let n = shape[shape.num_dims() - 1];
    let (probs, grad) = (
        contiguous_f32(probs.clone())?,
        contiguous_f32(grad.clone())?,
    );
    let mut out = Vec::with_capacity(shape.num_elements());
    for (p, g) in elems(&probs)
        .chunks_exact(n)
        .zip(elems(&grad).chunks_exact(n))
    {
        let dot: f32 = p.iter().zip(g).map(|(p, g)| p * g).sum();
        out.extend(p.iter().zip(g).map(|(p, g)| p * (g - dot)));
    }
    Some(tensor(out, shape))
}
