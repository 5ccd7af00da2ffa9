//! Launchers of the slot kernels: `segment_assign`, a check launch then a write launch, and a
//! store's two ops: the check of its slots, and a write of one cache or two (K and V) per launch.

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use kvplan_kernels::scan::{CUBE_SIZE, PLANE_WIDTH};
use kvplan_kernels::slots::{
    AssignShapeLaunch, STORE_CLOCK_LIMIT, StoreRowsShapeLaunch, StoreShapeLaunch,
    assign_check_kernel, assign_write_kernel, store_check_kernel, store_pair_write_kernel,
    store_write_kernel,
};
use kvplan_kernels::status::STATUS_LEN;

use super::{
    CUBES_PER_SM, address_type, bindable, contiguous, dims2, fixed_planes, grid, output_i64,
    resident_cubes, storage, stride, upload_i64, widened, writable,
};
use crate::backend::{
    AssignPrimitive, KvRows, StoreCheckPrimitive, StoreScratchPrimitive, StoreTargets,
    StoreWritePrimitive,
};

/// A status record on the device holding a launch that could not run.
fn refused_status(like: &CubeTensor, error: crate::Error) -> CubeTensor {
    upload_i64(like, &crate::status::encode(&Err(error)))
}

/// A tensor the kernels may write in place: the caller's own buffer when no one else holds it and
/// no two of its elements share memory (a broadcast view does), otherwise a contiguous copy, which
/// is what the op then returns (Burn tensors are values: that is the same result).
pub(super) fn owned(tensor: CubeTensor) -> CubeTensor {
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
    let slot_max = crate::backend::slot_max(req_to_token.dtype);
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
    fn of(row_bytes: impl IntoIterator<Item = usize>, tensors: &[&CubeTensor]) -> Self {
        // Everything a vector's start is a multiple of: the rows, the row strides (of tensors
        // with more than one row), the buffers' offsets.
        let mut multiple = row_bytes.into_iter().fold(0, gcd);
        for &tensor in tensors {
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

pub(crate) fn check_store_slots(
    loc: CubeTensor,
    scratch: StoreScratchPrimitive<CubeBackend>,
    cache_rows: usize,
) -> StoreCheckPrimitive<CubeBackend> {
    let tokens = loc.shape()[0];
    let status = output_i64(&loc, STATUS_LEN);
    // A call owns `tokens` clock values (the store starts again below the limit whenever it
    // can; only a single call of 2^31 tokens cannot).
    let address = if tokens as u64 >= STORE_CLOCK_LIMIT {
        Err(crate::Error::IndexRange {
            elements: tokens as u64,
            limit: STORE_CLOCK_LIMIT - 1,
        })
    } else {
        address_type([&loc, &scratch.slot_words, &scratch.control], &[tokens])
    };
    let address = match address {
        Ok(address) => address,
        Err(error) => {
            return StoreCheckPrimitive {
                status: refused_status(&loc, error),
                scratch,
            };
        }
    };
    let slot_words = writable(scratch.slot_words);
    let control = writable(scratch.control);
    let loc = bindable(widened(loc));
    // A unit per token (see the kernel).
    let (check_grid, check_cubes) = grid(tokens.div_ceil(CUBE_SIZE as usize));
    let shape = StoreShapeLaunch::new(
        tokens as u64,
        cache_rows as u64,
        check_cubes as u64,
        stride(&loc, 0),
    );
    let c = storage(&loc);
    // SAFETY: every index the kernel forms is bounds-checked against the shape passed here.
    unsafe {
        store_check_kernel::launch_unchecked(
            &loc.client.clone(),
            check_grid,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            loc.into_tensor_arg(),
            slot_words.clone().into_tensor_arg(),
            control.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            shape,
            c,
        );
    }
    StoreCheckPrimitive {
        scratch: StoreScratchPrimitive {
            slot_words,
            control,
        },
        status,
    }
}

/// One cache of a store write, ready to bind: the cache (owned, whole rows), its rows, and
/// whether it holds floats.
struct Target {
    cache: CubeTensor,
    values: CubeTensor,
    float: bool,
}

impl Target {
    fn new(cache: KvRows<CubeBackend>, values: KvRows<CubeBackend>) -> Self {
        let (cache, float) = match cache {
            KvRows::Float(tensor) => (tensor, true),
            KvRows::Int(tensor) => (tensor, false),
        };
        let values = match values {
            KvRows::Float(tensor) | KvRows::Int(tensor) => tensor,
        };
        Self {
            cache: with_rows(owned(cache)),
            values: with_rows(values),
            float,
        }
    }

    fn row_bytes(&self) -> usize {
        row_layout(&self.cache).map_or(0, |(bytes, _)| bytes)
    }

    /// Whether a launch has anything to write here (and buffers to bind: an empty cache or
    /// zero-width rows have none).
    fn has_work(&self) -> bool {
        self.cache.shape()[0] > 0 && self.values.shape()[0] > 0 && self.row_bytes() > 0
    }

    /// The write's scalars for this cache, in vectors of `words`.
    fn shape(&self, words: RowWords, loc: &CubeTensor, units: usize) -> StoreRowsShapeLaunch {
        StoreRowsShapeLaunch::new(
            self.values.shape()[0] as u64,
            (self.row_bytes() / (words.word * words.lanes)) as u64,
            words.row_stride(&self.cache),
            words.row_stride(&self.values),
            stride(loc, 0),
            units as u64,
        )
    }

    fn into_rows(self) -> KvRows<CubeBackend> {
        if self.float {
            KvRows::Float(self.cache)
        } else {
            KvRows::Int(self.cache)
        }
    }
}

pub(crate) fn store_rows(
    caches: StoreTargets<CubeBackend>,
    values: StoreTargets<CubeBackend>,
    loc: CubeTensor,
    status: CubeTensor,
) -> StoreWritePrimitive<CubeBackend> {
    let targets = match (caches, values) {
        (StoreTargets::One(cache), StoreTargets::One(values)) => vec![Target::new(cache, values)],
        (StoreTargets::Pair(first, second), StoreTargets::Pair(first_values, second_values)) => {
            vec![
                Target::new(first, first_values),
                Target::new(second, second_values),
            ]
        }
        // The public API pairs them; nothing to write otherwise.
        (caches, _) => return StoreWritePrimitive { caches, status },
    };
    let status = match write_targets(&targets, loc, status.clone()) {
        Ok(()) => status,
        Err(error) => refused_status(&status, error),
    };
    let mut targets = targets.into_iter().map(Target::into_rows);
    let caches = match (targets.next(), targets.next()) {
        (Some(first), Some(second)) => StoreTargets::Pair(first, second),
        (Some(first), None) => StoreTargets::One(first),
        _ => unreachable!("one or two targets"),
    };
    StoreWritePrimitive { caches, status }
}

/// One launch writing every target with work: the single kernel, or the pair kernel for two; or
/// the reason it cannot run.
fn write_targets(
    targets: &[Target],
    loc: CubeTensor,
    status: CubeTensor,
) -> Result<(), crate::Error> {
    let busy: Vec<usize> = (0..targets.len())
        .filter(|&at| targets[at].has_work())
        .collect();
    let Some(&first) = busy.first() else {
        return Ok(());
    };
    let tensors: Vec<&CubeTensor> = busy
        .iter()
        .flat_map(|&at| [&targets[at].cache, &targets[at].values])
        .collect();
    let words = RowWords::of(busy.iter().map(|&at| targets[at].row_bytes()), &tensors);
    let vectors: usize = busy
        .iter()
        .map(|&at| {
            targets[at].values.shape()[0] * targets[at].row_bytes() / (words.word * words.lanes)
        })
        .sum();
    let mut bound: Vec<&CubeTensor> = tensors.clone();
    bound.extend([&loc, &status]);
    let address = address_type(bound, &[vectors])?;
    let (grid, units) = stride_grid(&targets[first].cache, vectors);
    let client = loc.client.clone();
    let loc = bindable(widened(loc));
    let c = storage(&loc);
    let view = |at: usize| {
        let target = &targets[at];
        (
            words.view(&target.cache).into_tensor_arg(),
            words.view(&target.values).into_tensor_arg(),
            target.shape(words, &loc, units),
        )
    };
    let w = storage(&words.view(&targets[first].cache));
    // SAFETY: every index the kernels form is bounds-checked against the shapes passed here, and
    // a clear status means every slot is inside caches of these rows (checked by the caller).
    unsafe {
        match busy[..] {
            [one] => {
                let (cache, values, shape) = view(one);
                store_write_kernel::launch_unchecked(
                    &client,
                    grid,
                    CubeDim::new_1d(CUBE_SIZE),
                    address,
                    words.lanes,
                    cache,
                    values,
                    loc.clone().into_tensor_arg(),
                    status.into_tensor_arg(),
                    shape,
                    [w, c],
                );
            }
            [one, two] => {
                let (first_cache, first_values, first_shape) = view(one);
                let (second_cache, second_values, second_shape) = view(two);
                store_pair_write_kernel::launch_unchecked(
                    &client,
                    grid,
                    CubeDim::new_1d(CUBE_SIZE),
                    address,
                    words.lanes,
                    first_cache,
                    first_values,
                    second_cache,
                    second_values,
                    loc.clone().into_tensor_arg(),
                    status.into_tensor_arg(),
                    first_shape,
                    second_shape,
                    [w, c],
                );
            }
            _ => unreachable!("one or two targets"),
        }
    }
    Ok(())
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
