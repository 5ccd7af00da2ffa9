//! Masked and segment gather over `req_to_token`: each enqueues and returns a fixed-capacity
//! output with its status, nothing read back (check the status with the step's others).
//!
//! ```no_run
//! use burn_core::tensor::{Bool, Int, Tensor};
//! use kvplan::ops::GatherOptions;
//! # fn step(req_to_token: Tensor<2, Int>, req_pool_indices: Tensor<1, Int>,
//! #     draft_positions: Tensor<2, Int>, draft_mask: Tensor<2, Bool>) -> Result<(), kvplan::Error> {
//! let options = GatherOptions::new().context("draft window");
//! let draft = kvplan::ops::masked_gather(req_to_token, req_pool_indices, draft_positions, draft_mask, &options)?;
//! // ... later, once per step: the number of gathered slots, or the first error.
//! let count = draft.status.check()?;
//! let slots = draft.slots().slice([0..count]);
//! # Ok(()) }
//! ```

use burn_core::backend::Backend;
use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::backend::{Dispatch, TensorMetadata};
use burn_core::tensor::{Bool, Int, Slice, Tensor};

use crate::backend::{GatherPrimitive, KvPlanBackend, OptionalInt};
use crate::deferred::Status;
use crate::error::{Error, SEGMENT_CONTEXT};
use crate::layout::COUNT;
use crate::room::{self, Buffer};
use crate::validate::{self, Arg};

/// What an `allocation_too_large` error of a gather names.
const GATHER_OUTPUT: &str = "gather output";

/// The knobs of a gather.
#[derive(Debug, Clone, Default)]
pub struct GatherOptions {
    capacity: Option<usize>,
    context: String,
}

impl GatherOptions {
    /// No capacity (the largest possible output), no context.
    pub fn new() -> Self {
        Self::default()
    }

    /// The output's capacity: `R * C` (masked) or `S * cols` (segments) by default; a smaller one
    /// is checked on the device (`capacity_exceeded`).
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = Some(capacity);
        self
    }

    /// The prefix of every error message (a segment gather without one uses the spec's
    /// `DFLASH req_to_token segment gather`).
    pub fn context(mut self, context: impl Into<String>) -> Self {
        self.context = context.into();
        self
    }

    /// A segment gather's message prefix: the caller's context, or the spec's.
    fn segment_context(&self) -> &str {
        if self.context.is_empty() {
            SEGMENT_CONTEXT
        } else {
            &self.context
        }
    }
}

/// The result of a gather: nothing was read back and nothing synchronised.
#[derive(Debug, Clone)]
pub struct Gathered<B: Backend = Dispatch> {
    /// i64 `[capacity]`. `out[0..count]` are the gathered slots; the tail is unspecified.
    pub out: IntTensor<B>,
    /// The device-side validation status; its count word is the number of gathered values.
    pub status: Status<B>,
}

impl<B: Backend> Gathered<B> {
    /// i64 `[1]` on the device: the number of gathered values, 0 after a deferred error. A view
    /// of the status record's count word: the op makes no separate count output (each output
    /// costs Fusion an operation when it is dropped).
    pub fn count(&self) -> IntTensor<B> {
        B::int_slice(
            self.status.words().clone(),
            &[Slice::from(COUNT..COUNT + 1)],
        )
    }
}

pub(crate) fn arg<T: TensorMetadata>(name: &'static str, tensor: &T) -> Arg<T::Device> {
    Arg {
        name,
        shape: tensor.shape().to_vec(),
        dtype: tensor.dtype(),
        device: tensor.device(),
    }
}

/// The gathers on any backend's primitives (kvplan's own tools; not a stable API).
#[doc(hidden)]
pub mod generic {
    use super::*;

    /// [`masked_gather`](super::masked_gather) on primitives.
    ///
    /// # Errors
    /// As [`masked_gather`](super::masked_gather).
    pub fn masked_gather<B: KvPlanBackend>(
        req_to_token: IntTensor<B>,
        req_pool_indices: IntTensor<B>,
        pos2d: IntTensor<B>,
        mask: BoolTensor<B>,
        options: &GatherOptions,
    ) -> Result<Gathered<B>, Error> {
        let context = options.context.as_str();
        validate::masked_gather(
            &arg("req_to_token", &req_to_token),
            &arg("req_pool_indices", &req_pool_indices),
            &arg("pos2d", &pos2d),
            &arg("mask", &mask),
            context,
        )?;
        let capacity = options
            .capacity
            .unwrap_or_else(|| mask.shape().num_elements());
        room::on_device(
            &req_to_token.device(),
            &[Buffer::i64s(GATHER_OUTPUT, capacity)],
        )?;
        let output = B::masked_gather(req_to_token, req_pool_indices, pos2d, mask, capacity);
        Ok(deferred(output, context))
    }

    /// [`segment_gather`](super::segment_gather) on primitives.
    ///
    /// # Errors
    /// As [`segment_gather`](super::segment_gather).
    pub fn segment_gather<B: KvPlanBackend>(
        req_to_token: IntTensor<B>,
        req_pool_indices: IntTensor<B>,
        start: Option<IntTensor<B>>,
        lengths: IntTensor<B>,
        options: &GatherOptions,
    ) -> Result<Gathered<B>, Error> {
        let context = options.segment_context();
        validate::segment_gather(
            &arg("req_to_token", &req_to_token),
            &arg("req_pool_indices", &req_pool_indices),
            start.as_ref().map(|start| arg("start", start)).as_ref(),
            &arg("lengths", &lengths),
            context,
        )?;
        let cols = req_to_token.shape().as_slice().get(1).copied().unwrap_or(0);
        let capacity = options
            .capacity
            .unwrap_or_else(|| lengths.shape().num_elements().saturating_mul(cols));
        room::on_device(
            &req_to_token.device(),
            &[Buffer::i64s(GATHER_OUTPUT, capacity)],
        )?;
        let output = B::segment_gather(
            req_to_token,
            req_pool_indices,
            OptionalInt::from(start),
            lengths,
            capacity,
        );
        Ok(deferred(output, context))
    }

    /// Exact mode: one read-back of the status, then the first `count` values.
    ///
    /// # Errors
    /// The error the gather's status holds (see [`Status::check`](crate::Status::check)), read back
    /// here; `execution` when the read-back fails.
    pub fn exact<B: KvPlanBackend>(gathered: Gathered<B>) -> Result<IntTensor<B>, Error> {
        let count = gathered.status.check()?;
        Ok(B::int_view(gathered.out, 0, count))
    }

    fn deferred<B: Backend>(output: GatherPrimitive<B>, context: &str) -> Gathered<B> {
        Gathered {
            out: output.out,
            status: Status::new(output.status, context),
        }
    }
}

/// `req_to_token[req_pool_indices[i], pos2d[i, j]]` for every true `mask[i, j]`, row-major, into
/// the first `count` values of a fixed-capacity i64 output (spec `gather.md` §3, §5); `count` is
/// the status's. `req_pool_indices` may hold one index shared by every pos row. Every error
/// message starts with the options' context. Nothing is read back.
///
/// # Errors
/// At once: `pos_not_2d`, `mask_shape_mismatch`, `not_1d` / `not_2d`, `dtype_mismatch`,
/// `device_mismatch`, `index_shape_mismatch` / `mask_index_shape_mismatch` (a table with columns),
/// `allocation_too_large`. In `status` (value rules): `empty_table_nonempty_mask`,
/// `req_pool_index_out_of_range`, `position_out_of_range`, `capacity_exceeded`, `index_range`.
pub fn masked_gather(
    req_to_token: Tensor<2, Int>,
    req_pool_indices: Tensor<1, Int>,
    pos2d: Tensor<2, Int>,
    mask: Tensor<2, Bool>,
    options: &GatherOptions,
) -> Result<Gathered, Error> {
    generic::masked_gather::<Dispatch>(
        req_to_token.into_dispatch(),
        req_pool_indices.into_dispatch(),
        pos2d.into_dispatch(),
        mask.into_dispatch(),
        options,
    )
}

/// The slots of one run of consecutive positions per segment, `req_to_token[row(i)][start[i] + j]`
/// for `j < lengths[i]`, into the first `count` values of a fixed-capacity i64 output (spec
/// `gather.md` §4, §5). `start = None` starts every segment at position 0. Neither a position
/// rectangle nor a mask is ever built. Nothing is read back.
///
/// # Errors
/// At once: `not_1d` / `not_2d`, `dtype_mismatch`, `device_mismatch`, `allocation_too_large`. In
/// `status`, as every other rule hangs on `lengths`: `mask_shape_mismatch`,
/// `empty_table_nonempty_mask`, `index_shape_mismatch` / `mask_index_shape_mismatch`,
/// `req_pool_index_out_of_range`, `position_out_of_range`, `capacity_exceeded`, `index_range`.
pub fn segment_gather(
    req_to_token: Tensor<2, Int>,
    req_pool_indices: Tensor<1, Int>,
    start: Option<Tensor<1, Int>>,
    lengths: Tensor<1, Int>,
    options: &GatherOptions,
) -> Result<Gathered, Error> {
    generic::segment_gather::<Dispatch>(
        req_to_token.into_dispatch(),
        req_pool_indices.into_dispatch(),
        start.map(Tensor::into_dispatch),
        lengths.into_dispatch(),
        options,
    )
}

impl Gathered {
    /// The output, i64 `[capacity]`: its first `count` values (the status's) are the slots.
    pub fn slots(&self) -> Tensor<1, Int> {
        Tensor::from_dispatch(self.out.clone())
    }

    /// [`count`](Gathered::count) as a tensor.
    pub fn count_tensor(&self) -> Tensor<1, Int> {
        Tensor::from_dispatch(self.count())
    }
}
