//! NCCL on the buffers of Burn's CUDA backend (CubeCL), for the device path.
//!
//! CubeCL hands out the raw address of a buffer (`Client::get_resource`, which also keeps the
//! allocation in place while the resource is held) but not the CUDA stream its kernels run on.
//! So ordering is done with the host: the device is synchronised before the collective (the
//! kernels that wrote the input are done), and the communicator's stream after it (the output
//! is complete before CubeCL's next kernel reads it). The data never leaves the GPU; what is
//! lost is overlap of communication with CubeCL's compute, which needs that stream. The rest
//! (agreement, layouts, counters) is [`super::nccl`].

use burn::backend::{Backend, TensorMetadata};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl_runtime::runtime::Runtime;

use super::steps::DeviceOp;
use crate::transport::error::CollectiveError;
use crate::transport::group::ProcessGroup;

use super::nccl::{DeviceCall, cuda_err};
use crate::transport::nccl::comm::{DevicePtr, NcclError};

type CudaServer = <CudaRuntime as Runtime>::Server;

/// Runs `op` on `x`'s device buffer over `group` and returns the result as a new CUDA tensor.
pub(crate) fn run(
    x: CubeTensor,
    op: &DeviceOp,
    group: &ProcessGroup,
) -> Result<CubeTensor, CollectiveError> {
    let mut call = DeviceCall::new(op, group)?;
    let CubeDevice::Cuda(cuda) = &x.device else {
        return Err(call.fail()(NcclError::Unsupported(format!(
            "device collectives on {:?}: only CUDA devices run NCCL",
            x.device
        ))));
    };
    call.check_ordinal(cuda.index)?;
    // Always through `into_contiguous`: a tiled buffer passes `is_contiguous` (its strides
    // order tiles, not rows) and would be exchanged in tile order; `into_contiguous` untiles
    // it, and returns a row-major tensor as it is.
    let x = into_contiguous(x);
    if let DeviceOp::AllToAll { .. } = op {
        return all_to_all(x, &mut call);
    }
    let shape: Vec<usize> = x.shape().as_slice().to_vec();
    let plan = call.plan(&shape, x.dtype)?;
    let (client, device) = (x.client.clone(), x.device.clone());
    let out = client.empty(plan.out_bytes().max(1));
    let input = resource(&call, &x)?;
    let output = client
        .get_resource::<CudaServer>(out.clone())
        .map_err(|e| call.fail()(cuda_err("get_resource")(format!("{e:?}"))))?;
    sync(&call, &device)?;
    // SAFETY: `input` and `output` hold both buffers in place until they drop, after the
    // exchange has waited for its stream; their sizes are the plan's.
    unsafe { call.exchange(&plan, ptr(&input), ptr(&output)) }?;
    drop((input, output));
    Ok(CubeTensor::new_contiguous(
        client,
        device,
        plan.out_shape.into(),
        out,
        plan.dtype,
    ))
}

type Resource = cubecl_runtime::storage::ManagedResource<
    <<CudaServer as cubecl_runtime::server::ServerStorage>::Storage as cubecl_runtime::storage::ComputeStorage>::Resource,
>;

fn resource(call: &DeviceCall<'_>, x: &CubeTensor) -> Result<Resource, CollectiveError> {
    x.client
        .get_resource::<CudaServer>(x.handle.clone())
        .map_err(|e| call.fail()(cuda_err("get_resource")(format!("{e:?}"))))
}

fn ptr(r: &Resource) -> DevicePtr {
    r.resource().ptr
}

/// Waits for CubeCL's kernels on `device`: the inputs are written before NCCL reads them.
fn sync(call: &DeviceCall<'_>, device: &CubeDevice) -> Result<(), CollectiveError> {
    CubeBackend::sync(device).map_err(|e| call.fail()(cuda_err("synchronize")(format!("{e:?}"))))
}

/// The piece of `x` along `dim` from `start`, `len` long, contiguous.
fn piece(x: CubeTensor, dim: usize, (start, len): (usize, usize)) -> CubeTensor {
    into_contiguous(super::steps::piece::<CubeBackend>(x, dim, start, len))
}

fn cat<B: Backend>(xs: Vec<B::FloatTensorPrimitive>, dim: usize) -> B::FloatTensorPrimitive {
    B::float_cat(xs, dim)
}

/// all_to_all: each piece for a peer is cut out contiguous, the pieces go as one group of
/// NCCL sends and receives, and the received pieces are concatenated.
fn all_to_all(x: CubeTensor, call: &mut DeviceCall<'_>) -> Result<CubeTensor, CollectiveError> {
    let shape: Vec<usize> = x.shape().as_slice().to_vec();
    let plan = call.plan_all_to_all(&shape, x.dtype)?;
    let (client, device, dtype) = (x.client.clone(), x.device.clone(), x.dtype);
    let sends: Vec<CubeTensor> = plan
        .send
        .iter()
        .map(|range| piece(x.clone(), plan.split, *range))
        .collect();
    let elems = |s: &[usize]| s.iter().product::<usize>();
    let recvs: Vec<CubeTensor> = plan
        .recv_shapes
        .iter()
        .map(|s| {
            let handle = client.empty((elems(s) * dtype.size()).max(1));
            CubeTensor::new_contiguous(
                client.clone(),
                device.clone(),
                s.clone().into(),
                handle,
                dtype,
            )
        })
        .collect();
    let send_res = sends
        .iter()
        .map(|t| resource(call, t))
        .collect::<Result<Vec<_>, _>>()?;
    let recv_res = recvs
        .iter()
        .map(|t| resource(call, t))
        .collect::<Result<Vec<_>, _>>()?;
    let list = |res: &[Resource], counts: Vec<usize>| -> Vec<(DevicePtr, usize)> {
        res.iter().map(ptr).zip(counts).collect()
    };
    let send_list = list(
        &send_res,
        sends.iter().map(|t| t.shape().num_elements()).collect(),
    );
    let recv_list = list(
        &recv_res,
        plan.recv_shapes.iter().map(|s| elems(s)).collect(),
    );
    sync(call, &device)?;
    // SAFETY: every buffer is held in place by its resource until after the exchange has
    // waited for its stream, and each count is its buffer's element count.
    unsafe { call.exchange_all_to_all(&plan, &send_list, &recv_list) }?;
    drop((send_res, recv_res, sends));
    Ok(cat::<CubeBackend>(recvs, plan.concat))
}
