//! kv-canary write and verify (spec `canary-write-verify.md` §5-§9), in reference order.
//!
//! Indices the spec leaves unchecked (§11) never panic here: a slot outside the buffer reads as a
//! zero record and is not written, a source row outside the source reads as zero bytes.

use kvplan_kernels::hash::{CHAIN_ANCHOR, MIX_MUL_1, MIX_MUL_2};

/// `RealKvHashMode`: how much of each slot's real KV bytes the fingerprint folds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RealKvHashMode {
    /// No fingerprint: the record's field 3 holds 0.
    #[default]
    None,
    /// The first 16 bytes of each source's strip.
    Partial,
    /// `read_bytes` bytes of each source's strip.
    All,
}

/// Fields of a violation row (spec §8), in order.
pub const VIOLATION_FIELDS: usize = 8;
/// One violation row: kernel_kind, slot, position, stored_token, expected_token,
/// stored_chain_hash, expected_aux, fail_reason_bits.
pub type ViolationRow = [i64; VIOLATION_FIELDS];

/// Fail-reason bits (spec §3).
pub mod fail {
    /// Verify: the stored chain value does not continue the listed predecessor.
    pub const VERIFY_CHAIN_HASH_MISMATCH: i64 = 1;
    /// Verify: the stored position is not the expected one.
    pub const VERIFY_POSITION_MISMATCH: i64 = 2;
    /// Verify: the real KV bytes no longer match the stored fingerprint.
    pub const VERIFY_REAL_KV_HASH_MISMATCH: i64 = 4;
    /// Write: the token is not the one the caller's oracle expects.
    pub const WRITE_TOKEN_MISMATCH: i64 = 8;
    /// Write: the position is not the expected one (input assert or chain-position assert).
    pub const WRITE_POSITION_MISMATCH: i64 = 16;
    /// Verify: the stored token is not the expected one.
    pub const VERIFY_TOKEN_MISMATCH: i64 = 32;
}

/// The canary's device state, on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CanaryState {
    /// `S / 8`: i64 words per slot (at least 4).
    pub slot_stride_words: usize,
    /// `N * S / 8` words, slot-major.
    pub buffer: Vec<i64>,
    /// The violation ring, `C` rows.
    pub ring: Vec<ViolationRow>,
    /// Violations ever recorded (may exceed `C`).
    pub write_index: i64,
    /// Entries written or checked.
    pub slot_run_counter: i64,
    /// Launches.
    pub kernel_run_counter: i64,
}

impl CanaryState {
    /// A zeroed canary of `num_slots` slots of `slot_stride_words` words and an empty ring.
    pub fn zeroed(num_slots: usize, slot_stride_words: usize, ring_capacity: usize) -> Self {
        Self {
            slot_stride_words,
            buffer: vec![0; num_slots * slot_stride_words],
            ring: vec![[0; VIOLATION_FIELDS]; ring_capacity],
            write_index: 0,
            slot_run_counter: 0,
            kernel_run_counter: 0,
        }
    }

    /// `N`.
    pub fn num_slots(&self) -> usize {
        self.buffer.len() / self.slot_stride_words.max(1)
    }

    /// Word `field` of slot `slot`'s record, when the slot exists.
    fn word(&self, slot: i64, field: usize) -> Option<usize> {
        let slot = usize::try_from(slot)
            .ok()
            .filter(|&s| s < self.num_slots())?;
        Some(slot * self.slot_stride_words + field)
    }

    /// The record `[token, position, prev_hash, real_kv_hash]` of `slot` (zeros outside).
    pub fn record(&self, slot: i64) -> [i64; 4] {
        let mut record = [0; 4];
        for (field, value) in record.iter_mut().enumerate() {
            if let Some(word) = self.word(slot, field) {
                *value = self.buffer[word];
            }
        }
        record
    }

    fn store(&mut self, slot: i64, record: [i64; 4]) {
        for (field, value) in record.into_iter().enumerate() {
            if let Some(word) = self.word(slot, field) {
                self.buffer[word] = value;
            }
        }
    }

    /// Appends a row (§8): counted always, stored while the ring has room.
    fn append(&mut self, row: ViolationRow) {
        if let Some(free) = usize::try_from(self.write_index)
            .ok()
            .and_then(|index| self.ring.get_mut(index))
        {
            *free = row;
        }
        self.write_index = self.write_index.wrapping_add(1);
    }
}

/// One real-KV source as bytes: `rows` rows of `row_bytes` bytes (spec §4.2).
#[derive(Debug, Clone, Copy)]
pub struct SourceBytes<'a> {
    /// `rows * row_bytes` bytes.
    pub bytes: &'a [u8],
    /// Bytes per row (the row stride).
    pub row_bytes: usize,
    /// Slots per row.
    pub page_size: usize,
    /// Width of one slot's strip.
    pub num_bytes_per_token: usize,
    /// Bytes `ALL` folds.
    pub read_bytes: usize,
}

impl SourceBytes<'_> {
    /// The little-endian word `k` of slot `slot`'s strip (zero outside the source).
    fn word(&self, slot: u64, k: usize) -> u64 {
        let page = self.page_size as u64;
        let start = (slot / page) as usize * self.row_bytes
            + (slot % page) as usize * self.num_bytes_per_token
            + 8 * k;
        self.bytes
            .get(start..start + 8)
            .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
    }
}

/// `mix(x)` (spec §5.1).
pub fn mix(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(MIX_MUL_1);
    let x = (x ^ (x >> 27)).wrapping_mul(MIX_MUL_2);
    x ^ (x >> 31)
}

/// `mix3(a, b, c)` (spec §5.2).
pub fn mix3(a: u64, b: u64, c: u64) -> u64 {
    mix(mix(mix(a) ^ b) ^ c)
}

/// `link(s)` (spec §5.3): the `prev_hash` the successor of `slot` must hold.
pub fn link(state: &CanaryState, slot: i64) -> u64 {
    if slot < 0 {
        return mix(CHAIN_ANCHOR);
    }
    let [token, position, prev_hash, _] = state.record(slot);
    mix3(prev_hash as u64, token as u64, position as u64)
}

/// `fp(s)` (spec §5.4).
pub fn fingerprint(slot: i64, mode: RealKvHashMode, sources: &[SourceBytes]) -> u64 {
    if mode == RealKvHashMode::None || slot < 0 {
        return 0;
    }
    let mut acc = 0;
    for source in sources {
        let bytes = match mode {
            RealKvHashMode::Partial => 16,
            _ => source.read_bytes,
        };
        let mut h = 0;
        for k in 0..bytes / 8 {
            h = mix(h ^ source.word(slot as u64, k));
        }
        acc = mix(acc ^ h);
    }
    acc
}

/// What one launch needs besides its plan: the tag stamped into rows, the mode and the sources.
#[derive(Debug, Clone, Copy)]
pub struct Launch<'a> {
    /// `kernel_kind`.
    pub kernel_kind: i32,
    /// `real_kv_hash_mode`.
    pub mode: RealKvHashMode,
    /// The sources, in fold order.
    pub sources: &'a [SourceBytes<'a>],
}

/// A write plan and the step's token arrays, as i64 values.
#[derive(Debug, Clone, Copy)]
pub struct WriteArgs<'a> {
    /// `write_offsets`, `[K+1]`.
    pub offsets: &'a [i64],
    /// `write_seed_slot_indices`, `[K]`.
    pub seed_slot_indices: &'a [i64],
    /// `write_num_valid_reqs`.
    pub num_valid_reqs: i32,
    /// Token ids, `[T]`.
    pub input_ids: &'a [i64],
    /// Positions, `[T]`.
    pub positions: &'a [i64],
    /// Canary slot per token; negative skips it.
    pub out_cache_loc: &'a [i64],
    /// `(expected_input_tokens, expected_input_positions)` when the input assert is on.
    pub expected_inputs: Option<(&'a [i64], &'a [i64])>,
    /// `enable_chain_position_assert != 0`.
    pub chain_position_assert: bool,
}

/// `write` (spec §6): stores the records of the active requests' tokens and appends assert rows.
/// Returns the rows this launch produced, in reference order.
pub fn write(state: &mut CanaryState, args: &WriteArgs, launch: &Launch) -> Vec<ViolationRow> {
    let at = |values: &[i64], i: i64| usize::try_from(i).ok().and_then(|i| values.get(i).copied());
    let kind = i64::from(launch.kernel_kind);
    let mut rows = Vec::new();
    state.kernel_run_counter = state.kernel_run_counter.wrapping_add(1);
    let requests = (args.num_valid_reqs.max(0) as usize).min(args.seed_slot_indices.len());
    let mut written = 0i64;
    for r in 0..requests {
        let seed = args.seed_slot_indices[r];
        let mut h = link(state, seed);
        let pos_check = seed >= 0 && args.chain_position_assert;
        let mut last_pos = state.record(seed)[1];
        let start = at(args.offsets, r as i64).unwrap_or(0);
        let end = at(args.offsets, r as i64 + 1).unwrap_or(0);
        for i in start..end {
            // Offsets outside [0, T] are a precondition (§11): such entries are left alone.
            let (Some(slot), Some(tok), Some(pos)) = (
                at(args.out_cache_loc, i),
                at(args.input_ids, i),
                at(args.positions, i),
            ) else {
                continue;
            };
            if slot < 0 {
                continue;
            }
            if let Some((tokens, positions)) = args.expected_inputs {
                let (exp_tok, exp_pos) =
                    (at(tokens, i).unwrap_or(0), at(positions, i).unwrap_or(0));
                let bits = i64::from(tok != exp_tok) * fail::WRITE_TOKEN_MISMATCH
                    | i64::from(pos != exp_pos) * fail::WRITE_POSITION_MISMATCH;
                if bits != 0 {
                    rows.push([kind, slot, pos, tok, exp_tok, h as i64, exp_pos, bits]);
                }
            }
            if pos_check {
                let want = last_pos.wrapping_add(1);
                if pos != want {
                    let bits = fail::WRITE_POSITION_MISMATCH;
                    rows.push([kind, slot, pos, tok, tok, h as i64, want, bits]);
                }
                last_pos = pos;
            }
            let fp = fingerprint(slot, launch.mode, launch.sources);
            state.store(slot, [tok, pos, h as i64, fp as i64]);
            h = mix3(h, tok as u64, pos as u64);
            written += 1;
        }
    }
    state.slot_run_counter = state.slot_run_counter.wrapping_add(written);
    for &row in &rows {
        state.append(row);
    }
    rows
}

/// A verify plan, as i64 values.
#[derive(Debug, Clone, Copy)]
pub struct VerifyArgs<'a> {
    /// `verify_slot_indices`, `[V]`.
    pub slot_indices: &'a [i64],
    /// `verify_expected_tokens`, `[V]`.
    pub expected_tokens: &'a [i64],
    /// `verify_expected_positions`, `[V]`.
    pub expected_positions: &'a [i64],
    /// `verify_prev_slot_indices`, `[V]`.
    pub prev_slot_indices: &'a [i64],
    /// `verify_num_valid`.
    pub num_valid: i32,
    /// `enable`.
    pub enable: i32,
    /// `check_verify_expected_token`.
    pub check_expected_token: bool,
}

/// `verify` (spec §7): checks the plan's active entries and appends a row per mismatch.
/// Returns the rows this launch produced, in entry order.
pub fn verify(state: &mut CanaryState, args: &VerifyArgs, launch: &Launch) -> Vec<ViolationRow> {
    let kind = i64::from(launch.kernel_kind);
    let mut rows = Vec::new();
    state.kernel_run_counter = state.kernel_run_counter.wrapping_add(1);
    if args.enable == 0 {
        return rows;
    }
    // The four arrays have one length (validated); the shortest bounds the entries regardless.
    let len = [
        args.slot_indices,
        args.expected_tokens,
        args.expected_positions,
        args.prev_slot_indices,
    ]
    .iter()
    .map(|values| values.len())
    .min()
    .unwrap_or(0);
    let entries = (args.num_valid.max(0) as usize).min(len);
    state.slot_run_counter = state.slot_run_counter.wrapping_add(entries as i64);
    for k in 0..entries {
        let slot = args.slot_indices[k];
        if slot == 0 {
            continue;
        }
        let prev = args.prev_slot_indices[k];
        let exp_tok = if args.check_expected_token {
            args.expected_tokens[k]
        } else {
            -1
        };
        let [tok, pos, chain, rkv] = state.record(slot);
        let exp_chain = if prev != 0 {
            link(state, prev) as i64
        } else {
            chain
        };
        let mut bits = 0;
        if prev != 0 && chain != exp_chain {
            bits |= fail::VERIFY_CHAIN_HASH_MISMATCH;
        }
        if exp_tok != -1 && tok != exp_tok {
            bits |= fail::VERIFY_TOKEN_MISMATCH;
        }
        if pos != args.expected_positions[k] {
            bits |= fail::VERIFY_POSITION_MISMATCH;
        }
        if rkv != fingerprint(slot, launch.mode, launch.sources) as i64 {
            bits |= fail::VERIFY_REAL_KV_HASH_MISMATCH;
        }
        if bits != 0 {
            rows.push([kind, slot, pos, tok, exp_tok, chain, exp_chain, bits]);
        }
    }
    for &row in &rows {
        state.append(row);
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spec §13, example 1.
    #[test]
    fn primitives() {
        assert_eq!(mix(0), 0);
        assert_eq!(mix(1), 0x5692_161D_100B_05E5);
        assert_eq!(mix(CHAIN_ANCHOR), 0xDE7F_AE23_A9A1_B716);
        assert_eq!(mix(CHAIN_ANCHOR), kvplan_kernels::canary::ANCHOR_LINK);
        assert_eq!(mix(CHAIN_ANCHOR) as i64, -2414019407054260458);
        assert_eq!(mix3(1, 2, 3), 0xA55B_DF37_C087_24B5);
        let bytes: Vec<u8> = (0..16).collect();
        let source = SourceBytes {
            bytes: &bytes,
            row_bytes: 16,
            page_size: 1,
            num_bytes_per_token: 16,
            read_bytes: 16,
        };
        assert_eq!(mix(source.word(0, 0)), 0x6E06_8E3B_28B7_6F49);
        assert_eq!(
            fingerprint(0, RealKvHashMode::All, &[source]),
            0xD6D7_5024_DFD6_C30C
        );
        assert_eq!(
            fingerprint(0, RealKvHashMode::Partial, &[source]),
            0xD6D7_5024_DFD6_C30C
        );
        assert_eq!(fingerprint(0, RealKvHashMode::None, &[source]), 0);
        // A slot whose row is past the source reads zeros: never out of bounds.
        assert_eq!(source.word(5, 1), 0);
    }

    /// Spec §13, example 2: write, a clean verify, then a token flip.
    #[test]
    fn roundtrip_token_flip() {
        let mut state = CanaryState::zeroed(8, 4, 4);
        let launch = Launch {
            kernel_kind: 0,
            mode: RealKvHashMode::None,
            sources: &[],
        };
        let write_args = WriteArgs {
            offsets: &[0, 3],
            seed_slot_indices: &[-1],
            num_valid_reqs: 1,
            input_ids: &[11, 12, 13],
            positions: &[0, 1, 2],
            out_cache_loc: &[3, 5, 6],
            expected_inputs: None,
            chain_position_assert: true,
        };
        assert!(write(&mut state, &write_args, &launch).is_empty());
        assert_eq!(state.record(3), [11, 0, -2414019407054260458, 0]);
        assert_eq!(state.record(5), [12, 1, -8517104317260626359, 0]);
        assert_eq!(state.record(6), [13, 2, 1438260920671241686, 0]);
        let verify_args = VerifyArgs {
            slot_indices: &[3, 5, 6],
            expected_tokens: &[11, 12, 13],
            expected_positions: &[0, 1, 2],
            prev_slot_indices: &[-1, 3, 5],
            num_valid: 3,
            enable: 1,
            check_expected_token: true,
        };
        let launch = Launch {
            kernel_kind: 1,
            ..launch
        };
        assert!(verify(&mut state, &verify_args, &launch).is_empty());
        state.buffer[5 * 4] = 99;
        let rows = verify(&mut state, &verify_args, &launch);
        assert_eq!(
            rows,
            vec![
                [
                    1,
                    5,
                    1,
                    99,
                    12,
                    -8517104317260626359,
                    -8517104317260626359,
                    32
                ],
                [
                    1,
                    6,
                    2,
                    13,
                    13,
                    1438260920671241686,
                    -8615379121724178804,
                    1
                ],
            ]
        );
        assert_eq!(
            (
                state.write_index,
                state.slot_run_counter,
                state.kernel_run_counter
            ),
            (2, 9, 3)
        );
        assert_eq!(state.ring[..2], rows[..]);
    }

    /// Out-of-range slots, seeds and offsets (spec §11) neither panic nor write outside.
    #[test]
    fn preconditions_stay_in_bounds() {
        let mut state = CanaryState::zeroed(4, 4, 1);
        let launch = Launch {
            kernel_kind: 0,
            mode: RealKvHashMode::None,
            sources: &[],
        };
        let args = WriteArgs {
            offsets: &[-3, 9],
            seed_slot_indices: &[77],
            num_valid_reqs: i32::MAX,
            input_ids: &[1, 2],
            positions: &[0, 1],
            out_cache_loc: &[9, 2],
            expected_inputs: None,
            chain_position_assert: true,
        };
        write(&mut state, &args, &launch);
        assert_eq!(state.record(2)[0], 2);
        let args = VerifyArgs {
            slot_indices: &[-1, 99],
            expected_tokens: &[0, 0],
            expected_positions: &[0, 0],
            prev_slot_indices: &[99, -1],
            num_valid: 5,
            enable: 1,
            check_expected_token: true,
        };
        verify(&mut state, &args, &launch);
        assert_eq!(state.num_slots(), 4);
    }
}
