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

/// The fuzzer's first find on Vulkan (`kvplan fuzz --seed 1 --op slots`, case 18): a store of
/// bf16 views lost the lavapipe device. The store copied them with Burn's own bf16 kernels, which
/// lavapipe cannot run (it has no bf16); it now copies bits (u16). A cache and values that are
/// transposed views must each be copied: both are here, checked value by value.
pub fn bf16_views<B: KvPlanBackend>(device: &B::Device) {
    use burn_core::backend::TensorData;
    use burn_core::tensor::DType;
    use kvplan::backend::KvRows;
    use kvplan::ops::KvStore;
    let bf16 = |values: Vec<f32>, shape: [usize; 2]| {
        B::float_from_data(
            TensorData::new(values, shape).convert_dtype(DType::BF16),
            device,
        )
    };
    // The cache [8, 3] stored as its transpose [3, 8]; the values [3, 3] likewise.
    let cache: Vec<f32> = (0..24).map(|k| k as f32 / 4.0).collect();
    let stored_cache: Vec<f32> = (0..24).map(|k| cache[(k % 8) * 3 + k / 8]).collect();
    let cache_view = B::float_swap_dims(bf16(stored_cache, [3, 8]), 0, 1);
    let values: Vec<f32> = (0..9).map(|k| 20.0 + k as f32).collect();
    let stored_values: Vec<f32> = (0..9).map(|k| values[(k % 3) * 3 + k / 3]).collect();
    let values_view = B::float_swap_dims(bf16(stored_values, [3, 3]), 0, 1);
    let loc = kvplan_tools::prim::i64s::<B>(&[3, 4, 6], device);
    let mut store = KvStore::<B>::allocate_on(8, device).unwrap();
    let stored = crate::common::checked_store::<B>(
        &mut store,
        KvRows::Float(cache_view),
        loc,
        KvRows::Float(values_view),
    );
    let KvRows::Float(cache_after) = stored.unwrap() else {
        unreachable!()
    };
    let got = burn_core::backend::read_sync(B::float_into_data(cache_after)).unwrap();
    let got: Vec<f32> = got.convert_dtype(DType::F32).try_to_vec().unwrap();
    let mut want = cache;
    for (i, slot) in [3, 4, 6].into_iter().enumerate() {
        want[slot * 3..slot * 3 + 3].copy_from_slice(&values[i * 3..i * 3 + 3]);
    }
    assert_eq!(got, want);
}
