//! Masked gather: one launch. Tiles of mask cells are compacted with a cube scan chained by a
//! decoupled look-back; every true cell is checked, then scattered to its row-major rank; the last
//! cube to finish writes the count and the status record (spec `gather.md` §3).

use cubecl::prelude::*;

use crate::scan::{
    CUBE_SIZE, NO_ERROR, SLOT_PREFIX, SLOTS, cube_exclusive_scan, cube_share, first_holding,
    launch_total, publish_block_done, report_error, start_of, step_to_holder, take_ticket,
    tile_prefix,
};
use crate::status::{
    CODE, COUNT, FACTS, GATHER_CAPACITY, GATHER_EMPTY_TABLE, GATHER_POSITION, GATHER_ROW,
};

/// Mask cells per unit (consecutive, row-major).
pub const CELLS_PER_UNIT: u32 = 8;
/// Mask cells per tile (one cube).
pub const TILE_CELLS: u64 = (CUBE_SIZE * CELLS_PER_UNIT) as u64;

/// Scratch words before the tile states.
pub const SCRATCH_TICKETS: usize = 0;
/// Cubes done.
pub const SCRATCH_DONE: usize = 1;
/// Smallest error key.
pub const SCRATCH_ERROR: usize = 2;
/// First tile state.
pub const SCRATCH_TILES: usize = 4;

// Error keys: the rule in the top byte, then the row-major cell; smaller is reported first.
const RULE_SHIFT: u64 = 56;
const KEY_EMPTY_TABLE: u64 = 6 << RULE_SHIFT;
const KEY_ROW: u64 = 8 << RULE_SHIFT;
const KEY_POSITION: u64 = 9 << RULE_SHIFT;
const CELL_MASK: u64 = (1 << RULE_SHIFT) - 1;

/// Shapes of one masked gather (as scalars: empty tensors are bound as 1-element stand-ins).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct MaskedShape {
    /// Rows of `req_to_token`.
    pub rows: u64,
    /// Columns of `req_to_token`.
    pub cols: u64,
    /// Pos rows `R`.
    pub pos_rows: u64,
    /// Pos columns `C`.
    pub pos_cols: u64,
    /// 1 when a single `req_pool_indices` entry serves every pos row.
    pub shared_row: u64,
    /// Values `out` can take.
    pub capacity: u64,
    /// Tiles (= cubes) of this launch, at least 1.
    pub tiles: u64,
}

/// `T[row(i)][pos2d[i][j]]` for every true `mask[i][j]`, row-major, into `out[..capacity]`.
///
/// Each unit owns `CELLS_PER_UNIT` consecutive cells: it reads their mask, checks and gathers the
/// true ones into registers before the scan (so the loads' latency overlaps the look-back), then
/// stores them at their ranks. One division per unit: the cell's row and column then advance.
#[cube(launch_unchecked)]
pub fn masked_gather_kernel<T: Int, Q: Int, P: Int, M: Int>(
    table: &Tensor<T>,
    req_pool_indices: &Tensor<Q>,
    pos2d: &Tensor<P>,
    mask: &Tensor<M>,
    out: &mut Tensor<i64>,
    count: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: MaskedShape,
    #[comptime] broadcast_prefix: bool,
    #[define(T, Q, P, M)] _dtypes: [StorageType; 4],
) {
    let mut shared = SharedMemory::<u64>::new(CUBE_SIZE as usize);
    let mut broadcast = SharedMemory::<u64>::new(SLOTS);
    let tile = take_ticket(&scratch[SCRATCH_TICKETS], shape.tiles > 1, &mut broadcast);
    let cells = shape.pos_rows * shape.pos_cols;
    let first = tile * TILE_CELLS + (UNIT_POS * CELLS_PER_UNIT) as u64;
    let columns = shape.pos_cols.max(1);
    let mut i = first / columns;
    let mut j = first % columns;

    // The unit's cells: which are true, their values, and whether each may be stored. Nothing is
    // read before its bounds check passes.
    let mut values = Array::<i64>::new(CELLS_PER_UNIT as usize);
    let mut selected = 0u32.runtime();
    let mut stores = 0u32.runtime();
    let mut dependency = 0u64.runtime();
    let mut reported = false.runtime();
    #[unroll]
    for k in 0..CELLS_PER_UNIT {
        let cell = first + k as u64;
        values[k as usize] = 0;
        if cell < cells {
            let row = row_of(req_pool_indices, i, shape.shared_row);
            let row_ok = row >= 0 && (row as u64) < shape.rows;
            // Rule 8, once per pos row, true cells or not (the empty table skips it).
            if j == 0 && shape.cols > 0 && !row_ok {
                dependency |= report_error(&scratch[SCRATCH_ERROR], KEY_ROW | cell) >> 63;
                reported = true;
            }
            // Mask, position and row are read together (independent loads), true cell or not.
            let flag = mask[i as usize * mask.stride(0) + j as usize * mask.stride(1)];
            let position =
                i64::cast_from(pos2d[i as usize * pos2d.stride(0) + j as usize * pos2d.stride(1)]);
            if flag != M::new(0) {
                selected |= 1u32 << k;
                if shape.cols == 0 {
                    dependency |= report_error(&scratch[SCRATCH_ERROR], KEY_EMPTY_TABLE) >> 63;
                    reported = true;
                } else {
                    let position_ok = position >= 0 && (position as u64) < shape.cols;
                    if !position_ok {
                        dependency |=
                            report_error(&scratch[SCRATCH_ERROR], KEY_POSITION | cell) >> 63;
                        reported = true;
                    } else if row_ok {
                        let at =
                            row as usize * table.stride(0) + position as usize * table.stride(1);
                        values[k as usize] = i64::cast_from(table[at]);
                        stores |= 1u32 << k;
                    }
                }
            }
        }
        j += 1;
        if j == columns {
            j = 0;
            i += 1;
        }
    }
    let (unit_rank, tile_total) = cube_exclusive_scan(selected.count_ones() as u64, &mut shared);
    let mut rank = tile_prefix(
        scratch,
        SCRATCH_TILES,
        tile as usize,
        tile_total,
        shape.tiles > 1,
        &mut broadcast,
        SLOT_PREFIX,
        broadcast_prefix,
    ) + unit_rank;
    #[unroll]
    for k in 0..CELLS_PER_UNIT {
        if (selected >> k) & 1 == 1 {
            if (stores >> k) & 1 == 1 && rank < shape.capacity {
                out[rank as usize] = values[k as usize];
            }
            rank += 1;
        }
    }
    let (last, any_reported) = publish_block_done(
        &scratch[SCRATCH_DONE],
        shape.tiles,
        dependency,
        reported,
        &mut broadcast,
    );
    if last && UNIT_POS == 0 {
        let (total, key) = launch_outcome(
            scratch,
            SCRATCH_TILES,
            SCRATCH_ERROR,
            shape.tiles,
            tile_total,
            any_reported,
        );
        finish_masked(req_pool_indices, pos2d, count, status, shape, total, key);
    }
}

/// The last cube's view of a gather launch: the total of every tile and the smallest error key
/// (none to read when no cube reported one).
#[cube]
fn launch_outcome(
    scratch: &Tensor<Atomic<u64>>,
    states: usize,
    error: usize,
    tiles: u64,
    tile_total: u64,
    any_reported: bool,
) -> (u64, u64) {
    let total = launch_total(scratch, states, tiles, tile_total);
    let mut key = NO_ERROR.runtime();
    if any_reported {
        key = scratch[error].load();
    }
    (total, key)
}

/// `req_pool_indices[i]`, or entry 0 when it is shared, widened to i64.
#[cube]
fn row_of<Q: Int>(req_pool_indices: &Tensor<Q>, i: u64, shared_row: u64) -> i64 {
    let index = select(shared_row == 1, 0usize, i as usize);
    i64::cast_from(req_pool_indices[index * req_pool_indices.stride(0)])
}

/// The last cube: the count and the status record with the first offender's facts.
#[cube]
fn finish_masked<Q: Int, P: Int>(
    req_pool_indices: &Tensor<Q>,
    pos2d: &Tensor<P>,
    count: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    shape: MaskedShape,
    total: u64,
    key: u64,
) {
    clear_status(status);
    let cell = key & CELL_MASK;
    let i = cell / shape.pos_cols.max(1);
    let j = cell % shape.pos_cols.max(1);
    if key == NO_ERROR {
        if total > shape.capacity {
            status[CODE] = GATHER_CAPACITY;
            status[FACTS] = total as i64;
            status[FACTS + 1] = shape.capacity as i64;
            count[0] = 0;
        } else {
            status[COUNT] = total as i64;
            count[0] = total as i64;
        }
    } else {
        count[0] = 0;
        if key == KEY_EMPTY_TABLE {
            status[CODE] = GATHER_EMPTY_TABLE;
        } else if key < KEY_POSITION {
            status[CODE] = GATHER_ROW;
            status[FACTS] = i as i64;
            status[FACTS + 1] = row_of(req_pool_indices, i, shape.shared_row);
            status[FACTS + 2] = shape.rows as i64;
        } else {
            status[CODE] = GATHER_POSITION;
            status[FACTS] = i as i64;
            status[FACTS + 1] = j as i64;
            status[FACTS + 2] =
                i64::cast_from(pos2d[i as usize * pos2d.stride(0) + j as usize * pos2d.stride(1)]);
            status[FACTS + 3] = shape.cols as i64;
        }
    }
}

/// Zeroes a status record.
#[cube]
pub fn clear_status(status: &mut Tensor<i64>) {
    #[unroll]
    for word in 0..8usize {
        status[word] = 0;
    }
}

// ---- segment gather (spec `gather.md` §4) ----
//
// One launch, shaped like the plan: segments are cut into tiles of up to a cube's width, each
// served by `tile_cubes` cubes. A cube takes a ticket, scans its tile's lengths, chains the tile
// prefixes with a decoupled look-back and copies its share of the tile's values; the tile's lead
// cube checks its segments and publishes the tile. The last cube writes the count and the status.
// Wide tiles keep the look-back chain short (lengths are only known on the device, so a tile
// cannot be sized by its values), and sharing a tile spreads long segments over the device. No
// position or mask is ever built.

/// Segment gather scratch: ticket counter.
pub const SEG_TICKETS: usize = 0;
/// Smallest error key.
pub const SEG_ERROR: usize = 1;
/// Cubes done.
pub const SEG_DONE: usize = 2;
/// First tile state.
pub const SEG_TILES: usize = 4;

/// Values a cube copies at most when the host can bound them (its target when it shares tiles).
pub const SEGMENT_CUBE_VALUES: u64 = 256;

const KEY_SEGMENT_ROW: u64 = 8 << RULE_SHIFT;
const KEY_SEGMENT_POSITION: u64 = 9 << RULE_SHIFT;

/// Shapes of one segment gather.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub struct SegmentShape {
    /// Rows of `req_to_token`.
    pub rows: u64,
    /// Columns of `req_to_token`.
    pub cols: u64,
    /// Segments `S` (= `len(lengths)`).
    pub segments: u64,
    /// 1 when a single `req_pool_indices` entry serves every segment.
    pub shared_row: u64,
    /// Status code of a shape rule (5, 6 or 7) that fails unless the early exit applies; 0 if none.
    pub shape_error: i64,
    /// First fact of that shape error (the third, the longest length, is found on the device).
    pub shape_fact0: i64,
    /// Second fact of that shape error.
    pub shape_fact1: i64,
    /// Values `out` can take.
    pub capacity: u64,
    /// Segments per tile (1..=256).
    pub tile_segments: u64,
    /// Tiles: `ceil(S / tile_segments)`, at least 1.
    pub tiles: u64,
    /// Cubes per tile: each scans the whole tile and copies its share of the values.
    pub tile_cubes: u64,
    /// Cubes of the launch (at least `tiles * tile_cubes`; the extra cubes of a rounded-up grid
    /// idle).
    pub cubes: u64,
}

/// `T[row(i)][start_i + j]` for `j < lengths[i]`, segments in order, into `out[..capacity]`.
#[cube(launch_unchecked)]
pub fn segment_gather_kernel<T: Int, Q: Int, S: Int, L: Int>(
    table: &Tensor<T>,
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    out: &mut Tensor<i64>,
    count: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: SegmentShape,
    #[comptime] has_start: bool,
    #[comptime] broadcast_prefix: bool,
    #[define(T, Q, S, L)] _dtypes: [StorageType; 4],
) {
    let mut ends = SharedMemory::<u64>::new(CUBE_SIZE as usize);
    let mut broadcast = SharedMemory::<u64>::new(SLOTS);
    let ticket = take_ticket(&scratch[SEG_TICKETS], shape.tiles > 1, &mut broadcast);
    let tile = ticket / shape.tile_cubes;
    let part = ticket % shape.tile_cubes;
    let active = tile < shape.tiles;
    let lead = active && part == 0;
    let unit = UNIT_POS as u64;
    let i = tile * shape.tile_segments + unit;
    let owns = active && unit < shape.tile_segments && i < shape.segments;
    let len = i64::cast_from(lengths[select(owns, i, 0u64) as usize * lengths.stride(0)]);
    let length = select(owns && len > 0, len as u64, 0u64);
    // Rules 8 and 9, by the tile's lead (the shape rules 5-7 come first; then nothing else is
    // read).
    let mut dependency = 0u64.runtime();
    let mut reported = false.runtime();
    if lead && owns && shape.shape_error == 0 {
        let row = row_of(req_pool_indices, i, shape.shared_row);
        if row < 0 || row as u64 >= shape.rows {
            dependency |= report_error(&scratch[SEG_ERROR], KEY_SEGMENT_ROW | i) >> 63;
            reported = true;
        } else if len > 0 && !segment_fits(start, i, len, shape.cols, has_start) {
            dependency |= report_error(&scratch[SEG_ERROR], KEY_SEGMENT_POSITION | i) >> 63;
            reported = true;
        }
    }
    // `ends` keeps the tile's inclusive ends for the copy below.
    let (_, tile_total) = cube_exclusive_scan(length, &mut ends);
    let mut prefix = 0u64.runtime();
    if active {
        prefix = tile_prefix(
            scratch,
            SEG_TILES,
            tile as usize,
            tile_total,
            lead && shape.tiles > 1,
            &mut broadcast,
            SLOT_PREFIX,
            broadcast_prefix,
        );
    }

    // The tile's values, a contiguous share per cube, `CUBE_SIZE` at a time; the segment holding
    // value `e` is the first whose end exceeds it. A segment that fails a rule is never read.
    let copies = select(shape.shape_error == 0, tile_total, 0u64);
    let (share_first, share_end) = cube_share(copies, part, shape.tile_cubes);
    let last_segment = select(shape.tile_segments > 0, shape.tile_segments - 1, 0u64);
    let mut e = share_first + unit;
    let mut segment = first_holding(&ends, last_segment, e);
    while e < share_end {
        segment = step_to_holder(&ends, segment, last_segment, e);
        let before = start_of(&ends, segment);
        let g = tile * shape.tile_segments + segment;
        let row = row_of(req_pool_indices, g, shape.shared_row);
        let len = i64::cast_from(lengths[g as usize * lengths.stride(0)]);
        let k = prefix + e;
        let row_ok = row >= 0 && (row as u64) < shape.rows;
        if row_ok && segment_fits(start, g, len, shape.cols, has_start) && k < shape.capacity {
            let position = segment_start(start, g, has_start) as u64 + (e - before);
            let at = row as usize * table.stride(0) + position as usize * table.stride(1);
            out[k as usize] = i64::cast_from(table[at]);
        }
        e += CUBE_SIZE as u64;
    }

    let (last, any_reported) = publish_block_done(
        &scratch[SEG_DONE],
        shape.cubes,
        dependency,
        reported,
        &mut broadcast,
    );
    if last && UNIT_POS == 0 {
        let (total, key) = launch_outcome(
            scratch,
            SEG_TILES,
            SEG_ERROR,
            shape.tiles,
            tile_total,
            any_reported,
        );
        finish_segments(
            req_pool_indices,
            start,
            lengths,
            count,
            status,
            shape,
            total,
            key,
            has_start,
        );
    }
}

/// Rule 9 for a segment of positive length `len`: `[start, start + len)` lies in the table.
#[cube]
fn segment_fits<S: Int>(
    start: &Tensor<S>,
    i: u64,
    len: i64,
    cols: u64,
    #[comptime] has_start: bool,
) -> bool {
    let first = segment_start(start, i, has_start);
    first >= 0 && first <= cols as i64 - len
}

/// `start[i]`, or 0 without starts.
#[cube]
fn segment_start<S: Int>(start: &Tensor<S>, i: u64, #[comptime] has_start: bool) -> i64 {
    let mut first = 0i64;
    if has_start {
        first = i64::cast_from(start[i as usize * start.stride(0)]);
    }
    first
}

/// The last cube of a segment gather: count and status, rules in the spec's order.
#[cube]
fn finish_segments<Q: Int, S: Int, L: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    count: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    shape: SegmentShape,
    total: u64,
    key: u64,
    #[comptime] has_start: bool,
) {
    // Written as one pass of flat `if`s: deep `else if` chains were miscompiled by cubecl 0.10's
    // SPIR-V optimiser.
    let i = key & CELL_MASK;
    let gathers = total > 0;
    let shape_fails = gathers && shape.shape_error != 0;
    let row_fails = gathers && !shape_fails && key != NO_ERROR && key < KEY_SEGMENT_POSITION;
    let position_fails = gathers && !shape_fails && key != NO_ERROR && key >= KEY_SEGMENT_POSITION;
    let capacity_fails = gathers && !shape_fails && key == NO_ERROR && total > shape.capacity;
    let mut words = Array::<i64>::new(8usize);
    #[unroll]
    for word in 0..8usize {
        words[word] = 0;
    }
    if shape_fails {
        words[CODE] = shape.shape_error;
        if shape.shape_error != GATHER_EMPTY_TABLE {
            // `L`, the longest segment: only needed on this error path.
            let mut longest = 0i64;
            for segment in 0..shape.segments {
                let length = i64::cast_from(lengths[segment as usize * lengths.stride(0)]);
                if length > longest {
                    longest = length;
                }
            }
            words[FACTS] = shape.shape_fact0;
            words[FACTS + 1] = shape.shape_fact1;
            words[FACTS + 2] = longest;
        }
    }
    if row_fails {
        words[CODE] = GATHER_ROW;
        words[FACTS] = i as i64;
        words[FACTS + 1] = row_of(req_pool_indices, i, shape.shared_row);
        words[FACTS + 2] = shape.rows as i64;
    }
    if position_fails {
        let first = segment_start(start, i, has_start);
        let cols = shape.cols as i64;
        let position = select(first < 0 || first > cols, first, cols);
        words[CODE] = GATHER_POSITION;
        words[FACTS] = i as i64;
        words[FACTS + 1] = position - first;
        words[FACTS + 2] = position;
        words[FACTS + 3] = cols;
    }
    if capacity_fails {
        words[CODE] = GATHER_CAPACITY;
        words[FACTS] = total as i64;
        words[FACTS + 1] = shape.capacity as i64;
    }
    let fails = shape_fails || row_fails || position_fails || capacity_fails;
    let counted = select(fails, 0i64, total as i64);
    words[COUNT] = counted;
    count[0] = counted;
    #[unroll]
    for word in 0..8usize {
        status[word] = words[word];
    }
}
