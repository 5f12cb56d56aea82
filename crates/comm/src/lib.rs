//! burn-parallel-comm: how ranks talk. Three layers inside, each importing only the ones below
//! it:
//!
//! 1. transport: the device mesh, process groups, the [`Communicator`] trait and its engines
//!    (threads; MPI and NCCL behind features), launchers and counters, on host `TensorData`.
//! 2. device: every collective as a list of steps on a backend tensor, whose innermost
//!    exchange is the group's engine (CPU backends) or NCCL on the tensor's CUDA buffer; the
//!    buffer adapters for Burn's CUDA and LibTorch backends.
//! 3. autodiff: the backend extension that makes step lists Burn autodiff ops.
//!
//! Beside them, with no import from them, [`linear`]: the linear layer as one autodiff node
//! whose products are backend kernels (the autodiff layer's resharded linear uses them), so
//! every crate's linear layers share one path and flex's bf16 kernel.
//!
//! The public API sits at the root: the mesh and groups ([`DeviceMesh`], [`ProcessGroup`]),
//! launching ([`launch`], [`run_ranks`], [`EngineKind`]), the host collectives
//! ([`Communicator`], [`Collective`]), the differentiable ones on Burn tensors
//! ([`collectives`]), the engines' own modules ([`nccl`], and `mpi` with its feature), the
//! counters and the errors. [`buffer`], [`chunk`] and [`memory`] are small helpers other crates
//! and the benchmarks share.

#![warn(missing_docs)]

mod autodiff;
pub mod checkpoint;
pub mod compile;
mod device;
pub mod linear;
mod transport;

pub use transport::{buffer, chunk, memory};

/// Differentiable collectives on Burn tensors, and the step lists strategies build their own
/// from (FSDP's parameter gather).
pub mod collectives {
    // What the other crates and users call, listed so that the surface is explicit (a new op
    // in the autodiff layer is public only once named here).
    pub use crate::autodiff::{
        GatherOptions, Started, WeightRebuild, all_gather, all_gather_recompute, all_gather_with,
        all_reduce, all_to_all, check_gather_dim, copy_to_group, decode_weight, gather_from_group,
        order_after, place_flat, prefetch_on_backward, reduce_from_group, reduce_scatter,
        resharded_linear, scatter_to_group, split_segments, split_views, start_all_gather,
        start_ring_shift,
    };
    pub use crate::device::pairs::MixedDtypes;
    pub use crate::device::{
        CodedWeight, Deferral, DeviceCollective, DeviceOp, DevicePending, DeviceStep, Exchange,
        INDICES_PER_VALUE, Observer, Prefetch, RebuildSteps, Sizes, describe, device_mismatch,
        is_cuda_device, route, same_device,
    };
}

/// The NCCL engine (cargo feature `nccl`): one rank per GPU, collectives on device buffers.
/// Without the feature only the names remain (the launch environment's variables, the error
/// types and the dtype and reduce-op mappings), so a program can still describe what is missing.
pub mod nccl {
    #[cfg(feature = "nccl")]
    pub use crate::transport::nccl::library::check_libraries;
    pub use crate::transport::nccl::types::{NcclDataType, NcclRedOp, avg_tolerance};
    pub use crate::transport::nccl::{
        AgreementMode, CHECK_ENV, COMM_ID_ENV, CudaLibrary, ID_ENV, LaunchEnv, LibraryMissing,
    };
    #[cfg(feature = "nccl")]
    pub use crate::transport::nccl::{
        DeviceWork, NcclComm, NcclCommunicator, NcclEngine, NcclError, NcclOptions, check_gpu,
        launch_local, nccl_comm, nccl_version, new_unique_id,
    };
}

/// The MPI engine (cargo feature `mpi`): one rank per process of an `mpirun` job.
#[cfg(feature = "mpi")]
pub mod mpi {
    pub use crate::transport::mpi::{ABORT_EXIT_CODE, run};
}

pub use transport::collective::{
    Collective, CollectiveHandle, CollectiveOutput, Communicator, GroupInfo, OpKind,
};
pub use transport::compute_threads::{THREADS_PER_RANK_ENV, threads_per_rank};
pub use transport::data::{ReduceOp, sum as sum_data};
pub use transport::engine::{Engine, RankContext};
pub use transport::error::{CollectiveError, LaunchError, MeshError, PendingCall, RankFailure};
pub use transport::group::ProcessGroup;
pub use transport::launch::{
    ENGINE_ENV, EngineKind, Ranks, UnknownEngine, run_ranks, started_by_mpi_launcher,
};
pub use transport::mesh::{DeviceMesh, MeshShape};
pub use transport::stats::{CommStats, OpCounters};
pub use transport::threads::{DEFAULT_TIMEOUT, Launcher, TIMEOUT_ENV, launch};
/// The collective timeout every engine uses: `TIMEOUT_ENV` seconds, else `DEFAULT_TIMEOUT`.
pub use transport::timeout::from_env as collective_timeout;
