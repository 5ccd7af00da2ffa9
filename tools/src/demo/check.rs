//! The cross-check: every op of every step against the host oracle ([`kvplan::reference`]) run on
//! the same inputs, plus a few invariants that the scheduler itself knows.

use std::fmt;

use super::engine::{CapacityResult, DRAFT_CONTEXT, StepOutputs};
use super::trace::{DUMMY_SLOT, Step, Workload};
use kvplan::reference::{self, ExpectedTokens, PlanArgs, PlanBuffers, Table};

/// How many mismatches are kept with their details.
const KEPT: usize = 8;

/// One field where the backend and the reference (or the scheduler) disagree.
#[derive(Debug, Clone)]
pub struct Mismatch {
    step: usize,
    op: &'static str,
    field: String,
    index: Option<usize>,
    expected: String,
    got: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "step {} {} {}", self.step, self.op, self.field)?;
        if let Some(index) = self.index {
            write!(f, "[{index}]")?;
        }
        write!(f, ": expected {}, got {}", self.expected, self.got)
    }
}

/// Running totals: values compared, mismatching fields, the first few in detail.
#[derive(Debug, Default)]
struct Tally {
    compared: u64,
    mismatches: usize,
    kept: Vec<Mismatch>,
}

impl Tally {
    fn record(&mut self, mismatch: Mismatch) {
        self.mismatches += 1;
        if self.kept.len() < KEPT {
            self.kept.push(mismatch);
        }
    }

    fn scalar<T: PartialEq + fmt::Display>(
        &mut self,
        step: usize,
        op: &'static str,
        field: &str,
        expected: T,
        got: T,
    ) {
        self.compared += 1;
        if expected != got {
            self.record(Mismatch {
                step,
                op,
                field: field.into(),
                index: None,
                expected: expected.to_string(),
                got: got.to_string(),
            });
        }
    }

    fn slice(&mut self, step: usize, op: &'static str, field: &str, expected: &[i64], got: &[i64]) {
        self.compared += expected.len() as u64;
        if let Some(index) = expected.iter().zip(got).position(|(e, g)| e != g) {
            self.record(Mismatch {
                step,
                op,
                field: field.into(),
                index: Some(index),
                expected: expected[index].to_string(),
                got: got[index].to_string(),
            });
        } else if expected.len() != got.len() {
            self.record(Mismatch {
                step,
                op,
                field: format!("{field} length"),
                index: None,
                expected: expected.len().to_string(),
                got: got.len().to_string(),
            });
        }
    }

    /// The reference refused inputs the scheduler built as valid: a trace bug, reported like a
    /// mismatch so it cannot pass silently.
    fn reference_error(&mut self, step: usize, op: &'static str, error: kvplan::Error) {
        self.record(Mismatch {
            step,
            op,
            field: "reference result".into(),
            index: None,
            expected: "Ok".into(),
            got: error.to_string(),
        });
    }

    fn capacity(&mut self, step: usize, op: &'static str, expected: &[i64], got: &CapacityResult) {
        self.scalar(step, op, "status count", expected.len(), got.checked_count);
        self.scalar(
            step,
            op,
            "count tensor",
            expected.len() as i64,
            got.count_tensor,
        );
        self.slice(step, op, "out[..count]", expected, &got.values);
    }

    /// The fields a downstream verify/write reads: stale entries past `verify_num_valid` and
    /// seeds past `bs` are left out (spec `canary-plan.md` §4 leaves them stale).
    fn plan(
        &mut self,
        step: usize,
        op: &'static str,
        expected: &PlanBuffers,
        got: &PlanBuffers,
        bs: usize,
    ) {
        self.scalar(
            step,
            op,
            "verify_num_valid",
            expected.verify_num_valid,
            got.verify_num_valid,
        );
        self.scalar(step, op, "enable", expected.enable, got.enable);
        if expected.enable == 1 {
            let valid = usize::try_from(expected.verify_num_valid).unwrap_or(0);
            let head = |values: &[i64]| values[..valid.min(values.len())].to_vec();
            let fields = [
                (
                    "verify_slot_indices",
                    &expected.verify_slot_indices,
                    &got.verify_slot_indices,
                ),
                (
                    "verify_expected_tokens",
                    &expected.verify_expected_tokens,
                    &got.verify_expected_tokens,
                ),
                (
                    "verify_expected_positions",
                    &expected.verify_expected_positions,
                    &got.verify_expected_positions,
                ),
                (
                    "verify_prev_slot_indices",
                    &expected.verify_prev_slot_indices,
                    &got.verify_prev_slot_indices,
                ),
            ];
            for (field, expected, got) in fields {
                self.slice(step, op, field, &head(expected), &head(got));
            }
        }
        self.slice(
            step,
            op,
            "write_offsets",
            &expected.write_offsets,
            &got.write_offsets,
        );
        let seeds = |values: &[i64]| values[..bs.min(values.len())].to_vec();
        self.slice(
            step,
            op,
            "write_seed_slot_indices[..bs]",
            &seeds(&expected.write_seed_slot_indices),
            &seeds(&got.write_seed_slot_indices),
        );
        self.scalar(
            step,
            op,
            "write_num_valid_reqs",
            expected.write_num_valid_reqs,
            got.write_num_valid_reqs,
        );
    }
}

/// The reference side of the demo: its own copies of both plan pairs, advanced step by step
/// exactly like the device's, and the tally.
#[derive(Debug)]
pub struct CrossCheck {
    table_shape: [usize; 2],
    swa_window: i32,
    full: PlanBuffers,
    swa: PlanBuffers,
    tally: Tally,
    full_overflows: usize,
}

impl CrossCheck {
    /// Fresh reference plans with the device plans' capacities.
    pub fn new(workload: &Workload) -> Self {
        let write_capacity = workload.write_capacity();
        Self {
            table_shape: [workload.table_rows(), workload.table_cols()],
            swa_window: workload.swa_window_size(),
            full: PlanBuffers::fresh(workload.full_verify_capacity, write_capacity),
            swa: PlanBuffers::fresh(workload.swa_verify_capacity(), write_capacity),
            tally: Tally::default(),
            full_overflows: 0,
        }
    }

    /// Runs the reference on `step`'s inputs and compares every output of the backend.
    pub fn step(&mut self, step: &Step, got: &StepOutputs) {
        let n = step.index;
        let [rows, cols] = self.table_shape;
        let table = Table::new(rows, cols, &step.req_to_token);
        let batch = step.batch_size();
        let tally = &mut self.tally;

        // Draft window, both modes; the scheduler knows which slots it wrote there.
        let draft_shape = [batch, step.draft_cols];
        let masked = |capacity| {
            reference::masked_gather(
                table,
                &step.req_pool_indices,
                &step.draft_pos2d,
                &step.draft_mask,
                draft_shape,
                capacity,
                DRAFT_CONTEXT,
            )
        };
        match masked(None) {
            Ok(expected) => {
                tally.slice(n, "masked_gather", "values", &expected, &got.draft_slots);
                tally.slice(
                    n,
                    "trace",
                    "draft window slots",
                    &step.draft_slots,
                    &expected,
                );
            }
            Err(error) => tally.reference_error(n, "masked_gather", error),
        }
        match masked(Some(batch * step.draft_cols)) {
            Ok(expected) => {
                tally.capacity(n, "masked_gather", &expected, &got.draft_slots_capacity);
            }
            Err(error) => tally.reference_error(n, "masked_gather", error),
        }

        // Accepted suffix, both modes.
        let segments = |capacity| {
            reference::segment_gather(
                table,
                &step.req_pool_indices,
                Some(&step.accepted_start),
                &step.accepted_lengths,
                capacity,
            )
        };
        match segments(None) {
            Ok(expected) => {
                tally.slice(
                    n,
                    "segment_gather",
                    "values",
                    &expected,
                    &got.accepted_slots,
                );
                tally.slice(
                    n,
                    "trace",
                    "accepted suffix slots",
                    &step.accepted_slots,
                    &expected,
                );
            }
            Err(error) => tally.reference_error(n, "segment_gather", error),
        }
        match segments(Some(step.accepted_capacity())) {
            Ok(expected) => {
                tally.capacity(n, "segment_gather", &expected, &got.accepted_slots_capacity);
            }
            Err(error) => tally.reference_error(n, "segment_gather", error),
        }

        // Plans: the same inputs the engine passed, into reference buffers that carry the same
        // history (stale entries included).
        let base = PlanArgs {
            req_pool_indices: &step.req_pool_indices,
            prefix_lens: &step.prefix_lens,
            extend_seq_lens: &step.extend_seq_lens,
            req_to_token: table,
            swa_window_size: 0,
            full_to_swa: None,
            expected_tokens: None,
            position_offset: 0,
        };
        let full_args = PlanArgs {
            expected_tokens: Some(ExpectedTokens {
                pool: Table::new(rows, cols, &step.expected_tokens),
                valid_lens: &step.expected_tokens_valid_lens,
            }),
            ..base
        };
        match reference::plan(&full_args, &mut self.full) {
            Ok(()) => tally.plan(n, "plan [full]", &self.full, &got.full_plan, batch),
            Err(error) => tally.reference_error(n, "plan [full]", error),
        }
        if self.full.enable == 0 {
            self.full_overflows += 1;
        }
        let swa_args = PlanArgs {
            swa_window_size: self.swa_window,
            full_to_swa: Some(&step.full_to_swa),
            ..base
        };
        match reference::plan(&swa_args, &mut self.swa) {
            Ok(()) => {
                tally.plan(n, "plan [swa]", &self.swa, &got.swa_plan, batch);
                // Every token inside a window still has its SWA slot: the scheduler's eviction
                // never outruns the plan.
                let valid = usize::try_from(self.swa.verify_num_valid).unwrap_or(0);
                let evicted = self.swa.verify_slot_indices[..valid]
                    .iter()
                    .filter(|&&s| s == DUMMY_SLOT)
                    .count();
                tally.scalar(n, "trace", "SWA verify slots already evicted", 0, evicted);
            }
            Err(error) => tally.reference_error(n, "plan [swa]", error),
        }
    }

    /// Mismatching fields so far.
    pub fn mismatches(&self) -> usize {
        self.tally.mismatches
    }

    /// The first few mismatches, in order.
    pub fn first_mismatches(&self) -> &[Mismatch] {
        &self.tally.kept
    }

    /// Values compared so far.
    pub fn values_compared(&self) -> u64 {
        self.tally.compared
    }

    /// Steps whose full-group verify plan overflowed (`enable = 0`, verify skipped).
    pub fn full_overflows(&self) -> usize {
        self.full_overflows
    }
}
