//! Integration tests of kvplan's ops on every backend, through the backend API
//! (`kvplan::generic`, `StepPlan<B>`, `Canary<B>`, primitives of `B: KvPlanBackend`):
//! `Dispatch` on `Device::flex()` (the reference path), and, with the default `vulkan` feature,
//! `Dispatch` on `Device::vulkan` (fused: with the `fusion` feature the dispatched Cube backend is
//! `Fusion<CubeBackend>`) and `CubeBackend` itself (unfused, at the primitive level: the `Tensor`
//! API cannot reach it in a fused build). A smaller suite covers the `Tensor` façade on `Dispatch`
//! (and the decoder's projection kernel, which lives beside kvplan's on the same devices).
//! The Vulkan suites need a Vulkan adapter (Mesa's lavapipe in CI): without one they fail, they do
//! not skip.
//!
//! One test binary on purpose: each file directly under `tests/` links all of Burn.

#[path = "kvplan/attention.rs"]
mod attention;
#[path = "kvplan/bench_probe.rs"]
mod bench_probe;
#[path = "kvplan/canary.rs"]
mod canary;
#[path = "kvplan/common.rs"]
mod common;
#[path = "kvplan/concurrency.rs"]
mod concurrency;
#[path = "kvplan/conformance.rs"]
mod conformance;
#[path = "kvplan/errors.rs"]
mod errors;
#[path = "kvplan/fuzz.rs"]
mod fuzz;
#[path = "kvplan/gather.rs"]
mod gather;
#[path = "kvplan/linear.rs"]
mod linear;
#[cfg(feature = "vulkan")]
#[path = "kvplan/narrow.rs"]
mod narrow;
#[path = "kvplan/paged.rs"]
mod paged;
#[path = "kvplan/plan.rs"]
mod plan;
#[path = "kvplan/slots.rs"]
mod slots;
#[path = "kvplan/tensor_api.rs"]
mod tensor_api;
#[cfg(feature = "cuda")]
#[path = "kvplan/wide.rs"]
mod wide;

/// Devices of the suites.
#[allow(dead_code)]
mod devices {
    use burn_core::backend::DispatchDevice;
    use burn_core::tensor::Device;
    #[cfg(feature = "vulkan")]
    use burn_core::tensor::DeviceKind;

    /// `Dispatch` on Flex.
    pub fn flex() -> DispatchDevice {
        Device::flex().as_dispatch().clone()
    }

    /// `Dispatch` on a Vulkan device (fused).
    #[cfg(feature = "vulkan")]
    pub fn vulkan(kind: DeviceKind) -> DispatchDevice {
        Device::vulkan(kind).as_dispatch().clone()
    }

    /// The Cube backend's own device behind `Device::vulkan` (unfused).
    #[cfg(feature = "vulkan")]
    pub fn vulkan_cube(kind: DeviceKind) -> burn_cubecl::CubeDevice {
        cube(&Device::vulkan(kind))
    }

    /// `Dispatch` on CUDA device 0 (fused).
    #[cfg(feature = "cuda")]
    pub fn cuda() -> DispatchDevice {
        Device::cuda(0).as_dispatch().clone()
    }

    /// The Cube backend's own device behind `Device::cuda(0)` (unfused).
    #[cfg(feature = "cuda")]
    pub fn cuda_cube() -> burn_cubecl::CubeDevice {
        cube(&Device::cuda(0))
    }

    #[cfg(any(feature = "vulkan", feature = "cuda"))]
    fn cube(device: &Device) -> burn_cubecl::CubeDevice {
        match device.as_dispatch() {
            DispatchDevice::Cube(device) => device.clone(),
            #[allow(unreachable_patterns)]
            _ => unreachable!("not a CubeCL device"),
        }
    }
}

/// Instantiates every test for one backend.
macro_rules! suite {
    ($name:ident, $backend:ty, $device:expr, other_device: $other:expr, broadcast: $broadcast:ident, f64_exp: $f64_exp:expr) => {
        mod $name {
            use burn_core::backend::BackendTypes;

            type B = $backend;

            fn device() -> <B as BackendTypes>::Device {
                $device
            }

            #[test]
            fn device_is_usable() {
                let _device = crate::common::shared();
                // Fails (does not skip) when the backend has no device, e.g. no Vulkan adapter.
                let t = crate::common::list::<B>(
                    &[1, -2, i32::MAX as i64],
                    burn_core::tensor::DType::I32,
                    &device(),
                );
                assert_eq!(crate::common::values::<B>(t), vec![1, -2, i32::MAX as i64]);
            }

            #[test]
            fn conformance_gather() {
                let _device = crate::common::shared();
                crate::conformance::gather_file::<B>(&device());
            }

            #[test]
            fn conformance_plan() {
                let _device = crate::common::shared();
                crate::conformance::plan_file::<B>(&device());
            }

            #[test]
            fn conformance_malformed() {
                let _device = crate::common::shared();
                crate::conformance::malformed_file::<B>(&device());
            }

            #[test]
            fn gather_spec_examples() {
                let _device = crate::common::shared();
                crate::gather::spec_examples::<B>(&device());
            }

            #[test]
            fn gather_random_masked() {
                let _device = crate::common::shared();
                crate::gather::random_masked_cases::<B>(&device());
            }

            #[test]
            fn gather_random_segments() {
                let _device = crate::common::shared();
                crate::gather::random_segment_cases::<B>(&device());
            }

            #[test]
            fn gather_large() {
                let _device = crate::common::shared();
                crate::gather::large_cases::<B>(&device());
            }

            #[test]
            fn gather_caller_capacities() {
                let _device = crate::common::shared();
                crate::gather::caller_capacities::<B>(&device());
            }

            #[test]
            fn gather_strided_inputs() {
                let _device = crate::common::shared();
                crate::gather::strided_inputs::<B>(&device());
            }

            #[test]
            fn plan_spec_examples() {
                let _device = crate::common::shared();
                crate::plan::spec_examples::<B>(&device());
            }

            #[test]
            fn plan_random_batches() {
                let _device = crate::common::shared();
                crate::plan::random_plans::<B>(&device());
            }

            #[test]
            fn plan_overflow() {
                let _device = crate::common::shared();
                crate::plan::overflow::<B>(&device());
            }

            #[test]
            fn plan_large_batch() {
                let _device = crate::common::shared();
                crate::plan::large_batch::<B>(&device());
            }

            #[test]
            fn plan_strided_inputs() {
                let _device = crate::common::shared();
                crate::plan::strided_inputs::<B>(&device());
            }

            #[test]
            fn errors_gather() {
                let _device = crate::common::shared();
                crate::errors::gather_errors::<B>(&device());
            }

            #[test]
            fn errors_segments() {
                let _device = crate::common::shared();
                crate::errors::segment_errors::<B>(&device());
            }

            #[test]
            fn errors_dtype() {
                let _device = crate::common::shared();
                crate::errors::dtype_errors::<B>(&device());
            }

            #[test]
            fn errors_device() {
                let _device = crate::common::shared();
                let other: Option<<B as BackendTypes>::Device> = $other;
                match other {
                    Some(other) => {
                        crate::errors::device_errors::<B>(&device(), &other);
                        crate::slots::device_errors::<B>(&device(), &other);
                    }
                    // This backend has a single device: device_mismatch is covered by the unit
                    // tests of `validate`.
                    None => eprintln!("skipping device_mismatch: the backend has one device"),
                }
            }

            #[test]
            fn errors_plan_host() {
                let _device = crate::common::shared();
                crate::errors::plan_host_errors::<B>(&device());
            }

            #[test]
            fn errors_plan_device() {
                let _device = crate::common::shared();
                crate::errors::plan_device_errors::<B>(&device());
            }

            #[test]
            fn errors_plan_past_the_lead() {
                let _device = crate::common::shared();
                crate::errors::plan_errors_past_the_lead::<B>(&device());
            }

            #[test]
            fn errors_negative_values_both_dtypes() {
                let _device = crate::common::shared();
                crate::errors::negative_values_both_dtypes::<B>(&device());
            }

            #[test]
            fn errors_allocation() {
                let _device = crate::common::shared();
                crate::errors::allocation_errors::<B>(&device());
            }

            #[test]
            fn errors_allocation_too_large() {
                let _device = crate::common::shared();
                crate::errors::allocation_too_large::<B>(&device());
            }

            #[test]
            fn concurrency_threads() {
                let _device = crate::common::shared();
                crate::concurrency::threads_on_one_device::<B>(&device());
            }

            #[test]
            fn concurrency_two_devices() {
                let _device = crate::common::shared();
                let other: Option<<B as BackendTypes>::Device> = $other;
                match other {
                    Some(other) => crate::concurrency::threads_on_devices::<B>(&[device(), other]),
                    None => eprintln!("skipping two devices: the backend has one device"),
                }
            }

            #[test]
            fn conformance_canary() {
                let _device = crate::common::shared();
                crate::canary::conformance::<B>(&device());
            }

            #[test]
            fn canary_random_scenarios() {
                let _device = crate::common::shared();
                crate::canary::random_scenarios::<B>(&device());
            }

            #[test]
            fn canary_corruption_kinds() {
                let _device = crate::common::shared();
                crate::canary::corruption_kinds::<B>(&device());
            }

            #[test]
            fn canary_long_chains() {
                let _device = crate::common::shared();
                crate::canary::long_chains::<B>(&device());
            }

            #[test]
            fn canary_ring_overflow() {
                let _device = crate::common::shared();
                crate::canary::ring_overflow::<B>(&device());
            }

            #[test]
            fn canary_plan_write_verify() {
                let _device = crate::common::shared();
                crate::canary::plan_write_verify::<B>(&device());
            }

            #[test]
            fn errors_canary() {
                let _device = crate::common::shared();
                crate::canary::errors::<B>(&device());
            }

            #[test]
            fn conformance_slots() {
                let _device = crate::common::shared();
                crate::slots::conformance_file_runs::<B>(&device());
            }

            #[test]
            fn slots_random_assign() {
                let _device = crate::common::shared();
                crate::slots::random_assign_cases::<B>(&device());
            }

            #[test]
            fn slots_assign_then_gather() {
                let _device = crate::common::shared();
                crate::slots::assign_then_gather::<B>(&device());
            }

            #[test]
            fn slots_assign_layouts() {
                let _device = crate::common::shared();
                crate::slots::assign_layouts::<B>(&device());
            }

            #[test]
            fn errors_assign_values() {
                let _device = crate::common::shared();
                crate::slots::assign_value_errors::<B>(&device());
            }

            #[test]
            fn errors_assign_host() {
                let _device = crate::common::shared();
                crate::slots::assign_host_errors::<B>(&device());
            }

            #[test]
            fn slots_random_stores() {
                let _device = crate::common::shared();
                crate::slots::random_stores::<B>(&device());
            }

            #[test]
            fn slots_store_layouts() {
                let _device = crate::common::shared();
                crate::slots::store_layouts::<B>(&device());
            }

            #[test]
            fn slots_store_clock() {
                let _device = crate::common::shared();
                crate::slots::store_clock::<B>(&device());
            }

            #[test]
            fn errors_store() {
                let _device = crate::common::shared();
                crate::slots::store_errors::<B>(&device());
            }

            #[test]
            fn errors_slot_stores() {
                let _device = crate::common::shared();
                crate::slots::slot_store_errors::<B>(&device());
            }

            #[test]
            fn attention_random() {
                let _device = crate::common::shared();
                crate::attention::random_cases::<B>(&device());
            }

            #[test]
            fn attention_f64() {
                let _device = crate::common::shared();
                crate::attention::f64_cases::<B>(&device(), $f64_exp);
            }

            #[test]
            fn attention_rows_do_not_depend_on_the_batch() {
                let _device = crate::common::shared();
                crate::attention::rows_do_not_depend_on_the_batch::<B>(&device());
            }

            #[test]
            fn attention_after_store() {
                let _device = crate::common::shared();
                crate::attention::store_then_attend::<B>(&device(), $f64_exp);
            }

            #[test]
            fn errors_attention() {
                let _device = crate::common::shared();
                crate::attention::errors::<B>(&device());
            }

            #[test]
            fn fuzz_gather() {
                let _device = crate::common::shared();
                crate::fuzz::family::<B>(kvplan_tools::fuzz::Op::Gather, &device());
            }

            #[test]
            fn fuzz_plan() {
                let _device = crate::common::shared();
                crate::fuzz::family::<B>(kvplan_tools::fuzz::Op::Plan, &device());
            }

            #[test]
            fn fuzz_canary() {
                let _device = crate::common::shared();
                crate::fuzz::family::<B>(kvplan_tools::fuzz::Op::Canary, &device());
            }

            #[test]
            fn fuzz_regression_bf16_views() {
                let _device = crate::common::shared();
                crate::fuzz::bf16_views::<B>(&device());
            }

            #[test]
            fn fuzz_slots() {
                let _device = crate::common::shared();
                crate::fuzz::family::<B>(kvplan_tools::fuzz::Op::Slots, &device());
            }

            #[test]
            fn bench_probe_values() {
                let _device = crate::common::shared();
                crate::bench_probe::computed::<B>(&device());
            }

            #[test]
            fn errors_stride() {
                let _device = crate::common::shared();
                crate::errors::stride::<B>(&device(), crate::errors::Broadcast::$broadcast);
            }
        }
    };
}

suite!(
    flex,
    burn_core::backend::Dispatch,
    crate::devices::flex(),
    other_device: None,
    broadcast: Accepted,
    f64_exp: true
);

#[cfg(feature = "vulkan")]
suite!(
    vulkan,
    burn_core::backend::Dispatch,
    crate::devices::vulkan(burn_core::tensor::DeviceKind::DefaultDevice),
    other_device: Some(crate::devices::vulkan(burn_core::tensor::DeviceKind::Cpu)),
    broadcast: DeviceRefused,
    f64_exp: false
);

// 0.21 refused the broadcast table on the host here (`HostRefused`); 0.22 checks every Cube
// launch's real strides on the device.
#[cfg(feature = "vulkan")]
suite!(
    vulkan_unfused,
    burn_cubecl::CubeBackend,
    crate::devices::vulkan_cube(burn_core::tensor::DeviceKind::DefaultDevice),
    other_device: Some(crate::devices::vulkan_cube(burn_core::tensor::DeviceKind::Cpu)),
    broadcast: DeviceRefused,
    f64_exp: false
);

// GPU-only suites (`--features cuda`), run on the lent GPU: the same tests on the CUDA kernels.
#[cfg(feature = "cuda")]
suite!(
    cuda,
    burn_core::backend::Dispatch,
    crate::devices::cuda(),
    other_device: None,
    broadcast: DeviceRefused,
    f64_exp: true
);

#[cfg(feature = "cuda")]
suite!(
    cuda_unfused,
    burn_cubecl::CubeBackend,
    crate::devices::cuda_cube(),
    other_device: None,
    broadcast: DeviceRefused,
    f64_exp: true
);

/// The `Tensor` façade on one `Device`.
macro_rules! tensor_suite {
    ($name:ident, $device:expr) => {
        mod $name {
            fn device() -> burn_core::tensor::Device {
                $device
            }

            #[test]
            fn tensor_masked_gather() {
                let _device = crate::common::shared();
                crate::tensor_api::masked(&device());
            }

            #[test]
            fn tensor_segment_gather() {
                let _device = crate::common::shared();
                crate::tensor_api::segments(&device());
            }

            #[test]
            fn tensor_plan() {
                let _device = crate::common::shared();
                crate::tensor_api::plan(&device());
            }

            #[test]
            fn tensor_canary() {
                let _device = crate::common::shared();
                crate::tensor_api::canary(&device());
            }

            #[test]
            fn tensor_slots() {
                let _device = crate::common::shared();
                crate::tensor_api::slots(&device());
            }

            #[test]
            fn paged_values() {
                let _device = crate::common::shared();
                crate::paged::values(&device());
            }

            #[test]
            fn paged_errors() {
                let _device = crate::common::shared();
                crate::paged::errors(&device());
            }

            #[test]
            fn paged_property() {
                let _device = crate::common::shared();
                crate::paged::property(&device());
            }

            #[test]
            fn paged_faults() {
                let _device = crate::common::shared();
                crate::paged::faults(&device());
            }

            #[test]
            fn decoder_projection() {
                let _device = crate::common::shared();
                crate::linear::matches_reference(&device());
            }

            #[test]
            fn paged_capture() {
                let _device = crate::common::exclusive();
                crate::paged::capture(&device());
                crate::paged::capture_verify(&device());
            }
        }
    };
}

tensor_suite!(tensor_flex, burn_core::tensor::Device::flex());

#[cfg(feature = "vulkan")]
tensor_suite!(
    tensor_vulkan,
    burn_core::tensor::Device::vulkan(burn_core::tensor::DeviceKind::DefaultDevice)
);

#[cfg(feature = "cuda")]
tensor_suite!(tensor_cuda, burn_core::tensor::Device::cuda(0));

// The `kvplan` binary answers bad files and flags with a line each, never a panic.
#[test]
fn binary_bad_input() {
    let _device = crate::common::shared();
    crate::conformance::binary_bad_input();
}

// `tests/data/slots.jsonl` is what its generator writes.
#[test]
fn slots_file_is_generated() {
    let _device = crate::common::shared();
    crate::slots::file_is_generated();
}

// `index_range` end to end, on a device that acts as one without 64-bit indexing (a child process:
// the setting is read once per process).
#[cfg(feature = "vulkan")]
#[test]
fn narrow_device_vulkan() {
    let _device = crate::common::shared();
    use burn_core::tensor::DeviceKind;
    if crate::narrow::in_child() {
        let unfused = crate::devices::vulkan_cube(DeviceKind::DefaultDevice);
        crate::narrow::checks::<burn_cubecl::CubeBackend>(&unfused);
        let fused = crate::devices::vulkan(DeviceKind::DefaultDevice);
        crate::narrow::checks::<burn_core::backend::Dispatch>(&fused);
    } else {
        crate::narrow::run_in_child("narrow_device_vulkan");
    }
}

// 64-bit indexing, on a table past 2^32 elements (17 GB: CUDA only; one backend at a time).
#[cfg(feature = "cuda")]
#[test]
fn wide_tables_cuda() {
    let _device = crate::common::shared();
    crate::wide::wide_tables::<burn_cubecl::CubeBackend>(&crate::devices::cuda_cube());
    crate::wide::wide_tables::<burn_core::backend::Dispatch>(&crate::devices::cuda());
}
