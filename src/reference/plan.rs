//! The kv-canary plan (spec `canary-plan.md` §4, device-checked rules 12-17 of §5).

use super::Table;
use crate::error::{Error, PLAN_CONTEXT, Site};

/// The inputs of one plan step, as i64 values.
#[derive(Debug, Clone, Copy)]
pub struct PlanArgs<'a> {
    /// Table row per request; 0 marks a padding row.
    pub req_pool_indices: &'a [i64],
    /// Tokens already in the KV cache, per request.
    pub prefix_lens: &'a [i64],
    /// Tokens written this step, per request.
    pub extend_seq_lens: &'a [i64],
    /// Slot id per (table row, position).
    pub req_to_token: Table<'a>,
    /// `W`; `W <= 0` means no window.
    pub swa_window_size: i32,
    /// LUT from full-pool slot to SWA slot.
    pub full_to_swa: Option<&'a [i64]>,
    /// Expected-token pool and its per-request valid lengths.
    pub expected_tokens: Option<ExpectedTokens<'a>>,
    /// Column shift into the pool (0 for target, +1 for the EAGLE draft).
    pub position_offset: i32,
}

/// The expected-token pool of a plan step.
#[derive(Debug, Clone, Copy)]
pub struct ExpectedTokens<'a> {
    /// `req_to_verify_expected_tokens`.
    pub pool: Table<'a>,
    /// `req_to_verify_expected_tokens_valid_lens`, one per request.
    pub valid_lens: &'a [i64],
}

/// Host copies of a `VerifyPlan` and a `WritePlan`, in the order of the spec's field tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanBuffers {
    /// Slot to verify (after LUT translation), `[V]`.
    pub verify_slot_indices: Vec<i64>,
    /// Expected token or -1, `[V]`.
    pub verify_expected_tokens: Vec<i64>,
    /// Expected position, `[V]`.
    pub verify_expected_positions: Vec<i64>,
    /// Predecessor slot or -1, `[V]`.
    pub verify_prev_slot_indices: Vec<i64>,
    /// Number of valid leading entries.
    pub verify_num_valid: i32,
    /// 1 runs the verify step, 0 skips it.
    pub enable: i32,
    /// Exclusive prefix sum of the write counts, `[K+1]`.
    pub write_offsets: Vec<i64>,
    /// Chain seed slot per request or -1, `[K]`.
    pub write_seed_slot_indices: Vec<i64>,
    /// Batch size of the last run, 0 after a device-checked error.
    pub write_num_valid_reqs: i32,
}

impl PlanBuffers {
    /// Fresh buffers with the deterministic contents of spec §2 ("Allocation").
    pub fn fresh(verify_capacity: usize, write_req_capacity: usize) -> Self {
        Self {
            verify_slot_indices: vec![0; verify_capacity],
            verify_expected_tokens: vec![-1; verify_capacity],
            verify_expected_positions: vec![0; verify_capacity],
            verify_prev_slot_indices: vec![0; verify_capacity],
            verify_num_valid: 0,
            enable: 1,
            write_offsets: vec![0; write_req_capacity + 1],
            write_seed_slot_indices: vec![0; write_req_capacity],
            write_num_valid_reqs: 0,
        }
    }

    /// Leaves the plan harmless to a downstream verify/write (device-checked error, spec §5).
    fn disable(&mut self) {
        self.enable = 0;
        self.verify_num_valid = 0;
        self.write_num_valid_reqs = 0;
    }
}

/// One request's view of the step.
struct Request {
    /// Table row, valid for live requests once rule 12 passed.
    row: i64,
    prefix: i64,
    extend: i64,
    /// First verified position.
    window_start: i64,
}

impl Request {
    fn new(args: &PlanArgs<'_>, r: usize) -> Self {
        let window = i64::from(args.swa_window_size);
        let prefix = args.prefix_lens[r];
        // Compare first, so `prefix - window` cannot overflow.
        let window_start = if window > 0 && prefix > window {
            prefix - window
        } else {
            0
        };
        Self {
            row: args.req_pool_indices[r],
            prefix,
            extend: args.extend_seq_lens[r],
            window_start,
        }
    }

    fn is_padding(&self) -> bool {
        self.row == 0
    }

    /// Live requests read the table; only they are checked.
    fn is_live(&self) -> bool {
        !self.is_padding() && self.prefix > 0
    }

    fn verify_len(&self) -> i64 {
        if self.is_padding() {
            0
        } else {
            (self.prefix - self.window_start).max(0)
        }
    }

    fn write_len(&self) -> i64 {
        if !self.is_padding() && self.extend > 0 {
            self.extend
        } else {
            0
        }
    }

    /// Pool columns `[lo, hi]` read for `valid_len`, if any (`pos + off` in `[0, valid_len)`).
    fn pool_columns(&self, offset: i32, valid_len: i64) -> Option<(i64, i64)> {
        let offset = i64::from(offset);
        let lo = (self.window_start + offset).max(0);
        let hi = (self.prefix - 1 + offset).min(valid_len.saturating_sub(1));
        (lo <= hi).then_some((lo, hi))
    }
}

/// Runs one plan step into `buffers`, which hold the previous step's contents.
///
/// On a device-checked error (rules 12-17) the buffers are left disabled and the first offender is
/// returned; the host rules 1-11 are `validate`'s and must have passed.
pub fn plan(args: &PlanArgs<'_>, buffers: &mut PlanBuffers) -> Result<(), Error> {
    let requests: Vec<Request> = (0..args.req_pool_indices.len())
        .map(|r| Request::new(args, r))
        .collect();
    if let Err(error) = check(args, &requests) {
        buffers.disable();
        return Err(error);
    }
    let table = args.req_to_token;
    let xlat = |slot: i64| match args.full_to_swa {
        Some(lut) if slot >= 0 => lut[slot as usize],
        _ => slot,
    };
    let slot_at =
        |request: &Request, position: i64| xlat(table.at(request.row as usize, position as usize));

    // Verify entries, or nothing at all on overflow.
    let total = requests
        .iter()
        .map(Request::verify_len)
        .fold(0i64, i64::saturating_add);
    let capacity = buffers.verify_slot_indices.len();
    if total > capacity as i64 {
        buffers.verify_num_valid = capacity as i32;
        buffers.enable = 0;
    } else {
        let mut k = 0;
        for (r, request) in requests.iter().enumerate() {
            if request.verify_len() == 0 {
                continue;
            }
            for position in request.window_start..request.prefix {
                buffers.verify_slot_indices[k] = slot_at(request, position);
                buffers.verify_expected_positions[k] = position;
                buffers.verify_prev_slot_indices[k] = if position == 0 {
                    -1
                } else {
                    slot_at(request, position - 1)
                };
                buffers.verify_expected_tokens[k] = expected_token(args, r, request, position);
                k += 1;
            }
        }
        buffers.verify_num_valid = total as i32;
        buffers.enable = 1;
    }

    // Write metadata: offsets up to bs, zeros past it; seeds past bs stay stale.
    let bs = requests.len();
    let mut offset = 0;
    for (r, request) in requests.iter().enumerate() {
        buffers.write_offsets[r] = offset;
        offset += request.write_len();
        buffers.write_seed_slot_indices[r] =
            if request.is_padding() || request.extend <= 0 || request.prefix <= 0 {
                -1
            } else {
                slot_at(request, request.prefix - 1)
            };
    }
    buffers.write_offsets[bs] = offset;
    buffers.write_offsets[bs + 1..].fill(0);
    buffers.write_num_valid_reqs = bs as i32;
    Ok(())
}

/// `pool[q][pos + off]` when the column is inside the request's valid length, else -1.
fn expected_token(args: &PlanArgs<'_>, r: usize, request: &Request, position: i64) -> i64 {
    let Some(expected) = args.expected_tokens else {
        return -1;
    };
    let column = position + i64::from(args.position_offset);
    if column < 0 || column >= expected.valid_lens[r] {
        return -1;
    }
    expected.pool.at(request.row as usize, column as usize)
}

/// Rules 12-17 in order; within a rule the smallest request (then column) is reported.
fn check(args: &PlanArgs<'_>, requests: &[Request]) -> Result<(), Error> {
    let table = args.req_to_token;
    let live = || {
        requests
            .iter()
            .enumerate()
            .filter(|(_, request)| request.is_live())
    };
    for (r, request) in live() {
        if request.row < 0 || request.row as u64 >= table.rows as u64 {
            return Err(Error::ReqPoolIndexOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(r),
                value: request.row,
                rows: table.rows,
            });
        }
    }
    for (r, request) in live() {
        if request.prefix as u64 > table.cols as u64 {
            return Err(Error::PositionOutOfRange {
                context: PLAN_CONTEXT.into(),
                site: Site::Request(r),
                position: request.prefix,
                cols: table.cols,
            });
        }
    }
    if let Some(lut) = args.full_to_swa {
        for (r, request) in live() {
            // The window head's predecessor is read too.
            let first = (request.window_start - 1).max(0);
            for column in first..request.prefix {
                let slot = table.at(request.row as usize, column as usize);
                if slot >= 0 && slot as u64 >= lut.len() as u64 {
                    return Err(Error::SwaSlotOutsideLut {
                        slot,
                        lut_len: lut.len(),
                        request: r,
                        position: column as usize,
                    });
                }
            }
        }
    }
    if let Some(expected) = args.expected_tokens {
        let pool = expected.pool;
        let reads = |r: usize, request: &Request| {
            request.pool_columns(args.position_offset, expected.valid_lens[r])
        };
        for (r, request) in live() {
            if reads(r, request).is_some() && request.row as u64 >= pool.rows as u64 {
                return Err(Error::ExpectedPoolRowOutOfRange {
                    request: r,
                    row: request.row,
                    pool_rows: pool.rows,
                });
            }
        }
        for (r, request) in live() {
            if let Some((_, column)) = reads(r, request)
                && column as u64 >= pool.cols as u64
            {
                return Err(Error::ExpectedPoolPositionOutOfRange {
                    request: r,
                    column,
                    pool_cols: pool.cols,
                    valid_len: expected.valid_lens[r],
                });
            }
        }
    }
    let mut sum: i64 = 0;
    for (r, request) in requests.iter().enumerate() {
        sum = sum
            .checked_add(request.write_len())
            .ok_or(Error::WriteOffsetsOverflow { request: r })?;
    }
    Ok(())
}
