//! kvplan: the KV-cache bookkeeping of an LLM server as Burn 0.22 backend extensions: the masked
//! and segment `req_to_token` gathers, the slot assignment and KV stores that write what they
//! read, paged attention over the slots a gather returns, the kv-canary plan, and the canary's
//! write and verify, with CubeCL kernels on the Cube backend (CUDA, wgpu/Vulkan) and the host
//! reference elsewhere.
//!
//! Most users touch one object, [`PagedKv`]: every layer's K|V pool, `req_to_token`, the slot
//! and row allocators (shared prefixes), the store's scratch and the canary, with a begin /
//! per-layer attend / end step ([`paged`], `examples/paged_kv.rs`). The ops it composes stay
//! public, with one convention, in [`ops`] for engines that keep their own state.
//!
//! Data flows one way: [`PagedKv`] -> [`ops`] -> host rules -> [`KvPlanBackend`] -> (kernels |
//! [`reference`](mod@reference)).

#![warn(missing_docs)]

// The README's examples compile as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

mod attention;
pub mod backend;
mod canary;
mod deferred;
pub mod error;
mod gather;
mod layout;
pub mod ops;
pub mod paged;
/// The host reference of every op, for tests and conformance.
pub mod reference;
mod room;
mod slots;
mod status;
mod validate;

/// The ops on any backend's primitives, with their host rules (kvplan's own tools run them on
/// unfused backends): not a stable API.
#[doc(hidden)]
pub mod generic {
    pub use crate::attention::generic::*;
    pub use crate::gather::generic::*;
    pub use crate::slots::generic::*;
}

pub use backend::KvPlanBackend;
pub use deferred::{Status, check_all};
pub use error::{Error, Result};
pub use paged::{
    CanaryConfig, KvViolation, PagedKv, PagedKvConfig, RequestId, StepGraph, StepInputs, StepReport,
};
