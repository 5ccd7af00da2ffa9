//! Integration tests of kvplan's public tensor API on every backend: `burn_flex::Flex` (the
//! reference path), and, with the default `vulkan` feature, the fused and unfused wgpu SPIR-V
//! backends. The Vulkan suites need a Vulkan adapter (Mesa's lavapipe in CI): without one they
//! fail, they do not skip.
//!
//! One test binary on purpose: each file directly under `tests/` links all of Burn.

#[path = "kvplan/canary.rs"]
mod canary;
#[path = "kvplan/common.rs"]
mod common;
#[path = "kvplan/conformance.rs"]
mod conformance;
#[path = "kvplan/errors.rs"]
mod errors;
#[path = "kvplan/gather.rs"]
mod gather;
#[cfg(feature = "vulkan")]
#[path = "kvplan/narrow.rs"]
mod narrow;
#[path = "kvplan/plan.rs"]
mod plan;
#[cfg(feature = "cuda")]
#[path = "kvplan/wide.rs"]
mod wide;

/// Instantiates every test for one backend.
macro_rules! suite {
    ($name:ident, $backend:ty, $devty:ty, $device:expr, other_device: $other:expr, broadcast: $broadcast:ident) => {
        mod $name {
            type B = $backend;

            fn device() -> $devty {
                $device
            }

            #[test]
            fn device_is_usable() {
                // Fails (does not skip) when the backend has no device, e.g. no Vulkan adapter.
                let t = crate::common::list::<B>(
                    &[1, -2, i32::MAX as i64],
                    burn_tensor::DType::I32,
                    &device(),
                );
                assert_eq!(crate::common::values(t), vec![1, -2, i32::MAX as i64]);
            }

            #[test]
            fn conformance_gather() {
                crate::conformance::gather_file::<B>(&device());
            }

            #[test]
            fn conformance_plan() {
                crate::conformance::plan_file::<B>(&device());
            }

            #[test]
            fn gather_spec_examples() {
                crate::gather::spec_examples::<B>(&device());
            }

            #[test]
            fn gather_random_masked() {
                crate::gather::random_masked_cases::<B>(&device());
            }

            #[test]
            fn gather_random_segments() {
                crate::gather::random_segment_cases::<B>(&device());
            }

            #[test]
            fn gather_large() {
                crate::gather::large_cases::<B>(&device());
            }

            #[test]
            fn gather_caller_capacities() {
                crate::gather::caller_capacities::<B>(&device());
            }

            #[test]
            fn gather_strided_inputs() {
                crate::gather::strided_inputs::<B>(&device());
            }

            #[test]
            fn plan_spec_examples() {
                crate::plan::spec_examples::<B>(&device());
            }

            #[test]
            fn plan_random_batches() {
                crate::plan::random_plans::<B>(&device());
            }

            #[test]
            fn plan_overflow() {
                crate::plan::overflow::<B>(&device());
            }

            #[test]
            fn plan_large_batch() {
                crate::plan::large_batch::<B>(&device());
            }

            #[test]
            fn plan_strided_inputs() {
                crate::plan::strided_inputs::<B>(&device());
            }

            #[test]
            fn errors_gather() {
                crate::errors::gather_errors::<B>(&device());
            }

            #[test]
            fn errors_segments() {
                crate::errors::segment_errors::<B>(&device());
            }

            #[test]
            fn errors_dtype() {
                crate::errors::dtype_errors::<B>(&device());
            }

            #[test]
            fn errors_device() {
                let other: Option<$devty> = $other;
                match other {
                    Some(other) => crate::errors::device_errors::<B>(&device(), &other),
                    // This backend has a single device: device_mismatch is covered by the unit
                    // tests of `validate`.
                    None => eprintln!("skipping device_mismatch: the backend has one device"),
                }
            }

            #[test]
            fn errors_plan_host() {
                crate::errors::plan_host_errors::<B>(&device());
            }

            #[test]
            fn errors_plan_device() {
                crate::errors::plan_device_errors::<B>(&device());
            }

            #[test]
            fn errors_plan_past_the_lead() {
                crate::errors::plan_errors_past_the_lead::<B>(&device());
            }

            #[test]
            fn errors_negative_values_both_dtypes() {
                crate::errors::negative_values_both_dtypes::<B>(&device());
            }

            #[test]
            fn errors_allocation() {
                crate::errors::allocation_errors::<B>(&device());
            }

            #[test]
            fn conformance_canary() {
                crate::canary::conformance::<B>(&device());
            }

            #[test]
            fn canary_random_scenarios() {
                crate::canary::random_scenarios::<B>(&device());
            }

            #[test]
            fn canary_corruption_kinds() {
                crate::canary::corruption_kinds::<B>(&device());
            }

            #[test]
            fn canary_long_chains() {
                crate::canary::long_chains::<B>(&device());
            }

            #[test]
            fn canary_ring_overflow() {
                crate::canary::ring_overflow::<B>(&device());
            }

            #[test]
            fn canary_plan_write_verify() {
                crate::canary::plan_write_verify::<B>(&device());
            }

            #[test]
            fn errors_canary() {
                crate::canary::errors::<B>(&device());
            }

            #[test]
            fn errors_stride() {
                crate::errors::stride::<B>(&device(), crate::errors::Broadcast::$broadcast);
            }
        }
    };
}

suite!(flex, burn_flex::Flex, burn_flex::FlexDevice, burn_flex::FlexDevice, other_device: None, broadcast: Accepted);

#[cfg(feature = "vulkan")]
suite!(
    vulkan,
    kvplan::backends::Vulkan,
    burn_wgpu::WgpuDevice,
    burn_wgpu::WgpuDevice::DefaultDevice,
    other_device: Some(burn_wgpu::WgpuDevice::Cpu),
    broadcast: DeviceRefused
);

#[cfg(feature = "vulkan")]
suite!(
    vulkan_unfused,
    kvplan::backends::VulkanUnfused,
    burn_wgpu::WgpuDevice,
    burn_wgpu::WgpuDevice::DefaultDevice,
    other_device: Some(burn_wgpu::WgpuDevice::Cpu),
    broadcast: HostRefused
);

// GPU-only suites (`--features cuda`), run on the lent GPU: the same tests on the CUDA kernels.
#[cfg(feature = "cuda")]
suite!(
    cuda,
    kvplan::backends::Cuda,
    burn_cuda::CudaDevice,
    burn_cuda::CudaDevice::default(),
    other_device: None,
    broadcast: DeviceRefused
);

#[cfg(feature = "cuda")]
suite!(
    cuda_unfused,
    kvplan::backends::CudaUnfused,
    burn_cuda::CudaDevice,
    burn_cuda::CudaDevice::default(),
    other_device: None,
    broadcast: HostRefused
);

// `index_range` end to end, on a device that acts as one without 64-bit indexing (a child process:
// the setting is read once per process).
#[cfg(feature = "vulkan")]
#[test]
fn narrow_device_vulkan() {
    if crate::narrow::in_child() {
        let device = burn_wgpu::WgpuDevice::DefaultDevice;
        crate::narrow::checks::<kvplan::backends::VulkanUnfused>(&device);
        crate::narrow::checks::<kvplan::backends::Vulkan>(&device);
    } else {
        crate::narrow::run_in_child("narrow_device_vulkan");
    }
}

// 64-bit indexing, on a table past 2^32 elements (17 GB: CUDA only; one backend at a time).
#[cfg(feature = "cuda")]
#[test]
fn wide_tables_cuda() {
    let device = burn_cuda::CudaDevice::default();
    crate::wide::wide_tables::<kvplan::backends::CudaUnfused>(&device);
    crate::wide::wide_tables::<kvplan::backends::Cuda>(&device);
}
