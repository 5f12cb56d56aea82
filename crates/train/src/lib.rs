//! burn-parallel-train: trains a Llama under any strategy (single, ddp, fsdp2, hsdp, tp,
//! fsdp2_tp, megatron_fsdp) with rank threads or MPI processes, and reports every step.
//! `examples/train_llama.rs` is a thin command line ([`TrainArgs`]) over [`train`].
//!
//! Strategies come from `burn_parallel_parallelizer`: a run holds a `DistributedConfig`
//! ([`TrainConfig::distributed`]), which the command line's flags and `--distributed-config
//! FILE` set ([`DistributedFlags`]); `parallelize_model` shards the model (lazily loaded from
//! a checkpoint: each FSDP rank reads its own rows) and the `Step` runs backward, the
//! gradient reductions, clipping and this crate's PyTorch-exact optimizers.
//!
//! Numerics: the loss is the mean token cross-entropy over the GLOBAL batch. Each rank's loss
//! is its tokens' share of it times dp, and the data-parallel reductions average, so the
//! gradient is exactly the global mean's, also when ranks hold different numbers of rows.
//! SFT and chat data ([`data`], docs/data.md) mask prompt tokens: the loss is the counting
//! targets' cross-entropy over their count all-reduced over the data-parallel ranks (and over
//! `--grad-accum`'s micro-batches), so every layout trains on the same loss.
//!
//! LoRA ([`TrainConfig::lora`], [`LoraOptions`]) attaches adapters to the Llama's projections
//! (or loads a peft adapter) on every rank before `parallelize_model`, freezing the base; after
//! training rank 0 writes the adapter in peft's format and `--save` the merged model.
//!
//! `--freeze` ([`TrainConfig::freeze`]) freezes parameters by Hugging Face name before
//! `parallelize_model`. Guards end a run with an error rather than an abort or silent garbage:
//! a `--seq-len` past the model's positions (before anything is allocated) and a non-finite
//! loss or gradient norm (at its step, on every rank alike: [`TrainError::NonFinite`]; with
//! [`OnNonFinite::Skip`] the step's update is dropped instead).
//!
//! The learning rate follows [`TrainConfig::lr_schedule`] (warmup, then constant, linear or
//! cosine decay: transformers' formulas), a function of the step, which checkpoints record.
//! A batch whose logits would not fit in the machine's memory is refused up front.

#![warn(missing_docs)]

mod aux;
mod batches;
mod cli;
mod config;
pub mod data;
mod error;
mod fault;
mod flags;
mod flops;
mod freeze;
mod generate;
mod guard;
mod lora;
mod malloc;
mod mesh;
mod model_dir;
mod optim;
mod options;
mod outputs;
mod pipeline;
pub mod recipe;
mod relaunch;
mod restarts;
mod resume;
mod run_loop;
mod schedule;
mod state;
mod step_log;
mod stop;
mod stragglers;
mod trainer;
mod usage;
mod validate;
#[cfg(feature = "wgpu")]
mod wgpu_device;

pub use burn_parallel_comm::EngineKind;
pub use burn_parallel_parallelizer::{
    DistributedConfig, Dtype, MeshSizes, StepReport, Strategy, ZeroDpStrategy,
};
pub use cli::{BuiltinModel, TrainArgs};
pub use config::{Backend, OptimizerKind, TrainConfig};
pub use data::{DataOptions, EvalBatches};
/// A flag the run cannot use ([`TrainError::Flag`]): `err.flag` names it, for programs that
/// react to a particular flag rather than print the message.
pub use error::FlagError;
pub use error::TrainError;
pub use fault::{FAULT_ENV, Fault, FaultKind, SLOW_STEP};
pub use flags::{DistributedFlags, TpPlanName, trainer_defaults};
pub use flops::step_flops;
pub use generate::{GenerateOptions, Generated, generate};
pub use lora::LoraFlags;
pub use malloc::Malloc;
pub use mesh::mesh_plan;
pub use optim::{AdamW, Optimizer, Sgd};
pub use options::{
    DEFAULT_TARGETS, FUSED_DEFAULT_TARGETS, LoraOptions, LoraQuantize, LrScheduleKind, OnNonFinite,
    PipelineOptions,
};
pub use relaunch::{ATTEMPT_ENV, JobEnd, REQUEUE_EXIT_CODE, Relaunch, in_launched_job};
pub use restarts::train;
pub use state::model_state_bytes;
pub use step_log::{Skipped, StepCalls, StepLog, StepTimes};
pub use stop::StopFlag;
pub use trainer::TrainSummary;
pub use usage::ProcessUsage;
#[cfg(feature = "wgpu")]
pub use wgpu_device::{WgpuAdapter, wgpu_adapter};
