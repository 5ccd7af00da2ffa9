//! The library's one error type.
//!
//! Every variant carries the offending values; `kind()` gives the snake_case kind used by the specs and
//! the conformance files. Gather messages start with the caller's `context`, plan messages with
//! `kv-canary:`, slot messages with `segment_assign:` or `store_kv:`.

use core::fmt;

/// Context prefix of every kv-canary plan error message.
pub const PLAN_CONTEXT: &str = "kv-canary:";
/// Fixed context of `segment_gather` errors (the op takes no context argument).
pub const SEGMENT_CONTEXT: &str = "DFLASH req_to_token segment gather";
/// Context prefix of every `segment_assign` error message.
pub const ASSIGN_CONTEXT: &str = "segment_assign:";
/// Context prefix of every `store_kv` error message.
pub const STORE_CONTEXT: &str = "store_kv:";
/// Context prefix of every `paged_attention` error message.
pub const ATTENTION_CONTEXT: &str = "paged_attention:";

/// Where a data-dependent error was found: names the offender the way the op's spec does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Site {
    /// Gather pos row `i` (or segment `i`).
    Row(usize),
    /// Gather cell `[i, j]` (for segments, `j` is the offset inside segment `i`).
    Cell(usize, usize),
    /// Plan request `r`.
    Request(usize),
}

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Site::Row(i) => write!(f, "row {i}"),
            Site::Cell(i, j) => write!(f, "[{i},{j}]"),
            Site::Request(r) => write!(f, "request {r}"),
        }
    }
}

/// A shape, printed like `[2, 3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dims(pub Vec<usize>);

impl fmt::Display for Dims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// Every failure kvplan reports. Nothing in kvplan panics on bad input: it returns one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // ---- gather (spec gather.md §6) ----
    /// The table has no columns but the mask selects a cell.
    #[error("{context} req_to_token table is empty but gather mask is non-empty.")]
    EmptyTableNonemptyMask {
        /// Message prefix.
        context: String,
    },
    /// `pos2d` is not 2-D.
    #[error("{context} pos2d must be 2-D, got shape {shape}.")]
    PosNot2d {
        /// Message prefix.
        context: String,
        /// Shape of `pos2d`.
        shape: Dims,
    },
    /// `mask` and `pos2d` differ in shape (for segments: `S` lengths vs `P` starts).
    #[error("{context} mask shape {mask} differs from pos2d shape {pos2d}.")]
    MaskShapeMismatch {
        /// Message prefix.
        context: String,
        /// Shape of the mask.
        mask: Dims,
        /// Shape of the positions.
        pos2d: Dims,
    },
    /// `n` row indices pair with neither the `R` pos rows nor 1.
    #[error(
        "{context} {n} req_pool_indices cannot pair with {rows} pos2d rows (need {rows} or 1)."
    )]
    IndexShapeMismatch {
        /// Message prefix.
        context: String,
        /// Length of `req_pool_indices`.
        n: usize,
        /// Pos rows `R`.
        rows: usize,
        /// Pos columns `C`.
        cols: usize,
    },
    /// A single pos row cannot serve several row indices.
    #[error("{context} a single pos2d row cannot serve {n} req_pool_indices.")]
    MaskIndexShapeMismatch {
        /// Message prefix.
        context: String,
        /// Length of `req_pool_indices`.
        n: usize,
        /// Pos rows `R` (1).
        rows: usize,
        /// Pos columns `C`.
        cols: usize,
    },
    /// A row index names no row of `req_to_token`.
    #[error("{context} {site}: req_pool_index {value} is not a row of req_to_token (rows={rows}).")]
    ReqPoolIndexOutOfRange {
        /// Message prefix.
        context: String,
        /// Pos row, segment or request.
        site: Site,
        /// The offending index.
        value: i64,
        /// Rows of `req_to_token`.
        rows: usize,
    },
    /// A position is outside the table width (plan: the prefix length exceeds it).
    #[error("{context} {site}: position {position} is outside req_to_token width {cols}.")]
    PositionOutOfRange {
        /// Message prefix.
        context: String,
        /// Cell (gather) or request (plan).
        site: Site,
        /// The offending position (plan: the prefix length).
        position: i64,
        /// Columns of `req_to_token`.
        cols: usize,
    },
    /// More gathered values than the caller's capacity.
    #[error("{context} {count} gathered values do not fit capacity {capacity}.")]
    CapacityExceeded {
        /// Message prefix.
        context: String,
        /// Values the gather produces.
        count: u64,
        /// Capacity given.
        capacity: usize,
    },
    /// A tensor that must be 1-D is not.
    #[error("{context} {name} must be 1-D, got shape {shape}.")]
    Not1d {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its shape.
        shape: Dims,
    },
    /// A tensor that must be 2-D is not.
    #[error("{context} {name} must be 2-D, got shape {shape}.")]
    Not2d {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its shape.
        shape: Dims,
    },
    /// A tensor has a dtype the op does not accept.
    #[error("{context} {name} has dtype {got}; accepted: {accepted}.")]
    DtypeMismatch {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its dtype.
        got: String,
        /// The accepted dtypes.
        accepted: &'static str,
    },
    /// A tensor is on another device than the rest.
    #[error("{context} {name} is on {device}, expected {expected}.")]
    DeviceMismatch {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its device.
        device: String,
        /// The device of the first tensor (gather) or of the plans (plan).
        expected: String,
    },

    // ---- kv-canary plan (spec canary-plan.md §2, §5) ----
    /// `VerifyPlan::allocate(0)`.
    #[error("kv-canary: verify capacity must be positive, got {value}")]
    NonPositiveVerifyCapacity {
        /// The capacity given.
        value: usize,
    },
    /// `WritePlan::allocate(0)`.
    #[error("kv-canary: write request capacity must be positive, got {value}")]
    NonPositiveWriteCapacity {
        /// The capacity given.
        value: usize,
    },
    /// A capacity above `2^31-1` (counts are stored as i32).
    #[error("kv-canary: {field} {value} exceeds 2^31-1")]
    CapacityTooLarge {
        /// Which capacity.
        field: &'static str,
        /// The capacity given.
        value: usize,
    },
    /// Rule 1: a window needs the LUT.
    #[error("kv-canary: swa_window_size {window} > 0 requires full_to_swa_index_mapping")]
    MissingLutForSwa {
        /// The window.
        window: i32,
    },
    /// Rule 2: `verify_capacity` differs from the plan's.
    #[error("kv-canary: verify_capacity {argument} differs from the VerifyPlan capacity {plan}")]
    CapacityMismatch {
        /// The argument.
        argument: usize,
        /// The plan's capacity.
        plan: usize,
    },
    /// Rule 3: a pool without `valid_lens`.
    #[error(
        "kv-canary: req_to_verify_expected_tokens requires req_to_verify_expected_tokens_valid_lens"
    )]
    MissingValidLens,
    /// Rule 4: `valid_lens` without a pool.
    #[error(
        "kv-canary: req_to_verify_expected_tokens_valid_lens given without req_to_verify_expected_tokens"
    )]
    ValidLensWithoutPool,
    /// Rule 8: a per-request tensor's length differs from `bs`.
    #[error("kv-canary: {name} has length {len}, expected bs={bs}")]
    LengthMismatch {
        /// Argument name.
        name: &'static str,
        /// Its length.
        len: usize,
        /// The batch size.
        bs: usize,
    },
    /// Rule 9: the LUT is empty.
    #[error("kv-canary: full_to_swa_index_mapping is empty")]
    EmptyLut,
    /// Rule 10: more requests than the write plan holds.
    #[error("kv-canary: bs {bs} exceeds the WritePlan capacity {capacity}")]
    BsExceedsWriteCapacity {
        /// The batch size.
        bs: usize,
        /// The write plan's capacity.
        capacity: usize,
    },
    /// Rule 11: a zero (broadcast) row stride of `req_to_token`.
    #[error("kv-canary: req_to_token_stride0 must be positive, got {stride}")]
    ReqToTokenStride {
        /// The row stride, in elements.
        stride: i64,
    },
    /// Rule 14: a slot to translate is outside the LUT.
    #[error(
        "kv-canary: SWA slot {slot} is outside full_to_swa_index_mapping length {lut_len} (request {request}, position {position})"
    )]
    SwaSlotOutsideLut {
        /// The slot.
        slot: i64,
        /// LUT length.
        lut_len: usize,
        /// Request index.
        request: usize,
        /// Column of `req_to_token` it was read from.
        position: usize,
    },
    /// Rule 15: the request's pool row does not exist.
    #[error(
        "kv-canary: request {request}: req_pool_index {row} is not a row of req_to_verify_expected_tokens (rows={pool_rows})"
    )]
    ExpectedPoolRowOutOfRange {
        /// Request index.
        request: usize,
        /// Its row index.
        row: i64,
        /// Pool rows.
        pool_rows: usize,
    },
    /// Rule 16: the pool is narrower than the columns read.
    #[error(
        "kv-canary: request {request}: expected-token column {column} is outside req_to_verify_expected_tokens width {pool_cols} (valid_len {valid_len})"
    )]
    ExpectedPoolPositionOutOfRange {
        /// Request index.
        request: usize,
        /// Largest column read.
        column: i64,
        /// Pool columns.
        pool_cols: usize,
        /// The request's valid length.
        valid_len: i64,
    },
    /// Rule 17: the write offsets overflow i64.
    #[error("kv-canary: write offsets overflow i64 at request {request}")]
    WriteOffsetsOverflow {
        /// First request where the running sum overflows.
        request: usize,
    },

    // ---- kv-canary write and verify (spec canary-write-verify.md §10) ----
    /// A source's `page_size < 1`.
    #[error("kv-canary: RealKvSource.page_size must be >= 1, got {page_size}")]
    SourcePageSize {
        /// The page size given.
        page_size: i64,
    },
    /// A source's strip width is not a positive multiple of 16.
    #[error(
        "kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {num_bytes_per_token}"
    )]
    SourceNumBytesPerToken {
        /// The width given.
        num_bytes_per_token: i64,
    },
    /// A source's `read_bytes` is not a positive multiple of 16 within the strip.
    #[error(
        "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token={num_bytes_per_token}], got {read_bytes}"
    )]
    SourceReadBytes {
        /// The value given.
        read_bytes: i64,
        /// The source's strip width.
        num_bytes_per_token: i64,
    },
    /// A source tensor of rank below 2.
    #[error("kv-canary: RealKvSource.tensor must be at least 2-D, got shape {shape}")]
    SourceNot2d {
        /// Its shape.
        shape: Dims,
    },
    /// A source row stride that is not a multiple of 16 bytes.
    #[error(
        "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got {row_bytes} bytes (shape={shape}, dtype={dtype})"
    )]
    SourceRowStride {
        /// The row stride in bytes.
        row_bytes: usize,
        /// The tensor's shape.
        shape: Dims,
        /// Its dtype.
        dtype: String,
    },
    /// More than 4 sources in one launch.
    #[error("kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got {count}")]
    TooManySources {
        /// Sources given.
        count: usize,
    },
    /// The write input assert is on but an expected array is missing.
    #[error("kv-canary: expected input tensors are required when enable_write_input_assert=True")]
    ExpectedInputsMissing,
    /// The write input assert is off but expected arrays were given.
    #[error("kv-canary: expected input tensors must be None when enable_write_input_assert=False")]
    ExpectedInputsUnexpected,
    /// The write step's token arrays differ in length.
    #[error("kv-canary: {name} has length {len}, expected {expected} (the length of input_ids)")]
    TokenArraysLength {
        /// The array that differs.
        name: &'static str,
        /// Its length.
        len: usize,
        /// The length of `input_ids`.
        expected: usize,
    },
    /// `write_offsets` is not `K + 1` long.
    #[error(
        "canary_write: write_offsets.size(0) must equal write_req_capacity + 1 ({expected}), got {len}"
    )]
    WriteOffsetsLength {
        /// `K + 1`.
        expected: usize,
        /// Its length.
        len: usize,
    },
    /// The verify plan's arrays differ in length.
    #[error(
        "kv-canary: {name} has length {len}, expected {expected} (the length of verify_slot_indices)"
    )]
    VerifyPlanLength {
        /// The array that differs.
        name: &'static str,
        /// Its length.
        len: usize,
        /// The length of `verify_slot_indices`.
        expected: usize,
    },
    /// A canary slot stride that is not a multiple of 8 bytes.
    #[error(
        "kv-canary: canary_buf slot stride must be a multiple of 8 bytes, got {slot_stride_bytes}"
    )]
    SlotStrideNotMultipleOf8 {
        /// The stride given.
        slot_stride_bytes: usize,
    },
    /// A canary slot stride below the 4 record fields.
    #[error(
        "kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {}", slot_stride_bytes / 8
    )]
    SlotStrideTooSmall {
        /// The stride given, in bytes.
        slot_stride_bytes: usize,
    },
    /// A source row narrower than its slots' strips, under a fingerprinting mode.
    #[error(
        "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is {row_bytes} bytes but page_size={page_size} x num_bytes_per_token={num_bytes_per_token} needs {}", page_size * num_bytes_per_token
    )]
    SourceRowTooNarrow {
        /// Bytes per row.
        row_bytes: usize,
        /// Slots per row.
        page_size: usize,
        /// Strip width.
        num_bytes_per_token: usize,
    },
    /// A canary argument of the wrong dtype or shape (token arrays are i64 `[T]`, flags i32 `[1]`).
    #[error("kv-canary: {name} must be {accepted}, got {got}")]
    CanaryArgument {
        /// The argument.
        name: &'static str,
        /// Its dtype and shape.
        got: String,
        /// What is accepted.
        accepted: &'static str,
    },

    // ---- slot assignment and KV stores (spec slots.md) ----
    /// `start` or `lengths` does not hold one value per request.
    #[error("{context} {name} has length {len}, expected {bs} (one per req_pool_indices entry).")]
    SegmentLengthMismatch {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its length.
        len: usize,
        /// The length of `req_pool_indices`.
        bs: usize,
    },
    /// A padding row (`req_pool_indices[i] == 0`) with a non-zero length.
    #[error(
        "{context} request {request}: padding row 0 cannot take {length} slots (a padded request has length 0)."
    )]
    PaddingRowLength {
        /// Message prefix.
        context: String,
        /// The request.
        request: usize,
        /// Its length.
        length: i64,
    },
    /// A negative length.
    #[error("{context} request {request}: length {length} is negative.")]
    NegativeLength {
        /// Message prefix.
        context: String,
        /// The request.
        request: usize,
        /// Its length.
        length: i64,
    },
    /// `out_cache_loc` does not hold one slot per assigned cell.
    #[error("{context} out_cache_loc has {len} slots, but the lengths sum to {sum}.")]
    SlotCountMismatch {
        /// Message prefix.
        context: String,
        /// The length of `out_cache_loc`.
        len: usize,
        /// `sum(lengths)`.
        sum: u64,
    },
    /// A slot that is negative or does not fit the dtype of `req_to_token`.
    #[error(
        "{context} request {request}, column {column}: slot {slot} (out_cache_loc[{index}]) is outside 0..={max}, the slots req_to_token can hold."
    )]
    SlotOutOfRange {
        /// Message prefix.
        context: String,
        /// The request whose run takes the slot.
        request: usize,
        /// The column of `req_to_token` it would be written to.
        column: usize,
        /// Its index in `out_cache_loc`.
        index: usize,
        /// The slot.
        slot: i64,
        /// The largest slot the table's dtype holds.
        max: i64,
    },
    /// Two requests name one row with overlapping runs.
    #[error("{context} requests {other} and {request} both write req_to_token[{row}][{column}].")]
    WriteConflict {
        /// Message prefix.
        context: String,
        /// The later request.
        request: usize,
        /// The first earlier request it overlaps.
        other: usize,
        /// The row both name.
        row: usize,
        /// The first column both write.
        column: usize,
    },
    /// `values` is not one cache row per `loc` entry.
    #[error(
        "{context} values has shape {values}, expected {expected} (one row per loc entry, each shaped like a row of cache {cache})."
    )]
    ValueShapeMismatch {
        /// Message prefix.
        context: String,
        /// The shape of `values`.
        values: Dims,
        /// The shape it must have.
        expected: Dims,
        /// The shape of the cache.
        cache: Dims,
    },
    /// `values` and the cache differ in dtype.
    #[error("{context} values has dtype {values}, but cache has {cache}: they must match.")]
    ValueDtypeMismatch {
        /// Message prefix.
        context: String,
        /// The dtype of `values`.
        values: String,
        /// The dtype of the cache.
        cache: String,
    },
    /// A cache with more slots than its `KvStore` was allocated for.
    #[error(
        "{context} cache has {slots} slots, more than the {capacity} this KvStore was allocated for."
    )]
    StoreCapacity {
        /// Message prefix.
        context: String,
        /// The cache's slots.
        slots: usize,
        /// The store's.
        capacity: usize,
    },
    /// A cache stored into through checked slots without the rows they were checked against.
    #[error(
        "{context} {name} {cache} must have the {cache_rows} rows its slots were checked against."
    )]
    CacheRowsMismatch {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// The cache's shape.
        cache: Dims,
        /// The rows of the check.
        cache_rows: usize,
    },
    /// One cache given with two sets of rows, or two with one.
    #[error("{context} {caches} cache(s) given with {values} set(s) of rows: one set per cache.")]
    StoreTargetsMismatch {
        /// Message prefix.
        context: String,
        /// Caches given.
        caches: usize,
        /// Sets of rows given.
        values: usize,
    },
    /// A slot outside the cache.
    #[error("{context} loc[{index}]: slot {slot} is outside the cache's {slots} slots.")]
    LocOutOfRange {
        /// Message prefix.
        context: String,
        /// Its index in `loc`.
        index: usize,
        /// The slot.
        slot: i64,
        /// The cache's slots.
        slots: usize,
    },
    /// A slot other than the padding slot 0 named twice.
    #[error(
        "{context} loc[{index}]: slot {slot} is already taken by loc[{first}] (only the padding slot 0 may repeat)."
    )]
    DuplicateSlot {
        /// Message prefix.
        context: String,
        /// The later index.
        index: usize,
        /// The first index naming the slot.
        first: usize,
        /// The slot.
        slot: i64,
    },

    // ---- paged attention ----
    /// `q`, the pool and `heads` do not make whole heads of one `head_dim`.
    #[error(
        "{context} q {q} with {heads} heads over kv_pool {kv_pool} is not whole query heads over whole K/V heads of one head_dim <= {max_head_dim} (heads a multiple of K/V heads; each pool row a K row, then a V row as wide)."
    )]
    HeadShape {
        /// Message prefix.
        context: String,
        /// The shape of `q`.
        q: Dims,
        /// The shape of the joined K|V pool.
        kv_pool: Dims,
        /// Query heads asked for.
        heads: usize,
        /// The widest head the kernels take.
        max_head_dim: usize,
    },
    /// The pool does not have the rows its key runs were checked against.
    #[error(
        "{context} kv_pool {kv_pool} must have the {pool_rows} rows the key runs were checked against."
    )]
    PoolRowsMismatch {
        /// Message prefix.
        context: String,
        /// The shape of the joined K|V pool.
        kv_pool: Dims,
        /// The rows of the check.
        pool_rows: usize,
    },
    /// `counts` does not hold one value per start, or the runs one per row of `q`.
    #[error("{context} {name} has length {len}, expected {tokens} (one run per token).")]
    RunCountMismatch {
        /// Message prefix.
        context: String,
        /// Argument name.
        name: &'static str,
        /// Its length.
        len: usize,
        /// Rows of `q`.
        tokens: usize,
    },
    /// A token's run of keys leaves the slot list (or has a negative start or count).
    #[error(
        "{context} token {token}: keys {start}..{start}+{count} are outside the {slots} slots listed."
    )]
    KeyRunOutOfRange {
        /// Message prefix.
        context: String,
        /// The token (row of `q`).
        token: usize,
        /// Its start.
        start: i64,
        /// Its count.
        count: i64,
        /// Length of the slot list.
        slots: usize,
    },
    /// A slot of a token's run is outside the K/V pools.
    #[error(
        "{context} token {token}, key {key}: slot {slot} is outside the pools' {pool_rows} rows."
    )]
    KeySlotOutOfRange {
        /// Message prefix.
        context: String,
        /// The token (row of `q`).
        token: usize,
        /// The key's index in the token's run.
        key: usize,
        /// The slot.
        slot: i64,
        /// Rows of the pools.
        pool_rows: usize,
    },

    // ---- the paged KV state (`PagedKv`) ----
    /// A `PagedKvConfig` field that leaves nothing to serve with, or that does not fit.
    #[error("paged KV config: {field} = {value}: {why}")]
    Config {
        /// The field.
        field: &'static str,
        /// Its value.
        value: usize,
        /// What it must be.
        why: &'static str,
    },
    /// A step needs more KV slots than are free.
    #[error("paged KV: {needed} KV slots needed, {free} free")]
    OutOfSlots {
        /// Slots asked for.
        needed: usize,
        /// Slots free.
        free: usize,
    },
    /// Every `req_to_token` row is taken.
    #[error("paged KV: all {max_requests} request rows are taken")]
    OutOfRows {
        /// Requests the state holds at once.
        max_requests: usize,
    },
    /// A request id the state does not hold (never added, or removed).
    #[error("paged KV: unknown request {request}")]
    UnknownRequest {
        /// The id.
        request: u64,
    },
    /// A request named twice in one step.
    #[error("paged KV: request {request} appears twice in one step")]
    RequestTwiceInStep {
        /// The id.
        request: u64,
    },
    /// A window of no tokens.
    #[error("paged KV: request {request} brings no new tokens to the step")]
    EmptyWindow {
        /// The id.
        request: u64,
    },
    /// A request's context would pass the table's columns.
    #[error("paged KV: request {request} would reach {len} tokens, past max context {max_context}")]
    ContextFull {
        /// The id.
        request: u64,
        /// Its length after the step (or the shared prefix asked for).
        len: usize,
        /// The table's columns.
        max_context: usize,
    },
    /// A shared prefix longer than its source's committed tokens.
    #[error(
        "paged KV: request {request} has {len} committed tokens, a prefix of {prefix} cannot be shared"
    )]
    PrefixTooLong {
        /// The source request.
        request: u64,
        /// Its committed tokens.
        len: usize,
        /// The prefix asked for.
        prefix: usize,
    },
    /// A layer index past the model's layers.
    #[error("paged KV: layer {layer} is out of range for {layers} layers")]
    LayerOutOfRange {
        /// The layer.
        layer: usize,
        /// Layers configured.
        layers: usize,
    },
    /// A tensor handed to a `PagedKv` of another shape than it takes: a layer's `qkv` (`[tokens,
    /// (heads + 2 * kv_heads) * head_dim]`), a pool or a table set in place of its own.
    #[error("paged KV: {name} has shape {got}, expected {expected}")]
    TensorShape {
        /// The argument.
        name: &'static str,
        /// The shape given.
        got: Dims,
        /// The shape it must have.
        expected: Dims,
    },
    /// A tensor handed to a `PagedKv` of another dtype than its pools (or table).
    #[error("paged KV: {name} is {got:?}, expected {expected:?}")]
    TensorDtype {
        /// The argument.
        name: &'static str,
        /// The dtype given.
        got: burn_core::tensor::DType,
        /// The dtype it must have.
        expected: burn_core::tensor::DType,
    },
    /// A request keeps more tokens than its window brought (or the step ends with another count
    /// of requests than it began with).
    #[error("paged KV: request {request} keeps {keep} tokens of a window of {window}")]
    KeepPastWindow {
        /// The id.
        request: u64,
        /// Tokens kept.
        keep: usize,
        /// Tokens the window brought.
        window: usize,
    },
    /// `end` was given another number of requests than `begin`.
    #[error("paged KV: the step began with {began} requests, end names {ended}")]
    StepRequests {
        /// Requests at `begin`.
        began: usize,
        /// Requests at `end`.
        ended: usize,
    },
    /// A call out of the step's order (`attend` or `end` with no step begun, `begin` or a request
    /// change inside one).
    #[error("paged KV: {call} {why}")]
    StepOrder {
        /// The call.
        call: &'static str,
        /// Why it cannot run now.
        why: &'static str,
    },

    /// A captured step cannot replay this step: another shape (requests, tokens, shared-prefix
    /// cells to write), another `PagedKv`, or buffers replaced since the capture (`set_pool`,
    /// `set_req_to_token`, the store's clock starting again). Capture again.
    #[error("paged KV: the captured step cannot replay this one: {why}")]
    GraphMismatch {
        /// Why.
        why: &'static str,
    },

    /// A launch would index more elements than the device's kernels can address: it has no
    /// 64-bit indexing and a binding (or a count the kernel keeps) passes 2^31 elements.
    #[error(
        "kvplan: a launch spans {elements} elements, beyond the {limit} this device can index (it has no 64-bit indexing)"
    )]
    IndexRange {
        /// Elements of the widest binding or count.
        elements: u64,
        /// Elements a 32-bit launch may index.
        limit: u64,
    },
    /// A buffer sized from the caller's numbers (a capacity, a plan, a gather output) that the
    /// device, or the host holding its copy, cannot allocate: refused before anything is allocated.
    #[error(
        "kvplan: {what} needs {elements} elements ({bytes} bytes), more than {on} can allocate{}",
        limit.map_or(String::new(), |limit| format!(" (at most {limit} bytes at once)"))
    )]
    AllocationTooLarge {
        /// The buffer.
        what: &'static str,
        /// Its elements.
        elements: u64,
        /// Its bytes.
        bytes: u128,
        /// `the device` or `the host`.
        on: &'static str,
        /// The most bytes one allocation may have there, where it is known.
        limit: Option<u64>,
    },
    /// The device failed to run or read back an op (not an input error).
    #[error("kvplan: device execution failed: {detail}")]
    Execution {
        /// What the backend said.
        detail: String,
    },
    /// A status record with a code kvplan never writes: a bug, or memory overwritten by someone else.
    #[error("kvplan: status record holds unknown code {code}")]
    CorruptStatus {
        /// The code found.
        code: i64,
    },
}

impl Error {
    /// The snake_case kind of the specs and conformance files.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::EmptyTableNonemptyMask { .. } => "empty_table_nonempty_mask",
            Error::PosNot2d { .. } => "pos_not_2d",
            Error::MaskShapeMismatch { .. } => "mask_shape_mismatch",
            Error::IndexShapeMismatch { .. } => "index_shape_mismatch",
            Error::MaskIndexShapeMismatch { .. } => "mask_index_shape_mismatch",
            Error::ReqPoolIndexOutOfRange { .. } => "req_pool_index_out_of_range",
            Error::PositionOutOfRange { .. } => "position_out_of_range",
            Error::CapacityExceeded { .. } => "capacity_exceeded",
            Error::Not1d { .. } => "not_1d",
            Error::Not2d { .. } => "not_2d",
            Error::DtypeMismatch { .. } => "dtype_mismatch",
            Error::DeviceMismatch { .. } => "device_mismatch",
            Error::NonPositiveVerifyCapacity { .. } => "non_positive_verify_capacity",
            Error::NonPositiveWriteCapacity { .. } => "non_positive_write_capacity",
            Error::CapacityTooLarge { .. } => "capacity_too_large",
            Error::MissingLutForSwa { .. } => "missing_lut_for_swa",
            Error::CapacityMismatch { .. } => "capacity_mismatch",
            Error::MissingValidLens => "missing_valid_lens",
            Error::ValidLensWithoutPool => "valid_lens_without_pool",
            Error::LengthMismatch { .. } => "length_mismatch",
            Error::EmptyLut => "empty_lut",
            Error::BsExceedsWriteCapacity { .. } => "bs_exceeds_write_capacity",
            Error::ReqToTokenStride { .. } => "req_to_token_stride",
            Error::SwaSlotOutsideLut { .. } => "swa_slot_outside_lut",
            Error::ExpectedPoolRowOutOfRange { .. } => "expected_pool_row_out_of_range",
            Error::ExpectedPoolPositionOutOfRange { .. } => "expected_pool_position_out_of_range",
            Error::WriteOffsetsOverflow { .. } => "write_offsets_overflow",
            Error::SourcePageSize { .. } => "source_page_size",
            Error::SourceNumBytesPerToken { .. } => "source_num_bytes_per_token",
            Error::SourceReadBytes { .. } => "source_read_bytes",
            Error::SourceNot2d { .. } => "source_not_2d",
            Error::SourceRowStride { .. } => "source_row_stride",
            Error::TooManySources { .. } => "too_many_sources",
            Error::ExpectedInputsMissing => "expected_inputs_missing",
            Error::ExpectedInputsUnexpected => "expected_inputs_unexpected",
            Error::TokenArraysLength { .. } => "token_arrays_length",
            Error::WriteOffsetsLength { .. } => "write_offsets_length",
            Error::VerifyPlanLength { .. } => "verify_plan_length",
            Error::SlotStrideNotMultipleOf8 { .. } => "slot_stride_not_multiple_of_8",
            Error::SlotStrideTooSmall { .. } => "slot_stride_too_small",
            Error::SourceRowTooNarrow { .. } => "source_row_too_narrow",
            Error::CanaryArgument { .. } => "canary_argument",
            Error::SegmentLengthMismatch { .. } => "segment_length_mismatch",
            Error::PaddingRowLength { .. } => "padding_row_length",
            Error::NegativeLength { .. } => "negative_length",
            Error::SlotCountMismatch { .. } => "slot_count_mismatch",
            Error::SlotOutOfRange { .. } => "slot_out_of_range",
            Error::WriteConflict { .. } => "write_conflict",
            Error::ValueShapeMismatch { .. } => "value_shape_mismatch",
            Error::ValueDtypeMismatch { .. } => "value_dtype_mismatch",
            Error::StoreCapacity { .. } => "store_capacity",
            Error::CacheRowsMismatch { .. } => "cache_rows_mismatch",
            Error::StoreTargetsMismatch { .. } => "store_targets_mismatch",
            Error::LocOutOfRange { .. } => "loc_out_of_range",
            Error::DuplicateSlot { .. } => "duplicate_slot",
            Error::HeadShape { .. } => "head_shape",
            Error::RunCountMismatch { .. } => "run_count_mismatch",
            Error::PoolRowsMismatch { .. } => "pool_rows_mismatch",
            Error::KeyRunOutOfRange { .. } => "key_run_out_of_range",
            Error::KeySlotOutOfRange { .. } => "key_slot_out_of_range",
            Error::CorruptStatus { .. } => "corrupt_status",
            Error::IndexRange { .. } => "index_range",
            Error::AllocationTooLarge { .. } => "allocation_too_large",
            Error::Execution { .. } => "execution",
            Error::Config { .. } => "config",
            Error::OutOfSlots { .. } => "out_of_slots",
            Error::OutOfRows { .. } => "out_of_rows",
            Error::UnknownRequest { .. } => "unknown_request",
            Error::RequestTwiceInStep { .. } => "request_twice_in_step",
            Error::EmptyWindow { .. } => "empty_window",
            Error::ContextFull { .. } => "context_full",
            Error::PrefixTooLong { .. } => "prefix_too_long",
            Error::LayerOutOfRange { .. } => "layer_out_of_range",
            Error::TensorShape { .. } => "tensor_shape",
            Error::TensorDtype { .. } => "tensor_dtype",
            Error::KeepPastWindow { .. } => "keep_past_window",
            Error::StepRequests { .. } => "step_requests",
            Error::StepOrder { .. } => "step_order",
            Error::GraphMismatch { .. } => "graph_mismatch",
        }
    }
}

/// Result alias of the crate.
pub type Result<T> = core::result::Result<T, Error>;
