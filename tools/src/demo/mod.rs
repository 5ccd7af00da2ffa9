//! The main job: a synthetic speculative-decoding serving trace.
//!
//! A small scheduler (`trace`) serves a few dozen requests with continuous batching, prefix
//! caching, CUDA-graph padding, ragged draft windows and a sliding-window KV group. Every step
//! goes through kvplan's public API on the chosen backend (`engine`): the draft window through
//! `masked_gather`, the accepted suffix through `segment_gather` (each also deferred), and
//! the kv-canary plans of the full and the SWA group, which are allocated once and refilled in
//! place. Every result of every step is compared with the host reference (`check`), and the
//! run ends with per-op timings and a pass line.

mod check;
mod engine;
mod rng;
mod select;

pub use select::{Choice, PROBE_SUBCOMMAND, choose, probe_here};
mod timing;
mod trace;

use std::process::ExitCode;
use std::time::Instant;

use kvplan::KvPlanBackend;
use kvplan::ops::Violations;

use crate::backends::{BackendName, OnBackend, with_backend};
use check::CrossCheck;
use engine::{Engine, StepOutputs};
use timing::Timings;
use trace::{Step, Trace, Workload};

/// A progress line every this many steps.
const PROGRESS_EVERY: usize = 25;

/// Step after which `--inject-corruption` hands a live KV slot to a stray write.
const CORRUPTION_STEP: usize = 60;

/// Runs the demo on `backend`, or on the best backend present. With `inject_corruption`, one
/// live KV slot is overwritten mid-run and the canary must report it.
///
/// `Ok(ExitCode::FAILURE)` when any op disagreed with the reference or the canary's verdict is
/// wrong; `Err` when the backend cannot run or an op failed outright.
pub fn run(backend: Option<BackendName>, inject_corruption: bool) -> Result<ExitCode, String> {
    let choice = select::choose(backend)?;
    println!("demo: backend {} ({})", choice.name, choice.reason);
    let workload = Workload::default();
    describe(&workload);

    let started = Instant::now();
    let outcome = with_backend(
        choice.name,
        Drive {
            workload: &workload,
            inject_corruption,
        },
    )??;
    let elapsed = started.elapsed();

    println!();
    print!("{}", outcome.timings.table());
    println!(
        "(host wall time per call: the `+ check` rows include their one status read-back; the"
    );
    println!(" others are launch + sync, their status.check() has its own row)");
    let check = &outcome.check;
    println!(
        "trace ran in {:.2} s; {} values compared with the reference; the full-group verify plan \
         overflowed (enable=0, verify skipped) on {} of {} steps",
        elapsed.as_secs_f64(),
        check.values_compared(),
        check.full_overflows(),
        outcome.steps,
    );
    let summary = format!(
        "demo: {} steps, {} requests, backend {}",
        outcome.steps, workload.num_requests, choice.name
    );
    let canary_ok = report_canary(&outcome.canary);
    if check.mismatches() > 0 || !canary_ok {
        println!("{} mismatching fields; the first ones:", check.mismatches());
        for mismatch in check.first_mismatches() {
            println!("  {mismatch}");
        }
        println!("{summary}, ops disagreed with the reference or the canary: FAIL");
        return Ok(ExitCode::FAILURE);
    }
    println!("{summary}, all ops matched the reference and the canary was right: PASS");
    Ok(ExitCode::SUCCESS)
}

/// What a finished run hands back for the report.
struct Outcome {
    steps: usize,
    timings: Timings,
    check: CrossCheck,
    canary: CanaryOutcome,
}

/// The canary's verdict: the violations found, and the slot that was corrupted, if any.
struct CanaryOutcome {
    violations: Violations,
    /// `(slot, position)` of the injected corruption.
    injected: Option<(i64, i64)>,
}

/// Prints the canary's findings; true when they are right: none on a clean run, the corrupted
/// slot and position after an injection.
fn report_canary(canary: &CanaryOutcome) -> bool {
    let violations = &canary.violations;
    println!(
        "canary: {} violation(s) recorded ({} dropped by the ring)",
        violations.recorded, violations.dropped
    );
    for row in violations.rows.iter().take(8) {
        println!(
            "  kernel_kind {} slot {} position {}: stored token {} (expected {}), {:?}",
            row.kernel_kind,
            row.slot,
            row.position,
            row.stored_token,
            row.expected_token,
            row.fail_reasons
        );
    }
    match canary.injected {
        None => violations.recorded == 0,
        Some((slot, position)) => {
            let found = violations
                .rows
                .iter()
                .any(|row| row.slot == slot && row.position == position);
            println!(
                "canary: injected corruption at slot {slot} (position {position}) {}",
                if found {
                    "was reported"
                } else {
                    "was NOT reported"
                }
            );
            found
        }
    }
}

/// A live, committed slot of a running request to corrupt: the middle of the first decode row's
/// prefix (the request keeps running, so a later verify lists it).
fn victim(step: &Step, workload: &Workload) -> Option<(i64, i64)> {
    let cols = workload.table_cols();
    (0..step.decode_rows).find_map(|r| {
        let prefix = step.prefix_lens[r];
        let row = step.req_pool_indices[r] as usize;
        let position = prefix / 2;
        (prefix >= 8).then(|| (step.req_to_token[row * cols + position as usize], position))
    })
}

/// [`drive`] as a backend-generic job.
struct Drive<'a> {
    workload: &'a Workload,
    inject_corruption: bool,
}

impl OnBackend for Drive<'_> {
    type Output = Result<Outcome, String>;

    fn run<B: KvPlanBackend>(self, device: B::Device) -> Self::Output {
        drive::<B>(device, self.workload, self.inject_corruption)
    }
}

/// The trace, step by step, on backend `B`.
fn drive<B: KvPlanBackend>(
    device: B::Device,
    workload: &Workload,
    inject_corruption: bool,
) -> Result<Outcome, String> {
    let mut trace = Trace::new(workload.clone())?;
    let mut engine = Engine::<B>::new(device, workload, &trace.shared_prefix())?;
    let mut check = CrossCheck::new(workload);
    let mut steps = 0;
    let mut injected = None;
    while let Some(step) = trace.next_step()? {
        let outputs = engine
            .run_step(&step)
            .map_err(|error| format!("step {}: {error}", step.index))?;
        check.step(&step, &outputs);
        if step.index % PROGRESS_EVERY == 0 {
            println!("{}", progress(&step, &outputs));
        }
        if inject_corruption && injected.is_none() && step.index >= CORRUPTION_STEP {
            injected = victim(&step, workload);
            if let Some((slot, position)) = injected {
                println!(
                    "  step {:>3}: injecting corruption: a stray write into live KV slot {slot} (position {position})",
                    step.index
                );
                engine.corrupt_slot(slot, position)?;
            }
        }
        steps += 1;
    }
    let violations = engine.violations()?;
    Ok(Outcome {
        steps,
        timings: engine.into_timings(),
        check,
        canary: CanaryOutcome {
            violations,
            injected,
        },
    })
}

fn describe(workload: &Workload) {
    println!(
        "demo: {} requests, pool rows 1..={} of req_to_token [{}, {}] (row 0: padding), {} KV slots, \
         SWA window {} through a {}-entry LUT, draft windows of 1..={} tokens, CUDA-graph batch sizes {:?}",
        workload.num_requests,
        workload.pool_size,
        workload.table_rows(),
        workload.table_cols(),
        workload.kv_slots(),
        workload.swa_window,
        workload.kv_slots(),
        workload.max_draft,
        workload.batch_buckets,
    );
}

fn progress(step: &Step, outputs: &StepOutputs) -> String {
    // Decode rows come first in the batch, then prefill rows.
    let (decode, rest) = step.accepted_lengths.split_at(step.decode_rows);
    let accepted_drafts: i64 = decode.iter().sum();
    let prefilled: i64 = rest.iter().sum();
    let full = &outputs.full_plan;
    let full_verify = if full.enable == 1 {
        full.verify_num_valid.to_string()
    } else {
        format!("overflow (>{})", full.verify_num_valid)
    };
    format!(
        "  step {:>3}: bs {:>2} = {:>2} decode + {} prefill + {} padding; draft {:>2} -> accepted {:>2}, \
         prefill {:>3}; verify entries full {}, swa {}",
        step.index,
        step.batch_size(),
        step.decode_rows,
        step.prefill_rows,
        step.padding_rows(),
        outputs.draft_slots.len(),
        accepted_drafts,
        prefilled,
        full_verify,
        outputs.swa_plan.verify_num_valid,
    )
}
