//! Flex's f32 <-> bf16 conversion for the mixed-precision steps ([`DeviceStep::Cast`]: FSDP2's
//! `param_dtype` before a gather, `reduce_dtype` on the gradient). burn-flex converts one
//! element per call through `half`; here the same bit operations run over whole vectors
//! (compiled for AVX-512 where the CPU has it) on the rank's compute threads, so the values are
//! `half`'s, bit for bit. Other dtype pairs and strided views keep burn-flex's cast.
//!
//! [`DeviceStep::Cast`]: super::DeviceStep::Cast

use std::mem::MaybeUninit;

use burn::backend::Flex;
use burn::backend::TensorMetadata;
use burn::backend::flex::FlexTensor;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, TensorData, bf16};
use rayon::prelude::*;

/// Elements one task converts: large enough to amortise the task, small enough to spread a
/// layer's buffer over the rank's threads.
const CHUNK: usize = 1 << 16;

/// `x` in `dtype`, with the values Burn's cast gives.
pub fn cast_flex(x: FlexTensor, dtype: DType) -> FlexTensor {
    let shape = x.shape();
    let converted = match (x.dtype(), dtype) {
        (DType::F32, DType::BF16) => x
            .as_slice::<f32>()
            .map(|src| TensorData::new(convert(src, to_bf16), shape)),
        (DType::BF16, DType::F32) => x
            .as_slice::<bf16>()
            .map(|src| TensorData::new(convert(src, to_f32), shape)),
        _ => None,
    };
    match converted {
        Some(data) => FlexTensor::from_data(data),
        None => Flex::float_cast(x, dtype.into()),
    }
}

/// `half`'s f32 -> bf16, branch-free: to nearest even; a NaN keeps its high bits, made quiet.
#[inline(always)]
fn to_bf16(x: f32) -> bf16 {
    let bits = x.to_bits();
    let nan = bits & 0x7FFF_FFFF > 0x7F80_0000;
    // Adds just under half an ulp, plus one where the kept lowest bit is odd (ties to even).
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) >> 16;
    bf16::from_bits(if nan { (bits >> 16) | 0x40 } else { rounded } as u16)
}

/// `half`'s bf16 -> f32: exact; a NaN made quiet.
#[inline(always)]
fn to_f32(x: bf16) -> f32 {
    let bits = x.to_bits() as u32;
    f32::from_bits(
        if bits & 0x7FFF > 0x7F80 {
            bits | 0x40
        } else {
            bits
        } << 16,
    )
}

/// `src` converted element by element, in chunks on the current rayon pool.
fn convert<S, D, F>(src: &[S], one: F) -> Vec<D>
where
    S: Copy + Sync,
    D: Send,
    F: Fn(S) -> D + Copy + Send + Sync,
{
    let mut out = Vec::with_capacity(src.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(src.par_chunks(CHUNK))
        .for_each(|(dst, src)| convert_run(src, dst, one));
    // SAFETY: the chunks cover all `src.len()` elements and each was written.
    unsafe { out.set_len(src.len()) };
    out
}

/// One chunk, on the widest vectors this CPU has.
fn convert_run<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [MaybeUninit<D>], one: F) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has the features, checked just above.
        return unsafe { convert_avx512(src, dst, one) };
    }
    convert_loop(src, dst, one)
}

#[inline(always)]
fn convert_loop<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [MaybeUninit<D>], one: F) {
    for (d, &s) in dst.iter_mut().zip(src) {
        d.write(one(s));
    }
}

/// [`convert_loop`] compiled for AVX-512 (it vectorizes 16 or 32 lanes wide).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn convert_avx512<S: Copy, D, F: Fn(S) -> D>(src: &[S], dst: &mut [MaybeUninit<D>], one: F) {
    convert_loop(src, dst, one)
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::backend::TensorMetadata;
    use burn::backend::flex::FlexTensor;
    use burn::backend::ops::FloatTensorOps;
    use burn::tensor::{DType, Shape, TensorData, bf16};

    use super::cast_flex;

    /// f32 bit patterns that exercise every branch of the rounding: zeros, denormals, ties to
    /// even and odd, the largest finite values (which round to infinity), infinities, quiet and
    /// signalling NaNs with payloads, then pseudo-random bits; more than one chunk, and an
    /// uneven count.
    fn f32_cases() -> Vec<f32> {
        let mut bits = vec![
            0x0000_0000,
            0x8000_0000,
            0x0000_0001,
            0x807F_FFFF,
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
            0x7F7F_FFFF,
            0xFF7F_8000,
            0x7F7F_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0xFFA0_1234,
            0x7FFF_FFFF,
        ];
        let mut state = 0x2545_F491u32;
        bits.extend((0..(1 << 17) + 333).map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        }));
        bits.into_iter().map(f32::from_bits).collect()
    }

    fn flex(data: TensorData) -> FlexTensor {
        FlexTensor::from_data(data)
    }

    fn bits_of<E: burn::tensor::Element>(t: FlexTensor) -> Vec<E> {
        t.into_data().try_to_vec::<E>().unwrap()
    }

    #[test]
    fn f32_to_bf16_equals_halfs_conversion_bit_for_bit() {
        let values = f32_cases();
        let n = values.len();
        let got: Vec<bf16> = bits_of(cast_flex(
            flex(TensorData::new(values.clone(), [n])),
            DType::BF16,
        ));
        for (i, (&v, g)) in values.iter().zip(&got).enumerate() {
            let want = bf16::from_f32(v);
            assert_eq!(
                g.to_bits(),
                want.to_bits(),
                "element {i}: {:#010x}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn bf16_to_f32_equals_halfs_conversion_bit_for_bit() {
        // Every bf16 bit pattern, twice, and an uneven tail.
        let values: Vec<bf16> = (0..(1u32 << 17) + 7)
            .map(|b| bf16::from_bits(b as u16))
            .collect();
        let n = values.len();
        let got: Vec<f32> = bits_of(cast_flex(
            flex(TensorData::new(values.clone(), [n])),
            DType::F32,
        ));
        for (i, (v, g)) in values.iter().zip(&got).enumerate() {
            assert_eq!(
                g.to_bits(),
                v.to_f32().to_bits(),
                "element {i}: {:#06x}",
                v.to_bits()
            );
        }
    }

    #[test]
    fn strided_views_and_other_dtypes_take_burns_cast() {
        let values: Vec<f32> = (0..35).map(|i| i as f32 * 0.37 - 5.0).collect();
        let t = flex(TensorData::new(values, [5, 7]));
        let transposed = Flex::float_swap_dims(t, 0, 1);
        let ours = cast_flex(transposed.clone(), DType::BF16);
        assert_eq!(ours.shape(), Shape::new([7, 5]));
        let burns = Flex::float_cast(transposed.clone(), DType::BF16.into());
        assert_eq!(bits_of::<bf16>(ours), bits_of::<bf16>(burns));
        let f64s = cast_flex(transposed, DType::F64);
        assert_eq!(f64s.dtype(), DType::F64);
    }
}
