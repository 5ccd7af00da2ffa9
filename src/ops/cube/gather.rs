//! Launchers of the gather kernels.

use burn_cubecl::CubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_tensor::TensorMetadata;
use cubecl::prelude::*;
use kvplan_kernels::gather::{
    MaskedShapeLaunch, SCRATCH_ERROR, SCRATCH_TILES, TILE_CELLS, masked_gather_kernel,
};
use kvplan_kernels::scan::{CUBE_SIZE, NO_ERROR};
use kvplan_kernels::status::STATUS_LEN;

use super::{bindable, dims2, grid, output_i64, storage, upload_u64};
use crate::ops::GatherOutput;

pub(crate) fn masked_gather<R: CubeRuntime>(
    req_to_token: CubeTensor<R>,
    req_pool_indices: CubeTensor<R>,
    pos2d: CubeTensor<R>,
    mask: CubeTensor<R>,
    capacity: usize,
) -> GatherOutput<CubeTensor<R>> {
    let (rows, cols) = dims2(&req_to_token);
    let (pos_rows, pos_cols) = dims2(&pos2d);
    let n = req_pool_indices.shape()[0];
    let out = output_i64(&req_to_token, capacity);
    let count = output_i64(&req_to_token, 1);
    let status = output_i64(&req_to_token, STATUS_LEN);
    let (cube_count, tiles) = grid((pos_rows * pos_cols).div_ceil(TILE_CELLS as usize));
    // Fresh scratch: ticket and done counters at 0, no error, every tile state empty.
    let mut words = vec![0u64; SCRATCH_TILES + tiles];
    words[SCRATCH_ERROR] = NO_ERROR;
    let scratch = upload_u64(&req_to_token, &words);
    let client = req_to_token.client.clone();
    let dtypes = [storage(&req_to_token), storage(&req_pool_indices), storage(&pos2d), storage(&mask)];
    let shape = MaskedShapeLaunch::new(
        rows as u64,
        cols as u64,
        pos_rows as u64,
        pos_cols as u64,
        u64::from(n == 1 && pos_rows != 1),
        capacity as u64,
        tiles as u64,
    );
    // SAFETY: every index the kernel forms is bounds-checked against the shapes passed here.
    unsafe {
        masked_gather_kernel::launch_unchecked::<R>(
            &client,
            cube_count,
            CubeDim::new_1d(CUBE_SIZE),
            bindable(req_to_token).into_tensor_arg(),
            bindable(req_pool_indices).into_tensor_arg(),
            bindable(pos2d).into_tensor_arg(),
            bindable(mask).into_tensor_arg(),
            out.clone().into_tensor_arg(),
            count.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            scratch.into_tensor_arg(),
            shape,
            dtypes,
        );
    }
    GatherOutput { out, count, status }
}

pub(crate) fn segment_gather<R: CubeRuntime>(
    _req_to_token: CubeTensor<R>,
    _req_pool_indices: CubeTensor<R>,
    _start: Option<CubeTensor<R>>,
    _lengths: CubeTensor<R>,
    _capacity: usize,
) -> GatherOutput<CubeTensor<R>> {
    unimplemented!()
}
