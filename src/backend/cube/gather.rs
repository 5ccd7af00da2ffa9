//! Launchers of the gather kernels.

use burn_core::backend::TensorMetadata;
use burn_core::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use kvplan_kernels::gather::{
    CELLS_PER_UNIT, MaskedShapeLaunch, SCRATCH_ERROR, SCRATCH_TILES, SEG_ERROR, SEG_TILES,
    SEGMENT_CUBE_VALUES, SMALL_CELLS_PER_UNIT, SegmentShapeLaunch, TILE_CELLS, masked_count_kernel,
    masked_gather_kernel, segment_gather_kernel,
};
use kvplan_kernels::scan::{CUBE_SIZE, NO_ERROR, PLANE_WIDTH};
use kvplan_kernels::status::{
    GATHER_EMPTY_TABLE, GATHER_INDEX_SHAPE, GATHER_MASK_INDEX_SHAPE, GATHER_SEGMENT_SHAPE,
    STATUS_LEN,
};

use super::{
    address_type, bindable, dims2, faithful_shared, fixed_planes, fresh_parts, grid, output_i64,
    storage, stride, tile_cubes, widened,
};
use burn_cubecl::CubeBackend;

use crate::backend::GatherPrimitive;
use crate::backend::host::gather_output;

/// Segment gather cubes per streaming multiprocessor, at most. The kernel's 40 registers let 6
/// of its cubes stay resident; on the H200 4 per SM were fastest ((4096, 2048): 22.8 us against
/// 23.9 at 6 and 25.6 at 8, where 8 runs a second, partial wave): fewer, longer cubes spend less
/// on the per-cube scan, look-back and counters.
const SEGMENT_CUBES_PER_SM: usize = 4;

pub(crate) fn masked_gather(
    req_to_token: CubeTensor,
    req_pool_indices: CubeTensor,
    pos2d: CubeTensor,
    mask: CubeTensor,
    capacity: usize,
) -> GatherPrimitive<CubeBackend> {
    let client_device = req_to_token.device.clone();
    let (rows, cols) = dims2(&req_to_token);
    let (pos_rows, pos_cols) = dims2(&pos2d);
    let n = req_pool_indices.shape()[0];
    let out = output_i64(&req_to_token, capacity);
    // Many tiles: a count launch first, so that no tile waits on a chain of look-backs. Without
    // one, tiles are half as large.
    let cells = pos_rows * pos_cols;
    let counted = cells.div_ceil(TILE_CELLS as usize) > COUNTED_TILES;
    let cells_per_unit = if counted {
        CELLS_PER_UNIT
    } else {
        SMALL_CELLS_PER_UNIT
    };
    let tile_cells = (CUBE_SIZE * cells_per_unit) as usize;
    let lanes = mask_lanes(&pos2d, &mask);
    let slab = CUBE_SIZE as usize * lanes;
    let (cube_count, tiles) = grid(cells.div_ceil(tile_cells));
    // The kernels count cells in `usize`, up to the last tile's end.
    let address = match address_type(
        [&req_to_token, &req_pool_indices, &pos2d, &mask, &out],
        &[tiles * tile_cells],
    ) {
        Ok(address) => address,
        Err(error) => return gather_output::<CubeBackend>(Err(error), capacity, &client_device),
    };
    // Fresh scratch: ticket and done counters at 0, no error, every tile state (or, counted, every
    // group total) empty.
    let [status, scratch] = fresh_parts(
        &req_to_token,
        [
            (STATUS_LEN, DType::I64),
            (SCRATCH_TILES + tiles, DType::U64),
        ],
        (1, SCRATCH_ERROR, NO_ERROR),
    );
    let client = req_to_token.client.clone();
    let broadcast_prefix = faithful_shared(&req_to_token);
    let dtypes = [
        storage(&req_to_token),
        storage(&req_pool_indices),
        storage(&pos2d),
        storage(&mask),
    ];
    // Per-tile counts of a counted launch (an uncounted one never reads them).
    let counts = if counted {
        output_i64(&req_to_token, tiles)
    } else {
        status.clone()
    };
    let (table, req_pool_indices, pos2d, mask) = (
        bindable(req_to_token),
        bindable(req_pool_indices),
        bindable(pos2d),
        bindable(mask),
    );
    // Read before the launch consumes the bindings.
    let strides = [
        stride(&table, 0),
        stride(&table, 1),
        stride(&req_pool_indices, 0),
        stride(&pos2d, 0),
        stride(&pos2d, 1),
        stride(&mask, 0),
        stride(&mask, 1),
    ];
    let shape = || {
        MaskedShapeLaunch::new(
            rows as u64,
            cols as u64,
            pos_rows as u64,
            pos_cols as u64,
            u64::from(n == 1 && pos_rows != 1),
            capacity as u64,
            tiles as u64,
            (slab / pos_cols.max(1)) as u64,
            (slab % pos_cols.max(1)) as u64,
            tiles.div_ceil(CUBE_SIZE as usize).max(1) as u64,
            strides[0],
            strides[1],
            strides[2],
            strides[3],
            strides[4],
            strides[5],
            strides[6],
        )
    };
    // SAFETY: every index the kernels form is bounds-checked against the shapes passed here.
    unsafe {
        if counted {
            masked_count_kernel::launch_unchecked(
                &client,
                cube_count.clone(),
                CubeDim::new_1d(CUBE_SIZE),
                address,
                lanes,
                mask.clone().into_tensor_arg(),
                counts.clone().into_tensor_arg(),
                scratch.clone().into_tensor_arg(),
                shape(),
                lanes as u32,
                dtypes[3],
            );
        }
        masked_gather_kernel::launch_unchecked(
            &client,
            cube_count,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            lanes,
            table.into_tensor_arg(),
            req_pool_indices.into_tensor_arg(),
            pos2d.into_tensor_arg(),
            mask.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            scratch.into_tensor_arg(),
            counts.into_tensor_arg(),
            shape(),
            broadcast_prefix,
            counted,
            cells_per_unit,
            lanes as u32,
            dtypes,
        );
    }
    GatherPrimitive { out, status }
}

/// Tiles of `TILE_CELLS` above which a masked gather counts first. On the H200 a count launch
/// made 256 tiles (bs 4096, W 128) 24% faster and 4,096 tiles 10% faster, and cost ~2 us below
/// 32 tiles.
const COUNTED_TILES: usize = 64;

/// Cells per vector load of `pos2d` and `mask`: 4 where every vector lies in one pos row and is
/// aligned (unit column strides, row strides and row lengths that are multiples of 4, aligned
/// buffer offsets), else 1. Never 4 without cells: an empty input is bound as a one-element
/// stand-in, which a 4-wide read of vector 0 would overrun.
fn mask_lanes(pos2d: &CubeTensor, mask: &CubeTensor) -> usize {
    const LANES: usize = 4;
    let (pos_rows, pos_cols) = dims2(pos2d);
    if pos_rows == 0 || pos_cols == 0 {
        return 1;
    }
    let vectorizable = |tensor: &CubeTensor| {
        let aligned =
            tensor.handle.offset_start.unwrap_or(0) % (LANES * tensor.dtype.size()) as u64 == 0;
        aligned && stride(tensor, 1) == 1 && stride(tensor, 0) % LANES as u64 == 0
    };
    if pos_cols % LANES == 0 && vectorizable(pos2d) && vectorizable(mask) {
        LANES
    } else {
        1
    }
}

pub(crate) fn segment_gather(
    req_to_token: CubeTensor,
    req_pool_indices: CubeTensor,
    start: Option<CubeTensor>,
    lengths: CubeTensor,
    capacity: usize,
) -> GatherPrimitive<CubeBackend> {
    let client_device = req_to_token.device.clone();
    let (rows, cols) = dims2(&req_to_token);
    let n = req_pool_indices.shape()[0];
    let segments = lengths.shape()[0];
    let starts = start.as_ref().map_or(n, |start| start.shape()[0]);
    // Rules 5-7 depend on shapes only, but apply only when some length is positive: the kernel
    // decides, from the code computed here.
    let (shape_error, facts) = if segments != starts {
        (GATHER_SEGMENT_SHAPE, [segments as i64, starts as i64])
    } else if cols == 0 {
        (GATHER_EMPTY_TABLE, [0, 0])
    } else if n != starts && n != 1 {
        let code = if starts == 1 {
            GATHER_MASK_INDEX_SHAPE
        } else {
            GATHER_INDEX_SHAPE
        };
        (code, [n as i64, starts as i64])
    } else {
        (0, [0, 0])
    };
    let out = output_i64(&req_to_token, capacity);
    // Tiles of a cube's width of segments keep the look-back short. Their cubes share the values,
    // at most about `SEGMENT_CUBE_VALUES` each by the host's bound (the capacity, or every
    // segment as long as the table is wide), and together at most `SEGMENT_CUBES_PER_SM` per SM.
    let tile_segments = segments.clamp(1, CUBE_SIZE as usize);
    let tiles = segments.div_ceil(tile_segments).max(1);
    let most_values = capacity.min(segments.saturating_mul(cols));
    let per_unit = SEGMENT_CUBE_VALUES as usize / CUBE_SIZE as usize;
    let tile_cubes = tile_cubes(
        &req_to_token,
        most_values,
        tiles,
        per_unit,
        SEGMENT_CUBES_PER_SM,
    );
    let (cube_count, cubes) = grid(tiles * tile_cubes);
    // Fresh scratch: no tickets taken, no cube done, no error, every tile state empty.
    let address = match address_type(
        [&req_to_token, &req_pool_indices, &lengths, &out]
            .into_iter()
            .chain(start.as_ref()),
        &[],
    ) {
        Ok(address) => address,
        Err(error) => return gather_output::<CubeBackend>(Err(error), capacity, &client_device),
    };
    let [status, scratch] = fresh_parts(
        &req_to_token,
        [(STATUS_LEN, DType::I64), (SEG_TILES + tiles, DType::U64)],
        (1, SEG_ERROR, NO_ERROR),
    );
    let client = req_to_token.client.clone();
    let broadcast_prefix = faithful_shared(&req_to_token);
    let planes = fixed_planes(&req_to_token, PLANE_WIDTH);
    let has_start = start.is_some();
    let (req_pool_indices, lengths) = (
        bindable(widened(req_pool_indices)),
        bindable(widened(lengths)),
    );
    let start = start.map_or_else(|| lengths.clone(), |start| bindable(widened(start)));
    let table = bindable(req_to_token);
    let shape = SegmentShapeLaunch::new(
        rows as u64,
        cols as u64,
        segments as u64,
        u64::from(n == 1 && starts != 1),
        shape_error,
        facts[0],
        facts[1],
        capacity as u64,
        tile_segments as u64,
        tiles as u64,
        tile_cubes as u64,
        cubes as u64,
        stride(&table, 0),
        stride(&table, 1),
        stride(&req_pool_indices, 0),
        stride(&start, 0),
        stride(&lengths, 0),
    );
    let dtypes = [
        storage(&table),
        storage(&req_pool_indices),
        storage(&start),
        storage(&lengths),
    ];
    // SAFETY: every index the kernel forms is bounds-checked against the shapes passed here.
    unsafe {
        segment_gather_kernel::launch_unchecked(
            &client,
            cube_count,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            table.into_tensor_arg(),
            req_pool_indices.into_tensor_arg(),
            start.into_tensor_arg(),
            lengths.into_tensor_arg(),
            out.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            scratch.into_tensor_arg(),
            shape,
            has_start,
            broadcast_prefix,
            planes,
            dtypes,
        );
    }
    GatherPrimitive { out, status }
}
