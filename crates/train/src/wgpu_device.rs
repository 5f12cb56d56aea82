//! `--backend wgpu`: Burn's CubeCL backend on wgpu's default adapter, one device that every
//! rank thread of the process shares. It is brought up once, eagerly, so that a machine
//! without a driver gets an error naming it instead of a panic inside CubeCL at the first op.

use std::sync::OnceLock;

use burn::tensor::wgpu::WgpuInitError;
use burn::tensor::{Device, DeviceKind, FloatDType};
use burn_parallel_parallelizer::MixedPrecisionConfig;

use crate::error::{TrainError, flag_error};

/// The wgpu device `--backend wgpu` runs on, and the adapter wgpu picked for it.
#[derive(Debug, Clone)]
pub struct WgpuAdapter {
    /// The Burn device (not autodiff); every rank of the process uses this one.
    pub device: Device,
    /// The graphics API the device came up on (`Vulkan`, `Metal`, `Dx12`, `Gl`).
    pub api: String,
    /// The adapter's name as its driver reports it (`llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub name: String,
    /// What kind of adapter it is (`DiscreteGpu`, `IntegratedGpu`, `Cpu`, ...).
    pub kind: String,
    /// The driver's name and version.
    pub driver: String,
}

/// What to install when wgpu finds no adapter.
const MISSING_DRIVER: &str = "wgpu needs a Vulkan (Linux, Windows), Metal (macOS) or DX12 \
     driver; on a Linux machine without a GPU install Mesa's Vulkan driver, llvmpipe \
     (`apt-get install mesa-vulkan-drivers libvulkan1`)";

/// The process's wgpu device, brought up on first call (wgpu's default adapter: the GPU it
/// prefers, else a software one such as llvmpipe; `CUBECL_WGPU_DEFAULT_DEVICE=Cpu` picks the
/// CPU one). An error names the missing driver.
pub fn wgpu_adapter() -> Result<&'static WgpuAdapter, String> {
    static ADAPTER: OnceLock<Result<WgpuAdapter, String>> = OnceLock::new();
    ADAPTER.get_or_init(init).as_ref().map_err(Clone::clone)
}

fn init() -> Result<WgpuAdapter, String> {
    let (device, setup) = Device::wgpu_options()
        .device_kind(DeviceKind::DefaultDevice)
        .init_with_setup()
        .map_err(|e| match e {
            WgpuInitError::Registration { .. } => format!(
                "the wgpu runtime was already started outside the trainer ({e}): create wgpu \
                 tensors on `wgpu_adapter()`'s device only; in a build with the `wgpu` feature \
                 Burn's `Device::default()` (which its optimizer records use) is wgpu, so set \
                 BURN_DEVICE to the backend you train on (e.g. BURN_DEVICE=flex)"
            ),
            e => format!("no wgpu device could be created ({e}): {MISSING_DRIVER}"),
        })?;
    let info = setup.adapter.get_info();
    Ok(WgpuAdapter {
        device,
        api: format!("{:?}", info.backend),
        name: info.name,
        kind: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info),
    })
}

/// Refuses a mixed-precision dtype the wgpu device has no kernels for (WGSL has no bf16; f16
/// needs the adapter's `shader-f16`), before a rank starts, naming the dtype and the adapter.
pub(crate) fn check_dtypes(mp: &MixedPrecisionConfig) -> Result<(), TrainError> {
    let adapter = wgpu_adapter().map_err(|e| flag_error("--backend", format!("wgpu: {e}")))?;
    let dtypes = [mp.param_dtype, mp.reduce_dtype, mp.output_dtype];
    match dtypes
        .into_iter()
        .flatten()
        .find(|d| !adapter.device.supports_dtype(FloatDType::from(*d)))
    {
        Some(d) => Err(flag_error(
            "--backend",
            format!(
                "wgpu: {} ({}) has no {d} kernels: keep {d} out of the mixed-precision policy \
                 (--param-dtype, --reduce-dtype, mp_policy.output_dtype) or use --backend flex",
                adapter.name, adapter.api
            ),
        )),
        None => Ok(()),
    }
}
