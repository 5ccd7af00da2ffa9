//! The canary itself: device-resident records, violation ring and counters, and the `write` and
//! `verify` ops that keep and check them (spec `canary-write-verify.md`).
//!
//! ```no_run
//! use burn_tensor::{Int, Tensor};
//! use kvplan::canary::{Canary, CanaryLaunch, VerifyPlan, WriteInputs, WritePlan};
//! # fn step<B: kvplan::KvPlanBackend>(device: &B::Device, verify: &VerifyPlan<B>,
//! #     write: &WritePlan<B>, ids: Tensor<B, 1, Int>, positions: Tensor<B, 1, Int>,
//! #     out_cache_loc: Tensor<B, 1, Int>) -> Result<(), kvplan::Error> {
//! // Once: one 32-byte record per KV slot, room for 1024 violation rows.
//! let mut canary = Canary::<B>::allocate(1 << 20, 32, 1024, device)?;
//! // Every step, after `plan`: no host round trip between the three ops.
//! canary.write(write, WriteInputs::new(ids, positions, out_cache_loc), &CanaryLaunch::new(0))?;
//! canary.verify(verify, &CanaryLaunch::new(1))?;
//! // Whenever the host chooses to look.
//! for violation in canary.violations()?.rows {
//!     eprintln!("KV slot {} at position {}: {:?}", violation.slot, violation.position,
//!         violation.fail_reasons);
//! }
//! # Ok(()) }
//! ```

use core::fmt;

use burn_tensor::ops::{FloatTensor, IntTensor};
use burn_tensor::{Int, Tensor, TensorData, TensorMetadata};
use kvplan_kernels::canary::{COUNTERS, ROW_WORDS, WRITE_INDEX};

use super::{VerifyPlan, WritePlan};
use crate::error::Error;
use crate::gather::arg;
use crate::ops::{
    CanaryLaunchPrimitive, CanaryPrimitive, KvBytes, KvPlanBackend, SourceLayout, SourcePrimitive,
    WriteInputsPrimitive, read_ints,
};
use crate::reference::canary::{ViolationRow, fail};
use crate::reference::{CanaryState, RealKvHashMode};
use crate::validate;

/// A view of real KV memory whose bytes the canary fingerprints (spec §4.2). Holds a clone of the
/// caller's tensor (no copy of its data); build it per step from the current KV tensor, so that
/// the engine's own updates of that tensor stay in place once the step's ops have run.
#[derive(Debug, Clone)]
pub struct RealKvSource<B: KvPlanBackend> {
    tensor: KvBytes<FloatTensor<B>, IntTensor<B>>,
    layout: SourceLayout,
}

impl<B: KvPlanBackend> RealKvSource<B> {
    /// A float KV tensor of rank >= 2: dim 0 are rows, the rest of a row is contiguous bytes.
    /// Slot `s` owns `num_bytes_per_token` bytes at `(s % page_size) * num_bytes_per_token` of
    /// row `s / page_size`; `read_bytes` of them are folded in mode `ALL`.
    pub fn float<const D: usize>(
        tensor: Tensor<B, D>,
        page_size: i64,
        num_bytes_per_token: i64,
        read_bytes: i64,
    ) -> Result<Self, Error> {
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let bytes = KvBytes::Float(tensor.into_primitive().tensor());
        Self::new(
            bytes,
            shape.as_slice(),
            dtype,
            [page_size, num_bytes_per_token, read_bytes],
        )
    }

    /// An int KV tensor (any int dtype, e.g. raw `u8` bytes); as [`RealKvSource::float`].
    pub fn int<const D: usize>(
        tensor: Tensor<B, D, Int>,
        page_size: i64,
        num_bytes_per_token: i64,
        read_bytes: i64,
    ) -> Result<Self, Error> {
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let bytes = KvBytes::Int(tensor.into_primitive());
        Self::new(
            bytes,
            shape.as_slice(),
            dtype,
            [page_size, num_bytes_per_token, read_bytes],
        )
    }

    fn new(
        tensor: KvBytes<FloatTensor<B>, IntTensor<B>>,
        shape: &[usize],
        dtype: burn_tensor::DType,
        [page_size, num_bytes_per_token, read_bytes]: [i64; 3],
    ) -> Result<Self, Error> {
        let layout =
            validate::canary::source(shape, dtype, page_size, num_bytes_per_token, read_bytes)?;
        Ok(Self { tensor, layout })
    }

    /// The validated byte layout.
    pub fn layout(&self) -> SourceLayout {
        self.layout
    }
}

/// What a write or verify launch takes besides its plan: the tag stamped into its violation
/// rows, the real-KV mode and sources, and (verify only) whether tokens are checked.
#[derive(Debug, Clone)]
pub struct CanaryLaunch<B: KvPlanBackend> {
    kernel_kind: i32,
    mode: RealKvHashMode,
    sources: Vec<RealKvSource<B>>,
    check_verify_expected_token: bool,
}

impl<B: KvPlanBackend> CanaryLaunch<B> {
    /// A launch tagged `kernel_kind` (sglang: `HEAD_K_FULL 0` .. `SWEEP_V_SWA 11`), mode `NONE`,
    /// token check on.
    pub fn new(kernel_kind: i32) -> Self {
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

    fn to_primitive(&self) -> CanaryLaunchPrimitive<FloatTensor<B>, IntTensor<B>> {
        CanaryLaunchPrimitive {
            kernel_kind: self.kernel_kind,
            mode: self.mode,
            sources: self
                .sources
                .iter()
                .map(|source| SourcePrimitive {
                    tensor: source.tensor.clone(),
                    layout: source.layout,
                })
                .collect(),
            check_expected_token: self.check_verify_expected_token,
        }
    }
}

/// A write step's token arrays (i64 `[T]` each) and its asserts.
#[derive(Debug, Clone)]
pub struct WriteInputs<B: KvPlanBackend> {
    input_ids: Tensor<B, 1, Int>,
    positions: Tensor<B, 1, Int>,
    out_cache_loc: Tensor<B, 1, Int>,
    enable_write_input_assert: bool,
    expected_input_tokens: Option<Tensor<B, 1, Int>>,
    expected_input_positions: Option<Tensor<B, 1, Int>>,
    chain_position_assert: Option<Tensor<B, 1, Int>>,
}

impl<B: KvPlanBackend> WriteInputs<B> {
    /// Token ids, positions and canary slots (negative: skip the token) of the step's tokens.
    pub fn new(
        input_ids: Tensor<B, 1, Int>,
        positions: Tensor<B, 1, Int>,
        out_cache_loc: Tensor<B, 1, Int>,
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

    /// `expected_input_tokens`, i64 `[T]`.
    pub fn expected_input_tokens(mut self, tokens: Tensor<B, 1, Int>) -> Self {
        self.expected_input_tokens = Some(tokens);
        self
    }

    /// `expected_input_positions`, i64 `[T]`.
    pub fn expected_input_positions(mut self, positions: Tensor<B, 1, Int>) -> Self {
        self.expected_input_positions = Some(positions);
        self
    }

    /// `enable_chain_position_assert`, an i32 `[1]` device flag (non-zero: on). Absent: off.
    pub fn chain_position_assert(mut self, flag: Tensor<B, 1, Int>) -> Self {
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

    fn into_primitive(self) -> WriteInputsPrimitive<IntTensor<B>> {
        WriteInputsPrimitive {
            input_ids: self.input_ids.into_primitive(),
            positions: self.positions.into_primitive(),
            out_cache_loc: self.out_cache_loc.into_primitive(),
            expected_inputs: self
                .expected_input_tokens
                .zip(self.expected_input_positions)
                .map(|(tokens, positions)| (tokens.into_primitive(), positions.into_primitive())),
            chain_position_assert: self.chain_position_assert.map(Tensor::into_primitive),
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
pub struct Canary<B: KvPlanBackend> {
    // `None` only while an op has the state.
    state: Option<CanaryPrimitive<IntTensor<B>>>,
    device: B::Device,
}

impl<B: KvPlanBackend> Canary<B> {
    /// A zeroed canary of `num_slots` slots of `slot_stride_bytes` (a multiple of 8, at least 32;
    /// bytes past the first 32 are the caller's) and a ring of `ring_capacity` rows.
    pub fn allocate(
        num_slots: usize,
        slot_stride_bytes: usize,
        ring_capacity: usize,
        device: &B::Device,
    ) -> Result<Self, Error> {
        validate::canary::slot_stride(slot_stride_bytes)?;
        let state = CanaryState::zeroed(num_slots, slot_stride_bytes / 8, ring_capacity);
        Self::from_state(&state, device)
    }

    /// A canary holding `state` (restoring a snapshot, tests, conformance scenarios).
    pub fn from_state(state: &CanaryState, device: &B::Device) -> Result<Self, Error> {
        validate::canary::slot_stride(state.slot_stride_words * 8)?;
        Ok(Self {
            state: Some(crate::ops::upload_canary::<B>(state, device)),
            device: device.clone(),
        })
    }

    fn primitive(&self) -> &CanaryPrimitive<IntTensor<B>> {
        self.state
            .as_ref()
            .expect("the canary state is only lent out during an op")
    }

    /// Reads the whole state back: records, ring and counters.
    pub fn state(&self) -> Result<CanaryState, Error> {
        self.check()?;
        crate::ops::canary_state::<B>(self.primitive())
    }

    /// The error of a write or verify that failed when it ran, after returning `Ok` (one small
    /// read-back). Through `Fusion` an op runs when its stream is flushed, too late to return its
    /// error: it leaves a zeroed canary, as a failed op does everywhere, and its error here. The
    /// reads ([`Canary::violations`], [`Canary::state`]) report it too, until [`Canary::clear`].
    /// Other backends return errors from the op itself: this is then `Ok` without a read.
    pub fn check(&self) -> Result<(), Error> {
        match &self.primitive().failure {
            Some(failure) => {
                let words = B::read_status(failure.clone())?;
                crate::status::decode(&words, "kv-canary").map(drop)
            }
            None => Ok(()),
        }
    }

    /// `N`.
    pub fn num_slots(&self) -> usize {
        self.primitive().num_slots
    }

    /// The records, i64 `[max(N, 1), S / 8]` (`token, position, prev_hash, real_kv_hash, ..`).
    pub fn buffer(&self) -> Tensor<B, 2, Int> {
        let state = self.primitive();
        Tensor::<B, 1, Int>::from_primitive(state.buffer.clone())
            .reshape([state.num_slots.max(1), state.slot_words])
    }

    /// Runs `op` on the state; a failed op leaves a zeroed canary of the same shape.
    fn run(
        &mut self,
        op: impl FnOnce(CanaryPrimitive<IntTensor<B>>) -> Result<CanaryPrimitive<IntTensor<B>>, Error>,
    ) -> Result<(), Error> {
        let state = self
            .state
            .take()
            .expect("the canary state is always returned");
        let shape = (state.num_slots, state.slot_words, state.ring_capacity);
        match op(state) {
            Ok(state) => {
                self.state = Some(state);
                Ok(())
            }
            Err(error) => {
                let zeroed = CanaryState::zeroed(shape.0, shape.1, shape.2);
                self.state = Some(crate::ops::upload_canary::<B>(&zeroed, &self.device));
                Err(error)
            }
        }
    }

    /// Write (spec §6): stores a record for every non-skipped token of the plan's active
    /// requests, chaining each request from its seed slot. Reads the plan's device-side counts:
    /// nothing comes back to the host. Host-rule errors change nothing.
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
        self.run(|state| B::canary_write(state, plan, inputs, launch))
    }

    /// Verify (spec §7): checks the plan's active entries against the records and the real KV
    /// bytes and appends a violation row per mismatch. Nothing comes back to the host.
    pub fn verify(&mut self, plan: &VerifyPlan<B>, launch: &CanaryLaunch<B>) -> Result<(), Error> {
        launch.validate()?;
        let plan = plan.primitive().clone();
        let launch = launch.to_primitive();
        self.run(|state| B::canary_verify(state, plan, launch))
    }

    /// Reads the ring back (one sync) and decodes its rows.
    pub fn violations(&self) -> Result<Violations, Error> {
        self.check()?;
        let state = self.primitive();
        let counters = read_ints::<B>(state.counters.clone())?;
        let ring = read_ints::<B>(state.ring.clone())?;
        let recorded = counters[WRITE_INDEX].max(0) as u64;
        let stored = (recorded as usize).min(state.ring_capacity);
        let rows = ring
            .chunks_exact(ROW_WORDS)
            .take(stored)
            .map(|row| Violation::from(<ViolationRow>::try_from(row).unwrap_or_default()))
            .collect();
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
        let rows = state.ring_capacity.max(1);
        state.ring = B::int_from_data(
            TensorData::new(vec![0i64; rows * ROW_WORDS], [rows * ROW_WORDS]),
            &self.device,
        );
        // Moved, not cloned: a unique handle is updated in place.
        let counters = Tensor::<B, 1, Int>::from_primitive(state.counters);
        let zero = Tensor::<B, 1, Int>::from_data(
            TensorData::new(vec![0i64], [1]),
            (&self.device, burn_tensor::DType::I64),
        );
        state.counters = counters
            .slice_assign(WRITE_INDEX..WRITE_INDEX + 1, zero)
            .into_primitive();
        debug_assert_eq!(state.counters.shape().num_elements(), COUNTERS);
        // The next op brings a clear record.
        state.failure = None;
        self.state = Some(state);
    }
}
