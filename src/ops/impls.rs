//! Which backends implement `KvPlanBackend`, and how.
//!
//! Host backends use the default (reference) bodies. `Autodiff` delegates to its inner backend:
//! int and bool tensors are not tracked, so there is no gradient to record.

use burn_autodiff::Autodiff;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use burn_tensor::ops::{BoolTensor, IntTensor};

use super::{
    GatherOutput, KvPlanBackend, PlanInputsPrimitive, PlanOutput, VerifyPlanPrimitive,
    WritePlanPrimitive,
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
        Ok(super::cube::masked_gather(
            req_to_token,
            req_pool_indices,
            pos2d,
            mask,
            capacity,
        ))
    }

    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        Ok(super::cube::segment_gather(
            req_to_token,
            req_pool_indices,
            start,
            lengths,
            capacity,
        ))
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<IntTensor<Self>>,
        write: WritePlanPrimitive<IntTensor<Self>>,
        inputs: PlanInputsPrimitive<IntTensor<Self>>,
    ) -> Result<PlanOutput<IntTensor<Self>>, Error> {
        Ok(super::cube::canary_plan(verify, write, inputs))
    }

    fn int_row_stride(tensor: &IntTensor<Self>) -> i64 {
        tensor
            .meta
            .strides()
            .first()
            .map_or(1, |&stride| stride as i64)
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
