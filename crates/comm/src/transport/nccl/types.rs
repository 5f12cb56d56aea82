//! Burn element types and our reduce ops as NCCL names them. The discriminants are NCCL's ABI
//! values (`nccl.h`), so the mapping is checked here without loading NCCL; the engine converts
//! them to cudarc's `sys` enums (a test under the `nccl` feature checks that both agree).

use burn::tensor::DType;

use crate::transport::data::ReduceOp;
use crate::transport::error::CollectiveError;

/// `ncclDataType_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NcclDataType {
    /// Signed 8-bit integer.
    Int8 = 0,
    /// Unsigned 8-bit integer.
    Uint8 = 1,
    /// Signed 32-bit integer.
    Int32 = 2,
    /// Unsigned 32-bit integer.
    Uint32 = 3,
    /// Signed 64-bit integer.
    Int64 = 4,
    /// Unsigned 64-bit integer.
    Uint64 = 5,
    /// IEEE half precision.
    Float16 = 6,
    /// IEEE single precision.
    Float32 = 7,
    /// IEEE double precision.
    Float64 = 8,
    /// bfloat16.
    Bfloat16 = 9,
}

impl NcclDataType {
    /// Bytes of one element.
    pub fn size(self) -> usize {
        match self {
            NcclDataType::Int8 | NcclDataType::Uint8 => 1,
            NcclDataType::Float16 | NcclDataType::Bfloat16 => 2,
            NcclDataType::Int32 | NcclDataType::Uint32 | NcclDataType::Float32 => 4,
            NcclDataType::Int64 | NcclDataType::Uint64 | NcclDataType::Float64 => 8,
        }
    }
}

/// `ncclRedOp_t` (the built-in ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NcclRedOp {
    /// Elementwise sum.
    Sum = 0,
    /// Elementwise product (no [`ReduceOp`] maps to it).
    Prod = 1,
    /// Elementwise maximum.
    Max = 2,
    /// Elementwise minimum.
    Min = 3,
    /// Sum divided by the communicator size (NCCL 2.10+).
    Avg = 4,
}

/// The NCCL type that carries `dtype`, or an error naming `op` and the dtype.
pub fn nccl_dtype(op: &str, dtype: DType) -> Result<NcclDataType, CollectiveError> {
    Ok(match dtype {
        DType::F32 => NcclDataType::Float32,
        DType::F16 => NcclDataType::Float16,
        DType::BF16 => NcclDataType::Bfloat16,
        DType::F64 => NcclDataType::Float64,
        DType::I64 => NcclDataType::Int64,
        DType::I32 => NcclDataType::Int32,
        DType::I8 => NcclDataType::Int8,
        DType::U64 => NcclDataType::Uint64,
        DType::U32 => NcclDataType::Uint32,
        DType::U8 => NcclDataType::Uint8,
        other => {
            return Err(CollectiveError::UnsupportedDtype {
                op: format!("{op} (nccl)"),
                dtype: format!("{other:?}"),
            });
        }
    })
}

/// The NCCL reduction of `op`.
pub fn nccl_reduce(op: ReduceOp) -> NcclRedOp {
    match op {
        ReduceOp::Sum => NcclRedOp::Sum,
        ReduceOp::Avg => NcclRedOp::Avg,
        ReduceOp::Max => NcclRedOp::Max,
        ReduceOp::Min => NcclRedOp::Min,
    }
}

/// The unit roundoff of a float type (half the distance from 1 to the next value); 0 for the
/// integer types, whose reductions are exact.
pub fn unit_roundoff(t: NcclDataType) -> f64 {
    match t {
        NcclDataType::Float64 => 2f64.powi(-53),
        NcclDataType::Float32 => 2f64.powi(-24),
        NcclDataType::Float16 => 2f64.powi(-11),
        NcclDataType::Bfloat16 => 2f64.powi(-8),
        _ => 0.0,
    }
}

/// How far NCCL's `ncclAvg` of `ranks` values may lie from the host's `sum / ranks`, given the
/// sum of their magnitudes. NCCL computes a premultiplied sum, `sum(x_i * (1 / ranks))`, with
/// `1 / ranks`, each product and each partial sum rounded to the element type (bf16 keeps 8
/// bits), so ranks that are not a power of two (3, 5, 6, 7, ...) differ from `sum / ranks` by a
/// few units in the last place: comparing them exactly reports false mismatches.
pub fn avg_tolerance(t: NcclDataType, ranks: usize, abs_sum: f64) -> f64 {
    // One rounding for 1/ranks, one per product, one per addition, one for the host's division.
    (2 * ranks + 2) as f64 * unit_roundoff(t) * abs_sum
}

/// A compact code for the dtypes NCCL carries, sent ahead of point-to-point payloads so that
/// the receiver learns what arrives.
pub fn dtype_code(dtype: DType) -> Option<u64> {
    DTYPES.iter().position(|d| *d == dtype).map(|i| i as u64)
}

/// The dtype of [`dtype_code`].
pub fn dtype_from_code(code: u64) -> Option<DType> {
    DTYPES.get(code as usize).copied()
}

const DTYPES: [DType; 10] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::F64,
    DType::I64,
    DType::I32,
    DType::I8,
    DType::U64,
    DType::U32,
    DType::U8,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_dtypes_map_to_their_nccl_types() {
        assert_eq!(nccl_dtype("x", DType::F32).unwrap(), NcclDataType::Float32);
        assert_eq!(nccl_dtype("x", DType::F16).unwrap(), NcclDataType::Float16);
        assert_eq!(
            nccl_dtype("x", DType::BF16).unwrap(),
            NcclDataType::Bfloat16
        );
        for d in DTYPES {
            assert_eq!(nccl_dtype("x", d).unwrap().size(), d.size(), "{d:?}");
            assert_eq!(dtype_from_code(dtype_code(d).unwrap()), Some(d));
        }
        let e = nccl_dtype("all_reduce", DType::I16).unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_reduce (nccl) does not support dtype I16"
        );
        assert_eq!(dtype_from_code(99), None);
    }

    /// bf16 rounding of an f32 (to nearest, ties to even), for the simulation below.
    fn bf16(x: f32) -> f32 {
        let b = x.to_bits();
        let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
        f32::from_bits(rounded)
    }

    /// NCCL's ncclAvg: a premultiplied sum, rounded like the element type.
    fn premultiplied(xs: &[f32], round: impl Fn(f32) -> f32) -> f32 {
        let scale = round(1.0 / xs.len() as f32);
        xs.iter().fold(0.0, |acc, x| round(acc + round(x * scale)))
    }

    #[test]
    fn averages_compare_within_the_premultiplied_sums_rounding() {
        // nccl_check's values: multiples of 1/64 below 16.
        let value = |rank: usize, i: usize| ((i * 7 + rank * 13) % 1024) as f32 / 64.0;
        let mut exact_mismatch = [false; 9];
        for (ranks, mismatch) in exact_mismatch.iter_mut().enumerate().skip(1) {
            for (t, round) in [
                (NcclDataType::Float32, (|x| x) as fn(f32) -> f32),
                (NcclDataType::Bfloat16, bf16 as fn(f32) -> f32),
            ] {
                for i in 0..2048 {
                    let xs: Vec<f32> = (0..ranks).map(|r| round(value(r, i))).collect();
                    let host = xs.iter().sum::<f32>() / ranks as f32;
                    let device = premultiplied(&xs, round);
                    let abs: f64 = xs.iter().map(|x| x.abs() as f64).sum();
                    let diff = (device as f64 - host as f64).abs();
                    assert!(
                        diff <= avg_tolerance(t, ranks, abs),
                        "{t:?} x{ranks} at {i}: device {device}, host {host}"
                    );
                    if t == NcclDataType::Float32 && device != host {
                        *mismatch = true;
                    }
                }
            }
        }
        // The exact comparison nccl_check made before fails on these world sizes.
        assert!(exact_mismatch[3] && exact_mismatch[5] && exact_mismatch[7]);
        assert!(!exact_mismatch[1] && !exact_mismatch[2] && !exact_mismatch[4]);
        assert_eq!(avg_tolerance(NcclDataType::Int32, 3, 10.0), 0.0);
    }

    #[test]
    fn reduce_ops_map_one_to_one() {
        assert_eq!(nccl_reduce(ReduceOp::Sum) as u32, 0);
        assert_eq!(nccl_reduce(ReduceOp::Max) as u32, 2);
        assert_eq!(nccl_reduce(ReduceOp::Min) as u32, 3);
        assert_eq!(nccl_reduce(ReduceOp::Avg) as u32, 4);
    }
}
