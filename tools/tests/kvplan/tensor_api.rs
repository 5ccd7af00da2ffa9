//! The `Tensor` façade (`Tensor<D, K>` on a `Device`, dispatched): the form users call. The same
//! data as the backend-level suites, compared with the reference, so that the conversions between
//! `Tensor` and `Dispatch` primitives (`into_dispatch` / `from_dispatch`) are covered on every
//! device kind.

use burn_core::tensor::{Bool, DType, Device, Float, Int, Tensor, TensorData};
use kvplan::Error;
use kvplan::ops::GatherOptions;
use kvplan::ops::{
    Canary, CanaryLaunch, CanaryState, FailReasons, KernelKind, PlanInputs, RealKvHashMode,
    RealKvSource, SourceBytes, StepPlan, WriteInputs,
};
use kvplan::reference::PlanBuffers;
use kvplan::reference::canary::{self as oracle, Launch, ViolationRow};

use crate::common::{Rng, assert_plans_eq};
use crate::gather::{CTX, MaskedCase, SEGMENT_CONTEXT, SegmentCase};
use crate::plan::Step;

fn ints<const D: usize>(
    data: &[i64],
    shape: [usize; D],
    dtype: DType,
    device: &Device,
) -> Tensor<D, Int> {
    if shape.contains(&0) {
        return Tensor::empty(shape, (device, dtype));
    }
    Tensor::from_data(TensorData::new(data.to_vec(), shape), (device, dtype))
}

fn list(data: &[i64], dtype: DType, device: &Device) -> Tensor<1, Int> {
    ints::<1>(data, [data.len()], dtype, device)
}

fn bools<const D: usize>(data: &[bool], shape: [usize; D], device: &Device) -> Tensor<D, Bool> {
    if shape.contains(&0) {
        return Tensor::empty(shape, device);
    }
    Tensor::from_data(TensorData::new(data.to_vec(), shape), device)
}

fn values<const D: usize>(tensor: Tensor<D, Int>) -> Vec<i64> {
    crate::common::data_to_i64(&tensor.into_data())
}

/// The exact slots of a gather: its status read back, then the first `count` values.
#[track_caller]
fn check_exact(
    got: Result<kvplan::ops::Gathered, Error>,
    want: &Result<Vec<i64>, Error>,
    what: &str,
) {
    let got = got.and_then(|gathered| {
        let count = gathered.status.check()?;
        let slots = gathered.slots();
        assert_eq!(slots.dtype(), DType::I64, "{what}: dtype");
        Ok(if count == 0 {
            vec![]
        } else {
            values(slots.slice([0..count]))
        })
    });
    match (got, want) {
        (Ok(out), Ok(want)) => assert_eq!(&out, want, "{what}: values"),
        (Err(error), Err(want)) => assert_eq!(&error, want, "{what}: error"),
        (Ok(out), Err(want)) => panic!("{what}: expected {want:?}, got Ok({out:?})"),
        (Err(error), Ok(_)) => panic!("{what}: expected Ok, got {error:?}"),
    }
}

#[track_caller]
fn check_deferred(
    got: kvplan::ops::Gathered,
    want: &Result<Vec<i64>, Error>,
    capacity: usize,
    what: &str,
) {
    let (out, count) = (got.slots(), got.count_tensor());
    assert_eq!(out.dims(), [capacity], "{what}: out length");
    assert_eq!(count.dims(), [1], "{what}: count shape");
    let count = values(count);
    match (got.status.check(), want) {
        (Ok(n), Ok(want)) => {
            assert_eq!(n, want.len(), "{what}: check()");
            assert_eq!(count, vec![n as i64], "{what}: count tensor");
            // Only the prefix: the tail was never written.
            let out = if n == 0 {
                vec![]
            } else {
                values(out.slice(0..n))
            };
            assert_eq!(out, want[..], "{what}: out[..count]");
        }
        (Err(error), Err(want)) => {
            assert_eq!(&error, want, "{what}: deferred error");
            assert_eq!(count, vec![0], "{what}: count after a deferred error");
        }
        (got, want) => panic!("{what}: expected {want:?}, check() gave {got:?}"),
    }
}

fn masked_tensors(
    case: &MaskedCase,
    d: &Device,
) -> (
    Tensor<2, Int>,
    Tensor<1, Int>,
    Tensor<2, Int>,
    Tensor<2, Bool>,
) {
    (
        ints::<2>(&case.table, [case.rows, case.cols], case.dtypes[0], d),
        list(&case.rpi, case.dtypes[1], d),
        ints::<2>(&case.pos2d, [case.r, case.c], case.dtypes[2], d),
        bools::<2>(&case.mask, [case.r, case.c], d),
    )
}

/// Random masked gathers (every dtype mix, shared and per-row indices, bad rows and positions)
/// through `kvplan::ops::masked_gather` and `masked_gather`.
pub fn masked(device: &Device) {
    let mut rng = Rng::new(0x7465_6e73);
    for round in 0..24 {
        let (rows, cols) = (rng.urange(1, 5), rng.urange(1, 12));
        let (r, c) = (rng.urange(0, 9), rng.urange(0, 9));
        let n = if r <= 1 || rng.chance(1, 3) { 1 } else { r };
        let mask: Vec<bool> = (0..r * c).map(|_| rng.chance(1, 2)).collect();
        let pos2d = (0..r * c)
            .map(|_| {
                if rng.chance(1, 20) {
                    cols as i64
                } else {
                    rng.range(0, cols as i64 - 1)
                }
            })
            .collect();
        let rpi = (0..n)
            .map(|_| {
                if rng.chance(1, 20) {
                    -1
                } else {
                    rng.range(0, rows as i64 - 1)
                }
            })
            .collect();
        let case = MaskedCase {
            rows,
            cols,
            table: (0..(rows * cols) as i64).map(|k| 1000 + 7 * k).collect(),
            rpi,
            r,
            c,
            pos2d,
            mask,
            dtypes: [rng.int_dtype(), rng.int_dtype(), rng.int_dtype()],
        };
        let what = format!("tensor masked round {round}: {case:?}");
        let (table, rpi, pos2d, mask) = masked_tensors(&case, device);
        let options = GatherOptions::new().context(CTX);
        let got = kvplan::ops::masked_gather(
            table.clone(),
            rpi.clone(),
            pos2d.clone(),
            mask.clone(),
            &options,
        );
        check_exact(got, &case.reference(None), &what);
        let capacity = rng.urange(0, r * c + 2);
        let got = kvplan::ops::masked_gather(
            table,
            rpi,
            pos2d,
            mask,
            &options.clone().capacity(capacity),
        )
        .expect("host rules pass");
        check_deferred(got, &case.reference(Some(capacity)), capacity, &what);
    }
    // A host rule comes back at once, with the context.
    let error = kvplan::ops::masked_gather(
        ints::<2>(&[1, 2, 3, 4], [2, 2], DType::I64, device),
        list(&[0], DType::I64, device),
        ints::<2>(&[0; 6], [2, 3], DType::I64, device),
        bools::<2>(&[true; 6], [3, 2], device),
        &GatherOptions::new().context(CTX),
    )
    .unwrap_err();
    assert_eq!(error.kind(), "mask_shape_mismatch");
    assert!(error.to_string().starts_with(CTX), "{error}");
}

/// Random segment gathers through `kvplan::ops::segment_gather` and `segment_gather`.
pub fn segments(device: &Device) {
    let mut rng = Rng::new(0x7365_676d);
    for round in 0..24 {
        let (rows, cols) = (rng.urange(1, 5), rng.urange(1, 12));
        let s = rng.urange(0, 7);
        let has_start = rng.chance(2, 3);
        let n = if has_start && rng.chance(1, 3) { 1 } else { s };
        let lengths: Vec<i64> = (0..s).map(|_| rng.range(-2, cols as i64)).collect();
        let start = has_start.then(|| {
            lengths
                .iter()
                .map(|&len| {
                    if rng.chance(1, 20) {
                        -1
                    } else {
                        rng.range(0, cols as i64 - len.max(0))
                    }
                })
                .collect()
        });
        let case = SegmentCase {
            rows,
            cols,
            table: (0..(rows * cols) as i64).map(|k| 500 + 3 * k).collect(),
            rpi: (0..n).map(|_| rng.range(0, rows as i64 - 1)).collect(),
            start,
            lengths,
            dtypes: [0; 4].map(|_| rng.int_dtype()),
        };
        let what = format!("tensor segments round {round}: {case:?}");
        let d = device;
        let table = ints::<2>(&case.table, [rows, cols], case.dtypes[0], d);
        let rpi = list(&case.rpi, case.dtypes[1], d);
        let start = case
            .start
            .as_ref()
            .map(|start| list(start, case.dtypes[2], d));
        let lengths = list(&case.lengths, case.dtypes[3], d);
        let got = kvplan::ops::segment_gather(
            table.clone(),
            rpi.clone(),
            start.clone(),
            lengths.clone(),
            &GatherOptions::new(),
        );
        check_exact(got, &case.reference(None), &what);
        let got = kvplan::ops::segment_gather(table, rpi, start, lengths, &GatherOptions::new())
            .expect("host rules pass");
        check_deferred(
            got,
            &case.reference(Some(case.default_capacity())),
            case.default_capacity(),
            &what,
        );
    }
    let error = kvplan::ops::segment_gather(
        ints::<2>(&[1, 2, 3, 4], [2, 2], DType::I32, device),
        list(&[1], DType::I64, device),
        Some(list(&[1], DType::I64, device)),
        list(&[2], DType::I64, device),
        &GatherOptions::new(),
    )
    .and_then(|gathered| gathered.status.check())
    .unwrap_err();
    assert_eq!(error.kind(), "position_out_of_range");
    assert!(error.to_string().starts_with(SEGMENT_CONTEXT), "{error}");
}

fn plan_inputs(step: &Step, d: &Device) -> PlanInputs {
    let t = step.dtypes;
    let mut inputs = PlanInputs::new(
        list(&step.rpi, t[0], d),
        list(&step.prefix, t[1], d),
        list(&step.extend, t[2], d),
        ints::<2>(&step.table, [step.rows, step.cols], t[3], d),
    )
    .swa_window_size(step.window)
    .position_offset(step.offset);
    if let Some(lut) = &step.lut {
        inputs = inputs.full_to_swa_index_mapping(list(lut, t[4], d));
    }
    if let Some((rows, cols, data)) = &step.pool {
        inputs = inputs.expected_tokens(
            ints::<2>(data, [*rows, *cols], t[5], d),
            list(&step.valid_lens, t[6], d),
        );
    }
    inputs
}

/// Plan steps through `StepPlan::allocate`, `PlanInputs::new` (with a window, a LUT and an
/// expected-token pool), `kvplan::ops::plan` and `kvplan::ops::plan_deferred`, against the
/// reference on the same prior state; then a device-checked error, which leaves the plans
/// disabled.
pub fn plan(device: &Device) {
    let (rows, cols) = (4, 8);
    let table: Vec<i64> = (0..(rows * cols) as i64).collect();
    let steps = [
        Step::new(rows, cols, table.clone()).batch(&[1, 2, 3], &[0, 4, 8], &[8, 1, 1]),
        Step::new(rows, cols, table.clone())
            .batch(&[3, 0, 1], &[5, 9, 2], &[1, 1, 2])
            .window(3, Some((0..32).map(|k| 100 + k).collect()))
            .pool(4, 9, (0..36).map(|k| 7000 + k).collect(), &[6, 0, 9], 1),
        Step::new(rows, cols, table.clone()).batch(&[2], &[3], &[1]),
    ];
    let mut plans = StepPlan::allocate(16, 4, device).unwrap();
    let mut host = PlanBuffers::fresh(16, 4);
    for (k, step) in steps.iter().enumerate() {
        let mut want = host.clone();
        step.reference(&mut want).unwrap();
        if k % 2 == 0 {
            kvplan::ops::plan(&mut plans, plan_inputs(step, device))
                .and_then(|status| status.check().map(drop))
                .unwrap();
        } else {
            let status = kvplan::ops::plan(&mut plans, plan_inputs(step, device)).unwrap();
            assert_eq!(status.check(), Ok(0), "step {k}: deferred status");
        }
        let got = kvplan::ops::read_plans(&plans).unwrap();
        assert_plans_eq(&got, &want, &format!("tensor plan step {k}"));
        host = got;
    }
    let bad = Step::new(rows, cols, table).batch(&[1, 4], &[3, 4], &[1, 1]);
    let error = kvplan::ops::plan(&mut plans, plan_inputs(&bad, device))
        .and_then(|status| status.check().map(drop))
        .unwrap_err();
    assert_eq!(
        error,
        Error::ReqPoolIndexOutOfRange {
            context: "kv-canary:".into(),
            site: kvplan::error::Site::Request(1),
            value: 4,
            rows: 4,
        }
    );
    let got = kvplan::ops::read_plans(&plans).unwrap();
    assert_eq!(
        (got.enable, got.verify_num_valid, got.write_num_valid_reqs),
        (0, 0, 0)
    );
}

/// The oracle's view of per-slot sources of 32 bytes a slot.
fn oracle_sources(bytes: &[Vec<u8>; 2]) -> Vec<oracle::SourceBytes<'_>> {
    bytes
        .iter()
        .map(|bytes| oracle::SourceBytes {
            bytes,
            row_bytes: 32,
            page_size: 1,
            num_bytes_per_token: 32,
            read_bytes: 32,
        })
        .collect()
}

fn sorted(mut rows: Vec<ViolationRow>) -> Vec<ViolationRow> {
    rows.sort_unstable();
    rows
}

/// plan -> write -> verify through the `Tensor` forms (`Canary::allocate`, `WriteInputs::new`
/// with the chain-position assert and the input assert, `RealKvSource::float` and `::int`,
/// `Canary::buffer`), against the oracle; then a real-KV byte flip through `slice_assign`.
pub fn canary(device: &Device) {
    let d = device;
    const SLOTS: usize = 32;
    // Two sources: f32 words and raw u8 bytes, 32 bytes a slot.
    let floats: Vec<f32> = (0..SLOTS * 8).map(|k| (k % 1000) as f32).collect();
    let raw: Vec<u8> = (0..SLOTS * 32).map(|k| (k * 7 % 251) as u8).collect();
    let float_kv =
        Tensor::<2, Float>::from_data(TensorData::new(floats.clone(), [SLOTS, 8]), (d, DType::F32));
    let int_kv =
        Tensor::<2, Int>::from_data(TensorData::new(raw.clone(), [SLOTS, 32]), (d, DType::U8));
    let sources = |float_kv: &Tensor<2, Float>| {
        vec![
            RealKvSource::float(float_kv.clone(), SourceBytes::per_slot(32)).unwrap(),
            RealKvSource::int(int_kv.clone(), SourceBytes::per_slot(32)).unwrap(),
        ]
    };
    let float_bytes =
        |floats: &[f32]| -> Vec<u8> { floats.iter().flat_map(|f| f.to_le_bytes()).collect() };
    let views = |float_bytes: &[u8]| [float_bytes.to_vec(), raw.clone()];

    let mut plans = StepPlan::allocate(64, 4, d).unwrap();
    let mut canary = Canary::allocate(SLOTS, 32, 16, d).unwrap();
    let mut state = CanaryState::zeroed(SLOTS, 4, 16);
    let mut host = PlanBuffers::fresh(64, 4);
    // req_to_token rows 1 and 2 map positions to slots 1.. and 16..
    let mut table = vec![0i64; 3 * 16];
    for c in 0..16 {
        table[16 + c] = 1 + c as i64;
        table[32 + c] = 16 + c as i64;
    }
    let bytes = views(&float_bytes(&floats));
    let steps: [(&[i64], &[i64], &[i64], &[i64]); 2] = [
        (
            &[0, 0],
            &[4, 3],
            &[0, 1, 2, 3, 0, 1, 2],
            &[1, 2, 3, 4, 16, 17, 18],
        ),
        (&[4, 3], &[1, 1], &[4, 3], &[5, 19]),
    ];
    for (k, (prefix, extend, positions, slots)) in steps.into_iter().enumerate() {
        let step = Step::new(3, 16, table.clone()).batch(&[1, 2], prefix, extend);
        step.reference(&mut host).unwrap();
        kvplan::ops::plan(&mut plans, plan_inputs(&step, d))
            .and_then(|status| status.check().map(drop))
            .unwrap();
        let tokens: Vec<i64> = slots.iter().map(|s| 40 + s).collect();
        let inputs = WriteInputs::new(
            list(&tokens, DType::I64, d),
            list(positions, DType::I64, d),
            list(slots, DType::I64, d),
        )
        .enable_write_input_assert(true)
        .expected_input_tokens(list(&tokens, DType::I64, d))
        .expected_input_positions(list(positions, DType::I64, d))
        .chain_position_assert(list(&[1], DType::I32, d));
        let launch = CanaryLaunch::new(KernelKind::HEAD_K_FULL)
            .real_kv(RealKvHashMode::All, sources(&float_kv));
        canary.write(&plans.write, inputs, &launch).unwrap();
        let verify = CanaryLaunch::new(KernelKind::HEAD_V_FULL)
            .real_kv(RealKvHashMode::All, sources(&float_kv));
        canary.verify(&plans.verify, &verify).unwrap();
        let views = oracle_sources(&bytes);
        let write_rows = oracle::write(
            &mut state,
            &oracle::WriteArgs {
                offsets: &host.write_offsets,
                seed_slot_indices: &host.write_seed_slot_indices,
                num_valid_reqs: host.write_num_valid_reqs,
                input_ids: &tokens,
                positions,
                out_cache_loc: slots,
                expected_inputs: Some((&tokens, positions)),
                chain_position_assert: true,
            },
            &Launch {
                kernel_kind: 0,
                mode: RealKvHashMode::All,
                sources: &views,
            },
        );
        let verify_rows = oracle::verify(
            &mut state,
            &oracle::VerifyArgs {
                slot_indices: &host.verify_slot_indices,
                expected_tokens: &host.verify_expected_tokens,
                expected_positions: &host.verify_expected_positions,
                prev_slot_indices: &host.verify_prev_slot_indices,
                num_valid: host.verify_num_valid,
                enable: host.enable,
                check_expected_token: true,
            },
            &Launch {
                kernel_kind: 1,
                mode: RealKvHashMode::All,
                sources: &views,
            },
        );
        assert!(
            write_rows.is_empty() && verify_rows.is_empty(),
            "step {k}: a clean reference step"
        );
        let got = canary.state().unwrap();
        assert_eq!(got, state, "tensor canary step {k}: the whole state");
    }
    assert_eq!(canary.violations().unwrap().recorded, 0, "clean pipeline");
    // `Canary::buffer` is the records as a [N, S / 8] tensor.
    let buffer = canary.buffer();
    assert_eq!(buffer.dims(), [SLOTS, 4]);
    assert_eq!(values(buffer), state.buffer);

    // Slot 3's float bytes change: the next verify (same plan) reports the real-KV bit there.
    let mut flipped = floats.clone();
    flipped[3 * 8 + 2] += 1.0;
    let float_kv = float_kv.slice_assign(
        [3..4, 2..3],
        Tensor::<2, Float>::from_data(
            TensorData::new(vec![flipped[3 * 8 + 2]], [1, 1]),
            (d, DType::F32),
        ),
    );
    // The plan of the last step verifies slots 1..=4 and 16..=18.
    let verify =
        CanaryLaunch::new(KernelKind::HEAD_V_FULL).real_kv(RealKvHashMode::All, sources(&float_kv));
    canary.verify(&plans.verify, &verify).unwrap();
    let bytes = views(&float_bytes(&flipped));
    let views = oracle_sources(&bytes);
    let want = oracle::verify(
        &mut state,
        &oracle::VerifyArgs {
            slot_indices: &host.verify_slot_indices,
            expected_tokens: &host.verify_expected_tokens,
            expected_positions: &host.verify_expected_positions,
            prev_slot_indices: &host.verify_prev_slot_indices,
            num_valid: host.verify_num_valid,
            enable: host.enable,
            check_expected_token: true,
        },
        &Launch {
            kernel_kind: 1,
            mode: RealKvHashMode::All,
            sources: &views,
        },
    );
    let violations = canary.violations().unwrap();
    assert_eq!(violations.rows.len(), 1, "{violations:?}");
    let row = violations.rows[0];
    assert_eq!((row.slot, row.position), (3, 2));
    assert_eq!(row.fail_reasons, FailReasons::VERIFY_REAL_KV_HASH_MISMATCH);
    let got = canary.state().unwrap();
    assert_eq!(
        sorted(got.ring[..1].to_vec()),
        sorted(want),
        "the violation row"
    );
    assert_eq!(got.buffer, state.buffer);
}

/// `segment_assign` and `KvStore` (float and int caches) through the `Tensor` API against the
/// reference, statuses read by `check_all`, and the outputs handed back unchanged after an error
/// the status holds.
pub fn slots(device: &Device) {
    use crate::slots::{AssignCase, Rows, random_assign};
    use kvplan::ops::KvStore;

    let mut rng = Rng::new(0x736c_6f74);
    let tensors = |case: &AssignCase| {
        (
            ints::<2>(&case.table, [case.rows, case.cols], case.dtypes[0], device),
            list(&case.rpi, case.dtypes[1], device),
            list(&case.start, case.dtypes[2], device),
            list(&case.lengths, case.dtypes[3], device),
            list(&case.loc, case.dtypes[4], device),
        )
    };
    for round in 0..6 {
        let case = random_assign(&mut rng, 9, 6, 10);
        let want = case.reference().expect("a valid case");
        let (table, rpi, start, lengths, loc) = tensors(&case);
        let assigned = kvplan::ops::segment_assign(table, rpi, start, lengths, loc).unwrap();
        assert_eq!(assigned.status.check(), Ok(case.loc.len()));
        let table = assigned.req_to_token;
        assert_eq!(table.dtype(), case.dtypes[0], "round {round}: dtype kept");
        assert_eq!(values(table), want, "round {round}: table");
    }
    // An error in the status: the table comes back as it was.
    let mut case = random_assign(&mut rng, 4, 6, 10);
    case.lengths[0] = -1;
    let want = case.reference().unwrap_err();
    let (table, rpi, start, lengths, loc) = tensors(&case);
    let assigned = kvplan::ops::segment_assign(table, rpi, start, lengths, loc).unwrap();
    assert_eq!(assigned.status.check(), Err(want.clone()));
    assert_eq!(values(assigned.req_to_token), case.table);

    // Stores: a float K cache and an int V cache through one check of the slots, statuses in
    // one `check_all` with the assignment's.
    let float = |rows: &Rows| -> Tensor<2> {
        Tensor::from_data(
            TensorData::new(rows.data.clone(), [rows.shape[0], rows.shape[1]]),
            (device, rows.dtype),
        )
    };
    let int = |rows: &Rows| -> Tensor<2, Int> {
        let data: Vec<i64> = rows.data.iter().map(|&v| v as i64).collect();
        ints::<2>(&data, [rows.shape[0], rows.shape[1]], rows.dtype, device)
    };
    let mut store = KvStore::allocate(24, device).unwrap();
    let mut k = Rows::random(&mut rng, DType::F32, vec![24, 4]);
    let mut v = Rows::random(&mut rng, DType::I32, vec![24, 3]);
    let (mut k_now, mut v_now) = (float(&k), int(&v));
    for (call, loc) in [vec![3, 0, 7, 0], vec![7, 3, 20], vec![1, 2, 0]]
        .into_iter()
        .enumerate()
    {
        let k_rows = Rows::random(&mut rng, DType::F32, vec![loc.len(), 4]);
        let v_rows = Rows::random(&mut rng, DType::I32, vec![loc.len(), 3]);
        for (cache, values) in [(&mut k, &k_rows), (&mut v, &v_rows)] {
            let len = cache.row_len();
            kvplan::reference::store_kv(&mut cache.data, [24, len], &loc, &values.data, "")
                .unwrap();
        }
        let dtype = if call == 1 { DType::I32 } else { DType::I64 };
        let mut slots = store.slots(list(&loc, dtype, device), 24).unwrap();
        assert_eq!(slots.cache_rows(), 24);
        k_now = slots.store(k_now, float(&k_rows)).unwrap();
        v_now = slots.store_int(v_now, int(&v_rows)).unwrap();
        let counts = kvplan::check_all([slots.into_status()]).unwrap();
        assert_eq!(counts, vec![loc.len()], "call {call}: stored");
        assert_eq!(
            k_now.clone().into_data().bytes().to_vec(),
            k.bytes(),
            "call {call}: K"
        );
        assert_eq!(
            v_now.clone().into_data().bytes().to_vec(),
            v.bytes(),
            "call {call}: V"
        );
    }
    // A duplicate in the checked slots: no store through them writes, the status names it.
    let mut slots = store
        .slots(list(&[4, 8, 4], DType::I64, device), 24)
        .unwrap();
    let k_rows = Rows::random(&mut rng, DType::F32, vec![3, 4]);
    let v_rows = Rows::random(&mut rng, DType::I32, vec![3, 3]);
    let k_now = slots.store(k_now, float(&k_rows)).unwrap();
    let v_now = slots.store_int(v_now, int(&v_rows)).unwrap();
    assert_eq!(
        slots.status().check(),
        Err(Error::DuplicateSlot {
            context: crate::slots::STORE.into(),
            index: 2,
            first: 0,
            slot: 4,
        })
    );
    assert_eq!(k_now.into_data().bytes().to_vec(), k.bytes(), "K unchanged");
    assert_eq!(v_now.into_data().bytes().to_vec(), v.bytes(), "V unchanged");
}
