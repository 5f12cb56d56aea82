//! Counting what Burn's fusion runs: how many kernels a step launched, and how many fused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts what Burn's fusion ran while it lives: blocks (a fused kernel's operations, or one
/// operation run alone) and the operations in them. Process-wide, as Burn's fusion server is:
/// it counts every thread's CubeCL work. Without fusion built it counts nothing.
pub struct FusionCounter {
    counts: Arc<Counts>,
    #[cfg(feature = "fusion")]
    _observation: burn::backend::fusion::observer::FusionObservation,
}

/// What a [`FusionCounter`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusionCounts {
    /// Operations registered with the fusion server.
    pub operations: u64,
    /// Blocks run: each one kernel's worth of operations, or one operation alone.
    pub blocks: u64,
    /// Blocks that held more than one operation: fused kernels.
    pub fused_blocks: u64,
    /// Operations inside fused blocks.
    pub fused_operations: u64,
}

#[derive(Default)]
struct Counts {
    operations: AtomicU64,
    blocks: AtomicU64,
    fused_blocks: AtomicU64,
    fused_operations: AtomicU64,
}

impl FusionCounts {
    /// What was counted after `earlier`, a reading of the same counter.
    pub fn since(&self, earlier: &FusionCounts) -> FusionCounts {
        FusionCounts {
            operations: self.operations.saturating_sub(earlier.operations),
            blocks: self.blocks.saturating_sub(earlier.blocks),
            fused_blocks: self.fused_blocks.saturating_sub(earlier.fused_blocks),
            fused_operations: self
                .fused_operations
                .saturating_sub(earlier.fused_operations),
        }
    }
}

impl FusionCounter {
    /// Starts counting. Sync the devices first to leave out work queued before (Burn's
    /// `FusionObservation` notes why).
    pub fn start() -> Self {
        let counts = Arc::new(Counts::default());
        Self {
            #[cfg(feature = "fusion")]
            _observation: burn::backend::fusion::observer::FusionObservation::new(counts.clone()),
            counts,
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> FusionCounts {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FusionCounts {
            operations: read(&self.counts.operations),
            blocks: read(&self.counts.blocks),
            fused_blocks: read(&self.counts.fused_blocks),
            fused_operations: read(&self.counts.fused_operations),
        }
    }
}

#[cfg(feature = "fusion")]
impl burn::backend::fusion::observer::FusionObserver for Counts {
    fn registered(&self, _operation: &burn::backend::fusion::custom::OperationIr) {
        self.operations.fetch_add(1, Ordering::Relaxed);
    }

    fn block_starts(&self, block: burn::backend::fusion::observer::BlockOperations<'_>) {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        let len = block.iter().len() as u64;
        if len > 1 {
            self.fused_blocks.fetch_add(1, Ordering::Relaxed);
            self.fused_operations.fetch_add(len, Ordering::Relaxed);
        }
    }

    fn block_ran(&self) {}
}
