//! burn-parallel-tp: tensor and sequence parallelism as a module decorator.
//!
//! - [`Tp`] wraps a module (`nn::Linear`, `nn::Embedding`, or any [`TpLayer`]). Without a
//!   style it is exactly the inner module; [`Tp::parallelize`] shards its weights over a tp
//!   [`ProcessGroup`](burn_parallel_comm::ProcessGroup) and inserts the differentiable
//!   collectives of its [`ParallelStyle`] around the forward.
//! - [`ParallelStyle::colwise_fused`] splits a fused projection (one `qkv` or `gate_up`
//!   Linear) part by part, so the local output splits into q, k and v as the full one does.
//! - [`TpPlan`] maps module paths (with `*` wildcards) to styles; [`apply_plan`] walks a
//!   model's [`TpModule`] tree and reports unmatched entries and uncovered modules.
//! - [`loss_parallel`]: cross-entropy over vocab-sharded logits without gathering them.
//! - [`local_heads`]: attention-head validation against the tp size.
//! - [`TpModule::sync_tp_grads`]: all-reduce of the partial gradients of replicated
//!   parameters in the sequence-parallel region.
//!
//! A model takes part by wrapping layers in `Tp` and walking its fields by path (until the
//! derive exists, by hand):
//!
//! ```ignore
//! #[derive(Module, Debug)]
//! struct Mlp { gate_proj: Tp<Linear>, up_proj: Tp<Linear>, down_proj: Tp<Linear> }
//!
//! impl TpModule for Mlp {
//!     fn apply_tp(self, path: &str, cx: &mut TpApplier<'_>) -> Result<Self, TpError> {
//!         Ok(Self {
//!             gate_proj: self.gate_proj.apply_tp(&child_path(path, "gate_proj"), cx)?,
//!             up_proj: self.up_proj.apply_tp(&child_path(path, "up_proj"), cx)?,
//!             down_proj: self.down_proj.apply_tp(&child_path(path, "down_proj"), cx)?,
//!         })
//!     }
//!     fn sync_tp_grads(&self, grads: &mut Gradients) -> Result<(), TpError> {
//!         self.gate_proj.sync_tp_grads(grads)?;
//!         self.up_proj.sync_tp_grads(grads)?;
//!         self.down_proj.sync_tp_grads(grads)
//!     }
//! }
//!
//! impl Mlp {
//!     fn forward(&self, x: Tensor<3>) -> Tensor<3> {
//!         // gate and up read the same input: one input collective for both.
//!         let x = self.gate_proj.prepare_input(x).unwrap();
//!         let h = silu(self.gate_proj.forward_prepared(x.clone())) * self.up_proj.forward_prepared(x);
//!         self.down_proj.forward(h)
//!     }
//! }
//!
//! // On every rank: build the same model (from the same record), then
//! let plan = TpPlan::new().with("gate_proj", ParallelStyle::colwise()); // ... or a plan the model provides
//! let (model, report) = apply_plan(model, &plan, &mesh.group("tp")?)?;
//! report.check_entries()?;
//! let loss = loss_parallel(model.forward(ids).reshape([tokens, -1]), targets, &tp, vocab)?;
//! let mut grads = loss.backward();
//! model.sync_tp_grads(&mut grads)?; // sequence parallel: replicated params' partial grads
//! ```

#![warn(missing_docs)]

mod error;
mod grads;
mod heads;
mod layer;
mod loss;
mod pattern;
mod plan;
mod prepare;
mod ring;
mod shard;
mod style;
mod tp;

pub use error::TpError;
pub use heads::{LocalHeads, local_heads};
pub use layer::{Sharded, TpLayer, TpLinear};
pub use loss::{loss_parallel, loss_parallel_ignoring, loss_parallel_weighted};
pub use pattern::path_matches;
pub use plan::{TpApplier, TpModule, TpPlan, TpReport, apply_plan, child_path};
pub use prepare::{PrepareModuleInput, PrepareModuleOutput, Redistribute, redistribute};
pub use shard::{
    ShardSpec, gather_param, gather_param_parts, narrow_param, narrow_param_parts, part_size,
};
pub use style::{Layout, ParallelStyle};
pub use tp::{Prepared, Sharding, SplitParam, Tp, forward_shared, try_forward_shared};
