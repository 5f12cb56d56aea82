//! burn-parallel-fsdp: FSDP2-style fully sharded data parallelism for Burn modules.
//!
//! [`fully_shard`] shards every float parameter of any
//! `#[derive(Module)]` type on dim 0 over a process group (pad-to-ceil chunks, empty shards
//! allowed) through Burn 0.22's parameter reparameterization: the stored parameter is the
//! rank's shard (what optimizers update), and `param.val()` all-gathers it differentiably, so
//! stock modules (`nn::Linear`, ...) run unchanged and gradients land on the shards summed
//! over the group (a reduce-scatter). HSDP (reduce-scatter within the shard group, then
//! all-reduce across replicas), global-norm gradient clipping and the mixed-precision policy
//! (gather and compute in `param_dtype`, reduce gradients in `reduce_dtype`, shards and
//! optimizer state stay f32) and deferred gradient sync for accumulation
//! (`FsdpConfig::set_requires_gradient_sync`) work on top of it.
//!
//! FSDP units: [`with_gathered_unit`] runs a closure (the unit's forward) with every parameter
//! of a module gathered by ONE all-gather and reduced by ONE reduce-scatter; parameters outside
//! any running unit are gathered one by one.
//!
//! [`forward_units`] runs a sequence of units (a decoder's layers) with forward prefetch (the
//! depth the units were sharded with, [`FsdpConfig::forward_prefetch_depth`]): the next units'
//! gathers are in flight while the current one computes, and each unit's gather is tied to the
//! unit's input ([`UnitInput`]) so that backward reduce-scatters each unit's gradient right after
//! running through it. Backward prefetch ([`FsdpConfig::backward_prefetch_depth`]): when a
//! unit's backward starts, the re-gathers of that unit and of the units before it are issued
//! (a marker node on each unit's output; Burn's backward has no hooks), so that they overlap
//! the backward of the units after them.
//!
//! State is owned: each `fully_shard` call is one unit ([`UnitState`]: groups, policy,
//! resharding, prefetch depth) and each sharded parameter has a [`ParamState`] (global shape,
//! rows), held by its [`ShardGather`] reparameterization, so both travel with the model.
//!
//! Frozen parameters (no `require_grad` when sharded, [`ParamState::trainable`]) are sharded
//! and gathered but never reduced: a gather of frozen parameters only has no backward, and a
//! unit that mixes both kinds reduce-scatters its trainable rows only. [`trainability`] counts
//! a module's trainable and frozen parameters; [`FsdpConfig::ignore_params`] leaves some whole.
//! [`weight_rebuild`] lets a weight's consumer (`Lora<Linear>`'s base, through
//! `comm::collectives::resharded_linear`) keep the shard rather than the gathered weight for
//! backward, which gathers it again: a resharded weight is not resident through backward, on
//! any device (a frozen one even on a checkpointing device, which cannot recompute a gather
//! that is not tracked).
//!
//! Memory accounting ([`memory`]): per-rank live and peak bytes of parameters, gathered
//! weights, gradients and optimizer state in the config's [`MemoryTracker`]; FSDP records what
//! it gathers and the gradient shards its reduce-scatters hand out, the training loop reports
//! parameters and optimizer state (the module documents exactly what is counted when).
//!
//! State: [`fully_shard_from`] shards a lazily initialized module by asking a source for each
//! rank's rows of one parameter at a time (no rank materializes a full parameter);
//! [`gather_state_dict`] / [`for_each_full_param`] gather the full state one parameter at a
//! time, keyed by module path, on every rank or on the first rank of the shard group.
//!
//! Offload ([`OffloadPolicy`]): shards, their gradients and the optimizer step live on a host
//! device; each gather copies the shard to the compute device first and backward copies the
//! reduced gradient back (Burn 0.22's differentiable cross-device transfer, also across
//! backends).
//!
//! Not done: loading a Hugging Face checkpoint into an
//! already-sharded module (build it lazily and use [`fully_shard_from`] instead; sharded
//! training checkpoints load into any layout through `burn-parallel-checkpoint`).
//!
//! Every rank builds its own module (an autodiff tensor shared between rank threads joins
//! their graphs); build it from the same seeds or record on each rank, then shard it.

#![warn(missing_docs)]

mod clip;
mod config;
mod error;
mod gather;
mod load;
pub mod memory;
mod offload;
mod paths;
mod policy;
mod rebuild;
mod reparam;
mod rows;
mod shard;
mod state;
mod trainable;
mod unit;

pub use clip::{SquareSums, clip_grad_norm, clip_to_norm, grad_square_sums, scale_grads};
pub use config::{FsdpConfig, GradientReduction, ShardLayout};
pub use error::FsdpError;
pub use load::{
    StateDictRanks, for_each_full_param, fully_shard_from, gather_full, gather_state_dict,
};
pub use memory::{MemoryKind, MemoryReport, MemoryTracker, ModelStateBytes};
pub use offload::OffloadPolicy;
pub use paths::{PathVisitor, visit_with_paths};
pub use policy::MixedPrecisionPolicy;
pub use rebuild::weight_rebuild;
pub use reparam::{ShardGather, param_states};
pub use rows::{RowRequest, RowSource};
pub use shard::fully_shard;
pub use state::{ParamState, UnitState};
pub use trainable::{Trainability, frozen_param_ids, param_ids, trainability};
pub use unit::{
    UnitInput, forward_units, forward_units_checkpointed, try_with_gathered_unit,
    try_with_module_unit, with_gathered_unit, with_module_unit,
};
