//! Masked and segment gather through the backend API (`kvplan::generic`, the form the
//! `Tensor` API runs on `Dispatch`), against the host reference.

use burn_core::backend::TensorMetadata;
use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::tensor::DType;
use kvplan::generic;
use kvplan::ops::{GatherOptions, Gathered};
use kvplan::reference::{self, Table};
use kvplan::{Error, KvPlanBackend};
use kvplan_tools::prim::read_prefix;

use crate::common::{
    Rng, bool_slice, bool_slice_assign, bool_transpose, bool_values, bools, dims, int_expand,
    int_slice, int_slice_assign, int_transpose, ints, list, values,
};

pub const CTX: &str = "DFLASH target hidden KV append";
/// The fixed context of segment-gather errors (the library's `SEGMENT_CONTEXT`).
pub const SEGMENT_CONTEXT: &str = "DFLASH req_to_token segment gather";

/// The options of a masked gather: context `CTX`, the given capacity or the default.
pub fn options(capacity: Option<usize>) -> GatherOptions {
    let options = GatherOptions::new().context(CTX);
    match capacity {
        Some(capacity) => options.capacity(capacity),
        None => options,
    }
}

/// The options of a segment gather (no context: segments use the spec's own).
pub fn segment_options(capacity: Option<usize>) -> GatherOptions {
    match capacity {
        Some(capacity) => GatherOptions::new().capacity(capacity),
        None => GatherOptions::new(),
    }
}

/// Masked gather, exact mode (the old `masked_gather(.., CTX)`).
pub fn masked<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    pos2d: IntTensor<B>,
    mask: BoolTensor<B>,
) -> Result<IntTensor<B>, Error> {
    generic::masked_gather::<B>(table, rpi, pos2d, mask, &options(None)).and_then(generic::exact)
}

/// Masked gather, deferred mode with `capacity` (`None`: the default `R * C`).
pub fn masked_deferred<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    pos2d: IntTensor<B>,
    mask: BoolTensor<B>,
    capacity: Option<usize>,
) -> Result<Gathered<B>, Error> {
    generic::masked_gather::<B>(table, rpi, pos2d, mask, &options(capacity))
}

/// Segment gather, exact mode.
pub fn segments<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    start: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
) -> Result<IntTensor<B>, Error> {
    generic::segment_gather::<B>(table, rpi, start, lengths, &segment_options(None))
        .and_then(generic::exact)
}

/// Segment gather, deferred mode with `capacity` (`None`: the default `S * cols`).
pub fn segments_deferred<B: KvPlanBackend>(
    table: IntTensor<B>,
    rpi: IntTensor<B>,
    start: Option<IntTensor<B>>,
    lengths: IntTensor<B>,
    capacity: Option<usize>,
) -> Result<Gathered<B>, Error> {
    generic::segment_gather::<B>(table, rpi, start, lengths, &segment_options(capacity))
}

/// One masked gather: host data plus the dtypes of the three int inputs.
#[derive(Debug, Clone)]
pub struct MaskedCase {
    pub rows: usize,
    pub cols: usize,
    pub table: Vec<i64>,
    pub rpi: Vec<i64>,
    pub r: usize,
    pub c: usize,
    pub pos2d: Vec<i64>,
    pub mask: Vec<bool>,
    pub dtypes: [DType; 3],
}

impl MaskedCase {
    pub fn reference(&self, capacity: Option<usize>) -> Result<Vec<i64>, Error> {
        reference::masked_gather(
            Table::new(self.rows, self.cols, &self.table),
            &self.rpi,
            &self.pos2d,
            &self.mask,
            [self.r, self.c],
            capacity,
            CTX,
        )
    }

    pub fn tensors<B: KvPlanBackend>(
        &self,
        device: &B::Device,
    ) -> (IntTensor<B>, IntTensor<B>, IntTensor<B>, BoolTensor<B>) {
        (
            ints::<B, 2>(&self.table, [self.rows, self.cols], self.dtypes[0], device),
            list::<B>(&self.rpi, self.dtypes[1], device),
            ints::<B, 2>(&self.pos2d, [self.r, self.c], self.dtypes[2], device),
            bools::<B, 2>(&self.mask, [self.r, self.c], device),
        )
    }
}

/// One segment gather.
#[derive(Debug, Clone)]
pub struct SegmentCase {
    pub rows: usize,
    pub cols: usize,
    pub table: Vec<i64>,
    pub rpi: Vec<i64>,
    pub start: Option<Vec<i64>>,
    pub lengths: Vec<i64>,
    pub dtypes: [DType; 4],
}

impl SegmentCase {
    pub fn reference(&self, capacity: Option<usize>) -> Result<Vec<i64>, Error> {
        reference::segment_gather(
            Table::new(self.rows, self.cols, &self.table),
            &self.rpi,
            self.start.as_deref(),
            &self.lengths,
            capacity,
        )
    }

    #[allow(clippy::type_complexity)]
    pub fn tensors<B: KvPlanBackend>(
        &self,
        device: &B::Device,
    ) -> (
        IntTensor<B>,
        IntTensor<B>,
        Option<IntTensor<B>>,
        IntTensor<B>,
    ) {
        (
            ints::<B, 2>(&self.table, [self.rows, self.cols], self.dtypes[0], device),
            list::<B>(&self.rpi, self.dtypes[1], device),
            self.start
                .as_ref()
                .map(|start| list::<B>(start, self.dtypes[2], device)),
            list::<B>(&self.lengths, self.dtypes[3], device),
        )
    }

    pub fn default_capacity(&self) -> usize {
        self.lengths.len() * self.cols
    }
}

/// Exact mode against the reference (values and shape, or the exact error).
#[track_caller]
pub fn check_exact<B: KvPlanBackend>(
    got: Result<IntTensor<B>, Error>,
    want: &Result<Vec<i64>, Error>,
    what: &str,
) {
    match (got, want) {
        (Ok(out), Ok(want)) => {
            assert_eq!(dims(&out), [want.len()], "{what}: exact-mode shape");
            assert_eq!(out.dtype(), DType::I64, "{what}: exact-mode dtype");
            assert_eq!(&values::<B>(out), want, "{what}: exact-mode values");
        }
        (Err(error), Err(want)) => assert_eq!(&error, want, "{what}: exact-mode error"),
        (Ok(out), Err(want)) => {
            panic!("{what}: expected {want:?}, got Ok({:?})", values::<B>(out))
        }
        (Err(error), Ok(_)) => panic!("{what}: expected Ok, got {error:?}"),
    }
}

/// Capacity mode against the reference: `check()`, the count tensor, the out length, the prefix.
#[track_caller]
pub fn check_capacity<B: KvPlanBackend>(
    got: Gathered<B>,
    want: &Result<Vec<i64>, Error>,
    capacity: usize,
    what: &str,
) {
    assert_eq!(dims(&got.out), [capacity], "{what}: out length");
    assert_eq!(dims(&got.count()), [1], "{what}: count shape");
    let count = values::<B>(got.count());
    match (got.status.check(), want) {
        (Ok(n), Ok(want)) => {
            assert_eq!(n, want.len(), "{what}: check()");
            assert_eq!(count, vec![want.len() as i64], "{what}: count tensor");
            let out = read_prefix::<B>(got.out, n).unwrap();
            assert_eq!(out, want[..], "{what}: out[..count]");
        }
        (Err(error), Err(want)) => {
            assert_eq!(&error, want, "{what}: deferred error");
            assert_eq!(count, vec![0], "{what}: count after a deferred error");
        }
        (Ok(n), Err(want)) => panic!("{what}: expected {want:?}, check() gave Ok({n})"),
        (Err(error), Ok(_)) => panic!("{what}: expected Ok, check() gave {error:?}"),
    }
}

/// Runs a masked case in exact mode and in capacity mode (default and `extra` capacities).
pub fn run_masked<B: KvPlanBackend>(
    case: &MaskedCase,
    device: &B::Device,
    extra: &[usize],
    what: &str,
) {
    let (table, rpi, pos2d, mask) = case.tensors::<B>(device);
    let got = masked::<B>(table.clone(), rpi.clone(), pos2d.clone(), mask.clone());
    check_exact::<B>(got, &case.reference(None), what);
    let default = case.r * case.c;
    for capacity in std::iter::once(None).chain(extra.iter().map(|&c| Some(c))) {
        let got = masked_deferred::<B>(
            table.clone(),
            rpi.clone(),
            pos2d.clone(),
            mask.clone(),
            capacity,
        )
        .unwrap_or_else(|error| panic!("{what}: capacity mode refused at once: {error}"));
        let want = case.reference(Some(capacity.unwrap_or(default)));
        check_capacity(
            got,
            &want,
            capacity.unwrap_or(default),
            &format!("{what} capacity {capacity:?}"),
        );
    }
}

pub fn run_segments<B: KvPlanBackend>(
    case: &SegmentCase,
    device: &B::Device,
    extra: &[usize],
    what: &str,
) {
    let (table, rpi, start, lengths) = case.tensors::<B>(device);
    let got = segments::<B>(table.clone(), rpi.clone(), start.clone(), lengths.clone());
    check_exact::<B>(got, &case.reference(None), what);
    let default = case.default_capacity();
    for capacity in std::iter::once(None).chain(extra.iter().map(|&c| Some(c))) {
        let got = segments_deferred::<B>(
            table.clone(),
            rpi.clone(),
            start.clone(),
            lengths.clone(),
            capacity,
        )
        .unwrap_or_else(|error| panic!("{what}: capacity mode refused at once: {error}"));
        let want = case.reference(Some(capacity.unwrap_or(default)));
        check_capacity(
            got,
            &want,
            capacity.unwrap_or(default),
            &format!("{what} capacity {capacity:?}"),
        );
    }
}

pub fn random_table(rng: &mut Rng, rows: usize, cols: usize) -> Vec<i64> {
    (0..rows * cols)
        .map(|_| match rng.below(8) {
            0 => i32::MAX as i64,
            1 => i32::MIN as i64,
            2 => rng.range(-5, 5),
            _ => rng.range(0, i32::MAX as i64),
        })
        .collect()
}

#[derive(Debug, Clone, Copy)]
pub enum MaskKind {
    AllFalse,
    AllTrue,
    Ragged,
    Random,
}

fn random_masked(rng: &mut Rng, r: usize, c: usize, kind: MaskKind) -> MaskedCase {
    let rows = rng.urange(1, 6);
    let cols = rng.urange(1, 20);
    let table = random_table(rng, rows, cols);
    random_masked_on(rng, (rows, cols, table), r, c, kind)
}

/// A random `R x C` masked gather over a given `(rows, cols, values)` table.
pub fn random_masked_on(
    rng: &mut Rng,
    (rows, cols, table): (usize, usize, Vec<i64>),
    r: usize,
    c: usize,
    kind: MaskKind,
) -> MaskedCase {
    let shared = r <= 1 || rng.chance(1, 4);
    let n = if shared { 1 } else { r };
    let rpi = (0..n).map(|_| rng.range(0, rows as i64 - 1)).collect();
    let mut mask = vec![false; r * c];
    for i in 0..r {
        let ragged = rng.urange(0, c);
        for j in 0..c {
            mask[i * c + j] = match kind {
                MaskKind::AllFalse => false,
                MaskKind::AllTrue => true,
                MaskKind::Ragged => j < ragged,
                MaskKind::Random => rng.chance(1, 2),
            };
        }
    }
    let dtypes = [rng.int_dtype(), rng.int_dtype(), rng.int_dtype()];
    let pos2d = mask
        .iter()
        .map(|&m| {
            if m {
                // Often the last column.
                if rng.chance(1, 3) {
                    cols as i64 - 1
                } else {
                    rng.range(0, cols as i64 - 1)
                }
            } else if dtypes[2] == DType::I64 {
                rng.range(i64::MIN, i64::MAX)
            } else {
                rng.i32_value()
            }
        })
        .collect();
    MaskedCase {
        rows,
        cols,
        table,
        rpi,
        r,
        c,
        pos2d,
        mask,
        dtypes,
    }
}

fn random_segments(rng: &mut Rng, s: usize) -> SegmentCase {
    let rows = rng.urange(1, 6);
    let cols = rng.urange(1, 20);
    let table = random_table(rng, rows, cols);
    random_segments_on(rng, (rows, cols, table), s)
}

/// `s` random segments over a given `(rows, cols, values)` table.
pub fn random_segments_on(
    rng: &mut Rng,
    (rows, cols, table): (usize, usize, Vec<i64>),
    s: usize,
) -> SegmentCase {
    let has_start = rng.chance(2, 3);
    let shared = has_start && (s == 1 || rng.chance(1, 3));
    let n = if shared { 1 } else { s };
    let rpi = (0..n).map(|_| rng.range(0, rows as i64 - 1)).collect();
    let lengths: Vec<i64> = (0..s)
        .map(|_| match rng.below(6) {
            0 => cols as i64,
            1 => rng.range(-3, 0),
            _ => rng.range(1, cols as i64),
        })
        .collect();
    let start = has_start.then(|| {
        lengths
            .iter()
            .map(|&len| {
                if len > 0 {
                    rng.range(0, cols as i64 - len)
                } else {
                    rng.range(-1000, 1000)
                }
            })
            .collect()
    });
    let dtypes = [
        rng.int_dtype(),
        rng.int_dtype(),
        rng.int_dtype(),
        rng.int_dtype(),
    ];
    SegmentCase {
        rows,
        cols,
        table,
        rpi,
        start,
        lengths,
        dtypes,
    }
}

pub fn random_masked_cases<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6d61_736b);
    let kinds = [
        MaskKind::AllFalse,
        MaskKind::AllTrue,
        MaskKind::Ragged,
        MaskKind::Random,
    ];
    for r in [0, 1, 7, 33] {
        for c in [0, 1, 4, 5, 8, 17, 64] {
            for kind in kinds {
                let case = random_masked(&mut rng, r, c, kind);
                run_masked::<B>(
                    &case,
                    device,
                    &[],
                    &format!("masked R={r} C={c} {kind:?} {case:?}"),
                );
            }
        }
    }
}

pub fn random_segment_cases<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x7365_6773);
    for s in [0, 1, 7, 33] {
        for round in 0..8 {
            let case = random_segments(&mut rng, s);
            run_segments::<B>(
                &case,
                device,
                &[],
                &format!("segments S={s} round {round} {case:?}"),
            );
        }
    }
}

/// Caller-given capacities: tight, one short, and roomy.
pub fn caller_capacities<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6361_7073);
    for round in 0..6 {
        let case = random_masked(&mut rng, 7, 5, MaskKind::AllTrue);
        let n = 35;
        run_masked::<B>(
            &case,
            device,
            &[n, n - 1, n + 9, 0],
            &format!("masked round {round}"),
        );
        let case = random_masked(&mut rng, 7, 5, MaskKind::Random);
        let n = case.mask.iter().filter(|&&m| m).count();
        let mut capacities = vec![n, n + 3];
        if n > 0 {
            capacities.push(n - 1);
        }
        run_masked::<B>(
            &case,
            device,
            &capacities,
            &format!("masked random round {round}"),
        );
        let mut case = random_segments(&mut rng, 7);
        case.lengths[0] = case.lengths[0].max(1);
        if let Some(start) = case.start.as_mut() {
            start[0] = start[0].clamp(0, case.cols as i64 - case.lengths[0]);
        }
        let n: usize = case.lengths.iter().map(|&l| l.max(0) as usize).sum();
        run_segments::<B>(
            &case,
            device,
            &[n, n - 1, n + 4],
            &format!("segments round {round} {case:?}"),
        );
    }
    // The exact facts of a short capacity.
    let case = random_masked(&mut rng, 7, 5, MaskKind::AllTrue);
    let (table, rpi, pos2d, mask) = case.tensors::<B>(device);
    let got = masked_deferred::<B>(table, rpi, pos2d, mask, Some(30)).unwrap();
    assert_eq!(
        got.status.check(),
        Err(Error::CapacityExceeded {
            context: CTX.into(),
            count: 35,
            capacity: 30
        })
    );
    assert_eq!(values::<B>(got.count()), vec![0]);
}

/// The spec's worked examples, exactly.
pub fn spec_examples<B: KvPlanBackend>(device: &B::Device) {
    let table: Vec<i64> = (0..24).map(|k| 100 + k).collect();
    let t = || ints::<B, 2>(&table, [4, 6], DType::I32, device);
    let l = |data: &[i64]| list::<B>(data, DType::I64, device);
    let got = masked::<B>(
        t(),
        l(&[1, 3]),
        ints::<B, 2>(&[0, 1, 2, 99, 5, 4, 9, -7], [2, 4], DType::I64, device),
        bools::<B, 2>(
            &[true, true, true, false, true, true, false, false],
            [2, 4],
            device,
        ),
    )
    .unwrap();
    assert_eq!(values::<B>(got), vec![106, 107, 108, 123, 122]);
    let got = masked_deferred::<B>(
        t(),
        l(&[1, 3]),
        ints::<B, 2>(&[0, 1, 2, 99, 5, 4, 9, -7], [2, 4], DType::I64, device),
        bools::<B, 2>(
            &[true, true, true, false, true, true, false, false],
            [2, 4],
            device,
        ),
        None,
    )
    .unwrap();
    assert_eq!(dims(&got.out), [8]);
    assert_eq!(got.status.check(), Ok(5));
    assert_eq!(
        read_prefix::<B>(got.out, 5).unwrap(),
        [106, 107, 108, 123, 122]
    );
    let got = segments::<B>(t(), l(&[1, 2, 3]), Some(l(&[0, 2, 5])), l(&[3, 4, 1])).unwrap();
    assert_eq!(
        values::<B>(got),
        vec![106, 107, 108, 114, 115, 116, 117, 123]
    );
    let got = segments::<B>(t(), l(&[1, 2]), None, l(&[2, 6])).unwrap();
    assert_eq!(
        values::<B>(got),
        vec![106, 107, 112, 113, 114, 115, 116, 117]
    );
    let got = segments::<B>(t(), l(&[1, 2, 3]), Some(l(&[0, 1, 2])), l(&[-3, 2, 0])).unwrap();
    assert_eq!(values::<B>(got), vec![113, 114]);
    // An empty result is a [0] tensor.
    let got = segments::<B>(t(), l(&[1, 99]), Some(l(&[1000, -5])), l(&[0, 0])).unwrap();
    assert_eq!(dims(&got), [0]);
    let got =
        segments_deferred::<B>(t(), l(&[1, 99]), Some(l(&[1000, -5])), l(&[0, 0]), None).unwrap();
    assert_eq!(dims(&got.out), [12]);
    assert_eq!(got.status.check(), Ok(0));
    assert_eq!(values::<B>(got.count()), vec![0]);
    // The segment context.
    let error = segments::<B>(t(), l(&[1]), Some(l(&[4])), l(&[3])).unwrap_err();
    assert!(error.to_string().starts_with(SEGMENT_CONTEXT), "{error}");
}

/// Non-contiguous inputs (broadcast rows, transposed blocks, offset slices) are read through
/// their layout: the result equals the gather over the materialised values.
pub fn strided_inputs<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x7374_7269);
    for round in 0..4 {
        let (rows, cols, r, c) = (5, 9, 6, 4);
        let row: Vec<i64> = (0..cols).map(|_| rng.range(0, i32::MAX as i64)).collect();
        // Broadcast table: every row is `row`.
        let table = int_expand::<B, 2>(
            ints::<B, 2>(&row, [1, cols], rng.int_dtype(), device),
            [rows, cols],
        );
        // Transposed pos2d and mask, built as [c, r].
        let pos_t: Vec<i64> = (0..r * c).map(|_| rng.range(0, cols as i64 - 1)).collect();
        let mask_t: Vec<bool> = (0..r * c).map(|_| rng.chance(2, 3)).collect();
        let pos2d = int_transpose::<B>(ints::<B, 2>(&pos_t, [c, r], rng.int_dtype(), device));
        let mask = bool_transpose::<B>(bools::<B, 2>(&mask_t, [c, r], device));
        // req_pool_indices as an offset slice of a longer vector.
        let long: Vec<i64> = (0..r + 3).map(|_| rng.range(0, rows as i64 - 1)).collect();
        let rpi = int_slice::<B>(list::<B>(&long, rng.int_dtype(), device), &[2..2 + r]);
        let case = MaskedCase {
            rows,
            cols,
            table: values::<B>(table.clone()),
            rpi: long[2..2 + r].to_vec(),
            r,
            c,
            pos2d: values::<B>(pos2d.clone()),
            mask: bool_values::<B>(mask.clone()),
            dtypes: [DType::I64; 3],
        };
        assert_eq!(case.table, row.repeat(rows), "expanded table");
        let want = case.reference(None);
        let got = masked::<B>(table.clone(), rpi.clone(), pos2d.clone(), mask.clone());
        check_exact::<B>(got, &want, &format!("strided masked round {round}"));
        let got = masked_deferred::<B>(table.clone(), rpi.clone(), pos2d, mask, None).unwrap();
        check_capacity::<B>(
            got,
            &case.reference(Some(r * c)),
            r * c,
            &format!("strided masked capacity round {round}"),
        );
        // Segments over the broadcast table and a sliced start.
        let lengths: Vec<i64> = (0..r).map(|_| rng.range(0, 4)).collect();
        let start_long: Vec<i64> = (0..r + 1).map(|_| rng.range(0, cols as i64 - 4)).collect();
        let start = int_slice::<B>(list::<B>(&start_long, DType::I64, device), &[1..1 + r]);
        let seg = SegmentCase {
            rows,
            cols,
            table: case.table.clone(),
            rpi: case.rpi.clone(),
            start: Some(start_long[1..].to_vec()),
            lengths: lengths.clone(),
            dtypes: [DType::I64; 4],
        };
        let got = segments::<B>(
            table,
            rpi,
            Some(start),
            list::<B>(&lengths, DType::I32, device),
        );
        check_exact::<B>(
            got,
            &seg.reference(None),
            &format!("strided segments round {round}"),
        );
    }
    sliced_windows::<B>(&mut rng, device);
}

/// Windows cut from larger pos2d and mask buffers: a slice of rows (Burn keeps it a view when its
/// byte offset is a multiple of the device's memory alignment, and such a view is read in aligned
/// 4-cell vectors) and a slice of 8 columns at an offset of one cell (a copy).
fn sliced_windows<B: KvPlanBackend>(rng: &mut Rng, device: &B::Device) {
    let (rows, cols, r, wide) = (4, 32, 6, 64);
    let table = random_table(rng, rows, cols);
    let rpi: Vec<i64> = (0..r).map(|_| rng.range(0, rows as i64 - 1)).collect();
    let all_pos: Vec<i64> = (0..(r + 4) * wide)
        .map(|_| rng.range(0, cols as i64 - 1))
        .collect();
    let all_mask: Vec<bool> = (0..(r + 4) * wide).map(|_| rng.chance(1, 2)).collect();
    let pos = ints::<B, 2>(&all_pos, [r + 4, wide], DType::I32, device);
    let mask = bools::<B, 2>(&all_mask, [r + 4, wide], device);
    let windows = [
        ("rows 4.., every column", 4..r + 4, 0..wide),
        ("rows 0..r, columns 1..9", 0..r, 1..9),
    ];
    for (what, row_range, col_range) in windows {
        let c = col_range.len();
        let pos2d = int_slice::<B>(pos.clone(), &[row_range.clone(), col_range.clone()]);
        let window_mask = bool_slice::<B>(mask.clone(), &[row_range, col_range]);
        let case = MaskedCase {
            rows,
            cols,
            table: table.clone(),
            rpi: rpi.clone(),
            r,
            c,
            pos2d: values::<B>(pos2d.clone()),
            mask: bool_values::<B>(window_mask.clone()),
            dtypes: [DType::I32; 3],
        };
        let t = ints::<B, 2>(&table, [rows, cols], DType::I32, device);
        let q = list::<B>(&rpi, DType::I32, device);
        let got = masked::<B>(t.clone(), q.clone(), pos2d.clone(), window_mask.clone());
        check_exact::<B>(got, &case.reference(None), &format!("sliced {what}"));
        // A true cell's position past the table, in a vector's third cell: the error names it.
        let mut bad = case.clone();
        bad.mask[2 * c + 6] = true;
        bad.pos2d[2 * c + 6] = cols as i64 + 5;
        let bad_pos = int_slice_assign::<B>(
            pos2d,
            &[2..3, 6..7],
            ints::<B, 2>(&[cols as i64 + 5], [1, 1], DType::I32, device),
        );
        let bad_mask = bool_slice_assign::<B>(
            window_mask,
            &[2..3, 6..7],
            bools::<B, 2>(&[true], [1, 1], device),
        );
        let got = masked::<B>(t, q, bad_pos, bad_mask);
        check_exact::<B>(
            got,
            &bad.reference(None),
            &format!("sliced {what}, a bad position"),
        );
    }
}

/// Many tiles: the large masked case (bs 4096, W 2048, ragged windows at random
/// offsets), a mid-sized random one, the largest gather without a count launch (64 tiles' worth
/// of 2,048 cells: 128 tiles of 1,024 chained by the look-back), and segment batches of several
/// shared tiles.
/// `r x c` cells, each true with probability 1/2 at a random position of a `rows x cols` table,
/// rows from 1 (row 0 stays free), all inputs i32.
fn uniform_masked(rng: &mut Rng, rows: usize, cols: usize, r: usize, c: usize) -> MaskedCase {
    MaskedCase {
        rows,
        cols,
        table: random_table(rng, rows, cols),
        rpi: (0..r).map(|_| rng.range(1, rows as i64 - 1)).collect(),
        r,
        c,
        pos2d: (0..r * c).map(|_| rng.range(0, cols as i64 - 1)).collect(),
        mask: (0..r * c).map(|_| rng.chance(1, 2)).collect(),
        dtypes: [DType::I32, DType::I32, DType::I32],
    }
}

pub fn large_cases<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6269_6767);
    for (r, c, ragged) in [(4096, 2048, true), (300, 100, false), (512, 256, false)] {
        let (rows, cols) = (64, 4096);
        let table = random_table(&mut rng, rows, cols);
        let rpi = (0..r).map(|_| rng.range(1, rows as i64 - 1)).collect();
        let mut pos2d = vec![0i64; r * c];
        let mut mask = vec![false; r * c];
        for i in 0..r {
            let length = rng.urange(0, c);
            let start = rng.range(0, (cols - c) as i64);
            for j in 0..c {
                pos2d[i * c + j] = start + j as i64;
                mask[i * c + j] = if ragged { j < length } else { rng.chance(1, 2) };
            }
        }
        let case = MaskedCase {
            rows,
            cols,
            table,
            rpi,
            r,
            c,
            pos2d,
            mask,
            dtypes: [DType::I32, DType::I32, DType::I32],
        };
        run_masked::<B>(&case, device, &[], &format!("large masked ({r}, {c})"));
    }
    // Tiles chained by the look-back (30 tiles, no count launch), whose last tile's cube writes the
    // count and the status: a capacity one short and one exact, then a bad row in a middle tile,
    // then also a bad position in the first tile. Both reach the last tile through the look-back.
    let (rows, c) = (64usize, 100usize);
    let mut case = uniform_masked(&mut rng, rows, 4096, 300, c);
    let valid = case.mask.iter().filter(|&&m| m).count();
    run_masked::<B>(
        &case,
        device,
        &[valid - 1, valid],
        "chained masked (300, 100)",
    );
    case.mask[150 * c..151 * c].fill(true);
    case.rpi[150] = rows as i64;
    run_masked::<B>(
        &case,
        device,
        &[],
        "chained masked, bad row in a middle tile",
    );
    case.mask[5] = true;
    case.pos2d[5] = -1;
    run_masked::<B>(
        &case,
        device,
        &[],
        "chained masked, bad position in the first tile",
    );
    // More than 64 tiles of 2048 cells: the gather counts first. Clean (with a capacity one short
    // and one exact), then a bad position and a bad row late in the batch, both at once.
    let (rows, cols, c) = (64usize, 4096usize, 2048usize);
    let mut case = uniform_masked(&mut rng, rows, cols, 80, c);
    let valid = case.mask.iter().filter(|&&m| m).count();
    run_masked::<B>(
        &case,
        device,
        &[valid - 1, valid],
        "counted masked (80, 2048)",
    );
    case.mask[77 * c + 1500] = true;
    case.pos2d[77 * c + 1500] = cols as i64;
    run_masked::<B>(&case, device, &[], "counted masked, bad position");
    case.rpi[60] = rows as i64;
    run_masked::<B>(&case, device, &[], "counted masked, bad row and position");
    for (s, cols, longest) in [(4096, 128, 64), (1000, 4096, 2048), (300, 16, 16)] {
        let rows = 32;
        let table = random_table(&mut rng, rows, cols);
        let rpi = (0..s).map(|_| rng.range(1, rows as i64 - 1)).collect();
        let lengths: Vec<i64> = (0..s)
            .map(|_| match rng.below(8) {
                0 => rng.range(-3, 0),
                _ => rng.range(1, longest),
            })
            .collect();
        let start = lengths
            .iter()
            .map(|&len| rng.range(0, cols as i64 - len.max(0)))
            .collect();
        let case = SegmentCase {
            rows,
            cols,
            table,
            rpi,
            start: Some(start),
            lengths,
            dtypes: [DType::I32, DType::I32, DType::I32, DType::I32],
        };
        run_segments::<B>(&case, device, &[], &format!("large segments S={s}"));
    }
}
