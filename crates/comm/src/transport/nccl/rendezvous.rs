//! How every process of a launch gets rank 0's NCCL unique id, with rank 0's bootstrap root
//! alive while the others join.
//!
//! `ncclGetUniqueId` starts the bootstrap root's listener thread in the calling process
//! (NCCL's `bootstrapCreateRoot`), and every rank's `ncclCommInitRank` connects to it. So the id
//! must be created by rank 0 in the process that then joins the communicator and lives through
//! the launch: a short-lived helper process that prints an id leaves every rank waiting for a
//! root that is gone. The ways that keep the root alive:
//!
//! - [`IdSource::Broadcast`]: rank 0 creates the id and broadcasts it (MPI under `mpirun`, see
//!   [`share_unique_id`]): the message carries rank 0's failure instead when it has no id, so
//!   the others fail with its reason instead of waiting;
//! - [`IdSource::CommIdEnv`]: every process is given `NCCL_COMM_ID=host:port` (rank 0's
//!   address): each rank's `ncclGetUniqueId` then only encodes that address, and rank 0's
//!   `ncclCommInitRank` starts the root itself. Works with any launcher (`torchrun`-style
//!   `RANK`/`WORLD_SIZE`, `srun`, `mpirun` without the `mpi` feature);
//! - [`IdSource::Given`]: `BURN_PARALLEL_NCCL_ID`, for a launcher that itself keeps rank 0's
//!   root alive (a program that creates the id, keeps running and starts the ranks).
//!
//! Within one process (`launch_local`) there is nothing to hand over: one process creates the
//! id and every rank's communicator at once.
//!
//! Pure: the tests drive [`share_unique_id`] with a fake broadcast between threads.

use super::unique_id::{ID_BYTES, ID_ENV, IdError, UniqueIdBytes, decode};

/// NCCL's own variable for a fixed bootstrap address (`host:port` of rank 0).
pub const COMM_ID_ENV: &str = "NCCL_COMM_ID";

/// Where this process gets the unique id of its launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdSource {
    /// `BURN_PARALLEL_NCCL_ID`: a launcher that keeps rank 0's root alive passed it.
    Given(UniqueIdBytes),
    /// `NCCL_COMM_ID` is set: every rank calls `ncclGetUniqueId`, which encodes that address;
    /// rank 0's init starts the root.
    CommIdEnv(String),
    /// Rank 0 creates the id and broadcasts it to the others (MPI).
    Broadcast,
}

/// The id source for a process started with `RANK`/`WORLD_SIZE` by a launcher (`get` reads the
/// environment). `mpi_available`: whether this build can broadcast it over MPI, which needs
/// an MPI launcher.
pub fn id_source(
    get: impl Fn(&str) -> Option<String>,
    mpi_available: bool,
) -> Result<IdSource, IdError> {
    if let Some(hex) = get(ID_ENV) {
        return decode(&hex, ID_ENV).map(IdSource::Given);
    }
    if let Some(addr) = get(COMM_ID_ENV).filter(|a| !a.trim().is_empty()) {
        return Ok(IdSource::CommIdEnv(addr));
    }
    if mpi_available {
        return Ok(IdSource::Broadcast);
    }
    Err(IdError::Missing {
        var: format!("{COMM_ID_ENV} (or {ID_ENV})"),
    })
}

/// Bytes of the message rank 0 broadcasts: a status byte, the id, the length of a failure
/// message and the message (cut to fit). Every rank posts the same length, as MPI needs.
pub const MESSAGE_BYTES: usize = 512;
const TEXT_AT: usize = 1 + ID_BYTES + 2;

/// What rank 0 broadcasts: its id, or why it has none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdMessage {
    /// The id rank 0 created (its root listens in rank 0's process).
    Id(UniqueIdBytes),
    /// Rank 0 could not create an id (no NCCL, no network interface, ...).
    Failed(String),
}

impl IdMessage {
    /// The fixed-size message.
    pub fn encode(&self) -> [u8; MESSAGE_BYTES] {
        let mut out = [0u8; MESSAGE_BYTES];
        match self {
            IdMessage::Id(id) => {
                out[0] = 1;
                out[1..1 + ID_BYTES].copy_from_slice(&id.0);
            }
            IdMessage::Failed(text) => {
                let mut n = text.len().min(MESSAGE_BYTES - TEXT_AT);
                while !text.is_char_boundary(n) {
                    n -= 1;
                }
                out[1 + ID_BYTES..TEXT_AT].copy_from_slice(&(n as u16).to_le_bytes());
                out[TEXT_AT..TEXT_AT + n].copy_from_slice(&text.as_bytes()[..n]);
            }
        }
        out
    }

    /// The message from [`IdMessage::encode`]'s bytes.
    pub fn decode(bytes: &[u8; MESSAGE_BYTES]) -> Self {
        if bytes[0] == 1 {
            let mut id = [0u8; ID_BYTES];
            id.copy_from_slice(&bytes[1..1 + ID_BYTES]);
            return IdMessage::Id(UniqueIdBytes(id));
        }
        let n = u16::from_le_bytes([bytes[1 + ID_BYTES], bytes[2 + ID_BYTES]]) as usize;
        let end = (TEXT_AT + n).min(MESSAGE_BYTES);
        IdMessage::Failed(String::from_utf8_lossy(&bytes[TEXT_AT..end]).into_owned())
    }
}

/// A broadcast from rank 0 of one fixed-size message (MPI's `MPI_Bcast`, or a fake).
pub trait IdBroadcast {
    /// Rank 0 passes its message and gets it back; the others pass `None` and get rank 0's.
    fn broadcast(
        &self,
        message: Option<[u8; MESSAGE_BYTES]>,
    ) -> Result<[u8; MESSAGE_BYTES], String>;
}

/// Rank 0 creates the id (`create`, `ncclGetUniqueId` in this, the long-lived process that joins
/// the communicator next) and broadcasts it; the others receive it. A failure on rank 0 reaches
/// every rank as an error naming it, so nobody waits for an id that never comes.
pub fn share_unique_id(
    rank: usize,
    create: impl FnOnce() -> Result<UniqueIdBytes, String>,
    channel: &dyn IdBroadcast,
) -> Result<UniqueIdBytes, IdError> {
    let failed = |reason: String| IdError::Rendezvous { reason };
    let mine = (rank == 0).then(|| match create() {
        Ok(id) => IdMessage::Id(id),
        Err(e) => IdMessage::Failed(e),
    });
    let bytes = channel
        .broadcast(mine.as_ref().map(IdMessage::encode))
        .map_err(|e| {
            failed(format!(
                "the broadcast of rank 0's NCCL unique id failed: {e}"
            ))
        })?;
    match IdMessage::decode(&bytes) {
        IdMessage::Id(id) => Ok(id),
        IdMessage::Failed(e) => Err(failed(format!(
            "rank 0 could not create the NCCL unique id: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Condvar, Mutex};
    use std::thread::ThreadId;

    use super::*;

    /// A broadcast between threads that stand for processes: rank 0 posts, the others wait.
    #[derive(Default)]
    struct FakeBroadcast {
        slot: Mutex<Option<[u8; MESSAGE_BYTES]>>,
        posted: Condvar,
    }

    impl IdBroadcast for FakeBroadcast {
        fn broadcast(
            &self,
            message: Option<[u8; MESSAGE_BYTES]>,
        ) -> Result<[u8; MESSAGE_BYTES], String> {
            let mut slot = self.slot.lock().unwrap();
            if let Some(m) = message {
                *slot = Some(m);
                self.posted.notify_all();
                return Ok(m);
            }
            let (slot, timeout) = self
                .posted
                .wait_timeout_while(slot, std::time::Duration::from_secs(20), |s| s.is_none())
                .unwrap();
            if timeout.timed_out() {
                return Err("nothing was broadcast".into());
            }
            Ok(slot.expect("posted"))
        }
    }

    /// Runs `world` ranks as threads standing for processes; returns each one's thread and id.
    fn run(
        world: usize,
        create: impl Fn() -> Result<UniqueIdBytes, String> + Sync,
    ) -> Vec<(ThreadId, Result<UniqueIdBytes, IdError>)> {
        let channel = FakeBroadcast::default();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|rank| {
                    let (channel, create) = (&channel, &create);
                    s.spawn(move || {
                        (
                            std::thread::current().id(),
                            share_unique_id(rank, create, channel),
                        )
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn rank_0_creates_the_id_in_its_own_process_and_every_rank_gets_it() {
        let created: Mutex<Vec<ThreadId>> = Mutex::default();
        let results = run(4, || {
            created.lock().unwrap().push(std::thread::current().id());
            let mut id = [7u8; ID_BYTES];
            id[0] = 42;
            Ok(UniqueIdBytes(id))
        });
        // Created once, by rank 0's thread: the process that joins next, root alive.
        assert_eq!(*created.lock().unwrap(), vec![results[0].0]);
        let ids: HashMap<_, _> = results
            .iter()
            .map(|(_, r)| (r.as_ref().unwrap().0, ()))
            .collect();
        assert_eq!(ids.len(), 1);
        assert_eq!(results[3].1.as_ref().unwrap().0[0], 42);
    }

    #[test]
    fn rank_0s_failure_reaches_every_rank_instead_of_a_hang() {
        let results = run(3, || Err("the NCCL engine needs NCCL (libnccl.so)".into()));
        for (_, r) in results {
            let e = r.unwrap_err().to_string();
            assert!(
                e.contains("rank 0 could not create the NCCL unique id")
                    && e.contains("libnccl.so"),
                "{e}"
            );
        }
    }

    #[test]
    fn messages_round_trip_and_long_reasons_are_cut_on_a_char_boundary() {
        let id = UniqueIdBytes([3; ID_BYTES]);
        assert_eq!(
            IdMessage::decode(&IdMessage::Id(id).encode()),
            IdMessage::Id(id)
        );
        let long = "é".repeat(400);
        let IdMessage::Failed(back) = IdMessage::decode(&IdMessage::Failed(long).encode()) else {
            panic!("a failure")
        };
        assert!(!back.is_empty() && back.chars().all(|c| c == 'é'));
    }

    #[test]
    fn the_source_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let hex = "ab".repeat(ID_BYTES);
        let given = id_source(|k| (k == ID_ENV).then(|| hex.clone()), false).unwrap();
        assert_eq!(given, IdSource::Given(UniqueIdBytes([0xab; ID_BYTES])));
        assert_eq!(
            id_source(env(&[(COMM_ID_ENV, "10.0.0.1:29500")]), true).unwrap(),
            IdSource::CommIdEnv("10.0.0.1:29500".into())
        );
        assert_eq!(id_source(env(&[]), true).unwrap(), IdSource::Broadcast);
        let e = id_source(env(&[]), false).unwrap_err().to_string();
        assert!(
            e.starts_with("NCCL_COMM_ID (or BURN_PARALLEL_NCCL_ID) is not set"),
            "{e}"
        );
    }
}
