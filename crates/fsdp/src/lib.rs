//! burn-parallel-fsdp: FSDP2-style fully sharded data parallelism for Burn modules.
//!
//! Status: the first slice. [`fully_shard`] shards every float parameter of any
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
//! [`forward_units`] runs a sequence of units (a decoder's layers) with forward prefetch: the
//! next unit's gather is in flight while the current one computes. Burn's backward has no
//! hooks, so there is no backward prefetch: each unit's reduce-scatter runs when autodiff
//! reaches it.
//!
//! Not done yet (the rest of the FSDP2 issue): offload policy; memory
//! accounting; loading a full state builds the full module on each rank before sharding it
//! (peak: the whole model).
//!
//! Every rank builds its own module (an autodiff tensor shared between rank threads joins
//! their graphs); build it from the same seeds or record on each rank, then shard it.

mod clip;
mod error;
mod gather;
mod policy;
mod shard;
mod unit;

pub use clip::clip_grad_norm;
pub use error::FsdpError;
pub use policy::MixedPrecisionPolicy;
pub use shard::{FsdpConfig, ShardGather, fully_shard, gather_full};
pub use unit::{forward_units, with_gathered_unit};
