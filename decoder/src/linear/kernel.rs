//! The projection kernel for a step's few tokens: `out = [residual +] (x [/ rms(x)]) W^T`, over
//! weights kept as `[out, in]` rows.
//!
//! A plane of `LANES` units makes a few output columns for a block of `rows` tokens: lane `l` reads
//! the weight rows at `l, l + LANES, ..` (the plane's loads coalesced) and each token's input at the
//! same columns, then the lanes' sums fold in a fixed tree. A token's value is the same sums in the
//! same order whatever else is in the launch: a row is the same bits alone or in a verify window.

use cubecl::prelude::*;

/// Units a plane of the cube: the lanes that share one output column's dot product.
pub const LANES: usize = 32;
/// Planes of a cube: output columns a cube makes.
pub const PLANES: usize = 8;
/// The most tokens a cube makes its columns for (more tokens: more cubes along y).
pub const MAX_ROWS: usize = 8;

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
}

/// Cube `(c, b)` makes output columns `(c * PLANES + p) * columns ..` (plane `p` of the cube
/// `columns` of them) of tokens `b * rows ..`. With `norm`, each token's dot products are divided
/// by its input's RMS (`sqrt(mean(x^2) + eps)`: an RMSNorm whose weight is folded into `w`); with
/// `add`, `residual` is added. A lane loads `unroll` of its input columns at once (their loads in
/// flight together) before it adds them. With `planes` (planes exactly `LANES` wide: CUDA) the lanes fold by
/// plane sums, else in shared memory.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn linear_kernel<F: Float>(
    x: &Tensor<F>,
    w: &Tensor<F>,
    residual: &Tensor<F>,
    out: &mut Tensor<F>,
    shape: LinearShape,
    eps: f32,
    #[comptime] rows: usize,
    #[comptime] columns: usize,
    #[comptime] unroll: usize,
    #[comptime] norm: bool,
    #[comptime] add: bool,
    #[comptime] planes: bool,
    #[define(F)] _dtype: ElemType,
) {
    let lane = UNIT_POS_X as u64;
    let plane = UNIT_POS_Y as u64;
    let first_column = (CUBE_POS_X as u64 * PLANES as u64 + plane) * columns as u64;
    let first_row = CUBE_POS_Y as u64 * rows as u64;
    let mut dots = Array::<F>::new(rows * columns);
    let mut squares = Array::<F>::new(rows);
    #[unroll]
    for j in 0..rows * columns {
        dots[j] = F::new(0.0);
    }
    #[unroll]
    for r in 0..rows {
        squares[r] = F::new(0.0);
    }
    let mut weights = Array::<F>::new(unroll * columns);
    let mut inputs = Array::<F>::new(unroll * rows);
    let step = (LANES * unroll) as u64;
    let mut k = lane;
    while k < shape.inner {
        // Every load of the step first, then the sums in column order.
        #[unroll]
        for i in 0..unroll {
            let at = k + (i * LANES) as u64;
            let inside = at < shape.inner;
            #[unroll]
            for c in 0..columns {
                let column = first_column + c as u64;
                weights[i * columns + c] = F::new(0.0);
                if inside && column < shape.outputs {
                    weights[i * columns + c] = w[(column * shape.w_stride + at) as usize];
                }
            }
            #[unroll]
            for r in 0..rows {
                let row = first_row + r as u64;
                inputs[i * rows + r] = F::new(0.0);
                if inside && row < shape.tokens {
                    inputs[i * rows + r] = x[(row * shape.x_stride + at) as usize];
                }
            }
        }
        #[unroll]
        for i in 0..unroll {
            #[unroll]
            for r in 0..rows {
                let value = inputs[i * rows + r];
                if comptime![norm] {
                    squares[r] += value * value;
                }
                #[unroll]
                for c in 0..columns {
                    dots[r * columns + c] += value * weights[i * columns + c];
                }
            }
        }
        k += step;
    }
    if comptime![planes] {
        #[unroll]
        for j in 0..rows * columns {
            dots[j] = plane_sum(dots[j]);
        }
        if comptime![norm] {
            #[unroll]
            for r in 0..rows {
                squares[r] = plane_sum(squares[r]);
            }
        }
    } else {
        fold_lanes::<F>(&mut dots, &mut squares, lane, plane, rows, columns, norm);
    }
    // Lane 0 writes the plane's columns of every token.
    if lane == 0 {
        #[unroll]
        for r in 0..rows {
            let row = first_row + r as u64;
            let mut scale = F::new(1.0);
            if comptime![norm] {
                let mean = squares[r] / F::cast_from(shape.inner);
                scale = (mean + F::cast_from(eps)).sqrt();
            }
            #[unroll]
            for c in 0..columns {
                let column = first_column + c as u64;
                if row < shape.tokens && column < shape.outputs {
                    let mut value = dots[r * columns + c];
                    if comptime![norm] {
                        value /= scale;
                    }
                    if comptime![add] {
                        value += residual[(row * shape.residual_stride + column) as usize];
                    }
                    out[(row * shape.outputs + column) as usize] = value;
                }
            }
        }
    }
}

/// The lanes' sums folded in shared memory, in a fixed tree (lane 0 ends with `((l0 + l16) +
/// (l8 + l24)) + ..`, as a plane sum by halves), left in lane 0's `dots` and `squares`.
#[cube]
fn fold_lanes<F: Float>(
    dots: &mut Array<F>,
    squares: &mut Array<F>,
    lane: u64,
    plane: u64,
    #[comptime] rows: usize,
    #[comptime] columns: usize,
    #[comptime] norm: bool,
) {
    let values = comptime!(rows * columns + if norm { rows } else { 0 });
    let mut sums = Shared::<[F]>::new_slice(PLANES * values * LANES);
    let base = (plane * (values * LANES) as u64) as usize;
    #[unroll]
    for j in 0..rows * columns {
        sums[base + j * LANES + lane as usize] = dots[j];
    }
    if comptime![norm] {
        #[unroll]
        for r in 0..rows {
            sums[base + (rows * columns + r) * LANES + lane as usize] = squares[r];
        }
    }
    #[unroll]
    for level in 0..5u32 {
        let half = comptime!(LANES >> (level + 1));
        sync_cube();
        if (lane as usize) < half {
            #[unroll]
            for j in 0..values {
                let at = base + j * LANES + lane as usize;
                let other = sums[at + half];
                sums[at] += other;
            }
        }
    }
    sync_cube();
    #[unroll]
    for j in 0..rows * columns {
        dots[j] = sums[base + j * LANES];
    }
    if comptime![norm] {
        #[unroll]
        for r in 0..rows {
            squares[r] = sums[base + (rows * columns + r) * LANES];
        }
    }
}
