//! The status record: how a kernel (or the host reference) reports a data-dependent error.
//!
//! A status is `STATUS_LEN` i64 words, read back in one transfer:
//! `[code, count, fact0, .., fact5]` (unused facts 0). `code == OK` means success; `count` is the
//! op's element count (gathered values, slots assigned, rows stored; unused by the plan). The facts
//! of each code are listed next to it, and the host turns them into a typed error. A clear
//! `store_kv` record keeps two facts for its launches: fact0 is 1 + the last token naming the
//! padding slot 0 (0: none), the one token whose row slot 0 takes; fact1 is the check's first
//! clock value, which a store-and-attend launch reads its claims against.

/// Number of i64 words in a status record.
pub const STATUS_LEN: usize = 8;
/// Word index of the error code.
pub const CODE: usize = 0;
/// Word index of the element count.
pub const COUNT: usize = 1;
/// Word index of the first fact.
pub const FACTS: usize = 2;

/// No error.
pub const OK: i64 = 0;
/// The op failed to execute inside a lazily executed (fused) stream. []
pub const EXECUTION: i64 = 99;
/// A launch would index past what the device can address (no 64-bit indexing). [elements, limit]
pub const INDEX_RANGE: i64 = 98;

// Gather codes (spec gather.md §3/§4). Facts in brackets.
/// `cols == 0` under a non-empty mask. []
pub const GATHER_EMPTY_TABLE: i64 = 1;
/// Segments: `S != P`. [S, P, L]
pub const GATHER_SEGMENT_SHAPE: i64 = 2;
/// `n` pairs with neither `R` nor 1, `R > 1`. [n, R, C]
pub const GATHER_INDEX_SHAPE: i64 = 3;
/// `n` pairs with neither `R` nor 1, `R == 1`. [n, R, C]
pub const GATHER_MASK_INDEX_SHAPE: i64 = 4;
/// A pos row names no row of the table. [i, value, rows]
pub const GATHER_ROW: i64 = 5;
/// A true cell's position is outside the table width. [i, j, position, cols]
pub const GATHER_POSITION: i64 = 6;
/// More values than the caller's capacity. [count, capacity]
pub const GATHER_CAPACITY: i64 = 7;

// Plan codes (spec canary-plan.md §5, rules 12-17). Facts in brackets.
/// Rule 11, found on the device where the host could not see strides (fused backends). \[stride\]
pub const PLAN_STRIDE: i64 = 11;
/// Rule 12. [r, q, rows]
pub const PLAN_ROW: i64 = 12;
/// Rule 13. [r, p, cols]
pub const PLAN_POSITION: i64 = 13;
/// Rule 14. [slot, lut_len, r, c]
pub const PLAN_SWA_SLOT: i64 = 14;
/// Rule 15. [r, q, pool_rows]
pub const PLAN_POOL_ROW: i64 = 15;
/// Rule 16. [r, column, pool_cols, valid_len]
pub const PLAN_POOL_POSITION: i64 = 16;
/// Rule 17. \[r\]
pub const PLAN_WRITE_OFFSETS_OVERFLOW: i64 = 17;

// Slot codes (spec `slots.md`). Facts in brackets. `segment_assign` also reports `GATHER_ROW`
// [i, value, rows] and `GATHER_POSITION` [i, j, position, cols], as `segment_gather` does.
/// `segment_assign`: a padding row (0) named with a non-zero length. [i, length]
pub const ASSIGN_PADDING_ROW: i64 = 20;
/// `segment_assign`: a negative length. [i, length]
pub const ASSIGN_NEGATIVE_LENGTH: i64 = 21;
/// `segment_assign`: `len(out_cache_loc) != sum(lengths)`. [len, sum]
pub const ASSIGN_SLOT_COUNT: i64 = 22;
/// `segment_assign`: a slot that is negative or does not fit the table's dtype.
/// [i, column, index, slot, max]
pub const ASSIGN_SLOT: i64 = 23;
/// `segment_assign`: two requests write one cell. [i, earlier request, row, column]
pub const ASSIGN_CONFLICT: i64 = 24;
/// `store_kv`: a slot outside the cache. [index, slot, slots]
pub const STORE_LOC: i64 = 30;
/// `store_kv`: a slot other than 0 named twice. [index, first index, slot]
pub const STORE_DUPLICATE: i64 = 31;

// Attention codes. Facts in brackets.
/// `paged_attention`: a token's run leaves the slot list. [token, start, count, slots_len]
pub const KEY_RUN: i64 = 40;
/// `paged_attention`: a slot of a token's run is outside the K/V pools. [token, key, slot, pool_rows]
pub const KEY_SLOT: i64 = 41;
