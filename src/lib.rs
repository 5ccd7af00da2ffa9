//! kvplan: the KV-cache bookkeeping of an LLM server as Burn 0.22 backend extensions: the masked
//! and segment `req_to_token` gathers, the kv-canary plan, and the canary's write and verify, with
//! CubeCL kernels on the Cube backend (CUDA, wgpu/Vulkan) and the host reference elsewhere.
//!
//! Data flows one way: public API ([`gather`], [`canary`]) -> host rules -> [`KvPlanBackend`]
//! -> (kernels | [`reference`]).

#![warn(missing_docs)]

pub mod canary;
mod error;
pub mod gather;
mod layout;
mod ops;
pub mod reference;
mod status;
mod validate;

pub use canary::{
    Canary, CanaryLaunch, KernelKind, PlanInputs, RealKvSource, SourceBytes, StepPlan, WriteInputs,
    plan, plan_deferred,
};
pub use error::{Dims, Error, Result, Site};
pub use gather::{
    DeferredGather, GatherOptions, Status, masked_gather, masked_gather_deferred, segment_gather,
    segment_gather_deferred,
};
pub use layout::SourceLayout;
pub use ops::{
    CanaryLaunchPrimitive, CanaryPrimitive, GatherPrimitive, KvBytes, KvPlanBackend, LaunchMeta,
    OptionalInt, PlanInputsPrimitive, PlanOutput, VerifyPlanPrimitive, WriteInputsPrimitive,
    WritePlanPrimitive,
};
