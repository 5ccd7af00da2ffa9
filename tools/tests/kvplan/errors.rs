//! Every error kind reachable through the backend API, in checked and deferred modes, with the
//! state the spec fixes for the plans afterwards.
//!
//! Primitives carry no rank in their type, so `not_1d` is reachable here too (it was not through
//! the 0.21 `Tensor<B, 1, Int>` arguments).

use burn_core::backend::TensorMetadata;
use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::tensor::{DType, TensorData};
use kvplan::error::{Dims, Site};
use kvplan::ops::{PlanInputs, StepPlan};
use kvplan::reference::PlanBuffers;
use kvplan::{Error, KvPlanBackend};

use crate::common::{assert_plans_eq, bools, dims, int_expand, int_slice, ints, list, values};
use crate::gather::{CTX, SEGMENT_CONTEXT, masked, masked_deferred, segments, segments_deferred};
use crate::plan::{MODES, Mirror, Mode, Step};

/// The prefix of every plan error message (the library's `PLAN_CONTEXT`).
pub const PLAN_CONTEXT: &str = "kv-canary:";
/// The dtypes the int rules accept, as the errors name them (the library's `INT_DTYPES`).
pub const INT_DTYPES: &str = "int32, int64";

fn t46<B: KvPlanBackend>(device: &B::Device) -> IntTensor<B> {
    let data: Vec<i64> = (0..24).map(|k| 100 + k).collect();
    ints::<B, 2>(&data, [4, 6], DType::I32, device)
}

fn l<B: KvPlanBackend>(data: &[i64], device: &B::Device) -> IntTensor<B> {
    list::<B>(data, DType::I64, device)
}

/// A masked gather that must fail with `want`: at once in both modes (`immediate`), or from
/// the status in capacity mode with `count = 0`.
#[track_caller]
fn masked_error<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    pos2d: IntTensor<B>,
    mask: BoolTensor<B>,
    capacity: Option<usize>,
    want: Error,
    immediate: bool,
) {
    if capacity.is_none() {
        let got = masked::<B>(table.clone(), rpi.clone(), pos2d.clone(), mask.clone());
        assert_eq!(got.err(), Some(want.clone()), "exact mode");
    }
    let got = masked_deferred::<B>(table, rpi, pos2d, mask, capacity);
    if immediate {
        assert_eq!(got.err(), Some(want), "capacity mode, immediate");
    } else {
        let got = got.unwrap_or_else(|error| {
            panic!("{} must be deferred, got {error:?} at once", want.kind())
        });
        assert_eq!(got.status.check(), Err(want), "capacity mode, deferred");
        assert_eq!(
            values::<B>(got.count()),
            vec![0],
            "count after a deferred error"
        );
    }
}

#[track_caller]
fn segment_error<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    start: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    capacity: Option<usize>,
    want: Error,
    immediate: bool,
) {
    if capacity.is_none() {
        let got = segments::<B>(table.clone(), rpi.clone(), start.clone(), lengths.clone());
        assert_eq!(got.err(), Some(want.clone()), "exact mode");
    }
    let got = segments_deferred::<B>(table, rpi, start, lengths, capacity);
    if immediate {
        assert_eq!(got.err(), Some(want), "capacity mode, immediate");
    } else {
        let got = got.unwrap_or_else(|error| {
            panic!("{} must be deferred, got {error:?} at once", want.kind())
        });
        assert_eq!(got.status.check(), Err(want), "capacity mode, deferred");
        assert_eq!(
            values::<B>(got.count()),
            vec![0],
            "count after a deferred error"
        );
    }
}

pub fn gather_errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let yes = |n: usize| bools::<B, 2>(&vec![true; n], [1, n], d);
    // pos_not_2d (1-D and 3-D).
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1], d),
        ints::<B, 1>(&[0, 1, 2], [3], DType::I64, d),
        bools::<B, 1>(&[true; 3], [3], d),
        None,
        Error::PosNot2d {
            context: CTX.into(),
            shape: Dims(vec![3]),
        },
        true,
    );
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1], d),
        ints::<B, 3>(&[0, 1], [1, 1, 2], DType::I64, d),
        bools::<B, 3>(&[true; 2], [1, 1, 2], d),
        None,
        Error::PosNot2d {
            context: CTX.into(),
            shape: Dims(vec![1, 1, 2]),
        },
        true,
    );
    // mask_shape_mismatch.
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        ints::<B, 2>(&[0; 6], [2, 3], DType::I64, d),
        bools::<B, 2>(&[true; 6], [3, 2], d),
        None,
        Error::MaskShapeMismatch {
            context: CTX.into(),
            mask: Dims(vec![3, 2]),
            pos2d: Dims(vec![2, 3]),
        },
        true,
    );
    // not_2d (1-D and 3-D tables).
    let data: Vec<i64> = (0..24).collect();
    masked_error::<B>(
        ints::<B, 1>(&data, [24], DType::I32, d),
        l::<B>(&[1], d),
        ints::<B, 2>(&[0, 1], [1, 2], DType::I64, d),
        yes(2),
        None,
        Error::Not2d {
            context: CTX.into(),
            name: "req_to_token",
            shape: Dims(vec![24]),
        },
        true,
    );
    masked_error::<B>(
        ints::<B, 3>(&data, [2, 2, 6], DType::I64, d),
        l::<B>(&[1], d),
        ints::<B, 2>(&[0, 1], [1, 2], DType::I64, d),
        yes(2),
        None,
        Error::Not2d {
            context: CTX.into(),
            name: "req_to_token",
            shape: Dims(vec![2, 2, 6]),
        },
        true,
    );
    // not_1d: a 2-D req_pool_indices (reachable now that arguments are untyped primitives).
    masked_error::<B>(
        t46::<B>(d),
        ints::<B, 2>(&[1, 2], [2, 1], DType::I64, d),
        ints::<B, 2>(&[0, 1], [2, 1], DType::I64, d),
        bools::<B, 2>(&[true, true], [2, 1], d),
        None,
        Error::Not1d {
            context: CTX.into(),
            name: "req_pool_indices",
            shape: Dims(vec![2, 1]),
        },
        true,
    );
    // index_shape_mismatch / mask_index_shape_mismatch: immediate for masked.
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2, 3], d),
        ints::<B, 2>(&[0; 4], [2, 2], DType::I64, d),
        bools::<B, 2>(&[true; 4], [2, 2], d),
        None,
        Error::IndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 2,
            cols: 2,
        },
        true,
    );
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2, 3], d),
        ints::<B, 2>(&[0, 1], [1, 2], DType::I64, d),
        yes(2),
        None,
        Error::MaskIndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 1,
            cols: 2,
        },
        true,
    );
    // empty_table_nonempty_mask: deferred.
    let empty = ints::<B, 2>(&[], [4, 0], DType::I32, d);
    masked_error::<B>(
        empty.clone(),
        l::<B>(&[1, 99], d),
        ints::<B, 2>(&[3; 4], [2, 2], DType::I64, d),
        bools::<B, 2>(&[false, false, true, false], [2, 2], d),
        None,
        Error::EmptyTableNonemptyMask {
            context: CTX.into(),
        },
        false,
    );
    let error = masked::<B>(
        empty,
        l::<B>(&[1, 99], d),
        ints::<B, 2>(&[3; 4], [2, 2], DType::I64, d),
        bools::<B, 2>(&[false, false, true, false], [2, 2], d),
    )
    .unwrap_err();
    assert_eq!(
        error.to_string(),
        "DFLASH target hidden KV append req_to_token table is empty but gather mask is non-empty."
    );
    // req_pool_index_out_of_range, even for an all-false row.
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 4], d),
        ints::<B, 2>(&[0, 0], [2, 1], DType::I64, d),
        bools::<B, 2>(&[true, false], [2, 1], d),
        None,
        Error::ReqPoolIndexOutOfRange {
            context: CTX.into(),
            site: Site::Row(1),
            value: 4,
            rows: 4,
        },
        false,
    );
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[-1, -4], d),
        ints::<B, 2>(&[0, 0], [2, 1], DType::I32, d),
        bools::<B, 2>(&[true, true], [2, 1], d),
        None,
        Error::ReqPoolIndexOutOfRange {
            context: CTX.into(),
            site: Site::Row(0),
            value: -1,
            rows: 4,
        },
        false,
    );
    // position_out_of_range: the first true cell in row-major order.
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        ints::<B, 2>(&[0, 99, 9, -1, 0, 0], [2, 3], DType::I64, d),
        bools::<B, 2>(&[true, false, true, true, true, true], [2, 3], d),
        None,
        Error::PositionOutOfRange {
            context: CTX.into(),
            site: Site::Cell(0, 2),
            position: 9,
            cols: 6,
        },
        false,
    );
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        ints::<B, 2>(&[0, 99, 9, -1, 0, 0], [2, 3], DType::I64, d),
        bools::<B, 2>(&[true, false, false, true, true, true], [2, 3], d),
        None,
        Error::PositionOutOfRange {
            context: CTX.into(),
            site: Site::Cell(1, 0),
            position: -1,
            cols: 6,
        },
        false,
    );
    // capacity_exceeded: capacity mode only.
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        ints::<B, 2>(&[0, 1, 2, 3], [2, 2], DType::I64, d),
        bools::<B, 2>(&[true; 4], [2, 2], d),
        Some(3),
        Error::CapacityExceeded {
            context: CTX.into(),
            count: 4,
            capacity: 3,
        },
        false,
    );
}

pub fn segment_errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let seg = SEGMENT_CONTEXT;
    // not_2d: immediate.
    let data: Vec<i64> = (0..24).collect();
    segment_error::<B>(
        ints::<B, 1>(&data, [24], DType::I32, d),
        l::<B>(&[1], d),
        None,
        l::<B>(&[1], d),
        None,
        Error::Not2d {
            context: seg.into(),
            name: "req_to_token",
            shape: Dims(vec![24]),
        },
        true,
    );
    // not_1d: a 2-D lengths.
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1], d),
        None,
        ints::<B, 2>(&[1, 1], [1, 2], DType::I64, d),
        None,
        Error::Not1d {
            context: seg.into(),
            name: "lengths",
            shape: Dims(vec![1, 2]),
        },
        true,
    );
    // mask_shape_mismatch: deferred (S = 3, P = 2).
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 1, 1], d),
        Some(l::<B>(&[0, 0], d)),
        l::<B>(&[1, 1, 1], d),
        None,
        Error::MaskShapeMismatch {
            context: seg.into(),
            mask: Dims(vec![3, 1]),
            pos2d: Dims(vec![2, 1]),
        },
        false,
    );
    // ... naming the longest length `L` past one tile of segments (the fuzzer saw Vulkan name
    // another), wherever it stands and in either dtype.
    for (segments, at, longest, dtype) in [
        (300usize, 290usize, 1i64 << 40, DType::I64),
        (300, 3, 1 << 40, DType::I64),
        (257, 256, i64::from(i32::MAX), DType::I32),
        (1000, 999, 70_000, DType::I32),
    ] {
        let mut lengths = vec![1i64; segments];
        lengths[at] = longest;
        segment_error::<B>(
            t46::<B>(d),
            l::<B>(&[1], d),
            Some(l::<B>(&vec![0; segments - 1], d)),
            list::<B>(&lengths, dtype, d),
            None,
            Error::MaskShapeMismatch {
                context: seg.into(),
                mask: Dims(vec![segments, longest as usize]),
                pos2d: Dims(vec![segments - 1, longest as usize]),
            },
            false,
        );
    }
    // ... and skipped by the early exit.
    let got = segments::<B>(
        t46::<B>(d),
        l::<B>(&[1, 1, 1], d),
        Some(l::<B>(&[0, 0], d)),
        l::<B>(&[0, -1, 0], d),
    );
    assert_eq!(got.map(|out| dims(&out)), Ok(vec![0]));
    // empty_table_nonempty_mask.
    segment_error::<B>(
        ints::<B, 2>(&[], [4, 0], DType::I32, d),
        l::<B>(&[1, 99], d),
        None,
        l::<B>(&[0, 1], d),
        None,
        Error::EmptyTableNonemptyMask {
            context: seg.into(),
        },
        false,
    );
    // index_shape_mismatch / mask_index_shape_mismatch: deferred for segments.
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        Some(l::<B>(&[0, 0, 0], d)),
        l::<B>(&[1, 1, 1], d),
        None,
        Error::IndexShapeMismatch {
            context: seg.into(),
            n: 2,
            rows: 3,
            cols: 1,
        },
        false,
    );
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        Some(l::<B>(&[0], d)),
        l::<B>(&[2], d),
        None,
        Error::MaskIndexShapeMismatch {
            context: seg.into(),
            n: 2,
            rows: 1,
            cols: 2,
        },
        false,
    );
    // req_pool_index_out_of_range for an empty segment.
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 9], d),
        Some(l::<B>(&[0, 0], d)),
        l::<B>(&[2, 0], d),
        None,
        Error::ReqPoolIndexOutOfRange {
            context: seg.into(),
            site: Site::Row(1),
            value: 9,
            rows: 4,
        },
        false,
    );
    // position_out_of_range: past the width, negative, near i64::MAX, and a huge length (the
    // kernel must not walk it).
    for (start, len, j, position) in [
        (4, 3, 2, 6),
        (-2, 2, 0, -2),
        (i64::MAX - 1, 5, 0, i64::MAX - 1),
        (0, 1 << 40, 6, 6),
    ] {
        segment_error::<B>(
            t46::<B>(d),
            l::<B>(&[1], d),
            Some(l::<B>(&[start], d)),
            l::<B>(&[len], d),
            None,
            Error::PositionOutOfRange {
                context: seg.into(),
                site: Site::Cell(0, j),
                position,
                cols: 6,
            },
            false,
        );
    }
    // capacity_exceeded.
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], d),
        None,
        l::<B>(&[3, 2], d),
        Some(4),
        Error::CapacityExceeded {
            context: seg.into(),
            count: 5,
            capacity: 4,
        },
        false,
    );
}

/// dtype_mismatch with a uint8 int tensor, where the backend can hold one.
pub fn dtype_errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let u8_tensor = |data: Vec<u8>| {
        let len = data.len();
        B::int_from_data(TensorData::new(data, [len]), d)
    };
    if !B::supports_dtype(d, DType::U8) || u8_tensor(vec![1]).dtype() != DType::U8 {
        // This backend cannot hold a uint8 int tensor: the dtype rule is covered by the unit
        // tests of `validate` instead.
        eprintln!("skipping dtype_mismatch through the public API: no uint8 int tensors here");
        return;
    }
    let want = |context: &str, name: &'static str| Error::DtypeMismatch {
        context: context.into(),
        name,
        got: "uint8".into(),
        accepted: INT_DTYPES,
    };
    masked_error::<B>(
        t46::<B>(d),
        u8_tensor(vec![1, 2]),
        ints::<B, 2>(&[0, 1], [2, 1], DType::I64, d),
        bools::<B, 2>(&[true, true], [2, 1], d),
        None,
        want(CTX, "req_pool_indices"),
        true,
    );
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1], d),
        None,
        u8_tensor(vec![2]),
        None,
        want(SEGMENT_CONTEXT, "lengths"),
        true,
    );
    let mut mirror = primed::<B>(d);
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                u8_tensor(vec![3, 4]),
                l::<B>(&[1, 1], d),
                linear48::<B>(d),
            )
        },
        want(PLAN_CONTEXT, "prefix_lens"),
    );
}

/// device_mismatch: a tensor on `other`.
pub fn device_errors<B: KvPlanBackend>(device: &B::Device, other: &B::Device) {
    let d = device;
    let want = |context: &str, name: &'static str, on: &B::Device, expected: &B::Device| {
        Error::DeviceMismatch {
            context: context.into(),
            name,
            device: format!("{on:?}"),
            expected: format!("{expected:?}"),
        }
    };
    masked_error::<B>(
        t46::<B>(d),
        l::<B>(&[1, 2], other),
        ints::<B, 2>(&[0, 1], [2, 1], DType::I64, d),
        bools::<B, 2>(&[true, true], [2, 1], d),
        None,
        want(CTX, "req_pool_indices", other, d),
        true,
    );
    segment_error::<B>(
        t46::<B>(d),
        l::<B>(&[1], d),
        Some(l::<B>(&[0], d)),
        l::<B>(&[2], other),
        None,
        want(SEGMENT_CONTEXT, "lengths", other, d),
        true,
    );
    let mut mirror = primed::<B>(d);
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4], other),
                l::<B>(&[1, 1], d),
                linear48::<B>(d),
            )
        },
        want(PLAN_CONTEXT, "prefix_lens", other, d),
    );
    // Plans on `other`, every input on `device`: the first input is named.
    let mut elsewhere = primed::<B>(other);
    host_error(
        &mut elsewhere,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4], d),
                l::<B>(&[1, 1], d),
                linear48::<B>(d),
            )
        },
        want(PLAN_CONTEXT, "req_pool_indices", d, other),
    );
}

/// The linear 4x8 table of the plan examples.
fn linear48<B: KvPlanBackend>(device: &B::Device) -> IntTensor<B> {
    let data: Vec<i64> = (0..32).collect();
    ints::<B, 2>(&data, [4, 8], DType::I32, device)
}

fn base_step() -> Step {
    Step::new(4, 8, (0..32).collect()).batch(&[1, 2], &[3, 4], &[1, 1])
}

/// Plans (V = 16, K = 4) that already hold a run, so that "unchanged" is not "fresh".
fn primed<B: KvPlanBackend>(device: &B::Device) -> Mirror<B> {
    let mut mirror = Mirror::<B>::new(16, 4, device);
    mirror
        .step(
            &Step::new(4, 8, (0..32).collect()).batch(&[3, 1, 2], &[5, 2, 7], &[2, 1, 0]),
            Mode::Checked,
            "prime",
        )
        .unwrap();
    mirror
}

/// A host-rule error: `Err(want)` at once in both modes, plans unchanged.
#[track_caller]
fn host_error<B: KvPlanBackend>(
    mirror: &mut Mirror<B>,
    inputs: impl Fn() -> PlanInputs<B>,
    want: Error,
) {
    for mode in MODES {
        let before = mirror.read();
        let got = match mode {
            Mode::Checked => kvplan::ops::plan(&mut mirror.plans, inputs())
                .and_then(|status| status.check().map(drop)),
            Mode::Deferred => kvplan::ops::plan(&mut mirror.plans, inputs()).map(|_| ()),
        };
        assert_eq!(got, Err(want.clone()), "{mode:?}");
        assert_plans_eq(
            &mirror.read(),
            &before,
            &format!("{} ({mode:?}) leaves the plans unchanged", want.kind()),
        );
    }
}

pub fn plan_host_errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let mut mirror = primed::<B>(d);
    let base = || {
        PlanInputs::<B>::from_primitives(
            l::<B>(&[1, 2], d),
            l::<B>(&[3, 4], d),
            l::<B>(&[1, 1], d),
            linear48::<B>(d),
        )
    };
    let pool = || ints::<B, 2>(&(0..24).collect::<Vec<_>>(), [4, 6], DType::I32, d);
    let lut = |len: usize| list::<B>(&(0..len as i64).collect::<Vec<_>>(), DType::I64, d);

    host_error(
        &mut mirror,
        || base().swa_window_size(4),
        Error::MissingLutForSwa { window: 4 },
    );
    host_error(
        &mut mirror,
        || base().swa_window_size(4).verify_capacity(15),
        Error::MissingLutForSwa { window: 4 },
    );
    host_error(
        &mut mirror,
        || base().verify_capacity(15),
        Error::CapacityMismatch {
            argument: 15,
            plan: 16,
        },
    );
    host_error(
        &mut mirror,
        || base().expected_tokens_pool_primitive(pool()),
        Error::MissingValidLens,
    );
    host_error(
        &mut mirror,
        || base().expected_tokens_valid_lens_primitive(l::<B>(&[1, 1], d)),
        Error::ValidLensWithoutPool,
    );
    // not_2d: a 1-D and a 3-D table.
    let data: Vec<i64> = (0..32).collect();
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4], d),
                l::<B>(&[1, 1], d),
                ints::<B, 1>(&data, [32], DType::I32, d),
            )
        },
        Error::Not2d {
            context: PLAN_CONTEXT.into(),
            name: "req_to_token",
            shape: Dims(vec![32]),
        },
    );
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4], d),
                l::<B>(&[1, 1], d),
                ints::<B, 3>(&data, [2, 4, 4], DType::I64, d),
            )
        },
        Error::Not2d {
            context: PLAN_CONTEXT.into(),
            name: "req_to_token",
            shape: Dims(vec![2, 4, 4]),
        },
    );
    // not_1d: a 2-D prefix_lens.
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                ints::<B, 2>(&[3, 4], [2, 1], DType::I64, d),
                l::<B>(&[1, 1], d),
                linear48::<B>(d),
            )
        },
        Error::Not1d {
            context: PLAN_CONTEXT.into(),
            name: "prefix_lens",
            shape: Dims(vec![2, 1]),
        },
    );
    // length_mismatch.
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4, 5], d),
                l::<B>(&[1, 1], d),
                linear48::<B>(d),
            )
        },
        Error::LengthMismatch {
            name: "prefix_lens",
            len: 3,
            bs: 2,
        },
    );
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(
                l::<B>(&[1, 2], d),
                l::<B>(&[3, 4], d),
                l::<B>(&[1], d),
                linear48::<B>(d),
            )
        },
        Error::LengthMismatch {
            name: "extend_seq_lens",
            len: 1,
            bs: 2,
        },
    );
    host_error(
        &mut mirror,
        || {
            base()
                .expected_tokens_pool_primitive(pool())
                .expected_tokens_valid_lens_primitive(l::<B>(&[6, 6, 6], d))
        },
        Error::LengthMismatch {
            name: "req_to_verify_expected_tokens_valid_lens",
            len: 3,
            bs: 2,
        },
    );
    // empty_lut, even without a window; it beats bs_exceeds_write_capacity.
    host_error(
        &mut mirror,
        || base().full_to_swa_index_mapping_primitive(lut(0)),
        Error::EmptyLut,
    );
    host_error(
        &mut mirror,
        || {
            base()
                .swa_window_size(2)
                .full_to_swa_index_mapping_primitive(lut(0))
        },
        Error::EmptyLut,
    );
    // bs_exceeds_write_capacity.
    let five = || l::<B>(&[1, 2, 3, 1, 2], d);
    host_error(
        &mut mirror,
        || PlanInputs::<B>::from_primitives(five(), five(), five(), linear48::<B>(d)),
        Error::BsExceedsWriteCapacity { bs: 5, capacity: 4 },
    );
    host_error(
        &mut mirror,
        || {
            PlanInputs::<B>::from_primitives(five(), five(), five(), linear48::<B>(d))
                .full_to_swa_index_mapping_primitive(lut(0))
        },
        Error::EmptyLut,
    );
    // The plans still work afterwards.
    mirror
        .step(&base_step(), Mode::Checked, "after host errors")
        .unwrap();
}

pub fn plan_device_errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let identity = |len: i64| Some((0..len).collect::<Vec<_>>());
    let pool = |rows: usize| {
        (0..(rows * 6) as i64)
            .map(|k| 100000 + k)
            .collect::<Vec<_>>()
    };
    let cases: Vec<(Step, Error)> = vec![
        (
            base_step().batch(&[1, 4], &[3, 4], &[1, 1]),
            Error::ReqPoolIndexOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(1),
                value: 4,
                rows: 4,
            },
        ),
        (
            base_step().batch(&[-1, -3], &[1, 1], &[1, 1]),
            Error::ReqPoolIndexOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(0),
                value: -1,
                rows: 4,
            },
        ),
        (
            base_step().batch(&[1, 2], &[9, 1], &[1, 1]),
            Error::PositionOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(0),
                position: 9,
                cols: 8,
            },
        ),
        // A prefix far past the table: its 2^31 (capped) verify entries must not be walked.
        (
            base_step().batch(&[1, 2], &[1 << 40, 1], &[1, 1]),
            Error::PositionOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(0),
                position: 1 << 40,
                cols: 8,
            },
        ),
        (
            base_step().batch(&[1], &[3], &[1]).window(4, identity(10)),
            Error::SwaSlotOutsideLut {
                slot: 10,
                lut_len: 10,
                request: 0,
                position: 2,
            },
        ),
        (
            base_step()
                .batch(&[1, 3], &[2, 2], &[1, 1])
                .pool(2, 6, pool(2), &[2, 2], 0),
            Error::ExpectedPoolRowOutOfRange {
                request: 1,
                row: 3,
                pool_rows: 2,
            },
        ),
        (
            base_step()
                .batch(&[1], &[8], &[1])
                .pool(4, 6, pool(4), &[8], 0),
            Error::ExpectedPoolPositionOutOfRange {
                request: 0,
                column: 7,
                pool_cols: 6,
                valid_len: 8,
            },
        ),
        (
            base_step().batch(&[1, 2, 3], &[0, 0, 0], &[i64::MAX - 1, 1, 5]),
            Error::WriteOffsetsOverflow { request: 2 },
        ),
    ];
    for (step, want) in cases {
        for mode in MODES {
            let mut mirror = primed::<B>(d);
            // Also run on overflowing plans: the value checks cover every entry that would exist.
            let got = mirror.step(&step, mode, &format!("{} ({mode:?})", want.kind()));
            assert_eq!(got, Err(want.clone()));
            let mut tiny = Mirror::<B>::new(1, 4, d);
            tiny.step(&base_step(), mode, "tiny prime").unwrap();
            let got = tiny.step(&step, mode, &format!("{} on V=1 ({mode:?})", want.kind()));
            if step.verify_total() > 1 {
                assert_eq!(got, Err(want.clone()), "value checks apply on overflow");
            }
            // A good step re-enables the plans.
            mirror.step(&base_step(), mode, "recovery").unwrap();
            let after = mirror.read();
            assert_eq!(
                (
                    after.enable,
                    after.verify_num_valid,
                    after.write_num_valid_reqs
                ),
                (1, 7, 2)
            );
        }
    }
    // The searchable message of rule 14 survives the device round trip.
    let mut mirror = primed::<B>(d);
    let error = mirror
        .step(
            &base_step().batch(&[1], &[3], &[1]).window(4, identity(10)),
            Mode::Deferred,
            "msg",
        )
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "kv-canary: SWA slot 10 is outside full_to_swa_index_mapping length 10 (request 0, position 2)"
    );
}

pub fn allocation_errors<B: KvPlanBackend>(device: &B::Device) {
    // `VerifyPlan::allocate` / `WritePlan::allocate` are one call now, `StepPlan::allocate_on`:
    // each capacity is checked with the other one valid.
    assert_eq!(
        StepPlan::<B>::allocate_on(0, 1, device).err(),
        Some(Error::NonPositiveVerifyCapacity { value: 0 })
    );
    assert_eq!(
        StepPlan::<B>::allocate_on(1, 0, device).err(),
        Some(Error::NonPositiveWriteCapacity { value: 0 })
    );
    for value in [1usize << 31, usize::MAX] {
        assert_eq!(
            StepPlan::<B>::allocate_on(value, 1, device).err(),
            Some(Error::CapacityTooLarge {
                field: "verify_capacity",
                value
            })
        );
        assert_eq!(
            StepPlan::<B>::allocate_on(1, value, device).err(),
            Some(Error::CapacityTooLarge {
                field: "write_req_capacity",
                value
            })
        );
    }
    let plans = StepPlan::<B>::allocate_on(1, 1, device).unwrap();
    let fresh = kvplan::ops::read_plans(&plans).unwrap();
    assert_eq!(fresh, PlanBuffers::fresh(1, 1));
    assert_eq!(values::<B>(plans.verify.enable()), vec![1]);
    assert_eq!(plans.verify.num_valid().dtype(), DType::I32);
    assert_eq!(plans.verify.slot_indices().dtype(), DType::I64);
    assert_eq!(dims(&plans.write.offsets()), [2]);
    assert_eq!(plans.write.num_valid_reqs().dtype(), DType::I32);
}

/// `allocation_too_large` naming `what`, its elements and bytes, where it could not be allocated.
#[track_caller]
fn assert_too_large(got: Option<Error>, what: &str, elements: usize, elem_bytes: usize) {
    let bytes = elements as u128 * elem_bytes as u128;
    let Some(Error::AllocationTooLarge {
        what: got_what,
        elements: got_elements,
        bytes: got_bytes,
        on,
        ..
    }) = &got
    else {
        panic!("{what} of {elements} elements: expected allocation_too_large, got {got:?}");
    };
    assert_eq!(
        (*got_what, *got_elements, *got_bytes),
        (what, elements as u64, bytes)
    );
    assert!(["the device", "the host"].contains(on), "{on}");
    let message = got.as_ref().map(Error::to_string).unwrap_or_default();
    let named = format!("kvplan: {what} needs {elements} elements ({bytes} bytes), more than {on}");
    assert!(message.starts_with(&named), "{message}");
}

/// Sizes no device or host allocates come back as `allocation_too_large` before anything is
/// allocated, and the device still serves a small call afterwards.
pub fn allocation_too_large<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    for huge in [1usize << 40, usize::MAX] {
        let (table, rpi) = (
            ints::<B, 2>(&[5, 6], [1, 2], DType::I32, d),
            l::<B>(&[0], d),
        );
        let pos2d = ints::<B, 2>(&[1], [1, 1], DType::I64, d);
        let mask = bools::<B, 2>(&[true], [1, 1], d);
        let got = masked_deferred::<B>(table.clone(), rpi.clone(), pos2d, mask, Some(huge));
        assert_too_large(got.err(), "gather output", huge, 8);
        let got = segments_deferred::<B>(table, rpi, None, l::<B>(&[2], d), Some(huge));
        assert_too_large(got.err(), "gather output", huge, 8);
        let got = kvplan::ops::Canary::<B>::allocate_on(huge, 32, 1, d);
        assert_too_large(got.err(), "canary record buffer", huge, 32);
        let got = kvplan::ops::Canary::<B>::allocate_on(1, 32, huge, d);
        assert_too_large(got.err(), "violation ring", huge, 64);
        let got = kvplan::ops::KvStore::<B>::allocate_on(huge, d);
        assert_too_large(got.err(), "KvStore slot words", huge, 8);
    }
    let (table, rpi) = (
        ints::<B, 2>(&[5, 6], [1, 2], DType::I32, d),
        l::<B>(&[0], d),
    );
    let got = segments::<B>(table, rpi, None, l::<B>(&[2], d)).map(values::<B>);
    assert_eq!(got, Ok(vec![5, 6]), "a small gather after the refusals");
}

/// How a backend meets a broadcast (`expand`ed, zero-row-stride) `req_to_token`.
///
/// In 0.21 the unfused CubeCL backend refused it on the host (`HostRefused`, through the trait's
/// `int_row_stride`); the 0.22 library has no host-side stride query: every Cube launch (fused or
/// not) checks the real stride and reports rule 11 through the status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broadcast {
    /// The launcher finds the zero stride and reports rule 11 through the status, leaving both
    /// plans unchanged (CubeCL, fused or not).
    DeviceRefused,
    /// The backend reads values, not strides (Flex, the host reference): the op runs on the
    /// broadcast values.
    Accepted,
}

/// Rule 11 through the backend API: a broadcast (`expand`ed) table, handled as `expect` says.
/// A padded (sliced, row stride 12 for 8 columns) table is accepted everywhere.
pub fn stride<B: KvPlanBackend>(device: &B::Device, expect: Broadcast) {
    let d = device;
    let row: Vec<i64> = (0..8).map(|c| 8 + c).collect();
    let expanded = || int_expand::<B, 2>(ints::<B, 2>(&row, [1, 8], DType::I32, d), [4, 8]);
    assert_eq!(
        values::<B>(expanded()),
        row.repeat(4),
        "the expanded table's values"
    );
    let step = Step::new(4, 8, row.repeat(4)).batch(&[1, 2], &[3, 4], &[1, 1]);
    let inputs = || {
        PlanInputs::<B>::from_primitives(
            l::<B>(&[1, 2], d),
            l::<B>(&[3, 4], d),
            l::<B>(&[1, 1], d),
            expanded(),
        )
    };
    let want = Error::ReqToTokenStride { stride: 0 };
    match expect {
        Broadcast::DeviceRefused => {
            let mut mirror = primed::<B>(d);
            let before = mirror.read();
            let got = kvplan::ops::plan(&mut mirror.plans, inputs())
                .and_then(|status| status.check().map(drop));
            assert_eq!(got, Err(want.clone()), "checked");
            assert_plans_eq(&mirror.read(), &before, "rule 11 on the device (checked)");
            let status = kvplan::ops::plan(&mut mirror.plans, inputs())
                .expect("the host cannot see the stride");
            assert_plans_eq(&mirror.read(), &before, "rule 11 on the device (deferred)");
            assert_eq!(status.check(), Err(want.clone()), "deferred");
        }
        Broadcast::Accepted => {
            for mode in MODES {
                let mut mirror = primed::<B>(d);
                mirror
                    .step_with(&step, inputs(), mode, "expanded table")
                    .unwrap();
            }
        }
    }
    if expect != Broadcast::Accepted {
        let mut mirror = primed::<B>(d);
        let error = kvplan::ops::plan(&mut mirror.plans, inputs())
            .and_then(|status| status.check().map(drop))
            .unwrap_err();
        assert_eq!(
            error.to_string(),
            "kv-canary: req_to_token_stride0 must be positive, got 0"
        );
    }
    // A padded table: columns 2..10 of a 4x12 buffer.
    let wide: Vec<i64> = (0..48).map(|k| 1000 + k).collect();
    let sliced = || int_slice::<B>(ints::<B, 2>(&wide, [4, 12], DType::I64, d), &[0..4, 2..10]);
    let table: Vec<i64> = (0..4)
        .flat_map(|q| (2..10).map(move |c| 1000 + 12 * q + c))
        .collect();
    let step = Step::new(4, 8, table).batch(&[1, 2, 3], &[3, 8, 5], &[1, 1, 2]);
    for mode in MODES {
        let mut mirror = primed::<B>(d);
        let inputs = PlanInputs::<B>::from_primitives(
            l::<B>(&[1, 2, 3], d),
            l::<B>(&[3, 8, 5], d),
            l::<B>(&[1, 1, 2], d),
            sliced(),
        );
        mirror
            .step_with(&step, inputs, mode, "sliced table")
            .unwrap();
    }
}

/// Negative values must keep their sign whatever the input dtype: the same checks and results
/// with int32 and int64 tensors (row indices, positions, starts, lengths, prefix lengths).
pub fn negative_values_both_dtypes<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    for dtype in [DType::I32, DType::I64] {
        let v = |data: &[i64]| list::<B>(data, dtype, d);
        // Masked: a negative row index and a negative position in a true cell.
        masked_error::<B>(
            t46::<B>(d),
            v(&[-1, -4]),
            ints::<B, 2>(&[0, 0], [2, 1], dtype, d),
            bools::<B, 2>(&[true, true], [2, 1], d),
            None,
            Error::ReqPoolIndexOutOfRange {
                context: CTX.into(),
                site: Site::Row(0),
                value: -1,
                rows: 4,
            },
            false,
        );
        masked_error::<B>(
            t46::<B>(d),
            v(&[1, 2]),
            ints::<B, 2>(&[0, -5, -1, 2], [2, 2], dtype, d),
            bools::<B, 2>(&[true, false, true, true], [2, 2], d),
            None,
            Error::PositionOutOfRange {
                context: CTX.into(),
                site: Site::Cell(1, 0),
                position: -1,
                cols: 6,
            },
            false,
        );
        // Masked-off negative positions are ignored.
        let got = masked::<B>(
            t46::<B>(d),
            v(&[3]),
            ints::<B, 2>(&[-7, 5], [1, 2], dtype, d),
            bools::<B, 2>(&[false, true], [1, 2], d),
        );
        assert_eq!(got.map(values::<B>), Ok(vec![123]), "{dtype:?}");
        // Segments: negative lengths contribute nothing and their starts are not checked.
        let got = segments::<B>(
            t46::<B>(d),
            v(&[1, 2, 3]),
            Some(v(&[0, -887, 2])),
            v(&[2, -2, 1]),
        );
        assert_eq!(got.map(values::<B>), Ok(vec![106, 107, 120]), "{dtype:?}");
        let got = segments::<B>(t46::<B>(d), v(&[1, 2, 3]), None, v(&[-1, 3, -3]));
        assert_eq!(got.map(values::<B>), Ok(vec![112, 113, 114]), "{dtype:?}");
        let got = segments::<B>(t46::<B>(d), v(&[1, 99]), Some(v(&[5, -5])), v(&[-1, -1]));
        assert_eq!(got.map(|out| dims(&out)), Ok(vec![0]), "{dtype:?}");
        // A negative start and a negative row index.
        segment_error::<B>(
            t46::<B>(d),
            v(&[1]),
            Some(v(&[-2])),
            v(&[2]),
            None,
            Error::PositionOutOfRange {
                context: SEGMENT_CONTEXT.into(),
                site: Site::Cell(0, 0),
                position: -2,
                cols: 6,
            },
            false,
        );
        segment_error::<B>(
            t46::<B>(d),
            v(&[1, -3]),
            None,
            v(&[1, 0]),
            None,
            Error::ReqPoolIndexOutOfRange {
                context: SEGMENT_CONTEXT.into(),
                site: Site::Row(1),
                value: -3,
                rows: 4,
            },
            false,
        );
        // Plan: negative prefix and extend lengths (not live, nothing to write), a negative row
        // index with a positive prefix (an error), negative LUT entries and slots.
        let mut step = base_step().batch(&[1, 2, 3], &[-1, 3, -2147483648], &[-4, 2, -1]);
        step.dtypes = [dtype; 7];
        for mode in MODES {
            let mut mirror = primed::<B>(d);
            mirror
                .step(&step, mode, &format!("negative lengths {dtype:?}"))
                .unwrap();
            let got = mirror.read();
            assert_eq!(&got.write_offsets[..4], &[0, 0, 2, 2]);
            assert_eq!(&got.write_seed_slot_indices[..3], &[-1, 18, -1]);
        }
        let mut step = base_step().batch(&[2, -1], &[1, 1], &[1, 1]);
        step.dtypes = [dtype; 7];
        let mut mirror = primed::<B>(d);
        let got = mirror.step(&step, Mode::Deferred, &format!("negative row {dtype:?}"));
        assert_eq!(
            got,
            Err(Error::ReqPoolIndexOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(1),
                value: -1,
                rows: 4,
            })
        );
        let mut table: Vec<i64> = (0..32).collect();
        table[8] = -5;
        let lut: Vec<i64> = (0..32)
            .map(|i| if i % 2 == 0 { -1 } else { 100 + i })
            .collect();
        let mut step = Step::new(4, 8, table)
            .batch(&[1], &[4], &[1])
            .window(3, Some(lut));
        step.dtypes = [dtype; 7];
        for mode in MODES {
            let mut mirror = primed::<B>(d);
            mirror
                .step(&step, mode, &format!("negative slots {dtype:?}"))
                .unwrap();
            let got = mirror.read();
            // Positions 1..4 of row 1 = [9, 10, 11] -> [109, -1, 111]; predecessor T[1][0] = -5.
            assert_eq!(&got.verify_slot_indices[..3], &[109, -1, 111]);
            assert_eq!(&got.verify_prev_slot_indices[..3], &[-5, 109, -1]);
        }
    }
}

/// Rule 14 found by a cube that is not its tile's lead: a lone tile whose entries span several
/// cubes, and the second of two tiles. The error and the disabled plans come out as from a
/// one-cube launch.
pub fn plan_errors_past_the_lead<B: KvPlanBackend>(device: &B::Device) {
    for (bs, cols) in [(2usize, 2000usize), (300, 600)] {
        let rows = bs + 1;
        let lut_len = rows * cols;
        let mut table: Vec<i64> = (0..lut_len as i64).collect();
        let (request, position) = (bs - 1, cols - 10);
        // Request `r` reads row `r + 1`.
        table[(request + 1) * cols + position] = lut_len as i64;
        let rpi: Vec<i64> = (1..=bs as i64).collect();
        let step = Step::new(rows, cols, table)
            .batch(&rpi, &vec![cols as i64; bs], &vec![1; bs])
            .window(cols as i32, Some((0..lut_len as i64).collect()));
        let want = Error::SwaSlotOutsideLut {
            slot: lut_len as i64,
            lut_len,
            request,
            position,
        };
        for mode in MODES {
            let mut mirror = Mirror::<B>::new(bs * cols, bs, device);
            let what = format!("bs={bs}, cols={cols} ({mode:?})");
            assert_eq!(mirror.step(&step, mode, &what), Err(want.clone()));
        }
    }
}
