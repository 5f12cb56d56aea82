//! burn-parallel-pp: pipeline parallelism. A model is split into stages of consecutive layers
//! ([`StageSplit`]), one stage per rank of the pipeline group; each stage implements
//! [`PipelineStage`]; [`run_schedule`] runs a step's microbatches through the stages under a
//! schedule ([`ScheduleKind`]: GPipe, 1F1B, or interleaved 1F1B with several stages per rank),
//! exchanging activations and gradients with the neighbouring ranks ([`StageLink`]) and
//! summing the parameter gradients over the microbatches. The optimizer step, the
//! data-parallel average and the global gradient norm are the parallelizer's
//! (`parallelizer::Step::run_pipeline`).

#![warn(missing_docs)]

mod error;
mod link;
mod paths;
mod run;
mod schedule;
mod split;
mod stage;

pub use error::PipelineError;
pub use link::StageLink;
pub use paths::{StageParamPaths, renumber};
pub use run::{ScheduleStats, StageGrads, run_forward, run_schedule};
pub use schedule::{Action, ScheduleKind, actions, bubble_fraction};
pub use split::{StageSplit, split_rows};
pub use stage::{PipelineStage, StageOutput};
