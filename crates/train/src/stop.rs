//! Stopping a run early on request (a scheduler's preemption signal): the caller owns a
//! [`StopFlag`] (the trainer binary sets it from SIGTERM, SIGUSR1 and a first SIGINT), every
//! rank reads it at each step boundary, and the ranks agree, so that all of them stop after
//! the same step; that step is then saved to `--save-dir` (if it was not already) and the run
//! returns with [`TrainSummary::stopped_at`](crate::TrainSummary::stopped_at) set.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::TensorData;
use burn_parallel_comm::{RankContext, ReduceOp};

use crate::error::TrainError;

/// A request to stop a run at its next step boundary, shared between the code that raises it
/// (a signal handler: set it with [`StopFlag::request`] or through [`StopFlag::shared`]) and
/// the run. Clones share one flag.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// A flag not raised yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks the run to stop after the step it is in.
    pub fn request(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether a stop was asked for.
    pub fn is_requested(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// The flag itself, for a signal handler that sets an `AtomicBool`
    /// (`signal_hook::flag::register`).
    pub fn shared(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// Flags are equal when they are the same flag.
impl PartialEq for StopFlag {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// Whether any rank's process was asked to stop through the run's `flag`, the same answer on
/// every rank. One small all-reduce over the world per step when the run has a flag; none
/// otherwise.
pub(crate) fn stop_agreed(flag: Option<&StopFlag>, ctx: &RankContext) -> Result<bool, TrainError> {
    let Some(flag) = flag else {
        return Ok(false);
    };
    let mine = if flag.is_requested() { 1.0f32 } else { 0.0 };
    let all = ctx
        .world()?
        .all_reduce(TensorData::new(vec![mine], [1]), ReduceOp::Max)?;
    Ok(all.as_slice::<f32>().expect("an f32 flag")[0] > 0.0)
}
