//! Masked gather: one launch, or two for many tiles. Tiles of mask cells are compacted with a cube
//! scan chained by a decoupled look-back (or, after a count launch, by summing the counts of the
//! tiles before); every true cell is checked, then scattered to its row-major rank. The status
//! record, whose count word is the gather's count, is written by the last tile's cube of a
//! chained launch (the look-back hands it the total and whether any tile reported an error), or
//! by the last cube to finish a counted one (spec `gather.md` §3).

use cubecl::prelude::*;

use crate::scan::{
    CUBE_SIZE, NO_ERROR, SLOT_PREFIX, SLOTS, cube_exclusive_scan, cube_exclusive_scan_pair,
    cube_share, first_holding, launch_total, publish_block_done, report_error, start_of,
    step_to_holder, take_ticket, tile_prefix,
};
use crate::status::{
    CODE, COUNT, FACTS, GATHER_CAPACITY, GATHER_EMPTY_TABLE, GATHER_POSITION, GATHER_ROW,
};

/// Mask cells per unit (one per slab of `CUBE_SIZE` consecutive cells) of a counted gather.
pub const CELLS_PER_UNIT: u32 = 8;
/// Mask cells per unit of a gather without a count launch. On the H200 four were faster there
/// (more, shorter cubes: (64, 16) 4.46 -> 3.68 us), eight above (fewer tiles to sum:
/// (4096, 2048) 92 vs 111 us).
pub const SMALL_CELLS_PER_UNIT: u32 = 4;
/// A 16-bit field of a packed slab count.
const FIELD: u64 = 0xFFFF;
/// The field of a chained tile's `high` scan word that counts its reporting units.
const REPORTS_FIELD: u64 = 48;
/// Where a chained tile's state says that it reported an error; its count sits below.
const REPORTED_SHIFT: u64 = 40;
/// The count bits of a chained tile's state.
const COUNT_MASK: u64 = (1 << REPORTED_SHIFT) - 1;
/// Mask cells per tile (one cube) of a counted gather.
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
#[expand(derive(Clone, Copy))]
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
    /// Whole pos rows in a slab (`CUBE_SIZE` vectors of the launch's lanes).
    pub slab_rows: u64,
    /// The rest of a slab's cells past `slab_rows` rows (less than `pos_cols`).
    pub slab_cols: u64,
    /// Tiles per group of a counted gather: `ceil(tiles / CUBE_SIZE)`, so at most `CUBE_SIZE`
    /// groups.
    pub group_tiles: u64,
    // Element strides of the inputs, as launch scalars (see the crate docs).
    /// Row stride of `req_to_token`.
    pub table_row_stride: u64,
    /// Column stride of `req_to_token`.
    pub table_col_stride: u64,
    /// Stride of `req_pool_indices`.
    pub index_stride: u64,
    /// Row stride of `pos2d`.
    pub pos_row_stride: u64,
    /// Column stride of `pos2d`.
    pub pos_col_stride: u64,
    /// Row stride of `mask`.
    pub mask_row_stride: u64,
    /// Column stride of `mask`.
    pub mask_col_stride: u64,
}

/// `T[row(i)][pos2d[i][j]]` for every true `mask[i][j]`, row-major, into `out[..capacity]`.
///
/// A tile is `cells_per_unit / lanes` slabs of `CUBE_SIZE * lanes` consecutive cells; unit `u`
/// owns the `lanes` cells (one vector of `pos2d` and of `mask`, in one pos row) at `u * lanes`
/// of every slab, so that each load of a plane is coalesced, and wide where the inputs allow
/// (`lanes` 4: a quarter of the loads and index arithmetic). A unit reads its cells' mask,
/// position and row, checks and gathers the true ones into registers before the scan (so the
/// loads' latency overlaps the look-back), then stores them at their row-major ranks: the slabs
/// before, the units before it in its slab, its own cells before (a counted tile stages them in
/// shared memory, to store them in coalesced runs). One scan gives every slab's ranks, four
/// 16-bit counts per word.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn masked_gather_kernel<T: Int, Q: Int, P: Int, M: Int, N: Size>(
    table: &Tensor<T>,
    req_pool_indices: &Tensor<Q>,
    pos2d: &Tensor<Vector<P, N>>,
    mask: &Tensor<Vector<M, N>>,
    out: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    counts: &Tensor<u64>,
    shape: MaskedShape,
    #[comptime] broadcast_prefix: bool,
    #[comptime] counted: bool,
    #[comptime] cells_per_unit: u32,
    #[comptime] lanes: u32,
    #[define(T, Q, P, M)] _dtypes: [ElemType; 4],
) {
    let vectors = comptime!(cells_per_unit / lanes);
    let mut low_slabs = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut high_slabs = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut broadcast = Shared::<[u64]>::new_slice(SLOTS);
    // Counted tiles wait on no other tile: any order will do.
    let ordered = shape.tiles > 1 && !counted;
    let tile = take_ticket(&scratch[SCRATCH_TICKETS], ordered, &mut broadcast) as usize;
    // Cells are counted in `usize`, 32-bit unless the launch needs more (the launcher picks the
    // address type from every extent): 64-bit cell arithmetic was most of this kernel's
    // instructions.
    let cells = shape.pos_rows as usize * shape.pos_cols as usize;
    let first = tile * comptime!((CUBE_SIZE * cells_per_unit) as usize)
        + UNIT_POS as usize * comptime!(lanes as usize);
    let (mut i, mut j) = pos_of(first, shape);

    // First every cell's mask, position and row, with no branch between the loads, so that all
    // of them are in flight at once (a vector past the end reads vector 0, which every binding
    // has, and is then ignored). Cell `c` of vector `k` is bit `k * lanes + c`; row starts are
    // per vector (only its first cell can start a row).
    let mut flags = 0u32.runtime();
    let mut row_starts = 0u32.runtime();
    let mut positions = Array::<i64>::new(comptime!(cells_per_unit as usize));
    let mut rows = Array::<i64>::new(comptime!(vectors as usize));
    #[unroll]
    for k in 0..vectors {
        let inside = first + ((k * CUBE_SIZE * lanes) as usize) < cells;
        let (ci, cj) = (
            select(inside, i, index_zero()),
            select(inside, j, index_zero()),
        );
        let flag = mask[at2(ci, cj, shape.mask_row_stride, shape.mask_col_stride) / lanes as usize];
        let position =
            pos2d[at2(ci, cj, shape.pos_row_stride, shape.pos_col_stride) / lanes as usize];
        rows[k as usize] = row_of(req_pool_indices, ci, shape.shared_row, shape.index_stride);
        #[unroll]
        for c in 0..lanes {
            positions[(k * lanes + c) as usize] = i64::cast_from(position.extract(c as usize));
            flags |=
                u32::cast_from(inside && flag.extract(c as usize) != M::new(0)) << (k * lanes + c);
        }
        row_starts |= u32::cast_from(inside && j == 0) << k;
        (i, j) = next_slab(i, j, shape);
    }
    // Then the checks and the table reads (again all in flight at once). A failing cell only
    // sets a bit here; its error key is built after the loop, off the common path.
    let mut values = Array::<i64>::new(comptime!(cells_per_unit as usize));
    let mut stores = 0u32.runtime();
    let mut failures = 0u32.runtime();
    #[unroll]
    for k in 0..cells_per_unit {
        let row = rows[(k / lanes) as usize];
        let position = positions[k as usize];
        let flagged = (flags >> k) & 1 == 1;
        let row_start = k % lanes == 0 && (row_starts >> (k / lanes)) & 1 == 1;
        let (row_fails, empty_fails, position_fails) =
            cell_rules(row, position, flagged, row_start, shape);
        failures |= u32::cast_from(row_fails || empty_fails || position_fails) << k;
        values[k as usize] = 0;
        let row_ok = row >= 0 && (row as u64) < shape.rows;
        if flagged && !empty_fails && !position_fails && row_ok {
            let at = at2(
                row as usize,
                position as usize,
                shape.table_row_stride,
                shape.table_col_stride,
            );
            values[k as usize] = i64::cast_from(table[at]);
            stores |= 1u32 << k;
        }
    }
    // A unit reports only its smallest error key, once: no atomic sits between the loads.
    let mut key = NO_ERROR.runtime();
    if failures != 0 {
        key = smallest_key(
            first,
            &rows,
            &positions,
            flags,
            row_starts,
            shape,
            cells_per_unit,
            lanes,
        );
    }
    let mut dependency = 0u64.runtime();
    let reported = key != NO_ERROR;
    if reported {
        dependency = report_error(&scratch[SCRATCH_ERROR], key) >> 63;
    }
    // Slab k's true cells count as field k % 4 (16 bits) of the low or high word.
    let mut low = 0u64.runtime();
    let mut high = 0u64.runtime();
    #[unroll]
    for k in 0..vectors {
        let selected = vector_flags(flags, k, lanes).count_ones() as u64;
        if k < 4 {
            low |= selected << (16 * k) as u64;
        } else {
            high |= selected << (16 * (k - 4)) as u64;
        }
    }
    if comptime![!counted] {
        // A launch without a count has at most 4 slabs per tile, so `high` is free: its top field
        // counts this cube's reporting units, and its low bits carry the reports' dependency into
        // the tile's published state (see below).
        high = (u64::cast_from(reported) << REPORTS_FIELD) | dependency;
    }
    // The shared-memory scan: by plane shuffles the H200 measured (4096, 2048) 70.6 -> 76.0 us
    // and (1024, 64) 5.25 -> 5.32 (the segment gather gained at every shape, and uses them).
    let (low_rank, high_rank, low_total, high_total) =
        cube_exclusive_scan_pair(low, high, &mut low_slabs, &mut high_slabs, false);
    // A chained tile publishes its count plus, above `REPORTED_SHIFT`, whether it reported an
    // error: the look-back then hands the last tile's cube the total and whether any tile reported,
    // so no cube counts itself done (on the H200 the done counter and the last cube's hand-off cost
    // (1024, 64) ~1 us). A tile publishes only after its reports were performed (their dependency
    // is in `high_total`), so the last tile's cube sees them all.
    let tile_total = if counted {
        field_sum(low_total) + field_sum(high_total)
    } else {
        field_sum(low_total)
    };
    let tile_reported = if counted {
        0u64.runtime()
    } else {
        select(high_total >> REPORTS_FIELD > 0, 1u64, 0u64)
    };
    // A counted tile compacts its values in shared memory while its prefix is not yet known, then
    // stores them in coalesced runs (a unit's own cells take consecutive ranks: stored directly,
    // one store of a plane spans `lanes` times the sectors). On the H200: (4096, 2048) 81.8 ->
    // 69.1 us, (4096, 128) 11.4 -> 11.0; the barrier cost the one-launch sizes ~0.1 us.
    let ranks = (low_rank, high_rank, low_total, high_total);
    let staged_values = comptime!(if counted {
        (CUBE_SIZE * cells_per_unit) as usize
    } else {
        1
    });
    let mut staged = Shared::<[i64]>::new_slice(staged_values);
    if counted {
        let unbounded = usize::cast_from(u32::MAX);
        scatter_values(
            &values,
            stores,
            flags,
            ranks,
            index_zero(),
            unbounded,
            &mut staged,
            out,
            cells_per_unit,
            lanes,
            true,
        );
        sync_cube();
    }
    let prefix = if counted {
        counts_before(
            counts,
            scratch,
            tile as u64,
            shape.group_tiles,
            &mut low_slabs,
        )
    } else {
        tile_prefix(
            scratch,
            SCRATCH_TILES,
            tile,
            tile_total + (tile_reported << REPORTED_SHIFT) + (high_total & FIELD),
            shape.tiles > 1,
            &mut broadcast,
            SLOT_PREFIX,
            broadcast_prefix,
            true,
        )
    };
    // The states before this tile: the values before it and whether any of them reported.
    let reported_before = prefix >> REPORTED_SHIFT;
    let prefix = prefix & COUNT_MASK;
    // Ranks: the tile's prefix, then the rank in the tile (staged: the staged order, where a
    // failing cell leaves a hole, whose garbage goes out with an error status).
    let capacity = shape.capacity as usize;
    if counted {
        let mut t = UNIT_POS as usize;
        while t < tile_total as usize {
            let rank = prefix as usize + t;
            if rank < capacity {
                out[rank] = staged[t];
            }
            t += CUBE_SIZE as usize;
        }
    } else {
        scatter_values(
            &values,
            stores,
            flags,
            ranks,
            prefix as usize,
            capacity,
            &mut staged,
            out,
            cells_per_unit,
            lanes,
            false,
        );
    }
    // The cube that writes the status: the last to finish a counted launch, else the
    // last tile's (see `tile_reported`).
    let mut finisher = false.runtime();
    let mut total = 0u64.runtime();
    let mut any_reported = false.runtime();
    if counted {
        let (last, any) = publish_block_done(
            &scratch[SCRATCH_DONE],
            shape.tiles,
            dependency,
            reported,
            &mut broadcast,
        );
        if last {
            // No tile published a state: the total is every tile's count.
            total = counts_before(
                counts,
                scratch,
                shape.tiles,
                shape.group_tiles,
                &mut low_slabs,
            );
            finisher = UNIT_POS == 0;
            any_reported = any;
        }
    } else {
        finisher = tile as u64 + 1 == shape.tiles && UNIT_POS == 0;
        total = prefix + tile_total;
        any_reported = reported_before + tile_reported > 0;
    }
    if finisher {
        let key = first_error(scratch, SCRATCH_ERROR, any_reported);
        finish_masked(req_pool_indices, pos2d, status, shape, total, key, lanes);
    }
}

/// Stores a unit's values at `base` plus their ranks among the tile's true cells (the slabs
/// before, by their totals; the units before in the slab; the unit's own cells before), below
/// `capacity`: into `staged` or into `out`. Ranks are formed inline, cell by cell: held in an
/// array they made the one-launch gather 3-9% slower on the H200.
#[cube]
#[allow(clippy::too_many_arguments)]
fn scatter_values(
    values: &Array<i64>,
    stores: u32,
    flags: u32,
    ranks: (u64, u64, u64, u64),
    base: usize,
    capacity: usize,
    staged: &mut Shared<[i64]>,
    out: &mut Tensor<i64>,
    #[comptime] cells_per_unit: u32,
    #[comptime] lanes: u32,
    #[comptime] to_staged: bool,
) {
    let (low_rank, high_rank, low_total, high_total) = ranks;
    let mut slabs_before = base;
    #[unroll]
    for k in 0..comptime!(cells_per_unit / lanes) {
        let mut rank = slabs_before + slab_field(low_rank, high_rank, k);
        #[unroll]
        for c in 0..lanes {
            let cell = k * lanes + c;
            if (stores >> cell) & 1 == 1 && rank < capacity {
                if to_staged {
                    staged[rank] = values[cell as usize];
                } else {
                    out[rank] = values[cell as usize];
                }
            }
            rank += ((flags >> cell) & 1) as usize;
        }
        slabs_before += slab_field(low_total, high_total, k);
    }
}

/// The first launch of a counted masked gather: each tile's true cells, in `counts[tile]`, and
/// each group of `group_tiles` tiles' total, added into `scratch[SCRATCH_TILES + group]` (the tile
/// states, unused when counted; at most `CUBE_SIZE` groups). The gather then finds each tile's
/// prefix from the groups and tiles before it (`counts_before`): a bounded sum, with no chain
/// between tiles (a look-back over thousands of tiles costs more than this launch).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn masked_count_kernel<M: Int, N: Size>(
    mask: &Tensor<Vector<M, N>>,
    counts: &mut Tensor<u64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: MaskedShape,
    #[comptime] lanes: u32,
    #[define(M)] _dtype: ElemType,
) {
    let mut shared = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let tile = CUBE_POS;
    let cells = shape.pos_rows as usize * shape.pos_cols as usize;
    let first = tile * TILE_CELLS as usize + UNIT_POS as usize * comptime!(lanes as usize);
    let (mut i, mut j) = pos_of(first, shape);
    let mut selected = 0u64.runtime();
    #[unroll]
    for k in 0..comptime!(CELLS_PER_UNIT / lanes) {
        let cell = first + (k * CUBE_SIZE * lanes) as usize;
        if cell < cells {
            let flag =
                mask[at2(i, j, shape.mask_row_stride, shape.mask_col_stride) / lanes as usize];
            #[unroll]
            for c in 0..lanes {
                selected += u64::cast_from(flag.extract(c as usize) != M::new(0));
            }
        }
        (i, j) = next_slab(i, j, shape);
    }
    let (_, total) = cube_exclusive_scan(selected, &mut shared, false);
    if UNIT_POS == 0 {
        counts[tile] = total;
        scratch[SCRATCH_TILES + tile / shape.group_tiles as usize].fetch_add(total);
    }
}

/// The true cells of tiles `0..end`, summed by the whole cube: the whole groups' totals (at most
/// `CUBE_SIZE` groups: one read per unit), then the counts of the rest (fewer than a group).
///
/// A unit reads at most one group total, without a loop: lavapipe was seen to lose the code after
/// a loop that contains an atomic.
#[cube]
fn counts_before(
    counts: &Tensor<u64>,
    scratch: &Tensor<Atomic<u64>>,
    end: u64,
    group_tiles: u64,
    shared: &mut Shared<[u64]>,
) -> u64 {
    let groups = end / group_tiles;
    let unit = UNIT_POS as u64;
    let mut partial = 0u64.runtime();
    if unit < groups {
        partial += scratch[SCRATCH_TILES + unit as usize].load();
    }
    let mut t = groups * group_tiles + unit;
    while t < end {
        partial += counts[t as usize];
        t += CUBE_SIZE as u64;
    }
    let (_, total) = cube_exclusive_scan(partial, shared, false);
    total
}

/// The smallest error key of a gather launch, for the cube that finishes it (none to read when no
/// cube reported one).
#[cube]
fn first_error(scratch: &Tensor<Atomic<u64>>, error: usize, any_reported: bool) -> u64 {
    let mut key = NO_ERROR.runtime();
    if any_reported {
        key = scratch[error].load();
    }
    key
}

/// 0 as a `usize` of the launch's index width. A `usize` literal is always 32-bit in cubecl 0.10,
/// even in a 64-bit launch (`select` with one then truncates, `max` does not compile): runtime
/// `usize` values come from casts only.
#[cube]
fn index_zero() -> usize {
    usize::cast_from(0u32)
}

/// The pos row and column of a row-major cell.
#[cube]
fn pos_of(cell: usize, shape: MaskedShape) -> (usize, usize) {
    let columns = shape.pos_cols.max(1) as usize;
    (cell / columns, cell % columns)
}

/// The pos row and column `CUBE_SIZE` cells (a slab) after `(i, j)`, without a division.
#[cube]
fn next_slab(i: usize, j: usize, shape: MaskedShape) -> (usize, usize) {
    let columns = shape.pos_cols.max(1) as usize;
    let column = j + shape.slab_cols as usize;
    let wraps = column >= columns;
    (
        i + shape.slab_rows as usize + usize::cast_from(wraps),
        select(wraps, column - columns, column),
    )
}

/// The flags of vector `k`'s cells, as its low bits.
#[cube]
fn vector_flags(flags: u32, #[comptime] k: u32, #[comptime] lanes: u32) -> u32 {
    (flags >> (k * lanes)) & comptime!((1u32 << lanes) - 1)
}

/// The sum of a word's four 16-bit fields.
#[cube]
fn field_sum(word: u64) -> u64 {
    (word & FIELD) + ((word >> 16) & FIELD) + ((word >> 32) & FIELD) + (word >> 48)
}

/// Slab `k`'s 16-bit field of a packed pair of words, read from a 32-bit half.
#[cube]
fn slab_field(low: u64, high: u64, #[comptime] k: u32) -> usize {
    let word = if k < 4 { low } else { high };
    let half = if k % 4 < 2 {
        word as u32
    } else {
        (word >> 32) as u32
    };
    ((half >> (16 * (k % 2))) & FIELD as u32) as usize
}

/// The rules a cell fails: (rule 8, its row; rule 6, the empty table; rule 9, its position).
/// Rule 8 is checked once per pos row, at its first cell, true or not (the empty table skips it).
#[cube]
fn cell_rules(
    row: i64,
    position: i64,
    flagged: bool,
    row_start: bool,
    shape: MaskedShape,
) -> (bool, bool, bool) {
    let row_ok = row >= 0 && (row as u64) < shape.rows;
    let position_ok = position >= 0 && (position as u64) < shape.cols;
    (
        row_start && shape.cols > 0 && !row_ok,
        flagged && shape.cols == 0,
        flagged && shape.cols > 0 && !position_ok,
    )
}

/// The smallest error key of a unit's cells (only called when one of them fails): the rule in
/// the top byte, then the row-major cell.
#[cube]
#[allow(clippy::too_many_arguments)]
fn smallest_key(
    first: usize,
    rows: &Array<i64>,
    positions: &Array<i64>,
    flags: u32,
    row_starts: u32,
    shape: MaskedShape,
    #[comptime] cells_per_unit: u32,
    #[comptime] lanes: u32,
) -> u64 {
    let mut key = NO_ERROR.runtime();
    #[unroll]
    for k in 0..cells_per_unit {
        let (vector, c) = (k / lanes, k % lanes);
        let cell = (first + (vector * CUBE_SIZE * lanes + c) as usize) as u64;
        let (row_fails, empty_fails, position_fails) = cell_rules(
            rows[vector as usize],
            positions[k as usize],
            (flags >> k) & 1 == 1,
            c == 0 && (row_starts >> vector) & 1 == 1,
            shape,
        );
        let row_key = select(row_fails, KEY_ROW | cell, NO_ERROR);
        let empty_key = select(empty_fails, KEY_EMPTY_TABLE, NO_ERROR);
        let position_key = select(position_fails, KEY_POSITION | cell, NO_ERROR);
        key = key.min(row_key).min(empty_key).min(position_key);
    }
    key
}

/// `req_pool_indices[i]`, or entry 0 when it is shared, widened to i64.
#[cube]
fn row_of<Q: Int>(req_pool_indices: &Tensor<Q>, i: usize, shared_row: u64, stride: u64) -> i64 {
    let index = select(shared_row == 1, index_zero(), i);
    i64::cast_from(req_pool_indices[index * stride as usize])
}

/// The element at `(i, j)` of a 2-D input with the given strides.
#[cube]
fn at2(i: usize, j: usize, row_stride: u64, col_stride: u64) -> usize {
    i * row_stride as usize + j * col_stride as usize
}

/// The finishing cube: the status record, with the count or the first offender's facts.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish_masked<Q: Int, P: Int, N: Size>(
    req_pool_indices: &Tensor<Q>,
    pos2d: &Tensor<Vector<P, N>>,
    status: &mut Tensor<i64>,
    shape: MaskedShape,
    total: u64,
    key: u64,
    #[comptime] lanes: u32,
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
        } else {
            status[COUNT] = total as i64;
        }
    } else {
        if key == KEY_EMPTY_TABLE {
            status[CODE] = GATHER_EMPTY_TABLE;
        } else if key < KEY_POSITION {
            status[CODE] = GATHER_ROW;
            status[FACTS] = i as i64;
            status[FACTS + 1] = row_of(
                req_pool_indices,
                i as usize,
                shape.shared_row,
                shape.index_stride,
            );
            status[FACTS + 2] = shape.rows as i64;
        } else {
            status[CODE] = GATHER_POSITION;
            status[FACTS] = i as i64;
            status[FACTS + 1] = j as i64;
            let at = at2(
                i as usize,
                j as usize,
                shape.pos_row_stride,
                shape.pos_col_stride,
            );
            // The cell's lane, picked without a dynamic vector index.
            let vector = pos2d[at / lanes as usize];
            let lane = at % lanes as usize;
            let mut position = i64::cast_from(vector.extract(0usize));
            #[unroll]
            for c in 1..lanes {
                position = select(
                    lane == c as usize,
                    i64::cast_from(vector.extract(c as usize)),
                    position,
                );
            }
            status[FACTS + 2] = position;
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
// cube checks its segments and publishes the tile. The last cube writes the status.
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
/// Values a unit loads before it stores them (one per `CUBE_SIZE`-value pass of its cube).
const COPY_PASSES: usize = 4;
/// The base of a segment that is never read (it fails rule 8 or 9, or is not the unit's).
const NO_BASE: u64 = u64::MAX;

const KEY_SEGMENT_ROW: u64 = 8 << RULE_SHIFT;
const KEY_SEGMENT_POSITION: u64 = 9 << RULE_SHIFT;

/// Shapes of one segment gather.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
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
    // Element strides of the inputs, as launch scalars (see the crate docs).
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
}

/// `T[row(i)][start_i + j]` for `j < lengths[i]`, segments in order, into `out[..capacity]`.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn segment_gather_kernel<T: Int, Q: Int, S: Int, L: Int>(
    table: &Tensor<T>,
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
    out: &mut Tensor<i64>,
    status: &mut Tensor<i64>,
    scratch: &Tensor<Atomic<u64>>,
    shape: SegmentShape,
    #[comptime] has_start: bool,
    #[comptime] broadcast_prefix: bool,
    #[comptime] planes: bool,
    #[define(T, Q, S, L)] _dtypes: [ElemType; 4],
) {
    let mut ends = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut broadcast = Shared::<[u64]>::new_slice(SLOTS);
    let ticket = take_ticket(&scratch[SEG_TICKETS], shape.tiles > 1, &mut broadcast);
    let tile = ticket / shape.tile_cubes;
    let part = ticket % shape.tile_cubes;
    let active = tile < shape.tiles;
    let lead = active && part == 0;
    let unit = UNIT_POS as u64;
    let i = tile * shape.tile_segments + unit;
    let owns = active && unit < shape.tile_segments && i < shape.segments;
    let len =
        i64::cast_from(lengths[select(owns, i, 0u64) as usize * shape.lengths_stride as usize]);
    let length = select(owns && len > 0, len as u64, 0u64);
    // Each unit finds where its segment's values start in the table (rules 8 and 9 first: a
    // failing segment gets no base and is never read); the tile's lead reports the failures (the
    // shape rules 5-7 come first; then nothing else is read).
    let mut bases = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut base = NO_BASE.runtime();
    let mut dependency = 0u64.runtime();
    let mut reported = false.runtime();
    if owns && shape.shape_error == 0 {
        let row = row_of(
            req_pool_indices,
            i as usize,
            shape.shared_row,
            shape.index_stride,
        );
        let first = segment_start(start, i, shape, has_start);
        let row_fails = row < 0 || row as u64 >= shape.rows;
        let position_fails =
            !row_fails && len > 0 && (first < 0 || first > shape.cols as i64 - len);
        if !row_fails && !position_fails {
            base = row as u64 * shape.table_row_stride + first as u64 * shape.table_col_stride;
        }
        if lead && row_fails {
            dependency |= report_error(&scratch[SEG_ERROR], KEY_SEGMENT_ROW | i) >> 63;
            reported = true;
        }
        if lead && position_fails {
            dependency |= report_error(&scratch[SEG_ERROR], KEY_SEGMENT_POSITION | i) >> 63;
            reported = true;
        }
    }
    bases[UNIT_POS as usize] = base;
    // `ends` keeps the tile's inclusive ends for the copy below.
    let (_, tile_total) = cube_exclusive_scan(length, &mut ends, planes);
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
            false,
        );
    }

    // The tile's values, a contiguous share per cube, `COPY_PASSES * CUBE_SIZE` at a time; the
    // segment holding value `e` is the first whose end exceeds it. A pass loads all its values
    // before it stores any: a store between them would hold each load back until the previous
    // one returned (the table and `out` may alias, as far as the compiler knows). Values at or
    // past the capacity are never stored, so the copy stops there: that also bounds it when a
    // failing segment (never read; its values are left unspecified) claims a huge length.
    let room = select(prefix < shape.capacity, shape.capacity - prefix, 0u64);
    let copies = select(shape.shape_error == 0, tile_total.min(room), 0u64);
    let (share_first, share_end) = cube_share(copies, part, shape.tile_cubes);
    let last_segment = select(shape.tile_segments > 0, shape.tile_segments - 1, 0u64);
    let step = CUBE_SIZE as u64;
    let mut e = share_first + unit;
    // The holder's facts stay in registers until a value passes its end.
    let mut segment = first_holding(&ends, last_segment, e);
    let mut segment_end = ends[segment as usize];
    let mut segment_first = start_of(&ends, segment);
    let mut segment_base = bases[segment as usize];
    while e < share_end {
        // Held in the table's type until stored: widened right after its load, inside the
        // branch, each value was waited for before the next load went out ((4096, 2048) on the
        // H200: 33.4 us against 25.6).
        let mut values = Array::<T>::new(COPY_PASSES);
        #[unroll]
        for k in 0..COPY_PASSES {
            let value_e = e + k as u64 * step;
            let mut value = T::new(0);
            if value_e < share_end {
                if value_e >= segment_end {
                    segment = step_to_holder(&ends, segment, last_segment, value_e);
                    segment_end = ends[segment as usize];
                    segment_first = start_of(&ends, segment);
                    segment_base = bases[segment as usize];
                }
                if segment_base != NO_BASE {
                    let offset = value_e - segment_first;
                    let at = segment_base + offset * shape.table_col_stride;
                    value = table[at as usize];
                }
            }
            values[k] = value;
        }
        #[unroll]
        for k in 0..COPY_PASSES {
            let value_e = e + k as u64 * step;
            if value_e < share_end {
                out[(prefix + value_e) as usize] = i64::cast_from(values[k]);
            }
        }
        e += COPY_PASSES as u64 * step;
    }

    let (last, any_reported) = publish_block_done(
        &scratch[SEG_DONE],
        shape.cubes,
        dependency,
        reported,
        &mut broadcast,
    );
    if last && UNIT_POS == 0 {
        let total = launch_total(scratch, SEG_TILES, shape.tiles, tile, prefix, tile_total);
        let key = first_error(scratch, SEG_ERROR, any_reported);
        finish_segments(
            req_pool_indices,
            start,
            lengths,
            status,
            shape,
            total,
            key,
            has_start,
        );
    }
}

/// `start[i]`, or 0 without starts.
#[cube]
fn segment_start<S: Int>(
    start: &Tensor<S>,
    i: u64,
    shape: SegmentShape,
    #[comptime] has_start: bool,
) -> i64 {
    let mut first = 0i64;
    if has_start {
        first = i64::cast_from(start[i as usize * shape.start_stride as usize]);
    }
    first
}

/// The last cube of a segment gather: the status record, rules in the spec's order.
#[cube]
fn finish_segments<Q: Int, S: Int, L: Int>(
    req_pool_indices: &Tensor<Q>,
    start: &Tensor<S>,
    lengths: &Tensor<L>,
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
                let length =
                    i64::cast_from(lengths[segment as usize * shape.lengths_stride as usize]);
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
        words[FACTS + 1] = row_of(
            req_pool_indices,
            i as usize,
            shape.shared_row,
            shape.index_stride,
        );
        words[FACTS + 2] = shape.rows as i64;
    }
    if position_fails {
        let first = segment_start(start, i, shape, has_start);
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
    #[unroll]
    for word in 0..8usize {
        status[word] = words[word];
    }
}
