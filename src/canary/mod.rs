//! The kv-canary: per-step plans of which KV slots to verify and where new tokens' records go.

mod plan;

pub use plan::{PlanInputs, PlanStatus, VerifyPlan, WritePlan, plan, plan_deferred, read_plans};
