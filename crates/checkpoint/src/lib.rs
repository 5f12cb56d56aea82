//! burn-parallel-checkpoint: sharded training checkpoints. Save under one strategy and world
//! size, resume under any other; every rank writes only what it holds and reads only what it
//! needs; a checkpoint appears atomically or not at all.
//!
//! # Format
//!
//! A checkpoint is a directory (by convention `save_dir/step-00000005`, see [`step_dir`]):
//!
//! - `model-RRRRR.safetensors`: the parameter shards rank `RRRRR` owns, each under its module
//!   path (`model/layers.0.mlp.up_proj.weight`) with the shape of its region (a rank's further
//!   regions of the same tensor under `{path}@{start}`, recorded in the metadata's `entry`);
//! - `optim-RRRRR.safetensors`: the optimizer state of those shards (`optim/exp_avg/...`);
//! - `checkpoint.json` ([`Metadata`]), written once by rank 0: every tensor's global shape,
//!   dtype and the regions (start and shape per dim) each file holds, with a CRC32 per region
//!   and per file; the mesh, strategy and `DistributedConfig` it was saved under; the
//!   [`TrainingProgress`] (step, data position, free-form state such as the learning-rate
//!   schedule); the optimizer's kind and scalars; the format and crate versions.
//!
//! A region is what one rank stores: under FSDP its rows along dim 0, under tensor parallelism
//! its slice of the split dim, both combined under FSDP + TP. A piece of an FSDP flat buffer
//! (Megatron-FSDP) is a contiguous run of the row-major elements that need not be whole rows:
//! it is stored as the few regions [`boxes_of_range`] splits it into. Replicas (DDP, HSDP,
//! parameters tensor parallelism leaves whole) hold identical regions, which the lowest rank
//! writes once.
//!
//! # Saving and resuming from your own loop
//!
//! ```ignore
//! use burn_parallel::checkpoint::{Checkpoint, LoadOptions, SaveOptions, TrainingProgress, save, step_dir};
//!
//! // On every rank, after the model is parallelized (any strategy) and the optimizer made:
//! if let Some(dir) = &resume {
//!     let checkpoint = Checkpoint::open(dir)?; // a checkpoint, or a save dir's newest one
//!     let (loaded, _) = checkpoint.load(model, Some(&mut optimizer), &mesh, &LoadOptions::default())?;
//!     model = loaded;
//!     start = checkpoint.progress().step;
//! }
//! for step in start..steps {
//!     // ... forward, Step::new(&mesh, &rows).run(..) ...
//!     if (step + 1) % save_every == 0 {
//!         let progress = TrainingProgress { step: step + 1, data_position: (step + 1) * batch, ..Default::default() };
//!         save(&step_dir(&save_dir, step + 1), &model, Some(&optimizer), &progress, &mesh, &SaveOptions::default())?;
//!     }
//! }
//! ```
//!
//! The optimizer implements [`OptimizerState`] (the trainer's SGD and AdamW do); Burn's own
//! optimizers (`ModuleOptimizer`, as `OptimizerStep` takes) go through [`BurnOptimizer`]
//! (`BurnOptimizer::new(&mut optim, &model)?`). Pass `None` to save or load the model alone. [`save_async`] writes from a snapshot on a background
//! thread while training continues.
//!
//! # Pipeline parallelism
//!
//! Under `pp_size > 1` each rank holds one or more pipeline stages (chunks) of the model:
//! [`save_stages`] and [`Checkpoint::load_stages`] take the rank's chunks, and store or read
//! every parameter by the whole model's path ([`StageParamPaths`]; a stage's `layers.0` whose
//! first layer is the model's layer 2 is `layers.2`), agreeing over every rank of every stage.
//! The checkpoint is the whole model's: it loads under another split, another pp size, or
//! into a whole model with [`Checkpoint::load`] (and a whole model's into stages). The optimizer
//! is one for all of a rank's chunks ([`BurnOptimizer::for_stages`] for Burn's).
//!
//! # Guarantees
//!
//! - Atomic: files go to a hidden temporary directory, are flushed, and the directory is
//!   renamed into place only once every rank has succeeded; a failed or interrupted save leaves
//!   the previous checkpoint the newest complete one ([`latest`] never picks a temporary one).
//! - Verified: a missing file, a file of the wrong size, a flipped byte (named with its tensor)
//!   or a checkpoint of another model (the first differing parameter named) is an error on every
//!   rank before any parameter changes.
//! - Resharding: loading computes each rank's regions in the new layout and copies only the
//!   overlapping parts out of memory-mapped files, one tensor at a time ([`LoadReport`]).
//!
//! The directory must be visible to every rank (one node, or a shared filesystem).

#![warn(missing_docs)]

mod burn_optim;
mod dirs;
mod durable;
mod error;
mod exchange;
mod files;
#[cfg(test)]
mod flat_tests;
mod load;
mod lock;
mod meta;
mod optim;
mod placement;
mod region;
mod save;
mod stages;

pub use burn_optim::BurnOptimizer;
pub use dirs::{latest, resolve, step_dir};
pub use error::CheckpointError;
pub use load::{Checkpoint, LoadOptions, LoadReport};
pub use lock::{LOCK_FILE, SaveDirLock, lock_save_dir};
pub use meta::{
    FORMAT_NAME, FORMAT_VERSION, FileMeta, METADATA_FILE, Metadata, OptimizerMeta, SavedLayout,
    StoredRegion, TensorMeta, TrainingProgress, model_key, optim_key,
};
pub use optim::OptimizerState;
pub use placement::{Placement, placements};
pub use region::{Region, boxes_of_range};
pub use save::{
    PendingSave, SaveFault, SaveOptions, SaveReport, save, save_async, save_stages,
    save_stages_async,
};

/// How a pipeline stage's parameter paths map to the whole model's (re-exported from
/// burn-parallel-pp): what [`save_stages`] and [`Checkpoint::load_stages`] key tensors by.
pub use burn_parallel_pp::StageParamPaths;
