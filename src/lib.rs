//! kvplan: the KV-cache bookkeeping of an LLM server as Burn 0.22 backend extensions: the masked
//! and segment `req_to_token` gathers, the slot assignment and KV stores that write what they
//! read, paged attention over the slots a gather returns, the kv-canary plan, and the canary's
//! write and verify, with CubeCL kernels on the Cube backend (CUDA, wgpu/Vulkan) and the host
//! reference elsewhere.
//!
//! Most users touch one object, [`PagedKv`]: every layer's K|V pool, `req_to_token`, the slot
//! and row allocators (shared prefixes), the store's scratch and the canary, with a begin /
//! per-layer attend / end step ([`paged`], `examples/paged_kv.rs`). The ops it composes stay
//! public for engines that keep their own state.
//!
//! Data flows one way: public API ([`paged`] over [`gather`], [`slots`], [`attention`],
//! [`canary`]) -> host rules -> [`KvPlanBackend`] -> (kernels | [`reference`](mod@reference)).

#![warn(missing_docs)]

// The README's examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

pub mod attention;
pub mod canary;
mod deferred;
mod error;
pub mod gather;
mod layout;
mod ops;
pub mod paged;
pub mod reference;
mod room;
pub mod slots;
mod status;
mod validate;

pub use attention::{KeyRuns, paged_attention, paged_attention_kv};
pub use canary::{
    Canary, CanaryLaunch, KernelKind, PlanInputs, RealKvSource, SourceBytes, StepPlan, WriteInputs,
    plan, plan_deferred,
};
pub use deferred::{Status, check_all};
pub use error::{Dims, Error, Result, Site};
pub use gather::{
    DeferredGather, GatherOptions, masked_gather, masked_gather_deferred, segment_gather,
    segment_gather_deferred,
};
pub use layout::SourceLayout;
pub use paged::{
    CanaryConfig, KvViolation, PagedKv, PagedKvConfig, RequestId, StepInputs, StepReport,
};
pub use ops::{
    AssignPrimitive, AttendedKvPrimitive, AttendedPrimitive, CanaryLaunchPrimitive,
    CanaryPrimitive, GatherPrimitive, KeyRunsPrimitive, KvBytes, KvPlanBackend, KvRows, LaunchMeta,
    NewRowsPrimitive, OptionalInt, PlanInputsPrimitive, PlanOutput, StoreCheckPrimitive,
    StoreScratchPrimitive, StoreTargets, StoreWritePrimitive, VerifyPlanPrimitive,
    WriteInputsPrimitive, WritePlanPrimitive, data_to_i64,
};
pub use slots::{
    Assigned, Attended, AttendedKv, KvStore, StoreSlots, Stored, segment_assign,
    segment_assign_deferred,
};
