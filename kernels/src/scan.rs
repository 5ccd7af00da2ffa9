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
/// us but not to the compiler (see [`publish_block_done`]).
pub const NO_ERROR: u64 = (1 << 63) - 1;

/// Exclusive scan of one `u64` per unit over the cube (Hillis-Steele in shared memory).
/// Returns `(exclusive prefix of this unit, cube total)`.
#[cube]
pub fn cube_exclusive_scan(value: u64, shared: &mut SharedMemory<u64>) -> (u64, u64) {
    let unit = UNIT_POS as usize;
    shared[unit] = value;
    sync_cube();
    let mut offset = 1usize;
    while offset < CUBE_SIZE as usize {
        let mut add = 0u64;
        if unit >= offset {
            add = shared[unit - offset];
        }
        sync_cube();
        shared[unit] += add;
        sync_cube();
        offset *= 2;
    }
    let inclusive = shared[unit];
    let total = shared[CUBE_SIZE as usize - 1];
    sync_cube();
    (inclusive - value, total)
}

/// Takes the next tile ticket for this cube (dynamic ids: a cube only ever waits on tiles that a
/// running cube already holds, so the look-back cannot deadlock).
#[cube]
pub fn take_ticket(counter: &Atomic<u64>, broadcast: &mut SharedMemory<u64>) -> u64 {
    if UNIT_POS == 0 {
        broadcast[0] = counter.fetch_add(1u64);
    }
    sync_cube();
    let ticket = broadcast[0];
    sync_cube();
    ticket
}

/// Publishes `tile`'s aggregate in `states[base + tile]` and returns the exclusive prefix of all
/// earlier tiles. Called by one unit only.
#[cube]
pub fn look_back(states: &Tensor<Atomic<u64>>, base: usize, tile: usize, aggregate: u64) -> u64 {
    let mut prefix = 0u64;
    if tile == 0 {
        states[base].store(FLAG_INCLUSIVE | aggregate);
    } else {
        states[base + tile].store(FLAG_AGGREGATE | aggregate);
        let mut look = base + tile - 1;
        let mut searching = true;
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
        states[base + tile].store(FLAG_INCLUSIVE | (prefix + aggregate));
    }
    prefix
}

/// Records an error key (atomic minimum) and returns the old key, which the caller must keep in a
/// data dependency of its "done" increment so that the minimum is performed first.
#[cube]
pub fn report_error(key_word: &Atomic<u64>, key: u64) -> u64 {
    key_word.fetch_min(key)
}

/// Counts this cube as done; returns true in the one unit of the last cube to finish.
///
/// `dependency` is `old >> 63` of the cube's error reports (always 0): adding it makes the
/// increment wait for those atomics, so the last cube sees every error key.
#[cube]
pub fn publish_block_done(done: &Atomic<u64>, cubes: u64, dependency: u64) -> bool {
    let mut last = false;
    if UNIT_POS == 0 {
        let finished = done.fetch_add(1u64 + dependency);
        last = finished + 1 == cubes;
    }
    last
}
