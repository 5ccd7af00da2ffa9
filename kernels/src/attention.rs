//! Paged attention: every token's query heads attend over the K/V rows at its run of a slot list.
//!
//! A one-cube check of every run and slot writes a status once for a step's runs, and the runs
//! record: that status, then each token's start, then each token's count, as i64, one buffer a
//! layer's launch binds instead of three. Each layer's attention launch reads it and runs only on
//! a clear status (on an error its output is NaN, so
//! nothing reads a row it was not given). A cube per (token, head) walks the token's keys in
//! chunks, in their order, with a running max: the same token over the same keys
//! gives the same bits whatever else is in the launch (a verify window and a plain step agree).
//! Scores, sums and partials are kept in an accumulator type `A` (f32 for half-precision
//! queries and pools, else their own): a bf16 cache still attends in f32.

use cubecl::prelude::*;

use crate::scan::CUBE_SIZE;
use crate::status::{CODE, COUNT, FACTS, KEY_RUN, KEY_SLOT, OK, STATUS_LEN};

/// The fewest units of an attention cube: one per head dimension, rounded up to a plane of 32,
/// and at least this many; each unit scores one key per chunk.
pub const MIN_UNITS: usize = 64;
/// The widest head an attention cube holds (one unit per dimension).
pub const MAX_HEAD_DIM: usize = 256;

/// Units of a plane where planes are fixed at this width (`planes` in the kernels: CUDA), whose
/// plane ops take a chunk's max.
pub const PLANE: usize = 32;

/// Keys whose V rows a unit loads together before it folds them in.
const FOLD: usize = 32;

/// Keys whose V values a unit loads with a staged chunk's K rows, in one round trip.
const STAGED_FOLD: usize = 64;

/// Values of a K tile, the rows of a chunk a cube stages in shared memory at a time.
const TILE: usize = 4096;

/// Tokens (and new rows) up to which a launch stages each chunk's K rows in shared memory
/// (`staged`): read coalesced, a row by consecutive units, with the chunk's first V values in the
/// same round trip; a store-and-attend also finds its keys' new rows among the step's slots in
/// shared memory, not through a claims word. With few cubes a cube's chain of dependent loads is
/// the launch's time and each round trip saved pays; with many, each unit reading its own key's
/// row (no tile, half the registers) keeps more cubes resident (`benches/RESULTS.md`, session 41).
pub const STAGED_TOKENS: usize = 16;

/// Keys of a K tile of heads of `head_dim`: at most a chunk of `units`.
fn tile_keys(head_dim: usize, units: usize) -> usize {
    (TILE / head_dim).clamp(1, units)
}

/// A token's keys are split into this many parts, each attended by a cube of its own into a
/// partial (its max score, sum of weights and weighted V row), which are folded in order by the
/// last part to finish (`store_attention_kv_kernel` with `fold`) or by one more cube a head
/// (`attention_combine_kernel`). Every part is a run of whole chunks of `units` keys
/// fixed by the token's key count alone, so a row is the same bits alone or in any batch.
pub const SPLITS: usize = 8;

/// Values of one partial: the max score, the sum of weights, then the weighted V row (kernels
/// write `head_dim + 2` inline).
pub fn partial_len(head_dim: usize) -> usize {
    head_dim + 2
}

/// Units of the attention cube of heads of `head_dim` (at most `MAX_HEAD_DIM`).
pub fn attention_units(head_dim: usize) -> usize {
    head_dim.next_multiple_of(32).max(MIN_UNITS)
}

/// Scalars of one paged attention, in elements.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct AttentionShape {
    /// Tokens (rows of `q`).
    pub tokens: u64,
    /// Query heads per token.
    pub heads: u64,
    /// Query heads per K/V head.
    pub groups: u64,
    /// Rows of the K and V pools.
    pub pool_rows: u64,
    /// Length of the slot list.
    pub slots_len: u64,
    /// Row stride of `q`.
    pub q_stride: u64,
    /// Row stride of the K pool.
    pub k_stride: u64,
    /// Row stride of the V pool.
    pub v_stride: u64,
    /// Where the V rows' first column is in their pool's rows: past the K columns in a joined
    /// pool (each row K, then V), else 0.
    pub v_offset: u64,
    /// Stride of the slot list.
    pub slots_stride: u64,
    /// Stride of `starts`.
    pub starts_stride: u64,
    /// Stride of `counts`.
    pub counts_stride: u64,
}

/// Scalars of the store an attention launch makes first: the step's new K/V rows and their slots.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct NewRowsShape {
    /// New rows (the length of `loc`).
    pub rows: u64,
    /// Row stride of the new K rows.
    pub k_stride: u64,
    /// Where the K rows' first column is in their tensor: past the queries' columns when the
    /// queries and keys are one tensor, else 0.
    pub k_offset: u64,
    /// Row stride of the new V rows.
    pub v_stride: u64,
    /// Where the V rows' first column is in their tensor: past the keys' columns when the
    /// queries, keys and values are one tensor, else 0.
    pub v_offset: u64,
    /// Stride of `loc`.
    pub loc_stride: u64,
    /// The slots' check claimed `[base, newest]`: a slot's word `w` in it names row `newest - w`
    /// (`crate::slots`). Set on the device from the check's status, not by the launch.
    pub base: u64,
    /// The newest claim of the check.
    pub newest: u64,
}

/// A key read from the step's new rows, not the pools (a flag above every row offset).
const NEW_ROW: u64 = 1 << 63;

/// Length of the runs record of `tokens` tokens: the status, the starts, the counts.
pub fn runs_len(tokens: usize) -> usize {
    STATUS_LEN + 2 * tokens
}

/// The first fault of token `t`'s run: `0` none, `1` the run leaves the slot list, `2 + j` key
/// `j`'s slot is outside the pools.
#[cube]
fn run_fault<S: Int, A: Int, C: Int>(
    slots: &Tensor<S>,
    starts: &Tensor<A>,
    counts: &Tensor<C>,
    t: u64,
    shape: AttentionShape,
) -> u64 {
    let start = i64::cast_from(starts[(t * shape.starts_stride) as usize]);
    let count = i64::cast_from(counts[(t * shape.counts_stride) as usize]);
    let mut fault = 0u64;
    if start < 0 || count < 0 || start as u64 + count as u64 > shape.slots_len {
        fault = 1u64;
    } else {
        let mut j = 0u64;
        while j < count as u64 {
            let slot = i64::cast_from(slots[((start as u64 + j) * shape.slots_stride) as usize]);
            if slot < 0 || slot as u64 >= shape.pool_rows {
                fault = 2 + j;
                j = count as u64;
            } else {
                j += 1;
            }
        }
    }
    fault
}

/// The check: each token's run walked by a group of units; the lowest faulty token is reported
/// (`KEY_RUN` [token, start, count, slots_len] or `KEY_SLOT` [token, key, slot, pool_rows]) in
/// `status` and at the head of `runs`, whose body is every token's start, then every count.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn attention_check_kernel<S: Int, A: Int, C: Int>(
    slots: &Tensor<S>,
    starts: &Tensor<A>,
    counts: &Tensor<C>,
    status: &mut Tensor<i64>,
    runs: &mut Tensor<i64>,
    shape: AttentionShape,
    #[define(S, A, C)] _dtypes: [ElemType; 3],
) {
    let mut first = Shared::<[u64]>::new_slice(CUBE_SIZE as usize);
    let mut t = UNIT_POS as u64;
    while t < shape.tokens {
        runs[STATUS_LEN + t as usize] = i64::cast_from(starts[(t * shape.starts_stride) as usize]);
        runs[STATUS_LEN + (shape.tokens + t) as usize] =
            i64::cast_from(counts[(t * shape.counts_stride) as usize]);
        t += CUBE_SIZE as u64;
    }
    // A group of units a token, as wide as the cube allows (a power of two): each unit walks
    // every `group`-th key of its tokens' runs, so no unit walks a whole long run alone.
    let mut group = 1u64.runtime();
    #[unroll]
    for level in 0..comptime!(CUBE_SIZE.trailing_zeros()) {
        let wider = comptime!(2u64 << level);
        if wider * shape.tokens <= CUBE_SIZE as u64 {
            group = wider;
        }
    }
    // `tokens` stands for "no faulty token".
    let mut lowest = shape.tokens;
    let mut t = UNIT_POS as u64 / group;
    while t < shape.tokens {
        let start = i64::cast_from(starts[(t * shape.starts_stride) as usize]);
        let count = i64::cast_from(counts[(t * shape.counts_stride) as usize]);
        let mut bad = false;
        if start < 0 || count < 0 || start as u64 + count as u64 > shape.slots_len {
            bad = true;
        } else {
            let mut j = UNIT_POS as u64 % group;
            while j < count as u64 {
                let slot =
                    i64::cast_from(slots[((start as u64 + j) * shape.slots_stride) as usize]);
                if slot < 0 || slot as u64 >= shape.pool_rows {
                    bad = true;
                    j = count as u64;
                } else {
                    j += group;
                }
            }
        }
        if bad && t < lowest {
            lowest = t;
        }
        t += CUBE_SIZE as u64 / group;
    }
    // The lowest over the cube, by halves.
    first[UNIT_POS as usize] = lowest;
    #[unroll]
    for level in 0..comptime!(CUBE_SIZE.trailing_zeros()) {
        let half = comptime!((CUBE_SIZE >> (level + 1)) as usize);
        sync_cube();
        if (UNIT_POS as usize) < half {
            let other = first[UNIT_POS as usize + half];
            if other < first[UNIT_POS as usize] {
                first[UNIT_POS as usize] = other;
            }
        }
    }
    sync_cube();
    if UNIT_POS == 0 {
        let token = first[0];
        #[unroll]
        for word in 0..STATUS_LEN {
            status[word] = 0;
        }
        if token == shape.tokens {
            status[CODE] = OK;
            status[COUNT] = shape.tokens as i64;
        } else {
            let fault = run_fault::<S, A, C>(slots, starts, counts, token, shape);
            let start = i64::cast_from(starts[(token * shape.starts_stride) as usize]);
            status[FACTS] = token as i64;
            if fault == 1 {
                status[CODE] = KEY_RUN;
                status[FACTS + 1] = start;
                status[FACTS + 2] = i64::cast_from(counts[(token * shape.counts_stride) as usize]);
                status[FACTS + 3] = shape.slots_len as i64;
            } else {
                let key = fault - 2;
                let index = ((start as u64 + key) * shape.slots_stride) as usize;
                status[CODE] = KEY_SLOT;
                status[FACTS + 1] = key as i64;
                status[FACTS + 2] = i64::cast_from(slots[index]);
                status[FACTS + 3] = shape.pool_rows as i64;
            }
        }
        #[unroll]
        for word in 0..STATUS_LEN {
            runs[word] = status[word];
        }
    }
}

/// The attention over a joined pool (each row a slot's K, then its V at `shape.v_offset`), part
/// by part: cube `((t, h), part)` (flattened over a 2-D grid) writes the partial of its part of
/// token `t`'s keys for query head `h`: the softmax of `q[t, h] . K[slot] / sqrt(head_dim)`
/// relative to the part's max, applied to their V rows. Unit `u` scores key `u` of each chunk of
/// `units` keys and accumulates dimension `u`. With `group` above 1 a cube takes `group` query
/// heads of one K/V head (the launch's cubes are `group` times fewer): their keys' rows are read
/// once for all of them, each head's partial the same bits. `attention_combine_kernel` folds the
/// parts.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn attention_kv_kernel<F: Float, S: Int, A: Float>(
    q: &Tensor<F>,
    kv_pool: &Tensor<F>,
    slots: &Tensor<S>,
    runs: &Tensor<i64>,
    partials: &mut Tensor<A>,
    shape: AttentionShape,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] planes: bool,
    #[comptime] staged: bool,
    #[comptime] group: usize,
    #[define(F, S, A)] _dtypes: [ElemType; 3],
) {
    attend_pools::<F, S, A>(
        q, kv_pool, kv_pool, slots, runs, partials, shape, head_dim, units, planes, staged, group,
    );
}

/// Cube `((t, h), part)` (flattened) of the first of the `group` query heads launch cube `cube`
/// attends: cube `((t, k), part)` takes query heads `k * group ..` (`group` 1: the cube itself).
#[cube]
fn group_cube(cube: u64, shape: AttentionShape, #[comptime] group: usize) -> u64 {
    let mut first = cube;
    if comptime![group > 1] {
        let part = cube % SPLITS as u64;
        let pair = cube / SPLITS as u64;
        let per_token = shape.heads / group as u64;
        let t = pair / per_token;
        let h = (pair % per_token) * group as u64;
        first = (t * shape.heads + h) * SPLITS as u64 + part;
    }
    first
}

/// Dimension `UNIT_POS` of the query rows of cube `((t, h), part)`'s head and the `group - 1`
/// after it (0 past the tokens and the head).
#[cube]
fn query_values<F: Float>(
    q: &Tensor<F>,
    cube: u64,
    shape: AttentionShape,
    #[comptime] head_dim: usize,
    #[comptime] group: usize,
) -> Array<F> {
    let head = cube / SPLITS as u64;
    let t = head / shape.heads;
    let h = head % shape.heads;
    let mut values = Array::<F>::new(group);
    #[unroll]
    for g in 0..group {
        values[g] = F::new(0.0);
        if t < shape.tokens && (UNIT_POS as usize) < head_dim {
            let at = t * shape.q_stride + (h + g as u64) * head_dim as u64;
            values[g] = q[at as usize + UNIT_POS as usize];
        }
    }
    values
}

/// Folds the parts' partials of cube `(t, h)` in order into `out[t, h]`: zeros for a token
/// without keys, NaN on the runs' failed check.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn attention_combine_kernel<F: Float, A: Float>(
    partials: &Tensor<A>,
    runs: &Tensor<i64>,
    out: &mut Tensor<F>,
    shape: AttentionShape,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[define(F, A)] _dtypes: [ElemType; 2],
) {
    let cube = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    if cube < shape.tokens * shape.heads {
        fold_parts::<F, A>(partials, runs, out, shape, cube, head_dim, units);
    }
}

/// Unit `UNIT_POS`'s dimension of pair `(t, h)` (flattened: `pair`): its parts' partials folded
/// in order into `out[t, h]`.
#[cube]
fn fold_parts<F: Float, A: Float>(
    partials: &Tensor<A>,
    runs: &Tensor<i64>,
    out: &mut Tensor<F>,
    shape: AttentionShape,
    pair: u64,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
) {
    let u = UNIT_POS as usize;
    if u < head_dim {
        let t = pair / shape.heads;
        let clear = runs[CODE] == OK;
        let count = select(
            clear,
            runs[STATUS_LEN + (shape.tokens + t) as usize] as u64,
            0u64,
        );
        let per = part_chunks(count, units);
        let width = head_dim + 2;
        let first = pair as usize * SPLITS * width;
        // Every part's values loaded at once, unguarded (one round trip, not one a part; a part
        // without keys wrote nothing and is not folded), then folded in order.
        let mut scores = Array::<A>::new(SPLITS);
        let mut sums = Array::<A>::new(SPLITS);
        let mut accs = Array::<A>::new(SPLITS);
        #[unroll]
        for part in 0..SPLITS {
            let at = first + part * width;
            scores[part] = partials[at];
            sums[part] = partials[at + 1];
            accs[part] = partials[at + 2 + u];
        }
        let mut max = scores[0];
        let mut sum = sums[0];
        let mut acc = accs[0];
        #[unroll]
        for part in 1..SPLITS {
            if (part as u64) * per * (units as u64) < count {
                let score = scores[part];
                let next_max = select(score > max, score, max);
                let before = (max - next_max).exp();
                let this = (score - next_max).exp();
                sum = sum * before + sums[part] * this;
                acc = acc * before + accs[part] * this;
                max = next_max;
            }
        }
        // A store of NaN, not a select: cubecl 0.11's LLVM path types a selected `F::NAN` as
        // f32, which does not verify in f64 kernels.
        let at = pair as usize * head_dim + u;
        if clear {
            out[at] = F::cast_from(select(count > 0, acc / sum, A::new(0.0)));
        } else {
            out[at] = F::NAN;
        }
    }
}

/// Chunks of `units` keys each part of `count` keys holds: the chunks shared out over `SPLITS`
/// parts, rounded up (at least 1).
#[cube]
fn part_chunks(count: u64, #[comptime] units: usize) -> u64 {
    let chunks = (count + units as u64 - 1) / units as u64;
    let per = (chunks + SPLITS as u64 - 1) / SPLITS as u64;
    select(per > 0, per, 1u64)
}

/// The attention of cube `(t, h)` over the pools alone (no new rows).
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend_pools<F: Float, S: Int, A: Float>(
    q: &Tensor<F>,
    k_pool: &Tensor<F>,
    v_pool: &Tensor<F>,
    slots: &Tensor<S>,
    runs: &Tensor<i64>,
    partials: &mut Tensor<A>,
    shape: AttentionShape,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] planes: bool,
    #[comptime] staged: bool,
    #[comptime] group: usize,
) {
    let launched = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    if launched < shape.tokens * (shape.heads / group as u64) * SPLITS as u64 {
        let cube = group_cube(launched, shape, group);
        let run = run_words(runs, cube, shape);
        let q_values = query_values::<F>(q, cube, shape, head_dim, group);
        // No new rows: the pools stand in for them, never read (`with_new_rows` is false).
        let none = NewRowsShape {
            rows: 0,
            k_stride: 0,
            k_offset: 0,
            v_stride: 0,
            v_offset: 0,
            loc_stride: 0,
            base: 1,
            newest: 0,
        };
        let listed = Shared::<[u64]>::new_slice(1usize);
        attend::<F, S, S, A>(
            &q_values, run, &listed, k_pool, v_pool, k_pool, v_pool, slots, slots, partials, shape,
            none, NEW_ROW, cube, head_dim, units, false, planes, staged, group,
        );
    }
}

/// The store and the attention in one launch, over a joined pool (each row a slot's K, then its
/// V), the queries, the new K rows and the new V rows side by side in `qkv` (at `new_rows`'
/// offsets): cube `(t, h)` attends its part as `attention_kv_kernel` does, then stores the
/// columns of K/V head `h / groups` of new row `t` at `loc[t]` when `h` is its group's first
/// query head, its part is the first and the slots' status is clear (of the rows naming slot 0
/// only the last, as the store does). With `fold` (a device whose storage sync reaches other cubes),
/// the last of a pair's parts to count itself in `arrivals[pair]` folds them into `out` as
/// `attention_combine_kernel` would (the same bits), else that kernel does after; a cube of
/// `group` query heads (as `attention_kv_kernel`'s) stores for its K/V head and counts itself in
/// its first head's pair, and the last to arrive folds every head of the group. A key
/// whose slot this store claims reads the new row instead of the pool (whose rows other cubes are
/// writing), so the output is the attention over the pool after the store, bit for bit.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn store_attention_kv_kernel<F: Float, S: Int, L: Int, A: Float>(
    qkv: &Tensor<F>,
    kv_pool: &mut Tensor<F>,
    loc: &Tensor<L>,
    claims: &Tensor<u32>,
    stored: &Tensor<i64>,
    slots: &Tensor<S>,
    runs: &Tensor<i64>,
    partials: &mut Tensor<A>,
    arrivals: &mut Tensor<Atomic<u32>>,
    out: &mut Tensor<F>,
    shape: AttentionShape,
    new_rows: NewRowsShape,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] planes: bool,
    #[comptime] staged: bool,
    #[comptime] fold: bool,
    #[comptime] group: usize,
    #[define(F, S, L, A)] _dtypes: [ElemType; 4],
) {
    let cube = group_cube(
        CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64,
        shape,
        group,
    );
    let head = cube / SPLITS as u64;
    let t = head / shape.heads;
    // Every load that waits on no other is issued before any is used: with few cubes a launch's
    // time is its chain of dependent loads (runs and status, then slots, then K/V rows).
    let run = run_words(runs, cube, shape);
    let q_values = query_values::<F>(qkv, cube, shape, head_dim, group);
    let stored_code = stored[CODE];
    let stored_zero = stored[FACTS];
    let stored_first = stored[FACTS + 1];
    let mut named = 0i64;
    // Only a pair's first part stores.
    if cube % SPLITS as u64 == 0 && t < new_rows.rows {
        named = i64::cast_from(loc[(t * new_rows.loc_stride) as usize]);
    }
    // Staged: the step's slots in shared memory, where each key finds its new row (`listed_row`).
    let mut listed = Shared::<[u64]>::new_slice(comptime!(if staged { STAGED_TOKENS } else { 1 }));
    if comptime![staged] && (UNIT_POS as u64) < new_rows.rows {
        let own = i64::cast_from(loc[(UNIT_POS as u64 * new_rows.loc_stride) as usize]);
        listed[UNIT_POS as usize] = own as u64;
    }
    let rows = stored_rows(stored_code, stored_first, new_rows);
    let zero_row = stored_zero_row(stored_code, stored_zero);
    let mut slot = NEW_ROW.runtime();
    if cube % SPLITS as u64 == 0 {
        slot = store_slot(named, rows, shape, zero_row, head, head_dim);
    }
    // The store's values are loaded now and written last: no key of this launch is read from a
    // pool row it stores (those keys read the new rows), so the store's loads and writes stay
    // off the attention's chain of dependent loads.
    let column = ((head % shape.heads) / shape.groups) * head_dim as u64 + UNIT_POS as u64;
    let mut k_value = F::new(0.0);
    let mut v_value = F::new(0.0);
    if slot != NEW_ROW {
        k_value = qkv[(rows.k_offset + t * rows.k_stride + column) as usize];
        v_value = qkv[(rows.v_offset + t * rows.v_stride + column) as usize];
    }
    if t < shape.tokens {
        attend::<F, S, u32, A>(
            &q_values, run, &listed, &*kv_pool, &*kv_pool, qkv, qkv, slots, claims, partials,
            shape, rows, zero_row, cube, head_dim, units, true, planes, staged, group,
        );
        if comptime![fold] {
            // The pair's last part to arrive folds them all: each part publishes its partial,
            // then counts itself (the counts stay multiples of `SPLITS` between launches).
            let mut arrived = Shared::<u32>::new();
            sync_storage();
            if UNIT_POS == 0 {
                *arrived = arrivals[head as usize].fetch_add(1u32);
            }
            sync_storage();
            if *arrived % SPLITS as u32 == SPLITS as u32 - 1 {
                #[unroll]
                for g in 0..group {
                    fold_parts::<F, A>(
                        &*partials,
                        runs,
                        out,
                        shape,
                        head + g as u64,
                        head_dim,
                        units,
                    );
                }
            }
        }
    }
    if slot != NEW_ROW {
        kv_pool[(slot * shape.k_stride + column) as usize] = k_value;
        kv_pool[(slot * shape.v_stride + shape.v_offset + column) as usize] = v_value;
    }
}

/// The new rows as the store sees them (`code` and `first` the slots' status words): an unclear
/// status stores nothing, and every key is read from the pools as they are.
#[cube]
fn stored_rows(code: i64, first: i64, new_rows: NewRowsShape) -> NewRowsShape {
    let mut rows = new_rows;
    rows.base = 1;
    rows.newest = 0;
    if code == OK && new_rows.rows > 0 {
        // The check's first clock value (a device word: a replayed step's claims are its own).
        rows.base = first as u64;
        rows.newest = rows.base + new_rows.rows - 1;
    }
    rows
}

/// Of the rows naming slot 0 (the padding sink) only the last is stored (the status word
/// `FACTS`, `zero`, names it): that row, or `NEW_ROW` for none.
#[cube]
fn stored_zero_row(code: i64, zero: i64) -> u64 {
    let mut row = NEW_ROW.runtime();
    if code == OK && zero > 0 {
        row = (zero - 1) as u64;
    }
    row
}

/// Token `t`'s words of the runs record (cube `((t, h), part)`, flattened), loaded and not yet
/// used: the check's code, the run's start and count (0 past the tokens).
#[derive(CubeType, Clone, Copy)]
struct RunWords {
    code: i64,
    start: i64,
    count: i64,
}

#[cube]
fn run_words(runs: &Tensor<i64>, cube: u64, shape: AttentionShape) -> RunWords {
    let t = cube / SPLITS as u64 / shape.heads;
    let mut start = 0i64;
    let mut count = 0i64;
    if t < shape.tokens {
        start = runs[STATUS_LEN + t as usize];
        count = runs[STATUS_LEN + (shape.tokens + t) as usize];
    }
    RunWords {
        code: runs[CODE],
        start,
        count,
    }
}

/// The slot unit `UNIT_POS` of head `(t, h)` (flattened) stores new row `t`'s column at (`named`,
/// `loc[t]` as loaded): one unit per column of K/V head `h / groups`, in the group's first query
/// head, on a clear status; else `NEW_ROW`.
#[cube]
#[allow(clippy::manual_is_multiple_of)] // CubeCL expands `%`, not `is_multiple_of`
fn store_slot(
    named: i64,
    rows: NewRowsShape,
    shape: AttentionShape,
    zero_row: u64,
    cube: u64,
    #[comptime] head_dim: usize,
) -> u64 {
    let t = cube / shape.heads;
    let h = cube % shape.heads;
    let mut slot = NEW_ROW.runtime();
    if rows.base <= rows.newest
        && t < rows.rows
        && h % shape.groups == 0
        && (UNIT_POS as usize) < head_dim
        && (named != 0 || t == zero_row)
    {
        slot = named as u64;
    }
    slot
}

/// The new row that holds slot `slot`'s K/V (`NEW_ROW` when the pools do): the one whose token
/// claimed the slot in the check, or for slot 0 (never claimed) `zero_row`.
#[cube]
fn new_row<W: Int>(claims: &Tensor<W>, slot: u64, rows: NewRowsShape, zero_row: u64) -> u64 {
    let mut row = zero_row;
    if slot != 0 {
        row = NEW_ROW;
        let claim = u64::cast_from(claims[slot as usize]);
        if claim >= rows.base && claim <= rows.newest {
            row = rows.newest - claim;
        }
    }
    row
}

/// `new_row` for a launch of at most `STAGED_TOKENS` new rows, whose slots are `listed` (in shared
/// memory): the row naming `slot`, found without a claims word's load. On the slots' clear status
/// no slot but 0 is named twice, so it is the row the claims word names.
#[cube]
fn listed_row(listed: &Shared<[u64]>, slot: u64, rows: NewRowsShape, zero_row: u64) -> u64 {
    let mut row = zero_row;
    if slot != 0 {
        row = NEW_ROW;
        if rows.base <= rows.newest {
            #[unroll]
            for r in 0..STAGED_TOKENS {
                if (r as u64) < rows.rows && listed[r] == slot {
                    row = r as u64;
                }
            }
        }
    }
    row
}

/// `q_row[q_at ..] . tile[at .. at + head_dim]`, in the dimensions' order (a K row as the pool
/// holds it: the same bits as `dot_heads`).
#[cube]
fn dot_shared<A: Float>(
    q_row: &Shared<[A]>,
    q_at: usize,
    tile: &Shared<[A]>,
    at: usize,
    #[comptime] head_dim: usize,
) -> A {
    let mut sum = A::new(0.0);
    #[unroll]
    for e in 0..head_dim {
        sum += q_row[q_at + e] * tile[at + e];
    }
    sum
}

/// Each of `group` query rows (`q_row`, one after another) `.` the K row at `at` (a new row's
/// where `at` is marked `NEW_ROW`), in the dimensions' order, into `sums`: each value of the row
/// loaded once for the group.
#[cube]
fn dot_heads<F: Float, A: Float>(
    q_row: &Shared<[A]>,
    k_pool: &Tensor<F>,
    k: &Tensor<F>,
    at: u64,
    sums: &mut Array<A>,
    #[comptime] head_dim: usize,
    #[comptime] with_new_rows: bool,
    #[comptime] group: usize,
) {
    #[unroll]
    for g in 0..group {
        sums[g] = A::new(0.0);
    }
    // Unrolled: every load of the row is issued before the sums wait on them (the order of each
    // sum is the dimensions' all the same).
    #[unroll]
    for e in 0..head_dim {
        let value = A::cast_from(row_value::<F>(k_pool, k, at + e as u64, with_new_rows));
        #[unroll]
        for g in 0..group {
            sums[g] += q_row[g * head_dim + e] * value;
        }
    }
}

/// Element `at` of a K or V row: of the step's new rows `new` where `at` is marked `NEW_ROW`,
/// else of the pool. Both are read, unguarded (with the chunk's other loads so, the
/// store-and-attend measured 1.1-1.2x faster: RESULTS, session 44): the one not named reads its
/// first value. Only a launch with keys reads, so neither is empty.
#[cube]
fn row_value<F: Float>(
    pool: &Tensor<F>,
    new: &Tensor<F>,
    at: u64,
    #[comptime] with_new_rows: bool,
) -> F {
    if comptime![with_new_rows] {
        let fresh = at >= NEW_ROW;
        let in_new = select(fresh, at, NEW_ROW) - NEW_ROW;
        let in_pool = select(fresh, 0u64, at);
        let (new_value, pool_value) = (new[in_new as usize], pool[in_pool as usize]);
        select(fresh, new_value, pool_value)
    } else {
        pool[at as usize]
    }
}

/// Dimension `u` of the V row at `at` (a new row's where `at` is marked `NEW_ROW`), read
/// unguarded: past the head, whose units keep no output, the row's last.
#[cube]
fn v_value<F: Float, A: Float>(
    v_pool: &Tensor<F>,
    v: &Tensor<F>,
    at: u64,
    u: usize,
    #[comptime] head_dim: usize,
    #[comptime] with_new_rows: bool,
) -> A {
    let e = select(u < head_dim, u, head_dim - 1);
    A::cast_from(row_value::<F>(v_pool, v, at + e as u64, with_new_rows))
}

/// The part `cube % SPLITS` of token `t`'s keys for `group` query heads of one K/V head: cube
/// `cube`'s head (flattened `(t, h)`, `cube / SPLITS`) and the `group - 1` after it, whose
/// queries are `q_values`; each head's partial is written where its own cube's would be. The
/// chunk's K rows, slots and V values are read once for the group; each head's scores, max, sums
/// and weighted V row are computed as for it alone (the same bits whatever the group).
#[cube]
#[allow(clippy::too_many_arguments)]
fn attend<F: Float, S: Int, W: Int, A: Float>(
    q_values: &Array<F>,
    run: RunWords,
    listed: &Shared<[u64]>,
    k_pool: &Tensor<F>,
    v_pool: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    slots: &Tensor<S>,
    claims: &Tensor<W>,
    partials: &mut Tensor<A>,
    shape: AttentionShape,
    rows: NewRowsShape,
    zero_row: u64,
    cube: u64,
    #[comptime] head_dim: usize,
    #[comptime] units: usize,
    #[comptime] with_new_rows: bool,
    #[comptime] planes: bool,
    #[comptime] staged: bool,
    #[comptime] group: usize,
) {
    let head = cube / SPLITS as u64;
    let part = cube % SPLITS as u64;
    let h = head % shape.heads;
    let chunk = units as u64;
    let u = UNIT_POS as usize;
    let plane_count = comptime!(units / PLANE);
    // On the runs' failed check no key is read (no run is walked) and the output is NaN.
    let clear = run.code == OK;
    let mut q_row = Shared::<[A]>::new_slice(comptime!(group * head_dim));
    let mut scores = Shared::<[A]>::new_slice(comptime!(group * units));
    let mut key_rows = Shared::<[u64]>::new_slice(units);
    let mut maxima = Shared::<[A]>::new_slice(comptime!(group * plane_count));
    if u < head_dim {
        #[unroll]
        for g in 0..group {
            q_row[g * head_dim + u] = A::cast_from(q_values[g]);
        }
    }
    let start = run.start as u64;
    let count = select(clear, run.count as u64, 0u64);
    let kv_column = (h / shape.groups) * head_dim as u64;
    // In A, not an f32 constant: f64 attention keeps f64's precision.
    let scale = A::new(1.0) / A::cast_from(head_dim as u32).sqrt();
    let mut max = Array::<A>::new(group);
    let mut sum = Array::<A>::new(group);
    let mut acc = Array::<A>::new(group);
    let mut next_max = Array::<A>::new(group);
    let mut dots = Array::<A>::new(group);
    #[unroll]
    for g in 0..group {
        max[g] = A::new(0.0);
        sum[g] = A::new(0.0);
        acc[g] = A::new(0.0);
    }
    sync_cube();
    // This part's keys: whole chunks, fixed by the token's key count alone.
    let per = part_chunks(count, units) * chunk;
    let begin = part * per;
    let end = select(begin + per < count, begin + per, count);
    let per_tile = comptime!(tile_keys(head_dim, units));
    // Values of a tile each unit loads (its rows' elements `u`, `u + units`, ..).
    let loads = comptime!((per_tile * head_dim).div_ceil(units));
    let mut tile = Shared::<[A]>::new_slice(comptime!(if staged {
        per_tile * (head_dim + 1)
    } else {
        1
    }));
    let mut k_rows = Shared::<[u64]>::new_slice(units);
    let fold = comptime!(if staged { STAGED_FOLD } else { FOLD });
    let mut values = Array::<A>::new(fold);
    let mut first = begin;
    while first < end {
        let keys = select(end - first < chunk, end - first, chunk) as u32;
        // Each key's K and V rows, its slot resolved once by its own unit.
        if (u as u32) < keys {
            let slot =
                i64::cast_from(slots[((start + first + u as u64) * shape.slots_stride) as usize])
                    as u64;
            let mut row = NEW_ROW.runtime();
            if comptime![with_new_rows] {
                if comptime![staged] {
                    row = listed_row(listed, slot, rows, zero_row);
                } else {
                    row = new_row::<W>(claims, slot, rows, zero_row);
                }
            }
            if row == NEW_ROW {
                k_rows[u] = slot * shape.k_stride + kv_column;
                key_rows[u] = slot * shape.v_stride + shape.v_offset + kv_column;
            } else {
                k_rows[u] = NEW_ROW | (rows.k_offset + row * rows.k_stride + kv_column);
                key_rows[u] = NEW_ROW | (rows.v_offset + row * rows.v_stride + kv_column);
            }
        }
        if comptime![staged] {
            sync_cube();
            // The first keys' V values, in flight with the K rows' loads below (unguarded: past
            // the chunk's keys a unit reads its last key's, which no sum adds).
            #[unroll]
            for i in 0..fold {
                let key = select((i as u32) < keys, i as u32, keys - 1) as usize;
                values[i] = v_value::<F, A>(v_pool, v, key_rows[key], u, head_dim, with_new_rows);
            }
            // The K rows a tile at a time: each row read by consecutive units into shared
            // memory (rows `head_dim + 1` apart: a key's unit reads its row without bank
            // conflicts), then each key's unit takes its scores from the tile.
            let mut tile_first = 0u32;
            while tile_first < keys {
                let in_tile = select(
                    keys - tile_first < per_tile as u32,
                    keys - tile_first,
                    per_tile as u32,
                );
                // Unguarded loads: past the tile's values a unit reads its last, not staged.
                let mut staged_values = Array::<F>::new(loads);
                let last = in_tile * head_dim as u32 - 1;
                #[unroll]
                for i in 0..loads {
                    let e = (i * units) as u32 + u as u32;
                    let e = select(e < last, e, last);
                    let key = e / head_dim as u32;
                    let at = k_rows[(tile_first + key) as usize] + (e % head_dim as u32) as u64;
                    staged_values[i] = row_value::<F>(k_pool, k, at, with_new_rows);
                }
                #[unroll]
                for i in 0..loads {
                    let e = (i * units) as u32 + u as u32;
                    if e < in_tile * head_dim as u32 {
                        let key = e / head_dim as u32;
                        tile[(key * (head_dim as u32 + 1) + e % head_dim as u32) as usize] =
                            A::cast_from(staged_values[i]);
                    }
                }
                sync_cube();
                let unit = u as u32;
                if unit >= tile_first && unit < tile_first + in_tile {
                    let at = ((unit - tile_first) * (head_dim as u32 + 1)) as usize;
                    #[unroll]
                    for g in 0..group {
                        scores[g * units + u] =
                            dot_shared::<A>(&q_row, g * head_dim, &tile, at, head_dim) * scale;
                    }
                }
                sync_cube();
                tile_first += per_tile as u32;
            }
        } else {
            // Each key's unit reads its own row.
            if (u as u32) < keys {
                dot_heads::<F, A>(
                    &q_row,
                    k_pool,
                    k,
                    k_rows[u],
                    &mut dots,
                    head_dim,
                    with_new_rows,
                    group,
                );
                #[unroll]
                for g in 0..group {
                    scores[g * units + u] = dots[g] * scale;
                }
            }
            sync_cube();
        }
        // Every unit keeps each head's same running max and sum (the chunk's scores are shared).
        let mut chunk_max = Array::<A>::new(group);
        #[unroll]
        for g in 0..group {
            chunk_max[g] = scores[g * units];
        }
        if comptime![planes] {
            // Each plane's max, then the planes' (a max is the same whatever its order).
            #[unroll]
            for g in 0..group {
                let own = select((u as u32) < keys, scores[g * units + u], chunk_max[g]);
                let top = plane_max(own);
                if u % PLANE == 0 {
                    maxima[g * plane_count + u / PLANE] = top;
                }
            }
            sync_cube();
            #[unroll]
            for g in 0..group {
                #[unroll]
                for p in 0..plane_count {
                    if maxima[g * plane_count + p] > chunk_max[g] {
                        chunk_max[g] = maxima[g * plane_count + p];
                    }
                }
            }
        } else {
            #[unroll]
            for g in 0..group {
                let mut j = 1u32;
                while j < keys {
                    let score = scores[g * units + j as usize];
                    if score > chunk_max[g] {
                        chunk_max[g] = score;
                    }
                    j += 1;
                }
            }
        }
        #[unroll]
        for g in 0..group {
            next_max[g] = chunk_max[g];
            if first > begin && max[g] > chunk_max[g] {
                next_max[g] = max[g];
            }
            let rescale = select(first > begin, (max[g] - next_max[g]).exp(), A::new(1.0));
            sum[g] *= rescale;
            acc[g] *= rescale;
        }
        // Each key's weights once, by its own unit, in place of its scores (every unit has read
        // the scores it needs: the maxima are taken).
        if comptime![!planes] {
            sync_cube();
        }
        if (u as u32) < keys {
            #[unroll]
            for g in 0..group {
                scores[g * units + u] = (scores[g * units + u] - next_max[g]).exp();
            }
        }
        sync_cube();
        // `fold` keys at a time (staged: the first group loaded above): their V loads are in
        // flight together; the sums still add key by key, in order.
        let mut j = 0u32;
        while j < keys {
            if j > 0 || comptime![!staged] {
                // Unguarded: past the chunk's keys a unit reads its last key's, which no sum adds.
                #[unroll]
                for i in 0..fold {
                    let key = select(j + (i as u32) < keys, j + i as u32, keys - 1) as usize;
                    values[i] =
                        v_value::<F, A>(v_pool, v, key_rows[key], u, head_dim, with_new_rows);
                }
            }
            #[unroll]
            for i in 0..fold {
                if j + (i as u32) < keys {
                    #[unroll]
                    for g in 0..group {
                        let weight = scores[g * units + j as usize + i];
                        sum[g] += weight;
                        acc[g] += weight * values[i];
                    }
                }
            }
            j += fold as u32;
        }
        #[unroll]
        for g in 0..group {
            max[g] = next_max[g];
        }
        first += chunk;
        sync_cube();
    }
    if begin < end {
        #[unroll]
        for g in 0..group {
            let at = (cube as usize + g * SPLITS) * (head_dim + 2);
            if u == 0 {
                partials[at] = max[g];
                partials[at + 1] = sum[g];
            }
            if u < head_dim {
                partials[at + 2 + u] = acc[g];
            }
        }
    }
}
