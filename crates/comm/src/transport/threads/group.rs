//! The rendezvous of one group: numbered slots where each member deposits its call, waits for
//! the others, reads their inputs (shared memory, no copy until the output is built) and
//! releases the slot; plus mailboxes for point-to-point messages.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use crate::transport::collective::{Collective, GroupInfo, OpKind, mismatch};
use crate::transport::error::CollectiveError;

use super::state::{GroupShared, GroupState, Slot, lock};
use super::waits::Blocked;
use super::world::World;

/// How often a waiting rank re-checks for failed or exited peers and for a deadlock.
const POLL: Duration = Duration::from_millis(10);

/// The inputs of a slot once every member has deposited.
pub(crate) type Deposits = Vec<Arc<Collective>>;

/// A member's position in one group, with what it needs to report errors.
pub(crate) struct Member<'a> {
    pub world: &'a World,
    pub group: &'a GroupShared,
    pub info: &'a GroupInfo,
    /// Whether this member's waits block its rank's issuing thread (a synchronous call), so
    /// that the rank cannot issue anything else meanwhile: only such waits enter the deadlock
    /// detector (see [`super::waits`]); a background wait (`start`) does not.
    pub blocking: bool,
}

impl Member<'_> {
    fn n(&self) -> usize {
        self.info.size()
    }

    fn global(&self, members: impl IntoIterator<Item = usize>) -> Vec<usize> {
        members.into_iter().map(|i| self.info.ranks[i]).collect()
    }

    /// Takes the next place in the group's sequence and deposits the call there.
    pub fn deposit(&self, call: Collective) -> Result<u64, CollectiveError> {
        let me = self.info.index;
        let signature = call.signature();
        let seq = self.group.next_seq[me].fetch_add(1, Ordering::SeqCst);
        let mut state = lock(&self.group.state);
        if let Some(reason) = &state.broken {
            return Err(CollectiveError::GroupBroken {
                group: self.info.label.clone(),
                reason: reason.clone(),
            });
        }
        let n = self.n();
        let slot = state.slots.entry(seq).or_insert_with(|| Slot::new(n));
        if let Some(e) = &slot.error {
            return Err(e.clone());
        }
        match &slot.first {
            Some((rank, first)) if !first.compatible(&signature) => {
                let error = mismatch(self.info, seq, (*rank, first), (me, &signature));
                slot.error = Some(error.clone());
                state.broken = Some(error.to_string());
                self.group.cv.notify_all();
                return Err(error);
            }
            Some(_) => {}
            None => slot.first = Some((me, signature)),
        }
        slot.calls[me] = Some(Arc::new(call));
        slot.arrived += 1;
        if slot.arrived == n {
            self.group.cv.notify_all();
        }
        Ok(seq)
    }

    /// Waits until every member has deposited in slot `seq`.
    pub fn wait_deposits(&self, seq: u64, kind: OpKind) -> Result<Deposits, CollectiveError> {
        self.wait(
            kind,
            Some(seq),
            self.blocking,
            |state| {
                let slot = &state.slots[&seq];
                if let Some(e) = &slot.error {
                    return Err(Some(e.clone()));
                }
                if slot.arrived == slot.calls.len() {
                    return Ok(slot.calls.iter().map(|c| c.clone().unwrap()).collect());
                }
                Err(None)
            },
            |state| missing(&state.slots[&seq].calls),
        )
    }

    /// Publishes this member's partial result (first phase of a two-phase op).
    pub fn publish_partial(&self, seq: u64, partial: Vec<u8>) {
        let mut state = lock(&self.group.state);
        let slot = state
            .slots
            .get_mut(&seq)
            .expect("slot alive until released");
        slot.partials[self.info.index] = Some(Arc::new(partial));
        if slot.partials.iter().all(Option::is_some) {
            self.group.cv.notify_all();
        }
    }

    /// Waits for every member's partial result. Never part of a deadlock: once every member
    /// has deposited, each computes its partial without waiting for anyone.
    pub fn wait_partials(
        &self,
        seq: u64,
        kind: OpKind,
    ) -> Result<Vec<Arc<Vec<u8>>>, CollectiveError> {
        self.wait(
            kind,
            Some(seq),
            false,
            |state| {
                let slot = &state.slots[&seq];
                if slot.partials.iter().all(Option::is_some) {
                    return Ok(slot.partials.iter().map(|p| p.clone().unwrap()).collect());
                }
                Err(None)
            },
            |state| missing(&state.slots[&seq].partials),
        )
    }

    /// This member is done with slot `seq`; the last one frees it.
    pub fn release(&self, seq: u64) {
        let mut state = lock(&self.group.state);
        let n = self.n();
        let done = match state.slots.get_mut(&seq) {
            Some(slot) => {
                slot.released += 1;
                slot.released == n
            }
            None => false,
        };
        if done && let Some(slot) = state.slots.remove(&seq) {
            drop(state);
            free_off_the_critical_path(slot);
        }
    }

    pub fn post(&self, dst: usize, data: TensorData) {
        let mut state = lock(&self.group.state);
        state
            .mailboxes
            .entry((self.info.index, dst))
            .or_default()
            .push_back(data);
        self.group.cv.notify_all();
    }

    pub fn take(&self, src: usize) -> Result<TensorData, CollectiveError> {
        let key = (src, self.info.index);
        self.wait(
            OpKind::Recv,
            None,
            self.blocking,
            |state| match state.mailboxes.get_mut(&key).and_then(VecDeque::pop_front) {
                Some(d) => Ok(d),
                None => Err(None),
            },
            |_| vec![src],
        )
    }

    /// Waits until `ready` yields a value, giving up on a slot error, a failed world, a
    /// missing member that has exited, a deadlock with other ranks (when `detect`), or the
    /// timeout. `missing` lists members not yet there; `seq` is `None` for point-to-point.
    fn wait<T>(
        &self,
        kind: OpKind,
        seq: Option<u64>,
        detect: bool,
        mut ready: impl FnMut(&mut GroupState) -> Result<T, Option<CollectiveError>>,
        missing: impl Fn(&GroupState) -> Vec<usize>,
    ) -> Result<T, CollectiveError> {
        let started = Instant::now();
        // Entered once the wait outlasts a poll: a shorter one cannot be part of a deadlock the
        // detector reports (that takes `GRACE`), so the many quick waits cost nothing here.
        let mut blocked = None;
        let mut state = lock(&self.group.state);
        loop {
            match ready(&mut state) {
                Ok(v) => return Ok(v),
                Err(Some(e)) => return Err(e),
                Err(None) => {}
            }
            let absent = self.global(missing(&state));
            let waited = started.elapsed();
            if detect && waited >= POLL {
                let me = self.info.ranks[self.info.index];
                let blocked = blocked.get_or_insert_with(|| self.world.waits.enter(me));
                blocked.refresh(kind.name(), self.info, seq, &absent);
                // Before the failure check: once the rank that found the divergence has failed
                // with it, the others of the set still end with the divergence, not with "rank
                // N failed".
                if let Some(waits) = blocked.diverged() {
                    // This rank leaves its place in the group's sequence: the group is out of
                    // step, as after a mismatch.
                    return Err(self.break_group(&mut state, CollectiveError::Diverged { waits }));
                }
            }
            self.keep_waiting(&mut state, kind, seq, waited, absent, blocked.as_ref())?;
            let step = POLL.min(self.world.timeout - waited);
            state = self
                .group
                .cv
                .wait_timeout(state, step)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Whether a wait that is still not ready may go on: an error when another rank failed
    /// (or, when this wait is part of a divergence that rank recorded, that divergence), a
    /// member this rank waits for has exited, or the wait has run for the timeout. `absent`:
    /// the members not yet there, as global ranks.
    fn keep_waiting(
        &self,
        state: &mut GroupState,
        kind: OpKind,
        seq: Option<u64>,
        waited: Duration,
        absent: Vec<usize>,
        blocked: Option<&Blocked<'_>>,
    ) -> Result<(), CollectiveError> {
        let op = kind.name().to_string();
        let group = self.info.label.clone();
        if let Some((rank, reason)) = self.world.failure() {
            // The rank that found a divergence records it before it fails: a rank of the
            // set that sees the failure first still ends with the divergence.
            if let Some(waits) = blocked.and_then(|b| b.recorded()) {
                return Err(self.break_group(state, CollectiveError::Diverged { waits }));
            }
            return Err(CollectiveError::PeerFailed {
                op,
                group,
                rank,
                reason,
            });
        }
        let gone: Vec<usize> = absent
            .iter()
            .copied()
            .filter(|r| self.world.has_exited(*r))
            .collect();
        if !gone.is_empty() {
            return Err(CollectiveError::RankExited {
                op,
                group,
                seq: seq.unwrap_or(0),
                ranks: gone,
            });
        }
        if waited >= self.world.timeout {
            return Err(CollectiveError::Timeout {
                op,
                group,
                seq: seq.unwrap_or(0),
                waited,
                missing: absent,
            });
        }
        Ok(())
    }

    /// Marks the group broken by `error` and wakes its members: after a divergence the group
    /// is out of step, so every later call on it must fail rather than pair up wrongly.
    fn break_group(&self, state: &mut GroupState, error: CollectiveError) -> CollectiveError {
        state.broken = Some(error.to_string());
        self.group.cv.notify_all();
        error
    }
}

/// Inputs at least this large are freed on a helper thread.
const FREE_ASYNC_BYTES: usize = 1 << 20;

/// Frees a finished slot's inputs. Returning large allocations to the OS costs about as much as
/// faulting them in on some machines; the last rank to release would otherwise pay it inside
/// the collective. Small slots are freed in place.
fn free_off_the_critical_path(slot: Slot) {
    let bytes: usize = slot
        .calls
        .iter()
        .flatten()
        .map(|call| call_bytes(call))
        .sum();
    if bytes >= FREE_ASYNC_BYTES {
        let spawned = std::thread::Builder::new()
            .name("collective-free".into())
            .spawn(move || drop(slot));
        // If no thread can be spawned the closure (and the slot) is dropped here instead.
        drop(spawned);
    }
}

fn call_bytes(call: &Collective) -> usize {
    match call {
        Collective::AllReduce { data, .. }
        | Collective::AllGather { data, .. }
        | Collective::ReduceScatter { data, .. }
        | Collective::AllToAll { data, .. }
        | Collective::Send { data, .. } => data.as_bytes().len(),
        Collective::Broadcast { data, .. } => data.as_ref().map_or(0, |d| d.as_bytes().len()),
        Collective::Recv { .. } | Collective::Barrier => 0,
    }
}

fn missing<T>(entries: &[Option<T>]) -> Vec<usize> {
    entries
        .iter()
        .enumerate()
        .filter(|(_, e)| e.is_none())
        .map(|(i, _)| i)
        .collect()
}
