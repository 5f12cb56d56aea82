//! NCCL on the buffers of Burn's LibTorch backend, for the device path.
//!
//! `tch` gives a tensor's device address but not libtorch's current CUDA stream, so ordering
//! is done as for CubeCL: the GPU is synchronised before the collective (libtorch's kernels
//! that wrote the input are done) and the communicator's stream after it (the output is
//! complete before libtorch's next kernel reads it). The data never leaves the GPU. The rest
//! (agreement, layouts, counters) is [`super::nccl`].

// Burn 0.22 deprecates burn-tch (in favour of its CubeCL backends) but still ships it.
#![allow(deprecated)]

use burn::backend::TensorMetadata;
use burn_tch::TchTensor;
use tch::{Device, Kind, Tensor};

use super::steps::DeviceOp;
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;

use super::nccl::DeviceCall;
use crate::transport::nccl::comm::{DevicePtr, NcclError};

/// Runs `op` on `x`'s CUDA buffer over `group` and returns the result as a new tensor.
pub(crate) fn run(
    x: TchTensor,
    op: &DeviceOp,
    group: &ProcessGroup,
) -> Result<TchTensor, CollectiveError> {
    let mut call = DeviceCall::new(op, group)?;
    let dtype = x.dtype();
    let x = x.tensor.contiguous();
    let Device::Cuda(index) = x.device() else {
        return Err(call.fail()(NcclError::Unsupported(format!(
            "device collectives on {:?}: only CUDA devices run NCCL",
            x.device()
        ))));
    };
    call.check_ordinal(index)?;
    let shape: Vec<usize> = x.size().iter().map(|d| *d as usize).collect();
    let options = (x.kind(), x.device());
    if let DeviceOp::AllToAll { .. } = op {
        return all_to_all(&x, dtype, &shape, options, index, &mut call);
    }
    let plan = call.plan(&shape, dtype)?;
    let out = Tensor::empty(dims(&plan.out_shape), options);
    tch::Cuda::synchronize(index as i64);
    // SAFETY: `x` and `out` are contiguous CUDA tensors of the plan's sizes, alive until after
    // the exchange has waited for its stream.
    unsafe { call.exchange(&plan, ptr(&x), ptr(&out)) }?;
    drop(x);
    Ok(TchTensor::new(out))
}

fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|d| *d as i64).collect()
}

fn ptr(t: &Tensor) -> DevicePtr {
    t.data_ptr() as DevicePtr
}

fn elems(t: &Tensor) -> usize {
    t.numel()
}

/// all_to_all: contiguous pieces for each peer, one group of NCCL sends and receives, and the
/// received pieces concatenated.
fn all_to_all(
    x: &Tensor,
    dtype: burn::tensor::DType,
    shape: &[usize],
    options: (Kind, Device),
    index: usize,
    call: &mut DeviceCall<'_>,
) -> Result<TchTensor, CollectiveError> {
    let plan = call.plan_all_to_all(shape, dtype)?;
    let sends: Vec<Tensor> = plan
        .send
        .iter()
        .map(|(start, len)| {
            x.narrow(plan.split as i64, *start as i64, *len as i64)
                .contiguous()
        })
        .collect();
    let recvs: Vec<Tensor> = plan
        .recv_shapes
        .iter()
        .map(|s| Tensor::empty(dims(s), options))
        .collect();
    let list = |ts: &[Tensor]| -> Vec<(DevicePtr, usize)> {
        ts.iter().map(|t| (ptr(t), elems(t))).collect()
    };
    tch::Cuda::synchronize(index as i64);
    // SAFETY: every piece is a contiguous CUDA tensor alive until after the exchange has
    // waited for its stream, and each count is its element count.
    unsafe { call.exchange_all_to_all(&plan, &list(&sends), &list(&recvs)) }?;
    drop(sends);
    Ok(TchTensor::new(Tensor::cat(&recvs, plan.concat as i64)))
}
