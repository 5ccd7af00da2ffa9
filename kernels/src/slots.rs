//! KV slot assignment (spec `slots.md`): `segment_assign` and `store_kv`. Each op is a check
//! launch, which writes the status record, then a write launch, which writes nothing unless that
//! status is clear: on any error the table or the cache is left as it was.
//!
//! `segment_assign` checks in one cube (a batch's requests and slots are few): rules 1-4 on every
//! request, the offsets of the runs (a scan of the lengths), rule 5, rule 6 on every slot, and,
//! when all of those pass, rule 7 on every pair of requests, a tile of runs at a time through
//! shared memory. Its write launch finds each slot's request by bisecting the offsets.
//!
//! `store_kv` checks every token in parallel. Duplicates are found through the store's scratch:
//! one `u32` word per cache slot, reset without a memset. A call owns the clock values
//! `[base, base + N)`, above every value an earlier call wrote (the clock is a control word the
//! call advances on the device: a replayed launch claims new values too), and token `i` raises its slot's
//! word to `base + N - 1 - i` (an atomic maximum): a word that was already at or above `base`
//! was claimed earlier in this call, and once every token is done each word names the first token
//! of its slot. A token that finds its slot claimed reports a token that is not its slot's first:
//! itself when an earlier token claimed first, else the later token that did, which the old
//! value names; the smallest second of every slot is reported that way, whatever the order. The
//! last cube to finish writes the status and leaves the control words clean.

use cubecl::prelude::*;

use crate::scan::{
    CUBE_SIZE, NO_ERROR, SLOTS, cube_exclusive_scan, cube_min, publish_block_done, report_error,
};
use crate::status::{
    ASSIGN_CONFLICT, ASSIGN_NEGATIVE_LENGTH, ASSIGN_PADDING_ROW, ASSIGN_SLOT, ASSIGN_SLOT_COUNT,
    CODE, COUNT, FACTS, GATHER_POSITION, GATHER_ROW, OK, STATUS_LEN, STORE_DUPLICATE, STORE_LOC,
};

// Error keys of `segment_assign`: the rule in the top byte, then the request or slot index;
// smaller is reported first.
const RULE_SHIFT: u64 = 56;
const KEY_ROW: u64 = 1 << RULE_SHIFT;
const KEY_PADDING: u64 = 2 << RULE_SHIFT;
const KEY_NEGATIVE: u64 = 3 << RULE_SHIFT;
const KEY_POSITION: u64 = 4 << RULE_SHIFT;
const KEY_COUNT: u64 = 5 << RULE_SHIFT;
const KEY_SLOT: u64 = 6 << RULE_SHIFT;
const KEY_CONFLICT: u64 = 7 << RULE_SHIFT;
const INDEX_MASK: u64 = (1 << RULE_SHIFT) - 1;

/// Shapes of one `segment_assign` (as scalars: empty tensors are bound as 1-element stand-ins).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct AssignShape {
    /// Rows of `req_to_token`.
    pub rows: u64,
    /// Columns of `req_to_token`.
    pub cols: u64,
    /// `bs`.
    pub requests: u64,
    /// `N = len(out_cache_loc)`.
    pub slots: u64,
    /// The largest slot the table's dtype holds.
    pub slot_max: i64,
    /// Consecutive requests per unit of the check cube: `ceil(bs / CUBE_SIZE)`.
    pub unit_requests: u64,
    /// Units of the write launch (its grid-stride step).
    pub units: u64,
    // Element strides, as launch scalars (see the crate docs).
    /// Row stride of `req_to_token`.
    pub table_row_stride: u64,
    /// Column stride of `req_to_token`.
    pub table_col_stride: u64,
    /// Stride of `req_pool_indices`.
    pub index_stride: u64,
    /// Stride of `start`.
    pub start_stride: u64,
    /// Stride of `lengths`.
    pub lengths_stride: u64,
    /// Stride of `out_cache_loc`.
    pub loc_stride: u64,
}

/// One request's run.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Run {
    row: i64,
    start: i64,
    length: i64,
}

#[cube]
fn load_run<Q: Int, S: Int, L: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    i: u64,
    shape: AssignShape,
) -> Run {
    Run {
        row: i64::cast_from(req_pool_indices[i as usize * shape.index_stride as usize]),
        start: i64::cast_from(start[i as usize * shape.start_stride as usize]),
        length: i64::cast_from(lengths[i as usize * shape.lengths_stride as usize]),
    }
}

/// The smallest key of rules 1-4 that request `i` fails, or [`NO_ERROR`]. (Pure expressions:
/// see the note on mutable locals in `scan`.)
#[cube]
fn run_key(run: Run, i: u64, shape: AssignShape) -> u64 {
    let cols = shape.cols as i64;
    let length = select(run.length > 0, run.length, 0i64);
    let row_fails = run.row < 0 || run.row as u64 >= shape.rows;
    let padding_fails = run.row == 0 && run.length != 0;
    // `start + length <= cols` rearranged so that a start near i64::MAX cannot overflow.
    let position_fails = run.start < 0 || run.start > cols - length;
    let position = select(position_fails, KEY_POSITION | i, NO_ERROR);
    let negative = select(run.length < 0, KEY_NEGATIVE | i, position);
    let padding = select(padding_fails, KEY_PADDING | i, negative);
    select(row_fails, KEY_ROW | i, padding)
}

/// A run's length for the offsets: negative as 0, and at most `cols` (a longer one fails rule 4,
/// which is reported before the offsets matter), so that no sum overflows.
#[cube]
fn counted_length(run: Run, shape: AssignShape) -> u64 {
    let length = select(run.length > 0, run.length as u64, 0u64);
    select(length > shape.cols, shape.cols, length)
}

/// `segment_assign`'s check, in one cube: every rule, the runs' offsets (`offsets[i]` where
/// request `i`'s slots start in `out_cache_loc`, `offsets[bs]` their sum) and the status record.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn assign_check_kernel<Q: Int, S: Int, L: Int, C: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    out_cache_loc: &Tensor<C>,
    offsets: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    shape: AssignShape,
    #[comptime] planes: bool,
    #[define(Q, S, L, C)] _dtypes: [ElemType; 4],
) {
    // One shared array per purpose (see the note on broadcast slots in `scan`).
    let mut scan = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut rule_keys = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut conflict_keys = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut tile_rows = Shared::<[i64]>::new_slice(CUBE_SIZE as usize);
    let mut tile_starts = Shared::<[i64]>::new_slice(CUBE_SIZE as usize);
    let mut tile_ends = Shared::<[i64]>::new_slice(CUBE_SIZE as usize);
    let unit = UNIT_POS as u64;
    let first = unit * shape.unit_requests;
    let end = (first + shape.unit_requests).min(shape.requests);

    // Rules 1-4 on the unit's requests, and the sum of their lengths.
    let mut key = NO_ERROR.runtime();
    let mut sum = 0u64.runtime();
    let mut i = first;
    while i < end {
        let run = load_run(req_pool_indices, start, lengths, i, shape);
        key = key.min(run_key(run, i, shape));
        sum += counted_length(run, shape);
        i += 1;
    }
    let (before, total) = cube_exclusive_scan(sum, &mut scan, planes);
    let mut offset = before;
    let mut i = first;
    while i < end {
        offsets[i as usize] = offset as i64;
        offset += counted_length(load_run(req_pool_indices, start, lengths, i, shape), shape);
        i += 1;
    }
    if unit == 0 {
        offsets[shape.requests as usize] = total as i64;
        if total != shape.slots {
            key = key.min(KEY_COUNT);
        }
    }
    // Rule 6 on every slot.
    let mut k = unit;
    while k < shape.slots {
        let slot = i64::cast_from(out_cache_loc[k as usize * shape.loc_stride as usize]);
        if slot < 0 || slot > shape.slot_max {
            key = key.min(KEY_SLOT | k);
        }
        k += CUBE_SIZE as u64;
    }
    let first_key = cube_min(key, &mut rule_keys);

    // Rule 7, once everything else holds: each unit's request against every earlier one, a tile
    // of 256 runs at a time (an empty run is staged on row -1, which no run names).
    let mut conflict = NO_ERROR.runtime();
    if first_key == NO_ERROR && shape.requests > 1 {
        let tiles = shape.requests.div_ceil(CUBE_SIZE as u64);
        let mut ti = 0u64.runtime();
        while ti < tiles {
            let i = ti * CUBE_SIZE as u64 + unit;
            let mine = staged_run(req_pool_indices, start, lengths, i, shape);
            let mut found = false.runtime();
            let mut tj = 0u64.runtime();
            while tj <= ti {
                let theirs = staged_run(
                    req_pool_indices,
                    start,
                    lengths,
                    tj * CUBE_SIZE as u64 + unit,
                    shape,
                );
                tile_rows[UNIT_POS as usize] = theirs.row;
                tile_starts[UNIT_POS as usize] = theirs.start;
                tile_ends[UNIT_POS as usize] = theirs.start + theirs.length;
                sync_cube();
                // Only the requests before `i`: the whole of an earlier tile, the units before
                // this one in its own.
                let earlier = select(tj == ti, unit, CUBE_SIZE as u64);
                let mine_end = mine.start + mine.length;
                let mut t = 0u64.runtime();
                while t < earlier && !found && mine.row >= 0 {
                    let at = t as usize;
                    if tile_rows[at] == mine.row
                        && mine.start < tile_ends[at]
                        && tile_starts[at] < mine_end
                    {
                        found = true;
                    }
                    t += 1;
                }
                sync_cube();
                tj += 1;
            }
            if found {
                conflict = conflict.min(KEY_CONFLICT | i);
            }
            ti += 1;
        }
    }
    let conflict = cube_min(conflict, &mut conflict_keys);
    if UNIT_POS == 0 {
        finish_assign(
            req_pool_indices,
            start,
            lengths,
            out_cache_loc,
            status,
            shape,
            first_key.min(conflict),
            total,
        );
    }
}

/// Request `i`'s run for the conflict rule: on row -1 (naming nothing) when it is past the batch
/// or empty.
#[cube]
fn staged_run<Q: Int, S: Int, L: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    i: u64,
    shape: AssignShape,
) -> Run {
    let inside = i < shape.requests;
    let run = load_run(
        req_pool_indices,
        start,
        lengths,
        select(inside, i, 0u64),
        shape,
    );
    Run {
        row: select(inside && run.length > 0, run.row, -1i64),
        start: run.start,
        length: run.length,
    }
}

/// The status record of a `segment_assign` whose smallest error key is `key`: the offender's
/// facts, read again from the inputs (an error path: a serial walk is fine).
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish_assign<Q: Int, S: Int, L: Int, C: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    out_cache_loc: &Tensor<C>,
    status: &mut Tensor<i64>,
    shape: AssignShape,
    key: u64,
    total: u64,
) {
    // Written as one pass of flat `if`s: deep `else if` chains were miscompiled by cubecl 0.10's
    // SPIR-V optimiser.
    let mut words = Array::<i64>::new(STATUS_LEN);
    #[unroll]
    for word in 0..STATUS_LEN {
        words[word] = 0;
    }
    let rule = key >> RULE_SHIFT;
    let index = key & INDEX_MASK;
    let failed = key != NO_ERROR;
    let request = select(failed && rule <= 4, index, 0u64);
    let run = load_run(req_pool_indices, start, lengths, request, shape);
    if !failed {
        words[COUNT] = shape.slots as i64;
    }
    if failed && rule == 1 {
        words[CODE] = GATHER_ROW;
        words[FACTS] = index as i64;
        words[FACTS + 1] = run.row;
        words[FACTS + 2] = shape.rows as i64;
    }
    if failed && rule == 2 {
        words[CODE] = ASSIGN_PADDING_ROW;
        words[FACTS] = index as i64;
        words[FACTS + 1] = run.length;
    }
    if failed && rule == 3 {
        words[CODE] = ASSIGN_NEGATIVE_LENGTH;
        words[FACTS] = index as i64;
        words[FACTS + 1] = run.length;
    }
    if failed && rule == 4 {
        // The run's first column outside the table.
        let cols = shape.cols as i64;
        let position = select(run.start < 0 || run.start > cols, run.start, cols);
        words[CODE] = GATHER_POSITION;
        words[FACTS] = index as i64;
        words[FACTS + 1] = position - run.start;
        words[FACTS + 2] = position;
        words[FACTS + 3] = cols;
    }
    if failed && rule == 5 {
        words[CODE] = ASSIGN_SLOT_COUNT;
        words[FACTS] = shape.slots as i64;
        words[FACTS + 1] = total as i64;
    }
    if failed && rule == 6 {
        // The request whose run holds slot `index`: the lengths are valid and sum to N now.
        let mut holder = 0u64.runtime();
        let mut holder_offset = 0u64.runtime();
        let mut offset = 0u64.runtime();
        let mut r = 0u64.runtime();
        while r < shape.requests {
            let length =
                counted_length(load_run(req_pool_indices, start, lengths, r, shape), shape);
            if offset <= index && index < offset + length {
                holder = r;
                holder_offset = offset;
            }
            offset += length;
            r += 1;
        }
        let holder_run = load_run(req_pool_indices, start, lengths, holder, shape);
        words[CODE] = ASSIGN_SLOT;
        words[FACTS] = holder as i64;
        words[FACTS + 1] = holder_run.start + (index - holder_offset) as i64;
        words[FACTS + 2] = index as i64;
        words[FACTS + 3] =
            i64::cast_from(out_cache_loc[index as usize * shape.loc_stride as usize]);
        words[FACTS + 4] = shape.slot_max;
    }
    if failed && rule == 7 {
        // The first earlier request that request `index` overlaps, and their first shared column.
        let mine = load_run(req_pool_indices, start, lengths, index, shape);
        let mine_end = mine.start + mine.length;
        let mut other = index;
        let mut j = 0u64.runtime();
        while j < index {
            let theirs = staged_run(req_pool_indices, start, lengths, j, shape);
            if other == index
                && theirs.row == mine.row
                && mine.start < theirs.start + theirs.length
                && theirs.start < mine_end
            {
                other = j;
            }
            j += 1;
        }
        let theirs = load_run(req_pool_indices, start, lengths, other, shape);
        words[CODE] = ASSIGN_CONFLICT;
        words[FACTS] = index as i64;
        words[FACTS + 1] = other as i64;
        words[FACTS + 2] = mine.row;
        words[FACTS + 3] = select(mine.start > theirs.start, mine.start, theirs.start);
    }
    #[unroll]
    for word in 0..STATUS_LEN {
        status[word] = words[word];
    }
}

/// `segment_assign`'s write, when its check's status is clear: slot `k` goes to its request's
/// row, at `start + k - offsets[request]` (the request bisected from the offsets).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn assign_write_kernel<T: Int, Q: Int, S: Int, C: Int>(
    table: &mut Tensor<T>,
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    out_cache_loc: &Tensor<C>,
    offsets: &Tensor<i64>,
    status: &Tensor<i64>,
    shape: AssignShape,
    #[define(T, Q, S, C)] _dtypes: [ElemType; 4],
) {
    if status[CODE] == OK {
        let mut k = ABSOLUTE_POS as u64;
        while k < shape.slots {
            // The last request whose slots start at or before `k` (empty runs share an offset
            // with the next one, which holds `k`).
            let mut low = 0u64.runtime();
            let mut high = shape.requests - 1;
            while low < high {
                let mid = (low + high).div_ceil(2u64);
                if offsets[mid as usize] <= k as i64 {
                    low = mid;
                } else {
                    high = mid - 1;
                }
            }
            let row = i64::cast_from(req_pool_indices[low as usize * shape.index_stride as usize]);
            let first = i64::cast_from(start[low as usize * shape.start_stride as usize]);
            let column = first + (k as i64 - offsets[low as usize]);
            let at = row as u64 * shape.table_row_stride + column as u64 * shape.table_col_stride;
            table[at as usize] =
                T::cast_from(out_cache_loc[k as usize * shape.loc_stride as usize]);
            k += shape.units;
        }
    }
}

/// `store_kv` control words (one per store, left clean by every call): the smallest token whose
/// slot is outside the cache.
pub const STORE_RANGE: usize = 0;
/// The smallest token whose slot an earlier token claimed.
pub const STORE_DUPLICATES: usize = 1;
/// 1 + the last token naming slot 0 (0: none).
pub const STORE_ZERO: usize = 2;
/// Cubes done.
pub const STORE_DONE: usize = 3;
/// Clock values claimed so far (a call's first is one above; never left clean: it only grows).
pub const STORE_CLOCK: usize = 4;
/// Control words of a store.
pub const STORE_CONTROL_LEN: usize = 5;

/// The control words of a fresh store; every call leaves them this way again.
pub fn fresh_store_control() -> Vec<u64> {
    let mut words = vec![0u64; STORE_CONTROL_LEN];
    words[STORE_RANGE] = NO_ERROR;
    words[STORE_DUPLICATES] = NO_ERROR;
    words
}

/// Clock values stay below this (the top bit of a slot word stays clear, see
/// [`publish_block_done()`]'s dependency words); a store reaching it starts again from zeroed words.
pub const STORE_CLOCK_LIMIT: u64 = 1 << 31;

/// Scalars of one `store_kv` check.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct StoreShape {
    /// Tokens `N`.
    pub tokens: u64,
    /// Slots `S` of the cache.
    pub slots: u64,
    /// Cubes of the launch (at least `ceil(N / CUBE_SIZE)`: a unit per token).
    pub cubes: u64,
    /// Stride of `loc`.
    pub loc_stride: u64,
}

/// `store_kv`'s check, a unit per token: every slot inside the cache, no slot but 0 claimed
/// twice; the last cube writes the status and cleans the control words. (No grid-stride loop:
/// lavapipe was seen to lose the code after a loop holding an atomic.)
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn store_check_kernel<C: Int>(
    loc: &Tensor<C>,
    slot_words: &Tensor<Atomic<u32>>,
    control: &Tensor<Atomic<u64>>,
    status: &mut Tensor<i64>,
    shape: StoreShape,
    #[define(C)] _dtype: ElemType,
) {
    let mut broadcast = Shared::<[u64]>::new_slice(SLOTS);
    // Read by every unit before any cube publishes its end: the last cube advances it after.
    let base = control[STORE_CLOCK].load() + 1;
    let newest = base + shape.tokens - 1;
    let i = ABSOLUTE_POS as u64;
    let mut dependency = 0u64.runtime();
    let mut reported = false.runtime();
    if i < shape.tokens {
        let slot = i64::cast_from(loc[i as usize * shape.loc_stride as usize]);
        let inside = slot >= 0 && (slot as u64) < shape.slots;
        if !inside {
            dependency |= report_error(&control[STORE_RANGE], i) >> 63;
            reported = true;
        }
        if slot == 0 {
            dependency |= control[STORE_ZERO].fetch_max(i + 1) >> 63;
        }
        if inside && slot != 0 {
            let claim = newest - i;
            let old = u64::cast_from(slot_words[slot as usize].fetch_max(u32::cast_from(claim)));
            dependency |= old >> 31;
            // Claimed earlier in this call: by an earlier token (this one is a second), or by a
            // later one, which the old value names (that one is a second).
            if old >= base {
                let second = select(old > claim, i, newest - old);
                dependency |= report_error(&control[STORE_DUPLICATES], second) >> 63;
                reported = true;
            }
        }
    }
    let (last, any_reported) = publish_block_done(
        &control[STORE_DONE],
        shape.cubes,
        dependency,
        reported,
        &mut broadcast,
    );
    if last && UNIT_POS == 0 {
        finish_store(loc, slot_words, control, status, shape, base, any_reported);
    }
}

/// The last cube of a store check: the status, and the control words left clean.
#[cube]
fn finish_store<C: Int>(
    loc: &Tensor<C>,
    slot_words: &Tensor<Atomic<u32>>,
    control: &Tensor<Atomic<u64>>,
    status: &mut Tensor<i64>,
    shape: StoreShape,
    base: u64,
    any_reported: bool,
) {
    // Swaps, not stores: cubecl 0.10 on SPIR-V was seen to drop the second of two atomic stores.
    let zero = control[STORE_ZERO].exchange(0u64.runtime());
    control[STORE_CLOCK].exchange(base + shape.tokens - 1);
    let mut range = NO_ERROR.runtime();
    let mut second = NO_ERROR.runtime();
    if any_reported {
        range = control[STORE_RANGE].exchange(NO_ERROR.runtime());
        second = control[STORE_DUPLICATES].exchange(NO_ERROR.runtime());
    }
    if shape.cubes > 1 {
        control[STORE_DONE].exchange(0u64.runtime());
    }
    let outside = range != NO_ERROR;
    let duplicate = !outside && second != NO_ERROR;
    let mut words = Array::<i64>::new(STATUS_LEN);
    #[unroll]
    for word in 0..STATUS_LEN {
        words[word] = 0;
    }
    if outside {
        words[CODE] = STORE_LOC;
        words[FACTS] = range as i64;
        words[FACTS + 1] = i64::cast_from(loc[range as usize * shape.loc_stride as usize]);
        words[FACTS + 2] = shape.slots as i64;
    }
    if duplicate {
        // The slot's word names its first token now.
        let slot = i64::cast_from(loc[second as usize * shape.loc_stride as usize]);
        let newest = base + shape.tokens - 1;
        words[CODE] = STORE_DUPLICATE;
        words[FACTS] = second as i64;
        words[FACTS + 1] = (newest - u64::cast_from(slot_words[slot as usize].load())) as i64;
        words[FACTS + 2] = slot;
    }
    if !outside && !duplicate {
        words[COUNT] = shape.tokens as i64;
        words[FACTS] = zero as i64;
        words[FACTS + 1] = base as i64;
    }
    #[unroll]
    for word in 0..STATUS_LEN {
        status[word] = words[word];
    }
}

/// Scalars of one `store_kv` write, in vectors of the launch's word type.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct StoreRowsShape {
    /// Tokens `N`.
    pub tokens: u64,
    /// Vectors per row.
    pub row_vectors: u64,
    /// Row stride of the cache, in vectors.
    pub cache_row_stride: u64,
    /// Row stride of `values`, in vectors.
    pub values_row_stride: u64,
    /// Stride of `loc`.
    pub loc_stride: u64,
    /// Units of the launch (its grid-stride step).
    pub units: u64,
}

/// `store_kv`'s write, when its check's status is clear: `cache[loc[i]] = values[i]`, a vector of
/// words at a time (the rows' bytes, whatever their dtype). Of the tokens naming slot 0 only the
/// last one writes, as in the reference.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn store_write_kernel<W: Int, N: Size, C: Int>(
    cache: &mut Tensor<Vector<W, N>>,
    values: &Tensor<Vector<W, N>>,
    loc: &Tensor<C>,
    status: &Tensor<i64>,
    shape: StoreRowsShape,
    #[define(W, C)] _dtypes: [ElemType; 2],
) {
    if status[CODE] == OK {
        let zero_owner = status[FACTS] - 1;
        let vectors = shape.tokens * shape.row_vectors;
        let mut e = ABSOLUTE_POS as u64;
        while e < vectors {
            write_vector(cache, values, loc, shape, zero_owner, e);
            e += shape.units;
        }
    }
}

/// [`store_write_kernel()`] into two caches at once (a layer's K and V): the first
/// `tokens * row_vectors` vectors go to the first cache, the rest to the second.
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn store_pair_write_kernel<W: Int, N: Size, C: Int>(
    first_cache: &mut Tensor<Vector<W, N>>,
    first_values: &Tensor<Vector<W, N>>,
    second_cache: &mut Tensor<Vector<W, N>>,
    second_values: &Tensor<Vector<W, N>>,
    loc: &Tensor<C>,
    status: &Tensor<i64>,
    first: StoreRowsShape,
    second: StoreRowsShape,
    #[define(W, C)] _dtypes: [ElemType; 2],
) {
    if status[CODE] == OK {
        let zero_owner = status[FACTS] - 1;
        let first_vectors = first.tokens * first.row_vectors;
        let vectors = first_vectors + second.tokens * second.row_vectors;
        let mut e = ABSOLUTE_POS as u64;
        while e < vectors {
            if e < first_vectors {
                write_vector(first_cache, first_values, loc, first, zero_owner, e);
            } else {
                let e = e - first_vectors;
                write_vector(second_cache, second_values, loc, second, zero_owner, e);
            }
            e += first.units;
        }
    }
}

/// Vector `e` of a store's rows: row `e / row_vectors` of `values` into the cache row its slot
/// names (a token on slot 0 only when it is the slot's last token, `zero_owner`).
#[cube]
fn write_vector<W: Int, N: Size, C: Int>(
    cache: &mut Tensor<Vector<W, N>>,
    values: &Tensor<Vector<W, N>>,
    loc: &Tensor<C>,
    shape: StoreRowsShape,
    zero_owner: i64,
    e: u64,
) {
    let i = e / shape.row_vectors;
    let d = e % shape.row_vectors;
    let slot = i64::cast_from(loc[i as usize * shape.loc_stride as usize]);
    if slot != 0 || i as i64 == zero_owner {
        cache[(slot as u64 * shape.cache_row_stride + d) as usize] =
            values[(i * shape.values_row_stride + d) as usize];
    }
}
