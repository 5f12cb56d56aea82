//! Differentiable collectives: Burn autodiff ops whose forward and backward run collectives.

pub mod device;
mod extension;
mod ops;

pub use device::{
    Deferral, DeviceCollective, DeviceOp, DevicePending, DeviceStep, Exchange, ForcedDevicePath,
    MixedDtypes, Observer, Sizes, attach_device, force_device_path, is_cuda_device, route,
};
pub use extension::{CollectiveBackend, HostCollective, HostFn};
pub use ops::*;
