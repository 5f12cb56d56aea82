//! burn-parallel-comm: how ranks talk. Three layers, each importing only the ones below it:
//!
//! 1. [`transport`]: the device mesh, process groups, the `Communicator` trait and its engines
//!    (threads; MPI and NCCL behind features), launchers and counters, on host `TensorData`.
//! 2. [`device`]: every collective as a list of steps on a backend tensor, whose innermost
//!    exchange is the group's engine (CPU backends) or NCCL on the tensor's CUDA buffer; the
//!    buffer adapters for Burn's CUDA and LibTorch backends.
//! 3. [`autodiff`]: the backend extension that makes step lists Burn autodiff ops, and the
//!    differentiable collectives ([`collectives`]).
//!
//! Entry points: [`threads::launch`] runs ranks as threads of one process; [`run_ranks`] runs
//! the same closure as threads or, under `mpirun` (feature `mpi`), one rank per process.
//! [`DeviceMesh`] arranges ranks on named dimensions with one [`ProcessGroup`] per dimension.

#![warn(missing_docs)]

pub mod autodiff;
pub mod device;
pub mod transport;

#[cfg(feature = "mpi")]
pub use transport::mpi;
pub use transport::{
    buffer, chunk, collective, engine, error, group, launch, memory, mesh, nccl, stats, threads,
};

/// Differentiable collectives on Burn tensors, and the step lists strategies build their own
/// from (FSDP's parameter gather).
pub mod collectives {
    pub use crate::autodiff::*;
    pub use crate::device::pairs::MixedDtypes;
    pub use crate::device::{
        Deferral, DeviceCollective, DeviceOp, DevicePending, DeviceStep, Exchange, Observer, Sizes,
        device_mismatch, is_cuda_device, route, same_device,
    };
}

pub use collective::{
    Collective, CollectiveHandle, CollectiveOutput, Communicator, GroupInfo, OpKind,
};
pub use engine::{Engine, RankContext};
pub use error::{CollectiveError, LaunchError, MeshError, PendingCall, RankFailure};
pub use group::ProcessGroup;
pub use launch::{ENGINE_ENV, EngineKind, run_ranks, run_ranks_on};
pub use mesh::{DeviceMesh, MeshShape};
pub use stats::{CommStats, OpCounters};
pub use threads::{Launcher, launch};
pub use transport::data::{ReduceOp, sum as sum_data};
