//! `KvPlanBackend` for `CubeBackend`: the CubeCL launchers. Each talks to the CubeCL client
//! directly: allocate outputs, launch once, never read back (the public API reads the status).
//! A launch the device cannot run hands back its failure in the op's status record.

mod attention;
mod canary;
mod gather;
mod plan;
mod slots;

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::Client;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

pub(crate) use attention::{check_key_runs, launch_traits, paged_attention, store_and_attend};
pub(crate) use canary::{canary_verify, canary_write};
pub(crate) use gather::{masked_gather, segment_gather};
pub(crate) use plan::canary_plan;
pub(crate) use slots::{check_store_slots, segment_assign, store_rows};

/// A contiguous i64 tensor of `len` values (uninitialised).
fn empty_i64(like: &CubeTensor, len: usize) -> CubeTensor {
    empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new([len]),
        DType::I64,
    )
}

/// `len` values backed by at least one element: zero-sized bindings are not valid everywhere.
fn output_i64(like: &CubeTensor, len: usize) -> CubeTensor {
    let buffer = empty_i64(like, len.max(1));
    CubeTensor::new_contiguous(
        buffer.client,
        buffer.device,
        Shape::new([len]),
        buffer.handle,
        DType::I64,
    )
}

/// A buffer the kernels may write: the caller's own buffer when no one else holds it, otherwise a
/// copy (Burn tensors are values: a clone elsewhere must not change).
fn writable(tensor: CubeTensor) -> CubeTensor {
    if tensor.can_mut() {
        tensor
    } else {
        as_bits(tensor, |bits| bits.copy())
    }
}

/// A contiguous copy of `tensor` (itself when it is contiguous already).
fn contiguous(tensor: CubeTensor) -> CubeTensor {
    as_bits(tensor, burn_cubecl::kernel::into_contiguous)
}

/// `copy` run on `tensor` seen as the unsigned ints of its element's width: a copy moves bits,
/// and a runtime without a float type's arithmetic (lavapipe has no bf16: Burn's bf16 copy
/// kernels lose its device) still moves those.
fn as_bits(tensor: CubeTensor, copy: impl FnOnce(CubeTensor) -> CubeTensor) -> CubeTensor {
    let dtype = tensor.dtype;
    let bits = match dtype.size() {
        1 => DType::U8,
        2 => DType::U16,
        8 => DType::U64,
        _ => DType::U32,
    };
    if dtype == bits || tensor.qparams.is_some() {
        return copy(tensor);
    }
    let copied = copy(CubeTensor {
        dtype: bits,
        ..tensor
    });
    CubeTensor { dtype, ..copied }
}

/// Values `offset..offset + len` of a contiguous 1-D tensor, as a view of its buffer (no copy).
pub(crate) fn view(tensor: CubeTensor, offset: usize, len: usize) -> CubeTensor {
    let size = tensor.shape()[0];
    if offset == 0 && len >= size {
        return tensor;
    }
    // An empty view keeps one element of buffer: zero-sized bindings are not valid everywhere.
    let width = tensor.dtype.size();
    let offset = offset.min(size.saturating_sub(1));
    let tail = (size - offset - len.max(1).min(size - offset)) * width;
    let (dtype, handle) = (
        tensor.dtype,
        tensor
            .handle
            .offset_start((offset * width) as u64)
            .offset_end(tail as u64),
    );
    CubeTensor::new_contiguous(
        tensor.client,
        tensor.device,
        Shape::new([len]),
        handle,
        dtype,
    )
}

/// `values` written into `target`'s own buffer (enqueued on the client's stream, ordered with
/// the launches around it).
pub(crate) fn write_i64(target: CubeTensor, values: Vec<i64>) -> CubeTensor {
    target
        .client
        .write(&target.handle, cubecl::bytes::Bytes::from_elems(values));
    target
}

/// Words that start at 0 but one (`set`: part, index, value), written by one launch (not an
/// upload: a captured graph on wgpu records dispatches only) into one buffer, handed out as one
/// buffer per part at an offset the runtime can bind (parts of `(len, dtype)`).
fn fresh_parts<const N: usize>(
    like: &CubeTensor,
    parts: [(usize, DType); N],
    set: (usize, usize, u64),
) -> [CubeTensor; N] {
    let align = (like.client.properties().memory.alignment as usize / 8).max(1);
    let mut spans = [(0, 0); N];
    let mut total = 0;
    for (span, (len, _)) in spans.iter_mut().zip(&parts) {
        *span = (total, (*len).max(1));
        total = (total + span.1).next_multiple_of(align);
    }
    let buffer = empty_i64(like, total);
    let (part, index, value) = set;
    let shape = kvplan_kernels::scan::FillShapeLaunch::new(
        total as u64,
        (spans[part].0 + index) as u64,
        value,
    );
    let (count, _) = grid(total.div_ceil(kvplan_kernels::scan::CUBE_SIZE as usize));
    // SAFETY: the kernel writes only words below `total`, the buffer's length.
    unsafe {
        kvplan_kernels::scan::fill_kernel::launch_unchecked(
            &like.client,
            count,
            CubeDim::new_1d(kvplan_kernels::scan::CUBE_SIZE),
            AddressType::U32,
            buffer.clone().into_tensor_arg(),
            shape,
        );
    }
    split(like, buffer.handle, total, spans, parts)
}

/// Words that must start at known values (status records, counts, scratch), uploaded in one
/// transfer and handed out as one buffer per part, each at an offset the runtime can bind: one
/// round trip to the CubeCL server instead of one per buffer.
fn upload_parts<const N: usize>(like: &CubeTensor, parts: [(&[u64], DType); N]) -> [CubeTensor; N] {
    let align = (like.client.properties().memory.alignment as usize / 8).max(1);
    let mut words = Vec::new();
    let mut spans = [(0, 0); N];
    for (span, (part, _)) in spans.iter_mut().zip(&parts) {
        let len = part.len().max(1);
        *span = (words.len(), len);
        words.extend_from_slice(part);
        words.resize((span.0 + len).next_multiple_of(align), 0);
    }
    let handle = like.client.create_from_slice(bytemuck::cast_slice(&words));
    let shapes = parts.map(|(part, dtype)| (part.len(), dtype));
    split(like, handle, words.len(), spans, shapes)
}

/// One buffer of `total` words as one tensor per part: `(start, words)` spans, `(len, dtype)`
/// shapes.
fn split<const N: usize>(
    like: &CubeTensor,
    handle: cubecl::server::Handle,
    total: usize,
    spans: [(usize, usize); N],
    shapes: [(usize, DType); N],
) -> [CubeTensor; N] {
    std::array::from_fn(|k| {
        let ((start, len), (elements, dtype)) = (spans[k], shapes[k]);
        let view = handle
            .clone()
            .offset_start((start * 8) as u64)
            .offset_end(((total - start - len) * 8) as u64);
        let shape = Shape::new([elements]);
        CubeTensor::new_contiguous(like.client.clone(), like.device.clone(), shape, view, dtype)
    })
}

/// An i64 buffer uploaded from the host.
fn upload_i64(like: &CubeTensor, words: &[i64]) -> CubeTensor {
    let handle = like.client.create_from_slice(bytemuck::cast_slice(words));
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new([words.len()]),
        handle,
        DType::I64,
    )
}

/// The tensor itself, or a one-element stand-in when it is empty (the real shape travels as a
/// scalar). Kernels that load before they branch read the stand-in's element and drop it, so it
/// is zeroed: an uninitialised one is a read of never-written memory (compute-sanitizer initcheck).
fn bindable(tensor: CubeTensor) -> CubeTensor {
    if tensor.shape().num_elements() > 0 {
        return tensor;
    }
    let dtype = tensor.dtype;
    let rank = tensor.shape().num_dims().max(1);
    // At least 4 bytes: wgpu copies whole 4-byte words.
    let handle = tensor
        .client
        .create_from_slice(&[0u8; 8][..dtype.size().max(4)]);
    let shape = Shape::from(vec![1; rank]);
    CubeTensor::new_contiguous(tensor.client, tensor.device, shape, handle, dtype)
}

/// A per-request int input widened to i64 on the device (a copy only when it is i32).
///
/// cubecl 0.10's SPIR-V path was seen to compare widened negative i32 values as if they were
/// zero-extended (a length of -2 taken as positive), so values whose sign matters reach the
/// kernels as i64. These inputs are `[bs]`-sized: the copy is one small launch. CUDA sign-extends
/// correctly (its conformance run covers negative i32 lengths), so it skips the copy.
fn widened(tensor: CubeTensor) -> CubeTensor {
    let sign_extends = tensor.client.name() == "cuda";
    if sign_extends || tensor.dtype == DType::I64 || tensor.shape().num_elements() == 0 {
        return tensor;
    }
    burn_cubecl::kernel::cast(tensor, DType::I64)
}

/// Whether shared memory serves every unit the values written before a barrier, in every phase
/// of a kernel: on CUDA. lavapipe (CI's device) was seen to serve stale values to a later phase,
/// e.g. a look-back's prefix broadcast by one unit (`kvplan_kernels::scan::tile_prefix`), so
/// there every unit walks the look-back itself and reloads what it needs.
fn faithful_shared(like: &CubeTensor) -> bool {
    like.client.name() == "cuda"
}

/// Whether the runtime's planes are exactly `width` units wide and support plane operations
/// (CUDA; not lavapipe, whose planes CubeCL does not expose).
fn fixed_planes(like: &CubeTensor, width: u32) -> bool {
    let properties = like.client.properties();
    properties.features.plane.contains(Plane::Ops)
        && properties.hardware.plane_size_min == width
        && properties.hardware.plane_size_max == width
}

/// A grid of at least `cubes` cubes that every runtime accepts (Vulkan caps each axis at 65,535).
fn grid(cubes: usize) -> (CubeCount, usize) {
    const AXIS: usize = 65_535;
    let cubes = cubes.max(1);
    let x = cubes.min(AXIS);
    let y = cubes.div_ceil(x);
    (CubeCount::Static(x as u32, y as u32, 1), x * y)
}

/// The device's streaming multiprocessors (8 when the runtime does not say).
fn multiprocessors(like: &CubeTensor) -> usize {
    like.client
        .properties()
        .hardware
        .num_streaming_multiprocessors
        .unwrap_or(8) as usize
}

/// Cubes per streaming multiprocessor a launch fills unless its kernel measured better with
/// fewer.
pub(super) const CUBES_PER_SM: usize = 8;

/// Cubes per tile when every tile's cubes share its work: about `per_unit` of at most `elements`
/// values per unit over all `tiles`, and all tiles' cubes together at most `per_sm` per
/// streaming multiprocessor.
fn tile_cubes(
    like: &CubeTensor,
    elements: usize,
    tiles: usize,
    per_unit: usize,
    per_sm: usize,
) -> usize {
    let tiles = tiles.max(1);
    resident_cubes(like, elements.div_ceil(tiles), per_unit, per_sm)
        .min(multiprocessors(like) * per_sm / tiles)
        .max(1)
}

/// Cubes for a grid-stride loop over at most `elements` values, `per_unit` of them per unit:
/// enough to fill the device (`per_sm` per streaming multiprocessor), never more than the work
/// needs.
fn resident_cubes(like: &CubeTensor, elements: usize, per_unit: usize, per_sm: usize) -> usize {
    let per_cube = per_unit * kvplan_kernels::scan::CUBE_SIZE as usize;
    elements
        .div_ceil(per_cube)
        .clamp(1, multiprocessors(like) * per_sm)
}

/// A tensor's element stride along `dim` (0 past its rank), for a kernel's shape scalars (see
/// `kvplan_kernels`: strides never come from the tensor's metadata buffer).
fn stride(tensor: &CubeTensor, dim: usize) -> u64 {
    tensor.meta.strides().get(dim).map_or(0, |&s| s as u64)
}

/// A tensor's dtype as a kernel storage type.
fn storage(tensor: &CubeTensor) -> ElemType {
    burn_core::backend::cubecl::dtype_to_storage_type(tensor.dtype)
}

/// `[rows, cols]` of a 2-D tensor.
fn dims2(tensor: &CubeTensor) -> (usize, usize) {
    let shape = tensor.shape();
    (shape[0], shape[1])
}

/// Elements a launch may index with 32 bits: 2^31, leaving headroom for the rounding of a last
/// tile past any extent.
const NARROW_SPAN: usize = 1 << 31;

/// The index width (`usize` in the kernels) of a launch over `bindings`, whose kernel also
/// counts up to each of `extents` in `usize`: 32-bit while everything spans at most
/// `NARROW_SPAN` elements, 64-bit beyond (a KV cache viewed as words passes 2^32 on large
/// devices). A device without 64-bit indexing refuses such a launch rather than let an index
/// wrap. `KVPLAN_WIDE_INDEX=1` forces 64-bit indexing where the device has it (a diagnostic that
/// runs the wide path on ordinary inputs). `KVPLAN_NARROW_DEVICE=N` makes every device act as one
/// without 64-bit indexing whose 32-bit launches span at most `N` elements (a diagnostic that lets
/// small inputs reach the refusal: the tests' only way to see `index_range` end to end).
fn address_type<'a>(
    bindings: impl IntoIterator<Item = &'a CubeTensor>,
    extents: &[usize],
) -> Result<AddressType, crate::Error> {
    let mut client = None;
    let mut widest = extents.iter().copied().max().unwrap_or(0);
    for tensor in bindings {
        widest = widest.max(tensor.handle.size() as usize / tensor.dtype.size().max(1));
        client.get_or_insert_with(|| tensor.client.clone());
    }
    let forced = *FORCE_WIDE_INDEX
        .get_or_init(|| std::env::var("KVPLAN_WIDE_INDEX").is_ok_and(|value| value == "1"));
    let wide_capable = client.is_some_and(|client| wide_capable(&client));
    index_width(widest, narrow_span(narrow_device()), forced, wide_capable)
}

/// Whether launches on `client`'s device may index with 64 bits (never under
/// `KVPLAN_NARROW_DEVICE`): then no launch is refused for its size.
fn wide_capable(client: &Client) -> bool {
    narrow_device().is_none() && client.properties().supports_address(AddressType::U64)
}

/// `KVPLAN_NARROW_DEVICE`'s span, when set.
fn narrow_device() -> Option<usize> {
    *NARROW_DEVICE.get_or_init(|| {
        std::env::var("KVPLAN_NARROW_DEVICE")
            .ok()
            .and_then(|value| value.parse().ok())
    })
}

/// The span of a 32-bit launch: `NARROW_SPAN`, or less where `KVPLAN_NARROW_DEVICE` asks for
/// less. Never more: a larger setting would let 32-bit indexes wrap.
fn narrow_span(setting: Option<usize>) -> usize {
    setting.map_or(NARROW_SPAN, |span| span.min(NARROW_SPAN))
}

static FORCE_WIDE_INDEX: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
static NARROW_DEVICE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();

/// The rule of [`address_type`], for `widest` elements spanned and 32-bit launches spanning at
/// most `narrow_span`.
fn index_width(
    widest: usize,
    narrow_span: usize,
    forced: bool,
    wide_capable: bool,
) -> Result<AddressType, crate::Error> {
    if widest <= narrow_span && !(forced && wide_capable) {
        Ok(AddressType::U32)
    } else if wide_capable {
        Ok(AddressType::U64)
    } else {
        Err(crate::Error::IndexRange {
            elements: widest as u64,
            limit: narrow_span as u64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_width_is_32_bit_up_to_the_narrow_span() {
        for capable in [false, true] {
            assert_eq!(
                index_width(0, NARROW_SPAN, false, capable),
                Ok(AddressType::U32)
            );
            assert_eq!(
                index_width(NARROW_SPAN, NARROW_SPAN, false, capable),
                Ok(AddressType::U32)
            );
        }
        assert_eq!(
            index_width(NARROW_SPAN + 1, NARROW_SPAN, false, true),
            Ok(AddressType::U64)
        );
        assert_eq!(
            index_width(usize::MAX, NARROW_SPAN, false, true),
            Ok(AddressType::U64)
        );
    }

    #[test]
    fn index_width_refuses_what_a_32_bit_device_cannot_index() {
        let error = index_width(NARROW_SPAN + 1, NARROW_SPAN, false, false).unwrap_err();
        assert_eq!(
            error,
            crate::Error::IndexRange {
                elements: NARROW_SPAN as u64 + 1,
                limit: NARROW_SPAN as u64,
            }
        );
        assert_eq!(error.kind(), "index_range");
        assert!(error.to_string().contains("2147483649 elements"), "{error}");
    }

    #[test]
    fn a_narrow_device_setting_only_narrows() {
        assert_eq!(narrow_span(None), NARROW_SPAN);
        assert_eq!(narrow_span(Some(4096)), 4096);
        assert_eq!(narrow_span(Some(usize::MAX)), NARROW_SPAN);
    }

    #[test]
    fn forcing_wide_indexes_needs_a_capable_device() {
        assert_eq!(
            index_width(8, NARROW_SPAN, true, true),
            Ok(AddressType::U64)
        );
        assert_eq!(
            index_width(8, NARROW_SPAN, true, false),
            Ok(AddressType::U32)
        );
    }
}
