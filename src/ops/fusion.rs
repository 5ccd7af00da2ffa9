//! `KvPlanBackend` for `Fusion<B>`: every op is a registered custom operation whose `execute`
//! runs the inner backend's op on the inner tensors.
//!
//! Inputs are consumed (`into_ir`), so a plan buffer that the caller holds uniquely reaches the
//! inner op uniquely owned and CubeCL can write it in place; outputs are re-registered with the
//! shapes and dtypes that the inner op is guaranteed to return (i64 arrays, i32 counters).

use core::marker::PhantomData;

use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, TensorIr};
use burn_tensor::ops::IntTensorOps;
use burn_tensor::ops::{BoolTensor, IntTensor};
use burn_tensor::{DType, Shape, TensorData};
use kvplan_kernels::status::{CODE, EXECUTION, STATUS_LEN};

use super::{
    CanaryLaunchOf, CanaryLaunchPrimitive, CanaryPrimitive, GatherOutput, KvBytes, KvPlanBackend,
    PlanInputsPrimitive, PlanOutput, SourceLayout, SourcePrimitive, VerifyPlanPrimitive,
    WriteInputsPrimitive, WritePlanPrimitive,
};
use crate::error::Error;
use crate::reference::RealKvHashMode;

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

/// The registered op: which kvplan op, and its scalar arguments.
#[derive(Debug, Clone)]
enum Op {
    MaskedGather {
        capacity: usize,
    },
    SegmentGather {
        capacity: usize,
        has_start: bool,
    },
    Plan {
        swa_window_size: i32,
        has_lut: bool,
        has_pool: bool,
        position_offset: i32,
    },
    Prefix {
        len: usize,
    },
    CanaryWrite {
        canary: CanaryShape,
        launch: LaunchMeta,
        has_expected: bool,
        has_chain_flag: bool,
    },
    CanaryVerify {
        canary: CanaryShape,
        launch: LaunchMeta,
    },
}

/// The scalar part of a `CanaryPrimitive`.
#[derive(Debug, Clone, Copy)]
struct CanaryShape {
    num_slots: usize,
    slot_words: usize,
    ring_capacity: usize,
}

/// The scalar part of a `CanaryLaunchPrimitive`: sources travel as op inputs.
#[derive(Debug, Clone)]
struct LaunchMeta {
    kernel_kind: i32,
    mode: RealKvHashMode,
    check_expected_token: bool,
    /// Per source: its layout and whether it is a float tensor.
    sources: Vec<(SourceLayout, bool)>,
}

impl LaunchMeta {
    /// Splits a launch into its scalars and its source tensors (registered as inputs).
    fn split<T>(launch: CanaryLaunchPrimitive<T, T>) -> (Self, Vec<T>) {
        let mut tensors = Vec::new();
        let sources = launch
            .sources
            .into_iter()
            .map(|source| {
                let is_float = matches!(source.tensor, KvBytes::Float(_));
                let (KvBytes::Float(tensor) | KvBytes::Int(tensor)) = source.tensor;
                tensors.push(tensor);
                (source.layout, is_float)
            })
            .collect();
        let meta = Self {
            kernel_kind: launch.kernel_kind,
            mode: launch.mode,
            check_expected_token: launch.check_expected_token,
            sources,
        };
        (meta, tensors)
    }
}

#[derive(Debug)]
struct CustomOp<B: FusionBackend> {
    desc: CustomOpIr,
    op: Op,
    device: B::Device,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + KvPlanBackend> Operation<B::FusionRuntime> for CustomOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let inputs = &self.desc.inputs;
        let outputs = &self.desc.outputs;
        let mut int = |k: usize| handles.get_int_tensor::<B>(&inputs[k]);
        let result: Result<Vec<IntTensor<B>>, Error> = match self.op {
            Op::MaskedGather { capacity } => {
                let (table, rows, pos2d) = (int(0), int(1), int(2));
                let mask = handles.get_bool_tensor::<B>(&inputs[3]);
                B::masked_gather(table, rows, pos2d, mask, capacity)
                    .map(|out| vec![out.out, out.count, out.status])
            }
            Op::SegmentGather {
                capacity,
                has_start,
            } => {
                let (table, rows) = (int(0), int(1));
                let start = has_start.then(|| int(2));
                let lengths = int(2 + usize::from(has_start));
                B::segment_gather(table, rows, start, lengths, capacity)
                    .map(|out| vec![out.out, out.count, out.status])
            }
            Op::Prefix { len } => Ok(vec![B::int_prefix(int(0), len)]),
            Op::CanaryWrite {
                canary,
                ref launch,
                has_expected,
                has_chain_flag,
            } => {
                let failure = int(inputs.len() - 1);
                let state = canary_state(canary, int(0), int(1), int(2), None);
                let plan = WritePlanPrimitive {
                    offsets: int(3),
                    seed_slot_indices: int(4),
                    num_valid_reqs: int(5),
                    scratch: int(6),
                };
                let (input_ids, positions, out_cache_loc) = (int(7), int(8), int(9));
                let expected_inputs = has_expected.then(|| (int(10), int(11)));
                let flag_at = 10 + 2 * usize::from(has_expected);
                let chain_position_assert = has_chain_flag.then(|| int(flag_at));
                let inputs = WriteInputsPrimitive {
                    input_ids,
                    positions,
                    out_cache_loc,
                    expected_inputs,
                    chain_position_assert,
                };
                let sources = flag_at + usize::from(has_chain_flag)..self.desc.inputs.len() - 1;
                let launch = inner_launch::<B>(handles, launch, &self.desc.inputs[sources]);
                B::canary_write(state, plan, inputs, launch)
                    .map(|state| canary_outputs(state, failure))
            }
            Op::CanaryVerify { canary, ref launch } => {
                let failure = int(inputs.len() - 1);
                let state = canary_state(canary, int(0), int(1), int(2), None);
                let plan = VerifyPlanPrimitive {
                    slot_indices: int(3),
                    expected_tokens: int(4),
                    expected_positions: int(5),
                    prev_slot_indices: int(6),
                    num_valid: int(7),
                    enable: int(8),
                };
                let launch = inner_launch::<B>(handles, launch, &inputs[9..inputs.len() - 1]);
                B::canary_verify(state, plan, launch).map(|state| canary_outputs(state, failure))
            }
            Op::Plan {
                swa_window_size,
                has_lut,
                has_pool,
                position_offset,
            } => {
                let plans: Vec<IntTensor<B>> = (0..10).map(&mut int).collect();
                let mut next = 14;
                let mut optional = |present: bool| {
                    present.then(|| {
                        next += 1;
                        int(next - 1)
                    })
                };
                let full_to_swa = optional(has_lut);
                let pool = optional(has_pool);
                let valid_lens = optional(has_pool);
                let [
                    slot,
                    tokens,
                    positions,
                    prev,
                    num_valid,
                    enable,
                    offsets,
                    seeds,
                    reqs,
                    scratch,
                ] = <[IntTensor<B>; 10]>::try_from(plans)
                    .ok()
                    .expect("ten plan tensors");
                let inputs = PlanInputsPrimitive {
                    req_pool_indices: int(10),
                    prefix_lens: int(11),
                    extend_seq_lens: int(12),
                    req_to_token: int(13),
                    swa_window_size,
                    full_to_swa,
                    expected_tokens: pool.zip(valid_lens),
                    position_offset,
                };
                let verify = VerifyPlanPrimitive {
                    slot_indices: slot,
                    expected_tokens: tokens,
                    expected_positions: positions,
                    prev_slot_indices: prev,
                    num_valid,
                    enable,
                };
                let write = WritePlanPrimitive {
                    offsets,
                    seed_slot_indices: seeds,
                    num_valid_reqs: reqs,
                    scratch,
                };
                B::canary_plan(verify, write, inputs)
                    .map(|out| plan_outputs(out.verify, out.write, out.status))
            }
        };
        // A lazily executed op cannot return its error: it becomes the status record instead,
        // next to outputs of the declared shapes. A failed plan leaves fresh, disabled plans, as
        // on the unfused path (zeros would leave its scratch unlike a fresh plan's).
        let tensors = result.unwrap_or_else(|error| match self.op {
            Op::Plan { .. } => failed_plan_outputs::<B>(outputs, &error, &self.device),
            _ => failed_outputs::<B>(outputs, &error, &self.device),
        });
        for (ir, tensor) in outputs.iter().zip(tensors) {
            handles.register_int_tensor::<B>(&ir.id, tensor);
        }
    }
}

impl CanaryShape {
    fn of<T>(canary: &CanaryPrimitive<T>) -> Self {
        Self {
            num_slots: canary.num_slots,
            slot_words: canary.slot_words,
            ring_capacity: canary.ring_capacity,
        }
    }
}

/// Registers a canary op on `inputs` and the canary's failure record: the first three inputs
/// (buffer, ring, counters) and the failure come back as outputs of the same shapes and dtypes.
fn register_canary<B: FusionBackend + KvPlanBackend>(
    op: Op,
    name: &'static str,
    mut inputs: Vec<FusionTensor<B::FusionRuntime>>,
    canary: CanaryShape,
    failure: Option<FusionTensor<B::FusionRuntime>>,
) -> CanaryPrimitive<FusionTensor<B::FusionRuntime>> {
    // The first op of a canary brings a clear record; later ones pass theirs on.
    let failure = failure.unwrap_or_else(|| {
        let words = crate::status::encode(&Ok(0)).to_vec();
        let device = Fusion::<B>::int_device(&inputs[0]);
        Fusion::<B>::int_from_data(TensorData::new(words, [STATUS_LEN]), &device)
    });
    inputs.push(failure);
    let outputs = inputs[..3]
        .iter()
        .chain(inputs.last())
        .map(|state| {
            TensorIr::uninit(
                state.client.create_empty_handle(),
                state.shape.clone(),
                state.dtype,
            )
        })
        .collect();
    let [buffer, ring, counters, failure] =
        <[_; 4]>::try_from(register::<B>(op, name, inputs, outputs))
            .ok()
            .expect("four canary outputs");
    canary_state(canary, buffer, ring, counters, Some(failure))
}

fn canary_state<T>(
    shape: CanaryShape,
    buffer: T,
    ring: T,
    counters: T,
    failure: Option<T>,
) -> CanaryPrimitive<T> {
    CanaryPrimitive {
        buffer,
        ring,
        counters,
        num_slots: shape.num_slots,
        slot_words: shape.slot_words,
        ring_capacity: shape.ring_capacity,
        failure,
    }
}

/// A canary op's outputs, in their declared order: the state, then the failure record (passed on
/// unchanged by an op that ran).
fn canary_outputs<T>(canary: CanaryPrimitive<T>, failure: T) -> Vec<T> {
    vec![canary.buffer, canary.ring, canary.counters, failure]
}

/// The inner backend's launch: the source tensors fetched by kind from `inputs`.
fn inner_launch<B: FusionBackend>(
    handles: &mut Handles<B>,
    meta: &LaunchMeta,
    inputs: &[TensorIr],
) -> CanaryLaunchOf<B> {
    let sources = meta
        .sources
        .iter()
        .zip(inputs)
        .map(|(&(layout, is_float), ir)| SourcePrimitive {
            tensor: if is_float {
                KvBytes::Float(handles.get_float_tensor::<B>(ir))
            } else {
                KvBytes::Int(handles.get_int_tensor::<B>(ir))
            },
            layout,
        })
        .collect();
    CanaryLaunchPrimitive {
        kernel_kind: meta.kernel_kind,
        mode: meta.mode,
        sources,
        check_expected_token: meta.check_expected_token,
    }
}

/// Outputs of the declared shapes and dtypes, the status naming the failure.
fn failed_outputs<B: FusionBackend>(
    outputs: &[TensorIr],
    error: &Error,
    device: &B::Device,
) -> Vec<IntTensor<B>> {
    // The error's own record where it has a code, else a generic execution failure.
    let mut words = crate::status::encode(&Err(error.clone()));
    if words[CODE] < 0 {
        words = [0; STATUS_LEN];
        words[CODE] = EXECUTION;
    }
    outputs
        .iter()
        .enumerate()
        .map(|(k, ir)| {
            let len = ir.shape.num_elements();
            let is_status = k + 1 == outputs.len();
            let mut data = TensorData::new(vec![0i64; len], ir.shape.clone());
            if is_status && len == STATUS_LEN {
                data = TensorData::new(words.to_vec(), ir.shape.clone());
            }
            B::int_from_data(data.convert_dtype(ir.dtype), device)
        })
        .collect()
}

/// A failed plan's outputs: fresh plans of the declared capacities, disabled, and the status.
fn failed_plan_outputs<B: FusionBackend + KvPlanBackend>(
    outputs: &[TensorIr],
    error: &Error,
    device: &B::Device,
) -> Vec<IntTensor<B>> {
    let verify_capacity = outputs[0].shape.num_elements();
    let write_capacity = outputs[7].shape.num_elements();
    let verify = crate::canary::fresh_verify::<B>(verify_capacity, 0, device);
    let write = crate::canary::fresh_write::<B>(write_capacity, device);
    let status = failed_outputs::<B>(&outputs[outputs.len() - 1..], error, device);
    plan_outputs(
        verify,
        write,
        status.into_iter().next().expect("the status output"),
    )
}

/// A plan op's outputs, in their declared order: the plans, then the status.
fn plan_outputs<T>(
    verify: VerifyPlanPrimitive<T>,
    write: WritePlanPrimitive<T>,
    status: T,
) -> Vec<T> {
    let mut outputs = plan_tensors(verify, write);
    outputs.push(status);
    outputs
}

/// The plans' tensors, in the order a plan op takes and returns them.
fn plan_tensors<T>(verify: VerifyPlanPrimitive<T>, write: WritePlanPrimitive<T>) -> Vec<T> {
    vec![
        verify.slot_indices,
        verify.expected_tokens,
        verify.expected_positions,
        verify.prev_slot_indices,
        verify.num_valid,
        verify.enable,
        write.offsets,
        write.seed_slot_indices,
        write.num_valid_reqs,
        write.scratch,
    ]
}

fn output_ir<R: FusionRuntime>(
    tensor_client: &FusionTensor<R>,
    len: usize,
    dtype: DType,
) -> TensorIr {
    TensorIr::uninit(
        tensor_client.client.create_empty_handle(),
        Shape::new([len]),
        dtype,
    )
}

/// Registers `op` on `inputs` with `outputs` declared; returns the output tensors.
fn register<B: FusionBackend + KvPlanBackend>(
    op: Op,
    name: &'static str,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<TensorIr>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    let device = Fusion::<B>::int_device(&inputs[0]);
    let streams = OperationStreams::with_inputs(inputs.iter());
    let inputs: Vec<TensorIr> = inputs.into_iter().map(FusionTensor::into_ir).collect();
    let desc = CustomOpIr::new(name, &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        CustomOp::<B> {
            desc,
            op,
            device,
            _backend: PhantomData,
        },
    )
}

fn gather_outputs<R: FusionRuntime>(first: &FusionTensor<R>, capacity: usize) -> Vec<TensorIr> {
    vec![
        output_ir(first, capacity, DType::I64),
        output_ir(first, 1, DType::I64),
        output_ir(first, STATUS_LEN, DType::I64),
    ]
}

fn into_gather<T>(outputs: Vec<T>) -> GatherOutput<T> {
    let [out, count, status] = <[T; 3]>::try_from(outputs)
        .ok()
        .expect("three gather outputs");
    GatherOutput { out, count, status }
}

impl<B: FusionBackend + KvPlanBackend> KvPlanBackend for Fusion<B> {
    fn masked_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        pos2d: IntTensor<Self>,
        mask: BoolTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        let outputs = gather_outputs(&req_to_token, capacity);
        let inputs = vec![req_to_token, req_pool_indices, pos2d, mask];
        let op = Op::MaskedGather { capacity };
        Ok(into_gather(register::<B>(
            op,
            "kvplan::masked_gather",
            inputs,
            outputs,
        )))
    }

    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        let outputs = gather_outputs(&req_to_token, capacity);
        let op = Op::SegmentGather {
            capacity,
            has_start: start.is_some(),
        };
        let inputs = [
            Some(req_to_token),
            Some(req_pool_indices),
            start,
            Some(lengths),
        ];
        let inputs = inputs.into_iter().flatten().collect();
        Ok(into_gather(register::<B>(
            op,
            "kvplan::segment_gather",
            inputs,
            outputs,
        )))
    }

    fn read_status(status: IntTensor<Self>) -> Result<crate::status::StatusWords, Error> {
        // The stream is drained up to the status, which is then read by the base backend (one
        // transfer, without Burn's `into_data` path).
        let client = status.client.clone();
        B::read_status(client.resolve_tensor_int::<B>(status))
    }

    fn int_prefix(tensor: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        let outputs = vec![output_ir(&tensor, len, DType::I64)];
        let mut outputs =
            register::<B>(Op::Prefix { len }, "kvplan::prefix", vec![tensor], outputs);
        outputs.remove(0)
    }

    fn canary_write(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: WritePlanPrimitive<IntTensor<Self>>,
        inputs: WriteInputsPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        let (meta, sources) = LaunchMeta::split(launch);
        let shape = CanaryShape::of(&canary);
        let op = Op::CanaryWrite {
            canary: shape,
            launch: meta,
            has_expected: inputs.expected_inputs.is_some(),
            has_chain_flag: inputs.chain_position_assert.is_some(),
        };
        let (expected_tokens, expected_positions) = inputs.expected_inputs.unzip();
        let mut all = vec![
            canary.buffer,
            canary.ring,
            canary.counters,
            plan.offsets,
            plan.seed_slot_indices,
            plan.num_valid_reqs,
            plan.scratch,
            inputs.input_ids,
            inputs.positions,
            inputs.out_cache_loc,
        ];
        all.extend(
            [
                expected_tokens,
                expected_positions,
                inputs.chain_position_assert,
            ]
            .into_iter()
            .flatten(),
        );
        all.extend(sources);
        Ok(register_canary::<B>(
            op,
            "kvplan::canary_write",
            all,
            shape,
            canary.failure,
        ))
    }

    fn canary_verify(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: VerifyPlanPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        let (meta, sources) = LaunchMeta::split(launch);
        let shape = CanaryShape::of(&canary);
        let op = Op::CanaryVerify {
            canary: shape,
            launch: meta,
        };
        let mut all = vec![
            canary.buffer,
            canary.ring,
            canary.counters,
            plan.slot_indices,
            plan.expected_tokens,
            plan.expected_positions,
            plan.prev_slot_indices,
            plan.num_valid,
            plan.enable,
        ];
        all.extend(sources);
        Ok(register_canary::<B>(
            op,
            "kvplan::canary_verify",
            all,
            shape,
            canary.failure,
        ))
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<IntTensor<Self>>,
        write: WritePlanPrimitive<IntTensor<Self>>,
        inputs: PlanInputsPrimitive<IntTensor<Self>>,
    ) -> Result<PlanOutput<IntTensor<Self>>, Error> {
        let plans = plan_tensors(verify, write);
        // The plans come back with their own shapes and dtypes, then the status record.
        let mut outputs: Vec<TensorIr> = plans
            .iter()
            .map(|plan| output_ir(plan, plan.shape.num_elements(), plan.dtype))
            .collect();
        outputs.push(output_ir(&plans[0], STATUS_LEN, DType::I64));
        let op = Op::Plan {
            swa_window_size: inputs.swa_window_size,
            has_lut: inputs.full_to_swa.is_some(),
            has_pool: inputs.expected_tokens.is_some(),
            position_offset: inputs.position_offset,
        };
        let (pool, valid_lens) = inputs.expected_tokens.unzip();
        let mut all = plans;
        all.extend([
            inputs.req_pool_indices,
            inputs.prefix_lens,
            inputs.extend_seq_lens,
            inputs.req_to_token,
        ]);
        all.extend([inputs.full_to_swa, pool, valid_lens].into_iter().flatten());
        let outputs = register::<B>(op, "kvplan::canary_plan", all, outputs);
        let [
            slot,
            tokens,
            positions,
            prev,
            num_valid,
            enable,
            offsets,
            seeds,
            reqs,
            scratch,
            status,
        ] = <[IntTensor<Self>; 11]>::try_from(outputs)
            .ok()
            .expect("eleven plan outputs");
        Ok(PlanOutput {
            verify: VerifyPlanPrimitive {
                slot_indices: slot,
                expected_tokens: tokens,
                expected_positions: positions,
                prev_slot_indices: prev,
                num_valid,
                enable,
            },
            write: WritePlanPrimitive {
                offsets,
                seed_slot_indices: seeds,
                num_valid_reqs: reqs,
                scratch,
            },
            status,
        })
    }
}
