//! The backends the `kvplan` binary can run on, by name.

use core::fmt;
use std::str::FromStr;

/// A backend the CLI can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendName {
    /// The host reference, through Burn's Flex CPU backend (trait default methods).
    Reference,
    /// Flex, Burn's CPU backend (same path as `Reference`).
    Flex,
    /// wgpu with SPIR-V on Vulkan, fused (`burn_wgpu::Vulkan`).
    Vulkan,
    /// wgpu with SPIR-V on Vulkan, without fusion (`CubeBackend` directly).
    VulkanUnfused,
    /// CUDA, fused (`burn_cuda::Cuda`).
    Cuda,
    /// CUDA without fusion.
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

/// Fused Vulkan (SPIR-V) backend.
#[cfg(feature = "vulkan")]
pub type Vulkan = burn_wgpu::Vulkan<f32, i32>;
/// Unfused Vulkan (SPIR-V) backend.
#[cfg(feature = "vulkan")]
pub type VulkanUnfused = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u8>;
/// Fused CUDA backend.
#[cfg(feature = "cuda")]
pub type Cuda = burn_cuda::Cuda<f32, i32>;
/// Unfused CUDA backend.
#[cfg(feature = "cuda")]
pub type CudaUnfused = burn_cubecl::CubeBackend<cubecl::cuda::CudaRuntime, f32, i32, u8>;

/// Runs `$body` with `B` bound to the named backend and `device` to its default device, or
/// evaluates to `Err` when the backend is not compiled in.
#[macro_export]
macro_rules! with_backend {
    ($name:expr, |$device:ident : $b:ident| $body:expr) => {{
        use $crate::backends::BackendName;
        #[allow(unreachable_patterns)]
        match $name {
            BackendName::Reference | BackendName::Flex => {
                type $b = burn_flex::Flex;
                let $device = burn_flex::FlexDevice::default();
                Ok($body)
            }
            #[cfg(feature = "vulkan")]
            BackendName::Vulkan => {
                type $b = $crate::backends::Vulkan;
                let $device = burn_wgpu::WgpuDevice::default();
                Ok($body)
            }
            #[cfg(feature = "vulkan")]
            BackendName::VulkanUnfused => {
                type $b = $crate::backends::VulkanUnfused;
                let $device = burn_wgpu::WgpuDevice::default();
                Ok($body)
            }
            #[cfg(feature = "cuda")]
            BackendName::Cuda => {
                type $b = $crate::backends::Cuda;
                let $device = burn_cuda::CudaDevice::default();
                Ok($body)
            }
            #[cfg(feature = "cuda")]
            BackendName::CudaUnfused => {
                type $b = $crate::backends::CudaUnfused;
                let $device = burn_cuda::CudaDevice::default();
                Ok($body)
            }
            other => Err(format!(
                "backend {other} is not compiled in (enable its cargo feature)"
            )),
        }
    }};
}
