//! The NCCL step as a boundary of Burn's fusion stream (features `cuda` + `fusion`, where a
//! CubeCL tensor is a lazy `Fusion<CubeBackend>` one). NCCL needs the buffer, so the stream is
//! drained up to the input (`resolve_tensor_float`: every pending kernel that writes it runs),
//! the step runs on the inner CubeCL tensor, and its result enters the stream again as a new
//! tensor, as Burn's own `float_from_data` enters one.

use burn::backend::TensorMetadata;
use burn::backend::fusion::NoOp;
use burn::backend::fusion::custom::{OperationIr, OperationOutput, StreamId};
use burn::backend::ir::{BackendIr, InitOperationIr};
use burn::backend::tensor::FloatTensor;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{Cube, CubeBackend};

use crate::transport::error::CollectiveError;

/// Runs `step` on the inner CubeCL tensor of `x` and hands its result back to the fusion
/// stream.
pub(crate) fn on_inner(
    x: FloatTensor<Cube>,
    step: impl FnOnce(CubeTensor) -> Result<CubeTensor, CollectiveError>,
) -> Result<FloatTensor<Cube>, CollectiveError> {
    let client = x.client.clone();
    let out = step(client.resolve_tensor_float::<CubeBackend>(x))?;
    let (shape, dtype) = (out.shape(), out.dtype);
    let handle = <CubeBackend as BackendIr>::float_tensor_handle(out);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    Ok(client
        .register(
            StreamId::current(),
            OperationIr::Init(init),
            NoOp::<CubeBackend>::new(),
        )
        .output())
}
