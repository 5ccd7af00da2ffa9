//! The model's projections at a step's few tokens, as Burn backend extension ops: the RMSNorm or
//! SwiGLU before a projection, and the residual or RoPE after it, ride in the same launch, over
//! the weights' `[out, in]` rows. Steps of more tokens (prefill, wide verify windows) take Burn's
//! matmul and ops.

#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube;
pub mod kernel;

use burn_core as burn; // the paths `#[backend_extension]` generates
use burn_core::backend::fusion::custom::TensorSpec;
use burn_core::backend::tensor::{FloatTensor, IntTensor};
use burn_core::backend::{
    Backend, Dispatch, DispatchDevice, Flex, TensorData, TensorMetadata, backend_extension,
    try_read_sync,
};
use burn_core::tensor::{DType, FloatDType, Tensor};

/// Tokens up to which a projection runs the extension's kernel; more (a prefill) take Burn's
/// matmul (`KVPLAN_PROJECTION_MAX_TOKENS` moves it: `Knobs`). Up to here a token's bits are the
/// same at every count, so a verify window and a plain step agree.
pub const MAX_TOKENS: usize = 64;

/// Tokens a drafting step verifies at most by default (`EngineOptions::spec_max_tokens`): wider
/// windows cost more than their accepted drafts give back.
pub const VERIFY_TOKENS: usize = 16;

/// The benchmark knobs, read once from the environment (where the kernel's layouts pay depends
/// on the device):
/// - `KVPLAN_PROJECTION_MAX_TOKENS`: the most tokens the extension's op takes ([`MAX_TOKENS`]);
/// - `KVPLAN_PROJECTION_BLOCK_SPLITS=N`: the most parts the kernel splits each row into, a plane
///   each (4 by default; 1: a plane walks the whole row);
/// - `KVPLAN_PROJECTION_BLOCK_ROUNDS=N`: the most rounds of loads a part takes
///   (`kernel::BLOCK_ROUNDS` by default; fewer: more parts, more planes a cube);
/// - `KVPLAN_PROJECTION_BLOCK_COLUMNS=N` (2, 4 or 8): the columns a plane makes at every count
///   (by default `kernel::FEW_COLUMNS` up to `kernel::FEW_TOKENS` tokens, then
///   `kernel::BLOCK_COLUMNS`), its block `64 / N` tokens;
/// - `KVPLAN_PROJECTION_BLOCK_AHEAD=N`: the most rounds of loads a lane issues together
///   (`kernel::block_ahead`; 1: a round at a time).
///
/// None changes a token's bits but the splits and rounds (a row's parts).
struct Knobs {
    max_tokens: usize,
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    most_splits: usize,
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    block_rounds: usize,
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    block_columns: Option<usize>,
    #[cfg_attr(not(any(feature = "vulkan", feature = "cuda")), allow(dead_code))]
    block_ahead: usize,
}

fn knobs() -> &'static Knobs {
    static KNOBS: std::sync::OnceLock<Knobs> = std::sync::OnceLock::new();
    KNOBS.get_or_init(|| {
        let var = |name| std::env::var(name).ok();
        Knobs {
            max_tokens: var("KVPLAN_PROJECTION_MAX_TOKENS")
                .and_then(|value| value.parse().ok())
                .unwrap_or(MAX_TOKENS),
            most_splits: var("KVPLAN_PROJECTION_BLOCK_SPLITS")
                .and_then(|value| value.parse().ok())
                .unwrap_or(4usize)
                .clamp(1, 8),
            block_rounds: var("KVPLAN_PROJECTION_BLOCK_ROUNDS")
                .and_then(|value| value.parse().ok())
                .unwrap_or(kernel::BLOCK_ROUNDS)
                .clamp(1, kernel::BLOCK_ROUNDS),
            block_columns: match var("KVPLAN_PROJECTION_BLOCK_COLUMNS").as_deref() {
                Some("2") => Some(2),
                Some("4") => Some(4),
                Some("8") => Some(8),
                _ => None,
            },
            block_ahead: var("KVPLAN_PROJECTION_BLOCK_AHEAD")
                .and_then(|value| value.parse().ok())
                .unwrap_or(kernel::BLOCK_ROUNDS),
        }
    })
}

fn max_tokens() -> usize {
    knobs().max_tokens
}

/// Whether a projection of `x` runs the extension's op: up to `max_tokens()` tokens, on a device
/// with its kernels. Flex's op is the host reference, which reads every weight back a call (20x
/// slower than Burn's matmul there: `benches/RESULTS.md`, session 39), so Flex takes Burn's ops.
fn extension_op(x: &Tensor<2>) -> bool {
    x.dims()[0] <= max_tokens() && on_gpu(x)
}

/// Whether `x` is on a Cube device (not Flex, whose ops the host bodies would read back).
fn on_gpu(x: &Tensor<2>) -> bool {
    !matches!(x.device().as_dispatch(), DispatchDevice::Flex(_))
}

/// What rides with a projection: an RMSNorm of its input before; a residual, RoPE or SwiGLU
/// after.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Around {
    /// `Some(eps)`: each token's output divided by `sqrt(mean(x^2) + eps)` of its input (the
    /// norm's weight is folded into the matrix).
    pub norm_eps: Option<f64>,
    /// Each pair of output columns `(2i, 2i + 1)`, gate then up, gives column `i` of the output
    /// (`[tokens, outputs / 2]`): `silu(gate) * up`. Neither residual nor RoPE with it.
    pub swiglu: bool,
    /// The residual (the third input) added to the output.
    pub add: bool,
    /// RoPE of the first output columns (`linear_rope`).
    pub rope: Option<RopeShape>,
}

/// Which output columns RoPE rotates: the first `rotated` (the queries' and keys'), in heads of
/// `head_dim` (even) whose adjacent columns `(2i, 2i + 1)` are a pair at angle `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RopeShape {
    /// Rotated output columns, a multiple of `head_dim`.
    pub rotated: usize,
    /// Columns a head.
    pub head_dim: usize,
}

/// The projection as a backend extension: the Cube backend's kernel (`kernel`), the host
/// reference (default bodies) everywhere else.
#[backend_extension(Fusion, Flex, Cube: cfg(any(feature = "vulkan", feature = "cuda")))]
pub trait LinearBackend: Backend {
    /// `[residual +] (x [/ rms(x)]) w^T` for `x` `[tokens, inner]`, `w` `[outputs, inner]` and
    /// `residual` `[tokens, outputs]` (unread without `around.add`), in `x`'s float dtype; with
    /// `around.swiglu`, `[tokens, outputs / 2]` of its column pairs.
    #[fusion(meta = |x, w, _residual, around| TensorSpec::new([x.shape[0], out_columns(&around, w.shape[0])].into(), x.dtype))]
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        around: Around,
    ) -> FloatTensor<Self> {
        host_linear::<Self>(x, w, Some(residual), None, around)
    }

    /// `(x [/ rms(x)]) w^T` with RoPE of its first `around.rope` columns: pair `i` of each
    /// token's heads turned by `cos[t, i]`, `sin[t, i]` (`[tokens, head_dim / 2]`).
    #[fusion(meta = |x, w, _cos, _sin, _around| TensorSpec::new([x.shape[0], w.shape[0]].into(), x.dtype))]
    fn linear_rope(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        around: Around,
    ) -> FloatTensor<Self> {
        host_linear::<Self>(x, w, None, Some([cos, sin]), around)
    }

    /// RoPE of `y`'s first `shape.rotated` columns (`y` `[tokens, width]`), the rest as they are:
    /// the steps past [`MAX_TOKENS`], whose projection is Burn's matmul, in one launch.
    #[fusion(meta = |y, _cos, _sin, _shape| TensorSpec::new(y.shape.clone(), y.dtype))]
    fn rope(
        y: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        shape: RopeShape,
    ) -> FloatTensor<Self> {
        host_rope::<Self>(y, cos, sin, shape)
    }

    /// `silu(gate) * up` of each column pair `(2i, 2i + 1)` of `y` `[tokens, 2 * half]`, as
    /// `[tokens, half]`: the steps past [`MAX_TOKENS`], whose gate/up projection is Burn's
    /// matmul, in one launch (NaN for an odd width).
    #[fusion(meta = |y| TensorSpec::new([y.shape[0], y.shape[1] / 2].into(), y.dtype))]
    fn swiglu(y: FloatTensor<Self>) -> FloatTensor<Self> {
        host_swiglu::<Self>(y)
    }

    /// `x / rms(x)` of each row of `x` `[tokens, width]` (`rms(x) = sqrt(mean(x^2) + eps)`, in
    /// f32 for half precision): the steps past [`MAX_TOKENS`], whose projection is Burn's matmul,
    /// in one launch where Burn's ops take a reduce and an elementwise kernel.
    #[fusion(meta = |x, _eps| TensorSpec::new(x.shape.clone(), x.dtype))]
    fn rms_norm(x: FloatTensor<Self>, eps: f64) -> FloatTensor<Self> {
        host_rms_norm::<Self>(x, eps)
    }

    /// Each row's greedy token of `logits` `[rows, vocab]`: the index of its largest value, the
    /// first of equal ones, as i64 `[rows]`.
    #[fusion(meta = |logits| TensorSpec::new([logits.shape[0]].into(), burn_core::tensor::DType::I64))]
    fn greedy(logits: FloatTensor<Self>) -> IntTensor<Self> {
        host_greedy::<Self>(logits)
    }
}

/// Output columns of a projection of `outputs` columns: half with SwiGLU (a column a pair).
pub(crate) fn out_columns(around: &Around, outputs: usize) -> usize {
    if around.swiglu { outputs / 2 } else { outputs }
}

/// Whether a projection's inputs fit each other and `around` (`x` `[tokens, inner]`; `w`
/// `[outputs, inner]`; the residual `[tokens, outputs]` when added; RoPE of whole even heads
/// within the outputs, with angles `[tokens, head_dim / 2]`; SwiGLU of even outputs, alone). An op
/// given inputs that do not returns NaN, its launch never made (no read past an input).
pub(crate) fn fits(
    around: &Around,
    x: &[usize],
    w: &[usize],
    residual: Option<Vec<usize>>,
    angles: Option<[Vec<usize>; 2]>,
) -> bool {
    let ([tokens, x_cols], [outputs, inner]) = (
        <[usize; 2]>::try_from(x).unwrap_or([0, usize::MAX]),
        <[usize; 2]>::try_from(w).unwrap_or([0, 0]),
    );
    let residual_fits = !around.add || residual == Some(vec![tokens, outputs]);
    let rope_fits = around
        .rope
        .is_none_or(|rope| rope_fits(rope, [tokens, outputs], angles));
    let swiglu_fits = !around.swiglu || (outputs % 2 == 0 && !around.add && around.rope.is_none());
    x_cols == inner && residual_fits && rope_fits && swiglu_fits
}

/// Whether RoPE of whole even heads within `[tokens, columns]` fits its angles (`[tokens,
/// head_dim / 2]` each).
pub(crate) fn rope_fits(
    rope: RopeShape,
    [tokens, columns]: [usize; 2],
    angles: Option<[Vec<usize>; 2]>,
) -> bool {
    let pairs = [tokens, rope.head_dim / 2];
    rope.head_dim > 0
        && rope.head_dim % 2 == 0
        && rope.rotated % rope.head_dim == 0
        && rope.rotated <= columns
        && angles.is_some_and(|[cos, sin]| cos == pairs && sin == pairs)
}

/// The default bodies: inputs read back, [`reference`], the result uploaded.
fn host_linear<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    residual: Option<FloatTensor<B>>,
    angles: Option<[FloatTensor<B>; 2]>,
    around: Around,
) -> FloatTensor<B> {
    let device = x.device();
    let dtype = x.dtype();
    let out_shape = [
        x.shape()[0],
        out_columns(&around, w.shape().first().copied().unwrap_or(0)),
    ];
    let fit = fits(
        &around,
        &x.shape(),
        &w.shape(),
        residual.as_ref().map(|residual| residual.shape().to_vec()),
        angles
            .as_ref()
            .map(|[cos, sin]| [cos.shape().to_vec(), sin.shape().to_vec()]),
    );
    if !fit {
        let nan = vec![f64::NAN; out_shape[0] * out_shape[1]];
        return B::float_from_data(
            TensorData::new(nan, out_shape).convert_dtype(dtype),
            &device,
        );
    }
    let read = |tensor: FloatTensor<B>| -> (Vec<usize>, Vec<f64>) {
        let shape = tensor.shape().to_vec();
        let data = read_f64::<B>(tensor).unwrap_or_default();
        (shape, data)
    };
    let ((x_shape, x), (w_shape, w)) = (read(x), read(w));
    let residual = match residual.filter(|_| around.add) {
        Some(residual) => read(residual).1,
        None => Vec::new(),
    };
    let angles = angles.map(|[cos, sin]| [read(cos).1, read(sin).1]);
    let (tokens, inner, outputs) = (x_shape[0], w_shape[1], w_shape[0]);
    let angles = angles
        .as_ref()
        .map(|[cos, sin]| [cos.as_slice(), sin.as_slice()]);
    let values = reference(&x, &w, &residual, angles, [tokens, inner, outputs], around);
    B::float_from_data(
        TensorData::new(values, out_shape).convert_dtype(dtype),
        &device,
    )
}

/// `tensor`'s values as f64, `None` where it cannot be read back.
fn read_f64<B: Backend>(tensor: FloatTensor<B>) -> Option<Vec<f64>> {
    try_read_sync(B::float_into_data(tensor))
        .and_then(Result::ok)
        .and_then(|data| data.convert::<f64>().try_to_vec::<f64>().ok())
}

/// The default body of `greedy`: the logits read back, [`greedy_reference`], the tokens uploaded.
fn host_greedy<B: Backend>(logits: FloatTensor<B>) -> IntTensor<B> {
    let device = logits.device();
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    let values = read_f64::<B>(logits).unwrap_or_default();
    // An empty row's token is 0, as the kernel's (and an unreadable input gives 0s, not a panic).
    let tokens = if vocab > 0 && values.len() == rows * vocab {
        greedy_reference(&values, vocab)
    } else {
        vec![0; rows]
    };
    B::int_from_data(TensorData::new(tokens, [rows]), &device)
}

/// The default body of `rope`: the inputs read back, [`rope_reference`], the result uploaded
/// (NaN where they do not fit, as `linear`'s).
fn host_rope<B: Backend>(
    y: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    shape: RopeShape,
) -> FloatTensor<B> {
    let (device, dtype) = (y.device(), y.dtype());
    let dims = y.shape().to_vec();
    let angles = Some([cos.shape().to_vec(), sin.shape().to_vec()]);
    let read = |tensor: FloatTensor<B>| read_f64::<B>(tensor).unwrap_or_default();
    let values = match <[usize; 2]>::try_from(dims.as_slice()) {
        Ok(dims) if rope_fits(shape, dims, angles) => {
            rope_reference(&read(y), &read(cos), &read(sin), dims[1], shape)
        }
        _ => vec![f64::NAN; dims.iter().product()],
    };
    B::float_from_data(TensorData::new(values, dims).convert_dtype(dtype), &device)
}

/// The default body of `swiglu`: `y` read back, [`swiglu_reference`], the result uploaded (NaN
/// for an odd width).
fn host_swiglu<B: Backend>(y: FloatTensor<B>) -> FloatTensor<B> {
    let (device, dtype) = (y.device(), y.dtype());
    let dims = y.shape().to_vec();
    let out = [
        dims.first().copied().unwrap_or(0),
        dims.get(1).map_or(0, |w| w / 2),
    ];
    let values = match <[usize; 2]>::try_from(dims.as_slice()) {
        Ok([tokens, width]) if width % 2 == 0 => {
            let read = read_f64::<B>(y).unwrap_or_else(|| vec![f64::NAN; tokens * width]);
            swiglu_reference(&read)
        }
        _ => vec![f64::NAN; out[0] * out[1]],
    };
    B::float_from_data(TensorData::new(values, out).convert_dtype(dtype), &device)
}

/// The default body of `rms_norm`: `x` read back, [`rms_norm_reference`], the result uploaded
/// (NaN for a `x` that is not a matrix).
fn host_rms_norm<B: Backend>(x: FloatTensor<B>, eps: f64) -> FloatTensor<B> {
    let (device, dtype) = (x.device(), x.dtype());
    let dims = x.shape().to_vec();
    let values = match <[usize; 2]>::try_from(dims.as_slice()) {
        Ok([tokens, width]) => {
            let read = read_f64::<B>(x).unwrap_or_else(|| vec![f64::NAN; tokens * width]);
            rms_norm_reference(&read, width, eps)
        }
        _ => vec![f64::NAN; dims.iter().product()],
    };
    B::float_from_data(TensorData::new(values, dims).convert_dtype(dtype), &device)
}

/// RMSNorm on the host: each row of `width` values of `x` divided by `sqrt(mean(x^2) + eps)`.
pub fn rms_norm_reference(x: &[f64], width: usize, eps: f64) -> Vec<f64> {
    x.chunks(width.max(1))
        .flat_map(|row| {
            let scale = rms(row, eps);
            row.iter().map(move |v| v / scale)
        })
        .collect()
}

/// `sqrt(mean(row^2) + eps)`.
fn rms(row: &[f64], eps: f64) -> f64 {
    (row.iter().map(|v| v * v).sum::<f64>() / row.len() as f64 + eps).sqrt()
}

/// SwiGLU on the host: `silu(gate) * up` of each pair `(gate, up)` of `y`, in order.
pub fn swiglu_reference(y: &[f64]) -> Vec<f64> {
    y.chunks_exact(2)
        .map(|pair| gated(pair[0], pair[1]))
        .collect()
}

/// `silu(gate) * up`, as the kernels write it: `gate / (1 + exp(-gate)) * up`.
fn gated(gate: f64, up: f64) -> f64 {
    gate / (1.0 + (-gate).exp()) * up
}

/// RoPE on the host, as the kernels turn a pair: `(a, b)` to `(a cos - b sin, b cos + a sin)`
/// for the pairs of each row's first `shape.rotated` columns (rows of `width` values; `cos`,
/// `sin` rows of `head_dim / 2`).
pub fn rope_reference(
    y: &[f64],
    cos: &[f64],
    sin: &[f64],
    width: usize,
    shape: RopeShape,
) -> Vec<f64> {
    let pairs = shape.head_dim / 2;
    let mut out = y.to_vec();
    for (row, values) in out.chunks_mut(width.max(1)).enumerate() {
        let original = &y[row * width..][..width];
        for column in 0..shape.rotated.min(width) {
            let angle = row * pairs + (column % shape.head_dim) / 2;
            let partner = original[column ^ 1];
            let turn = if column % 2 == 0 {
                -sin[angle]
            } else {
                sin[angle]
            };
            values[column] = original[column] * cos[angle] + partner * turn;
        }
    }
    out
}

/// Each row's greedy token of `logits` (rows of `vocab` values, `vocab` > 0): the index of its
/// largest value, the first of equal ones.
pub fn greedy_reference(logits: &[f64], vocab: usize) -> Vec<i64> {
    logits
        .chunks(vocab.max(1))
        .map(|row| {
            let mut best = 0;
            for (at, &value) in row.iter().enumerate() {
                if value > row[best] {
                    best = at;
                }
            }
            best as i64
        })
        .collect()
}

/// The projection on the host, in f64: what the kernel computes, summed in plain order (NaN where
/// an input could not be read). `angles`: RoPE's `cos` and `sin`, `[tokens, head_dim / 2]` each.
pub fn reference(
    x: &[f64],
    w: &[f64],
    residual: &[f64],
    angles: Option<[&[f64]; 2]>,
    [tokens, inner, outputs]: [usize; 3],
    around: Around,
) -> Vec<f64> {
    let pairs = around.rope.map_or(0, |rope| rope.head_dim / 2);
    let columns = out_columns(&around, outputs);
    let readable = x.len() == tokens * inner
        && w.len() == outputs * inner
        && (!around.add || residual.len() == tokens * outputs)
        && (around.rope.is_none()
            || angles.is_some_and(|[cos, sin]| {
                cos.len() == tokens * pairs && sin.len() == tokens * pairs
            }));
    let mut out = vec![f64::NAN; tokens * columns];
    if !readable {
        return out;
    }
    for t in 0..tokens {
        let row = &x[t * inner..][..inner];
        let scale = around.norm_eps.map_or(1.0, |eps| 1.0 / rms(row, eps));
        let dot = |n: usize| -> f64 {
            let dot: f64 = row
                .iter()
                .zip(&w[n * inner..][..inner])
                .map(|(a, b)| a * b)
                .sum();
            dot * scale
        };
        if around.swiglu {
            for (i, value) in out[t * columns..][..columns].iter_mut().enumerate() {
                *value = gated(dot(2 * i), dot(2 * i + 1));
            }
            continue;
        }
        for n in 0..outputs {
            let add = if around.add {
                residual[t * outputs + n]
            } else {
                0.0
            };
            let mut value = dot(n);
            if let (Some(rope), Some([cos, sin])) = (around.rope, angles) {
                if n < rope.rotated {
                    let at = t * pairs + (n % rope.head_dim) / 2;
                    value = if n % 2 == 0 {
                        value * cos[at] - dot(n + 1) * sin[at]
                    } else {
                        value * cos[at] + dot(n - 1) * sin[at]
                    };
                }
            }
            out[t * outputs + n] = add + value;
        }
    }
    out
}

/// A projection's matrix: its `[outputs, inner]` rows, which the kernel reads, and their
/// transposed view, which Burn's matmul takes (made once: a view made in every step would sit
/// between the norm's ops and the matmul and keep Burn's fusion from joining them).
#[derive(Debug, Clone)]
pub struct Weight {
    rows: Tensor<2>,
    columns: Tensor<2>,
}

impl Weight {
    /// The matrix of `rows` (`[outputs, inner]`).
    pub fn new(rows: Tensor<2>) -> Self {
        let columns = rows.clone().transpose();
        Self { rows, columns }
    }
}

/// A step's RoPE angles: `cos` and `sin` of each token's angle for each pair, `[tokens, head_dim
/// / 2]`, and the columns they turn.
#[derive(Debug, Clone)]
pub struct Rope {
    /// `cos` of each token's pair angles.
    pub cos: Tensor<2>,
    /// `sin` of each token's pair angles.
    pub sin: Tensor<2>,
    /// The columns turned.
    pub shape: RopeShape,
}

/// `[residual +] (x [/ rms(x)]) w^T` on `x`'s device: the extension's one launch up to
/// [`MAX_TOKENS`] tokens on a GPU, Burn's ops past them and on Flex. Shapes are the model's own
/// (checked at load), so nothing here fails.
pub fn linear(
    x: Tensor<2>,
    w: &Weight,
    residual: Option<Tensor<2>>,
    norm_eps: Option<f64>,
) -> Tensor<2> {
    if !extension_op(&x) {
        let y = normed(x, norm_eps).matmul(w.columns.clone());
        return residual.map_or(y.clone(), |residual| residual + y);
    }
    let around = Around {
        norm_eps,
        swiglu: false,
        add: residual.is_some(),
        rope: None,
    };
    // Without a residual, `x` stands in for it (bound, never read).
    let residual = residual.unwrap_or_else(|| x.clone());
    Tensor::from_dispatch(<Dispatch as LinearBackend>::linear(
        x.into_dispatch(),
        w.rows.clone().into_dispatch(),
        residual.into_dispatch(),
        around,
    ))
}

/// `silu(gate) * up` of `(x [/ rms(x)]) w^T`'s column pairs (`w`'s rows gate, up, gate, ..:
/// `[tokens, outputs / 2]`), on `x`'s device: the extension's one launch up to [`MAX_TOKENS`]
/// tokens on a GPU, Burn's matmul and the `swiglu` op past them and on Flex.
pub fn linear_swiglu(x: Tensor<2>, w: &Weight, norm_eps: Option<f64>) -> Tensor<2> {
    if !extension_op(&x) {
        let pairs = normed(x, norm_eps).matmul(w.columns.clone());
        // One launch for the pairs, in f32 for half precision (Burn's ops sliced each
        // interleaved column apart: two launches more a layer).
        return Tensor::from_dispatch(<Dispatch as LinearBackend>::swiglu(pairs.into_dispatch()));
    }
    let around = Around {
        norm_eps,
        swiglu: true,
        add: false,
        rope: None,
    };
    // `x` stands in for the residual (bound, never read).
    Tensor::from_dispatch(<Dispatch as LinearBackend>::linear(
        x.clone().into_dispatch(),
        w.rows.clone().into_dispatch(),
        x.into_dispatch(),
        around,
    ))
}

/// `(x [/ rms(x)]) w^T` with RoPE of its first `rope.shape.rotated` columns, on `x`'s device: the
/// extension's one launch up to [`MAX_TOKENS`] tokens on a GPU, Burn's ops past them and on Flex.
pub fn linear_rope(x: Tensor<2>, w: &Weight, rope: &Rope, norm_eps: Option<f64>) -> Tensor<2> {
    if !extension_op(&x) {
        let y = normed(x, norm_eps).matmul(w.columns.clone());
        return Tensor::from_dispatch(<Dispatch as LinearBackend>::rope(
            y.into_dispatch(),
            rope.cos.clone().into_dispatch(),
            rope.sin.clone().into_dispatch(),
            rope.shape,
        ));
    }
    let around = Around {
        norm_eps,
        swiglu: false,
        add: false,
        rope: Some(rope.shape),
    };
    Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_rope(
        x.into_dispatch(),
        w.rows.clone().into_dispatch(),
        rope.cos.clone().into_dispatch(),
        rope.sin.clone().into_dispatch(),
        around,
    ))
}

/// Each row's greedy token of `logits` `[rows, vocab]` (the first of its largest values), on
/// their device: one launch a step where Burn's argmax reduces a row in one long walk.
pub fn greedy(logits: Tensor<2>) -> Tensor<1, burn_core::tensor::Int> {
    Tensor::from_dispatch(<Dispatch as LinearBackend>::greedy(logits.into_dispatch()))
}

/// `x / rms(x)` with `Some(eps)` (in f32 for half precision, as the kernels), else `x`.
fn normed(x: Tensor<2>, norm_eps: Option<f64>) -> Tensor<2> {
    match norm_eps {
        Some(eps) if on_gpu(&x) => Tensor::from_dispatch(<Dispatch as LinearBackend>::rms_norm(
            x.into_dispatch(),
            eps,
        )),
        Some(eps) => {
            let dtype = x.dtype();
            let x = widened(x);
            let rms = x.clone().powi_scalar(2).mean_dim(1).add_scalar(eps).sqrt();
            (x / rms).cast(dtype)
        }
        None => x,
    }
}

/// Half precision as f32 (the sums and SwiGLU of Burn's ops, as the kernels keep them; logits
/// whose token ids and probabilities need more than bf16's 8 bits), others as they are.
pub(crate) fn widened(x: Tensor<2>) -> Tensor<2> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.cast(FloatDType::F32),
        _ => x,
    }
}

impl LinearBackend for Flex {}

#[cfg(any(feature = "vulkan", feature = "cuda"))]
impl LinearBackend for burn_cubecl::CubeBackend {
    fn linear(
        x: burn_cubecl::tensor::CubeTensor,
        w: burn_cubecl::tensor::CubeTensor,
        residual: burn_cubecl::tensor::CubeTensor,
        around: Around,
    ) -> burn_cubecl::tensor::CubeTensor {
        cube::linear(x, w, residual, None, around)
    }

    fn linear_rope(
        x: burn_cubecl::tensor::CubeTensor,
        w: burn_cubecl::tensor::CubeTensor,
        cos: burn_cubecl::tensor::CubeTensor,
        sin: burn_cubecl::tensor::CubeTensor,
        around: Around,
    ) -> burn_cubecl::tensor::CubeTensor {
        let residual = x.clone();
        cube::linear(x, w, residual, Some([cos, sin]), around)
    }

    fn rope(
        y: burn_cubecl::tensor::CubeTensor,
        cos: burn_cubecl::tensor::CubeTensor,
        sin: burn_cubecl::tensor::CubeTensor,
        shape: RopeShape,
    ) -> burn_cubecl::tensor::CubeTensor {
        cube::rope(y, cos, sin, shape)
    }

    fn swiglu(y: burn_cubecl::tensor::CubeTensor) -> burn_cubecl::tensor::CubeTensor {
        cube::swiglu(y)
    }

    fn rms_norm(x: burn_cubecl::tensor::CubeTensor, eps: f64) -> burn_cubecl::tensor::CubeTensor {
        cube::rms_norm(x, eps)
    }

    fn greedy(logits: burn_cubecl::tensor::CubeTensor) -> burn_cubecl::tensor::CubeTensor {
        cube::greedy(logits)
    }
}
