//! The NCCL engine under `mpirun`: MPI only starts the job and carries rank 0's NCCL unique id
//! (created in rank 0's own process, whose bootstrap root then lives through the launch; see
//! `nccl::rendezvous`). The collectives themselves run on NCCL.

use mpi::topology::{Communicator as _, SimpleCommunicator};
use mpi::traits::*;

use crate::transport::error::{LaunchError, RankFailure};
use crate::transport::nccl::rendezvous::{IdBroadcast, MESSAGE_BYTES, share_unique_id};
use crate::transport::nccl::{NcclEngine, NcclOptions, new_unique_id};

/// Keeps MPI initialized while the NCCL ranks run; finalizes it when dropped.
pub(crate) struct MpiSession {
    _universe: mpi::environment::Universe,
}

/// `MPI_Bcast` from rank 0 on `world`.
struct WorldBroadcast<'a>(&'a SimpleCommunicator);

impl IdBroadcast for WorldBroadcast<'_> {
    fn broadcast(
        &self,
        message: Option<[u8; MESSAGE_BYTES]>,
    ) -> Result<[u8; MESSAGE_BYTES], String> {
        let mut buf = message.unwrap_or([0; MESSAGE_BYTES]);
        self.0.process_at_rank(0).broadcast_into(&mut buf[..]);
        Ok(buf)
    }
}

/// This process's rank of an MPI job as an NCCL rank: MPI gives the rank, the world size and
/// the GPU (the rank among the processes of this node), rank 0 creates the id and broadcasts
/// it, and every rank joins the NCCL world. `world_size` must be the job's size.
pub(crate) fn nccl_world(
    world_size: usize,
) -> Result<(usize, NcclEngine, MpiSession), LaunchError> {
    let failed = |rank: usize, message: String| LaunchError {
        failures: vec![RankFailure {
            rank,
            message,
            panicked: false,
        }],
    };
    let universe = mpi::initialize().ok_or_else(|| {
        failed(
            0,
            "MPI could not be initialized (or already was in this process)".into(),
        )
    })?;
    let world = universe.world();
    let (rank, size) = (world.rank() as usize, world.size() as usize);
    if size != world_size {
        return Err(failed(
            rank,
            format!(
                "the program asks for {world_size} ranks but the MPI job has {size} processes \
                 (mpirun -np {world_size})"
            ),
        ));
    }
    let local_rank = world.split_shared(world.rank()).rank() as usize;
    let id = share_unique_id(
        rank,
        || new_unique_id().map_err(|e| e.to_string()),
        &WorldBroadcast(&world),
    )
    .map_err(|e| failed(rank, e.to_string()))?;
    let engine = NcclEngine::join(rank, size, local_rank, &id, NcclOptions::from_env())
        .map_err(|e| failed(rank, e.to_string()))?;
    Ok((
        rank,
        engine,
        MpiSession {
            _universe: universe,
        },
    ))
}
