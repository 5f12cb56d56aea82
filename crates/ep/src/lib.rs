//! burn-parallel-ep: expert parallelism for mixture-of-experts (MoE) layers.
//!
//! A MoE layer routes each token to `k` of `E` experts. Under expert parallelism the experts
//! are split evenly over an `ep` group ([`ExpertShard`]): rank `r` holds experts
//! `r * E/ep .. (r + 1) * E/ep`. One forward of the experts ([`run_experts`]):
//!
//! 1. [`Routing`] sorts this rank's routed token rows by expert (expert-major);
//! 2. the per-expert row counts are exchanged (one host all_to_all of `E` integers);
//! 3. the rows go to the ranks that hold their experts (a differentiable all_to_all with
//!    per-rank sizes);
//! 4. each local expert runs once on its rows (picked from the arrivals), an expert that
//!    received none on one zero row whose output is dropped;
//! 5. the outputs are put back in arrival order and the inverse all_to_all brings them home.
//!
//! Backward is the same exchange with the splits swapped. Ranks and experts that receive no
//! token take part in every exchange with empty pieces, so nothing waits, and the autodiff graph
//! has the same shape whatever the routing, so every rank reaches backward's collectives in the
//! same order. Without a shard
//! (one device, or `ep = 1`) step 4 runs over all experts and nothing is exchanged: the same
//! code path, minus the exchange.

#![warn(missing_docs)]

mod dispatch;
mod error;
mod module;
mod routing;
mod shard;

pub use dispatch::run_experts;
pub use error::EpError;
pub use module::ExpertModule;
pub use routing::Routing;
pub use shard::ExpertShard;
