//! The low-level ops [`PagedKv`](crate::PagedKv) composes, for engines that keep their own
//! state: one convention for all of them. Each op checks its host rules at once (a typed error,
//! nothing enqueued), enqueues its launches and returns its outputs with a [`Status`] holding the
//! value rules checked on the device; nothing is read back until [`Status::check`] or one
//! [`check_all`] for the whole step. Tables, pools and canaries move in and come back, written
//! in place.
//!
//! - `req_to_token` gathers: [`masked_gather`], [`segment_gather`] ([`Gathered`]).
//! - Slot assignment: [`segment_assign`] ([`Assigned`]).
//! - KV stores: [`KvStore::slots`] once a step, then [`StoreSlots::store`] or
//!   [`StoreSlots::store_and_attend`] per layer ([`Attended`]).
//! - Paged attention: [`KeyRuns::new`] once a step, then [`paged_attention`] per layer.
//! - The kv-canary: [`plan`] into a [`StepPlan`], then [`Canary::write`] and [`Canary::verify`],
//!   read by [`Canary::violations`].
//!
//! Backend-generic code calls [`KvPlanBackend`](crate::KvPlanBackend)'s methods on primitives
//! (`kvplan::backend`), as burn-vision's users do; the host reference is
//! [`reference`](crate::reference).

pub use crate::attention::{KeyRuns, paged_attention};
pub use crate::canary::{
    Canary, CanaryLaunch, CanaryState, FailReasons, KernelKind, PlanInputs, RealKvHashMode,
    RealKvSource, SourceBytes, SourceLayout, StepPlan, VerifyPlan, Violation, Violations,
    WriteInputs, WritePlan, plan, read_plans,
};
pub use crate::deferred::{Status, check_all};
pub use crate::gather::{GatherOptions, Gathered, masked_gather, segment_gather};
pub use crate::slots::{Assigned, Attended, KvStore, StoreSlots, segment_assign};
