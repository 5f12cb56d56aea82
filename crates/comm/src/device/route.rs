//! Which exchange a collective of a group takes for a tensor on a device: NCCL on the buffer
//! for a CUDA tensor on a group of the nccl engine, the group's engine for everything else.
//! The only code besides the buffer adapters that knows backends.

use burn::tensor::Device;

use crate::transport::group::ProcessGroup;

use super::steps::Exchange;

/// How a collective of `group` exchanges a tensor on `device`.
pub fn route(device: &Device, group: &ProcessGroup) -> Exchange {
    #[cfg(feature = "nccl")]
    if is_cuda_device(device) && crate::transport::nccl::nccl_comm(group).is_some() {
        return Exchange::Nccl(group.clone());
    }
    let _ = device;
    Exchange::Engine(group.clone())
}

/// Whether `device` is a CUDA device of Burn's CubeCL or LibTorch backend (with or without
/// autodiff).
pub fn is_cuda_device(device: &Device) -> bool {
    #[cfg(any(feature = "cuda", feature = "tch"))]
    {
        use burn::backend::DispatchDevice;
        let inner = device.clone().inner();
        #[cfg(feature = "cuda")]
        if matches!(
            inner.as_dispatch(),
            DispatchDevice::Cube(burn_cubecl::CubeDevice::Cuda(_))
        ) {
            return true;
        }
        #[cfg(feature = "tch")]
        #[allow(deprecated)] // burn-tch is deprecated in Burn 0.22, still shipped
        if matches!(
            inner.as_dispatch(),
            DispatchDevice::LibTorch(burn_tch::LibTorchDevice::Cuda(_))
        ) {
            return true;
        }
    }
    let _ = device;
    false
}

/// Whether two devices are the same for Burn's ops: the same hardware and, with autodiff, the
/// same gradient-checkpointing strategy (Burn's own `==` ignores the strategy, but an op mixing
/// two strategies panics).
pub fn same_device(a: &Device, b: &Device) -> bool {
    a == b && a.gradient_checkpointing_strategy() == b.gradient_checkpointing_strategy()
}

/// A message naming both devices when `found` (where `what` is) is not `expected` (where the
/// model is), with the fix; `None` when they match.
pub fn device_mismatch(what: &str, found: &Device, expected: &Device) -> Option<String> {
    (!same_device(found, expected)).then(|| {
        format!(
            "{what} is on {} but the model is on {}: build inputs on the device the model was \
             parallelized for (`MeshContext::device()`)",
            describe(found),
            describe(expected)
        )
    })
}

/// A device with its gradient-checkpointing strategy (Burn's `Debug` leaves it out).
pub fn describe(device: &Device) -> String {
    match device.gradient_checkpointing_strategy() {
        Some(strategy) => format!("{device:?} (autodiff, gradient checkpointing {strategy:?})"),
        None => format!("{device:?}"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)]
    use super::*;
    use crate::transport::error::CollectiveError;
    use crate::transport::threads::launch;

    /// Without CUDA every tensor exchanges through the group's engine.
    #[test]
    fn cpu_tensors_exchange_through_the_engine() {
        let errors = launch(2, |ctx| {
            let group = ctx.world()?;
            let cpu = Device::ndarray();
            assert!(!is_cuda_device(&cpu));
            assert!(matches!(route(&cpu, &group), Exchange::Engine(_)));
            Ok::<_, CollectiveError>(())
        });
        assert!(errors.is_ok(), "{errors:?}");
    }
}

#[cfg(test)]
mod device_tests {
    #![allow(deprecated)]
    use super::*;

    /// Burn's `==` ignores the checkpointing strategy; ops mixing two strategies panic, so the
    /// check does not.
    #[test]
    fn a_checkpointing_device_is_not_the_plain_one() {
        let plain = Device::flex().autodiff();
        let ckpt = plain.clone().gradient_checkpointing();
        assert!(same_device(&plain, &plain.clone()));
        assert!(!same_device(&plain, &ckpt));
        assert!(!same_device(&plain, &Device::flex()));
        let msg = device_mismatch("the input", &plain, &ckpt).unwrap();
        assert!(
            msg.contains("gradient checkpointing") && msg.contains("MeshContext::device()"),
            "{msg}"
        );
        assert!(device_mismatch("x", &ckpt, &ckpt).is_none());
    }
}
