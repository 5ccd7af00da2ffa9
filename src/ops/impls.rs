//! Which backends implement `KvPlanBackend`, and how.
//!
//! Host backends use the default (reference) bodies. `Autodiff` delegates to its inner backend:
//! int and bool tensors are not tracked, so there is no gradient to record.

use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_tensor::ops::{BoolTensor, IntTensor};

use super::{
    CanaryLaunchOf, CanaryPrimitive, GatherOutput, KvBytes, KvPlanBackend, PlanInputsPrimitive,
    PlanOutput, SourcePrimitive, VerifyPlanPrimitive, WriteInputsPrimitive, WritePlanPrimitive,
};
use crate::error::Error;
use crate::status::StatusWords;

impl KvPlanBackend for burn_flex::Flex {}

impl<R, F, I, BT> KvPlanBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn masked_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        pos2d: IntTensor<Self>,
        mask: BoolTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        super::cube::masked_gather(req_to_token, req_pool_indices, pos2d, mask, capacity)
    }

    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        super::cube::segment_gather(req_to_token, req_pool_indices, start, lengths, capacity)
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<IntTensor<Self>>,
        write: WritePlanPrimitive<IntTensor<Self>>,
        inputs: PlanInputsPrimitive<IntTensor<Self>>,
    ) -> Result<PlanOutput<IntTensor<Self>>, Error> {
        super::cube::canary_plan(verify, write, inputs)
    }

    fn canary_write(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: WritePlanPrimitive<IntTensor<Self>>,
        inputs: WriteInputsPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        super::cube::canary_write(canary, plan, inputs, launch)
    }

    fn canary_verify(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: VerifyPlanPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        super::cube::canary_verify(canary, plan, launch)
    }

    fn int_row_stride(tensor: &IntTensor<Self>) -> i64 {
        tensor
            .meta
            .strides()
            .first()
            .map_or(1, |&stride| stride as i64)
    }

    fn read_status(status: IntTensor<Self>) -> Result<StatusWords, Error> {
        super::cube::read_status(status)
    }

    fn int_prefix(tensor: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        burn_cubecl::tensor::CubeTensor::new_contiguous(
            tensor.client.clone(),
            tensor.device.clone(),
            burn_tensor::Shape::new([len]),
            tensor.handle.clone(),
            tensor.dtype,
        )
    }
}

impl<B: KvPlanBackend, C: CheckpointStrategy> KvPlanBackend for Autodiff<B, C> {
    fn masked_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        pos2d: IntTensor<Self>,
        mask: BoolTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        B::masked_gather(req_to_token, req_pool_indices, pos2d, mask, capacity)
    }

    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        B::segment_gather(req_to_token, req_pool_indices, start, lengths, capacity)
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<IntTensor<Self>>,
        write: WritePlanPrimitive<IntTensor<Self>>,
        inputs: PlanInputsPrimitive<IntTensor<Self>>,
    ) -> Result<PlanOutput<IntTensor<Self>>, Error> {
        B::canary_plan(verify, write, inputs)
    }

    fn canary_write(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: WritePlanPrimitive<IntTensor<Self>>,
        inputs: WriteInputsPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        B::canary_write(canary, plan, inputs, inner_launch::<B, C>(launch))
    }

    fn canary_verify(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: VerifyPlanPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        B::canary_verify(canary, plan, inner_launch::<B, C>(launch))
    }

    fn int_row_stride(tensor: &IntTensor<Self>) -> i64 {
        B::int_row_stride(tensor)
    }

    fn int_prefix(tensor: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        B::int_prefix(tensor, len)
    }

    fn read_status(status: IntTensor<Self>) -> Result<StatusWords, Error> {
        B::read_status(status)
    }
}

/// The launch with float sources unwrapped from their autodiff nodes (bytes are only read).
fn inner_launch<B: KvPlanBackend, C: CheckpointStrategy>(
    launch: CanaryLaunchOf<Autodiff<B, C>>,
) -> CanaryLaunchOf<B> {
    let sources = launch
        .sources
        .into_iter()
        .map(|source| SourcePrimitive {
            tensor: match source.tensor {
                KvBytes::Float(tensor) => KvBytes::Float(tensor.primitive),
                KvBytes::Int(tensor) => KvBytes::Int(tensor),
            },
            layout: source.layout,
        })
        .collect();
    super::CanaryLaunchPrimitive {
        kernel_kind: launch.kernel_kind,
        mode: launch.mode,
        sources,
        check_expected_token: launch.check_expected_token,
    }
}
