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
pub mod error;
pub mod gather;
mod layout;
/// The backend extension trait's primitives and helpers, for backend-generic code.
pub mod ops;
pub mod paged;
/// The host reference of every op, for tests and conformance.
pub mod reference;
mod room;
pub mod slots;
mod status;
mod validate;

pub use deferred::{Status, check_all};
pub use error::{Error, Result};
pub use ops::KvPlanBackend;
pub use paged::{
    CanaryConfig, KvViolation, PagedKv, PagedKvConfig, RequestId, StepGraph, StepInputs, StepReport,
};
