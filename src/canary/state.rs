//! The canary itself: device-resident records, violation ring and counters, and the `write` and
//! `verify` ops that keep and check them (spec `canary-write-verify.md`).
//!
//! ```no_run
//! use burn_core::tensor::{Device, Int, Tensor};
//! use kvplan::ops::{Canary, CanaryLaunch, KernelKind, WriteInputs};
//! # fn step(device: &Device, plan: &kvplan::ops::StepPlan, ids: Tensor<1, Int>,
//! #     positions: Tensor<1, Int>, out_cache_loc: Tensor<1, Int>) -> Result<(), kvplan::Error> {
//! // Once: one 32-byte record per KV slot, room for 1024 violation rows.
//! let mut canary = Canary::allocate(1 << 20, 32, 1024, device)?;
//! // Every step, after `plan`: no host round trip between the three ops.
//! canary.write(&plan.write, WriteInputs::new(ids, positions, out_cache_loc), &CanaryLaunch::new(KernelKind::HEAD_K_FULL))?;
//! canary.verify(&plan.verify, &CanaryLaunch::new(KernelKind::HEAD_V_FULL))?;
//! // Whenever the host chooses to look.
//! for violation in canary.violations()?.rows {
//!     eprintln!("KV slot {} at position {}: {:?}", violation.slot, violation.position,
//!         violation.fail_reasons);
//! }
//! # Ok(()) }
//! ```

use core::fmt;

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Backend, Dispatch, TensorMetadata};
use burn_core::tensor::{DType, Device, Float, Int, Tensor};

use super::{VerifyPlan, WritePlan};
use crate::backend::{
    CanaryLaunchPrimitive, CanaryPrimitive, KvBytes, KvPlanBackend, LaunchMeta,
    WriteInputsPrimitive, read_ints,
};
use crate::deferred::Status;
use crate::error::Error;
use crate::gather::arg;
use crate::layout::{COUNTERS, MAX_SOURCES, ROW_WORDS, STATUS_LEN, SourceLayout, WRITE_INDEX};
use crate::reference::canary::{ViolationRow, fail};
use crate::reference::{CanaryState, RealKvHashMode};
use crate::room::{self, Buffer};
use crate::validate;

/// A view of real KV memory whose bytes the canary fingerprints (spec §4.2). Holds a clone of the
/// caller's tensor (no copy of its data); build it per step from the current KV tensor, so that
/// the engine's own updates of that tensor stay in place once the step's ops have run.
#[derive(Debug, Clone)]
pub struct RealKvSource<B: Backend = Dispatch> {
    tensor: KvBytes<B>,
    layout: SourceLayout,
}

impl RealKvSource {
    /// A float KV tensor `[rows, row_len]`: a row is contiguous bytes. Slot `s` owns
    /// `num_bytes_per_token` bytes at `(s % page_size) * num_bytes_per_token` of row
    /// `s / page_size`; `read_bytes` of them are folded in mode `ALL`.
    ///
    /// # Errors
    /// As [`RealKvSource::from_primitive`].
    pub fn float(tensor: Tensor<2, Float>, layout: SourceBytes) -> Result<Self, Error> {
        Self::from_primitive(KvBytes::Float(tensor.into_dispatch()), layout)
    }

    /// An int KV tensor `[rows, row_len]` (any int dtype, e.g. raw `u8` bytes); as
    /// [`RealKvSource::float`].
    ///
    /// # Errors
    /// As [`RealKvSource::from_primitive`].
    pub fn int(tensor: Tensor<2, Int>, layout: SourceBytes) -> Result<Self, Error> {
        Self::from_primitive(KvBytes::Int(tensor.into_dispatch()), layout)
    }
}

/// How a source's bytes map to slots (validated when the source is built).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceBytes {
    /// Slots per row.
    pub page_size: i64,
    /// Bytes per slot strip.
    pub num_bytes_per_token: i64,
    /// Bytes mode `ALL` folds.
    pub read_bytes: i64,
}

impl SourceBytes {
    /// One slot per row, strips of `num_bytes_per_token`, all of them folded in mode `ALL`.
    pub fn per_slot(num_bytes_per_token: i64) -> Self {
        Self {
            page_size: 1,
            num_bytes_per_token,
            read_bytes: num_bytes_per_token,
        }
    }
}

impl<B: Backend> RealKvSource<B> {
    /// A source from a backend's primitive (`KvBytes::Float` or `KvBytes::Int`).
    ///
    /// # Errors
    /// At once: `source_page_size`, `source_num_bytes_per_token`, `source_read_bytes`,
    /// `source_not_2d`, `source_row_stride` (a row that is not a multiple of 16 bytes).
    #[doc(hidden)]
    pub fn from_primitive(tensor: KvBytes<B>, layout: SourceBytes) -> Result<Self, Error> {
        let (shape, dtype) = match &tensor {
            KvBytes::Float(t) => (t.shape(), t.dtype()),
            KvBytes::Int(t) => (t.shape(), t.dtype()),
            KvBytes::Absent => (burn_core::tensor::Shape::new([0, 0]), DType::U8),
        };
        let layout = validate::canary::source(
            shape.as_slice(),
            dtype,
            layout.page_size,
            layout.num_bytes_per_token,
            layout.read_bytes,
        )?;
        Ok(Self { tensor, layout })
    }

    /// The validated byte layout.
    pub fn layout(&self) -> SourceLayout {
        self.layout
    }
}

/// The launch tag stamped into every violation row (`kernel_kind`); sglang's values are the
/// associated constants, any other i32 is the caller's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelKind(pub i32);

impl KernelKind {
    /// sglang `HEAD_K_FULL`.
    pub const HEAD_K_FULL: Self = Self(0);
    /// sglang `HEAD_V_FULL`.
    pub const HEAD_V_FULL: Self = Self(1);
    /// sglang `TAIL_K_FULL`.
    pub const TAIL_K_FULL: Self = Self(2);
    /// sglang `TAIL_V_FULL`.
    pub const TAIL_V_FULL: Self = Self(3);
    /// sglang `SWEEP_K_FULL`.
    pub const SWEEP_K_FULL: Self = Self(4);
    /// sglang `SWEEP_V_FULL`.
    pub const SWEEP_V_FULL: Self = Self(5);
    /// sglang `HEAD_K_SWA`.
    pub const HEAD_K_SWA: Self = Self(6);
    /// sglang `HEAD_V_SWA`.
    pub const HEAD_V_SWA: Self = Self(7);
    /// sglang `TAIL_K_SWA`.
    pub const TAIL_K_SWA: Self = Self(8);
    /// sglang `TAIL_V_SWA`.
    pub const TAIL_V_SWA: Self = Self(9);
    /// sglang `SWEEP_K_SWA`.
    pub const SWEEP_K_SWA: Self = Self(10);
    /// sglang `SWEEP_V_SWA`.
    pub const SWEEP_V_SWA: Self = Self(11);
}

/// What a write or verify launch takes besides its plan: the tag stamped into its violation
/// rows, the real-KV mode and sources, and (verify only) whether tokens are checked.
#[derive(Debug, Clone)]
pub struct CanaryLaunch<B: Backend = Dispatch> {
    kernel_kind: KernelKind,
    mode: RealKvHashMode,
    sources: Vec<RealKvSource<B>>,
    check_verify_expected_token: bool,
}

impl<B: Backend> CanaryLaunch<B> {
    /// A launch tagged `kernel_kind`, mode `NONE`, token check on.
    pub fn new(kernel_kind: KernelKind) -> Self {
        Self {
            kernel_kind,
            mode: RealKvHashMode::None,
            sources: Vec::new(),
            check_verify_expected_token: true,
        }
    }

    /// Fingerprints the slots' real KV bytes over `sources` (at most 4, folded in this order).
    pub fn real_kv(mut self, mode: RealKvHashMode, sources: Vec<RealKvSource<B>>) -> Self {
        self.mode = mode;
        self.sources = sources;
        self
    }

    /// `check_verify_expected_token` (verify only; default true).
    pub fn check_verify_expected_token(mut self, check: bool) -> Self {
        self.check_verify_expected_token = check;
        self
    }

    fn validate(&self) -> Result<(), Error> {
        let layouts: Vec<SourceLayout> = self.sources.iter().map(|s| s.layout).collect();
        validate::canary::launch(self.mode, &layouts)
    }

    fn to_primitive(&self) -> CanaryLaunchPrimitive<B> {
        debug_assert!(self.sources.len() <= MAX_SOURCES);
        let mut places = self.sources.iter().map(|source| source.tensor.clone());
        let mut next = || places.next().unwrap_or(KvBytes::Absent);
        CanaryLaunchPrimitive {
            source_0: next(),
            source_1: next(),
            source_2: next(),
            source_3: next(),
            meta: LaunchMeta {
                kernel_kind: self.kernel_kind.0,
                mode: self.mode,
                layouts: self.sources.iter().map(|s| s.layout).collect(),
                check_expected_token: self.check_verify_expected_token,
            },
        }
    }
}

/// A write step's token arrays (i64 `[T]` each) and its asserts.
#[derive(Debug, Clone)]
pub struct WriteInputs<B: Backend = Dispatch> {
    input_ids: IntTensor<B>,
    positions: IntTensor<B>,
    out_cache_loc: IntTensor<B>,
    enable_write_input_assert: bool,
    expected_input_tokens: Option<IntTensor<B>>,
    expected_input_positions: Option<IntTensor<B>>,
    chain_position_assert: Option<IntTensor<B>>,
}

impl WriteInputs {
    /// Token ids, positions and canary slots (negative: skip the token) of the step's tokens.
    pub fn new(
        input_ids: Tensor<1, Int>,
        positions: Tensor<1, Int>,
        out_cache_loc: Tensor<1, Int>,
    ) -> Self {
        Self::from_primitives(
            input_ids.into_dispatch(),
            positions.into_dispatch(),
            out_cache_loc.into_dispatch(),
        )
    }

    /// `expected_input_tokens`, i64 `[T]`.
    pub fn expected_input_tokens(self, tokens: Tensor<1, Int>) -> Self {
        self.expected_input_tokens_primitive(tokens.into_dispatch())
    }

    /// `expected_input_positions`, i64 `[T]`.
    pub fn expected_input_positions(self, positions: Tensor<1, Int>) -> Self {
        self.expected_input_positions_primitive(positions.into_dispatch())
    }

    /// `enable_chain_position_assert`, an i32 `[1]` device flag (non-zero: on). Absent: off.
    pub fn chain_position_assert(self, flag: Tensor<1, Int>) -> Self {
        self.chain_position_assert_primitive(flag.into_dispatch())
    }
}

impl<B: KvPlanBackend> WriteInputs<B> {
    /// [`WriteInputs::new`] on a backend's primitives.
    #[doc(hidden)]
    pub fn from_primitives(
        input_ids: IntTensor<B>,
        positions: IntTensor<B>,
        out_cache_loc: IntTensor<B>,
    ) -> Self {
        Self {
            input_ids,
            positions,
            out_cache_loc,
            enable_write_input_assert: false,
            expected_input_tokens: None,
            expected_input_positions: None,
            chain_position_assert: None,
        }
    }

    /// Checks every written token against the caller's oracle (`enable_write_input_assert`);
    /// both expected arrays are then required.
    pub fn enable_write_input_assert(mut self, enable: bool) -> Self {
        self.enable_write_input_assert = enable;
        self
    }

    /// [`WriteInputs::expected_input_tokens`] on a primitive.
    #[doc(hidden)]
    pub fn expected_input_tokens_primitive(mut self, tokens: IntTensor<B>) -> Self {
        self.expected_input_tokens = Some(tokens);
        self
    }

    /// [`WriteInputs::expected_input_positions`] on a primitive.
    #[doc(hidden)]
    pub fn expected_input_positions_primitive(mut self, positions: IntTensor<B>) -> Self {
        self.expected_input_positions = Some(positions);
        self
    }

    /// [`WriteInputs::chain_position_assert`] on a primitive.
    #[doc(hidden)]
    pub fn chain_position_assert_primitive(mut self, flag: IntTensor<B>) -> Self {
        self.chain_position_assert = Some(flag);
        self
    }

    fn validate(&self) -> Result<(), Error> {
        validate::canary::write(&validate::canary::WriteArgs {
            tokens: [
                arg("input_ids", &self.input_ids),
                arg("positions", &self.positions),
                arg("out_cache_loc", &self.out_cache_loc),
            ],
            enable_write_input_assert: self.enable_write_input_assert,
            expected_input_tokens: self
                .expected_input_tokens
                .as_ref()
                .map(|t| arg("expected_input_tokens", t)),
            expected_input_positions: self
                .expected_input_positions
                .as_ref()
                .map(|t| arg("expected_input_positions", t)),
            chain_position_assert: self
                .chain_position_assert
                .as_ref()
                .map(|t| arg("enable_chain_position_assert", t)),
        })
    }

    fn into_primitive(self) -> WriteInputsPrimitive<B> {
        let (tokens, positions) = match (self.expected_input_tokens, self.expected_input_positions)
        {
            (Some(tokens), Some(positions)) => (Some(tokens), Some(positions)),
            _ => (None, None),
        };
        WriteInputsPrimitive {
            input_ids: self.input_ids,
            positions: self.positions,
            out_cache_loc: self.out_cache_loc,
            expected_input_tokens: tokens.into(),
            expected_input_positions: positions.into(),
            chain_position_assert: self.chain_position_assert.into(),
        }
    }
}

/// Why a violation row was recorded (spec §3 fail-reason bits).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FailReasons(pub i64);

impl FailReasons {
    /// Verify: the chain value does not continue the listed predecessor.
    pub const VERIFY_CHAIN_HASH_MISMATCH: Self = Self(fail::VERIFY_CHAIN_HASH_MISMATCH);
    /// Verify: the stored position is not the expected one.
    pub const VERIFY_POSITION_MISMATCH: Self = Self(fail::VERIFY_POSITION_MISMATCH);
    /// Verify: the slot's real KV bytes changed since it was written.
    pub const VERIFY_REAL_KV_HASH_MISMATCH: Self = Self(fail::VERIFY_REAL_KV_HASH_MISMATCH);
    /// Write: the token is not the one the caller's oracle expects.
    pub const WRITE_TOKEN_MISMATCH: Self = Self(fail::WRITE_TOKEN_MISMATCH);
    /// Write: the position is not the expected one.
    pub const WRITE_POSITION_MISMATCH: Self = Self(fail::WRITE_POSITION_MISMATCH);
    /// Verify: the stored token is not the expected one.
    pub const VERIFY_TOKEN_MISMATCH: Self = Self(fail::VERIFY_TOKEN_MISMATCH);

    const NAMED: [(Self, &'static str); 6] = [
        (
            Self::VERIFY_CHAIN_HASH_MISMATCH,
            "VERIFY_CHAIN_HASH_MISMATCH",
        ),
        (Self::VERIFY_POSITION_MISMATCH, "VERIFY_POSITION_MISMATCH"),
        (
            Self::VERIFY_REAL_KV_HASH_MISMATCH,
            "VERIFY_REAL_KV_HASH_MISMATCH",
        ),
        (Self::WRITE_TOKEN_MISMATCH, "WRITE_TOKEN_MISMATCH"),
        (Self::WRITE_POSITION_MISMATCH, "WRITE_POSITION_MISMATCH"),
        (Self::VERIFY_TOKEN_MISMATCH, "VERIFY_TOKEN_MISMATCH"),
    ];

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
}

impl fmt::Debug for FailReasons {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Self::NAMED
            .iter()
            .filter(|(flag, _)| self.contains(*flag))
            .map(|(_, name)| *name)
            .collect();
        let unknown = self.0 & !Self::NAMED.iter().fold(0, |all, (flag, _)| all | flag.0);
        if unknown != 0 {
            return write!(f, "{} | {unknown:#x}", names.join(" | "));
        }
        write!(f, "{}", names.join(" | "))
    }
}

/// One decoded violation row (spec §8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Violation {
    /// The launch tag.
    pub kernel_kind: i64,
    /// The canary slot.
    pub slot: i64,
    /// Stored position (verify) or the written position (write).
    pub position: i64,
    /// Stored token (verify) or the written token (write).
    pub stored_token: i64,
    /// Expected token (-1 when unchecked).
    pub expected_token: i64,
    /// The slot's stored chain value.
    pub stored_chain_hash: i64,
    /// Verify: the expected chain value; write: the expected position.
    pub expected_aux: i64,
    /// Why.
    pub fail_reasons: FailReasons,
}

impl From<ViolationRow> for Violation {
    fn from(row: ViolationRow) -> Self {
        Self {
            kernel_kind: row[0],
            slot: row[1],
            position: row[2],
            stored_token: row[3],
            expected_token: row[4],
            stored_chain_hash: row[5],
            expected_aux: row[6],
            fail_reasons: FailReasons(row[7]),
        }
    }
}

/// The violation ring, read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violations {
    /// The stored rows, oldest first.
    pub rows: Vec<Violation>,
    /// Rows ever recorded since the last clear (the write index).
    pub recorded: u64,
    /// Rows dropped because the ring was full.
    pub dropped: u64,
}

/// The canary of one KV pool: a record per slot, the violation ring and the health counters,
/// all on the device.
#[derive(Debug)]
pub struct Canary<B: KvPlanBackend = Dispatch> {
    // `None` only while an op has the state.
    state: Option<CanaryPrimitive<B>>,
    device: B::Device,
}

/// A canary's sized buffers: `num_slots` records of `slot_stride_bytes`, `ring_capacity` rows.
fn canary_buffers(num_slots: usize, slot_stride_bytes: usize, ring_capacity: usize) -> [Buffer; 2] {
    [
        Buffer::new("canary record buffer", num_slots, slot_stride_bytes),
        Buffer::new("violation ring", ring_capacity, ROW_WORDS * 8),
    ]
}

impl Canary {
    /// A zeroed canary of `num_slots` slots of `slot_stride_bytes` (a multiple of 8, at least 32;
    /// bytes past the first 32 are the caller's) and a ring of `ring_capacity` rows.
    ///
    /// # Errors
    /// `slot_stride_not_multiple_of_8`, `slot_stride_too_small` (below a record's 32 bytes);
    /// `allocation_too_large` when the host (which stages the zeroed state) or the device cannot
    /// hold the records or the ring.
    pub fn allocate(
        num_slots: usize,
        slot_stride_bytes: usize,
        ring_capacity: usize,
        device: &Device,
    ) -> Result<Self, Error> {
        Self::allocate_on(
            num_slots,
            slot_stride_bytes,
            ring_capacity,
            device.as_dispatch(),
        )
    }

    /// The records, i64 `[max(N, 1), S / 8]` (`token, position, prev_hash, real_kv_hash, ..`).
    pub fn buffer(&self) -> Tensor<2, Int> {
        let state = self.primitive();
        Tensor::<1, Int>::from_dispatch(state.buffer.clone())
            .reshape([state.num_slots.max(1), state.slot_words])
    }
}

impl<B: KvPlanBackend> Canary<B> {
    /// [`Canary::allocate`] on a backend's device.
    ///
    /// # Errors
    /// As [`Canary::allocate`].
    #[doc(hidden)]
    pub fn allocate_on(
        num_slots: usize,
        slot_stride_bytes: usize,
        ring_capacity: usize,
        device: &B::Device,
    ) -> Result<Self, Error> {
        validate::canary::slot_stride(slot_stride_bytes)?;
        room::on_host(&canary_buffers(num_slots, slot_stride_bytes, ring_capacity))?;
        let state = CanaryState::zeroed(num_slots, slot_stride_bytes / 8, ring_capacity);
        Self::from_state(&state, device)
    }

    /// A canary holding `state` (restoring a snapshot, tests, conformance scenarios).
    ///
    /// # Errors
    /// `slot_stride_too_small`; `allocation_too_large` when the device cannot hold the records or
    /// the ring.
    #[doc(hidden)]
    pub fn from_state(state: &CanaryState, device: &B::Device) -> Result<Self, Error> {
        validate::canary::slot_stride(state.slot_stride_words * 8)?;
        let buffers = canary_buffers(
            state.num_slots().max(1),
            state.slot_stride_words * 8,
            state.ring.len().max(1),
        );
        room::on_device(device, &buffers)?;
        Ok(Self {
            state: Some(crate::backend::upload_canary::<B>(
                state,
                [0; STATUS_LEN],
                device,
            )),
            device: device.clone(),
        })
    }

    fn primitive(&self) -> &CanaryPrimitive<B> {
        self.state
            .as_ref()
            .expect("the canary state is only lent out during an op")
    }

    /// The canary's tensors.
    #[doc(hidden)]
    pub fn primitives(&self) -> &CanaryPrimitive<B> {
        self.primitive()
    }

    /// Reads the whole state back: records, ring and counters.
    ///
    /// # Errors
    /// As [`Canary::check`]; `execution` when reading the state back fails.
    pub fn state(&self) -> Result<CanaryState, Error> {
        self.check()?;
        crate::backend::canary_state::<B>(self.primitive())
    }

    /// The error of a write or verify whose launch failed (one small read-back). The ops only
    /// enqueue, so a failure (e.g. `index_range`) leaves a zeroed canary holding its status, and
    /// every read ([`Canary::violations`], [`Canary::state`]) reports it until [`Canary::clear`].
    ///
    /// # Errors
    /// The error a failed write or verify left in the canary's status: `index_range`, or
    /// `execution` from a fused stream. `execution` when the read-back fails; `corrupt_status` for
    /// a record kvplan never wrote.
    pub fn check(&self) -> Result<(), Error> {
        let words = crate::backend::read_status::<B>(self.primitive().status.clone())?;
        crate::status::decode(&words, "kv-canary").map(drop)
    }

    /// `N`.
    pub fn num_slots(&self) -> usize {
        self.primitive().num_slots
    }

    fn run(&mut self, op: impl FnOnce(CanaryPrimitive<B>) -> CanaryPrimitive<B>) {
        let state = self
            .state
            .take()
            .expect("the canary state is always returned");
        self.state = Some(op(state));
    }

    /// Write (spec §6): stores a record for every non-skipped token of the plan's active
    /// requests, chaining each request from its seed slot. Reads the plan's device-side counts:
    /// nothing comes back to the host. Host-rule errors change nothing.
    ///
    /// # Errors
    /// At once, nothing changed: `too_many_sources`, `source_row_too_narrow`,
    /// `expected_inputs_missing` / `expected_inputs_unexpected`, `canary_argument`,
    /// `token_arrays_length`. A launch that cannot run (`index_range`) is not returned: the ops
    /// only enqueue, so the canary holds it for [`Canary::check`].
    pub fn write(
        &mut self,
        plan: &WritePlan<B>,
        inputs: WriteInputs<B>,
        launch: &CanaryLaunch<B>,
    ) -> Result<(), Error> {
        launch.validate()?;
        inputs.validate()?;
        let plan = plan.primitive().clone();
        let inputs = inputs.into_primitive();
        let launch = launch.to_primitive();
        self.run(|state| B::canary_write(state, plan, inputs, launch));
        Ok(())
    }

    /// Verify (spec §7): checks the plan's active entries against the records and the real KV
    /// bytes and appends a violation row per mismatch. Nothing comes back to the host.
    ///
    /// # Errors
    /// At once, nothing changed: `too_many_sources`, `source_row_too_narrow`. A launch that cannot
    /// run is held as [`write`](Canary::write)'s is.
    pub fn verify(&mut self, plan: &VerifyPlan<B>, launch: &CanaryLaunch<B>) -> Result<(), Error> {
        launch.validate()?;
        let plan = plan.primitive().clone();
        let launch = launch.to_primitive();
        self.run(|state| B::canary_verify(state, plan, launch));
        Ok(())
    }

    /// Reads the status and the counters back in one sync, and the ring only when it holds rows
    /// (a clean step costs one read), and decodes its rows.
    ///
    /// # Errors
    /// As [`Canary::check`]; `execution` when a read-back fails.
    pub fn violations(&self) -> Result<Violations, Error> {
        self.violations_after([]).map(|(_, violations)| violations)
    }

    /// [`violations`](Self::violations) and [`check_all`](crate::check_all) of a step's other
    /// statuses in the same read: their counts in order, or the first op's error (theirs first,
    /// then the canary's). The statuses move into the read, as in `check_all`.
    ///
    /// # Errors
    /// The first error of `statuses`, as [`check_all`](crate::check_all), then the canary's, as
    /// [`Canary::check`]; `execution` when a read-back fails.
    pub fn violations_after(
        &self,
        statuses: impl IntoIterator<Item = Status<B>>,
    ) -> Result<(Vec<usize>, Violations), Error> {
        let (mut parts, contexts) = crate::deferred::split(statuses);
        parts.extend(self.record_words());
        let words = read_ints::<B>(B::int_cat(parts, 0))?;
        let counts = crate::deferred::decode_all(&contexts, &words)?;
        let violations =
            self.violations_in(&words[(contexts.len() * STATUS_LEN).min(words.len())..])?;
        Ok((counts, violations))
    }

    /// The canary's status record and health counters, the words [`violations_in`] reads (for a
    /// caller that reads them with other words in one transfer).
    pub(crate) fn record_words(&self) -> [IntTensor<B>; 2] {
        let state = self.primitive();
        [state.status.clone(), state.counters.clone()]
    }

    /// The violations of the canary's status record and counters read back as `words` (from
    /// [`record_words`]); the ring is read only when it holds rows.
    pub(crate) fn violations_in(&self, words: &[i64]) -> Result<Violations, Error> {
        let state = self.primitive();
        let (status, counters) = words.split_at(STATUS_LEN.min(words.len()));
        let status: crate::status::StatusWords = status.try_into().unwrap_or_default();
        crate::status::decode(&status, "kv-canary")?;
        let recorded = counters.get(WRITE_INDEX).copied().unwrap_or(0).max(0) as u64;
        let stored = (recorded as usize).min(state.ring_capacity);
        let rows = if stored == 0 {
            Vec::new()
        } else {
            read_ints::<B>(state.ring.clone())?
                .chunks_exact(ROW_WORDS)
                .take(stored)
                .map(|row| Violation::from(<ViolationRow>::try_from(row).unwrap_or_default()))
                .collect()
        };
        Ok(Violations {
            rows,
            recorded,
            dropped: recorded - stored as u64,
        })
    }

    /// Empties the ring and resets its write index; the health counters keep counting. Forgets the
    /// failure that [`Canary::check`] reports.
    pub fn clear(&mut self) {
        let mut state = self
            .state
            .take()
            .expect("the canary state is always returned");
        // Written in place (`write_i64`): a captured step keeps writing these buffers.
        let rows = state.ring_capacity.max(1);
        state.ring = B::write_i64(state.ring, vec![0i64; rows * ROW_WORDS]);
        // Moved, not cloned: a unique handle is updated in place.
        let zero = crate::backend::upload_i64::<B>(vec![0i64], &self.device);
        state.counters = B::int_slice_assign(
            state.counters,
            &[burn_core::tensor::Slice::from(WRITE_INDEX..WRITE_INDEX + 1)],
            zero,
        );
        debug_assert_eq!(state.counters.shape().num_elements(), COUNTERS);
        state.status = B::write_i64(state.status, vec![0i64; STATUS_LEN]);
        self.state = Some(state);
    }
}
