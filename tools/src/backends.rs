//! The backends the `kvplan` binary can run on, by name, and [`with_backend`], which runs a
//! backend-generic [`OnBackend`] job on the named one.

use core::fmt;
use std::str::FromStr;

use burn_core::backend::Dispatch;
use burn_core::tensor::Device;
use kvplan::KvPlanBackend;

use crate::bench::extension::HostProbe;

/// A backend the CLI can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendName {
    /// The host reference: `Dispatch` on the Flex CPU device (the trait's default bodies).
    Reference,
    /// Flex, Burn's CPU backend (same path as `Reference`).
    Flex,
    /// Vulkan (wgpu, SPIR-V), fused: `Dispatch` on `Device::vulkan`.
    Vulkan,
    /// Vulkan without fusion: `CubeBackend` directly, at the primitive level.
    VulkanUnfused,
    /// CUDA, fused: `Dispatch` on `Device::cuda(0)`.
    Cuda,
    /// CUDA without fusion: `CubeBackend` directly, at the primitive level.
    CudaUnfused,
}

impl FromStr for BackendName {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Ok(match name {
            "reference" => Self::Reference,
            "flex" => Self::Flex,
            "vulkan" => Self::Vulkan,
            "vulkan-unfused" => Self::VulkanUnfused,
            "cuda" => Self::Cuda,
            "cuda-unfused" => Self::CudaUnfused,
            other => {
                return Err(format!(
                    "unknown backend {other:?} (reference, flex, vulkan, vulkan-unfused, cuda, cuda-unfused)"
                ));
            }
        })
    }
}

impl fmt::Display for BackendName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Reference => "reference",
            Self::Flex => "flex",
            Self::Vulkan => "vulkan",
            Self::VulkanUnfused => "vulkan-unfused",
            Self::Cuda => "cuda",
            Self::CudaUnfused => "cuda-unfused",
        };
        f.write_str(name)
    }
}

/// A job generic over the backend: [`with_backend`] calls `run` with the named backend as `B`
/// and its default device.
pub trait OnBackend {
    /// What the job returns.
    type Output;

    /// Runs the job on backend `B`, device `device` (every backend here also has the host
    /// bench's probe ops).
    fn run<B: KvPlanBackend + HostProbe>(self, device: B::Device) -> Self::Output;
}

/// The unfused Cube backend (no `Fusion`, no `Dispatch`).
#[cfg(any(feature = "vulkan", feature = "cuda"))]
pub type CubeUnfused = burn_cubecl::CubeBackend;

/// The cubecl device behind a `Device` of the Cube backend.
#[cfg(any(feature = "vulkan", feature = "cuda"))]
fn cube_device(device: &Device) -> burn_cubecl::CubeDevice {
    use burn_core::backend::DispatchDevice;
    match device.as_dispatch() {
        DispatchDevice::Cube(device) => device.clone(),
        #[allow(unreachable_patterns)]
        _ => unreachable!("a Vulkan or CUDA device is a Cube device"),
    }
}

/// Runs `job` on the named backend and its default device, or `Err` when the backend is not
/// compiled in.
///
/// `reference` and `flex` are `Dispatch` on `Device::flex()`; `vulkan` and `cuda` are `Dispatch`
/// on their device (fused in this crate's builds); the `-unfused` ones are `CubeBackend` on the
/// same cubecl device.
pub fn with_backend<V: OnBackend>(name: BackendName, job: V) -> Result<V::Output, String> {
    #[allow(unreachable_patterns)]
    match name {
        BackendName::Reference | BackendName::Flex => {
            Ok(job.run::<Dispatch>(Device::flex().as_dispatch().clone()))
        }
        #[cfg(feature = "vulkan")]
        BackendName::Vulkan => Ok(job.run::<Dispatch>(vulkan().as_dispatch().clone())),
        #[cfg(feature = "vulkan")]
        BackendName::VulkanUnfused => Ok(job.run::<CubeUnfused>(cube_device(&vulkan()))),
        #[cfg(feature = "cuda")]
        BackendName::Cuda => Ok(job.run::<Dispatch>(Device::cuda(0).as_dispatch().clone())),
        #[cfg(feature = "cuda")]
        BackendName::CudaUnfused => Ok(job.run::<CubeUnfused>(cube_device(&Device::cuda(0)))),
        other => Err(format!(
            "backend {other} is not compiled in (enable its cargo feature)"
        )),
    }
}

#[cfg(feature = "vulkan")]
fn vulkan() -> Device {
    Device::vulkan(burn_core::tensor::DeviceKind::DefaultDevice)
}
