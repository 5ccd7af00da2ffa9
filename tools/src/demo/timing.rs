//! Host wall time per public call, and the summary table.

use std::fmt::Write as _;
use std::time::Duration;

/// The timed public calls of one step, in table order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `masked_gather` on the draft window, its status read back (the exact slots).
    MaskedGather,
    /// `masked_gather` on the draft window into a capacity, launch + `B::sync`.
    MaskedGatherCapacity,
    /// `segment_gather` on the accepted suffix, its status read back (the exact slots).
    SegmentGather,
    /// `segment_gather` on the accepted suffix into a capacity, launch + `B::sync`.
    SegmentGatherCapacity,
    /// `plan` for the full group, its status read back.
    PlanFull,
    /// `plan` for the SWA group, launch + `B::sync` (its status read with the others).
    PlanDeferredSwa,
    /// `status.check()` of the three capacity/deferred calls above (one transfer each).
    StatusCheck,
    /// `Canary::write` of the step's new tokens, launch + `B::sync`.
    CanaryWrite,
    /// `Canary::verify` of the full group's plan, launch + `B::sync`.
    CanaryVerify,
}

impl Op {
    const ALL: [Op; 9] = [
        Op::MaskedGather,
        Op::MaskedGatherCapacity,
        Op::SegmentGather,
        Op::SegmentGatherCapacity,
        Op::PlanFull,
        Op::PlanDeferredSwa,
        Op::StatusCheck,
        Op::CanaryWrite,
        Op::CanaryVerify,
    ];

    /// The name in the table and in error messages.
    pub fn name(self) -> &'static str {
        match self {
            Op::MaskedGather => "masked_gather + check",
            Op::MaskedGatherCapacity => "masked_gather [capacity]",
            Op::SegmentGather => "segment_gather + check",
            Op::SegmentGatherCapacity => "segment_gather [capacity]",
            Op::PlanFull => "plan + check [full]",
            Op::PlanDeferredSwa => "plan [swa]",
            Op::StatusCheck => "status.check",
            Op::CanaryWrite => "canary.write [full]",
            Op::CanaryVerify => "canary.verify [full]",
        }
    }

    /// Calls that read nothing back: their time only means something after a device sync.
    pub fn needs_sync(self) -> bool {
        matches!(
            self,
            Op::MaskedGatherCapacity
                | Op::SegmentGatherCapacity
                | Op::PlanDeferredSwa
                | Op::CanaryWrite
                | Op::CanaryVerify
        )
    }

    fn slot(self) -> usize {
        Op::ALL.iter().position(|&op| op == self).unwrap_or(0)
    }
}

/// Every recorded duration, per op.
#[derive(Debug, Default)]
pub struct Timings {
    samples: [Vec<Duration>; Op::ALL.len()],
}

impl Timings {
    /// Records one call of `op`.
    pub fn record(&mut self, op: Op, elapsed: Duration) {
        self.samples[op.slot()].push(elapsed);
    }

    /// The table: op | calls | median us | p90 us | total ms.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<30} {:>6} {:>10} {:>10} {:>10}",
            "op", "calls", "median us", "p90 us", "total ms"
        );
        for op in Op::ALL {
            let mut samples = self.samples[op.slot()].clone();
            if samples.is_empty() {
                continue;
            }
            samples.sort_unstable();
            let total: Duration = samples.iter().sum();
            let _ = writeln!(
                out,
                "{:<30} {:>6} {:>10.0} {:>10.0} {:>10.1}",
                op.name(),
                samples.len(),
                micros(percentile(&samples, 50)),
                micros(percentile(&samples, 90)),
                total.as_secs_f64() * 1e3,
            );
        }
        out
    }
}

/// Nearest-rank percentile of sorted, non-empty samples.
fn percentile(sorted: &[Duration], percent: usize) -> Duration {
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted[rank - 1]
}

fn micros(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e6
}
