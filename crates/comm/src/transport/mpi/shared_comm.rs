//! An MPI communicator that any thread of the process may use (MPI_THREAD_MULTIPLE).

use std::mem::ManuallyDrop;
use std::ops::Deref;

use mpi::topology::SimpleCommunicator;

/// An MPI communicator that worker threads share. The MPI library is initialized with
/// `MPI_THREAD_MULTIPLE`, so a communicator may be used from any thread.
pub(crate) struct Comm(ManuallyDrop<SimpleCommunicator>);

// SAFETY: MPI handles are plain identifiers; with MPI_THREAD_MULTIPLE the library allows calls
// on them from any thread, concurrently.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Shares `comm`.
    pub(crate) fn new(comm: SimpleCommunicator) -> Self {
        Self(ManuallyDrop::new(comm))
    }
}

impl Deref for Comm {
    type Target = SimpleCommunicator;
    fn deref(&self) -> &SimpleCommunicator {
        &self.0
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // A group that outlives the launch (kept in a result) cannot be freed once MPI is
        // finalized; the process is ending then anyway.
        if !mpi::is_finalized() {
            // SAFETY: dropped once, here.
            unsafe { ManuallyDrop::drop(&mut self.0) }
        }
    }
}
