//! The device side of the demo: one step's calls through kvplan's public API on backend `B`,
//! each timed, plus the read-backs that the cross-check needs (not timed).

use std::time::Instant;

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::DType;
use kvplan::generic::{exact, masked_gather, segment_gather};
use kvplan::ops::{
    Canary, CanaryLaunch, KernelKind, PlanInputs, StepPlan, Violations, WriteInputs, WritePlan,
    plan, read_plans,
};
use kvplan::ops::{GatherOptions, Gathered};
use kvplan::reference::PlanBuffers;
use kvplan::{Error, KvPlanBackend};

use super::timing::{Op, Timings};
use super::trace::{NewTokens, Step, Workload};
use crate::prim;

/// Context of the draft-window gather: sglang's DFlash call site, whose messages users search for.
pub const DRAFT_CONTEXT: &str = "DFLASH target hidden KV append";

/// A deferred gather, read back: the first `count` values and both views of `count`.
#[derive(Debug, Clone)]
pub struct CapacityResult {
    /// `out[0..count]` (the tail past `count` is unspecified, so it is dropped).
    pub values: Vec<i64>,
    /// `count` as `status.check()` returned it.
    pub checked_count: usize,
    /// `count` as the device tensor holds it.
    pub count_tensor: i64,
}

/// Everything one step produced on the device, as host copies.
#[derive(Debug, Clone)]
pub struct StepOutputs {
    /// `masked_gather` over the draft window.
    pub draft_slots: Vec<i64>,
    /// `masked_gather` over the draft window (default capacity `R * C`).
    pub draft_slots_capacity: CapacityResult,
    /// `segment_gather` over the accepted suffix.
    pub accepted_slots: Vec<i64>,
    /// `segment_gather` over the accepted suffix (capacity: the step's extends).
    pub accepted_slots_capacity: CapacityResult,
    /// The full group's plans after `plan`.
    pub full_plan: PlanBuffers,
    /// The SWA group's plans after `plan` (its status checked with the step's others).
    pub swa_plan: PlanBuffers,
}

/// A verify/write plan pair: allocated once, filled in place every step.
fn allocate_plans<B: KvPlanBackend>(
    verify_capacity: usize,
    write_capacity: usize,
    device: &B::Device,
) -> Result<StepPlan<B>, String> {
    StepPlan::allocate_on(verify_capacity, write_capacity, device)
        .map_err(op_error("StepPlan::allocate_on"))
}

/// The device-resident state of the demo: two plan pairs and the timings.
pub struct Engine<B: KvPlanBackend> {
    device: B::Device,
    table_shape: [usize; 2],
    kv_slots: usize,
    swa_window: i32,
    full: StepPlan<B>,
    swa: StepPlan<B>,
    /// The full KV pool's canary: written for every new token, verified against every plan.
    canary: Canary<B>,
    timings: Timings,
}

/// sglang's launch tags of the full group's canary ops.
const WRITE_KIND: KernelKind = KernelKind::HEAD_K_FULL;
const VERIFY_KIND: KernelKind = KernelKind::HEAD_V_FULL;
/// Violation rows the demo's ring holds.
const RING_CAPACITY: usize = 256;

impl<B: KvPlanBackend> Engine<B> {
    /// Allocates the full group's and the SWA group's plans and the canary on `device`, and
    /// writes the canary records of the prefix cache's shared prompt.
    pub fn new(device: B::Device, workload: &Workload, shared: &NewTokens) -> Result<Self, String> {
        let write_capacity = workload.write_capacity();
        let full = allocate_plans::<B>(workload.full_verify_capacity, write_capacity, &device)?;
        let swa = allocate_plans::<B>(workload.swa_verify_capacity(), write_capacity, &device)?;
        let mut canary = Canary::allocate_on(workload.kv_slots(), 32, RING_CAPACITY, &device)
            .map_err(op_error("Canary::allocate_on"))?;
        let len = shared.slots.len() as i64;
        let prompt = one_request_plan::<B>(len, &device)?;
        canary
            .write(
                &prompt,
                write_inputs::<B>(shared, &device),
                &CanaryLaunch::new(WRITE_KIND),
            )
            .map_err(op_error("canary.write"))?;
        Ok(Self {
            canary,
            table_shape: [workload.table_rows(), workload.table_cols()],
            kv_slots: workload.kv_slots(),
            swa_window: workload.swa_window_size(),
            device,
            full,
            swa,
            timings: Timings::default(),
        })
    }

    /// Everything timed, once the run is over.
    pub fn into_timings(self) -> Timings {
        self.timings
    }

    /// The canary's violation ring, read back.
    pub fn violations(&self) -> Result<Violations, String> {
        self.canary
            .violations()
            .map_err(op_error("canary.violations"))
    }

    /// Simulates an allocator bug: another request's write lands in live slot `slot` (same
    /// position, a different token, a fresh chain), as when a slot is reused while referenced.
    pub fn corrupt_slot(&mut self, slot: i64, position: i64) -> Result<(), String> {
        let d = &self.device;
        let plan = one_request_plan::<B>(1, d)?;
        let stray = NewTokens {
            ids: vec![-42],
            positions: vec![position],
            slots: vec![slot],
        };
        let launch = CanaryLaunch::new(WRITE_KIND);
        self.canary
            .write(&plan, write_inputs::<B>(&stray, d), &launch)
            .map_err(op_error("canary.write"))
    }

    /// Uploads the step's inputs, runs every op on them and reads the results back.
    pub fn run_step(&mut self, step: &Step) -> Result<StepOutputs, String> {
        let Self {
            device,
            table_shape,
            kv_slots,
            swa_window,
            full,
            swa,
            canary,
            timings,
        } = self;
        let batch = step.batch_size();

        // Dtypes as a serving engine holds them (sglang: int32 tables, int64 per-request
        // lengths); the ops take either, so nothing is cast at the call sites.
        let req_to_token = upload::<B>(&step.req_to_token, &table_shape[..], DType::I32, device);
        let expected_tokens =
            upload::<B>(&step.expected_tokens, &table_shape[..], DType::I32, device);
        let full_to_swa = upload::<B>(&step.full_to_swa, &[*kv_slots], DType::I64, device);
        let req_pool_indices = upload::<B>(&step.req_pool_indices, &[batch], DType::I64, device);
        let prefix_lens = upload::<B>(&step.prefix_lens, &[batch], DType::I64, device);
        let extend_seq_lens = upload::<B>(&step.extend_seq_lens, &[batch], DType::I64, device);
        let valid_lens = upload::<B>(
            &step.expected_tokens_valid_lens,
            &[batch],
            DType::I64,
            device,
        );
        let draft_shape = [batch, step.draft_cols];
        let draft_pos2d = upload::<B>(&step.draft_pos2d, &draft_shape, DType::I64, device);
        let draft_mask = prim::bools::<B>(&step.draft_mask, &draft_shape, device);
        let accepted_start = upload::<B>(&step.accepted_start, &[batch], DType::I64, device);
        let accepted_lengths = upload::<B>(&step.accepted_lengths, &[batch], DType::I64, device);
        let draft_options = GatherOptions::new().context(DRAFT_CONTEXT);

        // Draft window: exact mode (one read-back), then deferred mode at the static
        // CUDA-graph shape (no read-back until its status is checked).
        let draft_slots = timed::<B, _>(timings, device, Op::MaskedGather, || {
            masked_gather::<B>(
                req_to_token.clone(),
                req_pool_indices.clone(),
                draft_pos2d.clone(),
                draft_mask.clone(),
                &draft_options,
            )
            .and_then(exact::<B>)
        })?;
        let draft_capacity = timed::<B, _>(timings, device, Op::MaskedGatherCapacity, || {
            masked_gather::<B>(
                req_to_token.clone(),
                req_pool_indices.clone(),
                draft_pos2d,
                draft_mask,
                &draft_options,
            )
        })?;

        // Accepted suffix: one run per request starting at its prefix length.
        let accepted_slots = timed::<B, _>(timings, device, Op::SegmentGather, || {
            segment_gather::<B>(
                req_to_token.clone(),
                req_pool_indices.clone(),
                Some(accepted_start.clone()),
                accepted_lengths.clone(),
                &GatherOptions::new(),
            )
            .and_then(exact::<B>)
        })?;
        let accepted_capacity = timed::<B, _>(timings, device, Op::SegmentGatherCapacity, || {
            segment_gather::<B>(
                req_to_token.clone(),
                req_pool_indices.clone(),
                Some(accepted_start),
                accepted_lengths,
                &GatherOptions::new().capacity(step.accepted_capacity()),
            )
        })?;

        // Full group: checked plan with the expected-token pool (target model, offset 0).
        timed::<B, _>(timings, device, Op::PlanFull, || {
            let inputs = PlanInputs::<B>::from_primitives(
                req_pool_indices.clone(),
                prefix_lens.clone(),
                extend_seq_lens.clone(),
                req_to_token.clone(),
            )
            .expected_tokens_primitive(expected_tokens, valid_lens);
            plan(full, inputs).and_then(|status| status.check().map(drop))
        })?;
        // The canary of the full pool: records for the new tokens (chained from the write plan's
        // seeds, positions asserted), then a check of every slot the verify plan lists. Both
        // read the plans' device-side counts: nothing comes back to the host.
        let new_tokens = write_inputs::<B>(&step.new_tokens, device)
            .chain_position_assert_primitive(prim::i32_scalar::<B>(1, device));
        timed::<B, _>(timings, device, Op::CanaryWrite, || {
            canary.write(&full.write, new_tokens, &CanaryLaunch::new(WRITE_KIND))
        })?;
        timed::<B, _>(timings, device, Op::CanaryVerify, || {
            canary.verify(&full.verify, &CanaryLaunch::new(VERIFY_KIND))
        })?;
        // SWA group: deferred plan through the LUT; its status is checked with the others.
        let swa_status = timed::<B, _>(timings, device, Op::PlanDeferredSwa, || {
            let inputs = PlanInputs::<B>::from_primitives(
                req_pool_indices,
                prefix_lens,
                extend_seq_lens,
                req_to_token,
            )
            .swa_window_size(*swa_window)
            .full_to_swa_index_mapping_primitive(full_to_swa);
            plan(swa, inputs)
        })?;

        // End of step: the deferred statuses, one transfer each.
        let draft_count = timed::<B, _>(timings, device, Op::StatusCheck, || {
            draft_capacity.status.check()
        })
        .map_err(|error| format!("{} {error}", Op::MaskedGatherCapacity.name()))?;
        let accepted_count = timed::<B, _>(timings, device, Op::StatusCheck, || {
            accepted_capacity.status.check()
        })
        .map_err(|error| format!("{} {error}", Op::SegmentGatherCapacity.name()))?;
        timed::<B, _>(timings, device, Op::StatusCheck, || swa_status.check())
            .map_err(|error| format!("{} {error}", Op::PlanDeferredSwa.name()))?;

        Ok(StepOutputs {
            draft_slots: host_values::<B>(draft_slots)?,
            draft_slots_capacity: read_capacity::<B>(draft_capacity, draft_count)?,
            accepted_slots: host_values::<B>(accepted_slots)?,
            accepted_slots_capacity: read_capacity::<B>(accepted_capacity, accepted_count)?,
            full_plan: read_plans(full).map_err(op_error("read_plans [full]"))?,
            swa_plan: read_plans(swa).map_err(op_error("read_plans [swa]"))?,
        })
    }
}

/// Times one public call. Earlier work (the uploads, the previous op) is drained first so it is
/// not billed to this call; calls that read nothing back are synced before the clock stops.
fn timed<B: KvPlanBackend, T>(
    timings: &mut Timings,
    device: &B::Device,
    op: Op,
    call: impl FnOnce() -> Result<T, Error>,
) -> Result<T, String> {
    sync::<B>(device)?;
    let start = Instant::now();
    let value = call().map_err(op_error(op.name()))?;
    if op.needs_sync() {
        sync::<B>(device)?;
    }
    timings.record(op, start.elapsed());
    Ok(value)
}

fn sync<B: KvPlanBackend>(device: &B::Device) -> Result<(), String> {
    prim::sync::<B>(device)
}

fn op_error(op: &'static str) -> impl Fn(Error) -> String {
    move |error| format!("{op} failed: {error}")
}

/// The write plan of one request of `len` tokens starting a chain (seed -1).
fn one_request_plan<B: KvPlanBackend>(
    len: i64,
    device: &B::Device,
) -> Result<WritePlan<B>, String> {
    WritePlan::from_primitives(
        prim::i64s::<B>(&[0, len], device),
        prim::i64s::<B>(&[-1], device),
        prim::i32_scalar::<B>(1, device),
    )
    .map_err(op_error("WritePlan::from_primitives"))
}

/// The write inputs of `tokens` (i64 ids, positions and slots).
fn write_inputs<B: KvPlanBackend>(tokens: &NewTokens, device: &B::Device) -> WriteInputs<B> {
    WriteInputs::from_primitives(
        prim::i64s::<B>(&tokens.ids, device),
        prim::i64s::<B>(&tokens.positions, device),
        prim::i64s::<B>(&tokens.slots, device),
    )
}

fn upload<B: KvPlanBackend>(
    values: &[i64],
    shape: &[usize],
    dtype: DType,
    device: &B::Device,
) -> IntTensor<B> {
    prim::ints::<B>(values, shape, dtype, device)
}

fn host_values<B: KvPlanBackend>(tensor: IntTensor<B>) -> Result<Vec<i64>, String> {
    prim::read_ints::<B>(tensor)
}

fn read_capacity<B: KvPlanBackend>(
    gathered: Gathered<B>,
    checked_count: usize,
) -> Result<CapacityResult, String> {
    let count_tensor = host_values::<B>(gathered.count())?
        .first()
        .copied()
        .unwrap_or(-1);
    let mut values = host_values::<B>(gathered.out)?;
    values.truncate(checked_count);
    Ok(CapacityResult {
        values,
        checked_count,
        count_tensor,
    })
}
