//! The backend extension trait: kvplan's ops on Burn primitives.
//!
//! Every method has a default body that runs the host reference (read inputs back, compute, upload
//! results), so the trait works on any Burn backend. CubeCL backends override the bodies with
//! kernels. The public API (`crate::gather`, `crate::canary`) validates inputs before calling in
//! here, so implementations may rely on the host rules having passed.

mod cube;
mod fusion;
mod host;
mod impls;

pub use host::data_to_i64;
pub(crate) use host::{canary_state, read_ints, upload_canary};

use burn_tensor::TensorMetadata;
use burn_tensor::backend::Backend;
use burn_tensor::ops::{BoolTensor, FloatTensor, IntTensor};

use crate::error::Error;
use crate::reference::RealKvHashMode;

// The structs below are generic over the int primitive `T` (`IntTensor<B>`) rather than the
// backend, so that backends sharing a primitive (`Autodiff<B>` and `B`) share the types too.

/// The device-side result of a gather.
#[derive(Debug, Clone)]
pub struct GatherOutput<T> {
    /// i64 `[capacity]`; the first `count` values are the gathered slots.
    pub out: T,
    /// i64 `[1]`: the number of gathered values (0 after a deferred error).
    pub count: T,
    /// i64 status record (`kvplan_kernels::status`).
    pub status: T,
}

/// A `VerifyPlan`'s tensors, in the spec's field order.
#[derive(Debug, Clone)]
pub struct VerifyPlanPrimitive<T> {
    /// i64 `[V]`.
    pub slot_indices: T,
    /// i64 `[V]`.
    pub expected_tokens: T,
    /// i64 `[V]`.
    pub expected_positions: T,
    /// i64 `[V]`.
    pub prev_slot_indices: T,
    /// i32 `[1]`.
    pub num_valid: T,
    /// i32 `[1]`.
    pub enable: T,
}

impl<T> VerifyPlanPrimitive<T> {
    /// The plan with `f` applied to each of its tensors.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> VerifyPlanPrimitive<U> {
        VerifyPlanPrimitive {
            slot_indices: f(self.slot_indices),
            expected_tokens: f(self.expected_tokens),
            expected_positions: f(self.expected_positions),
            prev_slot_indices: f(self.prev_slot_indices),
            num_valid: f(self.num_valid),
            enable: f(self.enable),
        }
    }
}

/// A `WritePlan`'s tensors, in the spec's field order.
#[derive(Debug, Clone)]
pub struct WritePlanPrimitive<T> {
    /// i64 `[K+1]`.
    pub offsets: T,
    /// i64 `[K]`.
    pub seed_slot_indices: T,
    /// i32 `[1]`.
    pub num_valid_reqs: T,
    /// i64 `[scratch_len(K)]`: the kernels' control words and tile states, kept with the plan so that no call
    /// uploads or clears anything (each call leaves them ready for the next). Unused by the host
    /// reference.
    pub scratch: T,
}

/// The inputs of one plan step as primitives (dtype i32 or i64 each, validated).
#[derive(Debug, Clone)]
pub struct PlanInputsPrimitive<T> {
    /// `[bs]`; 0 marks a padding row.
    pub req_pool_indices: T,
    /// `[bs]`.
    pub prefix_lens: T,
    /// `[bs]`.
    pub extend_seq_lens: T,
    /// `[rows, cols]`.
    pub req_to_token: T,
    /// `W`; `<= 0` means no window.
    pub swa_window_size: i32,
    /// `[lut_len]`, non-empty.
    pub full_to_swa: Option<T>,
    /// The pool `[prow, pcol]` and its valid lengths `[bs]`.
    pub expected_tokens: Option<(T, T)>,
    /// Column shift into the pool.
    pub position_offset: i32,
}

/// The result of one plan step: the plans (filled in place) and the i64 status record.
#[derive(Debug, Clone)]
pub struct PlanOutput<T> {
    /// The verify plan.
    pub verify: VerifyPlanPrimitive<T>,
    /// The write plan.
    pub write: WritePlanPrimitive<T>,
    /// i64 status record (`kvplan_kernels::status`).
    pub status: T,
}

/// A canary's device state.
#[derive(Debug, Clone)]
pub struct CanaryPrimitive<T> {
    /// i64 `[max(N, 1) * S / 8]`: the slot records, slot-major (1-D: a 2-D allocation may get
    /// padded rows on CUDA).
    pub buffer: T,
    /// i64 `[max(C, 1) * 8]`: the violation ring.
    pub ring: T,
    /// i64 `[3]`: write index, `slot_run_counter`, `kernel_run_counter`
    /// (`kvplan_kernels::canary::{WRITE_INDEX, SLOT_RUN, KERNEL_RUN}`).
    pub counters: T,
    /// `N` (the buffer keeps at least one row: zero-sized buffers are not bindable everywhere).
    pub num_slots: usize,
    /// `S / 8`.
    pub slot_words: usize,
    /// `C` (the ring keeps at least one row, for the same reason).
    pub ring_capacity: usize,
    /// `Fusion` only: i64 `[STATUS_LEN]`, the status record of the latest op whose launch failed
    /// when its stream ran (a lazily run op cannot return its `Err`), else a clear record. `None`
    /// on every other backend, whose ops return their errors.
    pub failure: Option<T>,
}

/// The bytes of a real-KV source: a float or an int tensor, never copied.
#[derive(Debug, Clone)]
pub enum KvBytes<F, I> {
    /// A float tensor (any float dtype).
    Float(F),
    /// An int tensor (any int dtype).
    Int(I),
}

/// A real-KV source's layout in bytes (spec §4.2), validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceLayout {
    /// Rows of the byte matrix.
    pub rows: usize,
    /// Bytes per row (the row stride), a multiple of 16.
    pub row_bytes: usize,
    /// Slots per row.
    pub page_size: usize,
    /// Bytes per slot strip, a positive multiple of 16.
    pub num_bytes_per_token: usize,
    /// Bytes `ALL` folds, a positive multiple of 16, at most the strip.
    pub read_bytes: usize,
}

/// A real-KV source as primitives.
#[derive(Debug, Clone)]
pub struct SourcePrimitive<F, I> {
    /// The tensor whose bytes are read.
    pub tensor: KvBytes<F, I>,
    /// How its bytes map to slots.
    pub layout: SourceLayout,
}

/// What a write or verify launch takes besides its plan.
#[derive(Debug, Clone)]
pub struct CanaryLaunchPrimitive<F, I> {
    /// `kernel_kind`, stamped into every row.
    pub kernel_kind: i32,
    /// `real_kv_hash_mode`.
    pub mode: RealKvHashMode,
    /// At most 4 sources, in fold order.
    pub sources: Vec<SourcePrimitive<F, I>>,
    /// Verify only: `check_verify_expected_token`.
    pub check_expected_token: bool,
}

/// A write step's token arrays (i64 `[T]` each).
#[derive(Debug, Clone)]
pub struct WriteInputsPrimitive<T> {
    /// Token ids.
    pub input_ids: T,
    /// Positions.
    pub positions: T,
    /// Canary slot per token; negative skips the token.
    pub out_cache_loc: T,
    /// `(expected_input_tokens, expected_input_positions)`: the input assert is on when given.
    pub expected_inputs: Option<(T, T)>,
    /// i32 `[1]` `enable_chain_position_assert`; `None` is off.
    pub chain_position_assert: Option<T>,
}

/// The launch arguments of a backend `B`.
pub type CanaryLaunchOf<B> = CanaryLaunchPrimitive<FloatTensor<B>, IntTensor<B>>;

/// kvplan's ops as a Burn backend extension (burn-vision style).
///
/// Implemented for every backend kvplan knows: the CubeCL ones (`CubeBackend`, `Fusion`,
/// `Autodiff`) and the host ones, which use the default bodies. A custom backend opts in with an
/// empty `impl KvPlanBackend for MyBackend {}`.
pub trait KvPlanBackend: Backend {
    /// Masked gather (spec `gather.md` §3, rules 6-10) into an output of `capacity` values.
    ///
    /// `capacity` is also the bound of rule 10. Rules 1-5 have been checked by the caller.
    fn masked_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        pos2d: IntTensor<Self>,
        mask: BoolTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        host::masked_gather::<Self>(req_to_token, req_pool_indices, pos2d, mask, capacity)
    }

    /// Segment gather (spec `gather.md` §4, rules 4-10) into an output of `capacity` values.
    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: Option<IntTensor<Self>>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> Result<GatherOutput<IntTensor<Self>>, Error> {
        host::segment_gather::<Self>(req_to_token, req_pool_indices, start, lengths, capacity)
    }

    /// One kv-canary plan step (spec `canary-plan.md` §4 and rules 12-17), filling the plans in
    /// place. Rules 1-11 have been checked by the caller.
    fn canary_plan(
        verify: VerifyPlanPrimitive<IntTensor<Self>>,
        write: WritePlanPrimitive<IntTensor<Self>>,
        inputs: PlanInputsPrimitive<IntTensor<Self>>,
    ) -> Result<PlanOutput<IntTensor<Self>>, Error> {
        host::canary_plan::<Self>(verify, write, inputs)
    }

    /// Elements between `T[q][c]` and `T[q+1][c]` in the buffer of a 2-D int tensor, as passed in.
    ///
    /// The default assumes a contiguous layout: backends that cannot express strided views have
    /// no other.
    fn int_row_stride(tensor: &IntTensor<Self>) -> i64 {
        tensor
            .shape()
            .as_slice()
            .get(1)
            .map_or(1, |&cols| cols as i64)
    }

    /// The first `len` values of a 1-D i64 tensor, as an i64 tensor of exactly `len` values (exact
    /// mode's output). CubeCL backends answer with a view of the same buffer: no copy, and no
    /// zero-sized allocation when `len` is 0.
    fn int_prefix(tensor: IntTensor<Self>, len: usize) -> IntTensor<Self> {
        host::int_prefix::<Self>(tensor, len)
    }

    /// kv-canary write (spec `canary-write-verify.md` §6): stores the records of the plan's active
    /// requests into the canary, appends assert rows, counts. The canary is consumed and handed
    /// back (written in place when unique). Host rules have been checked by the caller.
    fn canary_write(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: WritePlanPrimitive<IntTensor<Self>>,
        inputs: WriteInputsPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        host::canary_write::<Self>(canary, plan, inputs, launch)
    }

    /// kv-canary verify (spec §7): checks the plan's active entries, appends a row per mismatch.
    fn canary_verify(
        canary: CanaryPrimitive<IntTensor<Self>>,
        plan: VerifyPlanPrimitive<IntTensor<Self>>,
        launch: CanaryLaunchOf<Self>,
    ) -> Result<CanaryPrimitive<IntTensor<Self>>, Error> {
        host::canary_verify::<Self>(canary, plan, launch)
    }

    /// Reads a status record back to the host: the single transfer of a checked call.
    fn read_status(status: IntTensor<Self>) -> Result<crate::status::StatusWords, Error> {
        host::read_status::<Self>(status)
    }
}
