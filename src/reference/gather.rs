//! Masked and segment gather over `req_to_token` (spec `gather.md` §3-§5, deferred rules).

use super::Table;
use crate::error::{Dims, Error, SEGMENT_CONTEXT, Site};

/// `masked_gather` for a `pos_rows x pos_cols` block (`pos2d` and `mask` row-major): `T[row(i)][pos2d[i][j]]` for every true
/// `mask[i][j]`, row-major. Evaluates rules 6-10 of §3 (rules 1-5 are `validate`'s).
///
/// `capacity` is the caller-given capacity of capacity mode (rule 10); `None` means no limit.
pub fn masked_gather(
    table: Table<'_>,
    req_pool_indices: &[i64],
    pos2d: &[i64],
    mask: &[bool],
    [pos_rows, pos_cols]: [usize; 2],
    capacity: Option<usize>,
    context: &str,
) -> Result<Vec<i64>, Error> {
    // Rule 6: an empty table accepts only an all-false mask, and then nothing else is checked.
    if table.cols == 0 {
        if mask.iter().any(|&m| m) {
            return Err(Error::EmptyTableNonemptyMask {
                context: context.into(),
            });
        }
        return Ok(Vec::new());
    }
    let row_of = pair_rows(req_pool_indices, pos_rows, pos_cols, context)?;
    // Rule 8: every pos row's table row, true cells or not (the source reads column 0 of each).
    let mut rows = Vec::with_capacity(pos_rows);
    if pos_cols > 0 {
        for i in 0..pos_rows {
            let value = req_pool_indices[row_of(i)];
            let row = table
                .row_index(value)
                .ok_or(Error::ReqPoolIndexOutOfRange {
                    context: context.into(),
                    site: Site::Row(i),
                    value,
                    rows: table.rows,
                })?;
            rows.push(row);
        }
    }
    // Rule 9, then the values, in row-major order.
    let mut out = Vec::new();
    for i in 0..pos_rows {
        for j in 0..pos_cols {
            let cell = i * pos_cols + j;
            if !mask[cell] {
                continue;
            }
            let position = pos2d[cell];
            let col = usize::try_from(position)
                .ok()
                .filter(|&c| c < table.cols)
                .ok_or(Error::PositionOutOfRange {
                    context: context.into(),
                    site: Site::Cell(i, j),
                    position,
                    cols: table.cols,
                })?;
            out.push(table.at(rows[i], col));
        }
    }
    check_capacity(out.len(), capacity, context)?;
    Ok(out)
}

/// `segment_gather`: `T[row(i)][start_i + j]` for `j < lengths[i]`, segments in order. Evaluates
/// rules 4-10 of §4. `start == None` means every segment starts at position 0.
pub fn segment_gather(
    table: Table<'_>,
    req_pool_indices: &[i64],
    start: Option<&[i64]>,
    lengths: &[i64],
    capacity: Option<usize>,
) -> Result<Vec<i64>, Error> {
    let context = SEGMENT_CONTEXT;
    // Rule 4: nothing to gather, nothing checked.
    let max_len = lengths.iter().copied().max().unwrap_or(0);
    if max_len <= 0 {
        return Ok(Vec::new());
    }
    let segments = lengths.len();
    let starts = start.map_or(req_pool_indices.len(), <[i64]>::len);
    let width = usize::try_from(max_len).unwrap_or(usize::MAX);
    // Rule 5.
    if segments != starts {
        return Err(Error::MaskShapeMismatch {
            context: context.into(),
            mask: Dims(vec![segments, width]),
            pos2d: Dims(vec![starts, width]),
        });
    }
    // Rule 6.
    if table.cols == 0 {
        return Err(Error::EmptyTableNonemptyMask {
            context: context.into(),
        });
    }
    let row_of = pair_rows(req_pool_indices, starts, width, context)?;
    // Rule 8, over every segment including empty ones.
    let mut rows = Vec::with_capacity(segments);
    for i in 0..segments {
        let value = req_pool_indices[row_of(i)];
        let row = table
            .row_index(value)
            .ok_or(Error::ReqPoolIndexOutOfRange {
                context: context.into(),
                site: Site::Row(i),
                value,
                rows: table.rows,
            })?;
        rows.push(row);
    }
    // Rule 9: the whole run must lie in [0, cols); the first bad position is reported.
    let mut out = Vec::new();
    for (i, &len) in lengths.iter().enumerate() {
        if len <= 0 {
            continue;
        }
        let first = start.map_or(0, |s| s[i]);
        let cols = table.cols as i64;
        // `first + len <= cols` rearranged so that a start near i64::MAX cannot overflow.
        if first < 0 || first > cols - len {
            let position = if first < 0 { first } else { first.max(cols) };
            let j = position.saturating_sub(first) as usize;
            return Err(Error::PositionOutOfRange {
                context: context.into(),
                site: Site::Cell(i, j),
                position,
                cols: table.cols,
            });
        }
        for position in first..first + len {
            out.push(table.at(rows[i], position as usize));
        }
    }
    check_capacity(out.len(), capacity, context)?;
    Ok(out)
}

/// Rule 7: `n == R` or `n == 1`. Returns the map from pos row to index into `req_pool_indices`.
fn pair_rows(
    req_pool_indices: &[i64],
    pos_rows: usize,
    pos_cols: usize,
    context: &str,
) -> Result<impl Fn(usize) -> usize, Error> {
    let n = req_pool_indices.len();
    if n == pos_rows {
        Ok(identity_or_zero(false))
    } else if n == 1 {
        Ok(identity_or_zero(true))
    } else if pos_rows == 1 {
        Err(Error::MaskIndexShapeMismatch {
            context: context.into(),
            n,
            rows: pos_rows,
            cols: pos_cols,
        })
    } else {
        Err(Error::IndexShapeMismatch {
            context: context.into(),
            n,
            rows: pos_rows,
            cols: pos_cols,
        })
    }
}

fn identity_or_zero(shared: bool) -> impl Fn(usize) -> usize {
    move |i| if shared { 0 } else { i }
}

/// Rule 10.
fn check_capacity(count: usize, capacity: Option<usize>, context: &str) -> Result<(), Error> {
    match capacity {
        Some(capacity) if count > capacity => Err(Error::CapacityExceeded {
            context: context.into(),
            count: count as u64,
            capacity,
        }),
        _ => Ok(()),
    }
}
