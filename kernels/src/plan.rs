//! The kv-canary plan (spec `canary-plan.md`): two launches, no host round trip, no batch cap.
//!
//! The requests launch (one cube) scans verify and write lengths, checks the request-level rules
//! 12, 13, 15 and 16, and stores the write offsets, seeds and per-request verify offsets. The entries launch runs a grid-stride
//! loop over every verify entry (all of them, even on overflow: rule 14 covers them), writes the
//! entries when they fit, zeroes `write_offsets` past `bs`, and its last cube writes the scalars
//! and the status record. The kernel boundary orders the two launches (CubeCL 0.10 has no
//! device-wide fence); window, LUT and pool are compile-time switches.

use cubecl::prelude::*;

use crate::gather::clear_status;
use crate::scan::{
    CUBE_SIZE, NO_ERROR, SLOT_DEPENDENCY, SLOTS, cube_exclusive_scan, find_row, publish_block_done,
    report_error,
};
use crate::status::{
    CODE, FACTS, PLAN_POOL_POSITION, PLAN_POOL_ROW, PLAN_POSITION, PLAN_ROW, PLAN_SWA_SLOT,
    PLAN_WRITE_OFFSETS_OVERFLOW,
};

/// Scratch: ticket counter of the requests launch.
pub const PLAN_TICKETS: usize = 0;
/// Set when some extend length exceeds [`EXACT_EXTEND`]: the write offsets are then redone
/// sequentially (exactly, with the i64 overflow rule 17) by the last cube.
pub const PLAN_SLOW_WRITE: usize = 1;
/// Cubes of the entries launch done.
pub const PLAN_DONE: usize = 2;
/// First error key: rules 12..=16 follow in order.
pub const PLAN_ERRORS: usize = 4;
/// Total verify entries (written by the requests launch).
pub const PLAN_TOTAL: usize = 3;
/// Scratch words.
pub const PLAN_SCRATCH: usize = 12;

/// The scratch of a fresh plan; every call leaves it this way again, except the done counter,
/// which only grows (the last cube is the one that brings it to a multiple of the grid).
pub fn fresh_scratch() -> [u64; PLAN_SCRATCH] {
    let mut words = [0u64; PLAN_SCRATCH];
    let mut rule = 0;
    while rule < 5 {
        words[PLAN_ERRORS + rule] = NO_ERROR;
        rule += 1;
    }
    words
}

/// Column bits of a rule-14 key (`r << 32 | column`).
const COLUMN_MASK: u64 = (1 << 32) - 1;

/// "No slot / no token / not found".
const NONE: i64 = -1;

/// Largest extend length the scanned write offsets take exactly: 2^31 requests of at most 2^30
/// tokens stay below the 2^62 of a tile state.
pub const EXACT_EXTEND: u64 = 1 << 30;

/// Scalars of one plan step.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct PlanShape {
    /// `bs`.
    pub requests: u64,
    /// Rows of `req_to_token`.
    pub rows: u64,
    /// Columns of `req_to_token`.
    pub cols: u64,
    /// `W`.
    pub window: i64,
    /// LUT length.
    pub lut_len: u64,
    /// Pool rows.
    pub pool_rows: u64,
    /// Pool columns.
    pub pool_cols: u64,
    /// `kv_token_id_vs_position_offset`.
    pub position_offset: i64,
    /// `V`.
    pub verify_capacity: u64,
    /// `K`.
    pub write_capacity: u64,
    /// Cubes of the entries launch.
    pub cubes: u64,
}

/// Compile-time switches: the common path carries no dead branches.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct PlanFeatures {
    /// `W > 0`.
    pub window: bool,
    /// A LUT is given.
    pub lut: bool,
    /// An expected-token pool is given.
    pub pool: bool,
}

/// One request's view of the step.
#[derive(CubeType, Clone, Copy)]
struct Request {
    row: i64,
    prefix: i64,
    extend: i64,
    window_start: i64,
}

#[cube]
fn load_request<Q: Int, P: Int, E: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    r: u64,
    window: i64,
    #[comptime] windowed: bool,
) -> Request {
    let row = i64::cast_from(req_pool_indices[r as usize * req_pool_indices.stride(0)]);
    let prefix = i64::cast_from(prefix_lens[r as usize * prefix_lens.stride(0)]);
    let extend = i64::cast_from(extend_seq_lens[r as usize * extend_seq_lens.stride(0)]);
    let mut window_start = 0i64;
    if windowed {
        // Compare first, so `prefix - window` cannot overflow.
        if prefix > window {
            window_start = prefix - window;
        }
    }
    Request {
        row,
        prefix,
        extend,
        window_start,
    }
}

/// A live request reads the table; only live requests are checked.
#[cube]
fn is_live(request: Request) -> bool {
    request.row != 0 && request.prefix > 0
}

/// Rules 12 and 13 pass: the table may be read at `[row][0..prefix)`.
#[cube]
fn in_table(request: Request, rows: u64, cols: u64) -> bool {
    request.row > 0 && (request.row as u64) < rows && (request.prefix as u64) <= cols
}

/// The largest pool column read by `request`, or -1 when it reads none.
#[cube]
fn last_pool_column(request: Request, position_offset: i64, valid_len: i64) -> i64 {
    let first = request.window_start + position_offset;
    let low = select(first > 0, first, 0i64);
    let last = request.prefix - 1 + position_offset;
    // `valid_len - 1` only for a positive `valid_len`: nothing is read otherwise.
    let limit = select(valid_len > 0, valid_len - 1, -1i64);
    let high = select(last < limit, last, limit);
    select(valid_len > 0 && low <= high, high, -1i64)
}

/// `x < 0`, from the sign bit: cubecl 0.10 on SPIR-V was seen to get `x < 0` wrong for i64.
#[cube]
pub fn is_negative(x: i64) -> bool {
    (x as u64) >> 63 == 1u64
}

/// A slot the LUT can translate: negative (passes through) or below `lut_len`.
#[cube]
fn slot_in_lut(slot: i64, lut_len: u64) -> bool {
    // Signed comparisons only: a negative slot is never cast to u64.
    let limit = lut_len as i64;
    slot < limit
}

/// `xlat(s)`: LUT translation, negative slots pass through. Callers check `s < lut_len`.
#[cube]
fn translate<U: Int>(lut: &Tensor<U>, slot: i64, #[comptime] has_lut: bool) -> i64 {
    let mut translated = slot;
    if has_lut {
        // Index 0 stands in for a negative slot, which passes through untranslated. Blended
        // arithmetically from the sign bit: `select` on this path was seen to pick wrongly.
        let negative = ((slot as u64) >> 63) as i64;
        let index = slot * (1 - negative);
        let looked_up = i64::cast_from(lut[index as usize * lut.stride(0)]);
        translated = looked_up * (1 - negative) + slot * negative;
    }
    translated
}

#[cube]
fn table_at<T: Int>(table: &Tensor<T>, row: i64, col: i64) -> i64 {
    i64::cast_from(table[row as usize * table.stride(0) + col as usize * table.stride(1)])
}

/// Requests launch: one cube. Unit `u` owns the contiguous requests
/// `[u * per_unit, (u + 1) * per_unit)`: it sums their verify and write lengths, one cube scan turns
/// the 256 sums into prefixes, and a second pass over the same requests checks them and stores
/// their offsets and seeds. No loop holds a barrier or an atomic, and no cube waits on another:
/// lavapipe (CI's device) was seen to mis-run all three.
#[cube(launch_unchecked)]
pub fn plan_requests_kernel<Q: Int, P: Int, E: Int, T: Int, U: Int, V: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    table: &Tensor<T>,
    lut: &Tensor<U>,
    valid_lens: &Tensor<V>,
    write_offsets: &mut Tensor<i64>,
    seeds: &mut Tensor<i64>,
    verify_offsets: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: PlanShape,
    #[comptime] features: PlanFeatures,
    #[define(Q, P, E, T, U, V)] _dtypes: [StorageType; 6],
) {
    let mut verify_shared = SharedMemory::<u64>::new(CUBE_SIZE as usize);
    let mut write_shared = SharedMemory::<u64>::new(CUBE_SIZE as usize);
    let per_unit = (shape.requests + CUBE_SIZE as u64 - 1) / CUBE_SIZE as u64;
    let first = select(
        UNIT_POS as u64 * per_unit < shape.requests,
        UNIT_POS as u64 * per_unit,
        shape.requests,
    );
    let end = select(
        first + per_unit < shape.requests,
        first + per_unit,
        shape.requests,
    );

    let mut verify_sum = 0u64;
    let mut write_sum = 0u64;
    let mut r = first;
    while r < end {
        let request = load_request(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            r,
            shape.window,
            features.window,
        );
        verify_sum += verify_length(request);
        write_sum += write_length(request);
        r += 1;
    }
    let (verify_rank, verify_total) = cube_exclusive_scan(verify_sum, &mut verify_shared);
    let (write_rank, write_total) = cube_exclusive_scan(write_sum, &mut write_shared);

    // Each unit meets its requests in order, so its first offender per rule is its smallest.
    let mut row_error = NO_ERROR.runtime();
    let mut position_error = NO_ERROR.runtime();
    let mut pool_row_error = NO_ERROR.runtime();
    let mut pool_position_error = NO_ERROR.runtime();
    let mut slow_write = false.runtime();
    let mut verify_offset = verify_rank;
    let mut write_offset = write_rank;
    let mut r = first;
    while r < end {
        let request = load_request(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            r,
            shape.window,
            features.window,
        );
        if request.row != 0 && request.extend > 0 && request.extend as u64 > EXACT_EXTEND {
            slow_write = true;
        }
        if is_live(request) {
            if (request.row < 0 || request.row as u64 >= shape.rows) && row_error == NO_ERROR {
                row_error = r;
            }
            if request.prefix as u64 > shape.cols && position_error == NO_ERROR {
                position_error = r;
            }
            if features.pool {
                let valid_len = i64::cast_from(valid_lens[r as usize * valid_lens.stride(0)]);
                let column = last_pool_column(request, shape.position_offset, valid_len);
                if column >= 0 {
                    if request.row as u64 >= shape.pool_rows && pool_row_error == NO_ERROR {
                        pool_row_error = r;
                    }
                    if column as u64 >= shape.pool_cols && pool_position_error == NO_ERROR {
                        pool_position_error = r;
                    }
                }
            }
        }
        seeds[r as usize] = seed_of(request, table, lut, shape, features);
        verify_offsets[r as usize] = verify_offset as i64;
        write_offsets[r as usize] = write_offset as i64;
        verify_offset += verify_length(request);
        write_offset += write_length(request);
        r += 1;
    }
    if UNIT_POS == 0 {
        write_offsets[shape.requests as usize] = write_total as i64;
        scratch[PLAN_TOTAL].store(verify_total);
    }
    if slow_write {
        scratch[PLAN_SLOW_WRITE].store(1u64);
    }
    if row_error != NO_ERROR {
        report_error(&scratch[PLAN_ERRORS], row_error);
    }
    if position_error != NO_ERROR {
        report_error(&scratch[PLAN_ERRORS + 1], position_error);
    }
    if pool_row_error != NO_ERROR {
        report_error(&scratch[PLAN_ERRORS + 3], pool_row_error);
    }
    if pool_position_error != NO_ERROR {
        report_error(&scratch[PLAN_ERRORS + 4], pool_position_error);
    }
}

/// `vlen`: verify entries of a request.
#[cube]
fn verify_length(request: Request) -> u64 {
    let length = request.prefix - request.window_start;
    select(request.row != 0 && length > 0, length as u64, 0u64)
}

/// `wlen`, capped at [`EXACT_EXTEND`] for the scan (the slow path redoes larger ones exactly).
#[cube]
fn write_length(request: Request) -> u64 {
    let length = select(
        request.row != 0 && request.extend > 0,
        request.extend as u64,
        0u64,
    );
    select(length > EXACT_EXTEND, EXACT_EXTEND, length)
}

/// The chain seed: the slot of the last prefix token, or -1. Rule 14 on it is the entries
/// launch's; an untranslatable or unreadable seed is left at -1 (the plan is disabled then).
#[cube]
fn seed_of<T: Int, U: Int>(
    request: Request,
    table: &Tensor<T>,
    lut: &Tensor<U>,
    shape: PlanShape,
    #[comptime] features: PlanFeatures,
) -> i64 {
    let mut seed = NONE.runtime();
    if request.row != 0
        && request.extend > 0
        && request.prefix > 0
        && in_table(request, shape.rows, shape.cols)
    {
        let slot = table_at(table, request.row, request.prefix - 1);
        if features.lut {
            if slot_in_lut(slot, shape.lut_len) {
                seed = translate(lut, slot, features.lut);
            }
        } else {
            seed = slot;
        }
    }
    seed
}

/// Entries launch: every verify entry, the zeroed write offsets past `bs`, then the last cube's
/// scalars and status.
#[cube(launch_unchecked)]
pub fn plan_entries_kernel<Q: Int, P: Int, E: Int, T: Int, U: Int, O: Int, V: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    table: &Tensor<T>,
    lut: &Tensor<U>,
    pool: &Tensor<O>,
    valid_lens: &Tensor<V>,
    verify_offsets: &Tensor<i64>,
    slot_indices: &mut Tensor<i64>,
    expected_tokens: &mut Tensor<i64>,
    expected_positions: &mut Tensor<i64>,
    prev_slot_indices: &mut Tensor<i64>,
    num_valid: &mut Tensor<i32>,
    enable: &mut Tensor<i32>,
    write_offsets: &mut Tensor<i64>,
    num_valid_reqs: &mut Tensor<i32>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: PlanShape,
    #[comptime] features: PlanFeatures,
    #[define(Q, P, E, T, U, O, V)] _dtypes: [StorageType; 7],
) {
    let mut broadcast = SharedMemory::<u64>::new(SLOTS);
    if UNIT_POS == 0 {
        broadcast[SLOT_DEPENDENCY] = 0;
    }
    sync_cube();
    let total = scratch[PLAN_TOTAL].load();
    let fits = total <= shape.verify_capacity;
    let stride = (CUBE_COUNT * CUBE_SIZE as usize) as u64;

    // Write offsets past `bs` are zeroed.
    let mut w = shape.requests + 1 + ABSOLUTE_POS as u64;
    while w <= shape.write_capacity {
        write_offsets[w as usize] = 0;
        w += stride;
    }

    // Rule-14 offenders are kept per unit and reported once after the loop: lavapipe was seen to
    // lose the code after a loop that contains an atomic.
    let mut lut_key = NO_ERROR.runtime();
    let mut k = ABSOLUTE_POS as u64;
    while k < total {
        let r = find_row(verify_offsets, shape.requests, k);
        let request = load_request(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            r,
            shape.window,
            features.window,
        );
        if in_table(request, shape.rows, shape.cols) {
            let position = request.window_start + (k - verify_offsets[r as usize] as u64) as i64;
            let raw = table_at(table, request.row, position);
            // Column 0 stands in for the predecessor of position 0, which is never used.
            let prev_column = select(position > 0i64.runtime(), position - 1, 0i64.runtime());
            let raw_prev = table_at(table, request.row, prev_column);
            // Rule 14 on every slot read, the window head's predecessor included. Without a LUT
            // the host passes `lut_len = i64::MAX`, so every slot is inside. (Pure expressions:
            // see the note on mutable locals in `scan`.)
            let slot_ok = slot_in_lut(raw, shape.lut_len);
            let prev_ok = position == 0i64.runtime() || slot_in_lut(raw_prev, shape.lut_len);
            let slot_key = select(slot_ok, NO_ERROR, (r << 32) | position as u64);
            let prev_key = select(prev_ok, NO_ERROR, (r << 32) | prev_column as u64);
            let entry_key = select(slot_key < prev_key, slot_key, prev_key);
            lut_key = select(entry_key < lut_key, entry_key, lut_key);
            if fits && slot_ok && prev_ok {
                let mut token = NONE.runtime();
                if features.pool {
                    let valid_len = i64::cast_from(valid_lens[r as usize * valid_lens.stride(0)]);
                    let column = position + shape.position_offset;
                    let last = last_pool_column(request, shape.position_offset, valid_len);
                    let pool_ok =
                        (request.row as u64) < shape.pool_rows && last < shape.pool_cols as i64;
                    if pool_ok && column >= 0 && column < valid_len {
                        token = i64::cast_from(
                            pool[request.row as usize * pool.stride(0)
                                + column as usize * pool.stride(1)],
                        );
                    }
                }
                let prev = select(
                    position > 0i64.runtime(),
                    translate(lut, raw_prev, features.lut),
                    NONE.runtime(),
                );
                slot_indices[k as usize] = translate(lut, raw, features.lut);
                expected_tokens[k as usize] = token;
                expected_positions[k as usize] = position;
                prev_slot_indices[k as usize] = prev;
            }
        }
        k += stride;
    }

    if lut_key != NO_ERROR {
        let old = report_error(&scratch[PLAN_ERRORS + 2], lut_key);
        keep_dependency(old, &mut broadcast);
    }
    sync_cube();
    let dependency = broadcast[SLOT_DEPENDENCY];
    let last = publish_block_done(&scratch[PLAN_DONE], shape.cubes, dependency, &mut broadcast);
    if last && UNIT_POS == 0 {
        let total = scratch[PLAN_TOTAL].load();
        finish_plan(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            table,
            valid_lens,
            write_offsets,
            num_valid,
            enable,
            num_valid_reqs,
            status,
            scratch,
            shape,
            total,
            features,
        );
    }
}

/// [`publish_block_done`] for a counter that is never reset: each call adds exactly `cubes`, so

/// Keeps `old >> 63` (always 0) of an error report in the cube's dependency slot.
#[cube]
fn keep_dependency(old: u64, broadcast: &mut SharedMemory<u64>) {
    let bit = old >> 63;
    if bit != 0 {
        broadcast[SLOT_DEPENDENCY] = bit;
    }
}

/// The last cube: the first failing rule in order (then the smallest request, then column), the
/// scalars, and on the slow write path the exact write offsets.
#[cube]
fn finish_plan<Q: Int, P: Int, E: Int, T: Int, V: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    table: &Tensor<T>,
    valid_lens: &Tensor<V>,
    write_offsets: &mut Tensor<i64>,
    num_valid: &mut Tensor<i32>,
    enable: &mut Tensor<i32>,
    num_valid_reqs: &mut Tensor<i32>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: PlanShape,
    total: u64,
    #[comptime] features: PlanFeatures,
) {
    clear_status(status);
    // Rule 17 and the exact offsets, only when some extend length was too large to scan.
    let mut overflow_at = NONE.runtime();
    if scratch[PLAN_SLOW_WRITE].swap(0u64.runtime()) != 0u64 {
        let mut sum = 0i64;
        let mut r = 0u64;
        while r < shape.requests {
            let request = load_request(
                req_pool_indices,
                prefix_lens,
                extend_seq_lens,
                r,
                shape.window,
                features.window,
            );
            write_offsets[r as usize] = sum;
            let mut length = 0i64;
            if request.row != 0 && request.extend > 0 {
                length = request.extend;
            }
            if overflow_at < 0 && sum > i64::MAX - length {
                overflow_at = r as i64;
            }
            sum += length;
            r += 1;
        }
        write_offsets[shape.requests as usize] = sum;
    }
    let mut code = 0i64;
    let mut key = NO_ERROR.runtime();
    #[unroll]
    for rule in 0..5u32 {
        // Read and reset: the scratch belongs to the plan and must be clean for the next call.
        let candidate = scratch[PLAN_ERRORS + rule as usize].swap(NO_ERROR.runtime());
        if code == 0 && candidate != NO_ERROR {
            code = PLAN_ROW + rule as i64;
            key = candidate;
        }
    }
    if code == 0 && overflow_at >= 0 {
        code = PLAN_WRITE_OFFSETS_OVERFLOW;
        key = overflow_at as u64;
    }
    // Rule 14 keys are `r << 32 | column`; the others are `r`.
    let r = select(code == PLAN_SWA_SLOT, key >> 32, key);
    status[CODE] = code;
    if code != 0 {
        let request = load_request(
            req_pool_indices,
            prefix_lens,
            extend_seq_lens,
            r,
            shape.window,
            features.window,
        );
        if code == PLAN_ROW {
            status[FACTS] = r as i64;
            status[FACTS + 1] = request.row;
            status[FACTS + 2] = shape.rows as i64;
        }
        if code == PLAN_POSITION {
            status[FACTS] = r as i64;
            status[FACTS + 1] = request.prefix;
            status[FACTS + 2] = shape.cols as i64;
        }
        if code == PLAN_SWA_SLOT {
            let column = (key & COLUMN_MASK) as i64;
            status[FACTS] = table_at(table, request.row, column);
            status[FACTS + 1] = shape.lut_len as i64;
            status[FACTS + 2] = r as i64;
            status[FACTS + 3] = column;
        }
        if code == PLAN_POOL_ROW {
            status[FACTS] = r as i64;
            status[FACTS + 1] = request.row;
            status[FACTS + 2] = shape.pool_rows as i64;
        }
        if code == PLAN_POOL_POSITION {
            let valid_len = i64::cast_from(valid_lens[r as usize * valid_lens.stride(0)]);
            status[FACTS] = r as i64;
            status[FACTS + 1] = last_pool_column(request, shape.position_offset, valid_len);
            status[FACTS + 2] = shape.pool_cols as i64;
            status[FACTS + 3] = valid_len;
        }
        if code == PLAN_WRITE_OFFSETS_OVERFLOW {
            status[FACTS] = r as i64;
        }
        // A device-checked error leaves the plan harmless downstream.
        enable[0] = 0;
        num_valid[0] = 0;
        num_valid_reqs[0] = 0;
    } else if total <= shape.verify_capacity {
        num_valid[0] = total as i32;
        enable[0] = 1;
        num_valid_reqs[0] = shape.requests as i32;
    } else {
        num_valid[0] = shape.verify_capacity as i32;
        enable[0] = 0;
        num_valid_reqs[0] = shape.requests as i32;
    }
}
