//! Launchers of the kv-canary write and verify kernels.

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use kvplan_kernels::canary::{
    CanaryFeatures, CanaryShapeLaunch, GROUP, GROUPS_PER_CUBE, LayoutsLaunch, MODE_ALL, MODE_NONE,
    MODE_PARTIAL, STAGE_WORDS, SourceLayoutLaunch, SourcesLaunch, StepTokensLaunch,
    canary_verify_kernel, canary_write_kernel, stage_len,
};
use kvplan_kernels::scan::CUBE_SIZE;

use super::{
    CUBES_PER_SM, address_type, bindable, contiguous, fixed_planes, grid, multiprocessors,
    resident_cubes, writable,
};
use burn_cubecl::CubeBackend;

use crate::backend::{
    CanaryLaunchPrimitive, CanaryPrimitive, KvBytes, OptionalInt, VerifyPlanPrimitive,
    WriteInputsPrimitive, WritePlanPrimitive,
};
use crate::layout::SourceLayout;
use crate::reference::RealKvHashMode;

type Launch = CanaryLaunchPrimitive<CubeBackend>;

/// The same buffer seen as `u64` words (the kernels hash and compare bit patterns).
fn as_words(tensor: CubeTensor) -> CubeTensor {
    let words = (tensor.shape().num_elements() * tensor.dtype.size()).div_ceil(8);
    CubeTensor::new_contiguous(
        tensor.client,
        tensor.device,
        Shape::new([words.max(1)]),
        tensor.handle,
        DType::U64,
    )
}

fn mode_code(mode: RealKvHashMode) -> u8 {
    match mode {
        RealKvHashMode::None => MODE_NONE,
        RealKvHashMode::Partial => MODE_PARTIAL,
        RealKvHashMode::All => MODE_ALL,
    }
}

/// The bound sources (stand-ins past the given ones) and their layouts in words.
fn bind_sources(
    sources: &[CubeTensor],
    layouts: &[SourceLayout],
    stand_in: &CubeTensor,
) -> (SourcesLaunch, LayoutsLaunch) {
    let tensor = |k: usize| sources.get(k).unwrap_or(stand_in).clone().into_tensor_arg();
    let layout = |k: usize| {
        let (layout, words) = match (layouts.get(k), sources.get(k)) {
            (Some(layout), Some(tensor)) if layout.rows > 0 => (*layout, tensor.shape()[0]),
            _ => (
                SourceLayout {
                    rows: 0,
                    row_bytes: 0,
                    page_size: 1,
                    num_bytes_per_token: 0,
                    read_bytes: 0,
                },
                0,
            ),
        };
        SourceLayoutLaunch::new(
            words as u64,
            (layout.row_bytes / 8) as u64,
            layout.page_size as u64,
            (layout.num_bytes_per_token / 8) as u64,
            (layout.read_bytes / 8) as u64,
        )
    };
    (
        SourcesLaunch::new(tensor(0), tensor(1), tensor(2), tensor(3)),
        LayoutsLaunch::new(layout(0), layout(1), layout(2), layout(3)),
    )
}

/// A source's bytes as words, and its layout with the real row stride: a view of the caller's
/// buffer. Rows may be padded (CUDA pitches some 2-D allocations, views skip columns); the rest of
/// a row must be contiguous, else the source is copied first (the only copy, and only then).
fn source_words(
    (tensor, layout): (KvBytes<CubeBackend>, SourceLayout),
) -> Option<(CubeTensor, SourceLayout)> {
    let tensor = match tensor {
        KvBytes::Float(tensor) | KvBytes::Int(tensor) => tensor,
        KvBytes::Absent => return None,
    };
    let row_stride = |tensor: &CubeTensor| -> Option<usize> {
        let (shape, strides) = (tensor.shape(), tensor.meta.strides());
        let mut expected = 1;
        for axis in (1..shape.num_dims()).rev() {
            if shape[axis] > 1 && strides[axis] != expected {
                return None;
            }
            expected *= shape[axis];
        }
        let bytes = strides[0] * tensor.dtype.size();
        (bytes % 16 == 0 && bytes >= expected * tensor.dtype.size()).then_some(bytes)
    };
    let (tensor, stride) = match row_stride(&tensor) {
        Some(stride) => (tensor, stride),
        None => {
            let tensor = contiguous(tensor);
            let stride = row_stride(&tensor).unwrap_or(layout.row_bytes);
            (tensor, stride)
        }
    };
    let rows = tensor.shape()[0];
    // The words the kernels may read; an empty source is bound to a one-word stand-in and
    // declared empty (`rows: 0`), so nothing of it is read.
    let bytes = if rows == 0 {
        0
    } else {
        (rows - 1) * stride + layout.row_bytes
    };
    let words = bindable(CubeTensor::new_contiguous(
        tensor.client,
        tensor.device,
        Shape::new([bytes / 8]),
        tensor.handle,
        DType::U64,
    ));
    let layout = SourceLayout {
        rows,
        row_bytes: stride,
        ..layout
    };
    Some((words, layout))
}

struct Bound {
    sources: Vec<CubeTensor>,
    layouts: Vec<SourceLayout>,
    features: CanaryFeatures,
    kernel_kind: u64,
}

fn bind_launch(launch: Launch) -> Bound {
    let (meta, sources) = launch.sources();
    let (sources, layouts): (Vec<CubeTensor>, Vec<SourceLayout>) =
        sources.into_iter().filter_map(source_words).unzip();
    Bound {
        features: CanaryFeatures {
            mode: mode_code(meta.mode),
            sources: sources.len() as u8,
            input_assert: false,
            chain_assert: false,
            check_token: meta.check_expected_token,
            shuffle: false,
            stage_words: 0,
        },
        sources,
        layouts,
        kernel_kind: i64::from(meta.kernel_kind) as u64,
    }
}

pub(crate) fn canary_write(
    canary: CanaryPrimitive<CubeBackend>,
    plan: WritePlanPrimitive<CubeBackend>,
    inputs: WriteInputsPrimitive<CubeBackend>,
    launch: Launch,
) -> CanaryPrimitive<CubeBackend> {
    let canary_shape = Shape3::of(&canary);
    let mut bound = bind_launch(launch);
    bound.features.input_assert = matches!(inputs.expected_input_tokens, OptionalInt::Given(_));
    // A verify-only switch: kept out of the write kernel's compile key.
    bound.features.check_token = false;
    bound.features.chain_assert = matches!(inputs.chain_position_assert, OptionalInt::Given(_));
    // A write group takes the tile's values by plane shuffles when a plane is one group.
    bound.features.shuffle = fixed_planes(&canary.buffer, GROUP);
    let buffer = writable(canary.buffer);
    let ring = writable(canary.ring);
    let counters = writable(canary.counters);
    let requests = plan.seed_slot_indices.shape()[0];
    let tokens = inputs.input_ids.shape()[0];
    // At least one cube per request up to the device's SMs: a chain walk is latency-bound, and
    // two of them on one SM scheduler slow each other down.
    let chain_cubes = requests
        .div_ceil(GROUPS_PER_CUBE as usize)
        .max(requests.min(multiprocessors(&buffer)))
        .max(1);
    // One entry per unit: a fingerprint is a serial fold, so spread them as widely as the device,
    // at most one warp's worth per cube while the step is small.
    let fingerprint_cubes = if bound.features.fingerprints() {
        tokens
            .div_ceil(GROUP as usize)
            .clamp(1, multiprocessors(&buffer) * 8)
    } else {
        0
    };
    let (cube_count, _) = grid(chain_cubes + fingerprint_cubes);
    let shape = CanaryShapeLaunch::new(
        canary.num_slots as u64,
        canary.slot_words as u64,
        canary.ring_capacity as u64,
        requests as u64,
        tokens as u64,
        chain_cubes as u64,
        (fingerprint_cubes * CUBE_SIZE as usize) as u64,
        bound.kernel_kind,
    );
    let words = |tensor: CubeTensor| as_words(bindable(tensor));
    let offsets = words(plan.offsets);
    let seeds = words(plan.seed_slot_indices);
    let num_valid_reqs = bindable(plan.num_valid_reqs);
    let input_ids = words(inputs.input_ids);
    let positions = words(inputs.positions);
    let out_cache_loc = words(inputs.out_cache_loc);
    let (expected_tokens, expected_positions) = match (
        inputs.expected_input_tokens.into_option(),
        inputs.expected_input_positions.into_option(),
    ) {
        (Some(tokens), Some(positions)) => (words(tokens), words(positions)),
        _ => (input_ids.clone(), input_ids.clone()),
    };
    let chain_assert = inputs
        .chain_position_assert
        .into_option()
        .map_or_else(|| num_valid_reqs.clone(), bindable);
    let buffer_words = as_words(buffer.clone());
    let ring_words = as_words(ring.clone());
    let address = match address_type(
        [
            &buffer_words,
            &ring_words,
            &offsets,
            &seeds,
            &input_ids,
            &positions,
            &out_cache_loc,
            &expected_tokens,
            &expected_positions,
        ]
        .into_iter()
        .chain(&bound.sources),
        &[],
    ) {
        Ok(address) => address,
        Err(error) => return refused(&canary_shape, error),
    };
    let (sources, layouts) = bind_sources(&bound.sources, &bound.layouts, &offsets);
    // SAFETY: the kernel bounds-checks every index it forms against the sizes passed here.
    unsafe {
        canary_write_kernel::launch_unchecked(
            &buffer.client,
            cube_count,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            buffer_words.into_tensor_arg(),
            ring_words.into_tensor_arg(),
            counters.clone().into_tensor_arg(),
            offsets.into_tensor_arg(),
            seeds.into_tensor_arg(),
            num_valid_reqs.into_tensor_arg(),
            StepTokensLaunch::new(
                input_ids.into_tensor_arg(),
                positions.into_tensor_arg(),
                out_cache_loc.into_tensor_arg(),
                expected_tokens.into_tensor_arg(),
                expected_positions.into_tensor_arg(),
            ),
            chain_assert.into_tensor_arg(),
            sources,
            layouts,
            shape,
            bound.features,
        );
    }
    CanaryPrimitive {
        buffer,
        ring,
        counters,
        ..canary
    }
}

/// Words per strip a verify cube stages per round: a whole line where the device's shared memory
/// holds it (CUDA), else half or a quarter of one (lavapipe offers 32 KiB).
fn stage_words(like: &CubeTensor) -> u32 {
    let shared = like.client.properties().hardware.max_shared_memory_size;
    [STAGE_WORDS, STAGE_WORDS / 2, STAGE_WORDS / 4]
        .into_iter()
        .find(|&words| stage_len(words) as usize * 8 <= shared)
        .unwrap_or(0)
}

pub(crate) fn canary_verify(
    canary: CanaryPrimitive<CubeBackend>,
    plan: VerifyPlanPrimitive<CubeBackend>,
    launch: Launch,
) -> CanaryPrimitive<CubeBackend> {
    let canary_shape = Shape3::of(&canary);
    let mut bound = bind_launch(launch);
    if bound.features.mode == MODE_ALL && !bound.sources.is_empty() {
        bound.features.stage_words = stage_words(&canary.buffer);
    }
    let buffer = canary.buffer;
    let ring = writable(canary.ring);
    let counters = writable(canary.counters);
    let entries = plan.slot_indices.shape()[0];
    // A staged cube walks its entries a cube's worth at a time, each pass a chain of staging
    // rounds: one entry a unit makes a step's live entries one pass (four a unit took two passes
    // of 8 cubes for batch 8's ~2,000 entries: 65 us a step, `benches/RESULTS.md`, session 43).
    let per_unit = if bound.features.stage_words > 0 { 1 } else { 4 };
    let cubes = resident_cubes(&buffer, entries, per_unit, CUBES_PER_SM);
    let (cube_count, cubes) = grid(cubes);
    let shape = CanaryShapeLaunch::new(
        canary.num_slots as u64,
        canary.slot_words as u64,
        canary.ring_capacity as u64,
        entries as u64,
        0,
        0,
        (cubes * CUBE_SIZE as usize) as u64,
        bound.kernel_kind,
    );
    let words = |tensor: CubeTensor| as_words(bindable(tensor));
    let slot_indices = words(plan.slot_indices);
    let expected_tokens = words(plan.expected_tokens);
    let expected_positions = words(plan.expected_positions);
    let prev_slot_indices = words(plan.prev_slot_indices);
    let num_valid = bindable(plan.num_valid);
    let enable = bindable(plan.enable);
    let buffer_words = as_words(buffer.clone());
    let ring_words = as_words(ring.clone());
    let address = match address_type(
        [
            &buffer_words,
            &ring_words,
            &slot_indices,
            &expected_tokens,
            &expected_positions,
            &prev_slot_indices,
        ]
        .into_iter()
        .chain(&bound.sources),
        &[],
    ) {
        Ok(address) => address,
        Err(error) => return refused(&canary_shape, error),
    };
    let (sources, layouts) = bind_sources(&bound.sources, &bound.layouts, &slot_indices);
    // SAFETY: the kernel bounds-checks every index it forms against the sizes passed here.
    unsafe {
        canary_verify_kernel::launch_unchecked(
            &buffer.client,
            cube_count,
            CubeDim::new_1d(CUBE_SIZE),
            address,
            buffer_words.into_tensor_arg(),
            ring_words.into_tensor_arg(),
            counters.clone().into_tensor_arg(),
            slot_indices.into_tensor_arg(),
            expected_tokens.into_tensor_arg(),
            expected_positions.into_tensor_arg(),
            prev_slot_indices.into_tensor_arg(),
            num_valid.into_tensor_arg(),
            enable.into_tensor_arg(),
            sources,
            layouts,
            shape,
            bound.features,
        );
    }
    CanaryPrimitive {
        buffer,
        ring,
        counters,
        ..canary
    }
}

/// What a refused launch needs of its canary.
struct Shape3 {
    num_slots: usize,
    slot_words: usize,
    ring_capacity: usize,
    device: burn_cubecl::CubeDevice,
}

impl Shape3 {
    fn of(canary: &CanaryPrimitive<CubeBackend>) -> Self {
        Self {
            num_slots: canary.num_slots,
            slot_words: canary.slot_words,
            ring_capacity: canary.ring_capacity,
            device: canary.buffer.device.clone(),
        }
    }
}

/// A launch the device cannot run: a zeroed canary holding the failure.
fn refused(canary: &Shape3, error: crate::Error) -> CanaryPrimitive<CubeBackend> {
    crate::backend::host::failed_canary::<CubeBackend>(
        canary.num_slots,
        canary.slot_words,
        canary.ring_capacity,
        error,
        &canary.device,
    )
}
