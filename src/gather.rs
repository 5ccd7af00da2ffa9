//! Masked and segment gather over `req_to_token`: the public, tensor-level API.
//!
//! ```no_run
//! use burn_tensor::{Bool, Int, Tensor};
//! # fn step<B: kvplan::KvPlanBackend>(
//! #     req_to_token: Tensor<B, 2, Int>, req_pool_indices: Tensor<B, 1, Int>,
//! #     pos2d: Tensor<B, 2, Int>, mask: Tensor<B, 2, Bool>,
//! # ) -> Result<(), kvplan::Error> {
//! // KV slots of the draft window, compacted row-major (one read-back for the count).
//! let slots = kvplan::masked_gather(req_to_token.clone(), req_pool_indices.clone(), pos2d.clone(), mask.clone(), "draft")?;
//! // Inside a decode step: no read-back, no sync; check the status when you choose to.
//! let gathered = kvplan::masked_gather_with_capacity(req_to_token, req_pool_indices, pos2d, mask, None, "draft")?;
//! let count = gathered.status.check()?;
//! # Ok(()) }
//! ```

use burn_tensor::{Bool, Int, Tensor};

use crate::error::{Error, SEGMENT_CONTEXT};
use crate::ops::{GatherOutput, KvPlanBackend};
use crate::status;
use crate::validate::{self, Arg};

/// The result of a capacity-mode gather: nothing was read back and nothing synchronised.
#[derive(Debug, Clone)]
pub struct CapacityGather<B: KvPlanBackend> {
    /// i64 `[capacity]`. `out[0..count]` are the gathered slots; the tail is unspecified.
    pub out: Tensor<B, 1, Int>,
    /// i64 `[1]`: the number of gathered values, 0 after a deferred error.
    pub count: Tensor<B, 1, Int>,
    /// The device-side validation status.
    pub status: GatherStatus<B>,
}

/// The device-side status of a capacity-mode gather.
#[derive(Debug, Clone)]
pub struct GatherStatus<B: KvPlanBackend> {
    words: Tensor<B, 1, Int>,
    context: String,
}

impl<B: KvPlanBackend> GatherStatus<B> {
    /// Reads the status back (one transfer) and returns `count`, or the error exact mode would
    /// have returned.
    pub fn check(&self) -> Result<usize, Error> {
        let words = B::read_status(self.words.clone().into_primitive())?;
        status::decode(&words, &self.context)
    }

    /// The raw i64 status record (`kvplan_kernels::status` layout), for callers that keep it on
    /// the device.
    pub fn words(&self) -> &Tensor<B, 1, Int> {
        &self.words
    }
}

pub(crate) fn arg<B: KvPlanBackend, const D: usize, K>(
    name: &'static str,
    tensor: &Tensor<B, D, K>,
) -> Arg<B::Device>
where
    K: burn_tensor::BasicOps<B>,
{
    Arg {
        name,
        shape: tensor.shape().to_vec(),
        dtype: tensor.dtype(),
        device: tensor.device(),
    }
}

/// `req_to_token[req_pool_indices[i], pos2d[i, j]]` for every true `mask[i, j]`, row-major, as a
/// 1-D i64 tensor of exactly `count` values (spec `gather.md` §3).
///
/// One device-to-host transfer (count and status together). `req_pool_indices` may hold one index
/// shared by every pos row. Every error message starts with `context`.
pub fn masked_gather<B, const DT: usize, const DP: usize, const DM: usize>(
    req_to_token: Tensor<B, DT, Int>,
    req_pool_indices: Tensor<B, 1, Int>,
    pos2d: Tensor<B, DP, Int>,
    mask: Tensor<B, DM, Bool>,
    context: &str,
) -> Result<Tensor<B, 1, Int>, Error>
where
    B: KvPlanBackend,
{
    let gathered =
        masked_gather_with_capacity(req_to_token, req_pool_indices, pos2d, mask, None, context)?;
    exact(gathered)
}

/// `masked_gather` into a fixed-capacity output, without any transfer to the host (spec §5).
///
/// `capacity` defaults to `R * C`; a smaller one is checked on the device (`capacity_exceeded`).
pub fn masked_gather_with_capacity<B, const DT: usize, const DP: usize, const DM: usize>(
    req_to_token: Tensor<B, DT, Int>,
    req_pool_indices: Tensor<B, 1, Int>,
    pos2d: Tensor<B, DP, Int>,
    mask: Tensor<B, DM, Bool>,
    capacity: Option<usize>,
    context: &str,
) -> Result<CapacityGather<B>, Error>
where
    B: KvPlanBackend,
{
    validate::masked_gather(
        &arg("req_to_token", &req_to_token),
        &arg("req_pool_indices", &req_pool_indices),
        &arg("pos2d", &pos2d),
        &arg("mask", &mask),
        context,
    )?;
    let capacity = capacity.unwrap_or_else(|| mask.shape().num_elements());
    let output = B::masked_gather(
        req_to_token.into_primitive(),
        req_pool_indices.into_primitive(),
        pos2d.into_primitive(),
        mask.into_primitive(),
        capacity,
    )?;
    Ok(capacity_gather(output, context))
}

/// The slots of one run of consecutive positions per segment: `req_to_token[row(i)][start[i] + j]`
/// for `j < lengths[i]`, as a 1-D i64 tensor of exactly `count` values (spec `gather.md` §4).
///
/// `start = None` starts every segment at position 0. Neither a position rectangle nor a mask is
/// ever built.
pub fn segment_gather<B, const DT: usize>(
    req_to_token: Tensor<B, DT, Int>,
    req_pool_indices: Tensor<B, 1, Int>,
    start: Option<Tensor<B, 1, Int>>,
    lengths: Tensor<B, 1, Int>,
) -> Result<Tensor<B, 1, Int>, Error>
where
    B: KvPlanBackend,
{
    exact(segment_gather_with_capacity(
        req_to_token,
        req_pool_indices,
        start,
        lengths,
        None,
    )?)
}

/// `segment_gather` into a fixed-capacity output, without any transfer to the host (spec §5).
///
/// `capacity` defaults to `S * cols`; another one is checked on the device (`capacity_exceeded`).
pub fn segment_gather_with_capacity<B, const DT: usize>(
    req_to_token: Tensor<B, DT, Int>,
    req_pool_indices: Tensor<B, 1, Int>,
    start: Option<Tensor<B, 1, Int>>,
    lengths: Tensor<B, 1, Int>,
    capacity: Option<usize>,
) -> Result<CapacityGather<B>, Error>
where
    B: KvPlanBackend,
{
    validate::segment_gather(
        &arg("req_to_token", &req_to_token),
        &arg("req_pool_indices", &req_pool_indices),
        start.as_ref().map(|start| arg("start", start)).as_ref(),
        &arg("lengths", &lengths),
    )?;
    let cols = req_to_token.shape().as_slice().get(1).copied().unwrap_or(0);
    let capacity = capacity.unwrap_or_else(|| lengths.shape().num_elements().saturating_mul(cols));
    let output = B::segment_gather(
        req_to_token.into_primitive(),
        req_pool_indices.into_primitive(),
        start.map(Tensor::into_primitive),
        lengths.into_primitive(),
        capacity,
    )?;
    Ok(capacity_gather(output, SEGMENT_CONTEXT))
}

fn capacity_gather<B: KvPlanBackend>(
    output: GatherOutput<burn_tensor::ops::IntTensor<B>>,
    context: &str,
) -> CapacityGather<B> {
    CapacityGather {
        out: Tensor::from_primitive(output.out),
        count: Tensor::from_primitive(output.count),
        status: GatherStatus {
            words: Tensor::from_primitive(output.status),
            context: context.into(),
        },
    }
}

/// Exact mode: one read-back of the status, then the first `count` values.
fn exact<B: KvPlanBackend>(gathered: CapacityGather<B>) -> Result<Tensor<B, 1, Int>, Error> {
    let count = gathered.status.check()?;
    Ok(Tensor::from_primitive(B::int_prefix(
        gathered.out.into_primitive(),
        count,
    )))
}
