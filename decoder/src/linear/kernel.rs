//! The projection kernel for a step's tokens: `out = [residual +] (x [/ rms(x)]) W^T`, over
//! weights kept as `[out, in]` rows (`linear_block_kernel`), and the launches that ride beside
//! it past `MAX_TOKENS` (RoPE, SwiGLU, RMSNorm) and after it (the greedy token).
//!
//! A token's value is the same sums in the same order whatever else is in the launch: a row is
//! the same bits alone or in a verify window. Sums are kept in an accumulator type `A` (f32 for
//! half-precision weights and activations, else their own) and rounded to `F` once, on the
//! store.

use cubecl::prelude::*;

/// Units of a plane.
pub const LANES: usize = 32;

/// Scalars of one projection.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct LinearShape {
    /// Tokens (rows of `x` and `out`).
    pub tokens: u64,
    /// Output columns (rows of `w`).
    pub outputs: u64,
    /// Input columns (columns of `w`).
    pub inner: u64,
    /// Row stride of `x`.
    pub x_stride: u64,
    /// Row stride of `w`.
    pub w_stride: u64,
    /// Row stride of `residual` (0 when it is not read).
    pub residual_stride: u64,
    /// Output columns RoPE rotates (the queries' and keys'), in heads of `2 * pairs` columns.
    pub rotated: u64,
    /// RoPE pairs a head (`head_dim / 2`): the columns of `cos` and `sin`.
    pub pairs: u64,
    /// Row stride of `cos` and `sin`.
    pub angle_stride: u64,
}

/// `index` where it is below `count`, else the last index (`count - 1`; `count` at least 1): an
/// unguarded read's row or column.
#[cube]
fn last_at_most(index: u64, count: u64) -> u64 {
    select(index < count, index, count - 1)
}

/// Where an output value goes: its token's input's sum of squares over `elements` values, its
/// token and column.
#[derive(CubeType, Clone, Copy)]
struct Finish<F: Float> {
    squares: F,
    elements: u64,
    row: u64,
    column: u64,
}

/// Output `(row, column)` from its dot product `value` (and its RoPE partner's): divided by the
/// input's RMS, turned, the residual added, in `A`; stored as `F`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn finish<F: Float, A: Float>(
    value: A,
    partner: A,
    at: Finish<A>,
    shape: LinearShape,
    eps: f32,
    residual: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] norm: bool,
    #[comptime] add: bool,
    #[comptime] rope: bool,
    #[comptime] swiglu: bool,
) {
    let (row, column) = (at.row, at.column);
    let mut value = value;
    let mut partner = partner;
    if comptime![norm] {
        let mean = at.squares / A::cast_from(at.elements);
        let scale = (mean + A::cast_from(eps)).sqrt();
        value /= scale;
        partner /= scale;
    }
    if comptime![rope] {
        if column < shape.rotated {
            // `(a, b)` -> `(a cos - b sin, b cos + a sin)`: the even column takes the first, the
            // odd one the second.
            let pair = (column % (2 * shape.pairs)) / 2;
            let angle = (row * shape.angle_stride + pair) as usize;
            let sine = A::cast_from(sin[angle]);
            let turn = select(column % 2 == 0, -sine, sine);
            value = value * A::cast_from(cos[angle]) + partner * turn;
        }
    }
    if comptime![add] {
        value += A::cast_from(residual[(row * shape.residual_stride + column) as usize]);
    }
    if comptime![swiglu] {
        // The pair's even column writes `silu(gate) * up`; the odd one nothing.
        if column % 2 == 0 {
            let gated = value / (A::new(1.0) + (-value).exp()) * partner;
            out[(row * (shape.outputs / 2) + column / 2) as usize] = F::cast_from(gated);
        }
    } else {
        out[(row * shape.outputs + column) as usize] = F::cast_from(value);
    }
}

/// Scalars of a RoPE launch.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
#[expand(derive(Clone, Copy))]
pub struct RopeScalars {
    /// Rows of `y` and `out`.
    pub tokens: u64,
    /// Columns of `y` and `out`.
    pub width: u64,
    /// Row stride of `y`.
    pub y_stride: u64,
    /// Columns turned, in heads of `2 * pairs` columns.
    pub rotated: u64,
    /// RoPE pairs a head: the columns of `cos` and `sin`.
    pub pairs: u64,
    /// Row stride of `cos` and `sin`.
    pub angle_stride: u64,
}

/// Units of a RoPE cube.
pub const ROPE_UNITS: usize = 256;

/// Unit `u` of cube `c` (flattened over x and y) writes value `c * ROPE_UNITS + u` of `out`
/// (`[tokens, width]`, contiguous): `y`'s, turned as `finish` turns a projection's output where
/// its column is below `rotated`.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn rope_kernel<F: Float, A: Float>(
    y: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    shape: RopeScalars,
    #[define(F, A)] _dtypes: [ElemType; 2],
) {
    let cube = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    let at = cube * ROPE_UNITS as u64 + UNIT_POS as u64;
    if at < shape.tokens * shape.width {
        let (row, column) = (at / shape.width, at % shape.width);
        let mut value = A::cast_from(y[(row * shape.y_stride + column) as usize]);
        if column < shape.rotated {
            let even = column % 2 == 0;
            let partner_column = select(even, column + 1, column - 1);
            let partner = A::cast_from(y[(row * shape.y_stride + partner_column) as usize]);
            let pair = (column % (2 * shape.pairs)) / 2;
            let angle = (row * shape.angle_stride + pair) as usize;
            let sine = A::cast_from(sin[angle]);
            let turn = select(even, -sine, sine);
            value = value * A::cast_from(cos[angle]) + partner * turn;
        }
        out[at as usize] = F::cast_from(value);
    }
}

/// Unit `u` of cube `c` (flattened over x and y) writes value `c * ROPE_UNITS + u` of `out`
/// (`[tokens, half]`, contiguous): `silu(gate) * up` of its column's pair `(2i, 2i + 1)` of `y`
/// (`[tokens, 2 * half]`), in `A`, as `finish` makes it after a projection.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn swiglu_kernel<F: Float, A: Float>(
    y: &Tensor<F>,
    out: &mut Tensor<F>,
    tokens: u64,
    half: u64,
    y_stride: u64,
    #[define(F, A)] _dtypes: [ElemType; 2],
) {
    let cube = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    let at = cube * ROPE_UNITS as u64 + UNIT_POS as u64;
    if at < tokens * half {
        let (row, column) = (at / half, at % half);
        let gate = A::cast_from(y[(row * y_stride + 2 * column) as usize]);
        let up = A::cast_from(y[(row * y_stride + 2 * column + 1) as usize]);
        out[at as usize] = F::cast_from(gate / (A::new(1.0) + (-gate).exp()) * up);
    }
}

/// Units of an RMSNorm cube.
pub const NORM_UNITS: usize = 256;

/// Cube `r` (flattened over x and y) writes row `r` of `out` (`[rows, cols]`, contiguous): `x`'s
/// row divided by its RMS (`sqrt(mean(x^2) + eps)`, as `finish` divides a projection), in `A`.
/// Unit `u` sums the squares of columns `u, u + NORM_UNITS, ..` in order, then the units' sums
/// add by halves: the order depends on the width alone.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn rms_norm_kernel<F: Float, A: Float>(
    x: &Tensor<F>,
    out: &mut Tensor<F>,
    rows: u64,
    cols: u64,
    x_stride: u64,
    eps: f32,
    #[define(F, A)] _dtypes: [ElemType; 2],
) {
    let row = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    let u = UNIT_POS as usize;
    let mut squares = Shared::<[A]>::new_slice(NORM_UNITS);
    let mut sum = A::new(0.0);
    if row < rows {
        let mut c = u as u64;
        while c < cols {
            let value = A::cast_from(x[(row * x_stride + c) as usize]);
            sum += value * value;
            c += NORM_UNITS as u64;
        }
    }
    squares[u] = sum;
    #[unroll]
    for level in 0..comptime!(NORM_UNITS.trailing_zeros()) {
        let half = comptime!(NORM_UNITS >> (level + 1));
        sync_cube();
        if u < half {
            squares[u] = squares[u] + squares[u + half];
        }
    }
    sync_cube();
    if row < rows {
        let scale = (squares[0] / A::cast_from(cols) + A::cast_from(eps)).sqrt();
        let mut c = u as u64;
        while c < cols {
            let value = A::cast_from(x[(row * x_stride + c) as usize]);
            out[(row * cols + c) as usize] = F::cast_from(value / scale);
            c += NORM_UNITS as u64;
        }
    }
}

/// Units of a greedy-token cube.
pub const GREEDY_UNITS: usize = 512;

/// Cube `r` (flattened over x and y) writes row `r`'s greedy token: the index of its largest
/// logit, the first of equal ones. Unit `u` walks columns `u, u + GREEDY_UNITS, ..`, `unroll`
/// loads in flight at once, keeping the first of its largest; the units' picks are joined by
/// halves (the larger value, on a tie the lower index).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn greedy_kernel<F: Float>(
    logits: &Tensor<F>,
    out: &mut Tensor<i64>,
    rows: u64,
    vocab: u64,
    stride: u64,
    #[comptime] unroll: usize,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    let u = UNIT_POS as usize;
    let mut values = Shared::<[F]>::new_slice(GREEDY_UNITS);
    let mut picks = Shared::<[u64]>::new_slice(GREEDY_UNITS);
    // `vocab` stands for "none yet".
    let mut best = F::new(0.0);
    let mut best_at = vocab;
    if row < rows {
        let base = row * stride;
        let mut loaded = Array::<F>::new(unroll);
        let mut k = u as u64;
        while k < vocab {
            // Unguarded loads, in flight together: past the end a unit reads the last logit,
            // which the picks below skip.
            #[unroll]
            for i in 0..unroll {
                let at = last_at_most(k + (i * GREEDY_UNITS) as u64, vocab);
                loaded[i] = logits[(base + at) as usize];
            }
            #[unroll]
            for i in 0..unroll {
                let at = k + (i * GREEDY_UNITS) as u64;
                if at < vocab && (best_at == vocab || loaded[i] > best) {
                    best = loaded[i];
                    best_at = at;
                }
            }
            k += (GREEDY_UNITS * unroll) as u64;
        }
    }
    values[u] = best;
    picks[u] = best_at;
    #[unroll]
    for level in 0..comptime!(GREEDY_UNITS.trailing_zeros()) {
        let half = comptime!(GREEDY_UNITS >> (level + 1));
        sync_cube();
        if u < half {
            let value = values[u + half];
            let at = picks[u + half];
            let mine = values[u];
            let mine_at = picks[u];
            if at < vocab && (mine_at == vocab || value > mine || (value == mine && at < mine_at)) {
                values[u] = value;
                picks[u] = at;
            }
        }
    }
    sync_cube();
    if u == 0 && row < rows {
        out[row as usize] = select(picks[0] < vocab, picks[0] as i64, 0i64);
    }
}

/// Sums a lane of `linear_block_kernel` keeps: a (token, column) each, two a lane once folded.
pub const BLOCK_VALUES: usize = 2 * LANES;
/// Columns a plane of `linear_block_kernel` makes by default past `FEW_TOKENS` tokens: its block is
/// then `BLOCK_VALUES / columns` tokens (more tokens, more cubes along z). Batch 32 measured 1.24x
/// faster at 8 than at 2 (the inputs, reread for every plane's columns, were most of the loads:
/// `benches/RESULTS.md`, session 45).
pub const BLOCK_COLUMNS: usize = 8;
/// Tokens up to which a plane of `linear_block_kernel` makes `FEW_COLUMNS` columns: more cubes for
/// a step's few sums (batch 8 measured 1.2x faster at 2 than at 8, `benches/RESULTS.md`, session
/// 47). A token's bits do not depend on its plane's columns.
pub const FEW_TOKENS: usize = 8;
/// Columns a plane makes up to `FEW_TOKENS` tokens.
pub const FEW_COLUMNS: usize = 2;
/// Planes of a `linear_block_kernel` cube, each its own columns (times its parts of the rows).
pub const BLOCK_PLANES: usize = 4;
/// Tokens of a block whose inputs a lane loads together before it adds them.
const BLOCK_LOADS: usize = 8;
/// The most rounds of loads (a vector of a row each lane) a part of a row takes: longer rows are
/// split into more parts, a plane each.
pub const BLOCK_ROUNDS: usize = 4;
/// Values a lane of a small block holds in flight: as many of its part's rounds as fit are
/// loaded together (`block_ahead`).
const AHEAD_VALUES: usize = 64;

/// Rounds of loads a lane of `linear_block_kernel` issues together for a block of `rows` tokens
/// and `columns` columns in vectors of `vector` values, at most `most`: where a round's loads are
/// few (a step of a few tokens), a part's chain of round trips becomes one.
pub fn block_ahead(rows: usize, columns: usize, vector: usize, most: usize) -> usize {
    (AHEAD_VALUES / ((columns + rows) * vector)).clamp(1, most.clamp(1, BLOCK_ROUNDS))
}

/// The projection for blocks of `rows` tokens (a power of two, at most `BLOCK_VALUES / columns`),
/// laid out so a weight is read once a block and the sums fold in
/// few exchanges: a cube makes `BLOCK_PLANES` runs of `columns` columns of its block, each run's
/// rows split in `splits` parts, a plane a part; lane `l` of part `p` reads vectors
/// `p * LANES + l`, then every `splits * LANES`-th, of the weight rows and of every token's
/// input, each vector's products added in order into one sum a (token, column). More columns a
/// plane: each input load feeds more sums (the inputs, reread for every run of columns, are most
/// of a launch's loads), the weights are read once for each of more blocks. The plane's
/// `rows * columns` sums then fold by halves, each exchange handing half of a lane's sums to the
/// lane `mask` away (62 exchanges for 64 sums, where a plane sum a value takes 320), until lane
/// `l` holds sum `l * rows * columns / LANES` (and the next where they are 64: a pair of
/// columns); the parts add in order. The exchanges are plane shuffles with `planes` (planes exactly `LANES` wide:
/// CUDA), else staged in shared memory (`splits` at most 2 there): the same sums in the same
/// order. A lane issues `ahead` rounds' loads together (`block_ahead`), added in the same order.
/// A token's value depends neither on the other tokens nor on `rows`, `columns` or `ahead`: the
/// same bits in any block.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn linear_block_kernel<F: Float, N: Size, A: Float>(
    x: &Tensor<Vector<F, N>>,
    w: &Tensor<Vector<F, N>>,
    residual: &Tensor<F>,
    cos: &Tensor<F>,
    sin: &Tensor<F>,
    out: &mut Tensor<F>,
    shape: LinearShape,
    eps: f32,
    #[comptime] norm: bool,
    #[comptime] swiglu: bool,
    #[comptime] add: bool,
    #[comptime] rope: bool,
    #[comptime] planes: bool,
    #[comptime] splits: usize,
    #[comptime] columns: usize,
    #[comptime] rows: usize,
    #[comptime] ahead: usize,
    #[define(F, A)] _dtypes: [ElemType; 2],
) {
    let lane = UNIT_POS_X as usize;
    let plane = UNIT_POS_Y as usize;
    let len = comptime!(rows * columns);
    // Tokens whose inputs a lane loads together.
    let loads = comptime!(rows.min(BLOCK_LOADS));
    // Plane `run + BLOCK_PLANES * part` sums part `part` of the rows of column run `run`.
    let run = plane % BLOCK_PLANES;
    let part = plane / BLOCK_PLANES;
    let cube = CUBE_POS_Y as u64 * CUBE_COUNT_X as u64 + CUBE_POS_X as u64;
    let first_column = (cube * BLOCK_PLANES as u64 + run as u64) * columns as u64;
    let first_row = CUBE_POS_Z as u64 * rows as u64;
    // Lane `l` writes sum `s = l * len / LANES` (and `s + 1` where a lane holds two): token
    // `s / columns`, column `s % columns`.
    let held = (lane * len) / LANES;
    let row = first_row + (held / columns) as u64;
    let pair_column = first_column + (held % columns) as u64;
    let mut sums = Array::<A>::new(len);
    let mut squares = Array::<A>::new(rows);
    #[unroll]
    for j in 0..len {
        sums[j] = A::new(0.0);
    }
    #[unroll]
    for r in 0..rows {
        squares[r] = A::new(0.0);
    }
    // Every load unguarded (the guarded form measured 2.9x slower: RESULTS, session 42): a column
    // or token past the end reads the last one's, whose sums nothing stores.
    let mut w_rows = Array::<usize>::new(columns);
    #[unroll]
    for c in 0..columns {
        let column = last_at_most(first_column + c as u64, shape.outputs);
        w_rows[c] = (column * shape.w_stride) as usize;
    }
    let vectors = shape.inner as usize;
    let stride = splits * LANES;
    let mut weights = Array::<Vector<A, N>>::new(comptime!(columns * ahead));
    let mut inputs = Array::<Vector<A, N>>::new(comptime!(loads * ahead));
    let mut k = part * LANES + lane;
    while k < vectors {
        // `ahead` rounds' weights, then the block's inputs `loads` tokens at a time, each group's
        // loads for every round in flight together before they are added (unguarded: past the
        // row a lane reads its last vector, which no sum adds). A sum adds its rounds in order
        // whatever `ahead` and `loads` are.
        #[unroll]
        for a in 0..ahead {
            let at = last_at_most((k + a * stride) as u64, vectors as u64) as usize;
            #[unroll]
            for c in 0..columns {
                weights[a * columns + c] = Vector::<A, N>::cast_from(w[w_rows[c] + at]);
            }
        }
        #[unroll]
        for group in 0..rows / loads {
            #[unroll]
            for a in 0..ahead {
                let at = last_at_most((k + a * stride) as u64, vectors as u64) as usize;
                #[unroll]
                for i in 0..loads {
                    let token = first_row + comptime!(group * loads + i) as u64;
                    let token = last_at_most(token, shape.tokens);
                    inputs[a * loads + i] =
                        Vector::<A, N>::cast_from(x[(token * shape.x_stride) as usize + at]);
                }
            }
            #[unroll]
            for a in 0..ahead {
                if k + a * stride < vectors {
                    #[unroll]
                    for i in 0..loads {
                        add_token::<A, N>(
                            inputs[a * loads + i],
                            &weights,
                            &mut sums,
                            &mut squares,
                            comptime!(a * columns),
                            comptime!(group * loads + i),
                            columns,
                            norm,
                        );
                    }
                }
            }
        }
        k += ahead * stride;
    }
    // The folds' hand-over without `planes`, then the parts' sums (three a lane).
    let mut staged = Shared::<[A]>::new_slice(comptime!(if planes {
        splits * BLOCK_PLANES * LANES * 3
    } else {
        splits * BLOCK_PLANES * LANES * (len / 2).max(3)
    }));
    fold_halves::<A>(&mut sums, &mut staged, lane, plane, len, planes);
    if comptime![norm] {
        fold_halves::<A>(&mut squares, &mut staged, lane, plane, rows, planes);
    }
    // The parts' sums added in part order by the first part's planes (a lane's second sum only
    // where it holds two: under 64 sums its partner comes after).
    if comptime![splits > 1] {
        let at = (plane * LANES + lane) * 3;
        staged[at] = sums[0];
        if comptime![len >= BLOCK_VALUES] {
            staged[at + 1] = sums[1];
        }
        staged[at + 2] = squares[0];
        sync_cube();
        if part == 0 {
            #[unroll]
            for other in 1..splits {
                let at = ((other * BLOCK_PLANES + run) * LANES + lane) * 3;
                sums[0] += staged[at];
                if comptime![len >= BLOCK_VALUES] {
                    sums[1] += staged[at + 1];
                }
                squares[0] += staged[at + 2];
            }
        }
    }
    if comptime![len < BLOCK_VALUES] {
        // A lane holds one sum, as the `LANES / len` lanes after it do; its RoPE or SwiGLU
        // partner's run is that far away. The run's first lane writes it.
        sums[1] = if comptime![planes] {
            plane_shuffle_xor(sums[0], comptime!((LANES / len) as u32))
        } else {
            sync_cube();
            staged[plane * LANES + lane] = sums[0];
            sync_cube();
            staged[plane * LANES + (lane ^ comptime!(LANES / len))]
        };
    }
    let writes = comptime!(if len < BLOCK_VALUES { 1 } else { 2 });
    let first = (lane * len) % LANES == 0;
    #[unroll]
    for c in 0..writes {
        let column = pair_column + c as u64;
        if part == 0 && first && row < shape.tokens && column < shape.outputs {
            let around = Finish::<A> {
                squares: squares[0],
                elements: shape.inner * N::value() as u64,
                row,
                column,
            };
            finish::<F, A>(
                sums[c],
                sums[comptime!(c ^ 1)],
                around,
                shape,
                eps,
                residual,
                cos,
                sin,
                out,
                norm,
                add,
                rope,
                swiglu,
            );
        }
    }
}

/// Token `r`'s input vector `value` into its sums, a value at a time in order: its square (with
/// `norm`), then its products with the `columns` weight vectors from `weights[first]`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_token<A: Float, N: Size>(
    value: Vector<A, N>,
    weights: &Array<Vector<A, N>>,
    sums: &mut Array<A>,
    squares: &mut Array<A>,
    #[comptime] first: usize,
    #[comptime] r: usize,
    #[comptime] columns: usize,
    #[comptime] norm: bool,
) {
    #[unroll]
    for e in 0..N::value() {
        let input = value.extract(e);
        if comptime![norm] {
            squares[r] += input * input;
        }
        #[unroll]
        for c in 0..columns {
            sums[r * columns + c] += input * weights[first + c].extract(e);
        }
    }
}

/// A plane's `values` (`len` a lane, a power of two up to `2 * LANES`) folded by halves: at each
/// of five levels a lane keeps the half its bit of `mask` picks, adds the partner's
/// (`lane ^ mask`) values of that half and hands over the other (the upper half where its bit is
/// set); once a lane holds one value the levels left add the partner's whole. Then lane `l`'s
/// first `max(len / LANES, 1)` values are the plane's sums of values `l * len / LANES ..` (of
/// value `l * len / LANES` rounded down). Every sum is the same tree whatever its index (an add
/// is the same either way round). Without `planes` the hand-over goes through `staged`
/// (`BLOCK_PLANES * LANES * len / 2` values).
#[cube]
fn fold_halves<A: Float>(
    values: &mut Array<A>,
    staged: &mut Shared<[A]>,
    lane: usize,
    plane: usize,
    #[comptime] len: usize,
    #[comptime] planes: bool,
) {
    #[unroll]
    for level in 0..5u32 {
        let half = comptime!(len >> (level + 1));
        let mask = comptime!(LANES >> (level + 1));
        let upper = (lane & mask) != 0;
        if comptime![half == 0] {
            if comptime![planes] {
                let value = values[0];
                values[0] = value + plane_shuffle_xor(value, mask as u32);
            } else {
                let value = values[0];
                staged[plane * LANES + lane] = value;
                sync_cube();
                values[0] = value + staged[plane * LANES + (lane ^ mask)];
                sync_cube();
            }
        } else if comptime![planes] {
            #[unroll]
            for i in 0..half {
                let kept = select(upper, values[half + i], values[i]);
                let given = select(upper, values[i], values[half + i]);
                values[i] = kept + plane_shuffle_xor(given, mask as u32);
            }
        } else {
            let mine = (plane * LANES + lane) * half;
            let partner = (plane * LANES + (lane ^ mask)) * half;
            #[unroll]
            for i in 0..half {
                staged[mine + i] = select(upper, values[i], values[half + i]);
            }
            sync_cube();
            #[unroll]
            for i in 0..half {
                let kept = select(upper, values[half + i], values[i]);
                values[i] = kept + staged[partner + i];
            }
            sync_cube();
        }
    }
}
