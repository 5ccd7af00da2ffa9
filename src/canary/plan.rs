//! `VerifyPlan`, `WritePlan` and the `plan` op (spec `canary-plan.md`).
//!
//! ```no_run
//! use burn_tensor::{Int, Tensor};
//! use kvplan::canary::{PlanInputs, VerifyPlan, WritePlan, plan};
//! # fn step<B: kvplan::KvPlanBackend>(device: &B::Device, rpi: Tensor<B, 1, Int>,
//! #     prefix: Tensor<B, 1, Int>, extend: Tensor<B, 1, Int>, req_to_token: Tensor<B, 2, Int>,
//! # ) -> Result<(), kvplan::Error> {
//! // Once, at start-up.
//! let mut verify = VerifyPlan::<B>::allocate(1 << 20, device)?;
//! let mut write = WritePlan::<B>::allocate(256, device)?;
//! // Every step: filled in place on the device.
//! plan(&mut verify, &mut write, PlanInputs::new(rpi, prefix, extend, req_to_token))?;
//! # Ok(()) }
//! ```

use burn_tensor::ops::IntTensor;
use burn_tensor::{Int, Tensor, TensorData, TensorMetadata};

use crate::error::Error;
use crate::gather::arg;
use crate::ops::{KvPlanBackend, PlanInputsPrimitive, VerifyPlanPrimitive, WritePlanPrimitive};
use crate::reference::PlanBuffers;
use crate::status;
use crate::validate;

/// The verify half of a plan: device-resident, allocated once with capacity `V`, filled in place.
#[derive(Debug)]
pub struct VerifyPlan<B: KvPlanBackend> {
    // `None` only while `plan` has lent the tensors to the op.
    tensors: Option<VerifyPlanPrimitive<IntTensor<B>>>,
    capacity: usize,
    device: B::Device,
}

/// The write half of a plan: device-resident, allocated once with capacity `K`, filled in place.
#[derive(Debug)]
pub struct WritePlan<B: KvPlanBackend> {
    // `None` only while `plan` has lent the tensors to the op.
    tensors: Option<WritePlanPrimitive<IntTensor<B>>>,
    capacity: usize,
    device: B::Device,
}

fn i64_tensor<B: KvPlanBackend>(value: i64, len: usize, device: &B::Device) -> IntTensor<B> {
    B::int_from_data(TensorData::new(vec![value; len], [len]), device)
}

fn i32_scalar<B: KvPlanBackend>(value: i32, device: &B::Device) -> IntTensor<B> {
    B::int_from_data(TensorData::new(vec![value], [1]), device)
}

impl<B: KvPlanBackend> VerifyPlan<B> {
    /// Allocates a plan for `capacity` entries (`1..=2^31-1`) with the spec's fresh contents.
    pub fn allocate(capacity: usize, device: &B::Device) -> Result<Self, Error> {
        validate::allocation("verify_capacity", capacity)?;
        Ok(Self {
            tensors: Some(fresh_verify::<B>(capacity, 1, device)),
            capacity,
            device: device.clone(),
        })
    }

    /// The capacity `V`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The plans' device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    fn tensors(&self) -> &VerifyPlanPrimitive<IntTensor<B>> {
        self.tensors
            .as_ref()
            .expect("VerifyPlan tensors are only lent out during plan")
    }

    pub(crate) fn primitive(&self) -> &VerifyPlanPrimitive<IntTensor<B>> {
        self.tensors()
    }

    /// A plan from existing tensors (a plan built elsewhere, tests, conformance scenarios): the
    /// four i64 arrays of one length `V` (`0` allowed) and the i32 `[1]` counts.
    pub fn from_tensors(
        slot_indices: Tensor<B, 1, Int>,
        expected_tokens: Tensor<B, 1, Int>,
        expected_positions: Tensor<B, 1, Int>,
        prev_slot_indices: Tensor<B, 1, Int>,
        num_valid: Tensor<B, 1, Int>,
        enable: Tensor<B, 1, Int>,
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
        let capacity = slot_indices.dims()[0];
        let device = slot_indices.device();
        Ok(Self {
            tensors: Some(VerifyPlanPrimitive {
                slot_indices: slot_indices.into_primitive(),
                expected_tokens: expected_tokens.into_primitive(),
                expected_positions: expected_positions.into_primitive(),
                prev_slot_indices: prev_slot_indices.into_primitive(),
                num_valid: num_valid.into_primitive(),
                enable: enable.into_primitive(),
            }),
            capacity,
            device,
        })
    }

    /// `verify_slot_indices`, i64 `[V]`.
    pub fn slot_indices(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().slot_indices.clone())
    }

    /// `verify_expected_tokens`, i64 `[V]`.
    pub fn expected_tokens(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().expected_tokens.clone())
    }

    /// `verify_expected_positions`, i64 `[V]`.
    pub fn expected_positions(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().expected_positions.clone())
    }

    /// `verify_prev_slot_indices`, i64 `[V]`.
    pub fn prev_slot_indices(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().prev_slot_indices.clone())
    }

    /// `verify_num_valid`, i32 `[1]`.
    pub fn num_valid(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().num_valid.clone())
    }

    /// `enable`, i32 `[1]`: 0 tells the verify step to do nothing.
    pub fn enable(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().enable.clone())
    }
}

pub(crate) fn fresh_verify<B: KvPlanBackend>(
    capacity: usize,
    enable: i32,
    device: &B::Device,
) -> VerifyPlanPrimitive<IntTensor<B>> {
    VerifyPlanPrimitive {
        slot_indices: i64_tensor::<B>(0, capacity, device),
        expected_tokens: i64_tensor::<B>(-1, capacity, device),
        expected_positions: i64_tensor::<B>(0, capacity, device),
        prev_slot_indices: i64_tensor::<B>(0, capacity, device),
        num_valid: i32_scalar::<B>(0, device),
        enable: i32_scalar::<B>(enable, device),
    }
}

impl<B: KvPlanBackend> WritePlan<B> {
    /// Allocates a plan for `capacity` requests (`1..=2^31-1`) with the spec's fresh contents.
    pub fn allocate(capacity: usize, device: &B::Device) -> Result<Self, Error> {
        validate::allocation("write_req_capacity", capacity)?;
        Ok(Self {
            tensors: Some(fresh_write::<B>(capacity, device)),
            capacity,
            device: device.clone(),
        })
    }

    /// The capacity `K`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn tensors(&self) -> &WritePlanPrimitive<IntTensor<B>> {
        self.tensors
            .as_ref()
            .expect("WritePlan tensors are only lent out during plan")
    }

    pub(crate) fn primitive(&self) -> &WritePlanPrimitive<IntTensor<B>> {
        self.tensors()
    }

    /// A plan from existing tensors (a plan built elsewhere, tests, conformance scenarios):
    /// i64 `write_offsets [K+1]` and `write_seed_slot_indices [K]` (`K = 0` allowed), i32 `[1]`
    /// `write_num_valid_reqs`.
    pub fn from_tensors(
        offsets: Tensor<B, 1, Int>,
        seed_slot_indices: Tensor<B, 1, Int>,
        num_valid_reqs: Tensor<B, 1, Int>,
    ) -> Result<Self, Error> {
        validate::canary::write_plan(
            &arg("write_offsets", &offsets),
            &arg("write_seed_slot_indices", &seed_slot_indices),
            &arg("write_num_valid_reqs", &num_valid_reqs),
        )?;
        let capacity = seed_slot_indices.dims()[0];
        let device = offsets.device();
        let scratch = fresh_scratch::<B>(capacity, &device);
        Ok(Self {
            tensors: Some(WritePlanPrimitive {
                offsets: offsets.into_primitive(),
                seed_slot_indices: seed_slot_indices.into_primitive(),
                num_valid_reqs: num_valid_reqs.into_primitive(),
                scratch,
            }),
            capacity,
            device,
        })
    }

    /// `write_offsets`, i64 `[K+1]`.
    pub fn offsets(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().offsets.clone())
    }

    /// `write_seed_slot_indices`, i64 `[K]`.
    pub fn seed_slot_indices(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().seed_slot_indices.clone())
    }

    /// `write_num_valid_reqs`, i32 `[1]`.
    pub fn num_valid_reqs(&self) -> Tensor<B, 1, Int> {
        Tensor::from_primitive(self.tensors().num_valid_reqs.clone())
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

pub(crate) fn fresh_write<B: KvPlanBackend>(
    capacity: usize,
    device: &B::Device,
) -> WritePlanPrimitive<IntTensor<B>> {
    WritePlanPrimitive {
        offsets: i64_tensor::<B>(0, capacity + 1, device),
        seed_slot_indices: i64_tensor::<B>(0, capacity, device),
        num_valid_reqs: i32_scalar::<B>(0, device),
        scratch: fresh_scratch::<B>(capacity, device),
    }
}

/// The inputs of one plan step. Int tensors may be i32 or i64, each as the caller has it.
#[derive(Debug, Clone)]
pub struct PlanInputs<B: KvPlanBackend> {
    req_pool_indices: Tensor<B, 1, Int>,
    prefix_lens: Tensor<B, 1, Int>,
    extend_seq_lens: Tensor<B, 1, Int>,
    req_to_token: IntTensor<B>,
    swa_window_size: i32,
    full_to_swa: Option<Tensor<B, 1, Int>>,
    expected_tokens: Option<Tensor<B, 2, Int>>,
    valid_lens: Option<Tensor<B, 1, Int>>,
    position_offset: i32,
    verify_capacity: Option<usize>,
}

impl<B: KvPlanBackend> PlanInputs<B> {
    /// A full-attention step without expected tokens. `req_pool_indices` value 0 marks a padding
    /// row; `req_to_token` is `[rows, cols]` (any other rank is refused with `not_2d`).
    pub fn new<const D: usize>(
        req_pool_indices: Tensor<B, 1, Int>,
        prefix_lens: Tensor<B, 1, Int>,
        extend_seq_lens: Tensor<B, 1, Int>,
        req_to_token: Tensor<B, D, Int>,
    ) -> Self {
        Self {
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            req_to_token: req_to_token.into_primitive(),
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

    /// `full_to_swa_index_mapping`: translates every slot read (negative slots pass through).
    pub fn full_to_swa_index_mapping(mut self, lut: Tensor<B, 1, Int>) -> Self {
        self.full_to_swa = Some(lut);
        self
    }

    /// `req_to_verify_expected_tokens`, `[prow, pcol]`; needs the valid lengths.
    pub fn expected_tokens(mut self, pool: Tensor<B, 2, Int>) -> Self {
        self.expected_tokens = Some(pool);
        self
    }

    /// `req_to_verify_expected_tokens_valid_lens`, `[bs]`; needs the pool.
    pub fn expected_tokens_valid_lens(mut self, valid_lens: Tensor<B, 1, Int>) -> Self {
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

    fn host_args(
        &self,
        verify: &VerifyPlan<B>,
        write: &WritePlan<B>,
    ) -> validate::PlanArgs<B::Device> {
        validate::PlanArgs {
            req_pool_indices: arg("req_pool_indices", &self.req_pool_indices),
            prefix_lens: arg("prefix_lens", &self.prefix_lens),
            extend_seq_lens: arg("extend_seq_lens", &self.extend_seq_lens),
            req_to_token: validate::Arg {
                name: "req_to_token",
                shape: self.req_to_token.shape().to_vec(),
                dtype: self.req_to_token.dtype(),
                device: B::int_device(&self.req_to_token),
            },
            req_to_token_row_stride: B::int_row_stride(&self.req_to_token),
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
            verify_capacity: self.verify_capacity.unwrap_or(verify.capacity),
            plan_verify_capacity: verify.capacity,
            write_req_capacity: write.capacity,
            plan_device: verify.device.clone(),
        }
    }

    fn into_primitive(self) -> PlanInputsPrimitive<IntTensor<B>> {
        PlanInputsPrimitive {
            req_pool_indices: self.req_pool_indices.into_primitive(),
            prefix_lens: self.prefix_lens.into_primitive(),
            extend_seq_lens: self.extend_seq_lens.into_primitive(),
            req_to_token: self.req_to_token,
            swa_window_size: self.swa_window_size,
            full_to_swa: self.full_to_swa.map(Tensor::into_primitive),
            expected_tokens: self
                .expected_tokens
                .zip(self.valid_lens)
                .map(|(pool, lens)| (pool.into_primitive(), lens.into_primitive())),
            position_offset: self.position_offset,
        }
    }
}

/// The device-side status of a deferred plan.
#[derive(Debug, Clone)]
pub struct PlanStatus<B: KvPlanBackend> {
    words: Tensor<B, 1, Int>,
}

impl<B: KvPlanBackend> PlanStatus<B> {
    /// Reads the status back (one transfer): `Ok` or the error `plan` would have returned.
    pub fn check(&self) -> Result<(), Error> {
        let words = B::read_status(self.words.clone().into_primitive())?;
        status::decode(&words, "").map(|_| ())
    }

    /// The raw i64 status record (`kvplan_kernels::status` layout).
    pub fn words(&self) -> &Tensor<B, 1, Int> {
        &self.words
    }
}

/// One plan step, checked: fills both plans in place, then reads one status record back.
///
/// Host-rule errors leave both plans unchanged; a device-checked error leaves them disabled
/// (`enable = 0`, `verify_num_valid = 0`, `write_num_valid_reqs = 0`).
pub fn plan<B: KvPlanBackend>(
    verify: &mut VerifyPlan<B>,
    write: &mut WritePlan<B>,
    inputs: PlanInputs<B>,
) -> Result<(), Error> {
    plan_deferred(verify, write, inputs)?.check()
}

/// One plan step without any transfer to the host: device-checked errors stay in the returned
/// status until `check()`. Until then the disabled plan keeps downstream consumers safe.
pub fn plan_deferred<B: KvPlanBackend>(
    verify: &mut VerifyPlan<B>,
    write: &mut WritePlan<B>,
    inputs: PlanInputs<B>,
) -> Result<PlanStatus<B>, Error> {
    // Plans built `from_tensors` may be empty; the plan op needs room for an entry and a request.
    validate::allocation("verify_capacity", verify.capacity)?;
    validate::allocation("write_req_capacity", write.capacity)?;
    validate::plan(&inputs.host_args(verify, write))?;
    // The op consumes the plans' tensors and hands them back: CubeCL then writes in place.
    let (Some(verify_tensors), Some(write_tensors)) = (verify.tensors.take(), write.tensors.take())
    else {
        unreachable!("plan tensors are always returned to their plans");
    };
    match B::canary_plan(verify_tensors, write_tensors, inputs.into_primitive()) {
        Ok(output) => {
            verify.tensors = Some(output.verify);
            write.tensors = Some(output.write);
            Ok(PlanStatus {
                words: Tensor::from_primitive(output.status),
            })
        }
        Err(error) => {
            // The device failed mid-op: start over from disabled plans rather than stale halves.
            verify.tensors = Some(fresh_verify::<B>(verify.capacity, 0, &verify.device));
            write.tensors = Some(fresh_write::<B>(write.capacity, &write.device));
            Err(error)
        }
    }
}

/// Reads both plans back to the host (tests, debugging, the conformance runner).
pub fn read_plans<B: KvPlanBackend>(
    verify: &VerifyPlan<B>,
    write: &WritePlan<B>,
) -> Result<PlanBuffers, Error> {
    let values = |tensor: Tensor<B, 1, Int>| -> Result<Vec<i64>, Error> {
        let data = tensor.try_into_data().map_err(|error| Error::Execution {
            detail: format!("{error:?}"),
        })?;
        Ok(crate::ops::data_to_i64(&data))
    };
    let scalar =
        |tensor| -> Result<i32, Error> { Ok(values(tensor)?.first().copied().unwrap_or(0) as i32) };
    Ok(PlanBuffers {
        verify_slot_indices: values(verify.slot_indices())?,
        verify_expected_tokens: values(verify.expected_tokens())?,
        verify_expected_positions: values(verify.expected_positions())?,
        verify_prev_slot_indices: values(verify.prev_slot_indices())?,
        verify_num_valid: scalar(verify.num_valid())?,
        enable: scalar(verify.enable())?,
        write_offsets: values(write.offsets())?,
        write_seed_slot_indices: values(write.seed_slot_indices())?,
        write_num_valid_reqs: scalar(write.num_valid_reqs())?,
    })
}
