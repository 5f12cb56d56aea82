//! Differentiable collectives: Burn autodiff ops whose forward and backward run collectives.

mod extension;
mod ops;

pub use extension::{CollectiveBackend, HostCollective, HostFn};
pub use ops::*;
