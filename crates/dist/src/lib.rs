//! burn-parallel-dist: the device mesh, process groups, the `Communicator` trait with its
//! engines, and collectives that Burn's autodiff differentiates through.
//!
//! - [`threads::launch`] runs ranks as threads of one process; each gets a [`RankContext`].
//! - [`run_ranks`] runs the same closure as threads or, under `mpirun` (feature `mpi`), as one
//!   rank per process of an MPI job.
//! - [`DeviceMesh`] arranges ranks on named dimensions with one [`ProcessGroup`] per dimension.
//! - [`ProcessGroup`] runs collectives on `TensorData` (blocking or async).
//! - [`collectives`] runs them on Burn tensors, differentiably.

pub mod buffer;
pub mod chunk;
pub mod collective;
pub mod collectives {
    //! Differentiable collectives on Burn tensors.
    pub use crate::diff::*;
}
mod data;
mod diff;
pub mod engine;
pub mod error;
pub mod group;
pub mod launch;
pub mod memory;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
pub mod stats;
pub mod threads;

pub use collective::{
    Collective, CollectiveHandle, CollectiveOutput, Communicator, GroupInfo, OpKind,
};
pub use data::{ReduceOp, sum as sum_data};
pub use engine::{Engine, RankContext};
pub use error::{CollectiveError, LaunchError, MeshError, RankFailure};
pub use group::ProcessGroup;
pub use launch::{ENGINE_ENV, EngineKind, run_ranks, run_ranks_on};
pub use mesh::{DeviceMesh, MeshShape};
pub use stats::{CommStats, OpCounters};
pub use threads::{Launcher, launch};
