//! Flex's fused kernels: one loop per pass over contiguous f32 buffers. SwiGLU also takes bf16,
//! computing in f32 and rounding to bf16 wherever the plain ops round (each op's result);
//! other dtypes take the plain-op math. Strided inputs are made contiguous first (the plain
//! ops would copy them too).

use burn::backend::flex::FlexTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Flex, TensorMetadata};
use burn::tensor::{DType, Shape, TensorData, bf16};

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

/// `x`'s elements in f32 when it holds bf16 (each value exact in f32).
fn bf16_as_f32(x: &FlexTensor) -> Option<Vec<f32>> {
    if x.dtype() != DType::BF16 {
        return None;
    }
    let x = x.to_contiguous();
    Some(x.as_slice::<bf16>()?.iter().map(|v| v.to_f32()).collect())
}

/// A bf16 tensor of f32 values already rounded to bf16 (so dropping the low half is exact).
fn bf16_tensor(values: &[f32], shape: Shape) -> FlexTensor {
    let values: Vec<bf16> = values
        .iter()
        .map(|v| bf16::from_bits((v.to_bits() >> 16) as u16))
        .collect();
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `x` rounded to the nearest bf16 (ties to even), as `bf16::from_f32` rounds: where a plain
/// op on bf16 tensors rounds its result. Branch-free, so the loops around it vectorize.
#[inline]
fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000);
    if x.is_nan() { x } else { rounded }
}

/// SwiGLU on bf16 `gate` and `up`, rounding as `plain::swiglu`'s ops do: `s = sigmoid(gate)`,
/// `silu = gate * s` and the product with `up`, each rounded to bf16.
fn swiglu_bf16(gate: &FlexTensor, up: &FlexTensor) -> Option<FlexTensor> {
    let (g, u) = (bf16_as_f32(gate)?, bf16_as_f32(up)?);
    let out: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| round_bf16(round_bf16(g * round_bf16(sigmoid(g))) * u))
        .collect();
    Some(bf16_tensor(&out, gate.shape()))
}

/// SwiGLU's backward on bf16, rounding as `plain::swiglu_backward`'s ops do.
fn swiglu_backward_bf16(
    gate: &FlexTensor,
    up: &FlexTensor,
    grad: &FlexTensor,
) -> Option<(FlexTensor, FlexTensor)> {
    let (g, u, d) = (bf16_as_f32(gate)?, bf16_as_f32(up)?, bf16_as_f32(grad)?);
    let n = g.len();
    let (mut d_gate, mut d_up) = (vec![0.0f32; n], vec![0.0f32; n]);
    let outs = d_gate.iter_mut().zip(d_up.iter_mut());
    for ((d_gate, d_up), ((&g, &u), &d)) in outs.zip(g.iter().zip(&u).zip(&d)) {
        let s = round_bf16(sigmoid(g));
        let silu = round_bf16(g * s);
        *d_up = round_bf16(d * silu);
        let one_minus_s = round_bf16(-s + 1.0);
        let d_silu = round_bf16(s + round_bf16(silu * one_minus_s));
        *d_gate = round_bf16(round_bf16(d * u) * d_silu);
    }
    let shape = gate.shape();
    Some((
        bf16_tensor(&d_gate, shape.clone()),
        bf16_tensor(&d_up, shape),
    ))
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `e^x` in f32 without a libm call, so that the loops around it vectorize (libm's `expf` was a
/// tenth of a tiny-Llama step). Cody-Waite reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, and
/// Cephes' degree-5 polynomial for `e^r` (within 2 ulp of `e^x`); `x` is clamped to
/// [-87.3, 88], where `2^n` stays a normal f32 (below: about 1.3e-38 instead of a smaller
/// number or 0; above: about 1.7e38 instead of a larger one or infinity).
#[inline]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a branch.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `sum(a * b)` in f32 over 16 interleaved partial sums (a vectorizable order; a single running
/// sum would be one dependent add per element).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a_chunks
        .remainder()
        .iter()
        .zip(b_chunks.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a_chunks.zip(b_chunks) {
        for i in 0..LANES {
            lanes[i] += x[i] * y[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum(a)` in f32, in [`dot`]'s order.
fn sum(a: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail: f32 = chunks.remainder().iter().sum();
    for x in chunks {
        for i in 0..LANES {
            lanes[i] += x[i];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `1 / sqrt(mean(row^2) + eps)` in f32, as the plain ops compute it.
fn inv_rms(row: &[f32], eps: f64) -> f32 {
    1.0 / (dot(row, row) / row.len() as f32 + eps as f32).sqrt()
}

impl FusedBackend for Flex {
    fn swiglu(gate: FloatTensor<Self>, up: FloatTensor<Self>) -> FloatTensor<Self> {
        let shape = gate.shape();
        if shape != up.shape() {
            return plain::swiglu::<Self>(gate, up);
        }
        if let Some(out) = swiglu_bf16(&gate, &up) {
            return out;
        }
        let (Some(gate), Some(up)) = (contiguous_f32(gate.clone()), contiguous_f32(up.clone()))
        else {
            return plain::swiglu::<Self>(gate, up);
        };
        let mut out = vec![0.0f32; shape.num_elements()];
        for (o, (&g, &u)) in out.iter_mut().zip(elems(&gate).iter().zip(elems(&up))) {
            *o = g * sigmoid(g) * u;
        }
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
        if let Some(grads) = swiglu_backward_bf16(&gate, &up, &grad) {
            return grads;
        }
        let (Some(g), Some(u), Some(d)) = (
            contiguous_f32(gate.clone()),
            contiguous_f32(up.clone()),
            contiguous_f32(grad.clone()),
        ) else {
            return plain::swiglu_backward::<Self>(gate, up, grad);
        };
        let n = shape.num_elements();
        let (mut d_gate, mut d_up) = (vec![0.0f32; n], vec![0.0f32; n]);
        let outs = d_gate.iter_mut().zip(d_up.iter_mut());
        let ins = elems(&g).iter().zip(elems(&u)).zip(elems(&d));
        for ((d_gate, d_up), ((&g, &u), &d)) in outs.zip(ins) {
            let s = sigmoid(g);
            let silu = g * s;
            *d_up = d * silu;
            *d_gate = d * u * (s + silu * (1.0 - s));
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
        let mut d_x = vec![0.0f32; shape.num_elements()];
        let mut d_weight = vec![0.0f32; n];
        let (mut normed, mut d_normed) = (vec![0.0f32; n], vec![0.0f32; n]);
        let rows = elems(&xs).chunks_exact(n).zip(elems(&d).chunks_exact(n));
        for ((row, g), d_x) in rows.zip(d_x.chunks_exact_mut(n)) {
            let r = inv_rms(row, eps);
            for i in 0..n {
                normed[i] = row[i] * r;
                d_normed[i] = g[i] * w[i];
                d_weight[i] += g[i] * normed[i];
            }
            let mean = dot(&d_normed, &normed) / n as f32;
            for i in 0..n {
                d_x[i] = r * (d_normed[i] - normed[i] * mean);
            }
        }
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
        for (p, &x) in p[..seen].iter_mut().zip(&row[..seen]) {
            *p = exp(x * scale - max);
        }
        let sum = sum(&p[..seen]);
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
        let dot = dot(p, g);
        out.extend(p.iter().zip(g).map(|(p, g)| p * (g - dot)));
    }
    Some(tensor(out, shape))
}

#[cfg(test)]
mod tests {
    use super::exp;

    /// The branch-free rounding equals `half`'s (ties to even, overflow to infinity, NaN kept).
    #[test]
    fn round_bf16_equals_halfs_conversion() {
        use super::{bf16, round_bf16};
        let mut bits = 0u32;
        loop {
            let x = f32::from_bits(bits);
            let (got, want) = (round_bf16(x), bf16::from_f32(x).to_f32());
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{x}"
            );
            match bits.checked_add(0x3_3333) {
                Some(next) => bits = next,
                None => break,
            }
        }
        for x in [
            1.0 + 2f32.powi(-8),
            1.0 + 3.0 * 2f32.powi(-8),
            f32::MAX,
            -0.0,
            1e-40,
        ] {
            assert_eq!(
                round_bf16(x).to_bits(),
                bf16::from_f32(x).to_f32().to_bits(),
                "{x}"
            );
        }
    }

    /// Within 2 ulp of the f64 `exp` over the range softmax and SiLU use, and clamped beyond.
    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = -87.0f32;
        while x <= 87.5 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                (got - want).abs() <= 2.0 * ulp as f64,
                "exp({x}) = {got}, want {want}"
            );
            x += 0.001_7;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1.3e-38 && exp(f32::NEG_INFINITY) > 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1000.0).is_finite());
    }
}
