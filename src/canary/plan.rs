//! `VerifyPlan`, `WritePlan` and the `plan` op (spec `canary-plan.md`).
//!
//! ```no_run
//! use burn_core::tensor::{Device, Int, Tensor};
//! use kvplan::ops::{PlanInputs, StepPlan};
//! # fn step(device: &Device, rpi: Tensor<1, Int>, prefix: Tensor<1, Int>,
//! #     extend: Tensor<1, Int>, req_to_token: Tensor<2, Int>) -> Result<(), kvplan::Error> {
//! // Once, at start-up: room for 2^20 verify entries and 256 requests.
//! let mut plan = StepPlan::allocate(1 << 20, 256, device)?;
//! // Every step: filled in place on the device, no read-back.
//! let status = kvplan::ops::plan(&mut plan, PlanInputs::new(rpi, prefix, extend, req_to_token))?;
//! // Once per step, when the host chooses to look:
//! status.check()?;
//! # Ok(()) }
//! ```

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Dispatch, TensorData, TensorMetadata};
use burn_core::tensor::{Device, Int, Tensor};

use crate::backend::{
    KvPlanBackend, OptionalInt, PlanInputsPrimitive, VerifyPlanPrimitive, WritePlanPrimitive,
};
use crate::deferred::Status;
use crate::error::{Error, PLAN_CONTEXT};
use crate::gather::arg;
use crate::reference::PlanBuffers;
use crate::room::{self, Buffer};
use crate::validate;

/// A step's two plans, allocated once and filled in place by every [`plan`] call.
#[derive(Debug)]
pub struct StepPlan<B: KvPlanBackend = Dispatch> {
    /// Which KV slots to verify.
    pub verify: VerifyPlan<B>,
    /// Where the step's new tokens' records go.
    pub write: WritePlan<B>,
}

impl StepPlan {
    /// Plans for `verify_capacity` entries and `write_req_capacity` requests (each `1..=2^31-1`).
    ///
    /// # Errors
    /// `non_positive_verify_capacity`, `non_positive_write_capacity`, `capacity_too_large` (past
    /// 2^31-1: counts are i32), `allocation_too_large` when the device, or the host that stages the
    /// plans, cannot hold them. Nothing is allocated on an error.
    pub fn allocate(
        verify_capacity: usize,
        write_req_capacity: usize,
        device: &Device,
    ) -> Result<Self, Error> {
        Self::allocate_on(verify_capacity, write_req_capacity, device.as_dispatch())
    }
}

impl<B: KvPlanBackend> StepPlan<B> {
    /// [`StepPlan::allocate`] on a backend's device.
    ///
    /// # Errors
    /// As [`StepPlan::allocate`].
    #[doc(hidden)]
    pub fn allocate_on(
        verify_capacity: usize,
        write_req_capacity: usize,
        device: &B::Device,
    ) -> Result<Self, Error> {
        validate::allocation("verify_capacity", verify_capacity)?;
        validate::allocation("write_req_capacity", write_req_capacity)?;
        // Staged on the host, then uploaded: both must have room.
        let buffers = plan_buffers(verify_capacity, write_req_capacity);
        room::on_device(device, &buffers)?;
        room::on_host(&buffers)?;
        Ok(fresh::<B>(verify_capacity, write_req_capacity, device))
    }
}

/// The verify half of a plan: device-resident, allocated once with capacity `V`, filled in place.
#[derive(Debug)]
pub struct VerifyPlan<B: KvPlanBackend = Dispatch> {
    // `None` only while `plan` has lent the tensors to the op.
    tensors: Option<VerifyPlanPrimitive<B>>,
    capacity: usize,
    device: B::Device,
}

/// The write half of a plan: device-resident, allocated once with capacity `K`, filled in place.
#[derive(Debug)]
pub struct WritePlan<B: KvPlanBackend = Dispatch> {
    // `None` only while `plan` has lent the tensors to the op.
    tensors: Option<WritePlanPrimitive<B>>,
    capacity: usize,
}

impl<B: KvPlanBackend> VerifyPlan<B> {
    /// The capacity `V`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The plans' device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    fn tensors(&self) -> &VerifyPlanPrimitive<B> {
        self.tensors
            .as_ref()
            .expect("VerifyPlan tensors are only lent out during plan")
    }

    /// The plan's tensors.
    #[doc(hidden)]
    pub fn primitive(&self) -> &VerifyPlanPrimitive<B> {
        self.tensors()
    }

    /// A plan from existing tensors (a plan built elsewhere, tests, conformance scenarios): the
    /// four i64 arrays of one length `V` (`0` allowed) and the i32 `[1]` counts.
    ///
    /// # Errors
    /// At once: `canary_argument` for an array that is not i64 `[n]` or a count that is not i32
    /// `[1]`; `verify_plan_length` when the arrays differ in length.
    #[doc(hidden)]
    pub fn from_primitives(
        slot_indices: IntTensor<B>,
        expected_tokens: IntTensor<B>,
        expected_positions: IntTensor<B>,
        prev_slot_indices: IntTensor<B>,
        num_valid: IntTensor<B>,
        enable: IntTensor<B>,
    ) -> Result<Self, Error> {
        validate::canary::verify_plan(
            &[
                arg("verify_slot_indices", &slot_indices),
                arg("verify_expected_tokens", &expected_tokens),
                arg("verify_expected_positions", &expected_positions),
                arg("verify_prev_slot_indices", &prev_slot_indices),
            ],
            &[arg("verify_num_valid", &num_valid), arg("enable", &enable)],
        )?;
        let capacity = slot_indices.shape()[0];
        let device = slot_indices.device();
        Ok(Self {
            tensors: Some(VerifyPlanPrimitive {
                slot_indices,
                expected_tokens,
                expected_positions,
                prev_slot_indices,
                num_valid,
                enable,
            }),
            capacity,
            device,
        })
    }

    /// `verify_slot_indices`, i64 `[V]`.
    pub fn slot_indices(&self) -> IntTensor<B> {
        self.tensors().slot_indices.clone()
    }

    /// `verify_expected_tokens`, i64 `[V]`.
    pub fn expected_tokens(&self) -> IntTensor<B> {
        self.tensors().expected_tokens.clone()
    }

    /// `verify_expected_positions`, i64 `[V]`.
    pub fn expected_positions(&self) -> IntTensor<B> {
        self.tensors().expected_positions.clone()
    }

    /// `verify_prev_slot_indices`, i64 `[V]`.
    pub fn prev_slot_indices(&self) -> IntTensor<B> {
        self.tensors().prev_slot_indices.clone()
    }

    /// `verify_num_valid`, i32 `[1]`.
    pub fn num_valid(&self) -> IntTensor<B> {
        self.tensors().num_valid.clone()
    }

    /// `enable`, i32 `[1]`: 0 tells the verify step to do nothing.
    pub fn enable(&self) -> IntTensor<B> {
        self.tensors().enable.clone()
    }
}

impl<B: KvPlanBackend> WritePlan<B> {
    /// The capacity `K`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn tensors(&self) -> &WritePlanPrimitive<B> {
        self.tensors
            .as_ref()
            .expect("WritePlan tensors are only lent out during plan")
    }

    /// The plan's tensors.
    #[doc(hidden)]
    pub fn primitive(&self) -> &WritePlanPrimitive<B> {
        self.tensors()
    }

    /// A plan from existing tensors (a plan built elsewhere, tests, conformance scenarios):
    /// i64 `write_offsets [K+1]` and `write_seed_slot_indices [K]` (`K = 0` allowed), i32 `[1]`
    /// `write_num_valid_reqs`.
    ///
    /// # Errors
    /// At once: `canary_argument` for an array that is not i64 `[n]` or a count that is not i32
    /// `[1]`; `write_offsets_length` when `write_offsets` is not `K + 1` long.
    #[doc(hidden)]
    pub fn from_primitives(
        offsets: IntTensor<B>,
        seed_slot_indices: IntTensor<B>,
        num_valid_reqs: IntTensor<B>,
    ) -> Result<Self, Error> {
        validate::canary::write_plan(
            &arg("write_offsets", &offsets),
            &arg("write_seed_slot_indices", &seed_slot_indices),
            &arg("write_num_valid_reqs", &num_valid_reqs),
        )?;
        let capacity = seed_slot_indices.shape()[0];
        let device = offsets.device();
        let scratch = fresh_scratch::<B>(capacity, &device);
        Ok(Self {
            tensors: Some(WritePlanPrimitive {
                offsets,
                seed_slot_indices,
                num_valid_reqs,
                scratch,
            }),
            capacity,
        })
    }

    /// `write_offsets`, i64 `[K+1]`.
    pub fn offsets(&self) -> IntTensor<B> {
        self.tensors().offsets.clone()
    }

    /// `write_seed_slot_indices`, i64 `[K]`.
    pub fn seed_slot_indices(&self) -> IntTensor<B> {
        self.tensors().seed_slot_indices.clone()
    }

    /// `write_num_valid_reqs`, i32 `[1]`.
    pub fn num_valid_reqs(&self) -> IntTensor<B> {
        self.tensors().num_valid_reqs.clone()
    }
}

/// The kernels' scratch of a plan with write capacity `capacity`, ready for a first call.
fn fresh_scratch<B: KvPlanBackend>(capacity: usize, device: &B::Device) -> IntTensor<B> {
    let words: Vec<i64> = kvplan_kernels::plan::fresh_scratch(capacity)
        .into_iter()
        .map(|word| word as i64)
        .collect();
    let len = words.len();
    B::int_from_data(TensorData::new(words, [len]), device)
}

/// The buffers of a `StepPlan`: four verify arrays of `V`, the write offsets, seeds and scratch.
pub(crate) fn plan_buffers(verify_capacity: usize, write_req_capacity: usize) -> [Buffer; 7] {
    let verify = Buffer::i64s("verify plan array", verify_capacity);
    [
        verify,
        verify,
        verify,
        verify,
        Buffer::i64s("write_offsets", write_req_capacity + 1),
        Buffer::i64s("write_seed_slot_indices", write_req_capacity),
        Buffer::i64s(
            "write plan scratch",
            kvplan_kernels::plan::scratch_len(write_req_capacity),
        ),
    ]
}

/// Plans with the spec's fresh contents (`PlanBuffers::fresh`, their one definition), uploaded.
fn fresh<B: KvPlanBackend>(
    verify_capacity: usize,
    write_req_capacity: usize,
    device: &B::Device,
) -> StepPlan<B> {
    let (verify, write) = crate::backend::upload_plans::<B>(
        PlanBuffers::fresh(verify_capacity, write_req_capacity),
        fresh_scratch::<B>(write_req_capacity, device),
        device,
    );
    StepPlan {
        verify: VerifyPlan {
            tensors: Some(verify),
            capacity: verify_capacity,
            device: device.clone(),
        },
        write: WritePlan {
            tensors: Some(write),
            capacity: write_req_capacity,
        },
    }
}

/// The inputs of one plan step. Int tensors may be i32 or i64, each as the caller has it.
#[derive(Debug, Clone)]
pub struct PlanInputs<B: KvPlanBackend = Dispatch> {
    req_pool_indices: IntTensor<B>,
    prefix_lens: IntTensor<B>,
    extend_seq_lens: IntTensor<B>,
    req_to_token: IntTensor<B>,
    swa_window_size: i32,
    full_to_swa: Option<IntTensor<B>>,
    expected_tokens: Option<IntTensor<B>>,
    valid_lens: Option<IntTensor<B>>,
    position_offset: i32,
    verify_capacity: Option<usize>,
}

impl PlanInputs {
    /// A full-attention step without expected tokens: `prefix_lens` committed tokens per request
    /// are verified, `extend_seq_lens` new ones get records. `req_pool_indices` value 0 marks a
    /// padding row.
    pub fn new(
        req_pool_indices: Tensor<1, Int>,
        prefix_lens: Tensor<1, Int>,
        extend_seq_lens: Tensor<1, Int>,
        req_to_token: Tensor<2, Int>,
    ) -> Self {
        Self::from_primitives(
            req_pool_indices.into_dispatch(),
            prefix_lens.into_dispatch(),
            extend_seq_lens.into_dispatch(),
            req_to_token.into_dispatch(),
        )
    }

    /// `full_to_swa_index_mapping`: translates every slot read (negative slots pass through).
    pub fn full_to_swa_index_mapping(self, lut: Tensor<1, Int>) -> Self {
        self.full_to_swa_index_mapping_primitive(lut.into_dispatch())
    }

    /// `req_to_verify_expected_tokens`, `[prow, pcol]`, with its valid lengths `[bs]`.
    pub fn expected_tokens(self, pool: Tensor<2, Int>, valid_lens: Tensor<1, Int>) -> Self {
        self.expected_tokens_primitive(pool.into_dispatch(), valid_lens.into_dispatch())
    }
}

impl<B: KvPlanBackend> PlanInputs<B> {
    /// [`PlanInputs::new`] on a backend's primitives.
    #[doc(hidden)]
    pub fn from_primitives(
        req_pool_indices: IntTensor<B>,
        prefix_lens: IntTensor<B>,
        extend_seq_lens: IntTensor<B>,
        req_to_token: IntTensor<B>,
    ) -> Self {
        Self {
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token,
            swa_window_size: 0,
            full_to_swa: None,
            expected_tokens: None,
            valid_lens: None,
            position_offset: 0,
            verify_capacity: None,
        }
    }

    /// Sliding window `W` (`<= 0`: none). `W > 0` needs the LUT.
    pub fn swa_window_size(mut self, window: i32) -> Self {
        self.swa_window_size = window;
        self
    }

    /// [`PlanInputs::full_to_swa_index_mapping`] on a primitive.
    #[doc(hidden)]
    pub fn full_to_swa_index_mapping_primitive(mut self, lut: IntTensor<B>) -> Self {
        self.full_to_swa = Some(lut);
        self
    }

    /// [`PlanInputs::expected_tokens`] on primitives.
    #[doc(hidden)]
    pub fn expected_tokens_primitive(
        mut self,
        pool: IntTensor<B>,
        valid_lens: IntTensor<B>,
    ) -> Self {
        self.expected_tokens = Some(pool);
        self.valid_lens = Some(valid_lens);
        self
    }

    /// Only the pool (a caller that gives the valid lengths apart, or not at all: tests of the
    /// pairing rule).
    #[doc(hidden)]
    pub fn expected_tokens_pool_primitive(mut self, pool: IntTensor<B>) -> Self {
        self.expected_tokens = Some(pool);
        self
    }

    /// Only the valid lengths (see [`PlanInputs::expected_tokens_pool_primitive`]).
    #[doc(hidden)]
    pub fn expected_tokens_valid_lens_primitive(mut self, valid_lens: IntTensor<B>) -> Self {
        self.valid_lens = Some(valid_lens);
        self
    }

    /// `kv_token_id_vs_position_offset`: column shift into the pool (+1 for an EAGLE draft).
    pub fn position_offset(mut self, offset: i32) -> Self {
        self.position_offset = offset;
        self
    }

    /// The `verify_capacity` argument; defaults to the `VerifyPlan`'s capacity.
    pub fn verify_capacity(mut self, capacity: usize) -> Self {
        self.verify_capacity = Some(capacity);
        self
    }

    fn host_args(&self, plan: &StepPlan<B>) -> validate::PlanArgs<B::Device> {
        validate::PlanArgs {
            req_pool_indices: arg("req_pool_indices", &self.req_pool_indices),
            prefix_lens: arg("prefix_lens", &self.prefix_lens),
            extend_seq_lens: arg("extend_seq_lens", &self.extend_seq_lens),
            req_to_token: arg("req_to_token", &self.req_to_token),
            // The true stride is only known where the op runs (a fused stream resolves views
            // late): the Cube launcher checks it into the status (PLAN_STRIDE).
            req_to_token_row_stride: self
                .req_to_token
                .shape()
                .as_slice()
                .get(1)
                .map_or(1, |&c| c.max(1) as i64),
            swa_window_size: self.swa_window_size,
            full_to_swa: self
                .full_to_swa
                .as_ref()
                .map(|lut| arg("full_to_swa_index_mapping", lut)),
            expected_tokens: self
                .expected_tokens
                .as_ref()
                .map(|pool| arg("req_to_verify_expected_tokens", pool)),
            valid_lens: self
                .valid_lens
                .as_ref()
                .map(|lens| arg("req_to_verify_expected_tokens_valid_lens", lens)),
            verify_capacity: self.verify_capacity.unwrap_or(plan.verify.capacity),
            plan_verify_capacity: plan.verify.capacity,
            write_req_capacity: plan.write.capacity,
            plan_device: plan.verify.device.clone(),
        }
    }

    fn into_primitive(self) -> PlanInputsPrimitive<B> {
        // The host rules pair the pool with its lengths before this runs.
        let (pool, lens) = match (self.expected_tokens, self.valid_lens) {
            (Some(pool), Some(lens)) => (Some(pool), Some(lens)),
            _ => (None, None),
        };
        PlanInputsPrimitive {
            req_pool_indices: self.req_pool_indices,
            prefix_lens: self.prefix_lens,
            extend_seq_lens: self.extend_seq_lens,
            req_to_token: self.req_to_token,
            full_to_swa: OptionalInt::from(self.full_to_swa),
            expected_tokens: OptionalInt::from(pool),
            expected_tokens_valid_lens: OptionalInt::from(lens),
            swa_window_size: self.swa_window_size,
            position_offset: self.position_offset,
        }
    }
}

/// One plan step, filling both plans in place, without any transfer to the host: device-checked
/// errors stay in the returned status until `check()`, and leave both plans disabled
/// (`enable = 0`, `verify_num_valid = 0`, `write_num_valid_reqs = 0`), which keeps downstream
/// consumers safe. Host-rule errors leave both plans unchanged.
///
/// # Errors
/// At once, plans unchanged: the capacity errors of [`StepPlan::allocate`], `missing_lut_for_swa`,
/// `capacity_mismatch`, `missing_valid_lens` / `valid_lens_without_pool`, `device_mismatch`,
/// `dtype_mismatch`, `not_1d` / `not_2d`, `length_mismatch`, `empty_lut`,
/// `bs_exceeds_write_capacity`. In the status, plans disabled: `req_pool_index_out_of_range`,
/// `position_out_of_range`, `swa_slot_outside_lut`, `expected_pool_row_out_of_range` /
/// `expected_pool_position_out_of_range`, `write_offsets_overflow`, `req_to_token_stride` (the true
/// stride is known only where the op runs), `index_range`.
pub fn plan<B: KvPlanBackend>(
    plan: &mut StepPlan<B>,
    inputs: PlanInputs<B>,
) -> Result<Status<B>, Error> {
    // Plans built `from_primitives` may be empty; the plan op needs room for an entry and a request.
    validate::allocation("verify_capacity", plan.verify.capacity)?;
    validate::allocation("write_req_capacity", plan.write.capacity)?;
    validate::plan(&inputs.host_args(plan))?;
    // The op consumes the plans' tensors and hands them back: CubeCL then writes in place.
    let (Some(verify), Some(write)) = (plan.verify.tensors.take(), plan.write.tensors.take())
    else {
        unreachable!("plan tensors are always returned to their plans");
    };
    let output = B::canary_plan(verify, write, inputs.into_primitive());
    plan.verify.tensors = Some(output.verify);
    plan.write.tensors = Some(output.write);
    Ok(Status::new(output.status, PLAN_CONTEXT))
}

/// Reads both plans back to the host (tests, debugging, the conformance runner).
///
/// # Errors
/// `execution` when a read-back fails.
pub fn read_plans<B: KvPlanBackend>(plan: &StepPlan<B>) -> Result<PlanBuffers, Error> {
    let values = |tensor: IntTensor<B>| crate::backend::read_ints::<B>(tensor);
    let scalar =
        |tensor| -> Result<i32, Error> { Ok(values(tensor)?.first().copied().unwrap_or(0) as i32) };
    let (verify, write) = (plan.verify.primitive(), plan.write.primitive());
    Ok(PlanBuffers {
        verify_slot_indices: values(verify.slot_indices.clone())?,
        verify_expected_tokens: values(verify.expected_tokens.clone())?,
        verify_expected_positions: values(verify.expected_positions.clone())?,
        verify_prev_slot_indices: values(verify.prev_slot_indices.clone())?,
        verify_num_valid: scalar(verify.num_valid.clone())?,
        enable: scalar(verify.enable.clone())?,
        write_offsets: values(write.offsets.clone())?,
        write_seed_slot_indices: values(write.seed_slot_indices.clone())?,
        write_num_valid_reqs: scalar(write.num_valid_reqs.clone())?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest capacity the count rule lets through.
    const MAX_CAPACITY: usize = i32::MAX as usize;

    #[test]
    fn a_plan_larger_than_a_page_is_refused_naming_its_array() {
        // lavapipe's page: 128 MiB. Any plan capacity below 2^31 passes the count rule.
        let error = room::within(&plan_buffers(MAX_CAPACITY, 1), 128 << 20, "the device");
        assert_eq!(
            error,
            Err(Error::AllocationTooLarge {
                what: "verify plan array",
                elements: MAX_CAPACITY as u64,
                bytes: MAX_CAPACITY as u128 * 8,
                on: "the device",
                limit: Some(128 << 20),
            })
        );
        let error = room::within(&plan_buffers(1, MAX_CAPACITY), 128 << 20, "the device");
        assert_eq!(
            error.unwrap_err().to_string(),
            "kvplan: write_offsets needs 2147483648 elements (17179869184 bytes), more than the device can allocate (at most 134217728 bytes at once)"
        );
        assert_eq!(
            room::within(&plan_buffers(1 << 20, 256), 128 << 20, "the device"),
            Ok(())
        );
    }
}
