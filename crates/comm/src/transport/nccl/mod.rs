//! The NCCL engine: collectives on GPU buffers through cudarc's NCCL bindings (cargo feature
//! `nccl`; the CUDA libraries load at run time, so it builds without CUDA or a GPU).
//!
//! - [`comm`]: one rank's communicator and every collective on raw device buffers, ordered on
//!   CUDA streams (all_to_all as grouped send/recv).
//! - [`engine`]: the [`Engine`](crate::Engine) for a [`RankContext`](crate::RankContext): one
//!   process per GPU from the launcher's environment, or one thread per GPU; one communicator
//!   per group (mesh dimension) by `ncclCommSplit`.
//! - [`launcher`]: one process with one thread per GPU, every communicator made at once.
//! - `p2p_header`: the header ahead of each point-to-point message (what the receiver gets).
//!
//! The planning around NCCL is pure and compiled without the feature, so it is tested on every
//! machine: [`split`] (group -> `ncclCommSplit` color/key), [`unique_id`] (rank 0's id through
//! the environment), [`types`] (dtype and reduce-op mapping), [`layout`] (uneven pieces as
//! strided copies around NCCL's equal-sized collectives), [`launch_env`] (a process's rank,
//! world size and id source from the launcher's environment), [`library`] (the messages for
//! missing or too old libraries), [`agreement`] (what the ranks state and agree on before a
//! call, and its cache), [`watchdog`] (stopping calls that cannot finish; their owner aborts),
//! [`config`] (non-blocking communicators) and [`rendezvous`] (rank 0's id reaching every
//! process while rank 0's bootstrap root lives).

// Without the feature nothing calls the planning, but it still compiles so its tests run on
// every machine.
#![cfg_attr(not(feature = "nccl"), allow(dead_code))]

pub mod agreement;
pub mod config;
pub mod launch_env;
pub mod layout;
pub mod library;
// The id's broadcast over MPI is the only user of the message format.
#[cfg_attr(not(feature = "mpi"), allow(dead_code))]
pub mod rendezvous;
pub mod split;
pub mod types;
pub mod unique_id;
pub mod watchdog;

#[cfg(feature = "nccl")]
pub mod comm;
#[cfg(feature = "nccl")]
pub mod engine;
#[cfg(feature = "nccl")]
pub mod launcher;
#[cfg(feature = "nccl")]
pub(crate) mod p2p_header;
#[cfg(feature = "nccl")]
pub(crate) mod scope;

pub use agreement::{AgreementMode, CHECK_ENV};
#[cfg(feature = "nccl")]
pub use comm::{DeviceWork, NcclComm, NcclError, check_gpu, nccl_version, new_unique_id};
#[cfg(feature = "nccl")]
pub use engine::{NcclCommunicator, NcclEngine, NcclOptions, nccl_comm};
pub use launch_env::LaunchEnv;
#[cfg(feature = "nccl")]
pub use launcher::launch_local;
pub use library::{CudaLibrary, LibraryMissing};
pub use rendezvous::COMM_ID_ENV;
pub use unique_id::ID_ENV;
