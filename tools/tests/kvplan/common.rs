//! Shared helpers: a tiny deterministic RNG, primitive builders, read-backs, the conformance files.

use std::path::PathBuf;

use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::backend::{Backend, TensorMetadata, get_device_settings, read_sync};
use burn_core::tensor::{DType, IntDType, Shape, Slice, TensorData};
use kvplan::KvPlanBackend;
use kvplan::reference::PlanBuffers;

/// splitmix64: small, fast, deterministic.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        // The project's one splitmix64 step.
        kvplan_decoder::sample::splitmix64(&mut self.0)
    }

    /// Uniform in `0..n` (0 when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        assert!(lo <= hi);
        let span = (hi as i128 - lo as i128 + 1) as u128;
        (lo as i128 + (self.next_u64() as u128 % span) as i128) as i64
    }

    /// Uniform in `lo..=hi`, as usize.
    pub fn urange(&mut self, lo: usize, hi: usize) -> usize {
        self.range(lo as i64, hi as i64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }

    /// I32 or I64.
    pub fn int_dtype(&mut self) -> DType {
        self.pick(&[DType::I32, DType::I64])
    }

    /// Any value that fits i32.
    pub fn i32_value(&mut self) -> i64 {
        self.range(i32::MIN as i64, i32::MAX as i64)
    }

    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// An int primitive of `dtype` and rank `D` (values must fit it). Empty tensors are allocated,
/// not uploaded: CubeCL's CUDA runtime breaks on a zero-byte upload (the server is left in an
/// invalid state).
pub fn ints<B: KvPlanBackend, const D: usize>(
    data: &[i64],
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> IntTensor<B> {
    if shape.contains(&0) {
        return B::int_empty(Shape::from(shape), device, IntDType::from(dtype));
    }
    B::int_from_data(
        TensorData::new(data.to_vec(), shape).convert_dtype(dtype),
        device,
    )
}

/// A 1-D int primitive.
pub fn list<B: KvPlanBackend>(data: &[i64], dtype: DType, device: &B::Device) -> IntTensor<B> {
    ints::<B, 1>(data, [data.len()], dtype, device)
}

/// A bool primitive of rank `D`, in the device's bool dtype.
pub fn bools<B: KvPlanBackend, const D: usize>(
    data: &[bool],
    shape: [usize; D],
    device: &B::Device,
) -> BoolTensor<B> {
    let bool_dtype = get_device_settings::<B>(device).bool_dtype;
    if shape.contains(&0) {
        return B::bool_empty(Shape::from(shape), device, bool_dtype);
    }
    B::bool_from_data(
        TensorData::new(data.to_vec(), shape).convert_dtype(DType::from(bool_dtype)),
        device,
    )
}

/// A u8 int primitive (raw bytes).
pub fn bytes<B: KvPlanBackend, const D: usize>(
    data: Vec<u8>,
    shape: [usize; D],
    device: &B::Device,
) -> IntTensor<B> {
    B::int_from_data(TensorData::new(data, shape), device)
}

pub use kvplan::backend::data_to_i64;

/// The values of an int primitive, as i64, row-major.
pub fn values<B: Backend>(tensor: IntTensor<B>) -> Vec<i64> {
    data_to_i64(&read_sync(B::int_into_data(tensor)).expect("an int read-back"))
}

/// The values of a bool primitive, row-major.
pub fn bool_values<B: Backend>(tensor: BoolTensor<B>) -> Vec<bool> {
    data_to_i64(&read_sync(B::bool_into_data(tensor)).expect("a bool read-back"))
        .into_iter()
        .map(|value| value != 0)
        .collect()
}

/// The shape of a primitive.
pub fn dims<T: TensorMetadata>(tensor: &T) -> Vec<usize> {
    tensor.shape().to_vec()
}

/// `tensor[ranges]` (a view where the backend keeps one).
pub fn int_slice<B: Backend>(
    tensor: IntTensor<B>,
    ranges: &[core::ops::Range<usize>],
) -> IntTensor<B> {
    let slices: Vec<Slice> = ranges.iter().cloned().map(Slice::from).collect();
    B::int_slice(tensor, &slices)
}

/// `tensor[ranges]` of a bool primitive.
pub fn bool_slice<B: Backend>(
    tensor: BoolTensor<B>,
    ranges: &[core::ops::Range<usize>],
) -> BoolTensor<B> {
    let slices: Vec<Slice> = ranges.iter().cloned().map(Slice::from).collect();
    B::bool_slice(tensor, &slices)
}

/// `tensor[ranges] = value`.
pub fn int_slice_assign<B: Backend>(
    tensor: IntTensor<B>,
    ranges: &[core::ops::Range<usize>],
    value: IntTensor<B>,
) -> IntTensor<B> {
    let slices: Vec<Slice> = ranges.iter().cloned().map(Slice::from).collect();
    B::int_slice_assign(tensor, &slices, value)
}

/// `tensor[ranges] = value` of a bool primitive.
pub fn bool_slice_assign<B: Backend>(
    tensor: BoolTensor<B>,
    ranges: &[core::ops::Range<usize>],
    value: BoolTensor<B>,
) -> BoolTensor<B> {
    let slices: Vec<Slice> = ranges.iter().cloned().map(Slice::from).collect();
    B::bool_slice_assign(tensor, &slices, value)
}

/// The transpose of a 2-D int primitive (a strided view where the backend keeps one).
pub fn int_transpose<B: Backend>(tensor: IntTensor<B>) -> IntTensor<B> {
    B::int_swap_dims(tensor, 0, 1)
}

/// The transpose of a 2-D bool primitive.
pub fn bool_transpose<B: Backend>(tensor: BoolTensor<B>) -> BoolTensor<B> {
    B::bool_swap_dims(tensor, 0, 1)
}

/// `tensor` broadcast to `shape` (a zero-stride view where the backend keeps one).
pub fn int_expand<B: Backend, const D: usize>(
    tensor: IntTensor<B>,
    shape: [usize; D],
) -> IntTensor<B> {
    B::int_expand(tensor, Shape::from(shape))
}

/// Where the conformance files are: `$KVPLAN_CONFORMANCE_DIR`, else the repository's
/// `tests/data`.
pub fn conformance_dir() -> PathBuf {
    match std::env::var_os("KVPLAN_CONFORMANCE_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/")),
    }
}

/// The text of a conformance file; panics (fails the test) with a clear message when missing.
pub fn conformance_file(name: &str) -> String {
    let path = conformance_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|error| {
        panic!(
            "conformance file {} cannot be read ({error}); set KVPLAN_CONFORMANCE_DIR to the folder \
             holding gather.jsonl, plan.jsonl and canary.jsonl",
            path.display()
        )
    })
}

/// Compares two plan states field by field; the panic names the first differing field and index.
#[track_caller]
pub fn assert_plans_eq(got: &PlanBuffers, want: &PlanBuffers, what: &str) {
    let scalars = [
        (
            "verify_num_valid",
            got.verify_num_valid,
            want.verify_num_valid,
        ),
        ("enable", got.enable, want.enable),
        (
            "write_num_valid_reqs",
            got.write_num_valid_reqs,
            want.write_num_valid_reqs,
        ),
    ];
    for (field, g, w) in scalars {
        assert_eq!(g, w, "{what}: {field}");
    }
    let arrays: [(&str, &[i64], &[i64]); 6] = [
        (
            "verify_slot_indices",
            &got.verify_slot_indices,
            &want.verify_slot_indices,
        ),
        (
            "verify_expected_tokens",
            &got.verify_expected_tokens,
            &want.verify_expected_tokens,
        ),
        (
            "verify_expected_positions",
            &got.verify_expected_positions,
            &want.verify_expected_positions,
        ),
        (
            "verify_prev_slot_indices",
            &got.verify_prev_slot_indices,
            &want.verify_prev_slot_indices,
        ),
        ("write_offsets", &got.write_offsets, &want.write_offsets),
        (
            "write_seed_slot_indices",
            &got.write_seed_slot_indices,
            &want.write_seed_slot_indices,
        ),
    ];
    for (field, g, w) in arrays {
        assert_eq!(g.len(), w.len(), "{what}: {field} length");
        let wrong: Vec<usize> = (0..g.len()).filter(|&i| g[i] != w[i]).collect();
        if let (Some(&first), Some(&last)) = (wrong.first(), wrong.last()) {
            panic!(
                "{what}: {field}[{first}]: got {}, want {} ({} wrong, the last at {last})",
                g[first],
                w[first],
                wrong.len()
            );
        }
    }
}

/// `enable = 0`, `verify_num_valid = 0`, `write_num_valid_reqs = 0`.
#[track_caller]
pub fn assert_disabled(plans: &PlanBuffers, what: &str) {
    assert_eq!(
        (
            plans.enable,
            plans.verify_num_valid,
            plans.write_num_valid_reqs
        ),
        (0, 0, 0),
        "{what}: a device-checked error must leave the plans disabled"
    );
}

/// The tests of one process share its devices; a test that captures a graph takes them alone (a
/// capture or replay beside another thread's work on the device is not safe: CUDA's global
/// capture mode refuses that thread's syncs, and wgpu was seen to hand a replay's status words
/// to another thread's tensors).
static DEVICES: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// The devices, shared with the other tests.
pub fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICES
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The devices, alone.
pub fn exclusive() -> std::sync::RwLockWriteGuard<'static, ()> {
    DEVICES
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `segment_assign` on primitives with its status read back: the table, or the first error.
pub fn checked_assign<B: KvPlanBackend>(
    req_to_token: IntTensor<B>,
    req_pool_indices: IntTensor<B>,
    start: IntTensor<B>,
    lengths: IntTensor<B>,
    out_cache_loc: IntTensor<B>,
) -> Result<IntTensor<B>, kvplan::Error> {
    let assigned = kvplan::generic::segment_assign::<B>(
        req_to_token,
        req_pool_indices,
        start,
        lengths,
        out_cache_loc,
    )?;
    assigned.status.check()?;
    Ok(assigned.req_to_token)
}

/// One cache's store on primitives with its status read back: the cache, or the first error.
pub fn checked_store<B: KvPlanBackend>(
    store: &mut kvplan::ops::KvStore<B>,
    cache: kvplan::backend::KvRows<B>,
    loc: IntTensor<B>,
    values: kvplan::backend::KvRows<B>,
) -> Result<kvplan::backend::KvRows<B>, kvplan::Error> {
    let stored = kvplan::generic::store::<B>(store, cache, loc, values)?;
    stored.status.check()?;
    Ok(stored.cache)
}

/// The half-precision float `device` has: bf16, else f16 (lavapipe has no bf16).
pub fn half<B: Backend>(device: &B::Device) -> DType {
    if B::supports_dtype(device, DType::BF16) {
        DType::BF16
    } else {
        assert!(
            B::supports_dtype(device, DType::F16),
            "a device without half-precision floats"
        );
        DType::F16
    }
}
