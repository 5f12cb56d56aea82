//! What the process costs the machine: page faults and peak resident memory (`getrusage`), for
//! the per-step report. Process-wide: under the threads engine every rank of the process
//! counts together; under MPI each process reports its own.

/// The process's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessUsage {
    /// Page faults served without I/O (fresh pages being zeroed and mapped, mostly).
    pub minor_faults: u64,
    /// The largest resident set so far, in bytes.
    pub peak_rss_bytes: u64,
}

impl ProcessUsage {
    /// The counters now (zeros where the platform does not report them).
    pub fn now() -> Self {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is always valid.
        let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
        if !ok {
            return Self::default();
        }
        // SAFETY: written by the successful call above (and zeroed before it).
        let usage = unsafe { usage.assume_init() };
        // Linux reports the peak in KiB, macOS in bytes.
        let rss_unit = if cfg!(target_os = "macos") { 1 } else { 1024 };
        Self {
            minor_faults: usage.ru_minflt.max(0) as u64,
            peak_rss_bytes: usage.ru_maxrss.max(0) as u64 * rss_unit,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touching_fresh_pages_counts_faults_and_raises_the_peak() {
        let before = ProcessUsage::now();
        // 64 MiB written page by page: fresh pages, each a minor fault.
        let mut pages = vec![0u8; 64 << 20];
        for p in pages.chunks_mut(4096) {
            p[0] = 1;
        }
        std::hint::black_box(&pages);
        let after = ProcessUsage::now();
        assert!(
            after.minor_faults >= before.minor_faults + 1000,
            "{before:?} {after:?}"
        );
        assert!(after.peak_rss_bytes >= 64 << 20, "{after:?}");
    }
}
