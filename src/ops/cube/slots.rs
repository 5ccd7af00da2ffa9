//! Launchers of the slot kernels: `segment_assign` and `store_kv`, a check launch then a write
//! launch each.

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use kvplan_kernels::scan::{CUBE_SIZE, PLANE_WIDTH};
use kvplan_kernels::slots::{
    AssignShapeLaunch, STORE_CLOCK_LIMIT, StoreRowsShapeLaunch, StoreShapeLaunch,
    assign_check_kernel, assign_write_kernel, store_check_kernel, store_write_kernel,
};
use kvplan_kernels::status::STATUS_LEN;

use super::{
    CUBES_PER_SM, address_type, bindable, contiguous, dims2, fixed_planes, grid, output_i64,
    resident_cubes, storage, stride, upload_i64, widened, writable,
};
use crate::ops::{AssignPrimitive, KvRows, StoreScratchPrimitive, StoredPrimitive};

/// A status record on the device holding a launch that could not run.
fn refused_status(like: &CubeTensor, error: crate::Error) -> CubeTensor {
    upload_i64(like, &crate::status::encode(&Err(error)))
}

/// A tensor the kernels may write in place: the caller's own buffer when no one else holds it and
/// no two of its elements share memory (a broadcast view does), otherwise a contiguous copy, which
/// is what the op then returns (Burn tensors are values: that is the same result).
fn owned(tensor: CubeTensor) -> CubeTensor {
    if tensor.is_nonoverlapping() {
        writable(tensor)
    } else {
        contiguous(tensor)
    }
}

/// Grid-stride cubes over `work` items, one per unit per pass: `(count, units)`.
fn stride_grid(like: &CubeTensor, work: usize) -> (CubeCount, usize) {
    let (count, cubes) = grid(resident_cubes(like, work, 1, CUBES_PER_SM));
    (count, cubes * CUBE_SIZE as usize)
}

pub(crate) fn segment_assign(
    req_to_token: CubeTensor,
    req_pool_indices: CubeTensor,
    start: CubeTensor,
    lengths: CubeTensor,
    out_cache_loc: CubeTensor,
) -> AssignPrimitive<CubeBackend> {
    let (rows, cols) = dims2(&req_to_token);
    let requests = req_pool_indices.shape()[0];
    let slots = out_cache_loc.shape()[0];
    let slot_max = crate::ops::slot_max(req_to_token.dtype);
    let table = owned(req_to_token);
    let status = output_i64(&table, STATUS_LEN);
    let offsets = output_i64(&table, requests + 1);
    let address = match address_type(
        [
            &table,
            &req_pool_indices,
            &start,
            &lengths,
            &out_cache_loc,
            &offsets,
        ],
        &[],
    ) {
        Ok(address) => address,
        Err(error) => {
            let status = refused_status(&table, error);
            return AssignPrimitive {
                req_to_token: table,
                status,
            };
        }
    };
    let planes = fixed_planes(&table, PLANE_WIDTH);
    let (req_pool_indices, start, lengths, out_cache_loc) = (
        bindable(widened(req_pool_indices)),
        bindable(widened(start)),
        bindable(widened(lengths)),
        bindable(widened(out_cache_loc)),
    );
    let bound_table = bindable(table.clone());
    let (write_grid, units) = stride_grid(&table, slots);
    // Read before the launches consume the bindings.
    let strides = [
        stride(&bound_table, 0),
        stride(&bound_table, 1),
        stride(&req_pool_indices, 0),
        stride(&start, 0),
        stride(&lengths, 0),
        stride(&out_cache_loc, 0),
    ];
    let shape = || {
        AssignShapeLaunch::new(
            rows as u64,
            cols as u64,
            requests as u64,
            slots as u64,
            slot_max,
            requests.div_ceil(CUBE_SIZE as usize) as u64,
            units as u64,
            strides[0],
            strides[1],
            strides[2],
            strides[3],
            strides[4],
            strides[5],
        )
    };
    let client = table.client.clone();
    let (q, s, l, c) = (
        storage(&req_pool_indices),
        storage(&start),
        storage(&lengths),
        storage(&out_cache_loc),
    );
    // SAFETY: every index the kernels form is bounds-checked against the shapes passed here.
    unsafe {
        assign_check_kernel::launch_unchecked(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(CUBE_SIZE),
            address,
            req_pool_indices.clone().into_tensor_arg(),
            start.clone().into_tensor_arg(),
            lengths.into_tensor_arg(),
            out_cache_loc.clone().into_tensor_arg(),
            offsets.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            shape(),
            planes,
            [q, s, l, c],
        );
        // Nothing to write without slots (a launch of no work is skipped).
        if slots > 0 {
            assign_write_kernel::launch_unchecked(
                &client,
                write_grid,
                CubeDim::new_1d(CUBE_SIZE),
                address,
                bound_table.clone().into_tensor_arg(),
                req_pool_indices.into_tensor_arg(),
                start.into_tensor_arg(),
                out_cache_loc.into_tensor_arg(),
                offsets.into_tensor_arg(),
                status.clone().into_tensor_arg(),
                shape(),
                [storage(&bound_table), q, s, c],
            );
        }
    }
    AssignPrimitive {
        req_to_token: table,
        status,
    }
}

/// The bytes of one row of a `[rows, ...]` tensor, and its row stride in bytes, when the trailing
/// dims are contiguous (size-1 dims aside); `None` otherwise.
fn row_layout(tensor: &CubeTensor) -> Option<(usize, usize)> {
    let (shape, strides) = (tensor.shape(), tensor.meta.strides());
    let mut expected = 1;
    for axis in (1..shape.num_dims()).rev() {
        if shape[axis] > 1 && strides[axis] != expected {
            return None;
        }
        expected *= shape[axis];
    }
    Some((
        expected * tensor.dtype.size(),
        strides[0] * tensor.dtype.size(),
    ))
}

/// A tensor of rows whose trailing dims are contiguous: itself, or a contiguous copy.
fn with_rows(tensor: CubeTensor) -> CubeTensor {
    match row_layout(&tensor) {
        Some(_) => tensor,
        None => contiguous(tensor),
    }
}

/// How the store's write kernel moves rows: `word` bytes as one unsigned int, `lanes` of them per
/// vector, the widest that every row of both tensors starts on and spans whole.
#[derive(Debug, Clone, Copy)]
struct RowWords {
    word: usize,
    lanes: usize,
}

impl RowWords {
    fn of(row_bytes: usize, tensors: [&CubeTensor; 2]) -> Self {
        // Everything a vector's start is a multiple of: the row, the row strides (of tensors with
        // more than one row), the buffers' offsets.
        let mut multiple = row_bytes;
        for tensor in tensors {
            if tensor.shape()[0] > 1 {
                multiple = gcd(multiple, stride(tensor, 0) as usize * tensor.dtype.size());
            }
            multiple = gcd(multiple, tensor.handle.offset_start.unwrap_or(0) as usize);
        }
        let word = [4, 2, 1]
            .into_iter()
            .find(|word| multiple % word == 0)
            .unwrap_or(1);
        let lanes = [4, 2, 1]
            .into_iter()
            .find(|lanes| multiple % (word * lanes) == 0)
            .unwrap_or(1);
        Self { word, lanes }
    }

    fn dtype(self) -> DType {
        match self.word {
            4 => DType::U32,
            2 => DType::U16,
            _ => DType::U8,
        }
    }

    /// The buffer of `tensor` seen as words.
    fn view(self, tensor: &CubeTensor) -> CubeTensor {
        let words = (tensor.handle.size() as usize / self.word).max(1);
        CubeTensor::new_contiguous(
            tensor.client.clone(),
            tensor.device.clone(),
            Shape::new([words]),
            tensor.handle.clone(),
            self.dtype(),
        )
    }

    /// A row stride of `tensor`, in vectors.
    fn row_stride(self, tensor: &CubeTensor) -> u64 {
        (stride(tensor, 0) as usize * tensor.dtype.size() / (self.word * self.lanes)) as u64
    }
}

/// `gcd(a, 0) = a`.
fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a } else { gcd(b, a % b) }
}

pub(crate) fn store_kv(
    cache: KvRows<CubeBackend>,
    loc: CubeTensor,
    values: KvRows<CubeBackend>,
    scratch: StoreScratchPrimitive<CubeBackend>,
    base: u32,
) -> StoredPrimitive<CubeBackend> {
    let (cache, float) = match cache {
        KvRows::Float(tensor) => (tensor, true),
        KvRows::Int(tensor) => (tensor, false),
    };
    let values = match values {
        KvRows::Float(tensor) | KvRows::Int(tensor) => tensor,
    };
    let rows = |tensor: CubeTensor| {
        if float {
            KvRows::Float(tensor)
        } else {
            KvRows::Int(tensor)
        }
    };
    let cache = with_rows(owned(cache));
    let values = with_rows(values);
    let slots = cache.shape()[0];
    let tokens = loc.shape()[0];
    let row_bytes = row_layout(&cache).map_or(0, |(bytes, _)| bytes);
    let status = output_i64(&cache, STATUS_LEN);
    let words = RowWords::of(row_bytes, [&cache, &values]);
    let row_vectors = row_bytes / (words.word * words.lanes);
    let base = u64::from(base);
    // A call owns the clock values `[base, base + N)` (the store starts again below the limit
    // whenever it can; only a single call of 2^31 tokens cannot).
    let clock = if base + tokens as u64 > STORE_CLOCK_LIMIT {
        Err(crate::Error::IndexRange {
            elements: tokens as u64,
            limit: STORE_CLOCK_LIMIT - base,
        })
    } else {
        address_type(
            [&cache, &values, &loc, &scratch.slot_words, &scratch.control],
            &[tokens * row_vectors],
        )
    };
    let address = match clock {
        Ok(address) => address,
        Err(error) => {
            return StoredPrimitive {
                status: refused_status(&cache, error),
                cache: rows(cache),
                scratch,
            };
        }
    };
    let slot_words = writable(scratch.slot_words);
    let control = writable(scratch.control);
    let loc_bound = bindable(widened(loc));
    let client = cache.client.clone();
    // A unit per token (see the kernel).
    let (check_grid, check_cubes) = grid(tokens.div_ceil(CUBE_SIZE as usize));
    let check_shape = StoreShapeLaunch::new(
        tokens as u64,
        slots as u64,
        base,
        check_cubes as u64,
        stride(&loc_bound, 0),
    );
    let c = storage(&loc_bound);
    // SAFETY: every index the kernels form is bounds-checked against the shapes passed here.
    unsafe {
        store_check_kernel::launch_unchecked(
            &client,
            check_grid,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            loc_bound.clone().into_tensor_arg(),
            slot_words.clone().into_tensor_arg(),
            control.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            check_shape,
            c,
        );
        // Nothing to write without rows, and nowhere to write into an empty cache (every slot is
        // outside it: the check fails).
        if tokens > 0 && row_vectors > 0 && slots > 0 {
            let (write_grid, write_units) = stride_grid(&cache, tokens * row_vectors);
            let write_shape = StoreRowsShapeLaunch::new(
                tokens as u64,
                row_vectors as u64,
                words.row_stride(&cache),
                words.row_stride(&values),
                stride(&loc_bound, 0),
                write_units as u64,
            );
            let (cache_words, values_words) = (words.view(&cache), words.view(&values));
            let w = storage(&cache_words);
            store_write_kernel::launch_unchecked(
                &client,
                write_grid,
                CubeDim::new_1d(CUBE_SIZE),
                address,
                words.lanes,
                cache_words.into_tensor_arg(),
                values_words.into_tensor_arg(),
                loc_bound.into_tensor_arg(),
                status.clone().into_tensor_arg(),
                write_shape,
                [w, c],
            );
        }
    }
    StoredPrimitive {
        cache: rows(cache),
        scratch: StoreScratchPrimitive {
            slot_words,
            control,
        },
        status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gcd_is_euclid() {
        assert_eq!(gcd(12, 8), 4);
        assert_eq!(gcd(6, 0), 6);
        assert_eq!(gcd(0, 6), 6);
        assert_eq!(gcd(7, 3), 1);
    }
}
