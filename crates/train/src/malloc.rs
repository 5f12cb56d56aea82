//! Keeping freed pages in the process: the allocator setting the trainer runs with.
//!
//! FSDP allocates each unit's gathered weights and flat gradients (tens of MB at 100M
//! parameters) every step and frees them soon after. glibc's malloc serves blocks that large
//! with `mmap` and returns them with `munmap`, so every step faults every page in again
//! (measured on the 95M config, fsdp2 x2: over 3 million page faults per step). With the mmap
//! and trim thresholds at their maximum, freed blocks stay in the heap and the next step
//! reuses them; with one arena for every thread, a rank thread's heap is never unmapped
//! whole when its last block is freed (glibc gives each thread arena its own 64 MiB heaps).
//! Page faults per step then fall to about zero after the first steps (figures and command in
//! docs/benchmarks.md).

use burn_parallel_parallelizer::named_enum;

named_enum! {
    /// How the process's allocator treats freed memory.
    pub enum Malloc as "malloc" {
        /// Large freed blocks stay in the process for the next step (glibc: the mmap and trim
        /// thresholds at their maximum, one arena). The default.
        Kept = "kept",
        /// The C library's defaults (glibc returns large blocks to the system when freed).
        System = "system",
    }
}

impl Malloc {
    /// Applies the setting to this process; call it first in `main`, before any thread starts.
    /// Returns whether the allocator took it (only glibc's does: elsewhere `Kept` is a no-op
    /// that returns `false`).
    pub fn apply(self) -> bool {
        match self {
            Malloc::System => true,
            Malloc::Kept => keep_freed_pages(),
        }
    }
}

/// Hands the allocator's free pages back to the system (glibc: `malloc_trim`), whatever
/// [`Malloc`] setting the process runs with. Called once the model is built, so that what
/// construction freed (a whole checkpoint read to be quantized or sharded, the full model a
/// rank built before sharding it) is not counted in training's peak, nor held from other
/// processes; the steps' own blocks are kept from then on. Returns whether it did anything.
pub(crate) fn release_freed_pages() -> bool {
    release_free_heap()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_free_heap() -> bool {
    // SAFETY: malloc_trim only returns free memory of glibc's heaps to the system.
    unsafe { libc::malloc_trim(0) == 1 }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn release_free_heap() -> bool {
    false
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_pages() -> bool {
    // SAFETY: mallopt only changes thresholds of glibc's allocator; it is called before other
    // threads allocate (see `Malloc::apply`).
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, i32::MAX) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) == 1
            && libc::mallopt(libc::M_ARENA_MAX, 1) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_pages() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_the_system_setting_always_applies() {
        assert_eq!("kept".parse::<Malloc>(), Ok(Malloc::Kept));
        assert_eq!("system".parse::<Malloc>(), Ok(Malloc::System));
        assert!(
            "jemalloc"
                .parse::<Malloc>()
                .unwrap_err()
                .contains("kept, system")
        );
        assert!(Malloc::System.apply());
    }
}
