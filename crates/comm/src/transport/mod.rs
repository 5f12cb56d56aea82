//! The transport layer: who the ranks are and how bytes move between them. The device mesh,
//! process groups, the [`Communicator`](collective::Communicator) trait and its engines
//! (threads; MPI and NCCL behind features), the launchers and the counters. It knows
//! `TensorData` but no backend: nothing here imports the device or autodiff layers.

pub mod buffer;
pub mod chunk;
pub mod collective;
pub mod compute_threads;
pub(crate) mod data;
pub mod engine;
pub mod error;
pub mod group;
pub mod launch;
pub mod memory;
pub mod mesh;
#[cfg(feature = "mpi")]
pub mod mpi;
pub mod nccl;
pub(crate) mod rank_threads;
pub mod stats;
pub mod threads;
pub mod timeout;
pub(crate) mod traffic;
