//! State shared by all rank threads of one launch: its groups, which ranks have failed or
//! exited, what each rank is blocked in, and per-rank counters.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::transport::stats::CommStats;

use super::state::{GroupShared, lock};
use super::waits::Waits;

/// A group is identified by its label and its members in order.
type GroupKey = (String, Vec<usize>);

pub(crate) struct World {
    pub size: usize,
    pub timeout: Duration,
    groups: Mutex<HashMap<GroupKey, Arc<GroupShared>>>,
    failure: Mutex<Option<(usize, String)>>,
    failed: AtomicBool,
    exited: Vec<AtomicBool>,
    /// What each rank is blocked in, for the deadlock detector.
    pub waits: Waits,
    pub rank_stats: Vec<Mutex<CommStats>>,
}

impl World {
    pub fn new(size: usize, timeout: Duration) -> Self {
        Self {
            size,
            timeout,
            groups: Mutex::new(HashMap::new()),
            failure: Mutex::new(None),
            failed: AtomicBool::new(false),
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            waits: Waits::new(size),
            rank_stats: (0..size)
                .map(|_| Mutex::new(CommStats::default()))
                .collect(),
        }
    }

    /// The shared state of a group; every member asking with the same key gets the same one.
    pub fn group(&self, label: &str, ranks: &[usize]) -> Arc<GroupShared> {
        let mut groups = lock(&self.groups);
        groups
            .entry((label.to_string(), ranks.to_vec()))
            .or_insert_with(|| Arc::new(GroupShared::new(ranks.len())))
            .clone()
    }

    /// Records the first failure; every rank waiting in a collective gives up with it.
    pub fn fail(&self, rank: usize, reason: String) {
        let mut failure = lock(&self.failure);
        if failure.is_none() {
            *failure = Some((rank, reason));
        }
        self.failed.store(true, Ordering::SeqCst);
        drop(failure);
        self.wake_all();
    }

    pub fn failure(&self) -> Option<(usize, String)> {
        if !self.failed.load(Ordering::SeqCst) {
            return None;
        }
        lock(&self.failure).clone()
    }

    pub fn exit(&self, rank: usize) {
        self.exited[rank].store(true, Ordering::SeqCst);
        self.wake_all();
    }

    pub fn has_exited(&self, rank: usize) -> bool {
        self.exited[rank].load(Ordering::SeqCst)
    }

    fn wake_all(&self) {
        let groups: Vec<Arc<GroupShared>> = lock(&self.groups).values().cloned().collect();
        groups.iter().for_each(|g| g.wake());
    }
}
