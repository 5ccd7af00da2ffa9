//! The projection's launcher on the Cube backend (CUDA, wgpu/Vulkan).

use burn_core::backend::TensorMetadata;
use burn_core::backend::cubecl::dtype_to_storage_type;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, full_device_dtype};
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

use super::kernel::{
    BLOCK_COLUMNS, BLOCK_PLANES, BLOCK_VALUES, FEW_COLUMNS, FEW_TOKENS, GREEDY_UNITS, LANES,
    LinearShapeLaunch, NORM_UNITS, ROPE_UNITS, RopeScalarsLaunch, block_ahead, greedy_kernel,
    linear_block_kernel, rms_norm_kernel, rope_kernel, swiglu_kernel,
};
use super::{Around, RopeShape};

/// One launch of `linear_block_kernel`: a cube for each `BLOCK_PLANES` planes' columns and each
/// block of up to `BLOCK_VALUES / columns` tokens.
pub(super) fn linear(
    x: CubeTensor,
    w: CubeTensor,
    residual: CubeTensor,
    angles: Option<[CubeTensor; 2]>,
    around: Around,
) -> CubeTensor {
    let fit = super::fits(
        &around,
        &x.shape(),
        &w.shape(),
        Some(residual.shape().to_vec()),
        angles
            .as_ref()
            .map(|[cos, sin]| [cos.shape().to_vec(), sin.shape().to_vec()]),
    );
    if !fit {
        let outputs = w.shape().first().copied().unwrap_or(0);
        let shape = Shape::new([x.shape()[0], super::out_columns(&around, outputs)]);
        return nan(x, shape);
    }
    let [x, w, residual] = [x, w, residual].map(rows_of_unit_stride);
    // Without RoPE, `x` stands in for the angles (bound, never read).
    let [cos, sin] = angles
        .map(|angles| angles.map(rows_of_unit_stride))
        .unwrap_or_else(|| [x.clone(), x.clone()]);
    let (tokens, inner) = (x.shape()[0], w.shape()[1]);
    let outputs = w.shape()[0];
    let out = empty(
        &x,
        Shape::new([tokens, super::out_columns(&around, outputs)]),
        x.dtype,
    );
    if tokens == 0 || outputs == 0 {
        return out;
    }
    let knobs = super::knobs();
    let properties = x.client.properties();
    let planes = properties.features.plane.contains(Plane::Ops)
        && properties.hardware.plane_size_min == LANES as u32
        && properties.hardware.plane_size_max == LANES as u32;
    let address = address_type(&[&x, &w, &residual, &cos, &sin, &out]);
    let dtypes = kernel_dtypes(x.dtype);
    let client = x.client.clone();
    let eps = around.norm_eps.unwrap_or(0.0) as f32;
    let vector = vector_size(&x, &w, inner);
    let vectors = inner / vector;
    let shape = linear_shape(
        [tokens as u64, outputs as u64, vectors as u64],
        [&x, &w, &residual, &cos],
        vector as u64,
        &around,
    );
    // A token's sums are the same whatever its block and its plane's columns (the rows' parts and
    // the folds' order depend on the row's length alone), so both may follow the count.
    let columns = knobs.block_columns.unwrap_or(if tokens <= FEW_TOKENS {
        FEW_COLUMNS
    } else {
        BLOCK_COLUMNS
    });
    let block_rows = tokens.next_power_of_two().min(BLOCK_VALUES / columns);
    let column_cubes = outputs.div_ceil(columns * BLOCK_PLANES);
    // Parts of at most `block_rounds` rounds of a plane's loads each, up to the knob's most; where
    // planes fold in shared memory two at most, so its buffer stays small.
    let most = if planes { 8 } else { 2 }.min(knobs.most_splits);
    let splits = vectors.div_ceil(knobs.block_rounds * LANES).clamp(1, most);
    let ahead = block_ahead(block_rows, columns, vector, knobs.block_ahead);
    // SAFETY: in vectors of `vector` values, rows and strides whole vectors (`vector_size`): a
    // lane reads vectors below `inner` of rows below `tokens` and `outputs` (one past the end
    // reads the last; both are at least 1 here), each output written by one lane.
    unsafe {
        linear_block_kernel::launch_unchecked(
            &client,
            grid(column_cubes, tokens.div_ceil(block_rows)),
            CubeDim::new_2d(LANES as u32, (BLOCK_PLANES * splits) as u32),
            address,
            vector,
            x.into_tensor_arg(),
            w.into_tensor_arg(),
            residual.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            shape,
            eps,
            around.norm_eps.is_some(),
            around.swiglu,
            around.add,
            around.rope.is_some(),
            planes,
            splits,
            columns,
            block_rows,
            ahead,
            dtypes,
        );
    }
    out
}

/// RoPE of `y`'s first `shape.rotated` columns into a new contiguous tensor (`rope_kernel`): a
/// unit a value. Inputs that do not fit give NaN, as `linear`'s.
pub(super) fn rope(
    y: CubeTensor,
    cos: CubeTensor,
    sin: CubeTensor,
    shape: RopeShape,
) -> CubeTensor {
    let dims = y.shape().to_vec();
    let fit = <[usize; 2]>::try_from(dims.as_slice()).is_ok_and(|dims| {
        super::rope_fits(
            shape,
            dims,
            Some([cos.shape().to_vec(), sin.shape().to_vec()]),
        )
    });
    if !fit {
        return nan(y, Shape::from(dims));
    }
    let [y, cos, sin] = [y, cos, sin].map(rows_of_unit_stride);
    let (tokens, width) = (dims[0], dims[1]);
    let out = empty(&y, Shape::new([tokens, width]), y.dtype);
    let values = tokens * width;
    if values == 0 {
        return out;
    }
    let cubes = values.div_ceil(ROPE_UNITS);
    let count = grid(cubes, 1);
    let scalars = RopeScalarsLaunch::new(
        tokens as u64,
        width as u64,
        row_stride(&y),
        shape.rotated as u64,
        (shape.head_dim / 2) as u64,
        row_stride(&cos),
    );
    let address = address_type(&[&y, &cos, &sin, &out]);
    let (dtypes, client) = (kernel_dtypes(y.dtype), y.client.clone());
    // SAFETY: every read is inside `y` (rows of unit column stride, columns below `width`; a
    // turned column's partner is in its pair, below `rotated`) or the angles (`[tokens, pairs]`,
    // checked above); each output written by one unit.
    unsafe {
        rope_kernel::launch_unchecked(
            &client,
            count,
            CubeDim::new_1d(ROPE_UNITS as u32),
            address,
            y.into_tensor_arg(),
            cos.into_tensor_arg(),
            sin.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            scalars,
            dtypes,
        );
    }
    out
}

/// SwiGLU of `y`'s column pairs (`swiglu_kernel`): a unit a value. An odd width or a `y` that is
/// not a matrix gives NaN, as `linear`'s misfits.
pub(super) fn swiglu(y: CubeTensor) -> CubeTensor {
    let dims = y.shape().to_vec();
    let Ok([tokens, width]) = <[usize; 2]>::try_from(dims.as_slice()) else {
        return nan(y, Shape::from(dims));
    };
    let half = width / 2;
    if width % 2 == 1 {
        return nan(y, Shape::new([tokens, half]));
    }
    let y = rows_of_unit_stride(y);
    let out = empty(&y, Shape::new([tokens, half]), y.dtype);
    let values = tokens * half;
    if values == 0 {
        return out;
    }
    let count = grid(values.div_ceil(ROPE_UNITS), 1);
    let address = address_type(&[&y, &out]);
    let (dtypes, client, stride) = (kernel_dtypes(y.dtype), y.client.clone(), row_stride(&y));
    // SAFETY: every read is inside `y` (rows of unit column stride, columns below `2 * half`);
    // each output written by one unit.
    unsafe {
        swiglu_kernel::launch_unchecked(
            &client,
            count,
            CubeDim::new_1d(ROPE_UNITS as u32),
            address,
            y.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            tokens as u64,
            half as u64,
            stride,
            dtypes,
        );
    }
    out
}

/// `x / rms(x)` of each row (`rms_norm_kernel`): a cube a row. A `x` that is not a matrix gives
/// NaN, as `linear`'s misfits.
pub(super) fn rms_norm(x: CubeTensor, eps: f64) -> CubeTensor {
    let dims = x.shape().to_vec();
    let Ok([rows, cols]) = <[usize; 2]>::try_from(dims.as_slice()) else {
        return nan(x, Shape::from(dims));
    };
    let x = rows_of_unit_stride(x);
    let out = empty(&x, Shape::new([rows, cols]), x.dtype);
    if rows * cols == 0 {
        return out;
    }
    let address = address_type(&[&x, &out]);
    let (dtypes, client, stride) = (kernel_dtypes(x.dtype), x.client.clone(), row_stride(&x));
    // SAFETY: every read is inside `x` (rows of unit column stride, columns below `cols`); each
    // row of `out` written by its own cube.
    unsafe {
        rms_norm_kernel::launch_unchecked(
            &client,
            grid(rows, 1),
            CubeDim::new_1d(NORM_UNITS as u32),
            address,
            x.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows as u64,
            cols as u64,
            stride,
            eps as f32,
            dtypes,
        );
    }
    out
}

/// Each row's greedy token (`greedy_kernel`): a cube a row, i64 out.
pub(super) fn greedy(logits: CubeTensor) -> CubeTensor {
    let logits = rows_of_unit_stride(logits);
    let (rows, vocab) = (logits.shape()[0], logits.shape()[1]);
    let out = empty(&logits, Shape::new([rows]), DType::I64);
    if rows == 0 {
        return out;
    }
    let cubes = grid(rows, 1);
    let widest = logits.handle.size() as usize / logits.dtype.size();
    let address = if widest < (1 << 31) {
        AddressType::U32
    } else {
        AddressType::U64
    };
    let (stride, dtype, client) = (
        row_stride(&logits),
        dtype_to_storage_type(logits.dtype),
        logits.client.clone(),
    );
    // SAFETY: every read is inside `logits` (rows of unit column stride at the row stride
    // given, columns below `vocab`), each output written by its row's cube.
    unsafe {
        greedy_kernel::launch_unchecked(
            &client,
            cubes,
            CubeDim::new_1d(GREEDY_UNITS as u32),
            address,
            logits.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            rows as u64,
            vocab as u64,
            stride,
            // A round of loads covers 8,192 logits: a vocabulary of 49,152 in six.
            16,
            dtype,
        );
    }
    out
}

/// The launch's scalars: `x`'s and `w`'s row strides in vectors of `vector` values (as `inner`),
/// the residual's and the angles' where they are read.
fn linear_shape(
    [tokens, outputs, inner]: [u64; 3],
    [x, w, residual, cos]: [&CubeTensor; 4],
    vector: u64,
    around: &Around,
) -> LinearShapeLaunch {
    LinearShapeLaunch::new(
        tokens,
        outputs,
        inner,
        row_stride(x) / vector,
        row_stride(w) / vector,
        if around.add { row_stride(residual) } else { 0 },
        around.rope.map_or(0, |rope| rope.rotated as u64),
        around.rope.map_or(0, |rope| (rope.head_dim / 2) as u64),
        if around.rope.is_some() {
            row_stride(cos)
        } else {
            0
        },
    )
}

/// `cubes` cubes along x (and y past 65,535), `blocks` along z: cube `(c, b)` reads `c` as
/// `y * count_x + x`.
fn grid(cubes: usize, blocks: usize) -> CubeCount {
    let x_cubes = cubes.min(65_535);
    CubeCount::Static(
        x_cubes as u32,
        cubes.div_ceil(x_cubes) as u32,
        blocks as u32,
    )
}

/// 32-bit indexing where every tensor's buffer allows it.
fn address_type(tensors: &[&CubeTensor]) -> AddressType {
    let widest = tensors
        .iter()
        .map(|tensor| tensor.handle.size() as usize / tensor.dtype.size())
        .max()
        .unwrap_or(0);
    if widest < (1 << 31) {
        AddressType::U32
    } else {
        AddressType::U64
    }
}

/// The widest vector (16 bytes at most) that `x`'s and `w`'s rows are whole vectors of: the
/// width, the row strides and the buffers' offsets its multiples.
fn vector_size(x: &CubeTensor, w: &CubeTensor, inner: usize) -> usize {
    let size = x.dtype.size();
    let fits = |vector: usize| {
        inner % vector == 0
            && [x, w].iter().all(|tensor| {
                row_stride(tensor) % vector as u64 == 0
                    && tensor.handle.offset_start.unwrap_or(0) % (vector * size) as u64 == 0
            })
    };
    [16 / size, 8 / size, 4 / size, 2 / size, 1]
        .into_iter()
        .find(|&vector| vector >= 1 && fits(vector))
        .unwrap_or(1)
}

/// `tensor` as rows of unit column stride: as it is when it already is (CUDA pitches a matrix's
/// rows, so a weight's row stride is often past its width), else a contiguous copy.
fn rows_of_unit_stride(tensor: CubeTensor) -> CubeTensor {
    let strides = tensor.meta.strides();
    if !tensor.meta.is_tiled() && strides.len() == 2 && strides[1] == 1 {
        tensor
    } else {
        burn_cubecl::kernel::into_contiguous(tensor)
    }
}

fn row_stride(tensor: &CubeTensor) -> u64 {
    tensor.meta.strides()[0] as u64
}

/// The storage type of a kernel's `dtype` tensors and of its sums: f32 for half precision (bf16
/// weights and activations sum in f32), else the dtype's own.
fn kernel_dtypes(dtype: DType) -> [ElemType; 2] {
    let sums = match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    };
    [dtype, sums].map(dtype_to_storage_type)
}

/// An uninitialised contiguous output of `shape` and `dtype` on `like`'s device.
fn empty(like: &CubeTensor, shape: Shape, dtype: DType) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// NaN of `like`'s dtype in `shape`: the output of a launch whose inputs do not fit.
fn nan(like: CubeTensor, shape: Shape) -> CubeTensor {
    let value = InputScalar::new(f32::NAN, dtype_to_storage_type(like.dtype));
    full_device_dtype(like.client, shape, like.device, value, like.dtype)
}
