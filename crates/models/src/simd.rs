//! What flex's fused loops (`fused`, `attention`) share: the element types they read and write
//! ([`Elem`]: f32, and bf16 computed in f32), the scalar math they inline (a branch-free `exp`,
//! bf16 rounding, lane-wise sums), and [`wide_fn`], which compiles a loop for the CPU's widest
//! vectors. A release build targets baseline x86-64 (SSE2), so without it the
//! loops run four lanes wide; the wider builds compute the same values (no fused multiply-add
//! is formed: Rust never contracts `a * b + c`).

use burn::backend::flex::FlexTensor;
use burn::tensor::{DType, Element, Shape, TensorData, bf16};

/// A float element flex's fused loops read as f32 and write back in its own type.
pub(crate) trait Elem: Element + Copy + Send + Sync {
    /// The tensor dtype of this element.
    const DTYPE: DType;
    /// The value in f32 (exact for both types).
    fn to_f32(self) -> f32;
    /// `x` rounded to this type, kept in f32: where a plain op on tensors of this type rounds
    /// its result (identity for f32).
    fn round(x: f32) -> f32;
    /// `x`, already [`round`](Elem::round)ed, as this type.
    fn from_rounded(x: f32) -> Self;
    /// A contiguous flex tensor's elements, when it holds this type.
    fn slice(x: &FlexTensor) -> Option<&[Self]>;
}

impl Elem for f32 {
    const DTYPE: DType = DType::F32;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        x
    }
    #[inline(always)]
    fn from_rounded(x: f32) -> Self {
        x
    }
    fn slice(x: &FlexTensor) -> Option<&[Self]> {
        x.as_slice()
    }
}

impl Elem for bf16 {
    const DTYPE: DType = DType::BF16;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    #[inline(always)]
    fn round(x: f32) -> f32 {
        round_bf16(x)
    }
    #[inline(always)]
    fn from_rounded(x: f32) -> Self {
        // Rounded already: the low half is zero, so dropping it is exact.
        bf16::from_bits((x.to_bits() >> 16) as u16)
    }
    fn slice(x: &FlexTensor) -> Option<&[Self]> {
        x.as_slice()
    }
}

/// `x`, contiguous, when its dtype is `E`'s.
pub(crate) fn contiguous<E: Elem>(x: &FlexTensor) -> Option<FlexTensor> {
    if x.dtype() != E::DTYPE {
        return None;
    }
    Some(match E::slice(x) {
        Some(_) => x.clone(),
        None => x.to_contiguous(),
    })
}

/// The elements of a tensor [`contiguous`] returned.
pub(crate) fn elems<E: Elem>(x: &FlexTensor) -> &[E] {
    E::slice(x).expect("a contiguous tensor of this element type")
}

/// Any float tensor's elements in f32, made contiguous (for the small operands: weights,
/// rotary tables); `None` for dtypes other than f32 and bf16.
pub(crate) fn to_f32_vec(x: &FlexTensor) -> Option<Vec<f32>> {
    match x.dtype() {
        DType::F32 => Some(elems::<f32>(&contiguous::<f32>(x)?).to_vec()),
        DType::BF16 => Some(
            elems::<bf16>(&contiguous::<bf16>(x)?)
                .iter()
                .map(|v| v.to_f32())
                .collect(),
        ),
        _ => None,
    }
}

/// A flex tensor of `values` (already in their element type).
pub(crate) fn tensor<E: Elem>(values: Vec<E>, shape: Shape) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// f32 values rounded to `E` into a tensor of `E`.
pub(crate) fn rounded_tensor<E: Elem>(values: &[f32], shape: Shape) -> FlexTensor {
    let mut out = vec![E::from_rounded(0.0); values.len()];
    round_into(values, &mut out);
    tensor(out, shape)
}

/// Dispatches on a flex tensor's dtype to a loop generic over [`Elem`]; `None` for dtypes the
/// loops do not take (the caller falls back to the plain ops).
macro_rules! by_elem {
    ($dtype:expr, $($f:ident)::+ ( $($arg:expr),* $(,)? )) => {
        match $dtype {
            burn::tensor::DType::F32 => $($f)::+::<f32>($($arg),*),
            burn::tensor::DType::BF16 => $($f)::+::<burn::tensor::bf16>($($arg),*),
            _ => None,
        }
    };
}
pub(crate) use by_elem;

/// The widest vectors this CPU runs that the loops are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// AVX-512 (F, BW, VL, DQ): sixteen f32 lanes.
    Avx512,
    /// AVX2 with FMA: eight lanes.
    Avx2,
    /// The build's target (SSE2 on x86-64): four lanes.
    Baseline,
}

/// This CPU's [`Level`] (the standard library caches the detection).
#[inline]
pub(crate) fn level() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512dq") {
            return Level::Avx512;
        }
        if has!("avx2") && has!("fma") {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// Defines a function whose body is compiled three times, for AVX-512, AVX2 and the build's
/// target, and runs the widest this CPU has ([`level`]). Everything the body calls should be
/// `#[inline(always)]` (or small enough to be inlined) to be compiled wide; closures passed
/// to iterator adapters are. The body takes one optional type parameter.
macro_rules! wide_fn {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident $(<$E:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?)
        $(-> $ret:ty)? $body:block
    ) => {
        $(#[$attr])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name $(<$E: $bound>)? ($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body $(<$E: $bound>)? ($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx512 $(<$E: $bound>)? ($($arg: $ty),*) $(-> $ret)? {
                    body $(::<$E>)? ($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2 $(<$E: $bound>)? ($($arg: $ty),*) $(-> $ret)? {
                    body $(::<$E>)? ($($arg),*)
                }
                match $crate::simd::level() {
                    // SAFETY: the CPU has every feature each function is compiled for.
                    $crate::simd::Level::Avx512 => return unsafe { avx512 $(::<$E>)? ($($arg),*) },
                    $crate::simd::Level::Avx2 => return unsafe { avx2 $(::<$E>)? ($($arg),*) },
                    $crate::simd::Level::Baseline => {}
                }
            }
            body $(::<$E>)? ($($arg),*)
        }
    };
}
pub(crate) use wide_fn;

wide_fn! {
    /// f32 values rounded to `E`, into `out`.
    fn round_into<E: Elem>(values: &[f32], out: &mut [E]) {
        for (o, &v) in out.iter_mut().zip(values) {
            *o = E::from_rounded(E::round(v));
        }
    }
}

/// `x` rounded to the nearest bf16 (ties to even), as `bf16::from_f32` rounds: where a plain
/// op on bf16 tensors rounds its result. Branch-free, so the loops around it vectorize.
#[inline(always)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    let rounded = f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000);
    if x.is_nan() { x } else { rounded }
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `e^x` in f32 without a libm call, so that the loops around it vectorize (libm's `expf` was a
/// tenth of a tiny-Llama step). Cody-Waite reduction `x = n ln2 + r`, `|r| <= ln2 / 2`, and
/// Cephes' degree-5 polynomial for `e^r` (within 2 ulp of `e^x`); `x` is clamped to
/// [-87.3, 88], where `2^n` stays a normal f32 (below: about 1.3e-38 instead of a smaller
/// number or 0; above: about 1.7e38 instead of a larger one or infinity).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer without a branch, and leaves that integer
    // in the low mantissa bits (read without a float-to-int conversion, which does not
    // vectorize: Rust's `as` saturates).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e_r = p * r * r + r + 1.0;
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    e_r * f32::from_bits((n_int.wrapping_add(127) as u32) << 23)
}

const LANES: usize = 16;

/// `sum(a * b)` in f32 over 16 interleaved partial sums (a vectorizable order; a single running
/// sum would be one dependent add per element).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
#[inline(always)]
pub(crate) fn sum(a: &[f32]) -> f32 {
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

/// `max(a)` (`-inf` for none), in lanes.
#[inline(always)]
pub(crate) fn max(a: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = a.chunks_exact(LANES);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    for x in chunks {
        for i in 0..LANES {
            lanes[i] = lanes[i].max(x[i]);
        }
    }
    lanes.iter().fold(tail, |m, &x| m.max(x))
}

#[cfg(test)]
mod tests {
    use super::{bf16, exp, round_bf16};

    wide_fn! {
        fn exp_all(xs: &[f32]) -> Vec<f32> {
            xs.iter().map(|&x| exp(x)).collect()
        }
    }

    /// The branch-free rounding equals `half`'s (ties to even, overflow to infinity, NaN kept).
    #[test]
    fn round_bf16_equals_halfs_conversion() {
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

    /// Within 2 ulp of the f64 `exp` over the range softmax and SiLU use, and clamped beyond;
    /// the vectorized build gives the scalar one's bits.
    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let xs: Vec<f32> = (0..=102_940).map(|i| -87.0 + i as f32 * 0.001_7).collect();
        let wide = exp_all(&xs);
        for (&x, &w) in xs.iter().zip(&wide) {
            let want = (x as f64).exp();
            let got = exp(x);
            let ulp = (want as f32).abs() * f32::EPSILON;
            assert!(
                (got as f64 - want).abs() <= 2.0 * ulp as f64,
                "exp({x}) = {got}, want {want}"
            );
            assert_eq!(got.to_bits(), w.to_bits(), "exp({x}) vectorized");
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1.3e-38 && exp(f32::NEG_INFINITY) > 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(1000.0).is_finite());
        assert_eq!(exp(-87.3), exp(-1000.0));
    }
}
