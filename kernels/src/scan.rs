//! Block-level scan and the decoupled look-back that chains tiles across the grid.
//!
//! Cross-block data only travels through 64-bit atomics: CubeCL 0.10 exposes no device-wide fence,
//! so a tile's state is one packed word (flag in the top two bits, value below).

use cubecl::prelude::*;

/// Threads per cube in every kvplan kernel.
pub const CUBE_SIZE: u32 = 256;

/// Tile state: only the tile's own aggregate is known.
pub const FLAG_AGGREGATE: u64 = 1 << 62;
/// Tile state: the inclusive prefix (all tiles up to this one) is known.
pub const FLAG_INCLUSIVE: u64 = 2 << 62;
/// The value bits of a tile state.
pub const VALUE_MASK: u64 = (1 << 62) - 1;

/// "No error" in an error-key word. The top bit stays clear so that `old >> 63` is provably 0 to
/// us but not to the compiler (see [`publish_block_done()`]).
pub const NO_ERROR: u64 = (1 << 63) - 1;

// A mutable local must start from a runtime value (`x.runtime()`): a literal start makes it a
// compile-time value in cubecl 0.10, and a later assignment under a runtime `if` then applies
// unconditionally (seen with bools).
//
// Per-cube broadcast slots, one per purpose: cubecl 0.10 on SPIR-V was seen to serve some lanes
// a stale value when one shared slot carried different values at different points of a kernel.
/// Shared slot: this cube's tile ticket.
pub const SLOT_TICKET: usize = 0;
/// Shared slot: the exclusive prefix of this cube's tile (see [`tile_prefix()`]).
pub const SLOT_PREFIX: usize = 1;
/// Shared slot: the exclusive prefix of a second scan of the same tiles.
pub const SLOT_SECOND_PREFIX: usize = 4;
/// Shared slot: the `old >> 63` dependency word (see [`publish_block_done()`]).
pub const SLOT_DEPENDENCY: usize = 2;
/// Shared slot: the done-counter value this cube saw.
pub const SLOT_DONE: usize = 3;
/// Shared slot: some unit of this cube reported an error (see [`publish_block_done()`]).
pub const SLOT_REPORTED: usize = 5;
/// Shared slots per cube.
pub const SLOTS: usize = 8;

/// Exclusive scan of one `u64` per unit over the cube (Hillis-Steele in shared memory, unrolled:
/// no barrier sits inside a runtime loop). Returns `(exclusive prefix of this unit, cube total)`;
/// `shared` is left holding the inclusive prefixes.
///
/// With `planes`, by plane shuffles (see [`cube_exclusive_scan_pair()`]).
#[cube]
pub fn cube_exclusive_scan(
    value: u64,
    shared: &mut Shared<[u64]>,
    #[comptime] planes: bool,
) -> (u64, u64) {
    if comptime![planes] {
        plane_scan(value, shared)
    } else {
        shared_scan(value, shared)
    }
}

/// [`cube_exclusive_scan()`] in shared memory (Hillis-Steele, unrolled).
#[cube]
fn shared_scan(value: u64, shared: &mut Shared<[u64]>) -> (u64, u64) {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    #[unroll]
    for level in 0..8u32 {
        let offset = comptime!(1usize << level);
        let mut add = 0u64;
        if unit >= offset {
            add = shared[unit - offset];
        }
        sync_cube();
        shared[unit] += add;
        sync_cube();
    }
    let inclusive = shared[unit];
    let total = shared[CUBE_SIZE as usize - 1];
    sync_cube();
    (inclusive - value, total)
}

/// [`cube_exclusive_scan()`] of two values per unit at once (one set of barriers). Returns
/// `(rank a, rank b, total a, total b)`; the shared arrays are left holding the inclusive prefixes.
///
/// With `planes` (the runtime's planes are exactly [`PLANE_WIDTH`] units wide: CUDA) each plane
/// scans by shuffles and the cube adds the planes' totals: two barriers instead of eighteen. On the
/// H200 the shared-memory scan was the largest part of a 512-cube plan's fixed cost per cube.
#[cube]
pub fn cube_exclusive_scan_pair(
    a: u64,
    b: u64,
    shared_a: &mut Shared<[u64]>,
    shared_b: &mut Shared<[u64]>,
    #[comptime] planes: bool,
) -> (u64, u64, u64, u64) {
    if comptime![planes] {
        plane_scan_pair(a, b, shared_a, shared_b)
    } else {
        shared_scan_pair(a, b, shared_a, shared_b)
    }
}

/// [`cube_exclusive_scan_pair()`] in shared memory (Hillis-Steele, unrolled).
#[cube]
fn shared_scan_pair(
    a: u64,
    b: u64,
    shared_a: &mut Shared<[u64]>,
    shared_b: &mut Shared<[u64]>,
) -> (u64, u64, u64, u64) {
    let unit = UNIT_POS as usize;
    shared_a[unit] = a;
    shared_b[unit] = b;
    sync_cube();
    #[unroll]
    for level in 0..8u32 {
        let offset = comptime!(1usize << level);
        let mut add_a = 0u64;
        let mut add_b = 0u64;
        if unit >= offset {
            add_a = shared_a[unit - offset];
            add_b = shared_b[unit - offset];
        }
        sync_cube();
        shared_a[unit] += add_a;
        shared_b[unit] += add_b;
        sync_cube();
    }
    let inclusive_a = shared_a[unit];
    let inclusive_b = shared_b[unit];
    let total_a = shared_a[CUBE_SIZE as usize - 1];
    let total_b = shared_b[CUBE_SIZE as usize - 1];
    sync_cube();
    (inclusive_a - a, inclusive_b - b, total_a, total_b)
}

/// The minimum of one `u64` per unit over the cube, in every unit: the steps of
/// `shared_scan` with `min` for `+` (unrolled: no barrier sits inside a runtime loop). `shared`
/// serves no other purpose in the kernel (see the note on broadcast slots above).
#[cube]
pub fn cube_min(value: u64, shared: &mut Shared<[u64]>) -> u64 {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    #[unroll]
    for level in 0..8u32 {
        let offset = comptime!(1usize << level);
        let mut least = shared[unit];
        if unit + offset < CUBE_SIZE as usize {
            least = least.min(shared[unit + offset]);
        }
        sync_cube();
        shared[unit] = least;
        sync_cube();
    }
    let least = shared[0];
    sync_cube();
    least
}

/// Units of a plane where the kernels scan by plane shuffles (see [`cube_exclusive_scan_pair()`]).
pub const PLANE_WIDTH: u32 = 32;
/// Planes of a cube that is [`PLANE_WIDTH`] units per plane.
const CUBE_PLANES: usize = (CUBE_SIZE / PLANE_WIDTH) as usize;
/// Shuffle steps of a plane's scan.
const PLANE_LEVELS: u32 = PLANE_WIDTH.trailing_zeros();

/// [`cube_exclusive_scan()`] by plane shuffles: every unit adds the totals of the planes before
/// its own (and of all of them for the cube's total) from shared memory.
#[cube]
fn plane_scan(value: u64, shared: &mut Shared<[u64]>) -> (u64, u64) {
    let mut plane_totals = Shared::<[u64]>::new_slice(CUBE_PLANES);
    let unit = UNIT_POS as usize;
    let plane = unit / PLANE_WIDTH as usize;
    let inclusive = plane_inclusive(value);
    if UNIT_POS % PLANE_WIDTH == PLANE_WIDTH - 1 {
        plane_totals[plane] = inclusive;
    }
    sync_cube();
    let (before, total) = planes_before(&plane_totals, 0usize, plane);
    shared[unit] = before + inclusive;
    sync_cube();
    (before + inclusive - value, total)
}

/// [`cube_exclusive_scan_pair()`] by plane shuffles (see [`plane_scan`]).
#[cube]
fn plane_scan_pair(
    a: u64,
    b: u64,
    shared_a: &mut Shared<[u64]>,
    shared_b: &mut Shared<[u64]>,
) -> (u64, u64, u64, u64) {
    let mut plane_totals = Shared::<[u64]>::new_slice(2 * CUBE_PLANES);
    let unit = UNIT_POS as usize;
    let plane = unit / PLANE_WIDTH as usize;
    let inclusive_a = plane_inclusive(a);
    let inclusive_b = plane_inclusive(b);
    if UNIT_POS % PLANE_WIDTH == PLANE_WIDTH - 1 {
        plane_totals[plane] = inclusive_a;
        plane_totals[CUBE_PLANES + plane] = inclusive_b;
    }
    sync_cube();
    let (before_a, total_a) = planes_before(&plane_totals, 0usize, plane);
    let (before_b, total_b) = planes_before(&plane_totals, CUBE_PLANES, plane);
    shared_a[unit] = before_a + inclusive_a;
    shared_b[unit] = before_b + inclusive_b;
    sync_cube();
    (
        before_a + inclusive_a - a,
        before_b + inclusive_b - b,
        total_a,
        total_b,
    )
}

/// The inclusive sum of `value` over this unit's plane, by shuffles unrolled over the known plane
/// width: cubecl's `plane_inclusive_sum` loops over the runtime plane width and divides for the
/// lane (on the H200 the plan's 512-cube shapes were ~0.5 us slower with it).
#[cube]
fn plane_inclusive(value: u64) -> u64 {
    let lane = UNIT_POS % PLANE_WIDTH;
    let mut inclusive = value;
    #[unroll]
    for level in 0..PLANE_LEVELS {
        let delta = comptime!(1u32 << level);
        let up = plane_shuffle_up(inclusive, delta);
        inclusive += select(lane >= delta, up, 0u64);
    }
    inclusive
}

/// The sum of the plane totals `totals[first..]` before `plane`, and of all of them.
#[cube]
fn planes_before(totals: &Shared<[u64]>, #[comptime] first: usize, plane: usize) -> (u64, u64) {
    // Pure expressions (see the note on mutable locals above).
    let mut before = 0u64.runtime();
    let mut total = 0u64.runtime();
    #[unroll]
    for p in 0..CUBE_PLANES {
        let plane_total = totals[first + p];
        before += select(p < plane, plane_total, 0u64);
        total += plane_total;
    }
    (before, total)
}

/// Takes the next tile ticket for this cube (dynamic ids: a cube only ever waits on tiles that a
/// running cube already holds, so the look-back cannot deadlock). When there is only one tile
/// there is nothing to wait on (`ordered` false): the cube's position is its ticket, without the
/// atomic's round trip or the barriers that hand a ticket out.
#[cube]
pub fn take_ticket(counter: &Atomic<u64>, ordered: bool, broadcast: &mut Shared<[u64]>) -> u64 {
    let mut ticket = CUBE_POS as u64;
    if ordered {
        if UNIT_POS == 0 {
            broadcast[SLOT_TICKET] = counter.fetch_add(1u64);
        }
        sync_cube();
        ticket = broadcast[SLOT_TICKET];
        sync_cube();
    }
    ticket
}

/// Publishes `tile`'s aggregate in `states[base + tile]` (when `publisher`), walks back to the
/// exclusive prefix of all earlier tiles, and publishes the tile's inclusive state. Called by one
/// unit, by every unit of a cube with one publisher (each then holds the prefix itself, with no
/// broadcast through shared memory: lavapipe was seen to serve a stale broadcast to later
/// subgroups after a look-back), or with `plane` by a whole plane (`plane_walk`).
#[cube]
pub fn look_back(
    states: &Tensor<Atomic<u64>>,
    base: usize,
    tile: usize,
    aggregate: u64,
    publisher: bool,
    #[comptime] plane: bool,
) -> u64 {
    let mut prefix = 0u64.runtime();
    if tile == 0 {
        if publisher {
            states[base].store(FLAG_INCLUSIVE | aggregate);
        }
    } else {
        if publisher {
            states[base + tile].store(FLAG_AGGREGATE | aggregate);
        }
        prefix = if plane {
            plane_walk(states, base, tile)
        } else {
            unit_walk(states, base, tile)
        };
        if publisher {
            states[base + tile].store(FLAG_INCLUSIVE | (prefix + aggregate));
        }
    }
    prefix
}

/// The sum of the states from tile `tile - 1` back to the nearest inclusive one, a tile per step.
#[cube]
fn unit_walk(states: &Tensor<Atomic<u64>>, base: usize, tile: usize) -> u64 {
    let mut prefix = 0u64.runtime();
    let mut look = base + tile - 1;
    let mut searching = true.runtime();
    while searching {
        let state = states[look].load();
        let flag = state & !VALUE_MASK;
        if flag == FLAG_INCLUSIVE {
            prefix += state & VALUE_MASK;
            searching = false;
        } else if flag == FLAG_AGGREGATE {
            prefix += state & VALUE_MASK;
            look -= 1;
        }
    }
    prefix
}

/// [`unit_walk`] by a whole plane, a window of `PLANE_DIM` tiles per step: lane `l` reads the
/// state of tile `end - 1 - l`. The walk stops at the nearest inclusive state once every tile
/// before it in the window is ready, and otherwise moves a window back when all of them are
/// aggregates: a tile's prefix costs `tile / PLANE_DIM` round trips instead of `tile`. Every lane
/// returns the prefix.
#[cube]
fn plane_walk(states: &Tensor<Atomic<u64>>, base: usize, tile: usize) -> u64 {
    let lane = UNIT_POS_PLANE;
    let width = PLANE_DIM;
    let mut prefix = 0u64.runtime();
    let mut end = tile;
    let mut searching = true.runtime();
    while searching {
        // A lane past tile 0 stands for an inclusive 0 (it reads tile 0 and ignores it).
        let inside = (lane as usize) < end;
        let look = select(inside, end - 1 - lane as usize, usize::cast_from(0u32));
        let state = states[base + look].load();
        let flag = state & !VALUE_MASK;
        let inclusive = !inside || flag == FLAG_INCLUSIVE;
        let ready = !inside || flag != 0u64;
        // The nearest inclusive lane, and the nearest lane not yet published.
        let stop = plane_min(select(inclusive, lane, width));
        let gap = plane_min(select(ready, width, lane));
        // Every lane up to `stop` (up to the window's end without one) must be ready;
        // otherwise the window is read again.
        if gap > stop || gap == width {
            let counted = inside && lane <= stop;
            prefix += plane_sum(select(counted, state & VALUE_MASK, 0u64));
            if stop < width {
                searching = false;
            } else {
                end -= width as usize;
            }
        }
    }
    prefix
}

/// The exclusive prefix of `tile`, in every unit; unit 0 publishes the tile's state when the
/// cube is the tile's `publisher` (several cubes may share a tile; exactly one publishes it).
/// Tile 0's prefix is 0 in every unit without a walk, so its cubes skip the broadcast's barrier.
///
/// `broadcast_prefix` (CUDA): unit 0 walks the look-back, or with `plane_walk` the first plane
/// (`plane_walk`), and hands the prefix to the cube through shared `slot`. The plane walk
/// suits one cube per tile (the masked gather: (1024, 64) 7.8 -> 6.5 us on the H200); where many
/// cubes share a tile and all walk it (plan, segments), 32 lanes each polling with an atomic
/// read-modify-write (cubecl's atomic load) contend on the same words ((4096, 512) plan 25 ->
/// 61 us). Otherwise (lavapipe, which was seen to serve a stale broadcast to later subgroups after
/// a look-back) every unit walks it; on a GPU that would poll one word from every thread and
/// serialise on it.
#[cube]
pub fn tile_prefix(
    states: &Tensor<Atomic<u64>>,
    base: usize,
    tile: usize,
    aggregate: u64,
    publisher: bool,
    broadcast: &mut Shared<[u64]>,
    #[comptime] slot: usize,
    #[comptime] broadcast_prefix: bool,
    #[comptime] plane_walk: bool,
) -> u64 {
    let mut prefix = 0u64.runtime();
    if comptime![broadcast_prefix] {
        if tile == 0 {
            // The first tile's prefix is 0: nothing to walk or hand out, only its state to publish.
            if UNIT_POS == 0 && publisher {
                states[base].store(FLAG_INCLUSIVE | aggregate);
            }
        } else {
            if comptime![plane_walk] {
                if UNIT_POS < PLANE_DIM {
                    let walked = look_back(
                        states,
                        base,
                        tile,
                        aggregate,
                        UNIT_POS == 0 && publisher,
                        true,
                    );
                    if UNIT_POS == 0 {
                        broadcast[slot] = walked;
                    }
                }
            } else if UNIT_POS == 0 {
                broadcast[slot] = look_back(states, base, tile, aggregate, publisher, false);
            }
            sync_cube();
            prefix = broadcast[slot];
        }
    } else {
        prefix = look_back(
            states,
            base,
            tile,
            aggregate,
            UNIT_POS == 0 && publisher,
            false,
        );
    }
    prefix
}

/// The total over every tile, for the last cube. A cube of the last tile has it already: its
/// tile's exclusive `prefix` plus its `aggregate` (a lone tile's prefix is 0). Any other cube reads
/// the last tile's inclusive state.
///
/// That state was stored before its publisher counted itself done, but nothing orders the store
/// before the increment the last cube saw (relaxed atomics to different words): lavapipe was seen
/// to hand the last cube an empty state under load. So the last cube waits for it.
#[cube]
pub fn launch_total(
    states: &Tensor<Atomic<u64>>,
    base: usize,
    tiles: u64,
    tile: u64,
    prefix: u64,
    aggregate: u64,
) -> u64 {
    let mut total = prefix + aggregate;
    // A lone tile publishes no state.
    if tiles > 1 && tile + 1 != tiles {
        let last = base + tiles as usize - 1;
        let mut state = states[last].load();
        while state & !VALUE_MASK != FLAG_INCLUSIVE {
            state = states[last].load();
        }
        total = state & VALUE_MASK;
    }
    total
}

/// Records an error key (atomic minimum) and returns the old key, which the caller must keep in a
/// data dependency of its "done" increment so that the minimum is performed first.
#[cube]
pub fn report_error(key_word: &Atomic<u64>, key: u64) -> u64 {
    key_word.fetch_min(key)
}

/// Counts this cube as done. Returns, in every unit, whether this cube is the last to finish and,
/// for the last cube, whether any cube of the launch has `reported` something (so that a clean
/// launch skips reading the error words).
///
/// `dependency` is `old >> 63` of this unit's error reports and ordered atomics (always 0). The
/// cube gathers them into one word and adds it to its increment, which makes the increment wait
/// for those atomics: the last cube then sees every one of them.
///
/// The counter counts cubes in its low 32 bits and reports above them. Each launch adds exactly
/// `cubes` to the low half, so the last cube of a launch is the one whose increment reaches a
/// multiple of `cubes`; the reports are only meaningful when the counter starts each launch at 0.
#[cube]
#[allow(clippy::manual_is_multiple_of)]
pub fn publish_block_done(
    done: &Atomic<u64>,
    cubes: u64,
    dependency: u64,
    reported: bool,
    broadcast: &mut Shared<[u64]>,
) -> (bool, bool) {
    if UNIT_POS == 0 {
        broadcast[SLOT_DEPENDENCY] = 0;
        broadcast[SLOT_REPORTED] = 0;
    }
    sync_cube();
    if dependency != 0 {
        broadcast[SLOT_DEPENDENCY] = dependency;
    }
    if reported {
        broadcast[SLOT_REPORTED] = REPORT;
    }
    sync_cube();
    let dependency = broadcast[SLOT_DEPENDENCY];
    let report = broadcast[SLOT_REPORTED];
    // A lone cube is last without counting (its own reports were awaited above).
    let mut finished = dependency + report;
    if cubes > 1 {
        if UNIT_POS == 0 {
            broadcast[SLOT_DONE] = done.fetch_add(1u64 + dependency + report) + report;
        }
        sync_cube();
        finished = broadcast[SLOT_DONE];
        sync_cube();
    }
    (
        ((finished & CUBES_MASK) + 1) % cubes == 0,
        finished >= REPORT,
    )
}

/// A cube's report in a done counter (see [`publish_block_done()`]).
const REPORT: u64 = 1 << 32;
/// The cube count bits of a done counter.
const CUBES_MASK: u64 = REPORT - 1;

/// The first `j <= last` with `ends[j] > e` (`ends` ascending), or `last`.
#[cube]
pub fn first_holding(ends: &Shared<[u64]>, last: u64, e: u64) -> u64 {
    holder_between(ends, 0u64.runtime(), last, e)
}

/// The first `j` in `[low, last]` with `ends[j] > e`, or `last`, by bisection.
#[cube]
fn holder_between(ends: &Shared<[u64]>, low: u64, last: u64, e: u64) -> u64 {
    let mut low = low;
    let mut high = last;
    while low < high {
        let mid = (low + high) / 2;
        if ends[mid as usize] > e {
            high = mid;
        } else {
            low = mid + 1;
        }
    }
    low
}

/// From `j`, the holder of `e` (at most `last`): entries only grow along a unit's pass, so the
/// search starts at the holder of the unit's previous entry. A pass steps `CUBE_SIZE` entries
/// through its cube's contiguous share, so the holder is mostly `j` or `j + 1` (one or two
/// reads); past that, a bisection of the rest (short holders).
#[cube]
pub fn step_to_holder(ends: &Shared<[u64]>, j: u64, last: u64, e: u64) -> u64 {
    let mut holder = j;
    if ends[j as usize] <= e {
        holder = select(j < last, j + 1, last);
        if ends[holder as usize] <= e {
            holder = holder_between(ends, holder, last, e);
        }
    }
    holder
}

/// The `part`-th of `parts` contiguous shares of a tile's `total` entries, as `[first, end)`:
/// whole multiples of `CUBE_SIZE`, so that each pass of a cube stores `CUBE_SIZE` consecutive
/// entries and a unit's holder advances by at most a step or two per pass.
#[cube]
pub fn cube_share(total: u64, part: u64, parts: u64) -> (u64, u64) {
    let size = CUBE_SIZE as u64;
    let share = total.div_ceil(parts * size) * size;
    let first = part * share;
    (first, (first + share).min(total))
}

/// Where holder `j`'s entries start within the tile (`ends` holds inclusive ends).
#[cube]
pub fn start_of(ends: &Shared<[u64]>, j: u64) -> u64 {
    select(j > 0, ends[select(j > 0, j - 1, 0u64) as usize], 0u64)
}

/// Scalars of one [`fill_kernel`].
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct FillShape {
    /// Words to write.
    pub len: u64,
    /// The one word that gets `value`; every other word gets 0.
    pub at: u64,
    /// Its value.
    pub value: u64,
}

/// Fresh statuses and scratch written on the device: a host upload is not a dispatch, and a
/// captured graph on wgpu records dispatches only.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn fill_kernel(words: &mut Tensor<u64>, shape: FillShape) {
    let i = ABSOLUTE_POS as u64;
    if i < shape.len {
        words[i as usize] = select(i == shape.at, shape.value, 0u64);
    }
}
