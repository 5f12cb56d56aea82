//! Kernel fusion on the CubeCL backends: what `enable_compile` turns on.
//!
//! Burn's answer to `torch.compile` is its fusion backend: with the `fusion` cargo feature a
//! CubeCL tensor (wgpu, cuda) is a lazy `Fusion<CubeBackend>` one, whose operations queue up
//! and run as fused kernels (element-wise chains, matmul with its epilogue, reductions) when a
//! value is needed. A collective reads its tensor, so it is a fusion boundary: the stream runs
//! up to it, and the exchanged result enters the stream again.
//!
//! Burn chooses its fusion optimizations once per process, before the first tensor on a
//! CubeCL device (its registry of fusers is process-wide and sealed when fusion's service
//! starts). So fused or eager is a process's choice too: [`set_kernel_fusion`] makes it (the
//! trainer does at start from `enable_compile`), and `parallelize_model` checks that
//! `enable_compile` agrees with it. Eager in a `fusion` build means Burn's fusers are removed:
//! every operation runs alone, the kernels of a build without the feature.

use std::sync::Mutex;

use burn::tensor::Device;

mod counter;
pub use counter::{FusionCounter, FusionCounts};

/// How a process runs the kernels of its CubeCL devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelFusion {
    /// Burn's fusion: operations queue and run as fused kernels (`enable_compile = true`).
    Fused,
    /// Every operation runs as its own kernel (`enable_compile = false`).
    Eager,
}

/// Why kernel fusion cannot be what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// `enable_compile` in a build without Burn's fusion.
    #[error(
        "enable_compile: this build has no kernel fusion; build with the `fusion` cargo feature \
         beside `wgpu` or `cuda` (e.g. `--features \"cuda fusion\"`), or leave enable_compile \
         false"
    )]
    NotBuilt,
    /// `enable_compile` on a device whose backend Burn does not fuse.
    #[error(
        "enable_compile on {device}: only Burn's CubeCL backends (wgpu, cuda) fuse kernels; flex, \
         ndarray and tch run every operation as it comes, so leave enable_compile false there"
    )]
    NoFusionOn {
        /// The device, as `collectives::describe` names it.
        device: String,
    },
    /// The process already runs its CubeCL devices the other way.
    #[error(
        "kernel fusion {wanted:?} asked, but this process's CubeCL devices already run \
         {running:?}: Burn sets its fusion optimizations once per process, so run compiled and \
         eager models in separate processes"
    )]
    Conflict {
        /// What was asked.
        wanted: KernelFusion,
        /// What the process runs.
        running: KernelFusion,
    },
    /// Eager was asked after Burn's fusion started with its fusers.
    #[error(
        "enable_compile = false, but Burn's fusion already runs this process's CubeCL devices \
         fused (a tensor was created on one before the choice was made): call \
         `burn_parallel::comm::compile::set_kernel_fusion(KernelFusion::Eager)` at the start of \
         the program, before the model is built, or set enable_compile = true"
    )]
    AlreadyFused,
}

/// Whether this build has Burn's fusion on a CubeCL backend (features `fusion` and `wgpu` or
/// `cuda`).
pub const FUSION_BUILT: bool = cfg!(all(
    feature = "fusion",
    any(feature = "wgpu", feature = "cuda")
));

/// The process's choice, once made: it mirrors Burn's process-wide fuser registry, which
/// cannot be read back.
static CHOICE: Mutex<Option<KernelFusion>> = Mutex::new(None);

/// Makes the process's choice; call it before the first tensor on a CubeCL device (Eager
/// after that is [`CompileError::AlreadyFused`]). Asking again for the same is a no-op; for the
/// other, [`CompileError::Conflict`]. Without fusion built, `Eager` is what runs and `Fused` is
/// [`CompileError::NotBuilt`].
pub fn set_kernel_fusion(wanted: KernelFusion) -> Result<(), CompileError> {
    if !FUSION_BUILT {
        return match wanted {
            KernelFusion::Eager => Ok(()),
            KernelFusion::Fused => Err(CompileError::NotBuilt),
        };
    }
    let mut choice = CHOICE.lock().unwrap_or_else(|e| e.into_inner());
    match *choice {
        Some(running) if running == wanted => return Ok(()),
        Some(running) => return Err(CompileError::Conflict { wanted, running }),
        None => {}
    }
    if wanted == KernelFusion::Eager {
        remove_fusers()?;
    }
    *choice = Some(wanted);
    Ok(())
}

/// The process's choice, if one was made ([`set_kernel_fusion`]). With fusion built and no
/// choice made, Burn fuses.
pub fn kernel_fusion() -> Option<KernelFusion> {
    match FUSION_BUILT {
        true => *CHOICE.lock().unwrap_or_else(|e| e.into_inner()),
        false => Some(KernelFusion::Eager),
    }
}

#[cfg(all(feature = "fusion", any(feature = "wgpu", feature = "cuda")))]
fn remove_fusers() -> Result<(), CompileError> {
    use burn_cubecl::fusion::{BUILTIN_NAMES, RegistryError, remove};
    for name in BUILTIN_NAMES {
        remove(name).map_err(|e| match e {
            RegistryError::ServiceRunning => CompileError::AlreadyFused,
            RegistryError::DuplicateOptimization { .. } => unreachable!("removal adds nothing"),
        })?;
    }
    Ok(())
}

#[cfg(not(all(feature = "fusion", any(feature = "wgpu", feature = "cuda"))))]
fn remove_fusers() -> Result<(), CompileError> {
    Ok(())
}

/// Whether `device` belongs to Burn's CubeCL backend (wgpu, cuda; with or without autodiff).
pub fn is_cube_device(device: &Device) -> bool {
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    {
        use burn::backend::DispatchDevice;
        matches!(
            device.clone().inner().as_dispatch(),
            DispatchDevice::Cube(_)
        )
    }
    #[cfg(not(any(feature = "wgpu", feature = "cuda")))]
    {
        let _ = device;
        false
    }
}

/// What `enable_compile` asks of a run on `device`, checked against the build and the process:
/// on, it needs fusion built and a CubeCL device, and settles the process fused; off, on a
/// CubeCL device of a fusion build, it settles the process eager.
pub fn check_compile(enable_compile: bool, device: &Device) -> Result<(), CompileError> {
    settle_kernel_fusion(enable_compile, is_cube_device(device), || {
        crate::device::describe(device)
    })
}

/// [`check_compile`] for a backend chosen before its device exists (the trainer's
/// `--backend`, settled before any rank starts): `cube` says whether it is a CubeCL one, `name`
/// names it in the error.
pub fn settle_kernel_fusion(
    enable_compile: bool,
    cube: bool,
    name: impl FnOnce() -> String,
) -> Result<(), CompileError> {
    match (enable_compile, cube) {
        (true, _) if !FUSION_BUILT => Err(CompileError::NotBuilt),
        (true, false) => Err(CompileError::NoFusionOn { device: name() }),
        (true, true) => set_kernel_fusion(KernelFusion::Fused),
        (false, true) => set_kernel_fusion(KernelFusion::Eager),
        (false, false) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compile_on_a_host_backend_is_refused_by_name() {
        let device = Device::flex();
        let err = check_compile(true, &device).unwrap_err();
        match FUSION_BUILT {
            true => assert!(
                matches!(err, CompileError::NoFusionOn { .. }) && err.to_string().contains("flex"),
                "{err}"
            ),
            false => assert_eq!(err, CompileError::NotBuilt),
        }
        assert_eq!(check_compile(false, &device), Ok(()));
    }
}
