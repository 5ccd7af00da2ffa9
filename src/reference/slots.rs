//! `segment_assign` and `store_kv` (spec `slots.md`): every value rule checked before anything is
//! written, so that an error leaves the table or the cache as it was.

use crate::error::{Error, Site};

/// The runs of one `segment_assign`: request `i` writes `lengths[i]` slots into row
/// `req_pool_indices[i]` from column `start[i]` on.
#[derive(Debug, Clone, Copy)]
pub struct Segments<'a> {
    /// `[bs]`; 0 is the padding row.
    pub req_pool_indices: &'a [i64],
    /// `[bs]`: each run's first column.
    pub start: &'a [i64],
    /// `[bs]`: each run's length.
    pub lengths: &'a [i64],
}

/// `req_to_token[req_pool_indices[i]][start[i] + j] = out_cache_loc[offset(i) + j]` for
/// `j < lengths[i]`, `offset(i) = sum(lengths[..i])`, into the row-major `[rows, cols]` table.
///
/// `slot_max` is the largest slot the table's dtype holds (`i32::MAX` for an int32 table). The
/// rules, in order (the first rule that fails decides the error; within a rule, the smallest
/// request or index):
/// 1. `0 <= req_pool_indices[i] < rows` for every request (`req_pool_index_out_of_range`);
/// 2. a padding row (0) has length 0 (`padding_row_length`);
/// 3. `lengths[i] >= 0` (`negative_length`);
/// 4. `start[i] >= 0` and `start[i] + lengths[i] <= cols` (`position_out_of_range`, at the run's
///    first column outside the table);
/// 5. `len(out_cache_loc) == sum(lengths)` (`slot_count_mismatch`);
/// 6. `0 <= out_cache_loc[k] <= slot_max` (`slot_out_of_range`);
/// 7. no two requests write one cell (`write_conflict`: the smallest request that overlaps an
///    earlier one, the first such earlier request, their first shared column).
///
/// Returns the number of slots written. On error the table is unchanged.
pub fn segment_assign(
    table: &mut [i64],
    [rows, cols]: [usize; 2],
    segments: Segments<'_>,
    out_cache_loc: &[i64],
    slot_max: i64,
    context: &str,
) -> Result<usize, Error> {
    debug_assert_eq!(rows.checked_mul(cols), Some(table.len()));
    let runs = check_assign([rows, cols], segments, out_cache_loc, slot_max, context)?;
    let mut k = 0;
    for run in runs {
        for column in run.start..run.end {
            table[run.row * cols + column] = out_cache_loc[k];
            k += 1;
        }
    }
    Ok(k)
}

/// One request's validated run: `[start, end)` of row `row`.
#[derive(Debug, Clone, Copy)]
struct Run {
    row: usize,
    start: usize,
    end: usize,
}

/// Rules 1-7 of [`segment_assign`]; the runs to write, request by request.
fn check_assign(
    [rows, cols]: [usize; 2],
    segments: Segments<'_>,
    out_cache_loc: &[i64],
    slot_max: i64,
    context: &str,
) -> Result<Vec<Run>, Error> {
    let Segments {
        req_pool_indices,
        start,
        lengths,
    } = segments;
    let bs = req_pool_indices.len();
    // Host rules, repeated so that the oracle never indexes past its inputs.
    for (name, values) in [("start", start), ("lengths", lengths)] {
        if values.len() != bs {
            return Err(Error::SegmentLengthMismatch {
                context: context.into(),
                name,
                len: values.len(),
                bs,
            });
        }
    }
    let context = || context.to_string();
    // Rule 1.
    for (i, &row) in req_pool_indices.iter().enumerate() {
        if usize::try_from(row).map_or(true, |row| row >= rows) {
            return Err(Error::ReqPoolIndexOutOfRange {
                context: context(),
                site: Site::Row(i),
                value: row,
                rows,
            });
        }
    }
    // Rule 2.
    for i in 0..bs {
        if req_pool_indices[i] == 0 && lengths[i] != 0 {
            return Err(Error::PaddingRowLength {
                context: context(),
                request: i,
                length: lengths[i],
            });
        }
    }
    // Rule 3.
    if let Some(i) = lengths.iter().position(|&length| length < 0) {
        return Err(Error::NegativeLength {
            context: context(),
            request: i,
            length: lengths[i],
        });
    }
    // Rule 4: `start + length <= cols` rearranged so that a start near i64::MAX cannot overflow.
    let width = cols as i64;
    for i in 0..bs {
        let (first, length) = (start[i], lengths[i]);
        if first < 0 || first > width - length {
            let position = if first < 0 || first > width {
                first
            } else {
                width
            };
            return Err(Error::PositionOutOfRange {
                context: context(),
                site: Site::Cell(i, (position - first) as usize),
                position,
                cols,
            });
        }
    }
    // Rule 5. Every length is at most `cols` now, so the sum cannot overflow.
    let sum: u64 = lengths.iter().map(|&length| length as u64).sum();
    if out_cache_loc.len() as u64 != sum {
        return Err(Error::SlotCountMismatch {
            context: context(),
            len: out_cache_loc.len(),
            sum,
        });
    }
    let runs: Vec<Run> = (0..bs)
        .map(|i| Run {
            row: req_pool_indices[i] as usize,
            start: start[i] as usize,
            end: (start[i] + lengths[i]) as usize,
        })
        .collect();
    // Rule 6.
    if let Some(index) = out_cache_loc
        .iter()
        .position(|&slot| slot < 0 || slot > slot_max)
    {
        let (request, column) = cell_of(&runs, index);
        return Err(Error::SlotOutOfRange {
            context: context(),
            request,
            column,
            index,
            slot: out_cache_loc[index],
            max: slot_max,
        });
    }
    // Rule 7.
    for (i, run) in runs.iter().enumerate() {
        // Empty runs write nothing, so they overlap nothing.
        let overlap = runs[..i].iter().position(|earlier| {
            earlier.row == run.row
                && run.start < run.end
                && earlier.start < earlier.end
                && earlier.start < run.end
                && run.start < earlier.end
        });
        if let Some(other) = overlap {
            return Err(Error::WriteConflict {
                context: context(),
                request: i,
                other,
                row: run.row,
                column: run.start.max(runs[other].start),
            });
        }
    }
    Ok(runs)
}

/// The request and column that `out_cache_loc[index]` is written to.
fn cell_of(runs: &[Run], index: usize) -> (usize, usize) {
    let mut offset = 0;
    for (i, run) in runs.iter().enumerate() {
        let length = run.end - run.start;
        if index < offset + length {
            return (i, run.start + index - offset);
        }
        offset += length;
    }
    unreachable!("rule 5 holds: every index of out_cache_loc has a cell")
}

/// `cache[loc[i]] = values[i]` for every token `i`, a row of `row_len` elements each (`cache` is
/// `[slots, row_len]` row-major, `values` `[len(loc), row_len]`). Rows are elements of any type:
/// the host fallback passes bytes.
///
/// The rules, in order: every `0 <= loc[i] < slots` (`loc_out_of_range`, the smallest `i`), then
/// no slot other than 0 named twice (`duplicate_slot`: the smallest `i` whose slot an earlier
/// token named, and the first token that named it). Slot 0 is the padding sink: it may repeat, and
/// the last token naming it is the one whose row it keeps. Returns the number of tokens stored. On
/// error the cache is unchanged.
pub fn store_kv<T: Copy>(
    cache: &mut [T],
    [slots, row_len]: [usize; 2],
    loc: &[i64],
    values: &[T],
    context: &str,
) -> Result<usize, Error> {
    debug_assert_eq!(slots.checked_mul(row_len), Some(cache.len()));
    debug_assert_eq!(loc.len().checked_mul(row_len), Some(values.len()));
    let rows = check_store_slots(loc, slots, context)?;
    for (i, &slot) in loc.iter().enumerate() {
        let (to, from) = (slot as usize * row_len, i * row_len);
        cache[to..to + row_len].copy_from_slice(&values[from..from + row_len]);
    }
    Ok(rows)
}

/// The rules of [`store_kv`] for a cache of `slots` slots; the number of tokens.
pub fn check_store_slots(loc: &[i64], slots: usize, context: &str) -> Result<usize, Error> {
    if let Some(index) = loc
        .iter()
        .position(|&slot| usize::try_from(slot).map_or(true, |slot| slot >= slots))
    {
        return Err(Error::LocOutOfRange {
            context: context.into(),
            index,
            slot: loc[index],
            slots,
        });
    }
    let mut first_of = std::collections::HashMap::new();
    for (index, &slot) in loc.iter().enumerate() {
        if slot == 0 {
            continue;
        }
        if let Some(&first) = first_of.get(&slot) {
            return Err(Error::DuplicateSlot {
                context: context.into(),
                index,
                first,
                slot,
            });
        }
        first_of.insert(slot, index);
    }
    Ok(loc.len())
}
