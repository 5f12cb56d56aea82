//! Collectives that run on a tensor's own device buffer: NCCL on Burn's CUDA backend, with no
//! copy through the host. The differentiable pairs are those of the host path
//! ([`super::ops`]): all_gather <-> reduce_scatter (sum), and all_reduce (sum) with an identity
//! backward (Megatron's reduce_from_group).
//!
//! Needs the `cuda` feature, a tensor on a CUDA device and a group of the nccl engine; anything
//! else is an error saying which, returned before any device work. Gradients are summed, as on
//! the host path.

use std::fmt;
use std::sync::Arc;

use burn::tensor::{Tensor, TensorData};

use crate::chunk::chunk_sizes;
use crate::collective::OpKind;
use crate::data::ReduceOp;
use crate::error::CollectiveError;
use crate::group::ProcessGroup;

use super::extension::CollectiveBackend;

type Result<T> = std::result::Result<T, CollectiveError>;

/// A collective on device buffers, as the backend extension receives it.
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceOp {
    /// Concatenation along `dim` of every rank's piece; rank `j` holds `sizes[j]` rows.
    AllGather {
        dim: usize,
        sizes: Vec<usize>,
    },
    /// Rank `i` keeps the reduction of every rank's slice `i` (of `sizes[i]` rows along `dim`).
    ReduceScatter {
        dim: usize,
        sizes: Vec<usize>,
        op: ReduceOp,
    },
    AllReduce {
        op: ReduceOp,
    },
}

impl DeviceOp {
    pub fn kind(&self) -> OpKind {
        match self {
            DeviceOp::AllGather { .. } => OpKind::AllGather,
            DeviceOp::ReduceScatter { .. } => OpKind::ReduceScatter,
            DeviceOp::AllReduce { .. } => OpKind::AllReduce,
        }
    }

    /// The op that maps the output gradient to the input gradient; `None` is the identity.
    fn adjoint(&self) -> Option<DeviceOp> {
        match self {
            DeviceOp::AllGather { dim, sizes } => Some(DeviceOp::ReduceScatter {
                dim: *dim,
                sizes: sizes.clone(),
                op: ReduceOp::Sum,
            }),
            DeviceOp::ReduceScatter { dim, sizes, .. } => Some(DeviceOp::AllGather {
                dim: *dim,
                sizes: sizes.clone(),
            }),
            DeviceOp::AllReduce { .. } => None,
        }
    }
}

/// The engine communicator a device collective runs on.
#[derive(Clone)]
pub struct DeviceComm {
    #[cfg(feature = "nccl")]
    pub(crate) nccl: Arc<crate::nccl::NcclComm>,
    #[cfg(not(feature = "nccl"))]
    _none: Arc<()>,
}

impl fmt::Debug for DeviceComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        #[cfg(feature = "nccl")]
        return write!(f, "{:?}", self.nccl);
        #[cfg(not(feature = "nccl"))]
        f.write_str("DeviceComm")
    }
}

/// One device collective with the group it runs on; the backward op rides along so that the
/// autodiff step can run it on the gradient.
#[derive(Debug, Clone)]
pub struct DeviceCollective {
    pub op: DeviceOp,
    pub group: String,
    pub(crate) comm: DeviceComm,
}

impl DeviceCollective {
    fn adjoint(&self) -> Option<DeviceCollective> {
        self.op.adjoint().map(|op| DeviceCollective {
            op,
            group: self.group.clone(),
            comm: self.comm.clone(),
        })
    }

    /// Why a backend without device collectives was handed one (the entry points rule it out).
    pub(crate) fn unsupported_here(&self) -> String {
        format!(
            "{} on group {}: this backend has no device collectives (only Burn's CUDA backend \
             with the `cuda` feature runs them)",
            self.op.kind(),
            self.group
        )
    }
}

/// Runs the differentiable device collective; the building block of the functions below.
pub(crate) fn attach_device<const D: usize>(x: Tensor<D>, op: DeviceCollective) -> Tensor<D> {
    Tensor::from_dispatch(
        <burn::backend::Dispatch as CollectiveBackend>::device_collective(x.into_dispatch(), op),
    )
}

pub(crate) fn adjoint_of(op: &DeviceCollective) -> Option<DeviceCollective> {
    op.adjoint()
}

fn invalid(op: OpKind, group: &ProcessGroup, message: String) -> CollectiveError {
    CollectiveError::InvalidArgument {
        op: format!("{op} (device)"),
        group: group.label().into(),
        message,
    }
}

/// The group's device communicator, or the reason there is none.
fn device_comm(op: OpKind, group: &ProcessGroup) -> Result<DeviceComm> {
    #[cfg(feature = "nccl")]
    {
        crate::nccl::nccl_comm(group)
            .map(|nccl| DeviceComm { nccl })
            .ok_or_else(|| {
                invalid(
                    op,
                    group,
                    "the group does not belong to the nccl engine; device collectives run on \
                     NCCL groups only (use the host collectives for other engines)"
                        .into(),
                )
            })
    }
    #[cfg(not(feature = "nccl"))]
    Err(invalid(
        op,
        group,
        "burn-parallel was built without the `cuda` feature, so there are no device collectives"
            .into(),
    ))
}

/// Whether `device` is a CUDA device of Burn's CubeCL backend (with or without autodiff).
pub fn is_cuda_device(device: &burn::tensor::Device) -> bool {
    #[cfg(feature = "cuda")]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_))
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        false
    }
}

fn check_device<const D: usize>(op: OpKind, group: &ProcessGroup, x: &Tensor<D>) -> Result<()> {
    if is_cuda_device(&x.device()) {
        Ok(())
    } else {
        Err(invalid(
            op,
            group,
            format!(
                "the tensor is on {:?}, not a CUDA device: device collectives need Burn's CUDA \
                 backend (feature `cuda`); use the host collectives on other devices",
                x.device()
            ),
        ))
    }
}

fn check_dim<const D: usize>(op: OpKind, group: &ProcessGroup, dim: usize) -> Result<()> {
    if dim < D {
        Ok(())
    } else {
        Err(invalid(
            op,
            group,
            format!("dim {dim} is out of range for a {D}-d tensor"),
        ))
    }
}

/// Every rank's size along `dim`, exchanged through the group (a few bytes).
fn exchange_sizes(group: &ProcessGroup, len: usize) -> Result<Vec<usize>> {
    let sizes = group.all_gather(TensorData::new(vec![len as i64], [1]), 0)?;
    let sizes: Vec<i64> = sizes
        .try_into_vec()
        .map_err(|e| CollectiveError::InvalidArgument {
            op: "all_gather (device sizes)".into(),
            group: group.label().into(),
            message: format!("{e:?}"),
        })?;
    Ok(sizes.into_iter().map(|s| s as usize).collect())
}

/// [`super::all_gather`] on the device: concatenation along `dim` of every rank's tensor
/// (sizes may differ); backward reduce-scatters (sums) the gradient back to the pieces.
pub fn all_gather<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    let op = OpKind::AllGather;
    check_dim::<D>(op, group, dim)?;
    check_device(op, group, &x)?;
    let comm = device_comm(op, group)?;
    let sizes = exchange_sizes(group, x.dims()[dim])?;
    let call = DeviceCollective {
        op: DeviceOp::AllGather { dim, sizes },
        group: group.label().into(),
        comm,
    };
    Ok(attach_device(x, call))
}

/// [`super::reduce_scatter`] on the device: the sum over ranks of this rank's chunk along
/// `dim` (FSDP2's pad-to-ceil chunks, [`crate::chunk`]); backward all-gathers the gradient.
pub fn reduce_scatter<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    dim: usize,
) -> Result<Tensor<D>> {
    let op = OpKind::ReduceScatter;
    check_dim::<D>(op, group, dim)?;
    check_device(op, group, &x)?;
    let comm = device_comm(op, group)?;
    let sizes = chunk_sizes(x.dims()[dim], group.size());
    let call = DeviceCollective {
        op: DeviceOp::ReduceScatter {
            dim,
            sizes,
            op: ReduceOp::Sum,
        },
        group: group.label().into(),
        comm,
    };
    Ok(attach_device(x, call))
}

/// All-reduce on the device. Differentiable for `Sum` with an identity backward (the gradient
/// of a replicated output, Megatron's reduce_from_group); other ops only on tensors that do
/// not require gradients.
pub fn all_reduce<const D: usize>(
    x: Tensor<D>,
    group: &ProcessGroup,
    reduce: ReduceOp,
) -> Result<Tensor<D>> {
    let op = OpKind::AllReduce;
    check_device(op, group, &x)?;
    if reduce != ReduceOp::Sum && x.is_require_grad() {
        return Err(invalid(
            op,
            group,
            format!("all_reduce({reduce}) has no gradient here; detach the tensor or use sum"),
        ));
    }
    let comm = device_comm(op, group)?;
    let call = DeviceCollective {
        op: DeviceOp::AllReduce { op: reduce },
        group: group.label().into(),
        comm,
    };
    Ok(attach_device(x, call))
}

/// Not supported yet on the device path: broadcast, all_to_all and send/recv of Burn tensors.
/// They exist on raw device buffers ([`crate::nccl::NcclComm`]) and on the host path.
pub fn unsupported(op: OpKind, group: &ProcessGroup) -> CollectiveError {
    invalid(
        op,
        group,
        "not supported yet on Burn tensors in device memory (use NcclComm on raw buffers, or \
         the host collective)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)]
    use burn::tensor::Device;

    use super::*;
    use crate::threads::launch;

    /// On a machine without CUDA, or with the threads engine, every entry point is a clear
    /// error before any device work.
    #[test]
    fn device_collectives_refuse_cpu_tensors_and_non_nccl_groups() {
        let errors = launch(2, |ctx| {
            let group = ctx.world()?;
            let x = Tensor::<2>::ones([2, 3], &Device::ndarray());
            let e = all_gather(x.clone(), &group, 0).unwrap_err().to_string();
            assert!(e.contains("not a CUDA device"), "{e}");
            let e = reduce_scatter(x.clone(), &group, 5)
                .unwrap_err()
                .to_string();
            assert!(e.contains("dim 5 is out of range"), "{e}");
            let tracked = Tensor::<2>::ones([2, 3], &Device::ndarray().autodiff()).require_grad();
            let e = all_reduce(tracked, &group, ReduceOp::Max)
                .unwrap_err()
                .to_string();
            assert!(e.contains("not a CUDA device"), "{e}");
            let e = device_comm(OpKind::AllGather, &group)
                .unwrap_err()
                .to_string();
            assert!(e.contains("nccl") || e.contains("cuda"), "{e}");
            Ok::<_, CollectiveError>(())
        });
        assert!(errors.is_ok(), "{errors:?}");
    }

    #[test]
    fn adjoints_pair_gather_and_scatter() {
        let g = DeviceOp::AllGather {
            dim: 1,
            sizes: vec![3, 1],
        };
        let s = g.adjoint().unwrap();
        assert_eq!(
            s,
            DeviceOp::ReduceScatter {
                dim: 1,
                sizes: vec![3, 1],
                op: ReduceOp::Sum
            }
        );
        assert_eq!(s.adjoint().unwrap(), g);
        assert_eq!(DeviceOp::AllReduce { op: ReduceOp::Sum }.adjoint(), None);
    }
}
