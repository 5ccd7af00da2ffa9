//! kv-canary write and verify (spec `canary-write-verify.md` §6-§9): one launch each.
//!
//! Every i64 array is bound as `u64` (same bits): equality is the same, hashing needs logical
//! shifts, and a negative value is read from its sign bit. A slot outside the buffer, a source row
//! outside a source and an offset outside the token arrays are never dereferenced (§11): reads
//! there give 0 and writes are dropped.
//!
//! Write: request `r` is owned by a group of units that walk its entries in order, in lockstep;
//! only the chain fold is serial, the loads, stores and checks of a tile are spread over the
//! group. Fingerprints depend only on the slot, so under a real-KV mode a separate set of cubes
//! folds them for every entry in parallel and stores field 3, which the chain walk never touches.
//!
//! Verify: one entry per unit, grid-striding; one atomic per violation row.

use cubecl::prelude::*;

use crate::hash::{mix, mix3};
use crate::scan::{CUBE_SIZE, cube_exclusive_scan};

/// Counter word: violations ever recorded (`violation_write_index`).
pub const WRITE_INDEX: usize = 0;
/// Counter word: `slot_run_counter`.
pub const SLOT_RUN: usize = 1;
/// Counter word: `kernel_run_counter`.
pub const KERNEL_RUN: usize = 2;
/// Counter words.
pub const COUNTERS: usize = 3;
/// i64 words of a violation row.
pub const ROW_WORDS: usize = 8;
/// `MAX_REAL_KV_SOURCES`.
pub const MAX_SOURCES: usize = 4;
/// `mix(CANARY_CHAIN_ANCHOR)`: the link of a chain head.
pub const ANCHOR_LINK: u64 = 0xDE7F_AE23_A9A1_B716;

/// `RealKvHashMode::NONE`.
pub const MODE_NONE: u8 = 0;
/// `RealKvHashMode::PARTIAL`.
pub const MODE_PARTIAL: u8 = 1;
/// `RealKvHashMode::ALL`.
pub const MODE_ALL: u8 = 2;

const FAIL_CHAIN: u64 = 1;
const FAIL_VERIFY_POSITION: u64 = 2;
const FAIL_REAL_KV: u64 = 4;
const FAIL_WRITE_TOKEN: u64 = 8;
const FAIL_WRITE_POSITION: u64 = 16;
const FAIL_VERIFY_TOKEN: u64 = 32;

/// The canary's shape and the launch's scalars.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct CanaryShape {
    /// `N`.
    pub num_slots: u64,
    /// `S / 8`.
    pub slot_words: u64,
    /// `C`.
    pub ring_capacity: u64,
    /// Plan capacity: `K` (write) or `V` (verify).
    pub capacity: u64,
    /// Length `T` of the token arrays (write).
    pub tokens: u64,
    /// Cubes that walk request chains (write).
    pub chain_cubes: u64,
    /// Units of the grid-stride loop (fingerprints for write, entries for verify).
    pub stride_units: u64,
    /// `kernel_kind`, sign-extended.
    pub kernel_kind: u64,
}

/// One real-KV source, in u64 words (all its byte sizes are multiples of 16).
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct SourceLayout {
    /// Words bound.
    pub words: u64,
    /// Words per row (the row stride).
    pub row_words: u64,
    /// Slots per row.
    pub page_size: u64,
    /// Words per slot strip.
    pub strip_words: u64,
    /// Words `ALL` folds.
    pub read_words: u64,
}

/// Compile-time switches of a launch.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct CanaryFeatures {
    /// `MODE_NONE`, `MODE_PARTIAL` or `MODE_ALL`.
    pub mode: u8,
    /// Sources bound (0..=4); unused bindings are stand-ins.
    pub sources: u8,
    /// Write: `enable_write_input_assert`.
    pub input_assert: bool,
    /// Write: a chain-position flag tensor is bound.
    pub chain_assert: bool,
    /// Verify: `check_verify_expected_token`.
    pub check_token: bool,
    /// Write: planes are exactly `GROUP` units wide and support shuffles, so a group takes the
    /// tile's values from its units' registers instead of loading each one again.
    pub shuffle: bool,
    /// Verify, mode `ALL`: words of every strip the cube stages per round (`staged_strip`),
    /// as many as the device's shared memory holds; 0 where each unit folds its own strip.
    pub stage_words: u32,
}

impl CanaryFeatures {
    /// Whether records carry a fingerprint.
    pub fn fingerprints(&self) -> bool {
        self.mode != MODE_NONE && self.sources > 0
    }
}

/// A slot record's fields 0..3.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Record {
    token: u64,
    position: u64,
    chain: u64,
    real_kv: u64,
}

/// The record of `slot`, zeros when the slot is outside the buffer.
#[cube]
fn read_record(buffer: &Tensor<u64>, slot: u64, shape: &CanaryShape) -> Record {
    let mut record = Record {
        token: 0u64.runtime(),
        position: 0u64.runtime(),
        chain: 0u64.runtime(),
        real_kv: 0u64.runtime(),
    };
    if slot < shape.num_slots {
        let base = (slot * shape.slot_words) as usize;
        record.token = buffer[base];
        record.position = buffer[base + 1];
        record.chain = buffer[base + 2];
        record.real_kv = buffer[base + 3];
    }
    record
}

/// `link(s)`: anchor for a negative slot, else the mix of the slot's record.
#[cube]
fn link(buffer: &Tensor<u64>, slot: u64, shape: &CanaryShape) -> u64 {
    let mut value = ANCHOR_LINK.runtime();
    if slot >> 63 == 0 {
        let record = read_record(buffer, slot, shape);
        value = mix3(record.chain, record.token, record.position);
    }
    value
}

/// Words of a strip loaded before they are folded, in write: a 256-byte strip (the common `ALL`
/// case) is one round trip to memory, which a decode step waits for. Verify streams many strips
/// per SM and keeps more of them in flight with smaller batches (larger ones cost occupancy).
const WRITE_STRIP_BATCH: u32 = 32;
/// Words of a strip loaded before they are folded, in verify.
const VERIFY_STRIP_BATCH: u32 = 8;

/// One source's fold of `slot`'s strip: `PARTIAL` folds 2 words, `ALL` `read_words`.
#[cube]
fn fold_strip(
    source: &Tensor<u64>,
    layout: &SourceLayout,
    slot: u64,
    #[comptime] mode: u8,
    #[comptime] batch: u32,
) -> u64 {
    let start = strip_start(layout, slot);
    let words = if comptime![mode == MODE_PARTIAL] {
        2u64.runtime()
    } else {
        layout.read_words
    };
    let batch_size = comptime![if mode == MODE_PARTIAL {
        2
    } else {
        batch as usize
    }];
    let mut h = 0u64.runtime();
    let mut k = 0u64.runtime();
    while k < words {
        let mut batch = Array::<u64>::new(batch_size);
        #[unroll]
        for j in 0..batch_size {
            let index = start + k + j as u64;
            let mut word = 0u64.runtime();
            if k + (j as u64) < words && index < layout.words {
                word = source[index as usize];
            }
            batch[j] = word;
        }
        #[unroll]
        for j in 0..batch_size {
            if k + (j as u64) < words {
                h = mix(h ^ batch[j]);
            }
        }
        k += batch_size as u64;
    }
    h
}

/// The first word of `slot`'s strip in a source.
#[cube]
fn strip_start(layout: &SourceLayout, slot: u64) -> u64 {
    // A 64-bit division sits between the slot's load and the strip's: token-granular caches
    // (page size 1, the common case) skip it.
    let mut start = slot * layout.row_words;
    if layout.page_size != 1 {
        start = (slot / layout.page_size) * layout.row_words
            + (slot % layout.page_size) * layout.strip_words;
    }
    start
}

/// Words of every strip a staging round holds where shared memory allows: a 128-byte line.
pub const STAGE_WORDS: u32 = 16;

// A stage of `stage_words` words per strip holds each unit's strip row (padded by one word, so
// that the fold's reads, one word of every unit's strip at a time, fall in different banks), then
// the units' strip starts, then their word counts.

/// Where a stage's strip starts begin.
const fn stage_starts(stage_words: u32) -> u32 {
    CUBE_SIZE * (stage_words + 1)
}

/// Where a stage's word counts begin.
const fn stage_limits(stage_words: u32) -> u32 {
    stage_starts(stage_words) + CUBE_SIZE
}

/// Shared words of a stage.
pub const fn stage_len(stage_words: u32) -> u32 {
    stage_limits(stage_words) + CUBE_SIZE
}

/// The strip and word a unit handles in slot `r` of a staging round: cell `q = r * CUBE_SIZE +
/// unit` is word `q % stage_words` of strip `q / stage_words`, so consecutive units cover one
/// strip's line.
#[cube]
fn round_cell(#[comptime] r: u32, #[comptime] stage_words: u32) -> (usize, usize) {
    let q = (r * CUBE_SIZE) as usize + UNIT_POS as usize;
    (q / stage_words as usize, q % stage_words as usize)
}

/// A unit's loads of staging round `k` (words `k..k + stage_words` of every strip, its cells by
/// [`round_cell`]), all issued before any is used. Words past a strip's count (none at all for a
/// strip not wanted) are 0.
#[cube]
fn load_round(
    source: &Tensor<u64>,
    layout: &SourceLayout,
    stage: &Shared<[u64]>,
    k: u64,
    lines: &mut Array<u64>,
    #[comptime] stage_words: u32,
) {
    let starts = comptime![stage_starts(stage_words) as usize];
    let limits = comptime![stage_limits(stage_words) as usize];
    #[unroll]
    for r in 0..stage_words {
        let (strip, cell) = round_cell(r, stage_words);
        let word = k + cell as u64;
        let index = stage[starts + strip] + word;
        let mut value = 0u64.runtime();
        if word < stage[limits + strip] && index < layout.words {
            value = source[index as usize];
        }
        lines[r as usize] = value;
    }
}

/// [`fold_strip`] of an `ALL` strip for every unit of the cube at once (all units call it, each
/// with its own `slot`; a unit that is not `wanted` gets an unspecified value). One unit's own
/// strip is a serial fold, but reading it alone makes every load of a plane touch 32 random
/// lines, a sector at a time: DRAM then serves 32- or 64-byte pieces of each strip, at random.
/// Here the cube loads a line of each of its strips per round, 16 units to a line (whole lines,
/// coalesced), into shared memory, and then each unit folds its own.
#[cube]
fn staged_strip(
    source: &Tensor<u64>,
    layout: &SourceLayout,
    slot: u64,
    wanted: bool,
    stage: &mut Shared<[u64]>,
    #[comptime] stage_words: u32,
) -> u64 {
    let pitch = comptime![(stage_words + 1) as usize];
    let starts = comptime![stage_starts(stage_words) as usize];
    let limits = comptime![stage_limits(stage_words) as usize];
    let unit = UNIT_POS as usize;
    let words = layout.read_words;
    stage[starts + unit] = strip_start(layout, slot);
    stage[limits + unit] = select(wanted, words, 0u64);
    sync_cube();
    let mut lines = Array::<u64>::new(stage_words as usize);
    let mut h = 0u64.runtime();
    let mut k = 0u64.runtime();
    while k < words {
        load_round(source, layout, &*stage, k, &mut lines, stage_words);
        #[unroll]
        for r in 0..stage_words {
            let (strip, cell) = round_cell(r, stage_words);
            stage[strip * pitch + cell] = lines[r as usize];
        }
        sync_cube();
        #[unroll]
        for j in 0..stage_words {
            if k + (j as u64) < words {
                h = mix(h ^ stage[unit * pitch + j as usize]);
            }
        }
        sync_cube();
        k += stage_words as u64;
    }
    h
}

/// How a launch folds real-KV strips (compile-time).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
struct StripFold {
    /// `MODE_PARTIAL` or `MODE_ALL`.
    mode: u8,
    /// Words a unit folding alone loads before folding them.
    batch: u32,
    /// Words per strip of a cube-staged round (`staged_strip`); 0 where each unit folds alone.
    stage_words: u32,
}

/// One source's fold of `slot`'s strip, as `fold` says.
#[cube]
fn source_fold(
    source: &Tensor<u64>,
    layout: &SourceLayout,
    slot: u64,
    wanted: bool,
    stage: &mut Shared<[u64]>,
    #[comptime] fold: StripFold,
) -> u64 {
    if comptime![fold.stage_words > 0] {
        staged_strip(source, layout, slot, wanted, stage, fold.stage_words)
    } else {
        fold_strip(source, layout, slot, fold.mode, fold.batch)
    }
}

/// `fp(s)` over the bound sources, in launch order. A staged fold needs every unit of the cube,
/// each with its `slot` and whether it `wants` the value, and a stage of [`stage_len`] words; a
/// unit folding alone ignores `wanted` and `stage`.
#[cube]
fn fingerprint(
    sources: &Sources,
    layouts: &Layouts,
    slot: u64,
    wanted: bool,
    stage: &mut Shared<[u64]>,
    #[comptime] count: u8,
    #[comptime] fold: StripFold,
) -> u64 {
    let mut acc = 0u64.runtime();
    if comptime![count > 0] {
        acc = mix(acc ^ source_fold(&sources.s0, &layouts.l0, slot, wanted, stage, fold));
    }
    if comptime![count > 1] {
        acc = mix(acc ^ source_fold(&sources.s1, &layouts.l1, slot, wanted, stage, fold));
    }
    if comptime![count > 2] {
        acc = mix(acc ^ source_fold(&sources.s2, &layouts.l2, slot, wanted, stage, fold));
    }
    if comptime![count > 3] {
        acc = mix(acc ^ source_fold(&sources.s3, &layouts.l3, slot, wanted, stage, fold));
    }
    acc
}

/// The four source bindings (stand-ins past `features.sources`).
#[derive(CubeType, CubeLaunch)]
pub struct Sources {
    /// Source 0.
    pub s0: OwnedTensor<u64>,
    /// Source 1.
    pub s1: OwnedTensor<u64>,
    /// Source 2.
    pub s2: OwnedTensor<u64>,
    /// Source 3.
    pub s3: OwnedTensor<u64>,
}

/// The four source layouts.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct Layouts {
    /// Source 0.
    pub l0: SourceLayout,
    /// Source 1.
    pub l1: SourceLayout,
    /// Source 2.
    pub l2: SourceLayout,
    /// Source 3.
    pub l3: SourceLayout,
}

/// Stores a violation row at ring index `index` when the ring has room there.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_row(
    ring: &mut Tensor<u64>,
    index: u64,
    shape: &CanaryShape,
    slot: u64,
    position: u64,
    stored_token: u64,
    expected_token: u64,
    chain: u64,
    expected_aux: u64,
    bits: u64,
) {
    if index < shape.ring_capacity {
        let base = index as usize * ROW_WORDS;
        ring[base] = shape.kernel_kind;
        ring[base + 1] = slot;
        ring[base + 2] = position;
        ring[base + 3] = stored_token;
        ring[base + 4] = expected_token;
        ring[base + 5] = chain;
        ring[base + 6] = expected_aux;
        ring[base + 7] = bits;
    }
}

/// `clamp(value, 0, capacity)` of a device i32 count.
#[cube]
fn active_count(count: &Tensor<i32>, capacity: u64) -> u64 {
    clamp_count(count[0], capacity)
}

/// `clamp(value, 0, capacity)`.
#[cube]
fn clamp_count(value: i32, capacity: u64) -> u64 {
    let mut active = 0u64.runtime();
    if value > 0 {
        active = u64::cast_from(value);
    }
    if active > capacity {
        active = capacity;
    }
    active
}

/// `offsets[r]` clamped into `[0, tokens]` (out-of-range offsets are a precondition, §11).
#[cube]
fn token_offset(offsets: &Tensor<u64>, r: u64, tokens: u64) -> u64 {
    let offset = offsets[r as usize];
    let mut clamped = offset;
    if offset >> 63 == 1 {
        clamped = 0u64;
    }
    if clamped > tokens {
        clamped = tokens;
    }
    clamped
}

/// The step's per-token arrays (§6): the write kernel's view of `WriteInputs`. The expected
/// arrays are stand-ins when the input assert is off.
#[derive(CubeType, CubeLaunch)]
pub struct StepTokens {
    /// `input_ids`.
    pub input_ids: OwnedTensor<u64>,
    /// `positions`.
    pub positions: OwnedTensor<u64>,
    /// `out_cache_loc`.
    pub out_cache_loc: OwnedTensor<u64>,
    /// `expected_input_tokens`.
    pub expected_tokens: OwnedTensor<u64>,
    /// `expected_input_positions`.
    pub expected_positions: OwnedTensor<u64>,
}

/// Units that own one request: they walk its chain in lockstep, each folding the same values, so
/// every unit can keep the chain value of its own entry of a tile while the loads, stores and
/// checks of the tile run in parallel. Only the fold is serial. Where a plane is exactly one group
/// (CUDA) the units take the tile's values from each other by plane shuffles; elsewhere (lavapipe,
/// CI's device, whose planes CubeCL does not expose) each unit loads them. No barrier either way:
/// lavapipe was seen to mis-run loops that hold one.
pub const GROUP: u32 = 32;
/// Requests per write cube.
pub const GROUPS_PER_CUBE: u32 = CUBE_SIZE / GROUP;

/// Write (spec §6). Cubes `[0, chain_cubes)` walk one request per group of `GROUP` units; under a
/// real-KV mode the remaining cubes fold fingerprints over all active entries.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn canary_write_kernel(
    buffer: &mut Tensor<u64>,
    ring: &mut Tensor<u64>,
    counters: &Tensor<Atomic<u64>>,
    offsets: &Tensor<u64>,
    seeds: &Tensor<u64>,
    num_valid_reqs: &Tensor<i32>,
    tokens: &StepTokens,
    chain_assert: &Tensor<i32>,
    sources: &Sources,
    layouts: &Layouts,
    shape: CanaryShape,
    #[comptime] features: CanaryFeatures,
) {
    // The active count is read where it is needed, after the loads that do not depend on it
    // were issued: a decode step is a chain of dependent loads.
    if (CUBE_POS as u64) < shape.chain_cubes {
        let mut shared = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
        let lane = UNIT_POS % GROUP;
        // Requests are dealt to cubes round-robin, so a few long requests get an SM each.
        let r = (UNIT_POS / GROUP) as u64 * shape.chain_cubes + CUBE_POS as u64;
        let mut written = 0u64.runtime();
        if r < shape.capacity {
            // Loaded before the count is tested, not after it.
            let seed = seeds[r as usize];
            let start = token_offset(offsets, r, shape.tokens);
            let end = token_offset(offsets, r + 1, shape.tokens);
            if r < active_count(num_valid_reqs, shape.capacity) {
                written = write_request(
                    buffer,
                    ring,
                    counters,
                    tokens,
                    chain_assert,
                    seed,
                    start,
                    end,
                    lane,
                    &shape,
                    features,
                );
            }
        }
        // One counter update per cube; the group's units all hold the same count.
        let mut own = 0u64.runtime();
        if lane == 0 {
            own = written;
        }
        let (_, total) = cube_exclusive_scan(own, &mut shared, false);
        if UNIT_POS == 0 {
            if total > 0 {
                counters[SLOT_RUN].fetch_add(total);
            }
            if CUBE_POS == 0 {
                counters[KERNEL_RUN].fetch_add(1u64);
            }
        }
    } else if comptime![features.fingerprints()] {
        // Every token's fingerprint is folded before the active range is known: the range needs
        // two dependent loads (the count, then its offset), which would otherwise delay a decode
        // step's fold. A fingerprint depends only on its slot and is stored only when in range.
        let count = num_valid_reqs[0];
        // Tokens are dealt to the fingerprint cubes round-robin: a decode step's few strips
        // spread over many SMs instead of queueing in one SM's L1 (each lane reads its own strip,
        // so a warp's loads do not coalesce).
        let cubes = shape.stride_units / CUBE_SIZE as u64;
        let mut unused_stage = Shared::<[u64]>::new_slice(1usize);
        let unit = UNIT_POS as u64 * cubes + (CUBE_POS as u64 - shape.chain_cubes);
        let mut i = unit;
        while i < shape.tokens {
            let slot = tokens.out_cache_loc[i as usize];
            if slot < shape.num_slots {
                let fold = comptime![StripFold {
                    mode: features.mode,
                    batch: WRITE_STRIP_BATCH,
                    stage_words: 0,
                }];
                let value = fingerprint(
                    sources,
                    layouts,
                    slot,
                    true,
                    &mut unused_stage,
                    features.sources,
                    fold,
                );
                let first = token_offset(offsets, 0, shape.tokens);
                let requests = clamp_count(count, shape.capacity);
                let end = token_offset(offsets, requests, shape.tokens);
                if i >= first && i < end {
                    buffer[(slot * shape.slot_words) as usize + 3] = value;
                }
            }
            i += shape.stride_units;
        }
    }
}

/// The write-assert outcome of one stored entry: the input-assert bits (0 when it holds) and
/// whether the chain-position assert fails.
#[cube]
fn entry_asserts(
    tokens: &StepTokens,
    index: u64,
    token: u64,
    position: u64,
    last_position: u64,
    position_check: bool,
    #[comptime] features: CanaryFeatures,
) -> (u64, bool) {
    let mut input_bits = 0u64.runtime();
    if comptime![features.input_assert] {
        if token != tokens.expected_tokens[index as usize] {
            input_bits |= FAIL_WRITE_TOKEN;
        }
        if position != tokens.expected_positions[index as usize] {
            input_bits |= FAIL_WRITE_POSITION;
        }
    }
    (input_bits, position_check && position != last_position + 1)
}

/// The state of one request's walk. Every unit of the group holds the same values, except the
/// `own_*` fields, which belong to the unit's entry of the current tile.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Walk {
    /// Chain value the next stored entry gets.
    h: u64,
    /// Position of the last stored entry (the chain-position assert's reference).
    last_position: u64,
    /// Assert rows so far.
    rows: u64,
    /// Entries stored so far.
    written: u64,
    /// Slot of the unit's entry (`u64::MAX` when it has none).
    own_slot: u64,
    /// Token of the unit's entry.
    own_token: u64,
    /// Position of the unit's entry.
    own_position: u64,
    /// Chain value of the unit's entry.
    own_chain: u64,
    /// A later entry of the tile writes the same slot: the unit must not store.
    own_superseded: bool,
}

/// The three per-token values of one entry; a unit past the request holds a skipped entry.
#[derive(CubeType, Clone, Copy)]
#[expand(derive(Clone, Copy))]
struct Entry {
    slot: u64,
    token: u64,
    position: u64,
}

/// Entry `index` when it is before `end`, else a skipped entry.
#[cube]
fn load_entry(tokens: &StepTokens, index: u64, end: u64) -> Entry {
    let mut entry = Entry {
        slot: u64::MAX.runtime(),
        token: 0u64.runtime(),
        position: 0u64.runtime(),
    };
    if index < end {
        entry.slot = tokens.out_cache_loc[index as usize];
        entry.token = tokens.input_ids[index as usize];
        entry.position = tokens.positions[index as usize];
    }
    entry
}

/// Entries folded between loop tests: enough independent loads to hide behind the serial fold,
/// few enough that the loop's code stays in the instruction cache.
const UNROLL: u32 = 8;

/// One entry of the walk: entry `j` of the tile that starts at `tile`. Branch-free, so that the
/// loads of later entries can be issued while the fold of this one is still in flight.
#[cube]
#[allow(clippy::too_many_arguments)]
fn walk_entry(
    walk: &mut Walk,
    tokens: &StepTokens,
    tile: u64,
    j: u32,
    lane: u32,
    position_check: bool,
    #[comptime] features: CanaryFeatures,
) {
    let index = tile + j as u64;
    let slot = if comptime![features.shuffle] {
        plane_shuffle(walk.own_slot, j)
    } else {
        tokens.out_cache_loc[index as usize]
    };
    let token = if comptime![features.shuffle] {
        plane_shuffle(walk.own_token, j)
    } else {
        tokens.input_ids[index as usize]
    };
    let position = if comptime![features.shuffle] {
        plane_shuffle(walk.own_position, j)
    } else {
        tokens.positions[index as usize]
    };
    let stored = slot >> 63 == 0;
    walk.own_chain = select(j == lane, walk.h, walk.own_chain);
    walk.own_superseded = walk.own_superseded || (j > lane && slot == walk.own_slot);
    // With shuffles, `tile_counts` keeps these counts once per tile, beside the serial fold.
    if comptime![!features.shuffle] {
        if comptime![features.input_assert || features.chain_assert] {
            let (input_bits, chain_fails) = entry_asserts(
                tokens,
                index,
                token,
                position,
                walk.last_position,
                position_check,
                features,
            );
            let rows = select(input_bits != 0, 1u64, 0u64) + select(chain_fails, 1u64, 0u64);
            walk.rows += select(stored, rows, 0u64);
            walk.last_position = select(stored, position, walk.last_position);
        }
        walk.written += select(stored, 1u64, 0u64);
    }
    walk.h = select(stored, mix3(walk.h, token, position), walk.h);
}

/// The walk's counts over one tile, where planes are the group (`features.shuffle`): each unit
/// checks its own entry's asserts, and ballots count the stored entries and the rows. None of it
/// depends on the chain value, so it runs beside the fold instead of adding to each of its steps.
/// Units past the request hold a skipped entry (`load_entry`), so they count nothing.
#[cube]
fn tile_counts(
    walk: &mut Walk,
    tokens: &StepTokens,
    tile: u64,
    lane: u32,
    position_check: bool,
    #[comptime] features: CanaryFeatures,
) {
    let stored = walk.own_slot >> 63 == 0;
    let stored_lanes = plane_ballot(stored).extract(0usize);
    walk.written += u64::cast_from(stored_lanes.count_ones());
    if comptime![features.input_assert || features.chain_assert] {
        // The chain-position assert compares with the last stored entry before this one: an
        // earlier unit's, or the previous tiles' when no earlier unit stores.
        let earlier = stored_lanes & ((1u32 << lane) - 1);
        let previous = plane_shuffle(walk.own_position, last_lane(earlier));
        let last_position = select(earlier == 0, walk.last_position, previous);
        let mut input_fails = false;
        let mut chain_fails = false;
        if stored {
            let (input_bits, position_fails) = entry_asserts(
                tokens,
                tile + lane as u64,
                walk.own_token,
                walk.own_position,
                last_position,
                position_check,
                features,
            );
            input_fails = input_bits != 0;
            chain_fails = position_fails;
        }
        let rows = plane_ballot(input_fails).extract(0usize).count_ones()
            + plane_ballot(chain_fails).extract(0usize).count_ones();
        walk.rows += u64::cast_from(rows);
        let tile_last = plane_shuffle(walk.own_position, last_lane(stored_lanes));
        walk.last_position = select(stored_lanes == 0, walk.last_position, tile_last);
    }
}

/// The highest unit whose bit is set in `lanes` (0 when none is).
#[cube]
fn last_lane(lanes: u32) -> u32 {
    select(lanes == 0, 0u32, 31u32 - lanes.leading_zeros())
}

/// One request's write, by its group (`lane` is the unit's place in it). The group walks the
/// entries a tile of `GROUP` at a time: every unit folds the whole tile (the same loads, so the
/// same values) and keeps the chain value of entry `tile + lane`, then stores that entry's record.
/// Within a tile, a slot written twice is stored by its later entry only; across tiles the
/// group's stores follow its program order.
/// The assert rows are only counted on the way; when there are any, lane 0 reserves them in one
/// block and walks the request again to store them in entry order (no atomic inside a loop:
/// lavapipe was seen to drop the code after such a loop). Returns the records written.
#[cube]
// A compile-time `if` holds the runtime one: the two cannot be collapsed.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn write_request(
    buffer: &mut Tensor<u64>,
    ring: &mut Tensor<u64>,
    counters: &Tensor<Atomic<u64>>,
    tokens: &StepTokens,
    chain_assert: &Tensor<i32>,
    seed: u64,
    start: u64,
    end: u64,
    lane: u32,
    shape: &CanaryShape,
    #[comptime] features: CanaryFeatures,
) -> u64 {
    let seed_record = read_record(&*buffer, seed, shape);
    let mut head = ANCHOR_LINK.runtime();
    if seed >> 63 == 0 {
        head = mix3(seed_record.chain, seed_record.token, seed_record.position);
    }
    let mut position_check = false.runtime();
    if comptime![features.chain_assert] {
        position_check = seed >> 63 == 0 && chain_assert[0] != 0;
    }
    let mut walk = Walk {
        h: head,
        last_position: seed_record.position,
        rows: 0u64.runtime(),
        written: 0u64.runtime(),
        own_slot: u64::MAX.runtime(),
        own_token: 0u64.runtime(),
        own_position: 0u64.runtime(),
        own_chain: 0u64.runtime(),
        own_superseded: false.runtime(),
    };
    // Each unit loads its own entry of the next tile before the group folds this one: one
    // coalesced load per tile, in flight during the fold.
    let mut next = load_entry(tokens, start + lane as u64, end);
    let mut tile = start;
    while tile < end {
        walk.own_slot = next.slot;
        walk.own_token = next.token;
        walk.own_position = next.position;
        walk.own_superseded = false;
        let following = tile + GROUP as u64;
        if following < end {
            let entry = load_entry(tokens, following + lane as u64, end);
            next.slot = entry.slot;
            next.token = entry.token;
            next.position = entry.position;
        }
        if comptime![features.shuffle] {
            tile_counts(&mut walk, tokens, tile, lane, position_check, features);
        }
        if tile + GROUP as u64 <= end {
            for chunk in 0..GROUP / UNROLL {
                #[unroll]
                for k in 0..UNROLL {
                    walk_entry(
                        &mut walk,
                        tokens,
                        tile,
                        chunk * UNROLL + k,
                        lane,
                        position_check,
                        features,
                    );
                }
            }
        } else {
            // The request's last, partial tile (a decode step's only one).
            let count = (end - tile) as u32;
            for j in 0..count {
                walk_entry(&mut walk, tokens, tile, j, lane, position_check, features);
            }
        }
        if walk.own_slot < shape.num_slots && !walk.own_superseded {
            let record = (walk.own_slot * shape.slot_words) as usize;
            buffer[record] = walk.own_token;
            buffer[record + 1] = walk.own_position;
            buffer[record + 2] = walk.own_chain;
            if comptime![!features.fingerprints()] {
                buffer[record + 3] = 0u64;
            }
        }
        tile += GROUP as u64;
    }
    if comptime![features.input_assert || features.chain_assert] {
        if walk.rows > 0 && lane == 0 {
            let row = counters[WRITE_INDEX].fetch_add(walk.rows);
            store_assert_rows(
                ring,
                tokens,
                head,
                seed_record.position,
                position_check,
                start,
                end,
                row,
                shape,
                features,
            );
        }
    }
    walk.written
}

/// The assert rows of one request, from ring index `row` on, in entry order: the walk of
/// `write_request` again, storing what it counted.
#[cube]
#[allow(clippy::too_many_arguments)]
fn store_assert_rows(
    ring: &mut Tensor<u64>,
    tokens: &StepTokens,
    head: u64,
    seed_position: u64,
    position_check: bool,
    start: u64,
    end: u64,
    row: u64,
    shape: &CanaryShape,
    #[comptime] features: CanaryFeatures,
) {
    let mut h = head;
    let mut last_position = seed_position;
    let mut row = row;
    let mut i = start;
    while i < end {
        let slot = tokens.out_cache_loc[i as usize];
        if slot >> 63 == 0 {
            let token = tokens.input_ids[i as usize];
            let position = tokens.positions[i as usize];
            let (input_bits, chain_fails) = entry_asserts(
                tokens,
                i,
                token,
                position,
                last_position,
                position_check,
                features,
            );
            if input_bits != 0 {
                let expected_token = tokens.expected_tokens[i as usize];
                let expected_position = tokens.expected_positions[i as usize];
                store_row(
                    ring,
                    row,
                    shape,
                    slot,
                    position,
                    token,
                    expected_token,
                    h,
                    expected_position,
                    input_bits,
                );
                row += 1;
            }
            if chain_fails {
                store_row(
                    ring,
                    row,
                    shape,
                    slot,
                    position,
                    token,
                    token,
                    h,
                    last_position + 1,
                    FAIL_WRITE_POSITION,
                );
                row += 1;
            }
            last_position = position;
            h = mix3(h, token, position);
        }
        i += 1;
    }
}

/// Verify (spec §7): one entry per unit over a grid-stride loop (in step with its cube where an
/// `ALL` fingerprint is staged by the whole cube).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn canary_verify_kernel(
    buffer: &Tensor<u64>,
    ring: &mut Tensor<u64>,
    counters: &Tensor<Atomic<u64>>,
    slot_indices: &Tensor<u64>,
    expected_tokens: &Tensor<u64>,
    expected_positions: &Tensor<u64>,
    prev_slot_indices: &Tensor<u64>,
    num_valid: &Tensor<i32>,
    enable: &Tensor<i32>,
    sources: &Sources,
    layouts: &Layouts,
    shape: CanaryShape,
    #[comptime] features: CanaryFeatures,
) {
    let mut stage = Shared::<[u64]>::new_slice(comptime![if features.stage_words > 0 {
        stage_len(features.stage_words) as usize
    } else {
        1usize
    }]);
    let enabled = enable[0] != 0;
    let entries = active_count(num_valid, shape.capacity);
    if ABSOLUTE_POS == 0 {
        counters[KERNEL_RUN].fetch_add(1u64);
        if enabled {
            counters[SLOT_RUN].fetch_add(entries);
        }
    }
    if enabled {
        // A staged cube walks its entries together (`base` is the same in all its units); other
        // units walk alone.
        let mut lead = 0u64.runtime();
        if comptime![features.stage_words > 0] {
            lead = UNIT_POS as u64;
        }
        let mut base = ABSOLUTE_POS as u64 - lead;
        while base < entries {
            verify_entry(
                buffer,
                ring,
                counters,
                slot_indices,
                expected_tokens,
                expected_positions,
                prev_slot_indices,
                sources,
                layouts,
                base + lead,
                entries,
                &mut stage,
                &shape,
                features,
            );
            base += shape.stride_units;
        }
    }
}

/// Entry `k` when `k < entries`; every unit of the cube calls it (see [`fingerprint`]).
#[cube]
// A compile-time `if` holds the runtime one: the two cannot be collapsed.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn verify_entry(
    buffer: &Tensor<u64>,
    ring: &mut Tensor<u64>,
    counters: &Tensor<Atomic<u64>>,
    slot_indices: &Tensor<u64>,
    expected_tokens: &Tensor<u64>,
    expected_positions: &Tensor<u64>,
    prev_slot_indices: &Tensor<u64>,
    sources: &Sources,
    layouts: &Layouts,
    k: u64,
    entries: u64,
    stage: &mut Shared<[u64]>,
    shape: &CanaryShape,
    #[comptime] features: CanaryFeatures,
) {
    let staged = comptime![features.stage_words > 0];
    // Entry 0 stands in past the end: read, never checked.
    let live = k < entries;
    let index = select(live, k, 0u64) as usize;
    let slot = slot_indices[index];
    let checked = live && slot != 0;
    let mut expected_real_kv = 0u64.runtime();
    if comptime![features.fingerprints()] {
        if staged || checked {
            let fold = comptime![StripFold {
                mode: features.mode,
                batch: VERIFY_STRIP_BATCH,
                stage_words: features.stage_words,
            }];
            expected_real_kv = fingerprint(
                sources,
                layouts,
                slot,
                checked,
                stage,
                features.sources,
                fold,
            );
        }
    }
    if checked {
        let prev = prev_slot_indices[index];
        let mut expected_token = u64::MAX.runtime();
        if comptime![features.check_token] {
            expected_token = expected_tokens[index];
        }
        let record = read_record(buffer, slot, shape);
        let mut expected_chain = record.chain;
        if prev != 0 {
            expected_chain = link(buffer, prev, shape);
        }
        let mut bits = 0u64.runtime();
        if record.chain != expected_chain {
            bits |= FAIL_CHAIN;
        }
        if expected_token != u64::MAX && record.token != expected_token {
            bits |= FAIL_VERIFY_TOKEN;
        }
        if record.position != expected_positions[index] {
            bits |= FAIL_VERIFY_POSITION;
        }
        if record.real_kv != expected_real_kv {
            bits |= FAIL_REAL_KV;
        }
        if bits != 0 {
            let index = counters[WRITE_INDEX].fetch_add(1u64);
            store_row(
                ring,
                index,
                shape,
                slot,
                record.position,
                record.token,
                expected_token,
                record.chain,
                expected_chain,
                bits,
            );
        }
    }
}
