//! Differentiable collectives: Burn autodiff ops whose forward and backward run collectives.

pub mod device;
mod extension;
mod ops;

pub use device::{DeviceCollective, DeviceOp};
pub use extension::{CollectiveBackend, HostCollective, HostFn};
pub use ops::*;
