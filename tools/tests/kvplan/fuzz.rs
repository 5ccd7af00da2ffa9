//! Differential fuzzing against the reference (`kvplan_tools::fuzz`): a fixed number of cases
//! of every op family on every backend, from fixed seeds. A disagreement fails the test with
//! its shrunk reproducer, a conformance record that `kvplan check` runs.

use kvplan::KvPlanBackend;
use kvplan_tools::fuzz::{self, Op};

/// The seed of every family's cases.
const SEED: u64 = 25;

/// Cases per family and backend.
const CASES: usize = 250;

/// Runs `CASES` cases of `op`; fails with the first disagreement's reproducer.
pub fn family<B: KvPlanBackend>(op: Op, device: &B::Device) {
    let report = fuzz::run::<B>(op, SEED, CASES, device);
    assert_eq!(report.cases, CASES, "{op}: cases run");
    if let Some(finding) = &report.first {
        panic!(
            "{op}: {} of {} cases disagree with the reference; the first (case {}, shrunk): {}\n\
             reproducer (kvplan check reproduces it: {:?}):\n{}",
            report.disagreements,
            report.cases,
            finding.case,
            finding.why,
            finding.reproduces,
            finding.record
        );
    }
}

/// The fuzzer's first find on Vulkan (`kvplan fuzz --seed 1 --op slots`, case 18): a store into
/// a bf16 cache that is a window of a larger buffer (rows of 3 at a row stride of 5) loses the
/// device on lavapipe (f16 and f32 windows, and contiguous bf16 caches, are stored right).
pub fn sliced_bf16_cache<B: KvPlanBackend>(device: &B::Device) {
    let (dtype, cols) = (DType::BF16, 1);
    use burn_core::backend::TensorData;
    use burn_core::tensor::{DType, Slice};
    use kvplan::{KvRows, KvStore};
    let d = device;
    let buffer: Vec<f32> = (0..50).map(|k| k as f32 / 4.0).collect();
    let wide = B::float_from_data(TensorData::new(buffer, [10, 5]).convert_dtype(dtype), d);
    let cache = B::float_slice(wide, &[Slice::from(1..9), Slice::from(cols..cols + 3)]);
    let values: Vec<f32> = (0..9).map(|k| 20.0 + k as f32).collect();
    let values = B::float_from_data(TensorData::new(values, [3, 3]).convert_dtype(dtype), d);
    let loc = kvplan_tools::prim::i64s::<B>(&[3, 4, 5], d);
    let mut store = KvStore::<B>::allocate_on(8, d).unwrap();
    let stored = kvplan::slots::backend::store::<B>(
        &mut store,
        KvRows::Float(cache),
        loc,
        KvRows::Float(values),
    );
    let KvRows::Float(cache) = stored.unwrap() else {
        unreachable!()
    };
    let got = burn_core::backend::read_sync(B::float_into_data(cache)).unwrap();
    let got: Vec<f32> = got.convert_dtype(DType::F32).try_to_vec().unwrap();
    let mut want: Vec<f32> = (0..8)
        .flat_map(|r| (0..3).map(move |c| ((r + 1) * 5 + c + cols) as f32 / 4.0))
        .collect();
    for (i, slot) in [3, 4, 5].into_iter().enumerate() {
        for c in 0..3 {
            want[slot * 3 + c] = 20.0 + (i * 3 + c) as f32;
        }
    }
    assert_eq!(got, want);
}
