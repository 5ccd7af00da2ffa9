//! The kv-canary: per-step plans of which KV slots to verify and where new tokens' records go
//! (`plan`), and the canary that writes those records and verifies them (`Canary`).

mod plan;
mod state;

pub use crate::layout::SourceLayout;
pub use crate::reference::RealKvHashMode;
pub use crate::reference::canary::CanaryState;
pub use plan::{PlanInputs, StepPlan, VerifyPlan, WritePlan, plan, read_plans};
pub use state::{
    Canary, CanaryLaunch, FailReasons, KernelKind, RealKvSource, SourceBytes, Violation,
    Violations, WriteInputs,
};
