//! NCCL on the buffers of Burn's CUDA backend (CubeCL), for the `device_collective` extension.
//!
//! CubeCL hands out the raw address of a buffer (`Client::get_resource`, which also keeps the
//! allocation in place while the resource is held) but not the CUDA stream its kernels run on.
//! So ordering is done with the host: the device is synchronised before the collective (the
//! kernels that wrote the input are done), and the communicator's stream after it (the output
//! is complete before CubeCL's next kernel reads it). The data never leaves the GPU; what is
//! lost is overlap of communication with CubeCL's compute, which needs that stream.

use burn::backend::{Backend, TensorMetadata};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtr as _};

use crate::diff::{DeviceCollective, DeviceOp};

use super::comm::{DevicePtr, NcclComm, NcclError};
use super::layout::{AlongDim, gather_layout, scatter_layout};
use super::types::{nccl_dtype, nccl_reduce};

type CudaServer = <CudaRuntime as Runtime>::Server;

fn cube_err(what: &'static str) -> impl Fn(String) -> NcclError {
    move |e| NcclError::Cuda {
        call: what,
        message: e,
    }
}

fn temp(comm: &NcclComm, len: usize) -> Result<CudaSlice<u8>, NcclError> {
    comm.stream()
        .alloc_zeros::<u8>(len.max(1))
        .map_err(|e| cube_err("cuMemAlloc")(format!("{e:?}")))
}

fn ptr(comm: &NcclComm, buf: &CudaSlice<u8>) -> DevicePtr {
    buf.device_ptr(comm.stream()).0
}

/// Runs `call` on `x`'s device buffer and returns the result as a new CUDA tensor.
pub(crate) fn run(x: CubeTensor, call: &DeviceCollective) -> Result<CubeTensor, NcclError> {
    let comm = &call.comm.nccl;
    if !matches!(x.device, CubeDevice::Cuda(_)) {
        return Err(NcclError::Unsupported(format!(
            "device collectives on {:?}: only CUDA devices run NCCL",
            x.device
        )));
    }
    let x = if x.is_contiguous() {
        x
    } else {
        into_contiguous(x)
    };
    let shape: Vec<usize> = x.shape().as_slice().to_vec();
    let dtype = x.dtype;
    let eb = dtype.size();
    let t = nccl_dtype(call.op.kind().name(), dtype)
        .map_err(|e| NcclError::InvalidArgument(e.to_string()))?;
    let me = comm.rank();
    let (out_shape, out_bytes) = match &call.op {
        DeviceOp::AllReduce { .. } => (shape.clone(), shape.iter().product::<usize>() * eb),
        DeviceOp::AllGather { dim, sizes } | DeviceOp::ReduceScatter { dim, sizes, .. } => {
            if sizes.len() != comm.size() {
                return Err(NcclError::InvalidArgument(format!(
                    "{} sizes, but the group has {} ranks",
                    sizes.len(),
                    comm.size()
                )));
            }
            let mut s = shape.clone();
            s[*dim] = match call.op {
                DeviceOp::AllGather { .. } => sizes.iter().sum(),
                _ => sizes[me],
            };
            let bytes = s.iter().product::<usize>() * eb;
            (s, bytes)
        }
    };

    let client = x.client.clone();
    let device = x.device.clone();
    let out = client.empty(out_bytes.max(1));
    let input = client
        .get_resource::<CudaServer>(x.handle.clone())
        .map_err(|e| cube_err("get_resource")(format!("{e:?}")))?;
    let output = client
        .get_resource::<CudaServer>(out.clone())
        .map_err(|e| cube_err("get_resource")(format!("{e:?}")))?;
    let (src, dst) = (input.resource().ptr, output.resource().ptr);
    // The kernels that wrote the input (and the output's allocation) are done.
    CubeBackend::sync(&device).map_err(|e| cube_err("synchronize")(format!("{e:?}")))?;

    // Temporaries stay alive until the stream is synchronised below.
    let mut temps: Vec<CudaSlice<u8>> = Vec::new();
    // SAFETY: `src` and `dst` are held in place by `input`/`output` until the end of this
    // function, and every plan stays inside the buffers it names (see `layout`).
    unsafe {
        match &call.op {
            DeviceOp::AllReduce { op } => {
                let count = out_bytes / eb;
                if count > 0 {
                    comm.all_reduce(src, dst, count, t, nccl_reduce(*op))?;
                }
            }
            DeviceOp::AllGather { dim, sizes } => {
                let l = gather_layout(AlongDim::new(&shape, *dim, eb), sizes, me);
                let send = match l.pack {
                    Some(c) => {
                        temps.push(temp(comm, l.piece_bytes)?);
                        let p = ptr(comm, temps.last().expect("pushed"));
                        comm.copy_2d(src, p, c)?;
                        p
                    }
                    None => src,
                };
                let gathered = match &l.unpack {
                    Some(_) => {
                        temps.push(temp(comm, l.piece_bytes * sizes.len())?);
                        ptr(comm, temps.last().expect("pushed"))
                    }
                    None => dst,
                };
                if l.piece_bytes > 0 {
                    comm.all_gather(send, gathered, l.piece_bytes / eb, t)?;
                }
                for c in l.unpack.iter().flatten() {
                    comm.copy_2d(gathered, dst, *c)?;
                }
            }
            DeviceOp::ReduceScatter { dim, sizes, op } => {
                let l = scatter_layout(AlongDim::new(&shape, *dim, eb), sizes, me);
                let send = match &l.pack {
                    Some(copies) => {
                        temps.push(temp(comm, l.piece_bytes * sizes.len())?);
                        let p = ptr(comm, temps.last().expect("pushed"));
                        for c in copies {
                            comm.copy_2d(src, p, *c)?;
                        }
                        p
                    }
                    None => src,
                };
                let recv = match l.unpack {
                    Some(_) => {
                        temps.push(temp(comm, l.piece_bytes)?);
                        ptr(comm, temps.last().expect("pushed"))
                    }
                    None => dst,
                };
                if l.piece_bytes > 0 {
                    comm.reduce_scatter(send, recv, l.piece_bytes / eb, t, nccl_reduce(*op))?;
                }
                if let Some(c) = l.unpack {
                    comm.copy_2d(recv, dst, c)?;
                }
            }
        }
    }
    // The output is complete before CubeCL runs anything that reads it.
    comm.stream()
        .synchronize()
        .map_err(|e| cube_err("cuStreamSynchronize")(format!("{e:?}")))?;
    drop((input, output, temps));
    Ok(CubeTensor::new_contiguous(
        client,
        device,
        out_shape.into(),
        out,
        dtype,
    ))
}
