//! Masked gather: one launch. Tiles of mask cells are compacted with a cube scan chained by a
//! decoupled look-back; every true cell is checked, then scattered to its row-major rank; the last
//! cube to finish writes the count and the status record (spec `gather.md` §3).

use cubecl::prelude::*;

use crate::scan::{
    CUBE_SIZE, NO_ERROR, VALUE_MASK, cube_exclusive_scan, look_back, publish_block_done,
    report_error, take_ticket,
};
use crate::status::{
    CODE, COUNT, FACTS, GATHER_CAPACITY, GATHER_EMPTY_TABLE, GATHER_POSITION, GATHER_ROW,
};

/// Mask cells per unit.
pub const CELLS_PER_UNIT: u32 = 4;
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
    #[define(T, Q, P, M)] _dtypes: [StorageType; 4],
) {
    let mut shared = SharedMemory::<u64>::new(CUBE_SIZE as usize);
    let mut broadcast = SharedMemory::<u64>::new(2usize);
    let tile = take_ticket(&scratch[SCRATCH_TICKETS], &mut broadcast);
    let cells = shape.pos_rows * shape.pos_cols;
    let first = tile * TILE_CELLS + (UNIT_POS * CELLS_PER_UNIT) as u64;

    // Which of this unit's cells are true.
    let mut bits = 0u32;
    let mut selected = 0u64;
    #[unroll]
    for k in 0..CELLS_PER_UNIT {
        let cell = first + k as u64;
        if cell < cells {
            let i = (cell / shape.pos_cols) as usize;
            let j = (cell % shape.pos_cols) as usize;
            if mask[i * mask.stride(0) + j * mask.stride(1)] != M::new(0) {
                bits |= 1u32 << k;
                selected += 1;
            }
        }
    }
    let (unit_rank, tile_total) = cube_exclusive_scan(selected, &mut shared);
    if UNIT_POS == 0 {
        broadcast[0] = look_back(scratch, SCRATCH_TILES, tile as usize, tile_total);
        broadcast[1] = 0;
    }
    sync_cube();

    // Checks, then the scatter. Nothing is read before its bounds check passes.
    let mut rank = broadcast[0] + unit_rank;
    let mut dependency = 0u64;
    #[unroll]
    for k in 0..CELLS_PER_UNIT {
        let cell = first + k as u64;
        if cell < cells {
            let i = cell / shape.pos_cols;
            let j = cell % shape.pos_cols;
            let row = row_of(req_pool_indices, i, shape.shared_row);
            let row_ok = row >= 0 && (row as u64) < shape.rows;
            // Rule 8, once per pos row, true cells or not (the empty table skips it).
            if j == 0 && shape.cols > 0 && !row_ok {
                dependency |= report_error(&scratch[SCRATCH_ERROR], KEY_ROW | cell) >> 63;
            }
            if (bits >> k) & 1 == 1 {
                if shape.cols == 0 {
                    dependency |= report_error(&scratch[SCRATCH_ERROR], KEY_EMPTY_TABLE) >> 63;
                } else {
                    let position = i64::cast_from(
                        pos2d[i as usize * pos2d.stride(0) + j as usize * pos2d.stride(1)],
                    );
                    let position_ok = position >= 0 && (position as u64) < shape.cols;
                    if !position_ok {
                        dependency |= report_error(&scratch[SCRATCH_ERROR], KEY_POSITION | cell) >> 63;
                    } else if row_ok && rank < shape.capacity {
                        let at = row as usize * table.stride(0) + position as usize * table.stride(1);
                        out[rank as usize] = i64::cast_from(table[at]);
                    }
                }
                rank += 1;
            }
        }
    }
    if dependency != 0 {
        broadcast[1] = dependency;
    }
    sync_cube();
    let last = publish_block_done(&scratch[SCRATCH_DONE], shape.tiles, broadcast[1]);
    if last {
        let total = scratch[SCRATCH_TILES + shape.tiles as usize - 1].load() & VALUE_MASK;
        let key = scratch[SCRATCH_ERROR].load();
        finish_masked(req_pool_indices, pos2d, count, status, shape, total, key);
    }
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
