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

    #[test]
    fn reduce_ops_map_one_to_one() {
        assert_eq!(nccl_reduce(ReduceOp::Sum) as u32, 0);
        assert_eq!(nccl_reduce(ReduceOp::Max) as u32, 2);
        assert_eq!(nccl_reduce(ReduceOp::Min) as u32, 3);
        assert_eq!(nccl_reduce(ReduceOp::Avg) as u32, 4);
    }
}
