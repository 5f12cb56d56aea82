//! The header a point-to-point send puts ahead of its payload: NCCL's send and receive carry
//! bytes only, and a receive does not agree with its sender first, so the receiver learns the
//! dtype and shape of what arrives from these fixed-size words.

use burn::tensor::{DType, TensorData};

use super::agreement::MAX_DIMS;
use super::comm::NcclError;
use super::types::{dtype_code, dtype_from_code};

/// Bytes of a point-to-point header: dtype code, ndim, dims.
pub(super) const HEADER_BYTES: usize = (2 + MAX_DIMS) * 8;

/// The header a send puts ahead of its payload, so the receiver learns what arrives.
pub(super) fn point_to_point_header(data: &TensorData) -> Result<Vec<u8>, NcclError> {
    let shape = data.shape();
    if shape.len() > MAX_DIMS {
        return Err(NcclError::InvalidArgument(format!(
            "the nccl engine sends tensors of at most {MAX_DIMS} dimensions, not {}",
            shape.len()
        )));
    }
    let code = dtype_code(data.dtype()).ok_or_else(|| {
        NcclError::InvalidArgument(format!("NCCL cannot send dtype {:?}", data.dtype()))
    })?;
    let mut words = [0u64; 2 + MAX_DIMS];
    words[0] = code;
    words[1] = shape.len() as u64;
    for (w, s) in words[2..].iter_mut().zip(shape.iter()) {
        *w = *s as u64;
    }
    Ok(words.iter().flat_map(|w| w.to_le_bytes()).collect())
}

/// The dtype and shape a received header announces, or an error when it is not one.
pub(super) fn read_point_to_point_header(bytes: &[u8]) -> Result<(DType, Vec<usize>), NcclError> {
    let words: Vec<u64> = bytes
        .chunks(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    let corrupt = || NcclError::InvalidArgument("the sender's header is corrupt".into());
    let dtype = dtype_from_code(words[0]).ok_or_else(corrupt)?;
    let ndim = words[1] as usize;
    if ndim > MAX_DIMS {
        return Err(corrupt());
    }
    Ok((
        dtype,
        words[2..2 + ndim].iter().map(|x| *x as usize).collect(),
    ))
}
