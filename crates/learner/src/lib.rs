//! burn-parallel-learner: burn-train's `Learner` under every burn-parallel strategy.
//!
//! [`ParallelStrategy`] implements burn-train 0.22's extension point
//! (`TrainingStrategy::Custom`), so a model trained through `SupervisedTraining` keeps its
//! metrics, renderer, early stopping and interruption while its ranks run ddp, fsdp2, hsdp, tp,
//! fsdp2_tp, megatron_fsdp or ep. A model's input implements [`SplitBatch`] (its rows per
//! data-parallel rank), its output [`GatherOutput`] (burn-train's classification and
//! regression outputs do). See `docs/learner.md`.

#![warn(missing_docs)]

mod batch;
mod error;
mod feed;
mod grads;
mod strategy;

pub use batch::{
    GatherOutput, SplitBatch, gather_mean, gather_rows, gather_rows_int, slice_rows, slice_rows_int,
};
/// The burn-train this crate implements its strategy for (use it to name `SupervisedTraining`,
/// metrics and renderers with the same version).
pub use burn_train;
pub use error::LearnerError;
pub use strategy::{ParallelLearnerModel, ParallelStrategy};
