//! kvplan: KV-cache bookkeeping ops for Burn — masked `req_to_token` gather and the kv-canary plan —
//! with CubeCL kernels on CubeCL backends and a host reference everywhere else.
//!
//! Data flows one way: public API ([`gather`], [`canary`]) -> [`validate`] -> [`ops::KvPlanBackend`]
//! -> (kernels | [`reference`]).

#![warn(missing_docs)]

pub mod backends;
pub mod bench;
pub mod canary;
pub mod conformance;
#[cfg(feature = "cuda")]
pub mod cupti;
pub mod demo;
pub mod error;
pub mod gather;
pub mod ops;
pub mod reference;
pub mod status;
pub mod validate;

pub use canary::{
    Canary, CanaryLaunch, PlanInputs, PlanStatus, RealKvSource, VerifyPlan, WriteInputs, WritePlan,
    plan, plan_deferred,
};
pub use error::{Error, Result};
pub use gather::{
    CapacityGather, GatherStatus, masked_gather, masked_gather_with_capacity, segment_gather,
    segment_gather_with_capacity,
};
pub use ops::KvPlanBackend;
