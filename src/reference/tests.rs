//! Unit and property tests of the host reference: the specs' worked examples with exact vectors,
//! every data-dependent error with its facts and first offender, plan buffer semantics (overflow,
//! reuse, disabling), and the status record round trip.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

use super::{ExpectedTokens, PlanArgs, PlanBuffers, Table, masked_gather, plan, segment_gather};
use crate::error::{Dims, Error, PLAN_CONTEXT, SEGMENT_CONTEXT, Site};
use crate::status;

const CTX: &str = "DFLASH target hidden KV append";

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The gather spec's 4x6 table: `T[q][c] = 100 + 6q + c`.
fn t46() -> Vec<i64> {
    (0..24).map(|k| 100 + k).collect()
}

/// A "linear" table: `T[q][c] = cols * q + c`.
fn linear(rows: usize, cols: usize) -> Vec<i64> {
    (0..(rows * cols) as i64).collect()
}

fn bools(bits: &[u8]) -> Vec<bool> {
    bits.iter().map(|&b| b != 0).collect()
}

/// Masked gather on the 4x6 table.
fn mg46(rpi: &[i64], pos2d: &[i64], mask: &[u8], shape: [usize; 2]) -> Result<Vec<i64>, Error> {
    let table = t46();
    masked_gather(
        Table::new(4, 6, &table),
        rpi,
        pos2d,
        &bools(mask),
        shape,
        None,
        CTX,
    )
}

/// Segment gather on the 4x6 table.
fn sg46(rpi: &[i64], start: Option<&[i64]>, lengths: &[i64]) -> Result<Vec<i64>, Error> {
    let table = t46();
    segment_gather(Table::new(4, 6, &table), rpi, start, lengths, None)
}

fn row_err(i: usize, value: i64, rows: usize) -> Error {
    Error::ReqPoolIndexOutOfRange {
        context: CTX.into(),
        site: Site::Row(i),
        value,
        rows,
    }
}

fn pos_err(i: usize, j: usize, position: i64, cols: usize) -> Error {
    Error::PositionOutOfRange {
        context: CTX.into(),
        site: Site::Cell(i, j),
        position,
        cols,
    }
}

fn seg_row_err(i: usize, value: i64, rows: usize) -> Error {
    Error::ReqPoolIndexOutOfRange {
        context: SEGMENT_CONTEXT.into(),
        site: Site::Row(i),
        value,
        rows,
    }
}

fn seg_pos_err(i: usize, j: usize, position: i64, cols: usize) -> Error {
    Error::PositionOutOfRange {
        context: SEGMENT_CONTEXT.into(),
        site: Site::Cell(i, j),
        position,
        cols,
    }
}

/// One plan step's inputs, owned.
#[derive(Debug, Clone)]
struct Step {
    rpi: Vec<i64>,
    prefix: Vec<i64>,
    extend: Vec<i64>,
    rows: usize,
    cols: usize,
    table: Vec<i64>,
    window: i32,
    lut: Option<Vec<i64>>,
    pool: Option<(usize, usize, Vec<i64>)>,
    valid_lens: Vec<i64>,
    offset: i32,
}

impl Step {
    fn new(rows: usize, cols: usize, table: Vec<i64>) -> Self {
        assert_eq!(table.len(), rows * cols);
        Self {
            rpi: vec![],
            prefix: vec![],
            extend: vec![],
            rows,
            cols,
            table,
            window: 0,
            lut: None,
            pool: None,
            valid_lens: vec![],
            offset: 0,
        }
    }

    fn batch(mut self, rpi: &[i64], prefix: &[i64], extend: &[i64]) -> Self {
        self.rpi = rpi.to_vec();
        self.prefix = prefix.to_vec();
        self.extend = extend.to_vec();
        self
    }

    fn window(mut self, window: i32, lut: Vec<i64>) -> Self {
        self.window = window;
        self.lut = Some(lut);
        self
    }

    fn pool(
        mut self,
        rows: usize,
        cols: usize,
        data: Vec<i64>,
        valid_lens: &[i64],
        offset: i32,
    ) -> Self {
        self.pool = Some((rows, cols, data));
        self.valid_lens = valid_lens.to_vec();
        self.offset = offset;
        self
    }

    fn run(&self, buffers: &mut PlanBuffers) -> Result<(), Error> {
        let args = PlanArgs {
            req_pool_indices: &self.rpi,
            prefix_lens: &self.prefix,
            extend_seq_lens: &self.extend,
            req_to_token: Table::new(self.rows, self.cols, &self.table),
            swa_window_size: self.window,
            full_to_swa: self.lut.as_deref(),
            expected_tokens: self.pool.as_ref().map(|(rows, cols, data)| ExpectedTokens {
                pool: Table::new(*rows, *cols, data),
                valid_lens: &self.valid_lens,
            }),
            position_offset: self.offset,
        };
        plan(&args, buffers)
    }
}

/// Buffers full of distinctive garbage, to tell written entries from stale ones.
fn poison(verify_capacity: usize, write_req_capacity: usize) -> PlanBuffers {
    let seq = |base: i64, len: usize| (0..len as i64).map(|k| base + k).collect::<Vec<_>>();
    PlanBuffers {
        verify_slot_indices: seq(9000, verify_capacity),
        verify_expected_tokens: seq(8000, verify_capacity),
        verify_expected_positions: seq(7000, verify_capacity),
        verify_prev_slot_indices: seq(6000, verify_capacity),
        verify_num_valid: 5,
        enable: 0,
        write_offsets: seq(4000, write_req_capacity + 1),
        write_seed_slot_indices: seq(3000, write_req_capacity),
        write_num_valid_reqs: 77,
    }
}

/// Sets the leading verify entries of `b`.
fn set_entries(
    b: &mut PlanBuffers,
    slots: &[i64],
    tokens: &[i64],
    positions: &[i64],
    prev: &[i64],
) {
    let n = slots.len();
    assert!(tokens.len() == n && positions.len() == n && prev.len() == n);
    b.verify_slot_indices[..n].copy_from_slice(slots);
    b.verify_expected_tokens[..n].copy_from_slice(tokens);
    b.verify_expected_positions[..n].copy_from_slice(positions);
    b.verify_prev_slot_indices[..n].copy_from_slice(prev);
    b.verify_num_valid = n as i32;
    b.enable = 1;
}

fn set_write(b: &mut PlanBuffers, offsets: &[i64], seeds: &[i64]) {
    b.write_offsets.copy_from_slice(offsets);
    b.write_seed_slot_indices[..seeds.len()].copy_from_slice(seeds);
    b.write_num_valid_reqs = seeds.len() as i32;
}

fn minus_ones(n: usize) -> Vec<i64> {
    vec![-1; n]
}

fn range(lo: i64, hi: i64) -> Vec<i64> {
    (lo..hi).collect()
}

fn concat(parts: &[&[i64]]) -> Vec<i64> {
    parts.concat()
}

fn assert_disabled(b: &PlanBuffers) {
    assert_eq!(
        (b.enable, b.verify_num_valid, b.write_num_valid_reqs),
        (0, 0, 0),
        "{b:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// masked_gather (gather.md §3)
// ---------------------------------------------------------------------------------------------

#[test]
fn masked_basic_ragged() {
    let (rpi, pos2d, mask) = ([1, 3], [0, 1, 2, 99, 5, 4, 9, -7], [1, 1, 1, 0, 1, 1, 0, 0]);
    assert_eq!(
        mg46(&rpi, &pos2d, &mask, [2, 4]),
        Ok(vec![106, 107, 108, 123, 122])
    );
    // Capacity: 5 fits 5 and 8, not 4 (rule 10).
    let table = t46();
    let run = |capacity| {
        masked_gather(
            Table::new(4, 6, &table),
            &rpi,
            &pos2d,
            &bools(&mask),
            [2, 4],
            capacity,
            CTX,
        )
    };
    assert_eq!(run(Some(8)), Ok(vec![106, 107, 108, 123, 122]));
    assert_eq!(run(Some(5)), Ok(vec![106, 107, 108, 123, 122]));
    let err = run(Some(4)).unwrap_err();
    assert_eq!(
        err,
        Error::CapacityExceeded {
            context: CTX.into(),
            count: 5,
            capacity: 4
        }
    );
    assert_eq!(err.kind(), "capacity_exceeded");
    assert_eq!(
        err.to_string(),
        format!("{CTX} 5 gathered values do not fit capacity 4.")
    );
}

#[test]
fn masked_single_index_broadcasts() {
    let got = mg46(&[2], &[0, 1, 2, 3, 4, 5], &[1, 1, 1, 0, 0, 1], [3, 2]);
    assert_eq!(got, Ok(vec![112, 113, 114, 117]));
}

#[test]
fn masked_row0_is_ordinary_and_duplicates_repeat() {
    assert_eq!(
        mg46(&[0, 0], &[0, 1, 2, 3], &[1, 1, 1, 0], [2, 2]),
        Ok(vec![100, 101, 102])
    );
    assert_eq!(
        mg46(&[2, 2], &[1, 1, 1, 0, 0, 5], &[1, 1, 1, 1, 0, 1], [2, 3]),
        Ok(vec![113, 113, 113, 112, 117])
    );
    // The last column.
    assert_eq!(mg46(&[0, 3], &[5, 5], &[1, 1], [2, 1]), Ok(vec![105, 123]));
}

#[test]
fn masked_int32_extremes_keep_their_sign() {
    let table = [
        2147483647,
        -2147483648,
        -1,
        0,
        1073741824,
        -1073741824,
        123,
        2147483640,
    ];
    let got = masked_gather(
        Table::new(2, 4, &table),
        &[1, 0, 1],
        &[0, 1, 2, 3, 3, 2, 1, 0, 3, 3, 0, 0],
        &bools(&[1, 1, 1, 1, 1, 0, 1, 0, 1, 1, 0, 0]),
        [3, 4],
        None,
        CTX,
    );
    assert_eq!(
        got,
        Ok(vec![
            1073741824,
            -1073741824,
            123,
            2147483640,
            0,
            -2147483648,
            2147483640,
            2147483640
        ])
    );
}

#[test]
fn masked_off_cells_are_never_checked() {
    // Huge and negative positions under false mask cells.
    assert_eq!(
        mg46(&[1, 2], &[50, -50, 7, i64::MIN], &[0, 0, 0, 0], [2, 2]),
        Ok(vec![])
    );
    assert_eq!(
        mg46(&[1, 2], &[i64::MAX, 0, 6, 5], &[0, 1, 0, 1], [2, 2]),
        Ok(vec![106, 117])
    );
}

#[test]
fn masked_empty_shapes() {
    // R == 0.
    assert_eq!(mg46(&[], &[], &[], [0, 5]), Ok(vec![]));
    // R == 0 with one (invalid) shared index: rule 8 checks nothing.
    assert_eq!(mg46(&[99], &[], &[], [0, 5]), Ok(vec![]));
    // C == 0: rule 8 checks nothing, even an out-of-range row.
    assert_eq!(mg46(&[1, 77], &[], &[], [2, 0]), Ok(vec![]));
    // C == 0 still pairs shapes (rule 7).
    assert_eq!(
        mg46(&[1, 2, 3], &[], &[], [2, 0]),
        Err(Error::IndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 2,
            cols: 0
        })
    );
}

#[test]
fn masked_empty_table_rule6() {
    let empty: [i64; 0] = [];
    let run = |rpi: &[i64], mask: &[u8], shape: [usize; 2]| {
        let pos2d = vec![3; mask.len()];
        masked_gather(
            Table::new(4, 0, &empty),
            rpi,
            &pos2d,
            &bools(mask),
            shape,
            None,
            CTX,
        )
    };
    assert_eq!(run(&[1, 99], &[0, 0, 0, 0], [2, 2]), Ok(vec![]));
    let err = run(&[1, 99], &[0, 0, 1, 0], [2, 2]).unwrap_err();
    assert_eq!(
        err,
        Error::EmptyTableNonemptyMask {
            context: CTX.into()
        }
    );
    assert_eq!(
        err.to_string(),
        "DFLASH target hidden KV append req_to_token table is empty but gather mask is non-empty."
    );
    // The early exit skips rule 7 too: three indices for two rows pass with an all-false mask,
    // and a true cell reports the empty table, not the pairing.
    assert_eq!(run(&[1, 2, 3], &[0, 0, 0, 0], [2, 2]), Ok(vec![]));
    assert_eq!(
        run(&[1, 2, 3], &[1, 0, 0, 0], [2, 2]),
        Err(Error::EmptyTableNonemptyMask {
            context: CTX.into()
        })
    );
    // 0x0 table, bs 0.
    assert_eq!(
        masked_gather(Table::new(0, 0, &empty), &[], &[], &[], [0, 3], None, CTX),
        Ok(vec![])
    );
}

#[test]
fn masked_zero_row_table() {
    let empty: [i64; 0] = [];
    for mask in [[1, 0], [0, 0]] {
        let got = masked_gather(
            Table::new(0, 5, &empty),
            &[0],
            &[1, 2],
            &bools(&mask),
            [1, 2],
            None,
            CTX,
        );
        assert_eq!(got, Err(row_err(0, 0, 0)), "{mask:?}");
    }
}

#[test]
fn masked_rule7_pairing() {
    let err = mg46(&[1, 2, 3], &[0, 1], &[1, 1], [1, 2]).unwrap_err();
    assert_eq!(
        err,
        Error::MaskIndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 1,
            cols: 2
        }
    );
    assert_eq!(err.kind(), "mask_index_shape_mismatch");
    assert_eq!(
        mg46(&[], &[0, 1], &[1, 1], [1, 2]),
        Err(Error::MaskIndexShapeMismatch {
            context: CTX.into(),
            n: 0,
            rows: 1,
            cols: 2
        })
    );
    let err = mg46(&[1, 2, 3], &[0, 1, 2, 3], &[1, 1, 1, 1], [2, 2]).unwrap_err();
    assert_eq!(
        err,
        Error::IndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 2,
            cols: 2
        }
    );
    assert_eq!(err.kind(), "index_shape_mismatch");
    // Pairing comes before out-of-range rows and positions.
    assert_eq!(
        mg46(&[9, 9, 9], &[99, 99, 99, 99], &[1, 1, 1, 1], [2, 2])
            .unwrap_err()
            .kind(),
        "index_shape_mismatch"
    );
}

#[test]
fn masked_rule8_rows() {
    // A false mask row is still checked.
    let err = mg46(&[1, 4], &[0, 0], &[1, 0], [2, 1]).unwrap_err();
    assert_eq!(err, row_err(1, 4, 4));
    assert_eq!(err.kind(), "req_pool_index_out_of_range");
    assert_eq!(
        err.to_string(),
        format!("{CTX} row 1: req_pool_index 4 is not a row of req_to_token (rows=4).")
    );
    // Negative indices never wrap.
    assert_eq!(
        mg46(&[-1, -4], &[0, 0], &[1, 1], [2, 1]),
        Err(row_err(0, -1, 4))
    );
    // The smallest offending row is reported.
    assert_eq!(
        mg46(&[1, 5, -2], &[0, 0, 0], &[1, 1, 1], [3, 1]),
        Err(row_err(1, 5, 4))
    );
    // With a shared index, row 0 is reported.
    assert_eq!(
        mg46(&[i64::MAX], &[0, 0], &[0, 0], [2, 1]),
        Err(row_err(0, i64::MAX, 4))
    );
    // Rule 8 runs over every row before rule 9 looks at any cell.
    assert_eq!(
        mg46(&[1, 5], &[6, 0], &[1, 1], [2, 1]),
        Err(row_err(1, 5, 4))
    );
}

#[test]
fn masked_rule9_positions_first_offender() {
    let all = [1, 1, 1, 1, 1, 1];
    let pos2d = [0, 7, 9, -1, 0, 0];
    let err = mg46(&[1, 2], &pos2d, &all, [2, 3]).unwrap_err();
    assert_eq!(err, pos_err(0, 1, 7, 6));
    assert_eq!(err.kind(), "position_out_of_range");
    assert_eq!(
        err.to_string(),
        format!("{CTX} [0,1]: position 7 is outside req_to_token width 6.")
    );
    assert_eq!(
        mg46(&[1, 2], &pos2d, &[1, 0, 1, 1, 1, 1], [2, 3]),
        Err(pos_err(0, 2, 9, 6))
    );
    assert_eq!(
        mg46(&[1, 2], &pos2d, &[1, 0, 0, 1, 1, 1], [2, 3]),
        Err(pos_err(1, 0, -1, 6))
    );
    // Position == cols is out; negative never wraps.
    assert_eq!(mg46(&[3], &[6], &[1], [1, 1]), Err(pos_err(0, 0, 6, 6)));
    assert_eq!(mg46(&[3], &[-6], &[1], [1, 1]), Err(pos_err(0, 0, -6, 6)));
    assert_eq!(
        mg46(&[3], &[i64::MIN], &[1], [1, 1]),
        Err(pos_err(0, 0, i64::MIN, 6))
    );
    // Rule 9 beats rule 10.
    let table = t46();
    let got = masked_gather(
        Table::new(4, 6, &table),
        &[1],
        &[0, 6],
        &[true, true],
        [1, 2],
        Some(0),
        CTX,
    );
    assert_eq!(got, Err(pos_err(0, 1, 6, 6)));
}

// ---------------------------------------------------------------------------------------------
// segment_gather (gather.md §4)
// ---------------------------------------------------------------------------------------------

#[test]
fn segments_examples() {
    assert_eq!(
        sg46(&[1, 2, 3], Some(&[0, 2, 5]), &[3, 4, 1]),
        Ok(vec![106, 107, 108, 114, 115, 116, 117, 123])
    );
    assert_eq!(
        sg46(&[1, 2], None, &[2, 6]),
        Ok(vec![106, 107, 112, 113, 114, 115, 116, 117])
    );
    assert_eq!(
        sg46(&[1, 2, 3], Some(&[0, 1, 2]), &[-3, 2, 0]),
        Ok(vec![113, 114])
    );
    // Shared index.
    assert_eq!(
        sg46(&[2], Some(&[0, 3]), &[2, 2]),
        Ok(vec![112, 113, 115, 116])
    );
    // The last column.
    assert_eq!(sg46(&[3], Some(&[5]), &[1]), Ok(vec![123]));
}

#[test]
fn segments_early_exit_rule4() {
    // Nothing is checked: bad rows, bad starts, mismatched lengths, an empty table.
    assert_eq!(sg46(&[1, 99], Some(&[1000, -5]), &[0, 0]), Ok(vec![]));
    assert_eq!(sg46(&[1, 2], Some(&[0]), &[-1, -7, 0]), Ok(vec![]));
    assert_eq!(sg46(&[], None, &[]), Ok(vec![]));
    assert_eq!(sg46(&[5, 6], None, &[]), Ok(vec![]));
    let empty: [i64; 0] = [];
    assert_eq!(
        segment_gather(Table::new(4, 0, &empty), &[1], None, &[0], None),
        Ok(vec![])
    );
}

#[test]
fn segments_rule5_shape() {
    let err = sg46(&[1, 1, 1], Some(&[0, 0]), &[1, 1, 1]).unwrap_err();
    assert_eq!(
        err,
        Error::MaskShapeMismatch {
            context: SEGMENT_CONTEXT.into(),
            mask: Dims(vec![3, 1]),
            pos2d: Dims(vec![2, 1]),
        }
    );
    assert_eq!(err.kind(), "mask_shape_mismatch");
    // Without start, P = n.
    assert_eq!(
        sg46(&[1, 2], None, &[1, 2, 3]),
        Err(Error::MaskShapeMismatch {
            context: SEGMENT_CONTEXT.into(),
            mask: Dims(vec![3, 3]),
            pos2d: Dims(vec![2, 3]),
        })
    );
    // Rule 5 beats rule 6 (empty table).
    let empty: [i64; 0] = [];
    assert_eq!(
        segment_gather(Table::new(4, 0, &empty), &[1], Some(&[0, 0]), &[1], None)
            .unwrap_err()
            .kind(),
        "mask_shape_mismatch"
    );
}

#[test]
fn segments_rule6_empty_table() {
    let empty: [i64; 0] = [];
    let err = segment_gather(Table::new(4, 0, &empty), &[1, 99], None, &[0, 1], None).unwrap_err();
    assert_eq!(
        err,
        Error::EmptyTableNonemptyMask {
            context: SEGMENT_CONTEXT.into()
        }
    );
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather req_to_token table is empty but gather mask is non-empty."
    );
}

#[test]
fn segments_rule7_pairing() {
    assert_eq!(
        sg46(&[1, 2], Some(&[0, 0, 0]), &[1, 1, 1]),
        Err(Error::IndexShapeMismatch {
            context: SEGMENT_CONTEXT.into(),
            n: 2,
            rows: 3,
            cols: 1
        })
    );
    assert_eq!(
        sg46(&[1, 2], Some(&[0]), &[2]),
        Err(Error::MaskIndexShapeMismatch {
            context: SEGMENT_CONTEXT.into(),
            n: 2,
            rows: 1,
            cols: 2
        })
    );
    // Pairing beats out-of-range values.
    assert_eq!(
        sg46(&[9, 9], Some(&[-1, 0, 0]), &[1, 1, 1])
            .unwrap_err()
            .kind(),
        "index_shape_mismatch"
    );
}

#[test]
fn segments_rule8_rows() {
    assert_eq!(
        sg46(&[1, 9], Some(&[0, 0]), &[2, 0]),
        Err(seg_row_err(1, 9, 4))
    );
    assert_eq!(sg46(&[1, 9], None, &[2, -4]), Err(seg_row_err(1, 9, 4)));
    assert_eq!(sg46(&[-1, 9], None, &[2, 1]), Err(seg_row_err(0, -1, 4)));
    // Rule 8 before rule 9.
    assert_eq!(
        sg46(&[1, 9], Some(&[-1, 0]), &[1, 1]),
        Err(seg_row_err(1, 9, 4))
    );
    let err = sg46(&[4], Some(&[0]), &[1]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather row 0: req_pool_index 4 is not a row of req_to_token (rows=4)."
    );
}

#[test]
fn segments_rule9_positions() {
    // start + len past the width: the first bad position is `cols`.
    let err = sg46(&[1], Some(&[4]), &[3]).unwrap_err();
    assert_eq!(err, seg_pos_err(0, 2, 6, 6));
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather [0,2]: position 6 is outside req_to_token width 6."
    );
    assert_eq!(sg46(&[1], Some(&[3]), &[4]), Err(seg_pos_err(0, 3, 6, 6)));
    // A start past the width is its own first bad position.
    assert_eq!(sg46(&[1], Some(&[9]), &[1]), Err(seg_pos_err(0, 0, 9, 6)));
    assert_eq!(sg46(&[1], Some(&[6]), &[1]), Err(seg_pos_err(0, 0, 6, 6)));
    // Negative start never wraps.
    assert_eq!(sg46(&[1], Some(&[-2]), &[2]), Err(seg_pos_err(0, 0, -2, 6)));
    // No start: a length past the width.
    assert_eq!(sg46(&[1, 2], None, &[6, 7]), Err(seg_pos_err(1, 6, 6, 6)));
    // The smallest bad segment.
    assert_eq!(
        sg46(&[1, 2, 3], Some(&[0, 5, -1]), &[2, 2, 2]),
        Err(seg_pos_err(1, 1, 6, 6))
    );
    // Empty segments are not checked for positions.
    assert_eq!(sg46(&[1, 2], Some(&[-100, 1]), &[0, 1]), Ok(vec![113]));
    // Rule 9 beats rule 10.
    let table = t46();
    let got = segment_gather(Table::new(4, 6, &table), &[1], Some(&[5]), &[2], Some(0));
    assert_eq!(got, Err(seg_pos_err(0, 1, 6, 6)));
}

#[test]
fn segments_huge_starts_and_lengths_do_not_overflow() {
    assert_eq!(
        sg46(&[1], Some(&[i64::MAX]), &[1]),
        Err(seg_pos_err(0, 0, i64::MAX, 6))
    );
    assert_eq!(
        sg46(&[1], Some(&[i64::MAX - 1]), &[5]),
        Err(seg_pos_err(0, 0, i64::MAX - 1, 6))
    );
    assert_eq!(
        sg46(&[1], Some(&[i64::MAX - 2]), &[i64::MAX]),
        Err(seg_pos_err(0, 0, i64::MAX - 2, 6))
    );
    assert_eq!(
        sg46(&[1], Some(&[0]), &[i64::MAX]),
        Err(seg_pos_err(0, 6, 6, 6))
    );
    assert_eq!(
        sg46(&[1], Some(&[i64::MIN]), &[i64::MAX]),
        Err(seg_pos_err(0, 0, i64::MIN, 6))
    );
}

#[test]
fn segments_capacity() {
    let table = t46();
    let run = |capacity| {
        segment_gather(
            Table::new(4, 6, &table),
            &[1, 2],
            Some(&[0, 2]),
            &[3, 2],
            capacity,
        )
    };
    assert_eq!(run(Some(5)), Ok(vec![106, 107, 108, 114, 115]));
    assert_eq!(
        run(Some(4)),
        Err(Error::CapacityExceeded {
            context: SEGMENT_CONTEXT.into(),
            count: 5,
            capacity: 4
        })
    );
}

// ---------------------------------------------------------------------------------------------
// plan (canary-plan.md §4-§6)
// ---------------------------------------------------------------------------------------------

#[test]
fn plan_fresh_buffers() {
    let b = PlanBuffers::fresh(3, 2);
    assert_eq!(b.verify_slot_indices, vec![0, 0, 0]);
    assert_eq!(b.verify_expected_tokens, vec![-1, -1, -1]);
    assert_eq!(b.verify_expected_positions, vec![0, 0, 0]);
    assert_eq!(b.verify_prev_slot_indices, vec![0, 0, 0]);
    assert_eq!(
        (b.verify_num_valid, b.enable, b.write_num_valid_reqs),
        (0, 1, 0)
    );
    assert_eq!(b.write_offsets, vec![0, 0, 0]);
    assert_eq!(b.write_seed_slot_indices, vec![0, 0]);
}

#[test]
fn plan_a_mixed_batch() {
    let step = Step::new(4, 16, linear(4, 16)).batch(&[1, 2, 3], &[0, 4, 10], &[8, 1, 1]);
    for start in [PlanBuffers::fresh(64, 8), poison(64, 8)] {
        let mut b = start.clone();
        step.run(&mut b).unwrap();
        let mut want = start;
        set_entries(
            &mut want,
            &concat(&[&range(32, 36), &range(48, 58)]),
            &minus_ones(14),
            &concat(&[&range(0, 4), &range(0, 10)]),
            &concat(&[&[-1], &range(32, 35), &[-1], &range(48, 57)]),
        );
        set_write(&mut want, &[0, 8, 9, 10, 0, 0, 0, 0, 0], &[-1, 35, 57]);
        assert_eq!(b, want);
    }
}

#[test]
fn plan_b_padding_row() {
    let step = Step::new(4, 16, linear(4, 16)).batch(&[1, 0, 2], &[5, 99, 3], &[1, 99, 1]);
    let mut b = poison(16, 4);
    step.run(&mut b).unwrap();
    let mut want = poison(16, 4);
    set_entries(
        &mut want,
        &[16, 17, 18, 19, 20, 32, 33, 34],
        &minus_ones(8),
        &[0, 1, 2, 3, 4, 0, 1, 2],
        &[-1, 16, 17, 18, 19, -1, 32, 33],
    );
    set_write(&mut want, &[0, 1, 1, 2, 0], &[20, -1, 34]);
    assert_eq!(b, want);
    // Padding rows are never checked, whatever their p and e.
    let step =
        Step::new(4, 16, linear(4, 16)).batch(&[0, 0], &[i64::MAX, i64::MIN], &[i64::MAX, -5]);
    let mut b = poison(4, 2);
    step.run(&mut b).unwrap();
    let mut want = poison(4, 2);
    set_entries(&mut want, &[], &[], &[], &[]);
    set_write(&mut want, &[0, 0, 0], &[-1, -1]);
    assert_eq!(b, want);
}

#[test]
fn plan_c_window_lut_and_real_predecessor() {
    let table: Vec<i64> = (0..32).map(|k| k - 2).collect();
    let lut: Vec<i64> = (0..14).map(|i| 10 * i).collect();
    let step = Step::new(4, 8, table)
        .batch(&[1], &[6], &[1])
        .window(2, lut);
    let mut b = poison(8, 1);
    step.run(&mut b).unwrap();
    let mut want = poison(8, 1);
    set_entries(&mut want, &[100, 110], &[-1, -1], &[4, 5], &[90, 100]);
    set_write(&mut want, &[0, 1], &[110]);
    assert_eq!(b, want);
}

#[test]
fn plan_c_lut_checks_cover_the_window_predecessor_only() {
    let identity: Vec<i64> = (0..33).collect();
    // Only T[1][3] = 40 (the predecessor of the window head) is outside the LUT.
    let mut table = linear(4, 8);
    table[8 + 3] = 40;
    let step = Step::new(4, 8, table)
        .batch(&[1], &[6], &[1])
        .window(2, identity.clone());
    let mut b = poison(8, 1);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::SwaSlotOutsideLut {
            slot: 40,
            lut_len: 33,
            request: 0,
            position: 3
        }
    );
    assert_disabled(&b);
    // T[1][2] is before the predecessor: never read, never checked.
    let mut table = linear(4, 8);
    table[8 + 2] = 40;
    let step = Step::new(4, 8, table)
        .batch(&[1], &[6], &[1])
        .window(2, identity);
    let mut b = poison(8, 1);
    step.run(&mut b).unwrap();
    let mut want = poison(8, 1);
    set_entries(&mut want, &[12, 13], &[-1, -1], &[4, 5], &[11, 12]);
    set_write(&mut want, &[0, 1], &[13]);
    assert_eq!(b, want);
}

#[test]
fn plan_d_negative_slots_pass_through() {
    let mut table = linear(4, 8);
    table[8 + 2] = -1;
    table[8 + 3] = 0;
    table[16] = -7;
    let identity: Vec<i64> = (0..33).collect();
    let step = Step::new(4, 8, table)
        .batch(&[1, 2], &[5, 3], &[1, 1])
        .window(8, identity);
    let mut b = PlanBuffers::fresh(16, 2);
    step.run(&mut b).unwrap();
    let mut want = PlanBuffers::fresh(16, 2);
    set_entries(
        &mut want,
        &[8, 9, -1, 0, 12, -7, 17, 18],
        &minus_ones(8),
        &[0, 1, 2, 3, 4, 0, 1, 2],
        &[-1, 8, 9, -1, 0, -1, -7, 17],
    );
    set_write(&mut want, &[0, 1, 2], &[12, 18]);
    assert_eq!(b, want);
}

#[test]
fn plan_d_negative_lut_entries_are_copied() {
    let lut: Vec<i64> = (0..33)
        .map(|i| if i % 3 == 0 { -1 } else { 1000 + i })
        .collect();
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 2], &[6, 4], &[1, 2])
        .window(5, lut);
    let mut b = PlanBuffers::fresh(16, 2);
    step.run(&mut b).unwrap();
    let mut want = PlanBuffers::fresh(16, 2);
    set_entries(
        &mut want,
        &[-1, 1010, 1011, -1, 1013, 1016, 1017, -1, 1019],
        &minus_ones(9),
        &[1, 2, 3, 4, 5, 0, 1, 2, 3],
        &[1008, -1, 1010, 1011, -1, -1, 1016, 1017, -1],
    );
    set_write(&mut want, &[0, 1, 3], &[1013, 1019]);
    assert_eq!(b, want);
}

#[test]
fn plan_lut_translates_even_without_window() {
    let lut: Vec<i64> = (0..32).map(|i| 500 + i).collect();
    for window in [0, -4] {
        let step = Step::new(4, 8, linear(4, 8))
            .batch(&[1], &[2], &[1])
            .window(window, lut.clone());
        let mut b = PlanBuffers::fresh(4, 1);
        step.run(&mut b).unwrap();
        let mut want = PlanBuffers::fresh(4, 1);
        set_entries(&mut want, &[508, 509], &[-1, -1], &[0, 1], &[-1, 508]);
        set_write(&mut want, &[0, 1], &[509]);
        assert_eq!(b, want, "W={window}");
    }
}

#[test]
fn plan_windows() {
    let identity: Vec<i64> = (0..32).collect();
    // W = 1: only the last prefix token, with its real predecessor.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 2], &[5, 1], &[1, 1])
        .window(1, identity.clone());
    let mut b = PlanBuffers::fresh(8, 2);
    step.run(&mut b).unwrap();
    let mut want = PlanBuffers::fresh(8, 2);
    set_entries(&mut want, &[12, 16], &[-1, -1], &[4, 0], &[11, -1]);
    set_write(&mut want, &[0, 1, 2], &[12, 16]);
    assert_eq!(b, want);
    // W >= p: the whole prefix.
    for window in [3, 4, 100, i32::MAX] {
        let step = Step::new(4, 8, linear(4, 8))
            .batch(&[3], &[3], &[2])
            .window(window, identity.clone());
        let mut b = PlanBuffers::fresh(8, 1);
        step.run(&mut b).unwrap();
        let mut want = PlanBuffers::fresh(8, 1);
        set_entries(
            &mut want,
            &[24, 25, 26],
            &[-1, -1, -1],
            &[0, 1, 2],
            &[-1, 24, 25],
        );
        set_write(&mut want, &[0, 2], &[26]);
        assert_eq!(b, want, "W={window}");
    }
    // A non-live request with a hugely negative prefix yields nothing (no overflow in p - W).
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[i64::MIN], &[1])
        .window(3, identity);
    let mut b = PlanBuffers::fresh(8, 1);
    step.run(&mut b).unwrap();
    let mut want = PlanBuffers::fresh(8, 1);
    set_entries(&mut want, &[], &[], &[], &[]);
    set_write(&mut want, &[0, 1], &[-1]);
    assert_eq!(b, want);
}

#[test]
fn plan_seeds() {
    // Seed is -1 for padding, e <= 0 or p <= 0; else the last prefix slot.
    let step =
        Step::new(4, 8, linear(4, 8)).batch(&[1, 2, 3, 0, 1], &[3, 2, 0, 4, 1], &[2, 0, 5, 1, -3]);
    let mut b = poison(16, 6);
    step.run(&mut b).unwrap();
    assert_eq!(b.write_seed_slot_indices, vec![10, -1, -1, -1, -1, 3005]);
    assert_eq!(b.write_offsets, vec![0, 2, 2, 7, 7, 7, 0]);
    assert_eq!(b.write_num_valid_reqs, 5);
    assert_eq!(b.verify_num_valid, 6);
}

#[test]
fn plan_bs0() {
    let step = Step::new(4, 8, linear(4, 8)).batch(&[], &[], &[]);
    let mut b = poison(4, 3);
    step.run(&mut b).unwrap();
    let mut want = poison(4, 3);
    set_entries(&mut want, &[], &[], &[], &[]);
    set_write(&mut want, &[0, 0, 0, 0], &[]);
    assert_eq!(b, want);
}

fn pool46() -> Vec<i64> {
    (0..24).map(|k| 100000 + k).collect()
}

#[test]
fn plan_e_expected_tokens() {
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 2], &[3, 4], &[1, 1])
        .pool(4, 6, pool46(), &[6, 2], -1);
    let mut b = poison(16, 2);
    step.run(&mut b).unwrap();
    let mut want = poison(16, 2);
    set_entries(
        &mut want,
        &[8, 9, 10, 16, 17, 18, 19],
        &[-1, 100006, 100007, -1, 100012, 100013, -1],
        &[0, 1, 2, 0, 1, 2, 3],
        &[-1, 8, 9, -1, 16, 17, 18],
    );
    set_write(&mut want, &[0, 1, 2], &[10, 19]);
    assert_eq!(b, want);

    // Offset +1 (EAGLE draft) and 0.
    for (offset, tokens) in [
        (1, [100007, 100008, 100009, 100013, -1, -1, -1]),
        (0, [100006, 100007, 100008, 100012, 100013, -1, -1]),
    ] {
        let step = Step::new(4, 8, linear(4, 8))
            .batch(&[1, 2], &[3, 4], &[1, 1])
            .pool(4, 6, pool46(), &[6, 2], offset);
        let mut b = PlanBuffers::fresh(16, 2);
        step.run(&mut b).unwrap();
        assert_eq!(&b.verify_expected_tokens[..7], &tokens, "off={offset}");
    }
}

#[test]
fn plan_pool_not_read_is_not_checked() {
    // valid_len 0 (or reads only at negative columns): no read, so neither the pool row nor its
    // width is checked.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[3, 1], &[2, 1], &[1, 1])
        .pool(1, 1, vec![5], &[0, 5], -1);
    let mut b = PlanBuffers::fresh(8, 2);
    step.run(&mut b).unwrap();
    assert_eq!(&b.verify_expected_tokens[..3], &[-1, -1, -1]);
    assert_eq!(&b.verify_slot_indices[..3], &[24, 25, 8]);
}

#[test]
fn plan_f_overflow() {
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1, 2], &[3, 4], &[1, 1]);
    for start in [PlanBuffers::fresh(6, 2), poison(6, 2)] {
        let mut b = start.clone();
        step.run(&mut b).unwrap();
        let mut want = start;
        want.verify_num_valid = 6;
        want.enable = 0;
        set_write(&mut want, &[0, 1, 2], &[10, 19]);
        assert_eq!(b, want);
    }
    // Exactly V fits.
    let mut b = poison(7, 2);
    step.run(&mut b).unwrap();
    assert_eq!((b.verify_num_valid, b.enable), (7, 1));
    // Overflow by many.
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1, 2, 3], &[8, 8, 8], &[1, 1, 1]);
    let mut b = poison(1, 3);
    step.run(&mut b).unwrap();
    let mut want = poison(1, 3);
    want.verify_num_valid = 1;
    want.enable = 0;
    set_write(&mut want, &[0, 1, 2, 3], &[15, 23, 31]);
    assert_eq!(b, want);
}

#[test]
fn plan_g_reuse_with_smaller_batch() {
    let base = Step::new(4, 8, linear(4, 8));
    let mut b = PlanBuffers::fresh(16, 4);
    base.clone()
        .batch(&[1, 2, 3, 1], &[2, 3, 4, 5], &[1, 1, 1, 1])
        .run(&mut b)
        .unwrap();
    let mut want = PlanBuffers::fresh(16, 4);
    set_entries(
        &mut want,
        &[8, 9, 16, 17, 18, 24, 25, 26, 27, 8, 9, 10, 11, 12],
        &minus_ones(14),
        &[0, 1, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4],
        &[-1, 8, -1, 16, 17, -1, 24, 25, 26, -1, 8, 9, 10, 11],
    );
    set_write(&mut want, &[0, 1, 2, 3, 4], &[9, 18, 27, 12]);
    assert_eq!(b, want);

    base.batch(&[1], &[3], &[1]).run(&mut b).unwrap();
    let want = PlanBuffers {
        verify_slot_indices: vec![8, 9, 10, 17, 18, 24, 25, 26, 27, 8, 9, 10, 11, 12, 0, 0],
        verify_expected_tokens: minus_ones(16),
        verify_expected_positions: vec![0, 1, 2, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 0],
        verify_prev_slot_indices: vec![-1, 8, 9, 16, 17, -1, 24, 25, 26, -1, 8, 9, 10, 11, 0, 0],
        verify_num_valid: 3,
        enable: 1,
        write_offsets: vec![0, 1, 0, 0, 0],
        write_seed_slot_indices: vec![10, 18, 27, 12],
        write_num_valid_reqs: 1,
    };
    assert_eq!(b, want);
}

#[test]
fn plan_g_overflow_after_prior_run_keeps_stale_entries() {
    let base = Step::new(4, 8, linear(4, 8));
    let mut b = PlanBuffers::fresh(10, 3);
    base.clone()
        .batch(&[2, 3], &[4, 5], &[1, 1])
        .run(&mut b)
        .unwrap();
    base.batch(&[1, 2, 3], &[8, 8, 8], &[1, 1, 1])
        .run(&mut b)
        .unwrap();
    let want = PlanBuffers {
        verify_slot_indices: vec![16, 17, 18, 19, 24, 25, 26, 27, 28, 0],
        verify_expected_tokens: minus_ones(10),
        verify_expected_positions: vec![0, 1, 2, 3, 0, 1, 2, 3, 4, 0],
        verify_prev_slot_indices: vec![-1, 16, 17, 18, -1, 24, 25, 26, 27, 0],
        verify_num_valid: 10,
        enable: 0,
        write_offsets: vec![0, 1, 2, 3],
        write_seed_slot_indices: vec![15, 23, 31],
        write_num_valid_reqs: 3,
    };
    assert_eq!(b, want);
}

#[test]
fn plan_h_swa_slot_outside_lut() {
    let identity10: Vec<i64> = (0..10).collect();
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[3], &[1])
        .window(4, identity10);
    let mut b = poison(8, 1);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::SwaSlotOutsideLut {
            slot: 10,
            lut_len: 10,
            request: 0,
            position: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "kv-canary: SWA slot 10 is outside full_to_swa_index_mapping length 10 (request 0, position 2)"
    );
    assert_eq!(err.kind(), "swa_slot_outside_lut");
    assert_disabled(&b);
}

#[test]
fn plan_swa_first_offender() {
    let lut: Vec<i64> = (0..20).collect();
    let mut table = linear(4, 8);
    // Request 0 (row 1): bad at columns 3 and 1; request 1 (row 2, all >= 16): bad at column 4.
    table[8 + 3] = 50;
    table[8 + 1] = 60;
    table[16 + 4] = 70;
    let step = Step::new(4, 8, table.clone())
        .batch(&[1, 2], &[5, 5], &[1, 1])
        .window(0, lut.clone());
    let mut b = poison(16, 2);
    assert_eq!(
        step.run(&mut b),
        Err(Error::SwaSlotOutsideLut {
            slot: 60,
            lut_len: 20,
            request: 0,
            position: 1
        })
    );
    // Request 0 reads only up to column 0 now: request 1 is first.
    let step = Step::new(4, 8, table)
        .batch(&[1, 2], &[1, 5], &[1, 1])
        .window(0, lut);
    let mut b = poison(16, 2);
    assert_eq!(
        step.run(&mut b),
        Err(Error::SwaSlotOutsideLut {
            slot: 70,
            lut_len: 20,
            request: 1,
            position: 4
        })
    );
    assert_disabled(&b);
}

#[test]
fn plan_rule12_req_pool_index() {
    let step = Step::new(4, 8, linear(4, 8)).batch(&[-1, -3], &[1, 1], &[1, 1]);
    let mut b = poison(8, 2);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::ReqPoolIndexOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(0),
            value: -1,
            rows: 4,
        }
    );
    assert_eq!(err.kind(), "req_pool_index_out_of_range");
    assert!(
        err.to_string().starts_with(
            "kv-canary: request 0: req_pool_index -1 is not a row of req_to_token (rows=4)"
        ),
        "{err}"
    );
    assert_disabled(&b);
    // q == rows, smallest r.
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1, 4, 9], &[1, 1, 1], &[1, 1, 1]);
    let mut b = poison(8, 3);
    assert_eq!(
        step.run(&mut b),
        Err(Error::ReqPoolIndexOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(1),
            value: 4,
            rows: 4,
        })
    );
    // Rows beyond the table with p <= 0 are never dereferenced.
    let step = Step::new(4, 8, linear(4, 8)).batch(&[9, -2], &[0, -1], &[3, 2]);
    let mut b = PlanBuffers::fresh(8, 2);
    step.run(&mut b).unwrap();
    let mut want = PlanBuffers::fresh(8, 2);
    set_entries(&mut want, &[], &[], &[], &[]);
    set_write(&mut want, &[0, 3, 5], &[-1, -1]);
    assert_eq!(b, want);
}

#[test]
fn plan_rule13_prefix_beyond_width() {
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1], &[9], &[1]);
    let mut b = poison(16, 1);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::PositionOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(0),
            position: 9,
            cols: 8,
        }
    );
    assert!(
        err.to_string()
            .starts_with("kv-canary: request 0: position 9"),
        "{err}"
    );
    assert_disabled(&b);
    // p == cols is fine.
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1], &[8], &[1]);
    let mut b = poison(16, 1);
    step.run(&mut b).unwrap();
    assert_eq!(b.verify_num_valid, 8);
}

#[test]
fn plan_pool_errors() {
    // Rule 15: pool rows 2, request 1 uses row 3 and reads.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 3], &[2, 2], &[1, 1])
        .pool(2, 6, (0..12).collect(), &[2, 2], 0);
    let mut b = poison(8, 2);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::ExpectedPoolRowOutOfRange {
            request: 1,
            row: 3,
            pool_rows: 2
        }
    );
    assert_eq!(err.kind(), "expected_pool_row_out_of_range");
    assert!(err.to_string().starts_with("kv-canary: "));
    assert_disabled(&b);
    // Rule 16: valid length 8 on a 6-wide pool.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[8], &[1])
        .pool(4, 6, pool46(), &[8], 0);
    let mut b = poison(16, 1);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(
        err,
        Error::ExpectedPoolPositionOutOfRange {
            request: 0,
            column: 7,
            pool_cols: 6,
            valid_len: 8
        }
    );
    assert_eq!(err.kind(), "expected_pool_position_out_of_range");
    assert_disabled(&b);
    // The largest column read is min(p - 1 + off, valid_len - 1).
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[6], &[1])
        .pool(4, 6, pool46(), &[8], 1);
    let mut b = poison(16, 1);
    assert_eq!(
        step.run(&mut b),
        Err(Error::ExpectedPoolPositionOutOfRange {
            request: 0,
            column: 6,
            pool_cols: 6,
            valid_len: 8
        })
    );
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[8], &[1])
        .pool(4, 6, pool46(), &[6], 0);
    let mut b = poison(16, 1);
    step.run(&mut b).unwrap();
    assert_eq!(
        &b.verify_expected_tokens[..8],
        &[100006, 100007, 100008, 100009, 100010, 100011, -1, -1]
    );
}

#[test]
fn plan_write_offsets_overflow() {
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1, 2, 3], &[0, 0, 0], &[i64::MAX - 1, 1, 5]);
    let mut b = poison(8, 3);
    let err = step.run(&mut b).unwrap_err();
    assert_eq!(err, Error::WriteOffsetsOverflow { request: 2 });
    assert_eq!(err.kind(), "write_offsets_overflow");
    assert!(err.to_string().starts_with("kv-canary: "));
    assert_disabled(&b);
    // Exactly i64::MAX is fine; padding rows and e <= 0 do not count.
    let step = Step::new(4, 8, linear(4, 8)).batch(
        &[1, 0, 2, 3],
        &[0, 0, 0, 0],
        &[i64::MAX - 1, i64::MAX, -5, 1],
    );
    let mut b = PlanBuffers::fresh(8, 4);
    step.run(&mut b).unwrap();
    assert_eq!(
        b.write_offsets,
        vec![0, i64::MAX - 1, i64::MAX - 1, i64::MAX - 1, i64::MAX]
    );
}

#[test]
fn plan_device_rule_order() {
    let lut: Vec<i64> = (0..20).collect();
    let mut bad_lut_table = linear(4, 8);
    bad_lut_table[8] = 50; // T[1][0] outside the LUT
    // 12 beats 13 even for a later request.
    let step = Step::new(4, 8, linear(4, 8)).batch(&[1, 7], &[9, 1], &[1, 1]);
    assert_eq!(
        step.run(&mut poison(8, 2)).unwrap_err().kind(),
        "req_pool_index_out_of_range"
    );
    // 13 beats 14.
    let step = Step::new(4, 8, bad_lut_table.clone())
        .batch(&[1, 2], &[1, 9], &[1, 1])
        .window(0, lut.clone());
    assert_eq!(
        step.run(&mut poison(8, 2)),
        Err(Error::PositionOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(1),
            position: 9,
            cols: 8,
        })
    );
    // 14 beats 15.
    let step = Step::new(4, 8, bad_lut_table.clone())
        .batch(&[3, 1], &[1, 1], &[1, 1])
        .window(0, lut.clone())
        .pool(2, 6, (0..12).collect(), &[1, 1], 0);
    assert_eq!(
        step.run(&mut poison(8, 2)).unwrap_err().kind(),
        "swa_slot_outside_lut"
    );
    // 15 beats 16.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 3], &[8, 1], &[1, 1])
        .pool(2, 6, (0..12).collect(), &[8, 1], 0);
    assert_eq!(
        step.run(&mut poison(16, 2)).unwrap_err().kind(),
        "expected_pool_row_out_of_range"
    );
    // 16 beats 17.
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1, 2], &[8, 0], &[i64::MAX, i64::MAX])
        .pool(4, 6, pool46(), &[8, 0], 0);
    assert_eq!(
        step.run(&mut poison(16, 2)).unwrap_err().kind(),
        "expected_pool_position_out_of_range"
    );
}

#[test]
fn plan_value_checks_apply_on_overflow() {
    let identity10: Vec<i64> = (0..10).collect();
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[3], &[1])
        .window(4, identity10);
    let mut b = poison(1, 1);
    assert_eq!(step.run(&mut b).unwrap_err().kind(), "swa_slot_outside_lut");
    assert_disabled(&b);
    let step = Step::new(4, 8, linear(4, 8))
        .batch(&[1], &[8], &[1])
        .pool(4, 6, pool46(), &[8], 0);
    let mut b = poison(1, 1);
    assert_eq!(
        step.run(&mut b).unwrap_err().kind(),
        "expected_pool_position_out_of_range"
    );
    assert_disabled(&b);
}

#[test]
fn plan_device_error_after_good_run_disables() {
    let base = Step::new(4, 8, linear(4, 8));
    let mut b = PlanBuffers::fresh(16, 4);
    base.clone()
        .batch(&[1, 2], &[3, 4], &[1, 1])
        .run(&mut b)
        .unwrap();
    assert_eq!(
        (b.enable, b.verify_num_valid, b.write_num_valid_reqs),
        (1, 7, 2)
    );
    base.clone()
        .batch(&[1, 5], &[3, 4], &[1, 1])
        .run(&mut b)
        .unwrap_err();
    assert_disabled(&b);
    // The next good run re-enables.
    base.batch(&[3], &[2], &[1]).run(&mut b).unwrap();
    assert_eq!(
        (b.enable, b.verify_num_valid, b.write_num_valid_reqs),
        (1, 2, 1)
    );
    assert_eq!(&b.verify_slot_indices[..2], &[24, 25]);
}

// ---------------------------------------------------------------------------------------------
// Status records
// ---------------------------------------------------------------------------------------------

#[test]
fn status_round_trip_every_data_dependent_kind() {
    let gather_ctx = "ctx here";
    let gather_errors = [
        Error::EmptyTableNonemptyMask {
            context: gather_ctx.into(),
        },
        Error::MaskShapeMismatch {
            context: gather_ctx.into(),
            mask: Dims(vec![3, 5]),
            pos2d: Dims(vec![2, 5]),
        },
        Error::IndexShapeMismatch {
            context: gather_ctx.into(),
            n: 3,
            rows: 2,
            cols: 7,
        },
        Error::MaskIndexShapeMismatch {
            context: gather_ctx.into(),
            n: 4,
            rows: 1,
            cols: 2,
        },
        Error::ReqPoolIndexOutOfRange {
            context: gather_ctx.into(),
            site: Site::Row(6),
            value: -9,
            rows: 4,
        },
        Error::ReqPoolIndexOutOfRange {
            context: gather_ctx.into(),
            site: Site::Row(0),
            value: i64::MAX,
            rows: 0,
        },
        Error::PositionOutOfRange {
            context: gather_ctx.into(),
            site: Site::Cell(2, 11),
            position: i64::MIN,
            cols: 6,
        },
        Error::PositionOutOfRange {
            context: gather_ctx.into(),
            site: Site::Cell(0, 0),
            position: i64::MAX - 1,
            cols: 6,
        },
        Error::CapacityExceeded {
            context: gather_ctx.into(),
            count: 5,
            capacity: 4,
        },
    ];
    for error in gather_errors {
        let words = status::encode(&Err(error.clone()));
        assert_ne!(
            words[kvplan_kernels::status::CODE],
            kvplan_kernels::status::OK,
            "{error:?}"
        );
        assert_eq!(status::decode(&words, gather_ctx), Err(error.clone()));
        // The context is re-attached at decode time, so segments decode with theirs.
        assert_eq!(
            status::decode(&words, gather_ctx).unwrap_err().kind(),
            error.kind()
        );
    }
    let plan_errors = [
        Error::ReqPoolIndexOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(3),
            value: -1,
            rows: 4,
        },
        Error::PositionOutOfRange {
            context: PLAN_CONTEXT.into(),
            site: Site::Request(1),
            position: 9,
            cols: 8,
        },
        Error::SwaSlotOutsideLut {
            slot: 70,
            lut_len: 65,
            request: 2,
            position: 5,
        },
        Error::ExpectedPoolRowOutOfRange {
            request: 1,
            row: 3,
            pool_rows: 2,
        },
        Error::ExpectedPoolPositionOutOfRange {
            request: 0,
            column: 7,
            pool_cols: 6,
            valid_len: 8,
        },
        Error::WriteOffsetsOverflow { request: 4096 },
        // Not a plan rule, but also context-free: a launch too wide for the device.
        Error::IndexRange {
            elements: 5 << 30,
            limit: 1 << 31,
        },
    ];
    for error in plan_errors {
        let words = status::encode(&Err(error.clone()));
        // Plan messages carry their own context, whatever the decoder is given.
        assert_eq!(status::decode(&words, ""), Err(error.clone()));
        assert_eq!(status::decode(&words, "ignored"), Err(error));
    }
}

#[test]
fn status_round_trip_ok_and_unknown() {
    for count in [0usize, 1, 5, 1 << 40] {
        assert_eq!(status::decode(&status::encode(&Ok(count)), "x"), Ok(count));
    }
    // Host-rule kinds never travel in a status: they encode as an unknown code.
    let words = status::encode(&Err(Error::EmptyLut));
    assert_eq!(
        status::decode(&words, "x"),
        Err(Error::CorruptStatus { code: -1 })
    );
    let mut words = status::encode(&Ok(3));
    words[kvplan_kernels::status::CODE] = 12345;
    assert_eq!(
        status::decode(&words, "x"),
        Err(Error::CorruptStatus { code: 12345 })
    );
}

#[test]
fn status_of_reference_errors_round_trips() {
    // The errors the reference actually produces survive the record (context re-attached).
    let outcomes = [
        mg46(&[1, 4], &[0, 0], &[1, 0], [2, 1]),
        mg46(&[1, 2], &[0, 7, 9, -1, 0, 0], &[1, 1, 1, 1, 1, 1], [2, 3]),
        mg46(&[1, 2, 3], &[0, 1], &[1, 1], [1, 2]),
    ];
    for outcome in outcomes {
        let error = outcome.unwrap_err();
        assert_eq!(
            status::decode(&status::encode(&Err(error.clone())), CTX),
            Err(error)
        );
    }
    let seg = sg46(&[1, 1, 1], Some(&[0, 0]), &[1, 1, 1]).unwrap_err();
    assert_eq!(
        status::decode(&status::encode(&Err(seg.clone())), SEGMENT_CONTEXT),
        Err(seg)
    );
}

// ---------------------------------------------------------------------------------------------
// Properties on random valid inputs
// ---------------------------------------------------------------------------------------------

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        rng_seed: RngSeed::Fixed(0x6b76_706c_616e),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

#[derive(Debug, Clone)]
struct MaskedCase {
    rows: usize,
    cols: usize,
    table: Vec<i64>,
    rpi: Vec<i64>,
    pos2d: Vec<i64>,
    mask: Vec<bool>,
    shape: [usize; 2],
}

fn masked_case() -> impl Strategy<Value = MaskedCase> {
    (1usize..5, 1usize..8, 0usize..6, 0usize..6, any::<bool>()).prop_flat_map(
        |(rows, cols, r, c, shared)| {
            let n = if shared { 1 } else { r };
            (
                vec(i32::MIN as i64..=i32::MAX as i64, rows * cols),
                vec(0..rows as i64, n),
                vec(0..cols as i64, r * c),
                vec(any::<i64>(), r * c),
                vec(any::<bool>(), r * c),
            )
                .prop_map(move |(table, rpi, pos, junk, mask)| {
                    // Masked-off cells hold anything.
                    let pos2d = pos
                        .iter()
                        .zip(&junk)
                        .zip(&mask)
                        .map(|((&p, &j), &m)| if m { p } else { j })
                        .collect();
                    MaskedCase {
                        rows,
                        cols,
                        table,
                        rpi,
                        pos2d,
                        mask,
                        shape: [r, c],
                    }
                })
        },
    )
}

#[derive(Debug, Clone)]
struct SegmentCase {
    rows: usize,
    cols: usize,
    table: Vec<i64>,
    rpi: Vec<i64>,
    start: Option<Vec<i64>>,
    lengths: Vec<i64>,
}

fn segment_case() -> impl Strategy<Value = SegmentCase> {
    (
        1usize..5,
        1usize..8,
        0usize..6,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_flat_map(|(rows, cols, s, has_start, shared)| {
            // Without start, P = n must equal S.
            let n = if shared && has_start { 1 } else { s };
            (
                vec(-1000i64..1000, rows * cols),
                vec(0..rows as i64, n),
                vec(-2i64..=cols as i64, s),
                vec(0.0f64..1.0, s),
                vec(-50i64..50, s),
            )
                .prop_map(move |(table, rpi, lengths, fraction, junk)| {
                    let start = has_start.then(|| {
                        lengths
                            .iter()
                            .zip(&fraction)
                            .zip(&junk)
                            .map(|((&len, &f), &j)| {
                                if len <= 0 {
                                    j
                                } else {
                                    // start in [0, cols - len].
                                    ((cols as i64 - len + 1) as f64 * f).floor() as i64
                                }
                            })
                            .collect()
                    });
                    SegmentCase {
                        rows,
                        cols,
                        table,
                        rpi,
                        start,
                        lengths,
                    }
                })
        })
}

#[derive(Debug, Clone)]
struct PlanCase {
    step: Step,
    prior: PlanBuffers,
}

fn plan_case() -> impl Strategy<Value = PlanCase> {
    let dims = (
        1usize..5,
        1usize..10,
        0usize..7,
        -2i32..12,
        any::<bool>(),
        any::<bool>(),
        -1i32..=1,
    );
    let capacities = (1usize..40, 0usize..3);
    (dims, capacities).prop_flat_map(
        |((rows, cols, bs, window, lut, has_pool, offset), (v, extra))| {
            let has_lut = lut || window > 0;
            let lut_len = 48usize;
            let pool_cols = cols + 2;
            let k = (bs + extra).max(1);
            let inputs = (
                vec(-3i64..lut_len as i64, rows * cols),
                vec(-5i64..200_000, lut_len),
                vec(0..rows as i64, bs),
                vec(-2i64..=cols as i64, bs),
                vec(-3i64..6, bs),
                vec(-1i64..=pool_cols as i64, bs),
                vec(-100_000i64..100_000, rows * pool_cols),
                vec(any::<bool>(), bs),
            );
            let prior = (
                vec(any::<i64>(), v),
                vec(any::<i64>(), v),
                vec(any::<i64>(), v),
                vec(any::<i64>(), v),
                any::<i32>(),
                0i32..=1,
                vec(any::<i64>(), k + 1),
                vec(any::<i64>(), k),
                any::<i32>(),
            );
            (inputs, prior).prop_map(
                move |((table, lut, rpi, prefix, extend, valid_lens, pool, wild), prior)| {
                    // Padding rows may carry any prefix, far beyond the table.
                    let prefix = prefix
                        .iter()
                        .zip(&rpi)
                        .zip(&wild)
                        .map(|((&p, &q), &w)| if q == 0 && w { p * 1000 + 7 } else { p })
                        .collect::<Vec<_>>();
                    let mut step = Step::new(rows, cols, table).batch(&rpi, &prefix, &extend);
                    step.window = window;
                    if has_lut {
                        step.lut = Some(lut);
                    }
                    if has_pool {
                        step = step.pool(rows, pool_cols, pool, &valid_lens, offset);
                    }
                    let prior = PlanBuffers {
                        verify_slot_indices: prior.0,
                        verify_expected_tokens: prior.1,
                        verify_expected_positions: prior.2,
                        verify_prev_slot_indices: prior.3,
                        verify_num_valid: prior.4,
                        enable: prior.5,
                        write_offsets: prior.6,
                        write_seed_slot_indices: prior.7,
                        write_num_valid_reqs: prior.8,
                    };
                    PlanCase { step, prior }
                },
            )
        },
    )
}

impl Step {
    fn xlat(&self, slot: i64) -> i64 {
        match &self.lut {
            Some(lut) if slot >= 0 => lut[slot as usize],
            _ => slot,
        }
    }

    fn at(&self, q: i64, c: i64) -> i64 {
        self.table[q as usize * self.cols + c as usize]
    }

    /// `(r, positions)` of every request with verify entries, by the `min(p, W)` formulation.
    fn verify_ranges(&self) -> Vec<(usize, std::ops::Range<i64>)> {
        let mut ranges = Vec::new();
        for (r, (&q, &p)) in self.rpi.iter().zip(&self.prefix).enumerate() {
            if q == 0 || p <= 0 {
                continue;
            }
            let len = if self.window > 0 {
                p.min(i64::from(self.window))
            } else {
                p
            };
            ranges.push((r, p - len..p));
        }
        ranges
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn prop_masked_gather_collects_true_cells(case in masked_case()) {
        let MaskedCase { rows, cols, table, rpi, pos2d, mask, shape } = &case;
        let got = masked_gather(Table::new(*rows, *cols, table), rpi, pos2d, mask, *shape, None, CTX);
        let [r, c] = *shape;
        let mut want = Vec::new();
        for i in 0..r {
            let q = if rpi.len() == 1 { rpi[0] } else { rpi[i] } as usize;
            for j in 0..c {
                if mask[i * c + j] {
                    want.push(table[q * cols + pos2d[i * c + j] as usize]);
                }
            }
        }
        prop_assert_eq!(want.len(), mask.iter().filter(|&&m| m).count());
        prop_assert_eq!(&got, &Ok(want.clone()));
        // Capacity mode with a tight capacity agrees; one less fails with the exact facts.
        let tight = masked_gather(Table::new(*rows, *cols, table), rpi, pos2d, mask, *shape, Some(want.len()), CTX);
        prop_assert_eq!(tight, Ok(want.clone()));
        if !want.is_empty() {
            let short = masked_gather(Table::new(*rows, *cols, table), rpi, pos2d, mask, *shape, Some(want.len() - 1), CTX);
            prop_assert_eq!(short, Err(Error::CapacityExceeded {
                context: CTX.into(),
                count: want.len() as u64,
                capacity: want.len() - 1,
            }));
        }
    }

    #[test]
    fn prop_segment_gather_equals_masked_rectangle(case in segment_case()) {
        let SegmentCase { rows, cols, table, rpi, start, lengths } = &case;
        let table = Table::new(*rows, *cols, table);
        let got = segment_gather(table, rpi, start.as_deref(), lengths, None);
        let width = lengths.iter().copied().max().unwrap_or(0);
        if width <= 0 {
            prop_assert_eq!(got, Ok(vec![]));
            return Ok(());
        }
        let (s, l) = (lengths.len(), width as usize);
        let mut pos2d = vec![0; s * l];
        let mut mask = vec![false; s * l];
        for i in 0..s {
            for j in 0..l {
                let first = start.as_ref().map_or(0, |start| start[i]);
                pos2d[i * l + j] = first.wrapping_add(j as i64);
                mask[i * l + j] = (j as i64) < lengths[i];
            }
        }
        let rect = masked_gather(table, rpi, &pos2d, &mask, [s, l], None, SEGMENT_CONTEXT);
        prop_assert!(rect.is_ok(), "{:?}", rect);
        prop_assert_eq!(&got, &rect);
        let total: i64 = lengths.iter().map(|&len| len.max(0)).sum();
        prop_assert_eq!(got.unwrap().len() as i64, total);
    }

    #[test]
    fn prop_plan_invariants(case in plan_case()) {
        let PlanCase { step, prior } = &case;
        let mut b = prior.clone();
        prop_assert_eq!(step.run(&mut b), Ok(()));
        let bs = step.rpi.len();
        let v = prior.verify_slot_indices.len();
        let k = prior.write_seed_slot_indices.len();

        // (1) write offsets: exclusive prefix sum of effective extend lengths, zero past bs.
        let mut offsets = vec![0i64; k + 1];
        for r in 0..bs {
            let e = step.extend[r];
            offsets[r + 1] = offsets[r] + if step.rpi[r] != 0 && e > 0 { e } else { 0 };
        }
        prop_assert_eq!(&b.write_offsets, &offsets);
        prop_assert_eq!(b.write_num_valid_reqs, bs as i32);

        // Seeds up to bs; stale past bs.
        for r in 0..k {
            let (q, p, e) = if r < bs { (step.rpi[r], step.prefix[r], step.extend[r]) } else { (0, 0, 0) };
            let want = if r >= bs {
                prior.write_seed_slot_indices[r]
            } else if q == 0 || e <= 0 || p <= 0 {
                -1
            } else {
                step.xlat(step.at(q, p - 1))
            };
            prop_assert_eq!(b.write_seed_slot_indices[r], want, "seed {}", r);
        }

        // (2) verify count, with overflow.
        let ranges = step.verify_ranges();
        let total: i64 = ranges.iter().map(|(_, range)| range.end - range.start).sum();
        if total > v as i64 {
            prop_assert_eq!((b.verify_num_valid, b.enable), (v as i32, 0));
            prop_assert_eq!(&b.verify_slot_indices, &prior.verify_slot_indices);
            prop_assert_eq!(&b.verify_expected_tokens, &prior.verify_expected_tokens);
            prop_assert_eq!(&b.verify_expected_positions, &prior.verify_expected_positions);
            prop_assert_eq!(&b.verify_prev_slot_indices, &prior.verify_prev_slot_indices);
            return Ok(());
        }
        prop_assert_eq!((b.verify_num_valid, b.enable), (total as i32, 1));

        // (3) every emitted entry, then the stale tail.
        let mut index = 0;
        for (r, positions) in ranges {
            let q = step.rpi[r];
            for pos in positions {
                prop_assert_eq!(b.verify_slot_indices[index], step.xlat(step.at(q, pos)));
                prop_assert_eq!(b.verify_expected_positions[index], pos);
                let prev = if pos == 0 { -1 } else { step.xlat(step.at(q, pos - 1)) };
                prop_assert_eq!(b.verify_prev_slot_indices[index], prev);
                let token = match &step.pool {
                    Some((_, pool_cols, data)) => {
                        let column = pos + i64::from(step.offset);
                        if column >= 0 && column < step.valid_lens[r] {
                            data[q as usize * pool_cols + column as usize]
                        } else {
                            -1
                        }
                    }
                    None => -1,
                };
                prop_assert_eq!(b.verify_expected_tokens[index], token);
                index += 1;
            }
        }
        prop_assert_eq!(&b.verify_slot_indices[index..], &prior.verify_slot_indices[index..]);
        prop_assert_eq!(&b.verify_expected_tokens[index..], &prior.verify_expected_tokens[index..]);
        prop_assert_eq!(&b.verify_expected_positions[index..], &prior.verify_expected_positions[index..]);
        prop_assert_eq!(&b.verify_prev_slot_indices[index..], &prior.verify_prev_slot_indices[index..]);
    }
}

// ---------------------------------------------------------------------------------------------
// Slots (spec slots.md): segment_assign and store_kv
// ---------------------------------------------------------------------------------------------

mod slots {
    use super::super::{Segments, segment_assign, store_kv};
    use super::t46;
    use crate::error::{ASSIGN_CONTEXT, Error, STORE_CONTEXT, Site};
    use crate::status;

    /// `segment_assign` on the 4x6 table `100 + k` of an int32 table; the table after the call.
    fn sa46(rpi: &[i64], start: &[i64], lengths: &[i64], loc: &[i64]) -> Result<Vec<i64>, Error> {
        let mut table = t46();
        let segments = Segments {
            req_pool_indices: rpi,
            start,
            lengths,
        };
        let before = table.clone();
        let outcome = segment_assign(
            &mut table,
            [4, 6],
            segments,
            loc,
            i64::from(i32::MAX),
            ASSIGN_CONTEXT,
        );
        match outcome {
            Ok(written) => {
                assert_eq!(written, loc.len());
                Ok(table)
            }
            Err(error) => {
                assert_eq!(table, before, "an error leaves the table unchanged");
                Err(error)
            }
        }
    }

    fn with(cells: &[(usize, i64)]) -> Vec<i64> {
        let mut table = t46();
        for &(at, value) in cells {
            table[at] = value;
        }
        table
    }

    #[test]
    fn assign_writes_each_run_and_nothing_else() {
        assert_eq!(
            sa46(&[1, 3], &[0, 2], &[3, 2], &[7, 8, 9, 10, 11]),
            Ok(with(&[(6, 7), (7, 8), (8, 9), (20, 10), (21, 11)]))
        );
        // Runs sharing a row, side by side; an empty run anywhere (even at `cols`); padding.
        assert_eq!(
            sa46(
                &[2, 0, 2, 1],
                &[3, 0, 0, 6],
                &[3, 0, 3, 0],
                &[1, 2, 3, 4, 5, 6]
            ),
            Ok(with(&[
                (15, 1),
                (16, 2),
                (17, 3),
                (12, 4),
                (13, 5),
                (14, 6)
            ]))
        );
        assert_eq!(sa46(&[], &[], &[], &[]), Ok(t46()));
        // An empty run inside another run writes nothing, so it conflicts with nothing.
        assert_eq!(
            sa46(&[1, 1], &[0, 2], &[4, 0], &[1, 2, 3, 4]),
            Ok(with(&[(6, 1), (7, 2), (8, 3), (9, 4)]))
        );
        assert_eq!(
            sa46(&[1], &[5], &[1], &[i64::from(i32::MAX)]),
            Ok(with(&[(11, i64::from(i32::MAX))]))
        );
    }

    #[test]
    fn assign_value_rules_with_their_facts() {
        let context = || ASSIGN_CONTEXT.to_string();
        let row = |i, value| Error::ReqPoolIndexOutOfRange {
            context: context(),
            site: Site::Row(i),
            value,
            rows: 4,
        };
        // Rule 1, every request (an empty run too).
        assert_eq!(sa46(&[1, 4], &[0, 0], &[1, 0], &[5]), Err(row(1, 4)));
        assert_eq!(sa46(&[-1], &[0], &[0], &[]), Err(row(0, -1)));
        // Rule 2.
        assert_eq!(
            sa46(&[1, 0], &[0, 0], &[1, -2], &[5]),
            Err(Error::PaddingRowLength {
                context: context(),
                request: 1,
                length: -2,
            })
        );
        // Rule 3.
        assert_eq!(
            sa46(&[1, 2], &[0, 0], &[1, -2], &[5]),
            Err(Error::NegativeLength {
                context: context(),
                request: 1,
                length: -2,
            })
        );
        // Rule 4: the first column outside the table; an empty run past the width; no overflow.
        let position = |i, j, position| Error::PositionOutOfRange {
            context: context(),
            site: Site::Cell(i, j),
            position,
            cols: 6,
        };
        assert_eq!(
            sa46(&[1, 2], &[0, 4], &[2, 3], &[5, 6, 7, 8, 9]),
            Err(position(1, 2, 6))
        );
        assert_eq!(sa46(&[1], &[-2], &[1], &[5]), Err(position(0, 0, -2)));
        assert_eq!(sa46(&[1], &[7], &[0], &[]), Err(position(0, 0, 7)));
        assert_eq!(
            sa46(&[1], &[i64::MAX - 1], &[3], &[5, 6, 7]),
            Err(position(0, 0, i64::MAX - 1))
        );
        // Rule 5.
        assert_eq!(
            sa46(&[1, 2], &[0, 0], &[2, 1], &[5, 6]),
            Err(Error::SlotCountMismatch {
                context: context(),
                len: 2,
                sum: 3,
            })
        );
        // Rule 6: named by request and column.
        assert_eq!(
            sa46(&[1, 2], &[0, 3], &[2, 2], &[5, 6, 7, 1 << 31]),
            Err(Error::SlotOutOfRange {
                context: context(),
                request: 1,
                column: 4,
                index: 3,
                slot: 1 << 31,
                max: i64::from(i32::MAX),
            })
        );
        // Rule 7: the later request, its first overlapped earlier one, their first shared cell.
        assert_eq!(
            sa46(
                &[3, 1, 3, 3],
                &[0, 0, 4, 2],
                &[3, 1, 2, 3],
                &[1, 2, 3, 4, 5, 6, 7, 8, 9]
            ),
            Err(Error::WriteConflict {
                context: context(),
                request: 3,
                other: 0,
                row: 3,
                column: 2,
            })
        );
    }

    #[test]
    fn assign_rules_in_order() {
        // Row (rule 1) before the conflict (rule 7) and the count (rule 5).
        assert_eq!(
            sa46(&[1, 1, 9], &[0, 0, 0], &[1, 1, 0], &[5])
                .unwrap_err()
                .kind(),
            "req_pool_index_out_of_range"
        );
        // A negative length at request 2 before a bad start at request 0.
        assert_eq!(
            sa46(&[1, 2, 3], &[-5, 0, 0], &[1, 1, -1], &[5, 6])
                .unwrap_err()
                .kind(),
            "negative_length"
        );
        // The count before a bad slot; a bad slot before a conflict.
        assert_eq!(
            sa46(&[1], &[0], &[2], &[-1]).unwrap_err().kind(),
            "slot_count_mismatch"
        );
        assert_eq!(
            sa46(&[1, 1], &[0, 1], &[2, 2], &[5, 6, 7, -8])
                .unwrap_err()
                .kind(),
            "slot_out_of_range"
        );
    }

    #[test]
    fn store_moves_rows_and_padding_keeps_the_last() {
        let mut cache: Vec<u16> = (0..12).collect();
        let values: Vec<u16> = (100..110).collect();
        // Rows of 2: tokens 0 and 3 name slot 0; token 3 is the last, so slot 0 keeps its row.
        assert_eq!(
            store_kv(&mut cache, [6, 2], &[0, 5, 2, 0, 1], &values, STORE_CONTEXT),
            Ok(5)
        );
        assert_eq!(
            cache,
            vec![106, 107, 108, 109, 104, 105, 6, 7, 8, 9, 102, 103]
        );
    }

    #[test]
    fn store_rules_with_their_facts() {
        let context = || STORE_CONTEXT.to_string();
        let run = |loc: &[i64]| {
            let mut cache = vec![0u8; 8];
            let values = vec![1u8; loc.len()];
            let outcome = store_kv(&mut cache, [8, 1], loc, &values, STORE_CONTEXT);
            if outcome.is_err() {
                assert_eq!(cache, vec![0; 8], "an error leaves the cache unchanged");
            }
            outcome
        };
        assert_eq!(
            run(&[3, 8, -1]),
            Err(Error::LocOutOfRange {
                context: context(),
                index: 1,
                slot: 8,
                slots: 8,
            })
        );
        // The smallest token whose slot an earlier one named; zeros repeat freely.
        assert_eq!(
            run(&[0, 3, 0, 5, 0, 5, 3]),
            Err(Error::DuplicateSlot {
                context: context(),
                index: 5,
                first: 3,
                slot: 5,
            })
        );
        // A slot outside the cache is reported before any duplicate.
        assert_eq!(run(&[2, 2, 9]).unwrap_err().kind(), "loc_out_of_range");
        assert_eq!(run(&[0, 0, 0]), Ok(3));
        assert_eq!(run(&[]), Ok(0));
    }

    #[test]
    fn slot_errors_round_trip_the_status() {
        let errors = [
            Error::PaddingRowLength {
                context: ASSIGN_CONTEXT.into(),
                request: 3,
                length: -7,
            },
            Error::NegativeLength {
                context: ASSIGN_CONTEXT.into(),
                request: 1,
                length: i64::MIN,
            },
            Error::SlotCountMismatch {
                context: ASSIGN_CONTEXT.into(),
                len: 9,
                sum: 1 << 40,
            },
            Error::SlotOutOfRange {
                context: ASSIGN_CONTEXT.into(),
                request: 2,
                column: 17,
                index: 40,
                slot: i64::MIN,
                max: i64::MAX,
            },
            Error::WriteConflict {
                context: ASSIGN_CONTEXT.into(),
                request: 300,
                other: 2,
                row: 7,
                column: 9,
            },
            Error::ReqPoolIndexOutOfRange {
                context: ASSIGN_CONTEXT.into(),
                site: Site::Row(5),
                value: -1,
                rows: 4,
            },
            Error::PositionOutOfRange {
                context: ASSIGN_CONTEXT.into(),
                site: Site::Cell(5, 2),
                position: 6,
                cols: 6,
            },
        ];
        for error in errors {
            let words = status::encode(&Err(error.clone()));
            assert_eq!(status::decode(&words, ASSIGN_CONTEXT), Err(error));
        }
        for error in [
            Error::LocOutOfRange {
                context: STORE_CONTEXT.into(),
                index: 4,
                slot: -9,
                slots: 64,
            },
            Error::DuplicateSlot {
                context: STORE_CONTEXT.into(),
                index: 3000,
                first: 12,
                slot: 77,
            },
        ] {
            let words = status::encode(&Err(error.clone()));
            assert_eq!(status::decode(&words, STORE_CONTEXT), Err(error));
        }
    }
}

mod attention {
    use super::super::{Heads, key_runs, paged_attention};
    use crate::error::{ATTENTION_CONTEXT, Error};
    use crate::status;

    const ONE_HEAD: Heads = Heads {
        heads: 1,
        kv_heads: 1,
        head_dim: 4,
    };

    #[test]
    fn softmax_over_the_run_weights_v() {
        // q . k = 2 for slot 1 and 0 for slot 3, scaled by 1/sqrt(4): weights e / (e + 1), 1 / (e + 1).
        let q = [1.0, 1.0, 1.0, 1.0];
        let mut k = vec![0.0; 5 * 4];
        k[4..8].copy_from_slice(&[0.5; 4]);
        let mut v = vec![0.0; 5 * 4];
        v[4..8].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        v[12..16].copy_from_slice(&[-1.0, 0.0, 1.0, 2.0]);
        let out = paged_attention(&q, &k, &v, ONE_HEAD, &[9, 1, 3], &[1], &[2], "").unwrap();
        let (a, b) = (1f64.exp() / (1f64.exp() + 1.0), 1.0 / (1f64.exp() + 1.0));
        let expected: Vec<f64> = (0..4)
            .map(|d| a * (d as f64 + 1.0) + b * (d as f64 - 1.0))
            .collect();
        for (o, e) in out.iter().zip(&expected) {
            assert!((o - e).abs() < 1e-12, "{out:?} against {expected:?}");
        }
    }

    #[test]
    fn query_heads_share_kv_heads_in_groups_and_empty_runs_are_zero() {
        let layout = Heads {
            heads: 4,
            kv_heads: 2,
            head_dim: 1,
        };
        // One key: each head's output is its K/V head's value (softmax of one score is 1).
        let v = [10.0, 20.0];
        let out = paged_attention(
            &[1.0; 8],
            &[0.0, 0.0],
            &v,
            layout,
            &[0],
            &[0, 0],
            &[1, 0],
            "",
        );
        assert_eq!(
            out.unwrap(),
            vec![10.0, 10.0, 20.0, 20.0, 0.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn the_first_faulty_token_is_reported() {
        let context = || ATTENTION_CONTEXT.to_string();
        let slots = [0, 1, 7, -2];
        let run_error = key_runs(&slots, &[0, 2, 3], &[2, 3, 1], 5, ATTENTION_CONTEXT);
        assert_eq!(
            run_error,
            Err(Error::KeyRunOutOfRange {
                context: context(),
                token: 1,
                start: 2,
                count: 3,
                slots: 4,
            })
        );
        let slot_error = key_runs(&slots, &[0, 1, 3], &[2, 2, 1], 5, ATTENTION_CONTEXT);
        assert_eq!(
            slot_error,
            Err(Error::KeySlotOutOfRange {
                context: context(),
                token: 1,
                key: 1,
                slot: 7,
                pool_rows: 5,
            })
        );
        for error in [run_error.unwrap_err(), slot_error.unwrap_err()] {
            let words = status::encode(&Err(error.clone()));
            assert_eq!(status::decode(&words, ATTENTION_CONTEXT), Err(error));
        }
        assert_eq!(
            key_runs(&slots, &[0, 0], &[2, 0], 5, ATTENTION_CONTEXT).map(|runs| runs.len()),
            Ok(2)
        );
    }
}
