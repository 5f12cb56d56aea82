//! Host buffers for collective outputs.
//!
//! Every collective returns a fresh `TensorData`, so large outputs are new memory whose first
//! touch page-faults. Where the kernel backs memory with transparent huge pages only on
//! request (`madvise` mode, the default of many distributions), faulting 4 KiB pages one by
//! one costs more than the copy itself; asking for huge pages on large buffers removes most of
//! those faults, as PyTorch's CPU allocator does.

use burn::tensor::{Bytes, DType, TensorData};

/// Wraps a finished buffer as tensor data, without copying it when it is aligned for any
/// element type. (`TensorData::from_bytes_vec` always copies a byte vector into a
/// 16-byte-aligned allocation, because `Vec<u8>` does not promise the alignment that the
/// allocator gives large buffers in practice.)
pub fn into_tensor_data(bytes: Vec<u8>, shape: Vec<usize>, dtype: DType) -> TensorData {
    if bytes.is_empty() {
        // Empty bytes keep the alignment of the vector they came from, and a clone of empty
        // `u8` bytes points at address 1, which Burn's element casts refuse as misaligned. An
        // empty `Vec<u128>` is aligned for every element type, and so are its clones.
        TensorData::from_bytes(Bytes::from_elems(Vec::<u128>::new()), shape, dtype)
    } else if bytes.as_ptr().align_offset(MAX_ELEMENT_ALIGN) == 0 {
        TensorData::from_bytes(Bytes::from_elems(bytes), shape, dtype)
    } else {
        // Empty vectors (dangling pointers) and unusual allocators.
        TensorData::from_bytes_vec(bytes, shape, dtype)
    }
}

/// The largest alignment a tensor element type needs (Burn's own bound).
const MAX_ELEMENT_ALIGN: usize = std::mem::align_of::<u128>();

/// Buffers at least this large are advised to use huge pages.
const HUGE_PAGE_THRESHOLD: usize = 4 << 20;

/// An empty byte vector with room for `len` bytes, backed by huge pages where the platform
/// supports it and the buffer is large.
pub fn output_buffer(len: usize) -> Vec<u8> {
    let buffer = Vec::with_capacity(len);
    if len >= HUGE_PAGE_THRESHOLD {
        advise_huge_pages(buffer.as_ptr(), len);
    }
    buffer
}

/// A zero-filled byte vector of `len` bytes for a library to write into (a receive buffer).
/// Large zeroed allocations come from fresh pages that the kernel zeroes when first touched,
/// so this costs no more than `output_buffer`.
pub fn zeroed_buffer(len: usize) -> Vec<u8> {
    let buffer = vec![0u8; len];
    if len >= HUGE_PAGE_THRESHOLD {
        advise_huge_pages(buffer.as_ptr(), len);
    }
    buffer
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *const u8, len: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    // madvise needs page-aligned bounds; huge pages only form on 2 MiB-aligned ranges.
    let start = (ptr as usize).next_multiple_of(HUGE_PAGE);
    let end = (ptr as usize + len) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: the range lies inside the allocation `ptr..ptr + len` owned by the caller's
        // vector; MADV_HUGEPAGE only changes how the kernel backs it, never its contents, and
        // a failure (e.g. THP disabled) leaves ordinary pages, so the result is ignored.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_ptr: *const u8, _len: usize) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_have_the_requested_room() {
        for len in [0, 10, HUGE_PAGE_THRESHOLD + 123] {
            let mut buffer = output_buffer(len);
            assert!(buffer.capacity() >= len);
            buffer.resize(len, 7);
            let data = into_tensor_data(buffer, vec![len], DType::U8);
            assert_eq!(data.as_bytes().len(), len);
            assert!(data.as_bytes().iter().all(|b| *b == 7));
        }
    }

    #[test]
    fn empty_buffers_and_their_clones_cast_to_every_float_type() {
        for (dtype, capacity) in [(DType::F32, 0), (DType::F16, 0), (DType::F64, 1)] {
            // A receive buffer: allocated, then left empty.
            let mut buffer = zeroed_buffer(capacity);
            buffer.truncate(0);
            let data = into_tensor_data(buffer, vec![0, 3], dtype);
            for data in [data.clone(), data] {
                let values = data.convert_dtype(DType::F32).try_to_vec::<f32>().unwrap();
                assert!(values.is_empty());
            }
        }
    }
}
