//! Status records: the one way a data-dependent error travels from a kernel (or the reference
//! fallback) to the host. Layout and codes are in `kvplan_kernels::status`.

use kvplan_kernels::status::*;

use crate::error::{Dims, Error, PLAN_CONTEXT, Site};

/// The words of one status record.
pub type StatusWords = [i64; STATUS_LEN];

/// A code kvplan never writes for a real outcome.
const UNKNOWN_CODE: i64 = -1;

/// Encodes the outcome of an op: `Ok(count)` or a data-dependent error.
///
/// Only data-dependent kinds have a code; any other error (a host rule, which never reaches a
/// status) encodes as an unknown code and decodes as `Error::CorruptStatus`.
pub fn encode(outcome: &Result<usize, Error>) -> StatusWords {
    let mut words = [0; STATUS_LEN];
    let (code, facts): (i64, Vec<i64>) = match outcome {
        Ok(count) => {
            words[COUNT] = *count as i64;
            return words;
        }
        Err(error) => match *error {
            Error::EmptyTableNonemptyMask { .. } => (GATHER_EMPTY_TABLE, vec![]),
            Error::MaskShapeMismatch {
                ref mask,
                ref pos2d,
                ..
            } => (
                GATHER_SEGMENT_SHAPE,
                vec![dim(mask, 0), dim(pos2d, 0), dim(mask, 1)],
            ),
            Error::IndexShapeMismatch { n, rows, cols, .. } => {
                (GATHER_INDEX_SHAPE, vec![n as i64, rows as i64, cols as i64])
            }
            Error::MaskIndexShapeMismatch { n, rows, cols, .. } => (
                GATHER_MASK_INDEX_SHAPE,
                vec![n as i64, rows as i64, cols as i64],
            ),
            Error::ReqPoolIndexOutOfRange {
                site: Site::Row(i),
                value,
                rows,
                ..
            } => (GATHER_ROW, vec![i as i64, value, rows as i64]),
            Error::ReqPoolIndexOutOfRange {
                site: Site::Request(r),
                value,
                rows,
                ..
            } => (PLAN_ROW, vec![r as i64, value, rows as i64]),
            Error::PositionOutOfRange {
                site: Site::Cell(i, j),
                position,
                cols,
                ..
            } => (
                GATHER_POSITION,
                vec![i as i64, j as i64, position, cols as i64],
            ),
            Error::PositionOutOfRange {
                site: Site::Request(r),
                position,
                cols,
                ..
            } => (PLAN_POSITION, vec![r as i64, position, cols as i64]),
            Error::CapacityExceeded {
                count, capacity, ..
            } => (GATHER_CAPACITY, vec![count as i64, capacity as i64]),
            Error::SwaSlotOutsideLut {
                slot,
                lut_len,
                request,
                position,
            } => (
                PLAN_SWA_SLOT,
                vec![slot, lut_len as i64, request as i64, position as i64],
            ),
            Error::ExpectedPoolRowOutOfRange {
                request,
                row,
                pool_rows,
            } => (PLAN_POOL_ROW, vec![request as i64, row, pool_rows as i64]),
            Error::ExpectedPoolPositionOutOfRange {
                request,
                column,
                pool_cols,
                valid_len,
            } => (
                PLAN_POOL_POSITION,
                vec![request as i64, column, pool_cols as i64, valid_len],
            ),
            Error::ReqToTokenStride { stride } => (PLAN_STRIDE, vec![stride]),
            Error::WriteOffsetsOverflow { request } => {
                (PLAN_WRITE_OFFSETS_OVERFLOW, vec![request as i64])
            }
            Error::IndexRange { elements, limit } => {
                (INDEX_RANGE, vec![elements as i64, limit as i64])
            }
            Error::PaddingRowLength {
                request, length, ..
            } => (ASSIGN_PADDING_ROW, vec![request as i64, length]),
            Error::NegativeLength {
                request, length, ..
            } => (ASSIGN_NEGATIVE_LENGTH, vec![request as i64, length]),
            Error::SlotCountMismatch { len, sum, .. } => {
                (ASSIGN_SLOT_COUNT, vec![len as i64, sum as i64])
            }
            Error::SlotOutOfRange {
                request,
                column,
                index,
                slot,
                max,
                ..
            } => (
                ASSIGN_SLOT,
                vec![request as i64, column as i64, index as i64, slot, max],
            ),
            Error::WriteConflict {
                request,
                other,
                row,
                column,
                ..
            } => (
                ASSIGN_CONFLICT,
                vec![request as i64, other as i64, row as i64, column as i64],
            ),
            Error::LocOutOfRange {
                index, slot, slots, ..
            } => (STORE_LOC, vec![index as i64, slot, slots as i64]),
            Error::DuplicateSlot {
                index, first, slot, ..
            } => (STORE_DUPLICATE, vec![index as i64, first as i64, slot]),
            Error::KeyRunOutOfRange {
                token,
                start,
                count,
                slots,
                ..
            } => (KEY_RUN, vec![token as i64, start, count, slots as i64]),
            Error::KeySlotOutOfRange {
                token,
                key,
                slot,
                pool_rows,
                ..
            } => (
                KEY_SLOT,
                vec![token as i64, key as i64, slot, pool_rows as i64],
            ),
            _ => (UNKNOWN_CODE, vec![]),
        },
    };
    words[CODE] = code;
    words[FACTS..FACTS + facts.len()].copy_from_slice(&facts);
    words
}

fn dim(dims: &Dims, axis: usize) -> i64 {
    dims.0.get(axis).copied().unwrap_or(0) as i64
}

/// Decodes a status record into `Ok(count)` or the typed error it names. `context` prefixes gather
/// messages; plan messages carry their own.
pub fn decode(words: &StatusWords, context: &str) -> Result<usize, Error> {
    let fact = |k: usize| words[FACTS + k];
    let index = |k: usize| fact(k).max(0) as usize;
    let context = || context.to_string();
    let plan_context = || PLAN_CONTEXT.to_string();
    let error = match words[CODE] {
        OK => return Ok(words[COUNT].max(0) as usize),
        GATHER_EMPTY_TABLE => Error::EmptyTableNonemptyMask { context: context() },
        GATHER_SEGMENT_SHAPE => Error::MaskShapeMismatch {
            context: context(),
            mask: Dims(vec![index(0), index(2)]),
            pos2d: Dims(vec![index(1), index(2)]),
        },
        GATHER_INDEX_SHAPE => Error::IndexShapeMismatch {
            context: context(),
            n: index(0),
            rows: index(1),
            cols: index(2),
        },
        GATHER_MASK_INDEX_SHAPE => Error::MaskIndexShapeMismatch {
            context: context(),
            n: index(0),
            rows: index(1),
            cols: index(2),
        },
        GATHER_ROW => Error::ReqPoolIndexOutOfRange {
            context: context(),
            site: Site::Row(index(0)),
            value: fact(1),
            rows: index(2),
        },
        GATHER_POSITION => Error::PositionOutOfRange {
            context: context(),
            site: Site::Cell(index(0), index(1)),
            position: fact(2),
            cols: index(3),
        },
        GATHER_CAPACITY => Error::CapacityExceeded {
            context: context(),
            count: fact(0).max(0) as u64,
            capacity: index(1),
        },
        PLAN_STRIDE => Error::ReqToTokenStride { stride: fact(0) },
        PLAN_ROW => Error::ReqPoolIndexOutOfRange {
            context: plan_context(),
            site: Site::Request(index(0)),
            value: fact(1),
            rows: index(2),
        },
        PLAN_POSITION => Error::PositionOutOfRange {
            context: plan_context(),
            site: Site::Request(index(0)),
            position: fact(1),
            cols: index(2),
        },
        PLAN_SWA_SLOT => Error::SwaSlotOutsideLut {
            slot: fact(0),
            lut_len: index(1),
            request: index(2),
            position: index(3),
        },
        PLAN_POOL_ROW => Error::ExpectedPoolRowOutOfRange {
            request: index(0),
            row: fact(1),
            pool_rows: index(2),
        },
        PLAN_POOL_POSITION => Error::ExpectedPoolPositionOutOfRange {
            request: index(0),
            column: fact(1),
            pool_cols: index(2),
            valid_len: fact(3),
        },
        PLAN_WRITE_OFFSETS_OVERFLOW => Error::WriteOffsetsOverflow { request: index(0) },
        INDEX_RANGE => Error::IndexRange {
            elements: fact(0).max(0) as u64,
            limit: fact(1).max(0) as u64,
        },
        ASSIGN_PADDING_ROW => Error::PaddingRowLength {
            context: context(),
            request: index(0),
            length: fact(1),
        },
        ASSIGN_NEGATIVE_LENGTH => Error::NegativeLength {
            context: context(),
            request: index(0),
            length: fact(1),
        },
        ASSIGN_SLOT_COUNT => Error::SlotCountMismatch {
            context: context(),
            len: index(0),
            sum: fact(1).max(0) as u64,
        },
        ASSIGN_SLOT => Error::SlotOutOfRange {
            context: context(),
            request: index(0),
            column: index(1),
            index: index(2),
            slot: fact(3),
            max: fact(4),
        },
        ASSIGN_CONFLICT => Error::WriteConflict {
            context: context(),
            request: index(0),
            other: index(1),
            row: index(2),
            column: index(3),
        },
        STORE_LOC => Error::LocOutOfRange {
            context: context(),
            index: index(0),
            slot: fact(1),
            slots: index(2),
        },
        STORE_DUPLICATE => Error::DuplicateSlot {
            context: context(),
            index: index(0),
            first: index(1),
            slot: fact(2),
        },
        KEY_RUN => Error::KeyRunOutOfRange {
            context: context(),
            token: index(0),
            start: fact(1),
            count: fact(2),
            slots: index(3),
        },
        KEY_SLOT => Error::KeySlotOutOfRange {
            context: context(),
            token: index(0),
            key: index(1),
            slot: fact(2),
            pool_rows: index(3),
        },
        EXECUTION => Error::Execution {
            detail: "a fused kvplan op failed on the device".into(),
        },
        code => Error::CorruptStatus { code },
    };
    Err(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fused op that failed inside its lazily executed stream reports it through the status.
    #[test]
    fn execution_code_decodes_to_execution_error() {
        let mut words = [0; STATUS_LEN];
        words[CODE] = EXECUTION;
        let error = decode(&words, "ctx").unwrap_err();
        assert_eq!(error.kind(), "execution");
    }

    /// The device-side stride check of fused backends decodes to the host rule's error.
    #[test]
    fn stride_code_round_trips() {
        let words = encode(&Err(Error::ReqToTokenStride { stride: 0 }));
        assert_eq!(words[CODE], PLAN_STRIDE);
        assert_eq!(
            decode(&words, ""),
            Err(Error::ReqToTokenStride { stride: 0 })
        );
    }
}
