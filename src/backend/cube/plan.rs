//! Launcher of the kv-canary plan kernels.

use burn_core::backend::TensorMetadata;
use cubecl::prelude::*;
use kvplan_kernels::plan::{
    CUBE_ENTRIES, PlanFeatures, PlanShapeLaunch, plan_count_kernel, plan_kernel,
};
use kvplan_kernels::scan::{CUBE_SIZE, PLANE_WIDTH};
use kvplan_kernels::status::{CODE, FACTS, PLAN_STRIDE, STATUS_LEN};

use super::{
    address_type, bindable, dims2, faithful_shared, fixed_planes, grid, output_i64, storage,
    stride, tile_cubes, upload_i64, widened, writable,
};
use burn_cubecl::CubeBackend;

use crate::backend::{PlanInputsPrimitive, PlanOutput, VerifyPlanPrimitive, WritePlanPrimitive};

/// Cubes per streaming multiprocessor of a lone tile (bs <= 256), at most. Each of its cubes
/// scans the whole tile and bisects it for its entries' holders; past two per SM that repeated
/// work costs more than the parallelism gains (H200, GPU us with 513 / 257 / 129 cubes:
/// (64, 4096) 5.84 / 5.03 / 5.27, (256, 4096, SWA) 9.40 / 8.90 / 10.15; benches/RESULTS.md,
/// session 14).
const LONE_TILE_CUBES_PER_SM: usize = 2;

/// Cubes per streaming multiprocessor of a plan of several tiles, at most: as many as surely stay
/// resident together. The kernel takes 40-46 registers (ncu), so only 5 or 6 of its 256-unit cubes
/// fit on an SM, and a grid sized for more runs a partial second wave whose cubes start late;
/// how late moved with every small change of the kernel's code (H200, GPU us with 8 / 6 / 5 / 4
/// per SM: (4096, 32768, SWA+pool) 213 / 180 / 176 / 171, (4096, 4096, FULL+pool) 146 / 173 /
/// 150 / 147, (4096, 512, FULL) 23.2 / 24.3 / 21.9 / 21.4; benches/RESULTS.md, session 15).
const MULTI_TILE_CUBES_PER_SM: usize = 4;

pub(crate) fn canary_plan(
    verify: VerifyPlanPrimitive<CubeBackend>,
    write: WritePlanPrimitive<CubeBackend>,
    inputs: PlanInputsPrimitive<CubeBackend>,
) -> PlanOutput<CubeBackend> {
    let table = inputs.req_to_token;
    let full_to_swa = inputs.full_to_swa.into_option();
    let expected_tokens = match (
        inputs.expected_tokens.into_option(),
        inputs.expected_tokens_valid_lens.into_option(),
    ) {
        (Some(pool), Some(valid_lens)) => Some((pool, valid_lens)),
        _ => None,
    };
    let (rows, cols) = dims2(&table);
    // Rule 11 again, on the real strides: through `Fusion` the host could not see them. The plans
    // are handed back untouched, as for every host rule.
    let row_stride = table.meta.strides().first().map_or(1, |&s| s as i64);
    if rows >= 1 && cols >= 1 && row_stride <= 0 {
        let mut words = [0i64; STATUS_LEN];
        words[CODE] = PLAN_STRIDE;
        words[FACTS] = row_stride;
        let status = upload_i64(&table, &words);
        return PlanOutput {
            verify,
            write,
            status,
        };
    }
    let requests = inputs.req_pool_indices.shape()[0];
    let verify_capacity = verify.slot_indices.shape()[0];
    let write_capacity = write.seed_slot_indices.shape()[0];
    // A request that passes rules 12 and 13 has at most `min(cols, W)` verify entries. When the
    // largest plan fits the verify capacity no overflow is possible, and one launch suffices.
    let window = usize::try_from(inputs.swa_window_size).unwrap_or(0);
    let longest = if window > 0 { cols.min(window) } else { cols };
    let most_entries = requests.saturating_mul(longest);
    // Tiles of a cube's width of requests keep the look-back short: a batch of at most 256
    // requests is one tile, which needs none and no count launch either (its cubes know the
    // total). A tile's cubes share its entries, about `CUBE_ENTRIES` each by the host's bound
    // (a table much wider than the prefixes makes it loose), and all tiles' cubes together at
    // most what the device holds at once; a grid-stride loop covers the rest.
    let tile_requests = requests.clamp(1, CUBE_SIZE as usize);
    let tiles = requests.div_ceil(tile_requests).max(1);
    let per_unit = CUBE_ENTRIES as usize / CUBE_SIZE as usize;
    let per_sm = if tiles == 1 {
        LONE_TILE_CUBES_PER_SM
    } else {
        MULTI_TILE_CUBES_PER_SM
    };
    let tile_cubes = tile_cubes(&table, most_entries, tiles, per_unit, per_sm);
    let features = PlanFeatures {
        window: inputs.swa_window_size > 0,
        lut: full_to_swa.is_some(),
        pool: expected_tokens.is_some(),
        counted: tiles > 1 && most_entries > verify_capacity,
        lead_finishes: tiles == 1 && full_to_swa.is_none(),
        planes: fixed_planes(&table, PLANE_WIDTH),
        faithful_shared: faithful_shared(&table),
    };
    // Without a LUT every slot counts as inside it (the kernels compare against this length).
    let lut_len = full_to_swa
        .as_ref()
        .map_or(i64::MAX as usize, |lut| lut.shape()[0]);
    let (pool_rows, pool_cols) = expected_tokens
        .as_ref()
        .map_or((0, 0), |(pool, _)| dims2(pool));
    let (plan_grid, cubes) = grid(tiles * tile_cubes);
    // The plan's own scratch, left ready by the previous call: nothing is uploaded.
    let scratch = writable(write.scratch);
    let status = output_i64(&table, STATUS_LEN);

    let req_pool_indices = bindable(widened(inputs.req_pool_indices));
    let prefix_lens = bindable(widened(inputs.prefix_lens));
    let extend_seq_lens = bindable(widened(inputs.extend_seq_lens));
    let table = bindable(table);
    // Absent inputs are bound to a stand-in that the compile-time switches never read.
    let stand_in = || req_pool_indices.clone();
    let lut = full_to_swa.map_or_else(stand_in, bindable);
    let (pool, valid_lens) = match expected_tokens {
        Some((pool, valid_lens)) => (bindable(pool), bindable(widened(valid_lens))),
        None => (stand_in(), stand_in()),
    };
    // Read before the launch consumes the bindings.
    let strides = [
        stride(&req_pool_indices, 0),
        stride(&prefix_lens, 0),
        stride(&extend_seq_lens, 0),
        stride(&table, 0),
        stride(&table, 1),
        stride(&lut, 0),
        stride(&pool, 0),
        stride(&pool, 1),
        stride(&valid_lens, 0),
    ];
    let shape = || {
        PlanShapeLaunch::new(
            requests as u64,
            rows as u64,
            cols as u64,
            i64::from(inputs.swa_window_size),
            lut_len as u64,
            pool_rows as u64,
            pool_cols as u64,
            i64::from(inputs.position_offset),
            verify_capacity as u64,
            write_capacity as u64,
            tile_requests as u64,
            tiles as u64,
            tile_cubes as u64,
            cubes as u64,
            strides[0],
            strides[1],
            strides[2],
            strides[3],
            strides[4],
            strides[5],
            strides[6],
            strides[7],
            strides[8],
        )
    };
    let verify = VerifyPlanPrimitive {
        slot_indices: writable(verify.slot_indices),
        expected_tokens: writable(verify.expected_tokens),
        expected_positions: writable(verify.expected_positions),
        prev_slot_indices: writable(verify.prev_slot_indices),
        num_valid: writable(verify.num_valid),
        enable: writable(verify.enable),
    };
    let [offsets, seeds, num_valid_reqs] =
        [write.offsets, write.seed_slot_indices, write.num_valid_reqs].map(writable);

    let client = table.client.clone();
    let (q, p, e, t, u, o, v) = (
        storage(&req_pool_indices),
        storage(&prefix_lens),
        storage(&extend_seq_lens),
        storage(&table),
        storage(&lut),
        storage(&pool),
        storage(&valid_lens),
    );
    let address = match address_type(
        [
            &req_pool_indices,
            &prefix_lens,
            &extend_seq_lens,
            &table,
            &lut,
            &pool,
            &valid_lens,
            &verify.slot_indices,
            &verify.expected_tokens,
            &verify.expected_positions,
            &verify.prev_slot_indices,
            &offsets,
            &seeds,
            &scratch,
        ],
        &[],
    ) {
        Ok(address) => address,
        Err(error) => {
            return refused(
                verify,
                WritePlanPrimitive {
                    offsets,
                    seed_slot_indices: seeds,
                    num_valid_reqs,
                    scratch,
                },
                error,
            );
        }
    };
    // SAFETY: every index the kernels form is bounds-checked against the shapes passed here.
    unsafe {
        if features.counted {
            let (count_grid, _) = grid(requests.div_ceil(CUBE_SIZE as usize));
            plan_count_kernel::launch_unchecked(
                &client,
                count_grid,
                CubeDim::new_1d(CUBE_SIZE),
                address,
                req_pool_indices.clone().into_tensor_arg(),
                prefix_lens.clone().into_tensor_arg(),
                extend_seq_lens.clone().into_tensor_arg(),
                scratch.clone().into_tensor_arg(),
                shape(),
                features,
                [q, p, e],
            );
        }
        plan_kernel::launch_unchecked(
            &client,
            plan_grid,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            req_pool_indices.into_tensor_arg(),
            prefix_lens.into_tensor_arg(),
            extend_seq_lens.into_tensor_arg(),
            table.into_tensor_arg(),
            lut.into_tensor_arg(),
            pool.into_tensor_arg(),
            valid_lens.into_tensor_arg(),
            verify.slot_indices.clone().into_tensor_arg(),
            verify.expected_tokens.clone().into_tensor_arg(),
            verify.expected_positions.clone().into_tensor_arg(),
            verify.prev_slot_indices.clone().into_tensor_arg(),
            verify.num_valid.clone().into_tensor_arg(),
            verify.enable.clone().into_tensor_arg(),
            offsets.clone().into_tensor_arg(),
            seeds.clone().into_tensor_arg(),
            num_valid_reqs.clone().into_tensor_arg(),
            status.clone().into_tensor_arg(),
            scratch.clone().into_tensor_arg(),
            shape(),
            features,
            [q, p, e, t, u, o, v],
        );
    }
    PlanOutput {
        verify,
        write: WritePlanPrimitive {
            offsets,
            seed_slot_indices: seeds,
            num_valid_reqs,
            scratch,
        },
        status,
    }
}

/// A launch the device cannot run: fresh, disabled plans and the failure in the status.
fn refused(
    verify: VerifyPlanPrimitive<CubeBackend>,
    write: WritePlanPrimitive<CubeBackend>,
    error: crate::Error,
) -> PlanOutput<CubeBackend> {
    crate::backend::host::refused_plan::<CubeBackend>(verify, write, error)
}
