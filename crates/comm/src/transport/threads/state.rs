//! The shared state of one group of the threads engine: numbered slots where members deposit
//! their calls, mailboxes for point-to-point messages, per-member counters. The rendezvous
//! protocol on it is [`super::group`].

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};

use burn::tensor::TensorData;

use crate::transport::collective::{Collective, Signature};
use crate::transport::error::CollectiveError;
use crate::transport::stats::CommStats;

pub(crate) struct GroupShared {
    pub(super) state: Mutex<GroupState>,
    pub(super) cv: Condvar,
    pub(super) next_seq: Vec<AtomicU64>,
    pub stats: Vec<Mutex<CommStats>>,
}

#[derive(Default)]
pub(super) struct GroupState {
    pub(super) slots: HashMap<u64, Slot>,
    pub(super) mailboxes: HashMap<(usize, usize), VecDeque<TensorData>>,
    pub(super) broken: Option<String>,
}

pub(super) struct Slot {
    pub(super) first: Option<(usize, Signature)>,
    pub(super) calls: Vec<Option<Arc<Collective>>>,
    pub(super) arrived: usize,
    pub(super) partials: Vec<Option<Arc<Vec<u8>>>>,
    pub(super) released: usize,
    pub(super) error: Option<CollectiveError>,
}

impl Slot {
    pub(super) fn new(n: usize) -> Self {
        Self {
            first: None,
            calls: vec![None; n],
            arrived: 0,
            partials: vec![None; n],
            released: 0,
            error: None,
        }
    }
}

impl GroupShared {
    pub fn new(n: usize) -> Self {
        Self {
            state: Mutex::new(GroupState::default()),
            cv: Condvar::new(),
            next_seq: (0..n).map(|_| AtomicU64::new(0)).collect(),
            stats: (0..n).map(|_| Mutex::new(CommStats::default())).collect(),
        }
    }

    pub fn wake(&self) {
        let _guard = lock(&self.state);
        self.cv.notify_all();
    }
}

/// Locks ignoring poisoning: a rank that panicked is reported through `World::fail`, and the
/// protected state stays consistent because no lock is held across user code.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
