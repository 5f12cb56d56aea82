//! Locking a mutex while ignoring poisoning, for every lock of the mpi engine (its groups,
//! worker threads, counters and pending calls).

use std::sync::{Mutex, MutexGuard};

/// Locks ignoring poisoning: no lock is held across user code.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
