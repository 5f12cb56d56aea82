//! The device-ops layer: every collective as a list of steps on a backend tensor
//! ([`steps`]), the lists of the differentiable collectives ([`pairs`]), which exchange a
//! tensor takes ([`route`]), and the buffer adapters that run NCCL on CubeCL and LibTorch CUDA
//! tensors (`cube`, `torch`, planned by `nccl`). It builds on the transport layer and knows
//! nothing of autodiff.

pub mod cast;
pub mod collective;
pub mod decode;
pub mod pairs;
pub mod prefetch;
pub mod route;
pub mod steps;

#[cfg(feature = "cuda")]
pub(crate) mod cube;
#[cfg(all(feature = "cuda", feature = "fusion"))]
pub(crate) mod fused;
#[cfg(any(feature = "cuda", feature = "tch"))]
pub(crate) mod nccl;
#[cfg(feature = "tch")]
pub(crate) mod torch;

pub use cast::cast_flex;
pub use collective::{DeviceCollective, RebuildSteps};
pub use decode::{CodedWeight, INDICES_PER_VALUE, decode_flex};
pub use prefetch::Prefetch;
pub use route::{describe, device_mismatch, is_cuda_device, route, same_device};
pub use steps::{
    Deferral, DeviceOp, DevicePending, DeviceStep, Exchange, InFlight, NcclCall, Observer, Phase,
    Sizes, StepKernels, no_nccl, run_steps,
};
