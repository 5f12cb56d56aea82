//! A roll call when a collective times out. MPI cannot say which ranks a blocked call waits
//! for, so a rank that times out tells every other rank so, over a communicator of its own, and
//! listens for a grace period: every rank blocked in a collective times out too and answers
//! alike, so the ranks it does not hear from are those that never reached one (stopped by a
//! signal, hung, or still computing). Once per process: the calls that time out after the
//! first reuse its answer.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mpi::Rank;
use mpi::point_to_point::{Destination as _, Source as _};
use mpi::topology::{Communicator as _, SimpleCommunicator};

use super::lock::lock;
use super::shared_comm::Comm;

/// The roll call's message tag (on its own communicator, so it meets no other message).
const TAG: i32 = 1;

/// How long a rank listens for the others: long enough for every rank blocked in a collective
/// to time out too (they entered their calls at about the same time), short against the
/// timeout itself.
pub(crate) fn grace(timeout: Duration) -> Duration {
    (timeout / 2).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// One process's roll call.
pub(crate) struct RollCall {
    comm: Comm,
    rank: usize,
    size: usize,
    /// The ranks heard from, once the roll call has run.
    heard: Mutex<Option<BTreeSet<usize>>>,
}

impl RollCall {
    /// The roll call of rank `rank` of `size`, on a duplicate of `world` (collective: every
    /// process creates it at the same point).
    pub fn new(world: &SimpleCommunicator, rank: usize, size: usize) -> Self {
        Self {
            comm: Comm::new(world.duplicate()),
            rank,
            size,
            heard: Mutex::new(None),
        }
    }

    /// The world ranks that answered within `grace`, this one included. The first call sends
    /// this rank's answer to every other rank (a message of 8 bytes, sent eagerly: it does not
    /// wait for the receiver) and listens; later calls return its result.
    pub fn heard(&self, grace: Duration) -> BTreeSet<usize> {
        let mut done = lock(&self.heard);
        if let Some(heard) = done.as_ref() {
            return heard.clone();
        }
        let me = self.rank as u64;
        for other in (0..self.size).filter(|r| *r != self.rank) {
            self.comm
                .process_at_rank(other as Rank)
                .send_with_tag(&me, TAG);
        }
        let mut heard = BTreeSet::from([self.rank]);
        let deadline = Instant::now() + grace;
        while heard.len() < self.size && Instant::now() < deadline {
            match self.comm.any_process().immediate_probe_with_tag(TAG) {
                Some(status) => {
                    let from = self.comm.process_at_rank(status.source_rank());
                    let (rank, _) = from.receive_with_tag::<u64>(TAG);
                    heard.insert(rank as usize);
                }
                None => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        *done = Some(heard.clone());
        heard
    }
}
