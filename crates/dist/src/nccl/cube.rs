//! NCCL on the buffers of Burn's CUDA backend (CubeCL), for the `device_collective` extension.
//!
//! CubeCL hands out the raw address of a buffer (`Client::get_resource`, which also keeps the
//! allocation in place while the resource is held) but not the CUDA stream its kernels run on.
//! So ordering is done with the host: the device is synchronised before the collective (the
//! kernels that wrote the input are done), and the communicator's stream after it (the output
//! is complete before CubeCL's next kernel reads it). The data never leaves the GPU; what is
//! lost is overlap of communication with CubeCL's compute, which needs that stream.
//!
//! Before each call the ranks agree on the op, dtype and shape (a few bytes through NCCL, as
//! the engine's host path does), which also tells a gather every rank's length; a mismatch is
//! an error naming both calls instead of a hang. The bytes are counted in the group's stats.

use burn::backend::{Backend, TensorMetadata};
use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl_runtime::runtime::Runtime;
use cudarc::driver::{CudaSlice, DevicePtr as _};

use crate::chunk::offsets;
use crate::collective::OpKind;
use crate::diff::{DeviceOp, Sizes};
use crate::error::CollectiveError;
use crate::group::ProcessGroup;

use super::comm::{DevicePtr, NcclComm, NcclError};
use super::engine::nccl_communicator;
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

fn broken(group: &ProcessGroup, op: &DeviceOp) -> impl Fn(NcclError) -> CollectiveError {
    let (label, kind) = (group.label().to_string(), op.kind());
    move |e| CollectiveError::GroupBroken {
        group: label.clone(),
        reason: format!("{kind} (device) failed: {e}"),
    }
}

/// Runs `call` on `x`'s device buffer over `group` and returns the result as a new CUDA tensor.
pub(crate) fn run(
    x: CubeTensor,
    call: &DeviceOp,
    group: &ProcessGroup,
) -> Result<CubeTensor, CollectiveError> {
    let engine = nccl_communicator(group).ok_or_else(|| CollectiveError::InvalidArgument {
        op: format!("{} (device)", call.kind()),
        group: group.label().into(),
        message: "the group does not belong to the nccl engine".into(),
    })?;
    if !matches!(x.device, CubeDevice::Cuda(_)) {
        return Err(broken(group, call)(NcclError::Unsupported(format!(
            "device collectives on {:?}: only CUDA devices run NCCL",
            x.device
        ))));
    }
    let comm: &NcclComm = engine.comm();
    let x = if x.is_contiguous() {
        x
    } else {
        into_contiguous(x)
    };
    let shape: Vec<usize> = x.shape().as_slice().to_vec();
    let dtype = x.dtype;
    let eb = dtype.size();
    let t = nccl_dtype(call.kind().name(), dtype)?;
    let me = comm.rank();
    let free: &[usize] = match call {
        DeviceOp::AllGather { dim, .. } => std::slice::from_ref(dim),
        _ => &[],
    };
    if let DeviceOp::AllToAll {
        split_dim,
        concat_dim,
        send_sizes,
        received,
    } = call
    {
        let dims = (*split_dim, *concat_dim);
        return all_to_all(x, dims, send_sizes, received, group);
    }
    let shapes: Vec<Vec<usize>> = engine
        .agree_device(call.kind(), dtype, &shape, free, &[])?
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let (out_shape, out_bytes, sizes) = match call {
        DeviceOp::AllReduce { .. } => {
            let bytes = shape.iter().product::<usize>() * eb;
            (shape.clone(), bytes, Vec::new())
        }
        DeviceOp::AllGather {
            dim,
            sizes: learned,
        } => {
            let sizes: Vec<usize> = shapes.iter().map(|s| s[*dim]).collect();
            learned.set(sizes.clone());
            let mut s = shape.clone();
            s[*dim] = sizes.iter().sum();
            let bytes = s.iter().product::<usize>() * eb;
            (s, bytes, sizes)
        }
        DeviceOp::ReduceScatter { dim, sizes, .. } => {
            let sizes = sizes
                .get()
                .unwrap_or_else(|| crate::chunk::chunk_sizes(shape[*dim], comm.size()));
            if sizes.len() != comm.size() || sizes.iter().sum::<usize>() != shape[*dim] {
                return Err(CollectiveError::InvalidArgument {
                    op: format!("{} (device)", call.kind()),
                    group: group.label().into(),
                    message: format!(
                        "pieces {sizes:?} do not split {} rows over {} ranks",
                        shape[*dim],
                        comm.size()
                    ),
                });
            }
            let mut s = shape.clone();
            s[*dim] = sizes[me];
            let bytes = s.iter().product::<usize>() * eb;
            (s, bytes, sizes)
        }
        DeviceOp::AllToAll { .. } => unreachable!("handled above"),
    };
    let in_bytes = shape.iter().product::<usize>() * eb;
    let fail = broken(group, call);

    let client = x.client.clone();
    let device = x.device.clone();
    let out = client.empty(out_bytes.max(1));
    let input = client
        .get_resource::<CudaServer>(x.handle.clone())
        .map_err(|e| fail(cube_err("get_resource")(format!("{e:?}"))))?;
    let output = client
        .get_resource::<CudaServer>(out.clone())
        .map_err(|e| fail(cube_err("get_resource")(format!("{e:?}"))))?;
    let (src, dst) = (input.resource().ptr, output.resource().ptr);
    // The kernels that wrote the input (and the output's allocation) are done.
    CubeBackend::sync(&device).map_err(|e| fail(cube_err("synchronize")(format!("{e:?}"))))?;
    exchange(comm, call, &shape, eb, t, &sizes, src, dst, out_bytes).map_err(&fail)?;
    drop((input, output));
    engine.record_device(call.kind(), in_bytes, eb, out_bytes, 0);
    Ok(CubeTensor::new_contiguous(
        client,
        device,
        out_shape.into(),
        out,
        dtype,
    ))
}

/// The NCCL calls of one op, with the strided copies that uneven pieces need, then a wait for
/// the communicator's stream.
#[allow(clippy::too_many_arguments)]
fn exchange(
    comm: &NcclComm,
    call: &DeviceOp,
    shape: &[usize],
    eb: usize,
    t: super::types::NcclDataType,
    sizes: &[usize],
    src: DevicePtr,
    dst: DevicePtr,
    out_bytes: usize,
) -> Result<(), NcclError> {
    let me = comm.rank();

    // Temporaries stay alive until the stream is synchronised below.
    let mut temps: Vec<CudaSlice<u8>> = Vec::new();
    // SAFETY: the caller holds `src` and `dst` in place until this returns, and every plan
    // stays inside the buffers it names (see `layout`).
    unsafe {
        match call {
            DeviceOp::AllReduce { op } => {
                let count = out_bytes / eb;
                if count > 0 {
                    comm.all_reduce(src, dst, count, t, nccl_reduce(*op))?;
                }
            }
            DeviceOp::AllGather { dim, .. } => {
                let l = gather_layout(AlongDim::new(shape, *dim, eb), sizes, me);
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
            DeviceOp::AllToAll { .. } => unreachable!("all_to_all runs in `all_to_all`"),
            DeviceOp::ReduceScatter { dim, op, .. } => {
                let l = scatter_layout(AlongDim::new(shape, *dim, eb), sizes, me);
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
    drop(temps);
    Ok(())
}

/// The piece of `x` along `dim` from `start`, `len` long, contiguous.
fn piece(x: CubeTensor, dim: usize, start: usize, len: usize) -> CubeTensor {
    let slices: Vec<burn::tensor::Slice> = (0..x.shape().num_dims())
        .map(|d| match d == dim {
            true => burn::tensor::Slice::new(start as isize, Some((start + len) as isize), 1),
            false => burn::tensor::Slice::full(),
        })
        .collect();
    into_contiguous(slice::<CubeBackend>(x, &slices))
}

fn slice<B: Backend>(
    x: B::FloatTensorPrimitive,
    s: &[burn::tensor::Slice],
) -> B::FloatTensorPrimitive {
    B::float_slice(x, s)
}

fn cat<B: Backend>(xs: Vec<B::FloatTensorPrimitive>, dim: usize) -> B::FloatTensorPrimitive {
    B::float_cat(xs, dim)
}

/// all_to_all on device buffers: each piece for a peer is cut out contiguous, the pieces go
/// as one group of NCCL sends and receives, and the received pieces are concatenated.
fn all_to_all(
    x: CubeTensor,
    (split, concat): (usize, usize),
    send_sizes: &Sizes,
    received: &Sizes,
    group: &ProcessGroup,
) -> Result<CubeTensor, CollectiveError> {
    let op = OpKind::AllToAll;
    let invalid = |message: String| CollectiveError::InvalidArgument {
        op: format!("{op} (device)"),
        group: group.label().into(),
        message,
    };
    let engine = nccl_communicator(group)
        .ok_or_else(|| invalid("the group does not belong to the nccl engine".into()))?;
    let comm: &NcclComm = engine.comm();
    let (n, me) = (comm.size(), comm.rank());
    let shape: Vec<usize> = x.shape().as_slice().to_vec();
    let (dtype, eb) = (x.dtype, x.dtype.size());
    let t = nccl_dtype(op.name(), dtype)?;
    let send = send_sizes
        .get()
        .ok_or_else(|| invalid("the send sizes are not known".into()))?;
    if send.len() != n || send.iter().sum::<usize>() != shape[split] {
        return Err(invalid(format!(
            "send sizes {send:?} do not split {} rows over {n} ranks",
            shape[split]
        )));
    }
    let words: Vec<u64> = send.iter().map(|s| *s as u64).collect();
    let all = engine.agree_device(op, dtype, &shape, &[split, concat], &words)?;
    // The piece from rank j: its shape, with its send size for this rank along `split`.
    let recv_shapes: Vec<Vec<usize>> = all
        .iter()
        .map(|(s, w)| {
            let mut s = s.clone();
            s[split] = w[me] as usize;
            s
        })
        .collect();
    received.set(recv_shapes.iter().map(|s| s[concat]).collect());

    let (client, device) = (x.client.clone(), x.device.clone());
    let starts = offsets(&send);
    let sends: Vec<CubeTensor> = (0..n)
        .map(|j| piece(x.clone(), split, starts[j], send[j]))
        .collect();
    let elems = |s: &[usize]| s.iter().product::<usize>();
    let recvs: Vec<CubeTensor> = recv_shapes
        .iter()
        .map(|s| {
            let handle = client.empty((elems(s) * eb).max(1));
            CubeTensor::new_contiguous(
                client.clone(),
                device.clone(),
                s.clone().into(),
                handle,
                dtype,
            )
        })
        .collect();
    let fail = |e: NcclError| CollectiveError::GroupBroken {
        group: group.label().into(),
        reason: format!("{op} (device) failed: {e}"),
    };
    let resource = |t: &CubeTensor| {
        client
            .get_resource::<CudaServer>(t.handle.clone())
            .map_err(|e| fail(cube_err("get_resource")(format!("{e:?}"))))
    };
    let send_res = sends.iter().map(resource).collect::<Result<Vec<_>, _>>()?;
    let recv_res = recvs.iter().map(resource).collect::<Result<Vec<_>, _>>()?;
    // The kernels that cut the pieces are done before NCCL reads them.
    CubeBackend::sync(&device).map_err(|e| fail(cube_err("synchronize")(format!("{e:?}"))))?;
    let send_list: Vec<(DevicePtr, usize)> = send_res
        .iter()
        .zip(&sends)
        .map(|(r, t)| (r.resource().ptr, elems(t.shape().as_slice())))
        .collect();
    let recv_list: Vec<(DevicePtr, usize)> = recv_res
        .iter()
        .zip(&recv_shapes)
        .map(|(r, s)| (r.resource().ptr, elems(s)))
        .collect();
    // SAFETY: every pointer is held in place by its resource until after the stream
    // synchronises, and each count is its buffer's element count.
    unsafe { comm.all_to_all(&send_list, &recv_list, t) }.map_err(fail)?;
    comm.stream()
        .synchronize()
        .map_err(|e| fail(cube_err("cuStreamSynchronize")(format!("{e:?}"))))?;
    drop((send_res, recv_res, sends));
    let in_bytes = elems(&shape) * eb;
    let kept = send[me] * in_bytes.checked_div(shape[split]).unwrap_or(0);
    let out_bytes: usize = recv_shapes.iter().map(|s| elems(s) * eb).sum();
    engine.record_device(op, in_bytes, eb, out_bytes, kept);
    Ok(cat::<CubeBackend>(recvs, concat))
}
