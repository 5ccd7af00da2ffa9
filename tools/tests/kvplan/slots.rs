//! `segment_assign` and `store_kv` through the backend API (`kvplan::generic`,
//! `KvStore<B>`), against the host reference: random cases with poisoned outputs (every cell
//! compared, written or not), every error kind with its exact facts in checked and deferred mode,
//! outputs unchanged after an error, shared and strided inputs, the store's clock, and stores
//! through slots checked once (`KvStore::check_slot_primitives`), one cache or K and V a launch.

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{TensorData, read_sync};
use burn_core::tensor::DType;
use kvplan::backend::{KvRows, StoreTargets};
use kvplan::error::{Dims, Site};
use kvplan::generic;
use kvplan::generic::segment_gather;
use kvplan::ops::GatherOptions;
use kvplan::ops::KvStore;
use kvplan::reference::{Segments, segment_assign, store_kv};
use kvplan::{Error, KvPlanBackend};
use kvplan_tools::conformance::check_file;
use kvplan_tools::prim::read_prefix;

use crate::common::{Rng, conformance_file, int_expand, int_transpose, ints, list, values};
use crate::conformance::assert_clean;
use crate::errors::INT_DTYPES;

/// The prefix of `segment_assign` messages (the library's `ASSIGN_CONTEXT`).
pub const ASSIGN: &str = "segment_assign:";
/// The prefix of `store_kv` messages (the library's `STORE_CONTEXT`).
pub const STORE: &str = "store_kv:";

/// Records of `slots.jsonl`.
const SLOT_RECORDS: usize = 117;

pub fn conformance_file_runs<B: KvPlanBackend>(device: &B::Device) {
    let text = conformance_file("slots.jsonl");
    assert_eq!(
        text.lines().filter(|line| !line.trim().is_empty()).count(),
        SLOT_RECORDS,
        "slots.jsonl records"
    );
    assert_clean("slots.jsonl", &check_file::<B>(&text, device), SLOT_RECORDS);
}

/// The file is what its generator writes (`KVPLAN_REGENERATE=1` writes it).
pub fn file_is_generated() {
    let generated = kvplan_tools::conformance::slots_data::jsonl();
    let path = crate::common::conformance_dir().join("slots.jsonl");
    if std::env::var_os("KVPLAN_REGENERATE").is_some() {
        std::fs::write(&path, &generated).expect("slots.jsonl written");
    }
    let file = std::fs::read_to_string(&path).expect("slots.jsonl");
    assert!(
        file == generated,
        "{} differs from its generator (kvplan_tools::conformance::slots_data): regenerate it",
        path.display()
    );
}

// ---- segment_assign ----

/// One `segment_assign`: host data and dtypes (table, rpi, start, lengths, loc).
#[derive(Debug, Clone)]
pub struct AssignCase {
    pub rows: usize,
    pub cols: usize,
    pub table: Vec<i64>,
    pub rpi: Vec<i64>,
    pub start: Vec<i64>,
    pub lengths: Vec<i64>,
    pub loc: Vec<i64>,
    pub dtypes: [DType; 5],
}

impl AssignCase {
    fn slot_max(&self) -> i64 {
        if self.dtypes[0] == DType::I32 {
            i64::from(i32::MAX)
        } else {
            i64::MAX
        }
    }

    /// The reference: the whole table after the call, or the error.
    pub fn reference(&self) -> Result<Vec<i64>, Error> {
        let mut table = self.table.clone();
        let segments = Segments {
            req_pool_indices: &self.rpi,
            start: &self.start,
            lengths: &self.lengths,
        };
        segment_assign(
            &mut table,
            [self.rows, self.cols],
            segments,
            &self.loc,
            self.slot_max(),
            ASSIGN,
        )?;
        Ok(table)
    }

    pub fn tensors<B: KvPlanBackend>(&self, device: &B::Device) -> [IntTensor<B>; 5] {
        [
            ints::<B, 2>(&self.table, [self.rows, self.cols], self.dtypes[0], device),
            list::<B>(&self.rpi, self.dtypes[1], device),
            list::<B>(&self.start, self.dtypes[2], device),
            list::<B>(&self.lengths, self.dtypes[3], device),
            list::<B>(&self.loc, self.dtypes[4], device),
        ]
    }
}

/// Runs a case in checked and deferred mode and compares both with the reference: the whole
/// table, or the exact error and the table unchanged.
#[track_caller]
pub fn run_assign<B: KvPlanBackend>(case: &AssignCase, device: &B::Device, what: &str) {
    let want = case.reference();
    let [table, rpi, start, lengths, loc] = case.tensors::<B>(device);
    match (
        crate::common::checked_assign::<B>(table, rpi, start, lengths, loc),
        &want,
    ) {
        (Ok(table), Ok(want)) => assert_eq!(&values::<B>(table), want, "{what}: checked table"),
        (Err(error), Err(want)) => assert_eq!(&error, want, "{what}: checked error"),
        (got, want) => panic!("{what}: checked gave {:?}, want {want:?}", got.map(drop)),
    }
    let [table, rpi, start, lengths, loc] = case.tensors::<B>(device);
    let assigned = generic::segment_assign::<B>(table, rpi, start, lengths, loc)
        .unwrap_or_else(|error| panic!("{what}: host rules pass, got {error}"));
    let table = values::<B>(assigned.req_to_token);
    match (assigned.status.check(), &want) {
        (Ok(count), Ok(want)) => {
            assert_eq!(count, case.loc.len(), "{what}: slots written");
            assert_eq!(&table, want, "{what}: deferred table");
        }
        (Err(error), Err(want)) => {
            assert_eq!(&error, want, "{what}: deferred error");
            assert_eq!(table, case.table, "{what}: the table after an error");
        }
        (got, want) => panic!("{what}: deferred gave {got:?}, want {want:?}"),
    }
}

/// A random valid case of `bs` requests on a `rows x cols` table: non-overlapping runs (rows
/// shared), padding requests, a poisoned table, slots that fit its dtype.
pub fn random_assign(rng: &mut Rng, bs: usize, rows: usize, cols: usize) -> AssignCase {
    let wide = rng.chance(1, 2);
    let table_dtype = if wide { DType::I64 } else { DType::I32 };
    let table = (0..rows * cols).map(|_| rng.i32_value()).collect();
    let mut taken = vec![false; rows * cols];
    let (mut rpi, mut start, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bs {
        let padding = rng.chance(1, 8);
        let row = if padding { 0 } else { rng.urange(1, rows - 1) };
        let first = rng.urange(0, cols);
        let mut length = if padding {
            0
        } else {
            rng.urange(0, (cols - first).min(9))
        };
        if let Some(at) = (0..length).position(|j| taken[row * cols + first + j]) {
            length = at;
        }
        for j in 0..length {
            taken[row * cols + first + j] = true;
        }
        rpi.push(row as i64);
        start.push(first as i64);
        lengths.push(length as i64);
    }
    let slots = lengths.iter().sum::<i64>() as usize;
    let most = if wide {
        1i64 << 45
    } else {
        i64::from(i32::MAX)
    };
    let loc: Vec<i64> = (0..slots)
        .map(|_| match rng.below(16) {
            0 => 0,
            1 => most,
            _ => rng.range(1, most),
        })
        .collect();
    let loc_dtype = if wide { DType::I64 } else { rng.int_dtype() };
    AssignCase {
        rows,
        cols,
        table,
        rpi,
        start,
        lengths,
        loc,
        dtypes: [
            table_dtype,
            rng.int_dtype(),
            rng.int_dtype(),
            rng.int_dtype(),
            loc_dtype,
        ],
    }
}

/// Breaks a valid case at random places: each value rule once, often several at a time, so that
/// the rule order and the first offender are compared with the reference.
pub fn broken(rng: &mut Rng, mut case: AssignCase) -> AssignCase {
    let bs = case.rpi.len();
    if bs == 0 {
        return case;
    }
    for _ in 0..rng.urange(1, 3) {
        let i = rng.urange(0, bs - 1);
        match rng.below(8) {
            0 => case.rpi[i] = rng.pick(&[-1, case.rows as i64, i64::MAX]),
            1 => {
                case.rpi[i] = 0;
                case.lengths[i] = case.lengths[i].max(1);
            }
            2 => case.lengths[i] = -rng.range(1, 3),
            3 => case.start[i] = rng.pick(&[-1, case.cols as i64 + 1, i64::MAX - 1]),
            4 => case.loc.push(7),
            5 if !case.loc.is_empty() => {
                let k = rng.urange(0, case.loc.len() - 1);
                case.loc[k] = rng.pick(&[-1, i64::MIN, case.slot_max().saturating_add(1)]);
            }
            _ => {
                // A conflict: request i copies an earlier request's row and start.
                let j = rng.urange(0, i.max(1) - 1);
                if case.lengths[j] > 0 && i != j {
                    case.rpi[i] = case.rpi[j];
                    case.start[i] = case.start[j];
                    case.lengths[i] = case.lengths[j];
                    case.loc = (0..case.lengths.iter().map(|&l| l.max(0)).sum::<i64>())
                        .map(|k| k + 1)
                        .collect();
                }
            }
        }
    }
    // Values past int32 need int64 lists.
    let narrow = |values: &[i64]| values.iter().all(|&v| v == v as i32 as i64);
    for (k, values) in [&case.rpi, &case.start, &case.lengths, &case.loc]
        .into_iter()
        .enumerate()
    {
        if !narrow(values) {
            case.dtypes[k + 1] = DType::I64;
        }
    }
    case
}

/// Random cases, valid and broken, small and past one tile of 256 requests (the conflict
/// rule's tiles, several requests per unit of the check cube), with thousands of slots.
pub fn random_assign_cases<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6173_7369_676e);
    for (bs, rows, cols) in [
        (0, 2, 4),
        (1, 2, 1),
        (5, 4, 6),
        (37, 9, 12),
        (300, 64, 16),
        (700, 40, 48),
    ] {
        for round in 0..4 {
            let case = random_assign(&mut rng, bs, rows, cols);
            run_assign::<B>(&case, device, &format!("bs {bs} round {round}"));
            let case = broken(&mut rng, case);
            run_assign::<B>(&case, device, &format!("bs {bs} round {round}, broken"));
        }
    }
}

/// `segment_assign` then `segment_gather` over the same runs gives back `out_cache_loc`, with
/// both statuses read in one `check_all`.
pub fn assign_then_gather<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x636f_6d70);
    for (bs, rows, cols) in [(3, 4, 8), (64, 70, 32), (513, 600, 24)] {
        let case = random_assign(&mut rng, bs, rows, cols);
        let [table, rpi, start, lengths, loc] = case.tensors::<B>(device);
        let assigned =
            generic::segment_assign::<B>(table, rpi.clone(), start.clone(), lengths.clone(), loc)
                .unwrap();
        let gathered = segment_gather::<B>(
            assigned.req_to_token,
            rpi,
            Some(start),
            lengths,
            &GatherOptions::new(),
        )
        .unwrap();
        let counts = kvplan::check_all([assigned.status, gathered.status]).unwrap();
        assert_eq!(counts, vec![case.loc.len(); 2], "bs {bs}: counts");
        let out = read_prefix::<B>(gathered.out, case.loc.len()).unwrap();
        assert_eq!(out, case.loc, "bs {bs}: gathered");
    }
}

fn small(rpi: &[i64], start: &[i64], lengths: &[i64], loc: &[i64]) -> AssignCase {
    AssignCase {
        rows: 4,
        cols: 6,
        table: (0..24).map(|k| 100 + k).collect(),
        rpi: rpi.to_vec(),
        start: start.to_vec(),
        lengths: lengths.to_vec(),
        loc: loc.to_vec(),
        dtypes: [DType::I32, DType::I64, DType::I64, DType::I64, DType::I64],
    }
}

/// Every value rule with its exact facts, both modes (through [`run_assign`], which also checks
/// the table is unchanged), on both index dtypes.
pub fn assign_value_errors<B: KvPlanBackend>(device: &B::Device) {
    let context = || ASSIGN.to_string();
    let cases = [
        (
            small(&[1, 4], &[0, 0], &[1, 0], &[5]),
            Error::ReqPoolIndexOutOfRange {
                context: context(),
                site: Site::Row(1),
                value: 4,
                rows: 4,
            },
        ),
        (
            small(&[1, 0], &[0, 0], &[1, 2], &[5, 6, 7]),
            Error::PaddingRowLength {
                context: context(),
                request: 1,
                length: 2,
            },
        ),
        (
            small(&[1, 2], &[0, 0], &[1, -2], &[5]),
            Error::NegativeLength {
                context: context(),
                request: 1,
                length: -2,
            },
        ),
        (
            small(&[1, 2], &[0, 4], &[2, 3], &[5, 6, 7, 8, 9]),
            Error::PositionOutOfRange {
                context: context(),
                site: Site::Cell(1, 2),
                position: 6,
                cols: 6,
            },
        ),
        (
            small(&[1], &[-2], &[1], &[5]),
            Error::PositionOutOfRange {
                context: context(),
                site: Site::Cell(0, 0),
                position: -2,
                cols: 6,
            },
        ),
        (
            small(&[1, 2], &[0, 0], &[2, 1], &[5, 6]),
            Error::SlotCountMismatch {
                context: context(),
                len: 2,
                sum: 3,
            },
        ),
        (
            small(&[1, 2], &[0, 3], &[2, 2], &[5, 6, 7, -3]),
            Error::SlotOutOfRange {
                context: context(),
                request: 1,
                column: 4,
                index: 3,
                slot: -3,
                max: i64::from(i32::MAX),
            },
        ),
        (
            small(&[2], &[1], &[2], &[5, 1 << 31]),
            Error::SlotOutOfRange {
                context: context(),
                request: 0,
                column: 2,
                index: 1,
                slot: 1 << 31,
                max: i64::from(i32::MAX),
            },
        ),
        (
            small(&[1, 2, 1], &[1, 0, 3], &[3, 1, 2], &[5, 6, 7, 8, 9, 10]),
            Error::WriteConflict {
                context: context(),
                request: 2,
                other: 0,
                row: 1,
                column: 3,
            },
        ),
    ];
    for (case, want) in cases {
        assert_eq!(case.reference(), Err(want.clone()), "the reference");
        for dtype in [DType::I32, DType::I64] {
            let mut case = case.clone();
            case.dtypes[1..4].fill(dtype);
            if case.loc.iter().all(|&slot| slot == slot as i32 as i64) {
                case.dtypes[4] = dtype;
            }
            run_assign::<B>(&case, device, &format!("{} ({dtype:?})", want.kind()));
        }
    }
}

/// Host rules: at once, in both modes.
pub fn assign_host_errors<B: KvPlanBackend>(device: &B::Device) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let table = || ints::<B, 2>(&(0..24).collect::<Vec<_>>(), [4, 6], DType::I32, device);
    let context = || ASSIGN.to_string();
    let expect = |got: Result<IntTensor<B>, Error>, want: Error| {
        assert_eq!(got.err(), Some(want), "checked");
    };
    let run = |t: IntTensor<B>, rpi, start, lengths, loc, want: Error| {
        let deferred = generic::segment_assign::<B>(
            t.clone(),
            IntTensor::<B>::clone(&rpi),
            IntTensor::<B>::clone(&start),
            IntTensor::<B>::clone(&lengths),
            IntTensor::<B>::clone(&loc),
        );
        assert_eq!(deferred.err(), Some(want.clone()), "deferred");
        expect(
            crate::common::checked_assign::<B>(t, rpi, start, lengths, loc),
            want,
        );
    };
    run(
        ints::<B, 1>(&[1, 2, 3], [3], DType::I32, device),
        l(&[1]),
        l(&[0]),
        l(&[1]),
        l(&[5]),
        Error::Not2d {
            context: context(),
            name: "req_to_token",
            shape: Dims(vec![3]),
        },
    );
    run(
        table(),
        ints::<B, 2>(&[1], [1, 1], DType::I64, device),
        l(&[0]),
        l(&[1]),
        l(&[5]),
        Error::Not1d {
            context: context(),
            name: "req_pool_indices",
            shape: Dims(vec![1, 1]),
        },
    );
    run(
        table(),
        l(&[1]),
        l(&[0]),
        l(&[1]),
        list::<B>(&[5], DType::U8, device),
        Error::DtypeMismatch {
            context: context(),
            name: "out_cache_loc",
            got: "uint8".into(),
            accepted: INT_DTYPES,
        },
    );
    run(
        table(),
        l(&[1, 2]),
        l(&[0, 0]),
        l(&[1, 1, 1]),
        l(&[5, 6]),
        Error::SegmentLengthMismatch {
            context: context(),
            name: "lengths",
            len: 3,
            bs: 2,
        },
    );
}

/// Value semantics and layouts: a clone the caller keeps is never written; a transposed table is
/// written through its strides; a broadcast table (every row one buffer) is copied first.
pub fn assign_layouts<B: KvPlanBackend>(device: &B::Device) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let data: Vec<i64> = (0..24).map(|k| 100 + k).collect();
    let table = ints::<B, 2>(&data, [4, 6], DType::I32, device);
    let kept = table.clone();
    let got =
        crate::common::checked_assign::<B>(table, l(&[2]), l(&[1]), l(&[2]), l(&[7, 8])).unwrap();
    let mut want = data.clone();
    want[13] = 7;
    want[14] = 8;
    assert_eq!(values::<B>(got), want, "assigned");
    assert_eq!(values::<B>(kept), data, "the caller's clone");

    // [6, 4] transposed to [4, 6]: cell (r, c) lives at c * 4 + r.
    let transposed = int_transpose::<B>(ints::<B, 2>(&data, [6, 4], DType::I64, device));
    let got =
        crate::common::checked_assign::<B>(transposed, l(&[3]), l(&[4]), l(&[2]), l(&[9, 10]))
            .unwrap();
    let mut want: Vec<i64> = (0..24).map(|k| data[(k % 6) * 4 + k / 6]).collect();
    want[3 * 6 + 4] = 9;
    want[3 * 6 + 5] = 10;
    assert_eq!(values::<B>(got), want, "a transposed table");

    // One row broadcast to four: only row 1 changes.
    let row = ints::<B, 2>(&data[..6], [1, 6], DType::I32, device);
    let broadcast = int_expand::<B, 2>(row, [4, 6]);
    let got =
        crate::common::checked_assign::<B>(broadcast, l(&[1]), l(&[0]), l(&[1]), l(&[55])).unwrap();
    let mut want: Vec<i64> = (0..24).map(|k| data[k % 6]).collect();
    want[6] = 55;
    assert_eq!(values::<B>(got), want, "a broadcast table");
}

// ---- store_kv ----

/// A cache or rows of `dtype`, as exact f64 values.
#[derive(Debug, Clone)]
pub struct Rows {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl Rows {
    pub fn random(rng: &mut Rng, dtype: DType, shape: Vec<usize>) -> Self {
        let data = (0..shape.iter().product::<usize>())
            .map(|_| element(rng, dtype))
            .collect();
        Self { dtype, shape, data }
    }

    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    fn data(&self) -> TensorData {
        if self.dtype.is_float() {
            TensorData::new(self.data.clone(), self.shape.clone()).convert_dtype(self.dtype)
        } else {
            let ints: Vec<i64> = self.data.iter().map(|&v| v as i64).collect();
            TensorData::new(ints, self.shape.clone()).convert_dtype(self.dtype)
        }
    }

    /// The values' bytes in the dtype.
    pub fn bytes(&self) -> Vec<u8> {
        self.data().bytes().to_vec()
    }

    pub fn primitive<B: KvPlanBackend>(&self, device: &B::Device) -> KvRows<B> {
        if self.dtype.is_float() {
            KvRows::Float(B::float_from_data(self.data(), device))
        } else if self.shape.contains(&0) {
            KvRows::Int(B::int_empty(
                self.shape.clone().into(),
                device,
                self.dtype.into(),
            ))
        } else {
            KvRows::Int(B::int_from_data(self.data(), device))
        }
    }
}

/// A value of `dtype` that f64 and the dtype both hold exactly.
pub fn element(rng: &mut Rng, dtype: DType) -> f64 {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => rng.range(-120, 120) as f64 / 4.0,
        DType::U8 => rng.range(0, 255) as f64,
        DType::I16 => rng.range(-30_000, 30_000) as f64,
        DType::I32 => rng.i32_value() as f64,
        _ => rng.range(-(1 << 52), 1 << 52) as f64,
    }
}

/// The bytes of a cache, read back.
pub fn read_bytes<B: KvPlanBackend>(rows: KvRows<B>) -> Vec<u8> {
    let data = match rows {
        KvRows::Float(tensor) => read_sync(B::float_into_data(tensor)),
        KvRows::Int(tensor) => read_sync(B::int_into_data(tensor)),
    };
    data.expect("a cache read-back").bytes().to_vec()
}

/// One store call against the reference, through `mode` (checked or deferred): the whole cache
/// after it (`cache` is updated), or the exact error and the cache unchanged.
#[track_caller]
pub fn run_store<B: KvPlanBackend>(
    store: &mut KvStore<B>,
    current: KvRows<B>,
    cache: &mut Rows,
    loc: &[i64],
    values: &Rows,
    deferred: bool,
    device: &B::Device,
    what: &str,
) -> KvRows<B> {
    let mut want = cache.data.clone();
    let outcome = store_kv(
        &mut want,
        [cache.shape[0], cache.row_len()],
        loc,
        &values.data,
        STORE,
    );
    let loc_dtype = if loc.iter().all(|&slot| slot == slot as i32 as i64) && loc.len() % 2 == 0 {
        DType::I32
    } else {
        DType::I64
    };
    let loc = list::<B>(loc, loc_dtype, device);
    let failing = outcome.is_err();
    // The checked form consumes the cache on `Err`: a failing call is handed a clone.
    let kept = failing.then(|| current.clone());
    let got = if deferred {
        let stored = generic::store::<B>(store, current, loc, values.primitive(device))
            .unwrap_or_else(|error| panic!("{what}: host rules pass, got {error}"));
        (stored.cache, stored.status.check())
    } else {
        match crate::common::checked_store::<B>(store, current, loc, values.primitive(device)) {
            Ok(cache) => (cache, Ok(values.shape[0])),
            Err(error) => (kept.expect("a failing call keeps its cache"), Err(error)),
        }
    };
    match (got.1, outcome) {
        (Ok(count), Ok(want_count)) => {
            assert_eq!(count, want_count, "{what}: stored");
            cache.data = want;
        }
        (Err(error), Err(want_error)) => assert_eq!(error, want_error, "{what}: error"),
        (got, want) => panic!("{what}: got {got:?}, want {want:?}"),
    }
    assert_cache::<B>(got.0.clone(), cache, what);
    got.0
}

/// Every byte of a cache on the device against `cache`.
#[track_caller]
fn assert_cache<B: KvPlanBackend>(got: KvRows<B>, cache: &Rows, what: &str) {
    let bytes = read_bytes::<B>(got);
    let want = cache.bytes();
    if let Some(at) = (0..want.len()).find(|&at| bytes.get(at) != Some(&want[at])) {
        let size = cache.dtype.size();
        panic!(
            "{what}: cache element {} (slot {}) differs ({} bytes long, want {})",
            at / size,
            at / size / cache.row_len().max(1),
            bytes.len(),
            want.len()
        );
    }
    assert_eq!(bytes.len(), want.len(), "{what}: cache bytes");
}

/// Random calls of up to `tokens` tokens: distinct slots but 0, padding tokens on slot 0, and,
/// with `broken`, a slot outside the cache or a duplicate far from its first (other cubes).
pub fn random_loc(rng: &mut Rng, slots: usize, tokens: usize, broken: bool) -> Vec<i64> {
    let mut free: Vec<i64> = (1..slots as i64).collect();
    rng.shuffle(&mut free);
    let n = rng.urange(0, tokens.min(free.len() + 4));
    let mut loc: Vec<i64> = (0..n)
        .map(|_| match free.pop() {
            Some(slot) if !rng.chance(1, 9) => slot,
            _ => 0,
        })
        .collect();
    if broken && n > 1 {
        let (i, j) = (rng.urange(0, n / 2), rng.urange(n / 2 + 1, n).min(n - 1));
        match rng.below(3) {
            0 => loc[j] = rng.pick(&[-1, slots as i64, i64::MAX]),
            _ => loc[j] = loc[i].max(1),
        }
        if rng.chance(1, 2) && j > i + 1 {
            // A second duplicate, earlier: it is the one reported.
            loc[i + 1] = loc[i].max(1);
        }
    }
    loc
}

/// Random stores against the reference: one store shared by two caches (K and V), calls in
/// sequence (slots reused across calls), every dtype, rows of odd widths, and calls of thousands
/// of tokens (a check over many cubes), valid and broken; each call checked, deferred, or through
/// checked slots (K and V in one launch, or one launch each).
pub fn random_stores<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x7374_6f72_6573);
    let dtypes = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I16,
    ];
    for (slots, tokens, widths) in [
        (1, 3, [1, 1]),
        (9, 12, [3, 8]),
        (64, 40, [5, 64]),
        (5000, 3000, [2, 12]),
    ] {
        for mode in [Mode::Checked, Mode::Deferred, Mode::Slots] {
            let mut store = KvStore::<B>::allocate_on(slots + 3, device).unwrap();
            let dtype = rng.pick(&dtypes);
            let width = rng.pick(&widths);
            let mut k = Rows::random(&mut rng, dtype, vec![slots, width]);
            let mut v = Rows::random(&mut rng, DType::F32, vec![slots, 2, 3]);
            let (mut k_now, mut v_now) = (k.primitive::<B>(device), v.primitive::<B>(device));
            for call in 0..6 {
                let broken = call % 3 == 2;
                let loc = random_loc(&mut rng, slots, tokens, broken);
                let what = format!("S {slots} {dtype:?}x{width} call {call} {mode:?}");
                let k_rows = Rows::random(&mut rng, dtype, vec![loc.len(), width]);
                let v_rows = Rows::random(&mut rng, DType::F32, vec![loc.len(), 2, 3]);
                if mode == Mode::Slots {
                    let pair = call % 2 == 0;
                    (k_now, v_now) = run_slot_stores::<B>(
                        &mut store,
                        [k_now, v_now],
                        [&mut k, &mut v],
                        &loc,
                        [&k_rows, &v_rows],
                        pair,
                        device,
                        &what,
                    );
                    continue;
                }
                let deferred = mode == Mode::Deferred;
                k_now = run_store::<B>(
                    &mut store, k_now, &mut k, &loc, &k_rows, deferred, device, &what,
                );
                v_now = run_store::<B>(
                    &mut store, v_now, &mut v, &loc, &v_rows, deferred, device, &what,
                );
            }
        }
    }
}

/// How a random store call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Checked,
    Deferred,
    Slots,
}

/// K and V stored at `loc` through slots checked once, in one launch (`pair`) or one each, against
/// the reference: both caches after it (`caches` are updated), or the exact error and both
/// caches unchanged.
#[track_caller]
#[allow(clippy::too_many_arguments)]
fn run_slot_stores<B: KvPlanBackend>(
    store: &mut KvStore<B>,
    [k_now, v_now]: [KvRows<B>; 2],
    mut caches: [&mut Rows; 2],
    loc: &[i64],
    rows: [&Rows; 2],
    pair: bool,
    device: &B::Device,
    what: &str,
) -> (KvRows<B>, KvRows<B>) {
    let mut wants = Vec::new();
    let mut outcome = Ok(loc.len());
    for (cache, rows) in caches.iter().zip(rows) {
        let mut want = cache.data.clone();
        outcome = store_kv(
            &mut want,
            [cache.shape[0], cache.row_len()],
            loc,
            &rows.data,
            STORE,
        );
        wants.push(want);
    }
    let cache_rows = caches[0].shape[0];
    let mut slots = store
        .check_slot_primitives(list::<B>(loc, DType::I64, device), cache_rows)
        .unwrap_or_else(|error| panic!("{what}: host rules pass, got {error}"));
    let (k_rows, v_rows) = (rows[0].primitive(device), rows[1].primitive(device));
    let (k_now, v_now) = if pair {
        let stored = slots
            .store_primitives(
                StoreTargets::Pair(k_now, v_now),
                StoreTargets::Pair(k_rows, v_rows),
            )
            .unwrap_or_else(|error| panic!("{what}: host rules pass, got {error}"));
        match stored {
            StoreTargets::Pair(k, v) => (k, v),
            StoreTargets::One(_) => panic!("{what}: a pair comes back as a pair"),
        }
    } else {
        let mut one = |cache: KvRows<B>, rows: KvRows<B>| match slots
            .store_primitives(StoreTargets::One(cache), StoreTargets::One(rows))
        {
            Ok(StoreTargets::One(cache)) => cache,
            other => panic!("{what}: one cache back, got {other:?}"),
        };
        (one(k_now, k_rows), one(v_now, v_rows))
    };
    match (slots.status().check(), outcome) {
        (Ok(count), Ok(want_count)) => {
            assert_eq!(count, want_count, "{what}: stored");
            for (cache, want) in caches.iter_mut().zip(wants) {
                cache.data = want;
            }
        }
        (Err(error), Err(want_error)) => assert_eq!(error, want_error, "{what}: error"),
        (got, want) => panic!("{what}: got {got:?}, want {want:?}"),
    }
    assert_cache::<B>(k_now.clone(), caches[0], &format!("{what}, K"));
    assert_cache::<B>(v_now.clone(), caches[1], &format!("{what}, V"));
    (k_now, v_now)
}

/// A store's value rules on a cache of 8 slots: each `loc` with its exact error.
fn value_errors() -> [(Vec<i64>, Error); 2] {
    [
        (
            vec![3, 9, -1],
            Error::LocOutOfRange {
                context: STORE.into(),
                index: 1,
                slot: 9,
                slots: 8,
            },
        ),
        (
            vec![0, 3, 0, 5, 3, 5],
            Error::DuplicateSlot {
                context: STORE.into(),
                index: 4,
                first: 1,
                slot: 3,
            },
        ),
    ]
}

/// Host rules of a store, at once in both forms, and a cache (a clone the caller keeps) never
/// written by a failing or a succeeding store.
pub fn store_errors<B: KvPlanBackend>(device: &B::Device) {
    let context = || STORE.to_string();
    let mut rng = Rng::new(0x6572_7273);
    let cache = Rows::random(&mut rng, DType::F32, vec![8, 4]);
    let rows = |n: usize| Rows::random(&mut Rng::new(n as u64), DType::F32, vec![n, 4]);
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let mut store = KvStore::<B>::allocate_on(8, device).unwrap();
    let host = |loc: IntTensor<B>, values: KvRows<B>, want: Error, store: &mut KvStore<B>| {
        let got = generic::store::<B>(store, cache.primitive(device), loc.clone(), values.clone());
        assert_eq!(got.err(), Some(want.clone()), "deferred");
        let got = generic::store::<B>(store, cache.primitive(device), loc, values);
        assert_eq!(got.err(), Some(want), "checked");
    };
    host(
        l(&[1, 2]),
        rows(3).primitive(device),
        Error::ValueShapeMismatch {
            context: context(),
            values: Dims(vec![3, 4]),
            expected: Dims(vec![2, 4]),
            cache: Dims(vec![8, 4]),
        },
        &mut store,
    );
    host(
        ints::<B, 2>(&[1, 2], [2, 1], DType::I64, device),
        rows(2).primitive(device),
        Error::Not1d {
            context: context(),
            name: "loc",
            shape: Dims(vec![2, 1]),
        },
        &mut store,
    );
    host(
        list::<B>(&[1], DType::I16, device),
        rows(1).primitive(device),
        Error::DtypeMismatch {
            context: context(),
            name: "loc",
            got: "int16".into(),
            accepted: INT_DTYPES,
        },
        &mut store,
    );
    host(
        l(&[1]),
        Rows::random(&mut rng, DType::I32, vec![1, 4]).primitive(device),
        Error::ValueDtypeMismatch {
            context: context(),
            values: "int32".into(),
            cache: "f32".into(),
        },
        &mut store,
    );
    let mut small = KvStore::<B>::allocate_on(6, device).unwrap();
    host(
        l(&[1]),
        rows(1).primitive(device),
        Error::StoreCapacity {
            context: context(),
            slots: 8,
            capacity: 6,
        },
        &mut small,
    );
    // Value rules with their facts; the caller's clone is never written.
    let primitive = cache.primitive::<B>(device);
    for (loc, want) in value_errors() {
        let stored = generic::store::<B>(
            &mut store,
            primitive.clone(),
            l(&loc),
            rows(loc.len()).primitive(device),
        )
        .unwrap();
        assert_eq!(stored.status.check(), Err(want.clone()), "deferred");
        assert_eq!(read_bytes::<B>(stored.cache), cache.bytes(), "unchanged");
        let got = crate::common::checked_store::<B>(
            &mut store,
            primitive.clone(),
            l(&loc),
            rows(loc.len()).primitive(device),
        );
        assert_eq!(got.err(), Some(want), "checked");
    }
    let stored = crate::common::checked_store::<B>(
        &mut store,
        primitive.clone(),
        l(&[2]),
        rows(1).primitive(device),
    )
    .unwrap();
    let mut want = cache.clone();
    want.data[8..12].copy_from_slice(&rows(1).data);
    assert_eq!(read_bytes::<B>(stored), want.bytes(), "stored");
    assert_eq!(
        read_bytes::<B>(primitive),
        cache.bytes(),
        "the caller's clone"
    );
}

/// Host and value rules of stores through checked slots: the check's rules at once, each
/// cache's at its store (naming the cache), and a value error in the slots keeping every cache
/// stored through them unchanged.
pub fn slot_store_errors<B: KvPlanBackend>(device: &B::Device) {
    let context = || STORE.to_string();
    let mut rng = Rng::new(0x736c_6f74);
    let k = Rows::random(&mut rng, DType::F32, vec![8, 4]);
    let v = Rows::random(&mut rng, DType::F32, vec![8, 2]);
    let rows =
        |n: usize, width: usize| Rows::random(&mut Rng::new(n as u64), DType::F32, vec![n, width]);
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let mut store = KvStore::<B>::allocate_on(8, device).unwrap();
    let check = |store: &mut KvStore<B>, loc: IntTensor<B>, cache_rows: usize| {
        store.check_slot_primitives(loc, cache_rows).err()
    };
    assert_eq!(
        check(&mut store, l(&[1]), 9),
        Some(Error::StoreCapacity {
            context: context(),
            slots: 9,
            capacity: 8,
        })
    );
    assert_eq!(
        check(
            &mut store,
            ints::<B, 2>(&[1, 2], [2, 1], DType::I64, device),
            8
        ),
        Some(Error::Not1d {
            context: context(),
            name: "loc",
            shape: Dims(vec![2, 1]),
        })
    );
    assert_eq!(
        check(&mut store, list::<B>(&[1], DType::I16, device), 8),
        Some(Error::DtypeMismatch {
            context: context(),
            name: "loc",
            got: "int16".into(),
            accepted: INT_DTYPES,
        })
    );
    let pair = |k: KvRows<B>, v: KvRows<B>| StoreTargets::Pair(k, v);
    let mut slots = store.check_slot_primitives(l(&[1, 2]), 8).unwrap();
    let short = Rows::random(&mut rng, DType::F32, vec![7, 2]);
    for (caches, values, want) in [
        (
            pair(k.primitive(device), short.primitive(device)),
            pair(rows(2, 4).primitive(device), rows(2, 2).primitive(device)),
            Error::CacheRowsMismatch {
                context: context(),
                name: "v_cache",
                cache: Dims(vec![7, 2]),
                cache_rows: 8,
            },
        ),
        (
            StoreTargets::One(k.primitive(device)),
            pair(rows(2, 4).primitive(device), rows(2, 2).primitive(device)),
            Error::StoreTargetsMismatch {
                context: context(),
                caches: 1,
                values: 2,
            },
        ),
        (
            pair(k.primitive(device), v.primitive(device)),
            pair(rows(3, 4).primitive(device), rows(2, 2).primitive(device)),
            Error::ValueShapeMismatch {
                context: context(),
                values: Dims(vec![3, 4]),
                expected: Dims(vec![2, 4]),
                cache: Dims(vec![8, 4]),
            },
        ),
        (
            pair(k.primitive(device), v.primitive(device)),
            pair(
                rows(2, 4).primitive(device),
                Rows::random(&mut rng, DType::I32, vec![2, 2]).primitive(device),
            ),
            Error::ValueDtypeMismatch {
                context: context(),
                values: "int32".into(),
                cache: "f32".into(),
            },
        ),
    ] {
        assert_eq!(slots.store_primitives(caches, values).err(), Some(want));
    }
    // Host errors leave the slots as they were: a valid store through them still runs.
    let (k_rows, v_rows) = (rows(2, 4), rows(2, 2));
    let (k_clone, v_clone) = (k.primitive::<B>(device), v.primitive::<B>(device));
    let stored = slots
        .store_primitives(
            pair(k_clone.clone(), v_clone.clone()),
            pair(k_rows.primitive(device), v_rows.primitive(device)),
        )
        .unwrap();
    assert_eq!(slots.status().check(), Ok(2));
    let StoreTargets::Pair(k_now, v_now) = stored else {
        panic!("a pair comes back as a pair");
    };
    let (mut k_want, mut v_want) = (k.clone(), v.clone());
    k_want.data[4..12].copy_from_slice(&k_rows.data);
    v_want.data[2..6].copy_from_slice(&v_rows.data);
    assert_cache::<B>(k_now, &k_want, "K stored");
    assert_cache::<B>(v_now, &v_want, "V stored");
    assert_cache::<B>(k_clone, &k, "the caller's K clone");
    assert_cache::<B>(v_clone, &v, "the caller's V clone");

    // Value rules: found by the check, every store through the slots leaves its caches as they
    // were, and the status keeps the check's error.
    for (loc, want) in value_errors() {
        let mut slots = store.check_slot_primitives(l(&loc), 8).unwrap();
        let n = loc.len();
        let stored = slots
            .store_primitives(
                pair(k.primitive(device), v.primitive(device)),
                pair(rows(n, 4).primitive(device), rows(n, 2).primitive(device)),
            )
            .unwrap();
        let StoreTargets::Pair(k_now, v_now) = stored else {
            panic!("a pair comes back as a pair");
        };
        let stored = slots
            .store_primitives(
                StoreTargets::One(k.primitive(device)),
                StoreTargets::One(rows(n, 4).primitive(device)),
            )
            .unwrap();
        let StoreTargets::One(k_one) = stored else {
            panic!("one cache comes back as one");
        };
        assert_eq!(slots.status().check(), Err(want), "{loc:?}");
        assert_cache::<B>(k_now, &k, "K unchanged");
        assert_cache::<B>(v_now, &v, "V unchanged");
        assert_cache::<B>(k_one, &k, "K unchanged, one cache");
    }
}

/// Strided rows: `values` a transposed view (copied to rows first) and a slice of a larger
/// tensor (read in place), and a 1-D cache (one element per slot).
pub fn store_layouts<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6c61_796f);
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let mut store = KvStore::<B>::allocate_on(16, device).unwrap();
    let cache = Rows::random(&mut rng, DType::I32, vec![16, 3]);
    // [3, 2] transposed: the rows are [2, 3].
    let source: Vec<i64> = (0..6).map(|k| 1000 + k).collect();
    let values = KvRows::Int(int_transpose::<B>(ints::<B, 2>(
        &source,
        [3, 2],
        DType::I32,
        device,
    )));
    let got =
        crate::common::checked_store::<B>(&mut store, cache.primitive(device), l(&[4, 9]), values)
            .unwrap();
    let mut want = cache.clone();
    for (slot, i) in [(4, 0), (9, 1)] {
        for c in 0..3 {
            want.data[slot * 3 + c] = source[c * 2 + i] as f64;
        }
    }
    assert_eq!(read_bytes::<B>(got), want.bytes(), "transposed values");
    // Rows 2..4 of a [5, 3] tensor.
    let big: Vec<i64> = (0..15).map(|k| 2000 + k).collect();
    let slice = crate::common::int_slice::<B>(
        ints::<B, 2>(&big, [5, 3], DType::I32, device),
        &[2..4, 0..3],
    );
    let got = crate::common::checked_store::<B>(
        &mut store,
        want.primitive(device),
        l(&[1, 0]),
        KvRows::Int(slice),
    )
    .unwrap();
    for (slot, row) in [(1, 2), (0, 3)] {
        for c in 0..3 {
            want.data[slot * 3 + c] = big[row * 3 + c] as f64;
        }
    }
    assert_eq!(read_bytes::<B>(got), want.bytes(), "sliced values");
    // One value per slot.
    let flat = Rows::random(&mut rng, DType::F16, vec![16]);
    let values = Rows::random(&mut rng, DType::F16, vec![3]);
    let got = crate::common::checked_store::<B>(
        &mut store,
        flat.primitive(device),
        l(&[0, 15, 0]),
        values.primitive(device),
    )
    .unwrap();
    let mut want = flat.clone();
    want.data[15] = values.data[1];
    want.data[0] = values.data[2];
    assert_eq!(read_bytes::<B>(got), want.bytes(), "a 1-D cache");
}

/// The clock: a store near the end of its clock range starts again from zeroed words, after which
/// duplicates are still found and earlier claims are not taken for duplicates.
pub fn store_clock<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x636c_6f63);
    let mut store = KvStore::<B>::allocate_on(32, device).unwrap();
    let mut cache = Rows::random(&mut rng, DType::F32, vec![32, 2]);
    let mut now = cache.primitive::<B>(device);
    for (k, (loc, skip)) in [
        (vec![1, 2, 3], 0u64),
        (vec![3, 4], (1 << 31) - 6),
        (vec![5, 1, 2, 6], 0),
        (vec![7, 8, 7], 0),
        (vec![1, 2, 3, 4, 5, 6, 7, 8], 0),
    ]
    .into_iter()
    .enumerate()
    {
        store.advance_clock(skip);
        let values = Rows::random(&mut rng, DType::F32, vec![loc.len(), 2]);
        now = run_store::<B>(
            &mut store,
            now,
            &mut cache,
            &loc,
            &values,
            true,
            device,
            &format!("call {k}"),
        );
    }
}

/// `device_mismatch` of both ops.
pub fn device_errors<B: KvPlanBackend>(device: &B::Device, other: &B::Device) {
    let want = |context: &str, name: &'static str| Error::DeviceMismatch {
        context: context.into(),
        name,
        device: format!("{other:?}"),
        expected: format!("{device:?}"),
    };
    let l = |values: &[i64], on: &B::Device| list::<B>(values, DType::I64, on);
    let table = ints::<B, 2>(&[0; 24], [4, 6], DType::I32, device);
    let got = generic::segment_assign::<B>(
        table,
        l(&[1], device),
        l(&[0], device),
        l(&[1], device),
        l(&[5], other),
    );
    assert_eq!(got.err(), Some(want(ASSIGN, "out_cache_loc")));
    let mut store = KvStore::<B>::allocate_on(8, device).unwrap();
    let cache = Rows::random(&mut Rng::new(1), DType::F32, vec![8, 2]);
    let values = Rows::random(&mut Rng::new(2), DType::F32, vec![1, 2]);
    let got = generic::store::<B>(
        &mut store,
        cache.primitive(device),
        l(&[1], other),
        values.primitive(device),
    );
    assert_eq!(got.err(), Some(want(STORE, "loc")));
    // Everything on the other device but the store (its scratch).
    let got = generic::store::<B>(
        &mut store,
        cache.primitive(other),
        l(&[1], other),
        values.primitive(other),
    );
    assert_eq!(got.err(), Some(want(STORE, "loc")));
    let got = store.check_slot_primitives(l(&[1], other), 8);
    assert_eq!(got.err(), Some(want(STORE, "loc")));
    let mut slots = store.check_slot_primitives(l(&[1], device), 8).unwrap();
    let got = slots.store_primitives(
        StoreTargets::Pair(cache.primitive(device), cache.primitive(device)),
        StoreTargets::Pair(values.primitive(device), values.primitive(other)),
    );
    assert_eq!(got.err(), Some(want(STORE, "v")));
}

/// `index_range` end to end (in the narrow-device child, 32-bit launches spanning `span`
/// elements): both ops over tensors past the span are refused through their status and hand
/// their table or cache back unchanged.
#[cfg(feature = "vulkan")]
pub fn narrow_checks<B: KvPlanBackend>(device: &B::Device, span: usize) {
    let refused = |got: Result<usize, Error>, what: &str| match got {
        Err(Error::IndexRange { elements, limit }) => {
            assert_eq!(limit, span as u64, "{what}: limit");
            assert!(elements > span as u64, "{what}: {elements} elements");
        }
        other => panic!("{what}: expected index_range, got {other:?}"),
    };
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let table = ints::<B, 2>(&vec![7; 2 * span], [2, span], DType::I32, device);
    let assigned = generic::segment_assign::<B>(table, l(&[1]), l(&[0]), l(&[2]), l(&[5, 6]))
        .expect("host rules pass: the refusal is the launch's");
    refused(assigned.status.check(), "segment_assign");
    assert_eq!(
        values::<B>(assigned.req_to_token),
        vec![7; 2 * span],
        "table unchanged"
    );
    let mut store = KvStore::<B>::allocate_on(span, device).unwrap();
    let cache = Rows::random(&mut Rng::new(3), DType::F32, vec![span, 2]);
    let rows = Rows::random(&mut Rng::new(4), DType::F32, vec![1, 2]);
    let stored = generic::store::<B>(
        &mut store,
        cache.primitive(device),
        l(&[1]),
        rows.primitive(device),
    )
    .expect("host rules pass: the refusal is the launch's");
    refused(stored.status.check(), "store_kv");
    assert_eq!(
        read_bytes::<B>(stored.cache),
        cache.bytes(),
        "cache unchanged"
    );
    // Slots within the span pass their check; a write into a cache past it is refused by the
    // write, which leaves both caches unchanged, and so is every later write through the slots.
    let mut slots = store.check_slot_primitives(l(&[1]), span).unwrap();
    let k = Rows::random(&mut Rng::new(5), DType::F32, vec![span, 1]);
    let stored = slots
        .store_primitives(
            StoreTargets::Pair(k.primitive(device), cache.primitive(device)),
            StoreTargets::Pair(
                Rows::random(&mut Rng::new(6), DType::F32, vec![1, 1]).primitive(device),
                rows.primitive(device),
            ),
        )
        .expect("host rules pass: the refusal is the launch's");
    let StoreTargets::Pair(k_now, v_now) = stored else {
        panic!("a pair comes back as a pair");
    };
    assert_cache::<B>(k_now, &k, "K unchanged");
    assert_cache::<B>(v_now, &cache, "V unchanged");
    let stored = slots
        .store_primitives(
            StoreTargets::One(k.primitive(device)),
            StoreTargets::One(
                Rows::random(&mut Rng::new(7), DType::F32, vec![1, 1]).primitive(device),
            ),
        )
        .unwrap();
    let StoreTargets::One(k_now) = stored else {
        panic!("one cache comes back as one");
    };
    assert_cache::<B>(k_now, &k, "K unchanged by a later store");
    refused(slots.status().check(), "a store through checked slots");
    // Within the span both run.
    let small = ints::<B, 2>(&[0; 8], [2, 4], DType::I32, device);
    let got =
        crate::common::checked_assign::<B>(small, l(&[1]), l(&[1]), l(&[2]), l(&[5, 6])).unwrap();
    assert_eq!(values::<B>(got), vec![0, 0, 0, 0, 0, 5, 6, 0]);
}
