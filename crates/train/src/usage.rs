//! What the process costs the machine at one moment, for the per-step report. Process-wide:
//! under the threads engine every rank of the process counts together; under MPI each process
//! reports its own.

use burn_parallel_comm::memory::{minor_page_faults, peak_rss_bytes};

/// The process's counters at one moment (zeros where the platform does not report them).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Page faults served without I/O so far (fresh pages being zeroed and mapped, mostly).
    pub minor_faults: u64,
    /// The largest resident set so far, in bytes.
    pub peak_rss_bytes: u64,
}

impl ProcessUsage {
    /// The counters now.
    pub fn now() -> Self {
        Self {
            minor_faults: minor_page_faults().unwrap_or(0),
            peak_rss_bytes: peak_rss_bytes().unwrap_or(0),
        }
    }
}
