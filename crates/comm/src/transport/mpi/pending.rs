//! The calls this process has issued and not seen complete, on every group, and the wait for a
//! call's reply that gives up at the timeout reporting them all. MPI cannot say which ranks a
//! blocked call waits for; what each rank had pending when it gave up (like PyTorch's flight
//! recorder) shows where the ranks' orders of calls parted.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::transport::collective::CollectiveResult;
use crate::transport::error::{CollectiveError, PendingCall};

use super::lock::lock;

/// One process's pending calls, in issue order.
#[derive(Debug, Default)]
pub(crate) struct PendingCalls {
    calls: Mutex<BTreeMap<u64, PendingCall>>,
    next_id: AtomicU64,
}

/// A call's place in [`PendingCalls`]; dropping it (when the call's job ends, however it ends)
/// removes the call.
pub(crate) struct Entered {
    calls: Arc<PendingCalls>,
    id: u64,
}

impl Drop for Entered {
    fn drop(&mut self) {
        lock(&self.calls.calls).remove(&self.id);
    }
}

impl PendingCalls {
    /// Enters `call` as pending until the returned token drops.
    pub fn enter(self: &Arc<Self>, call: PendingCall) -> Entered {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        lock(&self.calls).insert(id, call);
        Entered {
            calls: self.clone(),
            id,
        }
    }

    /// Every pending call, the oldest first.
    pub fn all(&self) -> Vec<PendingCall> {
        lock(&self.calls).values().cloned().collect()
    }
}

/// Waits up to `timeout` (from `started`) for `call`'s result on `reply`. On timeout, asks
/// `absent` which of the call's ranks never reached a collective (the roll call), then prints
/// the report to stderr before returning it: when several ranks give up, the first to abort the
/// job (MPI_Abort) may end this process before its error is printed. `stopped` is the error if
/// the worker stopped without replying.
pub(crate) fn await_reply(
    reply: &mpsc::Receiver<CollectiveResult>,
    mut call: PendingCall,
    started: Instant,
    timeout: Duration,
    pending: &PendingCalls,
    stopped: impl FnOnce() -> CollectiveError,
    absent: impl FnOnce(&PendingCall) -> Vec<usize>,
) -> CollectiveResult {
    let left = timeout.saturating_sub(started.elapsed());
    match reply.recv_timeout(left) {
        Ok(result) => result,
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(stopped()),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            let rank = call.rank;
            let absent = absent(&call);
            if !absent.is_empty() {
                call.missing = Some(absent);
            }
            let error = CollectiveError::Stalled {
                call: Box::new(call),
                waited: started.elapsed(),
                pending: pending.all(),
            };
            // One write of one line: the job's processes share mpirun's stderr, and a line
            // written in pieces interleaves with the other ranks' reports.
            let line = format!("burn-parallel: rank {rank}: {error}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            Err(error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64) -> PendingCall {
        PendingCall {
            rank: 1,
            op: "all_reduce".into(),
            group: "A[0, 1]".into(),
            ranks: vec![0, 1],
            seq: Some(seq),
            missing: None,
        }
    }

    #[test]
    fn a_timeout_names_the_call_and_every_pending_one() {
        let pending = Arc::new(PendingCalls::default());
        let first = pending.enter(call(0));
        let second = pending.enter(call(1));
        let (_keep, reply) = mpsc::channel();
        let timeout = Duration::from_millis(20);
        let e = await_reply(
            &reply,
            call(1),
            Instant::now(),
            timeout,
            &pending,
            || unreachable!(),
            |_| Vec::new(),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string().split("ms: ").nth(1),
            Some(
                "rank 1 waits in all_reduce (call #1 of group A[0, 1]); calls pending on this \
                 rank: rank 1 waits in all_reduce (call #0 of group A[0, 1]); rank 1 waits in \
                 all_reduce (call #1 of group A[0, 1])"
            ),
            "{e}"
        );
        drop((first, second));
        assert!(pending.all().is_empty());
    }
}
