//! kvplan's tools: the conformance runner, the benchmarks and the serving demo behind the
//! `kvplan` binary, on any backend that implements [`kvplan::KvPlanBackend`].
//!
//! Everything here runs at Burn's primitive level (`B::int_from_data`, `IntTensor<B>`): the same
//! code drives `Dispatch` (the `Tensor` API's backend: Flex, fused Vulkan, fused CUDA) and the
//! unfused `CubeBackend`, which a build with fusion cannot reach through `Tensor`.

#![warn(missing_docs)]

pub mod backends;
pub mod bench;
pub mod chart;
pub mod conformance;
#[cfg(feature = "cuda")]
pub mod cupti;
pub mod demo;
pub mod fuzz;
pub mod generate;
pub mod prim;

pub use backends::{BackendName, OnBackend, with_backend};
