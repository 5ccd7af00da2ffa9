//! The kv-canary plan (spec `canary-plan.md`): one launch, no host round trip, no memset, no
//! batch cap.
//!
//! Requests are cut into tiles of up to [`CUBE_SIZE`] requests, and each tile is served by
//! `tile_cubes` cubes, enough to give each about [`CUBE_ENTRIES`] entries within what the device
//! holds at once. A short batch of long prefixes is then spread over the device, and the
//! look-back chains only `bs / 256` tiles. A batch of at most 256 requests is one tile and needs
//! no look-back at all.
//!
//! Each cube takes a ticket, scans its tile's verify and write lengths and chains the tile
//! prefixes across the grid with a decoupled look-back. The tile's lead cube checks the request
//! rules (12, 13, 15, 16) and stores the write offsets and seeds; every cube of the tile fills its
//! share of the tile's verify entries (rule 14 on every slot it reads). The last cube to finish
//! writes the scalars and the status, and leaves the scratch clean for the next call; a lone tile
//! without a LUT needs no last cube: its lead writes them before the fill
//! (`PlanFeatures::lead_finishes`). Window, LUT and pool are compile-time switches.
//!
//! On overflow (`total > V`) the spec forbids writing any entry. A lone tile knows its total
//! after the scan. With more tiles a cube only learns the total once every tile has been scanned:
//! when `bs * min(cols, W)` cannot exceed `V` (a capacity sized for the largest plan) no overflow
//! is possible and one launch suffices; otherwise a count launch first sums the verify lengths,
//! and the plan launch reads that total (`PlanFeatures::counted`).

use cubecl::prelude::*;

use crate::gather::clear_status;
use crate::scan::{
    CUBE_SIZE, NO_ERROR, SLOT_PREFIX, SLOT_SECOND_PREFIX, SLOTS, cube_exclusive_scan,
    cube_exclusive_scan_pair, cube_share, first_holding, launch_total, publish_block_done,
    report_error, start_of, step_to_holder, take_ticket, tile_prefix,
};
use crate::status::{
    CODE, FACTS, PLAN_POOL_POSITION, PLAN_POOL_ROW, PLAN_POSITION, PLAN_ROW, PLAN_SWA_SLOT,
    PLAN_WRITE_OFFSETS_OVERFLOW,
};

/// Scratch: tile tickets taken by this launch (reset by the last cube).
pub const PLAN_TICKETS: usize = 0;
/// Set when some extend length exceeds [`EXACT_EXTEND`]: the write offsets are then redone
/// sequentially (exactly, with the i64 overflow rule 17) by the last cube.
pub const PLAN_SLOW_WRITE: usize = 1;
/// Cubes done (reset by the last cube).
pub const PLAN_DONE: usize = 2;
/// Total verify entries, summed by the count launch (read and reset by the plan launch).
pub const PLAN_TOTAL: usize = 3;
/// First error key: rules 12..=16 follow in order.
pub const PLAN_ERRORS: usize = 4;
/// First tile state: `K` verify tile states, then `K` write tile states (a plan has at most `bs`
/// tiles, and `bs <= K`).
pub const PLAN_STATES: usize = 12;

/// Verify entries a cube fills at most by the host's bound: a tile's entries are spread over as
/// many cubes as this asks for (within what the device holds). On the H200, 512 was the best of
/// 256, 512 and 1024 over bs 8, 64 and 256 (benches/RESULTS.md, session 5).
pub const CUBE_ENTRIES: u64 = 512;

/// Scratch words of a plan with write capacity `K`.
pub fn scratch_len(write_capacity: usize) -> usize {
    PLAN_STATES + 2 * write_capacity
}

/// The scratch of a fresh plan; every call leaves it this way again.
pub fn fresh_scratch(write_capacity: usize) -> Vec<u64> {
    let mut words = vec![0u64; scratch_len(write_capacity)];
    for word in &mut words[PLAN_ERRORS..PLAN_ERRORS + 5] {
        *word = NO_ERROR;
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

/// Verify lengths are scanned capped here: a longer one overflows any `V <= 2^31 - 1` anyway, and
/// 2^31 requests of at most 2^31 entries stay below the 2^62 of a tile state.
const VERIFY_CAP: u64 = 1 << 31;

/// Scalars of one plan step.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
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
    /// Requests per tile (1..=256).
    pub tile_requests: u64,
    /// Tiles: `ceil(bs / tile_requests)`, at least 1.
    pub tiles: u64,
    /// Cubes per tile: each scans the whole tile and fills its share of the entries; the first
    /// (the tile's lead) also publishes the tile, checks its requests and stores their write
    /// offsets and seeds.
    pub tile_cubes: u64,
    /// Cubes of the launch (at least `tiles * tile_cubes`: a 2-D grid may round up; the extra
    /// cubes only zero write offsets).
    pub cubes: u64,
    // Element strides of the inputs, as launch scalars (see the crate docs).
    /// Stride of `req_pool_indices`.
    pub index_stride: u64,
    /// Stride of `prefix_lens`.
    pub prefix_stride: u64,
    /// Stride of `extend_seq_lens`.
    pub extend_stride: u64,
    /// Row stride of `req_to_token`.
    pub table_row_stride: u64,
    /// Column stride of `req_to_token`.
    pub table_col_stride: u64,
    /// Stride of the LUT.
    pub lut_stride: u64,
    /// Row stride of the expected-token pool.
    pub pool_row_stride: u64,
    /// Column stride of the expected-token pool.
    pub pool_col_stride: u64,
    /// Stride of `valid_lens`.
    pub valid_stride: u64,
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
    /// The verify total comes from the count launch: `bs * min(cols, W)` may exceed `V`.
    pub counted: bool,
    /// A lone tile without a LUT: only its lead cube can find an error (rule 14 needs a LUT), and
    /// every cube knows the total, so the lead writes the scalars and the status before the fill
    /// and no cube counts itself done.
    pub lead_finishes: bool,
    /// The runtime's planes are `PLANE_WIDTH` units wide: the tile is scanned by shuffles.
    pub planes: bool,
    /// Shared memory serves every unit what was written before a barrier, in every phase of the
    /// kernel (CUDA; lavapipe was seen to serve stale values to a later phase). Then unit 0 walks
    /// the look-back and broadcasts the prefix (see `scan::tile_prefix`), and the fill takes its
    /// holders from shared memory, where their units left them, instead of loading each request
    /// again.
    pub faithful_shared: bool,
}

/// One request's view of the step.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
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
    shape: PlanShape,
    #[comptime] windowed: bool,
) -> Request {
    let row = i64::cast_from(req_pool_indices[r as usize * shape.index_stride as usize]);
    let prefix = i64::cast_from(prefix_lens[r as usize * shape.prefix_stride as usize]);
    let extend = i64::cast_from(extend_seq_lens[r as usize * shape.extend_stride as usize]);
    let window = shape.window;
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

/// What the fill needs of the request holding an entry.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Holder {
    /// The table row, or 0 when rules 12 and 13 forbid reading the table (row 0 is never read).
    row: i64,
    /// The position of the request's first verify entry.
    window_start: i64,
    /// Pool columns below this one may be read (0 without a pool, or when rules 15 and 16 fail).
    pool_limit: i64,
}

/// A request's [`Holder`] (`r` indexes `valid_lens`).
#[cube]
fn holder_of<V: Int>(
    request: Request,
    valid_lens: &Tensor<V>,
    r: u64,
    shape: PlanShape,
    #[comptime] pool: bool,
) -> Holder {
    let mut row = request.row;
    if !in_table(request, shape.rows, shape.cols) {
        row = 0i64;
    }
    let mut pool_limit = 0i64.runtime();
    if pool {
        let valid_len = valid_len_of(valid_lens, r, shape);
        let last = last_pool_column(request, shape.position_offset, valid_len);
        if (request.row as u64) < shape.pool_rows && last < shape.pool_cols as i64 {
            pool_limit = valid_len;
        }
    }
    Holder {
        row,
        window_start: request.window_start,
        pool_limit,
    }
}

/// `valid_lens[r]`, widened.
#[cube]
fn valid_len_of<V: Int>(valid_lens: &Tensor<V>, r: u64, shape: PlanShape) -> i64 {
    i64::cast_from(valid_lens[r as usize * shape.valid_stride as usize])
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
///
/// The shifted bit is masked: cubecl 0.11's LLVM lowering (CUDA) drops the same-width cast and
/// shifts `x as u64` arithmetically (it takes the shift's signedness from the cast's input), so
/// the bare shift yields all ones, not 1, for a negative `x`.
#[cube]
pub fn is_negative(x: i64) -> bool {
    ((x as u64) >> 63) & 1 == 1u64
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
fn translate<U: Int>(lut: &Tensor<U>, slot: i64, stride: u64, #[comptime] has_lut: bool) -> i64 {
    let mut translated = slot;
    if has_lut {
        // Index 0 stands in for a negative slot, which passes through untranslated. Blended
        // arithmetically from the sign bit: `select` on this path was seen to pick wrongly.
        // Masked: see `is_negative` (cubecl 0.11 shifts `slot as u64` arithmetically).
        let negative = (((slot as u64) >> 63) & 1) as i64;
        let index = slot * (1 - negative);
        let looked_up = i64::cast_from(lut[index as usize * stride as usize]);
        translated = looked_up * (1 - negative) + slot * negative;
    }
    translated
}

#[cube]
fn table_at<T: Int>(table: &Tensor<T>, row: i64, col: i64, shape: PlanShape) -> i64 {
    i64::cast_from(
        table[row as usize * shape.table_row_stride as usize
            + col as usize * shape.table_col_stride as usize],
    )
}

/// The plan launch: a tile of requests per `tile_cubes` cubes (see the module docs).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn plan_kernel<Q: Int, P: Int, E: Int, T: Int, U: Int, O: Int, V: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    table: &Tensor<T>,
    lut: &Tensor<U>,
    pool: &Tensor<O>,
    valid_lens: &Tensor<V>,
    slot_indices: &mut Tensor<i64>,
    expected_tokens: &mut Tensor<i64>,
    expected_positions: &mut Tensor<i64>,
    prev_slot_indices: &mut Tensor<i64>,
    num_valid: &mut Tensor<i32>,
    enable: &mut Tensor<i32>,
    write_offsets: &mut Tensor<i64>,
    seeds: &mut Tensor<i64>,
    num_valid_reqs: &mut Tensor<i32>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: PlanShape,
    #[comptime] features: PlanFeatures,
    #[define(Q, P, E, T, U, O, V)] _dtypes: [ElemType; 7],
) {
    let mut verify_scan = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut write_scan = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut broadcast = Shared::<[u64]>::new_slice(SLOTS);
    let holders = comptime![if features.faithful_shared {
        CUBE_SIZE as usize
    } else {
        1
    }];
    let mut holder_rows = Shared::<[i64]>::new_slice(holders);
    let mut holder_starts = Shared::<[i64]>::new_slice(holders);
    let mut holder_pool_limits = Shared::<[i64]>::new_slice(holders);
    let ticket = take_ticket(&scratch[PLAN_TICKETS], shape.tiles > 1, &mut broadcast);
    let tile = ticket / shape.tile_cubes;
    let part = ticket % shape.tile_cubes;
    // Extra cubes of a rounded-up grid hold tickets past the last tile: they own no request.
    let active = tile < shape.tiles;
    let lead = active && part == 0;
    // A lone tile's prefix is 0 and its cubes know its total: nothing to publish.
    let publisher = lead && shape.tiles > 1;
    let unit = UNIT_POS as u64;
    let r = tile * shape.tile_requests + unit;
    let owns = active && unit < shape.tile_requests && r < shape.requests;

    // Index 0 stands in for a request this unit does not own (every binding has an element 0);
    // nothing loaded for it is used.
    let request = load_request(
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        select(owns, r, 0u64),
        shape,
        features.window,
    );
    let verify_length = select(owns, verify_length(request), 0u64);
    let write_length = select(owns, write_length(request), 0u64);
    let (_, write_rank, verify_tile, write_tile) = cube_exclusive_scan_pair(
        verify_length,
        write_length,
        &mut verify_scan,
        &mut write_scan,
        features.planes,
    );
    let mut verify_prefix = 0u64.runtime();
    let mut write_prefix = 0u64.runtime();
    if active {
        let broadcast_prefix = features.faithful_shared;
        verify_prefix = tile_prefix(
            scratch,
            PLAN_STATES,
            tile as usize,
            verify_tile,
            publisher,
            &mut broadcast,
            SLOT_PREFIX,
            broadcast_prefix,
            false,
        );
        write_prefix = tile_prefix(
            scratch,
            PLAN_STATES + shape.write_capacity as usize,
            tile as usize,
            write_tile,
            publisher,
            &mut broadcast,
            SLOT_SECOND_PREFIX,
            broadcast_prefix,
            false,
        );
    }

    // While the look-back runs: the request rules and the seed, by the tile's lead only.
    let checks = lead && owns;
    let live = checks && is_live(request);
    let row_fails = live && (request.row < 0 || request.row as u64 >= shape.rows);
    let position_fails = live && request.prefix as u64 > shape.cols;
    let mut pool_row_fails = false.runtime();
    let mut pool_position_fails = false.runtime();
    if features.pool {
        let valid_len = valid_len_of(valid_lens, select(owns, r, 0u64), shape);
        let column = last_pool_column(request, shape.position_offset, valid_len);
        pool_row_fails = live && column >= 0 && request.row as u64 >= shape.pool_rows;
        pool_position_fails = live && column >= 0 && column as u64 >= shape.pool_cols;
    }
    let mut dependency = 0u64.runtime();
    if row_fails {
        dependency |= report_error(&scratch[PLAN_ERRORS], r) >> 63;
    }
    if position_fails {
        dependency |= report_error(&scratch[PLAN_ERRORS + 1], r) >> 63;
    }
    if pool_row_fails {
        dependency |= report_error(&scratch[PLAN_ERRORS + 3], r) >> 63;
    }
    if pool_position_fails {
        dependency |= report_error(&scratch[PLAN_ERRORS + 4], r) >> 63;
    }
    let slow_write =
        checks && request.row != 0 && request.extend > 0 && request.extend as u64 > EXACT_EXTEND;
    if slow_write {
        dependency |= scratch[PLAN_SLOW_WRITE].exchange(1u64) >> 63;
    }
    let mut reported =
        row_fails || position_fails || pool_row_fails || pool_position_fails || slow_write;
    // The seed's table read is issued here and its value stored after the fill, so that its
    // latency hides behind the fill's.
    let seed_slot = seed_slot_of(request, table, shape);
    if comptime![features.faithful_shared] {
        let holder = holder_of(
            request,
            valid_lens,
            select(owns, r, 0u64),
            shape,
            features.pool,
        );
        holder_rows[unit as usize] = holder.row;
        holder_starts[unit as usize] = holder.window_start;
        holder_pool_limits[unit as usize] = holder.pool_limit;
    }
    sync_cube();

    if checks {
        write_offsets[r as usize] = (write_prefix + write_rank) as i64;
        if r + 1 == shape.requests {
            write_offsets[shape.requests as usize] =
                (write_prefix + write_rank + write_length) as i64;
        }
    }
    if shape.requests == 0 && ticket == 0 && UNIT_POS == 0 {
        write_offsets[0] = 0;
    }
    if comptime![features.lead_finishes] {
        // The lead's own reports are gathered here (a lone cube's count, with no counter). Its
        // barriers also put the write offsets above before the slow path's exact ones. On the
        // H200 the done counter and the last cube's hand-off cost ~1.2 us at bs 1-64.
        let (_, any_reported) = publish_block_done(
            &scratch[PLAN_DONE],
            1u64,
            dependency,
            reported,
            &mut broadcast,
        );
        if lead && UNIT_POS == 0 {
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
                verify_tile,
                any_reported,
                features,
            );
        }
    }
    // Write offsets past `bs` are zeroed (no memset launch).
    let stride = shape.cubes * CUBE_SIZE as u64;
    let mut w = shape.requests + 1 + ticket * CUBE_SIZE as u64 + unit;
    while w <= shape.write_capacity {
        write_offsets[w as usize] = 0;
        w += stride;
    }

    // The tile's verify entries, a contiguous share per cube, `CUBE_SIZE` at a time. Entries may
    // only be written when the whole plan fits: a lone tile knows its total; for more tiles either
    // the count launch summed it or the host has proved that the plan fits.
    let mut fits = shape.tiles > 1 || verify_tile <= shape.verify_capacity;
    if features.counted {
        fits = scratch[PLAN_TOTAL].load() <= shape.verify_capacity;
    }
    // Rule-14 offenders are kept per unit and reported once after the loop: lavapipe was seen to
    // lose the code after a loop that contains an atomic.
    let mut lut_key = NO_ERROR.runtime();
    let last_request = select(shape.tile_requests > 0, shape.tile_requests - 1, 0u64);
    // The request holding entry `e` is the first whose inclusive end exceeds `e`: found by
    // bisection for the unit's first entry, then from the previous holder (entries only grow).
    let (share_first, share_end) = cube_share(verify_tile, part, shape.tile_cubes);
    let mut e = share_first + unit;
    let mut j = first_holding(&verify_scan, last_request, e);
    while e < share_end {
        j = step_to_holder(&verify_scan, j, last_request, e);
        let start = start_of(&verify_scan, j);
        let mut step = (CUBE_SIZE as u64).runtime();
        let r_global = tile * shape.tile_requests + j;
        let holder = if comptime![features.faithful_shared] {
            Holder {
                row: holder_rows[j as usize],
                window_start: holder_starts[j as usize],
                pool_limit: holder_pool_limits[j as usize],
            }
        } else {
            // Loaded again (cached) rather than kept in shared memory: lavapipe was seen to
            // serve stale shared values to a later phase of the kernel.
            let owner = load_request(
                req_pool_indices,
                prefix_lens,
                extend_seq_lens,
                r_global,
                shape,
                features.window,
            );
            holder_of(owner, valid_lens, r_global, shape, features.pool)
        };
        if holder.row != 0 {
            let row = holder.row;
            let position = holder.window_start + (e - start) as i64;
            let raw = table_at(table, row, position, shape);
            // Column 0 stands in for the predecessor of position 0, which is never used.
            let prev_column = select(position > 0i64.runtime(), position - 1, 0i64.runtime());
            let raw_prev = table_at(table, row, prev_column, shape);
            let (slot_ok, prev_ok, entry_key) = rule_14(
                raw,
                raw_prev,
                r_global,
                position,
                prev_column,
                shape.lut_len,
            );
            lut_key = select(entry_key < lut_key, entry_key, lut_key);
            // `k < V` also guards a plan with a device-checked error, whose lengths are not
            // bounded by the host's proof.
            let k = verify_prefix + e;
            if fits && slot_ok && prev_ok && k < shape.verify_capacity {
                let token = expected_token(pool, holder, position, shape, features.pool);
                let prev = select(
                    position > 0i64.runtime(),
                    translate(lut, raw_prev, shape.lut_stride, features.lut),
                    NONE.runtime(),
                );
                slot_indices[k as usize] = translate(lut, raw, shape.lut_stride, features.lut);
                expected_tokens[k as usize] = token;
                expected_positions[k as usize] = position;
                prev_slot_indices[k as usize] = prev;
            }
        } else {
            // A request outside the table is never read: the unit skips its passes over the rest
            // of the request's entries (a failing prefix may claim 2^31 of them).
            let end = verify_scan[j as usize];
            step = (end - e).div_ceil(CUBE_SIZE as u64) * CUBE_SIZE as u64;
        }
        e += step;
    }
    if lut_key != NO_ERROR {
        dependency |= report_error(&scratch[PLAN_ERRORS + 2], lut_key) >> 63;
        reported = true;
    }
    if checks {
        seeds[r as usize] = seed_of(seed_slot, lut, shape, features.lut);
    }
    if comptime![!features.lead_finishes] {
        let (last, any_reported) = publish_block_done(
            &scratch[PLAN_DONE],
            shape.cubes,
            dependency,
            reported,
            &mut broadcast,
        );
        if last {
            if UNIT_POS == 0 {
                let total = if features.counted {
                    scratch[PLAN_TOTAL].exchange(0u64.runtime())
                } else {
                    launch_total(
                        scratch,
                        PLAN_STATES,
                        shape.tiles,
                        tile,
                        verify_prefix,
                        verify_tile,
                    )
                };
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
                    any_reported,
                    features,
                );
                // Swaps, not stores: cubecl 0.10 on SPIR-V was seen to drop the second of two
                // atomic stores in a row. A lone tile takes no ticket; a lone cube does not count.
                if shape.tiles > 1 {
                    scratch[PLAN_TICKETS].exchange(0u64.runtime());
                }
                if shape.cubes > 1 {
                    scratch[PLAN_DONE].exchange(0u64.runtime());
                }
            }
            // Every other cube is done with the tile states: clear them for the next call (a lone
            // tile published none). Last in the kernel, since lavapipe was seen to lose code after a
            // loop holding an atomic.
            let mut t = unit;
            while shape.tiles > 1 && t < shape.tiles {
                scratch[PLAN_STATES + t as usize].exchange(0u64.runtime());
                scratch[PLAN_STATES + (shape.write_capacity + t) as usize].exchange(0u64.runtime());
                t += CUBE_SIZE as u64;
            }
        }
    }
}

/// Rule 14 on an entry's slot and its predecessor's (the window head's included): whether each
/// can be translated, and the entry's error key (`r << 32 | column`, [`NO_ERROR`] when both can).
/// Without a LUT the host passes `lut_len = i64::MAX`, so every slot is inside. (Pure
/// expressions: see the note on mutable locals in `scan`.)
#[cube]
fn rule_14(
    raw: i64,
    raw_prev: i64,
    r: u64,
    position: i64,
    prev_column: i64,
    lut_len: u64,
) -> (bool, bool, u64) {
    let slot_ok = slot_in_lut(raw, lut_len);
    let prev_ok = position == 0i64.runtime() || slot_in_lut(raw_prev, lut_len);
    let slot_key = select(slot_ok, NO_ERROR, (r << 32) | position as u64);
    let prev_key = select(prev_ok, NO_ERROR, (r << 32) | prev_column as u64);
    (
        slot_ok,
        prev_ok,
        select(slot_key < prev_key, slot_key, prev_key),
    )
}

/// The expected token of the entry at `position` of `holder`: the pool's, where it may be read,
/// else -1.
#[cube]
fn expected_token<O: Int>(
    pool: &Tensor<O>,
    holder: Holder,
    position: i64,
    shape: PlanShape,
    #[comptime] has_pool: bool,
) -> i64 {
    let mut token = NONE.runtime();
    if has_pool {
        let column = position + shape.position_offset;
        if column >= 0 && column < holder.pool_limit {
            token = i64::cast_from(
                pool[holder.row as usize * shape.pool_row_stride as usize
                    + column as usize * shape.pool_col_stride as usize],
            );
        }
    }
    token
}

/// The count launch (only when the plan may overflow): the sum of every verify length, one
/// atomic per cube, into the scratch word the plan launch reads and resets.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn plan_count_kernel<Q: Int, P: Int, E: Int>(
    req_pool_indices: &Tensor<Q>,
    prefix_lens: &Tensor<P>,
    extend_seq_lens: &Tensor<E>,
    scratch: &Tensor<Atomic<u64>>,
    shape: PlanShape,
    #[comptime] features: PlanFeatures,
    #[define(Q, P, E)] _dtypes: [ElemType; 3],
) {
    let mut shared = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let r = ABSOLUTE_POS as u64;
    let owns = r < shape.requests;
    let request = load_request(
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        select(owns, r, 0u64),
        shape,
        features.window,
    );
    let (_, total) = cube_exclusive_scan(
        select(owns, verify_length(request), 0u64),
        &mut shared,
        false,
    );
    if UNIT_POS == 0 && total > 0 {
        scratch[PLAN_TOTAL].fetch_add(total);
    }
}

/// `vlen`: verify entries of a request, capped at [`VERIFY_CAP`].
#[cube]
fn verify_length(request: Request) -> u64 {
    let length = request.prefix - request.window_start;
    let length = select(request.row != 0 && length > 0, length as u64, 0u64);
    select(length > VERIFY_CAP, VERIFY_CAP, length)
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

/// The raw chain seed: the table slot of the last prefix token, or -1 when there is none or it
/// cannot be read.
#[cube]
fn seed_slot_of<T: Int>(request: Request, table: &Tensor<T>, shape: PlanShape) -> i64 {
    let mut slot = NONE.runtime();
    if request.row != 0
        && request.extend > 0
        && request.prefix > 0
        && in_table(request, shape.rows, shape.cols)
    {
        slot = table_at(table, request.row, request.prefix - 1, shape);
    }
    slot
}

/// The chain seed from its raw slot: translated through the LUT. Rule 14 on it is the entries'
/// (the same slot is an entry); an untranslatable seed is left at -1 (the plan is disabled then).
#[cube]
fn seed_of<U: Int>(slot: i64, lut: &Tensor<U>, shape: PlanShape, #[comptime] has_lut: bool) -> i64 {
    let mut seed = slot;
    if has_lut {
        seed = NONE.runtime();
        if slot_in_lut(slot, shape.lut_len) {
            seed = translate(lut, slot, shape.lut_stride, has_lut);
        }
    }
    seed
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
    any_reported: bool,
    #[comptime] features: PlanFeatures,
) {
    clear_status(status);
    // Rule 17 and the exact offsets, only when some extend length was too large to scan. A
    // launch where no cube reported anything left the error words and this flag untouched.
    let mut overflow_at = NONE.runtime();
    if any_reported && scratch[PLAN_SLOW_WRITE].exchange(0u64.runtime()) != 0u64 {
        let mut sum = 0i64;
        let mut r = 0u64;
        while r < shape.requests {
            let request = load_request(
                req_pool_indices,
                prefix_lens,
                extend_seq_lens,
                r,
                shape,
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
    if any_reported {
        #[unroll]
        for rule in 0..5u32 {
            // Read and reset: the scratch belongs to the plan and must be clean for the next call.
            let candidate = scratch[PLAN_ERRORS + rule as usize].exchange(NO_ERROR.runtime());
            if code == 0 && candidate != NO_ERROR {
                code = PLAN_ROW + rule as i64;
                key = candidate;
            }
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
            shape,
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
            status[FACTS] = table_at(table, request.row, column, shape);
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
            let valid_len = valid_len_of(valid_lens, r, shape);
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
