//! The model's projections at a step's few tokens, as one Burn backend extension op: the RMSNorm
//! before a projection and the residual after it ride in the same launch, over the weights'
//! `[out, in]` rows. Steps of more tokens (prefill, wide verify windows) take Burn's matmul.

#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube;
pub mod kernel;

use burn_core as burn; // the paths `#[backend_extension]` generates
use burn_core::backend::fusion::custom::TensorSpec;
use burn_core::backend::tensor::FloatTensor;
use burn_core::backend::{
    Backend, Dispatch, Flex, TensorData, TensorMetadata, backend_extension, try_read_sync,
};
use burn_core::tensor::Tensor;

/// Tokens up to which a projection runs the extension's kernel; more take Burn's matmul, whose
/// tiles pay off there. `KVPLAN_PROJECTION_MAX_TOKENS` overrides it (a benchmark's knob: where
/// the two cross depends on the device).
pub const MAX_TOKENS: usize = 16;

fn max_tokens() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("KVPLAN_PROJECTION_MAX_TOKENS")
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(MAX_TOKENS)
    })
}

/// What rides with a projection: an RMSNorm of its input before, a residual after.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Around {
    /// `Some(eps)`: each token's output divided by `sqrt(mean(x^2) + eps)` of its input (the
    /// norm's weight is folded into the matrix).
    pub norm_eps: Option<f64>,
    /// The residual (the third input) added to the output.
    pub add: bool,
}

/// The projection as a backend extension: the Cube backend's kernel (`kernel`), the host
/// reference (default body) everywhere else.
#[backend_extension(Fusion, Flex, Cube: cfg(any(feature = "vulkan", feature = "cuda")))]
pub trait LinearBackend: Backend {
    /// `[residual +] (x [/ rms(x)]) w^T` for `x` `[tokens, inner]`, `w` `[outputs, inner]` and
    /// `residual` `[tokens, outputs]` (unread without `around.add`), in `x`'s float dtype.
    #[fusion(meta = |x, w, _residual, _around| TensorSpec::new([x.shape[0], w.shape[0]].into(), x.dtype))]
    fn linear(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        around: Around,
    ) -> FloatTensor<Self> {
        let device = x.device();
        let dtype = x.dtype();
        let read = |tensor: FloatTensor<Self>| -> (Vec<usize>, Vec<f64>) {
            let shape = tensor.shape().to_vec();
            let data = try_read_sync(Self::float_into_data(tensor))
                .and_then(Result::ok)
                .map(|data| {
                    data.convert::<f64>()
                        .try_to_vec::<f64>()
                        .unwrap_or_default()
                })
                .unwrap_or_default();
            (shape, data)
        };
        let ((x_shape, x), (w_shape, w)) = (read(x), read(w));
        let residual = if around.add {
            read(residual).1
        } else {
            Vec::new()
        };
        let (tokens, inner, outputs) = (x_shape[0], x_shape[1], w_shape[0]);
        let values = reference(&x, &w, &residual, [tokens, inner, outputs], around);
        Self::float_from_data(
            TensorData::new(values, [tokens, outputs]).convert_dtype(dtype),
            &device,
        )
    }
}

/// The projection on the host, in f64: what the kernel computes, summed in plain order (NaN where
/// an input could not be read).
pub fn reference(
    x: &[f64],
    w: &[f64],
    residual: &[f64],
    [tokens, inner, outputs]: [usize; 3],
    around: Around,
) -> Vec<f64> {
    let readable = x.len() == tokens * inner
        && w.len() == outputs * inner
        && (!around.add || residual.len() == tokens * outputs);
    let mut out = vec![f64::NAN; tokens * outputs];
    if !readable {
        return out;
    }
    for t in 0..tokens {
        let row = &x[t * inner..][..inner];
        let scale = around.norm_eps.map_or(1.0, |eps| {
            let mean = row.iter().map(|v| v * v).sum::<f64>() / inner as f64;
            1.0 / (mean + eps).sqrt()
        });
        for n in 0..outputs {
            let dot: f64 = row
                .iter()
                .zip(&w[n * inner..][..inner])
                .map(|(a, b)| a * b)
                .sum();
            let add = if around.add {
                residual[t * outputs + n]
            } else {
                0.0
            };
            out[t * outputs + n] = add + dot * scale;
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

/// `[residual +] (x [/ rms(x)]) w^T` on `x`'s device: the extension's one launch up to
/// [`MAX_TOKENS`] tokens, Burn's ops past them. Shapes are the model's own (checked at load), so
/// nothing here fails.
pub fn linear(
    x: Tensor<2>,
    w: &Weight,
    residual: Option<Tensor<2>>,
    norm_eps: Option<f64>,
) -> Tensor<2> {
    let tokens = x.dims()[0];
    if tokens > max_tokens() {
        let x = match norm_eps {
            Some(eps) => {
                let rms = x.clone().powi_scalar(2).mean_dim(1).add_scalar(eps).sqrt();
                x / rms
            }
            None => x,
        };
        let y = x.matmul(w.columns.clone());
        return residual.map_or(y.clone(), |residual| residual + y);
    }
    let around = Around {
        norm_eps,
        add: residual.is_some(),
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

impl LinearBackend for Flex {}

#[cfg(any(feature = "vulkan", feature = "cuda"))]
impl LinearBackend for burn_cubecl::CubeBackend {
    fn linear(
        x: burn_cubecl::tensor::CubeTensor,
        w: burn_cubecl::tensor::CubeTensor,
        residual: burn_cubecl::tensor::CubeTensor,
        around: Around,
    ) -> burn_cubecl::tensor::CubeTensor {
        cube::linear(x, w, residual, around)
    }
}
