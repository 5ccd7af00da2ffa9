//! The backend extension trait: kvplan's ops on Burn primitives, declared with
//! `#[backend_extension]` as burn-vision does.
//!
//! Every method has a default body that runs the host reference (read inputs back, compute,
//! upload results), so the trait works on any Burn backend. The Cube backend (CUDA, wgpu/Vulkan)
//! overrides the bodies with kernels; `Fusion<B>` comes from the macro; `Autodiff<B>` delegates.
//! The ops are infallible: a data-dependent error, and a launch that cannot run (`index_range`,
//! `execution`), travel in the op's status record. The public API validates the host rules
//! before calling in here.

#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube;
mod host;
pub(crate) use host::split_columns;
mod impls;

pub use host::data_to_i64;
pub(crate) use host::{
    canary_state, read_ints, read_status, upload_canary, upload_i64, upload_plans,
};

use burn_core as burn; // the paths `#[backend_extension]` generates
use burn_core::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_core::backend::{Backend, ExtensionType, TensorMetadata, backend_extension};

use crate::layout::SourceLayout;
use crate::reference::RealKvHashMode;

/// An optional int input (a `None` the macro's Fusion support can carry).
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub enum OptionalInt<B: Backend> {
    /// The tensor.
    Given(IntTensor<B>),
    /// No tensor.
    Absent,
}

impl<B: Backend> OptionalInt<B> {
    /// `Some(tensor)` or `None`.
    pub fn into_option(self) -> Option<IntTensor<B>> {
        match self {
            Self::Given(tensor) => Some(tensor),
            Self::Absent => None,
        }
    }
}

impl<B: Backend> From<Option<IntTensor<B>>> for OptionalInt<B> {
    fn from(tensor: Option<IntTensor<B>>) -> Self {
        tensor.map_or(Self::Absent, Self::Given)
    }
}

/// The device-side result of a gather.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct GatherPrimitive<B: Backend> {
    /// i64 `[capacity]`; the first `count` values are the gathered slots.
    pub out: IntTensor<B>,
    /// i64 status record (`kvplan_kernels::status`); its count word is the number of gathered
    /// values (0 after a deferred error).
    pub status: IntTensor<B>,
}

/// The key runs' check: its status record, and the runs record each layer's attention binds.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct KeyRunsPrimitive<B: Backend> {
    /// i64 status record (`kvplan_kernels::status`); its count word is the number of tokens.
    pub status: IntTensor<B>,
    /// i64 `[STATUS_LEN + 2 * tokens]` (`kvplan_kernels::attention::runs_len`): the status, then
    /// every token's start, then every token's count.
    pub runs: IntTensor<B>,
}

/// A `VerifyPlan`'s tensors, in the spec's field order.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct VerifyPlanPrimitive<B: Backend> {
    /// i64 `[V]`.
    pub slot_indices: IntTensor<B>,
    /// i64 `[V]`.
    pub expected_tokens: IntTensor<B>,
    /// i64 `[V]`.
    pub expected_positions: IntTensor<B>,
    /// i64 `[V]`.
    pub prev_slot_indices: IntTensor<B>,
    /// i32 `[1]`.
    pub num_valid: IntTensor<B>,
    /// i32 `[1]`.
    pub enable: IntTensor<B>,
}

/// A `WritePlan`'s tensors, in the spec's field order.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct WritePlanPrimitive<B: Backend> {
    /// i64 `[K+1]`.
    pub offsets: IntTensor<B>,
    /// i64 `[K]`.
    pub seed_slot_indices: IntTensor<B>,
    /// i32 `[1]`.
    pub num_valid_reqs: IntTensor<B>,
    /// i64 `[scratch_len(K)]`: the kernels' control words and tile states, kept with the plan so
    /// that no call uploads or clears anything (each call leaves them ready for the next). Unused
    /// by the host reference.
    pub scratch: IntTensor<B>,
}

/// The inputs of one plan step as primitives (dtype i32 or i64 each, validated).
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct PlanInputsPrimitive<B: Backend> {
    /// `[bs]`; 0 marks a padding row.
    pub req_pool_indices: IntTensor<B>,
    /// `[bs]`.
    pub prefix_lens: IntTensor<B>,
    /// `[bs]`.
    pub extend_seq_lens: IntTensor<B>,
    /// `[rows, cols]`.
    pub req_to_token: IntTensor<B>,
    /// `[lut_len]`, non-empty.
    #[extension_type]
    pub full_to_swa: OptionalInt<B>,
    /// The expected-token pool `[prow, pcol]`.
    #[extension_type]
    pub expected_tokens: OptionalInt<B>,
    /// The pool's valid lengths `[bs]` (given with the pool).
    #[extension_type]
    pub expected_tokens_valid_lens: OptionalInt<B>,
    /// `W`; `<= 0` means no window.
    pub swa_window_size: i32,
    /// Column shift into the pool.
    pub position_offset: i32,
}

/// The result of one plan step: the plans (filled in place) and the i64 status record.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct PlanOutput<B: Backend> {
    /// The verify plan.
    #[extension_type]
    pub verify: VerifyPlanPrimitive<B>,
    /// The write plan.
    #[extension_type]
    pub write: WritePlanPrimitive<B>,
    /// i64 status record (`kvplan_kernels::status`).
    pub status: IntTensor<B>,
}

/// A canary's device state.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct CanaryPrimitive<B: Backend> {
    /// i64 `[max(N, 1) * S / 8]`: the slot records, slot-major (1-D: a 2-D allocation may get
    /// padded rows on CUDA).
    pub buffer: IntTensor<B>,
    /// i64 `[max(C, 1) * 8]`: the violation ring.
    pub ring: IntTensor<B>,
    /// i64 `[3]`: write index, `slot_run_counter`, `kernel_run_counter`.
    pub counters: IntTensor<B>,
    /// i64 `[STATUS_LEN]`: clear, or the status of the latest write or verify whose launch failed
    /// (kept until `clear`), so that a lazily run op reports its failure on the next read.
    pub status: IntTensor<B>,
    /// `N` (the buffer keeps at least one row: zero-sized buffers are not bindable everywhere).
    pub num_slots: usize,
    /// `S / 8`.
    pub slot_words: usize,
    /// `C` (the ring keeps at least one row, for the same reason).
    pub ring_capacity: usize,
}

/// The bytes of one real-KV source: a float or an int tensor, never copied.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub enum KvBytes<B: Backend> {
    /// A float tensor (any float dtype).
    Float(FloatTensor<B>),
    /// An int tensor (any int dtype).
    Int(IntTensor<B>),
    /// No source in this place.
    Absent,
}

/// What a write or verify launch takes besides its plan: at most four real-KV sources, in fold
/// order (fixed places, since the macro's Fusion support carries no `Vec` of tensors).
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct CanaryLaunchPrimitive<B: Backend> {
    /// Source 0.
    #[extension_type]
    pub source_0: KvBytes<B>,
    /// Source 1.
    #[extension_type]
    pub source_1: KvBytes<B>,
    /// Source 2.
    #[extension_type]
    pub source_2: KvBytes<B>,
    /// Source 3.
    #[extension_type]
    pub source_3: KvBytes<B>,
    /// The scalars of the launch.
    pub meta: LaunchMeta,
}

/// The host values of a write or verify launch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchMeta {
    /// `kernel_kind`, stamped into every row.
    pub kernel_kind: i32,
    /// `real_kv_hash_mode`.
    pub mode: RealKvHashMode,
    /// The layout of each given source, in order.
    pub layouts: Vec<SourceLayout>,
    /// Verify only: `check_verify_expected_token`.
    pub check_expected_token: bool,
}

impl<B: Backend> CanaryLaunchPrimitive<B> {
    /// The given sources with their layouts, in fold order.
    pub fn sources(self) -> (LaunchMeta, Vec<(KvBytes<B>, SourceLayout)>) {
        let places = [self.source_0, self.source_1, self.source_2, self.source_3];
        let sources = places
            .into_iter()
            .zip(self.meta.layouts.iter().copied())
            .collect();
        (self.meta, sources)
    }
}

/// A write step's token arrays (i64 `[T]` each).
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct WriteInputsPrimitive<B: Backend> {
    /// Token ids.
    pub input_ids: IntTensor<B>,
    /// Positions.
    pub positions: IntTensor<B>,
    /// Canary slot per token; negative skips the token.
    pub out_cache_loc: IntTensor<B>,
    /// `expected_input_tokens`: the input assert is on when given (with the positions).
    #[extension_type]
    pub expected_input_tokens: OptionalInt<B>,
    /// `expected_input_positions`.
    #[extension_type]
    pub expected_input_positions: OptionalInt<B>,
    /// i32 `[1]` `enable_chain_position_assert`; absent is off.
    #[extension_type]
    pub chain_position_assert: OptionalInt<B>,
}

/// The device-side result of a `segment_assign`.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct AssignPrimitive<B: Backend> {
    /// The table: written in place where its buffer was unique; as it was after an error.
    pub req_to_token: IntTensor<B>,
    /// i64 status record (`kvplan_kernels::status`); its count is the number of slots written.
    pub status: IntTensor<B>,
}

/// A KV cache, or the rows stored into one: a float or an int tensor `[slots or tokens, ...]`.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub enum KvRows<B: Backend> {
    /// A float tensor (any float dtype).
    Float(FloatTensor<B>),
    /// An int tensor (any int dtype).
    Int(IntTensor<B>),
}

impl<B: Backend> KvRows<B> {
    /// The tensor's shape.
    pub fn shape(&self) -> burn_core::tensor::Shape {
        match self {
            Self::Float(tensor) => tensor.shape(),
            Self::Int(tensor) => tensor.shape(),
        }
    }
}

/// A `KvStore`'s scratch, kept with the store so that no call uploads or clears anything (each
/// call leaves it ready for the next). Unused by the host reference.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct StoreScratchPrimitive<B: Backend> {
    /// u32 `[max(S, 1)]`: per cache slot, the last clock value that claimed it.
    pub slot_words: IntTensor<B>,
    /// i64 `[STORE_CONTROL_LEN]`: the check's control words (`kvplan_kernels::slots`).
    pub control: IntTensor<B>,
}

/// The device-side result of a store's slot check.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct StoreCheckPrimitive<B: Backend> {
    /// The store's scratch, handed back.
    #[extension_type]
    pub scratch: StoreScratchPrimitive<B>,
    /// i64 status record (`kvplan_kernels::status`); its count is the number of tokens.
    pub status: IntTensor<B>,
}

/// The caches one store write fills, or the rows it writes into them: one cache, or two (a
/// layer's K and V) written by one launch.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub enum StoreTargets<B: Backend> {
    /// One cache.
    One(#[extension_type] KvRows<B>),
    /// Two caches (K and V).
    Pair(#[extension_type] KvRows<B>, #[extension_type] KvRows<B>),
}

/// The device-side result of a store write: the caches, and the status to check, the slots'
/// (handed back) or a launch's refusal.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct StoreWritePrimitive<B: Backend> {
    /// The caches: written in place where their buffers were unique; as they were after an error.
    #[extension_type]
    pub caches: StoreTargets<B>,
    /// i64 status record (`kvplan_kernels::status`).
    pub status: IntTensor<B>,
}

/// The checked slots a layer's new K and V rows are stored at, for `store_and_attend`. The status is read, never written: the op runs only where it cannot be refused.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct NewRowsPrimitive<B: Backend> {
    /// The slots, `[N]`.
    pub loc: IntTensor<B>,
    /// The slots' i64 status record: their check's, or an earlier write's.
    pub status: IntTensor<B>,
    /// The store scratch's u32 slot words as the slots' check left them: which row claims a slot
    /// (`kvplan_kernels::slots`). Unused by the host reference.
    pub claims: IntTensor<B>,
    /// The store's u32 arrival counts, multiples of the attention's parts between launches: a
    /// launch of at most as many (token, query head) pairs folds its parts itself. Unused by
    /// the host reference.
    pub arrivals: IntTensor<B>,
}

/// The device-side result of a store into a joined pool followed by the attention over it.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion: cfg(feature = "fusion"))]
pub struct AttendedPrimitive<B: Backend> {
    /// The attention's output, `[tokens, heads * head_dim]`.
    pub out: FloatTensor<B>,
    /// The joined pool: written in place where its buffer was unique; as it was after an error.
    pub kv_pool: FloatTensor<B>,
}

impl<B: Backend> StoreTargets<B> {
    /// The caches (or rows), in order.
    pub fn rows(&self) -> Vec<&KvRows<B>> {
        match self {
            Self::One(first) => vec![first],
            Self::Pair(first, second) => vec![first, second],
        }
    }
}

/// Where `store_and_attend` runs as one launch whatever its sizes, on one device: the Cube
/// backend's rule (64-bit indexes, and no f64 through SPIR-V) on a CubeCL device, everywhere
/// elsewhere. Read once, when a store is allocated: it asks the device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OneLaunch {
    wide: bool,
    spirv: bool,
}

impl OneLaunch {
    pub(crate) fn on<D: 'static>(device: &D) -> Self {
        #[cfg(any(feature = "vulkan", feature = "cuda"))]
        if let Some(cube) = crate::room::cube_device(device) {
            let (wide, spirv) = cube::launch_traits(&cube);
            return Self { wide, spirv };
        }
        let _ = device;
        Self {
            wide: true,
            spirv: false,
        }
    }

    pub(crate) fn runs(self, dtype: burn_core::tensor::DType) -> bool {
        self.wide && !(self.spirv && dtype == burn_core::tensor::DType::F64)
    }
}

/// The largest slot a `req_to_token` of `dtype` (int32 or int64) holds.
pub(crate) fn slot_max(dtype: burn_core::tensor::DType) -> i64 {
    match dtype {
        burn_core::tensor::DType::I32 => i64::from(i32::MAX),
        _ => i64::MAX,
    }
}

/// kvplan's ops as a Burn backend extension.
///
/// Implemented by the Cube backend (kernels), Flex (the host reference), Fusion (lazy, from the
/// macro) and Autodiff (delegates: int tensors carry no gradient). A custom backend opts in with
/// an empty `impl KvPlanBackend for MyBackend {}`, which runs the host reference.
#[backend_extension(
    Fusion: cfg(feature = "fusion"),
    Flex,
    Cube: cfg(any(feature = "vulkan", feature = "cuda")),
    Autodiff,
)]
pub trait KvPlanBackend: Backend {
    /// Masked gather (spec `gather.md` §3, rules 6-10) into an output of `capacity` values.
    ///
    /// `capacity` is also the bound of rule 10. Rules 1-5 have been checked by the caller.
    #[fusion(meta = gather_meta)]
    fn masked_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        pos2d: IntTensor<Self>,
        mask: BoolTensor<Self>,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        host::masked_gather::<Self>(req_to_token, req_pool_indices, pos2d, mask, capacity)
    }

    /// Segment gather (spec `gather.md` §4, rules 4-10) into an output of `capacity` values.
    #[fusion(meta = segment_meta)]
    fn segment_gather(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        #[extension_type] start: OptionalInt<Self>,
        lengths: IntTensor<Self>,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        host::segment_gather::<Self>(req_to_token, req_pool_indices, start, lengths, capacity)
    }

    /// One kv-canary plan step (spec `canary-plan.md` §4 and rules 12-17), filling the plans in
    /// place. Rules 1-11 have been checked by the caller.
    #[fusion(meta = plan_meta)]
    fn canary_plan(
        #[extension_type] verify: VerifyPlanPrimitive<Self>,
        #[extension_type] write: WritePlanPrimitive<Self>,
        #[extension_type] inputs: PlanInputsPrimitive<Self>,
    ) -> PlanOutput<Self> {
        host::canary_plan::<Self>(verify, write, inputs)
    }

    /// `segment_assign` (spec `slots.md` §1): writes each request's run of `out_cache_loc` into
    /// its row of `req_to_token`, which is consumed and handed back (written in place when
    /// unique). The value rules come back in the status; on any error no cell is written. The
    /// host rules have been checked by the caller.
    #[fusion(meta = |req_to_token, _rpi, _start, _lengths, _loc| AssignPrimitiveMetadata {
        req_to_token: req_to_token.clone(),
        status: status_spec(),
    })]
    fn segment_assign(
        req_to_token: IntTensor<Self>,
        req_pool_indices: IntTensor<Self>,
        start: IntTensor<Self>,
        lengths: IntTensor<Self>,
        out_cache_loc: IntTensor<Self>,
    ) -> AssignPrimitive<Self> {
        host::segment_assign::<Self>(
            req_to_token,
            req_pool_indices,
            start,
            lengths,
            out_cache_loc,
        )
    }

    /// The value rules of a store's slots (spec `slots.md` §2: every slot inside caches of
    /// `cache_rows` rows, no slot but 0 twice) into a status record whose count is the number of
    /// tokens. The store's scratch is consumed and handed back, its clock advanced on the device
    /// (`kvplan_kernels::slots`). The host rules have been checked by the caller.
    #[fusion(meta = |_loc, scratch, _cache_rows| StoreCheckPrimitiveMetadata {
        scratch: scratch.clone(),
        status: status_spec(),
    })]
    fn check_store_slots(
        loc: IntTensor<Self>,
        #[extension_type] scratch: StoreScratchPrimitive<Self>,
        cache_rows: usize,
    ) -> StoreCheckPrimitive<Self> {
        host::check_store_slots::<Self>(loc, scratch, cache_rows)
    }

    /// A store's write (spec `slots.md` §2): `cache[loc[i]] = values[i]` for each cache, when
    /// `status` (the slots' check against the caches' rows, or an earlier write's) is clear. The
    /// caches are consumed and handed back (written in place when unique), unchanged after an
    /// error; the status comes back as it was, or holding why this write could not run. The host
    /// rules have been checked by the caller.
    #[fusion(meta = |caches, _values, _loc, _status| StoreWritePrimitiveMetadata {
        caches: caches.clone(),
        status: status_spec(),
    })]
    fn store_rows(
        #[extension_type] caches: StoreTargets<Self>,
        #[extension_type] values: StoreTargets<Self>,
        loc: IntTensor<Self>,
        status: IntTensor<Self>,
    ) -> StoreWritePrimitive<Self> {
        host::store_rows::<Self>(caches, values, loc, status)
    }

    /// The value rules of a paged attention's key runs (`KEY_RUN`, `KEY_SLOT`) for pools of
    /// `pool_rows` rows, into a status record whose count is the number of tokens, and the runs
    /// record of the status, the starts and the counts (one input of each layer's attention).
    #[fusion(meta = |_slots, starts, _counts, _pool_rows| KeyRunsPrimitiveMetadata {
        status: status_spec(),
        runs: TensorSpec::new(
            [kvplan_kernels::attention::runs_len(starts.shape[0])].into(),
            burn_core::tensor::DType::I64,
        ),
    })]
    fn check_key_runs(
        slots: IntTensor<Self>,
        starts: IntTensor<Self>,
        counts: IntTensor<Self>,
        pool_rows: usize,
    ) -> KeyRunsPrimitive<Self> {
        host::check_key_runs::<Self>(slots, starts, counts, pool_rows)
    }

    /// Paged attention: each row `t` of `q` (`heads` query heads) attends over the rows of the
    /// joined pool `kv_pool` `[pool_rows, 2 * kv_heads * head_dim]` (each row a slot's K, then its
    /// V) at `slots[start_t .. start_t + count_t]`, the start and count of `runs` (the runs'
    /// check, `check_key_runs`), scaled by `1 / sqrt(head_dim)`; query heads share K/V heads in
    /// groups. On an error the runs' status holds, the output is NaN. The host rules have been
    /// checked by the caller.
    #[fusion(meta = |q, _kv_pool, _slots, _runs, _heads| q.clone())]
    fn paged_attention(
        q: FloatTensor<Self>,
        kv_pool: FloatTensor<Self>,
        slots: IntTensor<Self>,
        runs: IntTensor<Self>,
        heads: usize,
    ) -> FloatTensor<Self> {
        let kv_cols = kv_pool.shape()[1] / 2;
        let [k_pool, v_pool] = host::split_columns::<Self>(kv_pool, kv_cols);
        host::paged_attention::<Self>(q, k_pool, v_pool, [slots, runs], heads)
    }

    /// A layer's new rows stored at their slots of the joined pool (`store_rows`), then the paged
    /// attention over it (`paged_attention`), as one op: the queries, new K rows and new V rows
    /// side by side in `qkv` `[N, heads * head_dim + kv_pool columns]`, each new row's K and V
    /// (its last `kv_pool` columns) stored whole at its slot. The Cube backend reads the keys this
    /// store writes from the new rows, through the claims and the check's first clock value (in
    /// its status), and makes both in one launch. The host rules of both have been checked by the
    /// caller, and it calls the op only where its launch cannot be refused (`OneLaunch`): the
    /// slots' status is read, not handed back.
    #[fusion(meta = |qkv, kv_pool, _rows, _slots, _runs, _heads| AttendedPrimitiveMetadata {
        out: TensorSpec::new(
            [qkv.shape[0], qkv.shape[1] - kv_pool.shape[1]].into(),
            qkv.dtype,
        ),
        kv_pool: kv_pool.clone(),
    })]
    fn store_and_attend(
        qkv: FloatTensor<Self>,
        kv_pool: FloatTensor<Self>,
        #[extension_type] rows: NewRowsPrimitive<Self>,
        slots: IntTensor<Self>,
        runs: IntTensor<Self>,
        heads: usize,
    ) -> AttendedPrimitive<Self> {
        let q_cols = qkv.shape()[1] - kv_pool.shape()[1];
        let [q, kv] = host::split_columns::<Self>(qkv, q_cols);
        let written = Self::store_rows(
            StoreTargets::One(KvRows::Float(kv_pool)),
            StoreTargets::One(KvRows::Float(kv)),
            rows.loc,
            rows.status,
        );
        let StoreTargets::One(KvRows::Float(kv_pool)) = written.caches else {
            unreachable!("a write hands back the targets it was given");
        };
        let out = Self::paged_attention(q, kv_pool.clone(), slots, runs, heads);
        AttendedPrimitive { out, kv_pool }
    }

    /// Values `offset..offset + len` of a contiguous 1-D i64 tensor (a gather's output, a
    /// step's record): a view of its buffer where the backend can make one. (Burn's `slice`
    /// copies a range whose ends are not both on the allocator's alignment, and a copy made
    /// before a capture is not in the graph: a replay would read it stale.)
    #[fusion(meta = |_tensor, _offset, len| TensorSpec::new([*len].into(), burn_core::tensor::DType::I64))]
    fn int_view(tensor: IntTensor<Self>, offset: usize, len: usize) -> IntTensor<Self> {
        host::int_view::<Self>(tensor, offset, len)
    }

    /// Writes `values` into `target` (i64, contiguous, `values.len()` elements) in place: the same
    /// device buffer, so that a captured graph that reads it sees the new values (the one
    /// host-to-device transfer of a `PagedKv` step). The host body uploads a new tensor (no
    /// backend without graphs needs the same buffer).
    #[fusion(meta = |target, _values| target.clone())]
    fn write_i64(target: IntTensor<Self>, values: Vec<i64>) -> IntTensor<Self> {
        host::write_i64::<Self>(target, values)
    }

    /// kv-canary write (spec `canary-write-verify.md` §6): stores the records of the plan's active
    /// requests into the canary, appends assert rows, counts. The canary is consumed and handed
    /// back (written in place when unique). Host rules have been checked by the caller.
    #[fusion(meta = |canary, _plan, _inputs, _launch| canary.clone())]
    fn canary_write(
        #[extension_type] canary: CanaryPrimitive<Self>,
        #[extension_type] plan: WritePlanPrimitive<Self>,
        #[extension_type] inputs: WriteInputsPrimitive<Self>,
        #[extension_type] launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        host::canary_write::<Self>(canary, plan, inputs, launch)
    }

    /// kv-canary verify (spec §7): checks the plan's active entries, appends a row per mismatch.
    #[fusion(meta = |canary, _plan, _launch| canary.clone())]
    fn canary_verify(
        #[extension_type] canary: CanaryPrimitive<Self>,
        #[extension_type] plan: VerifyPlanPrimitive<Self>,
        #[extension_type] launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        host::canary_verify::<Self>(canary, plan, launch)
    }
}

#[cfg(feature = "fusion")]
use burn_core::backend::fusion::custom::TensorSpec;

/// The spec of a status record.
#[cfg(feature = "fusion")]
fn status_spec() -> TensorSpec {
    use burn_core::tensor::DType;
    use kvplan_kernels::status::STATUS_LEN;
    TensorSpec::new([STATUS_LEN].into(), DType::I64)
}

#[cfg(feature = "fusion")]
fn gather_outputs(capacity: usize) -> GatherPrimitiveMetadata {
    use burn_core::tensor::DType;
    use kvplan_kernels::status::STATUS_LEN;
    let i64s = |len: usize| TensorSpec::new([len].into(), DType::I64);
    GatherPrimitiveMetadata {
        out: i64s(capacity),
        status: i64s(STATUS_LEN),
    }
}

#[cfg(feature = "fusion")]
fn gather_meta(
    _req_to_token: &TensorSpec,
    _req_pool_indices: &TensorSpec,
    _pos2d: &TensorSpec,
    _mask: &TensorSpec,
    capacity: &usize,
) -> GatherPrimitiveMetadata {
    gather_outputs(*capacity)
}

#[cfg(feature = "fusion")]
fn segment_meta(
    _req_to_token: &TensorSpec,
    _req_pool_indices: &TensorSpec,
    _start: &OptionalIntMetadata,
    _lengths: &TensorSpec,
    capacity: &usize,
) -> GatherPrimitiveMetadata {
    gather_outputs(*capacity)
}

#[cfg(feature = "fusion")]
fn plan_meta(
    verify: &VerifyPlanPrimitiveMetadata,
    write: &WritePlanPrimitiveMetadata,
    _inputs: &PlanInputsPrimitiveMetadata,
) -> PlanOutputMetadata {
    use burn_core::tensor::DType;
    use kvplan_kernels::status::STATUS_LEN;
    PlanOutputMetadata {
        verify: verify.clone(),
        write: write.clone(),
        status: TensorSpec::new([STATUS_LEN].into(), DType::I64),
    }
}
