//! kv-canary write and verify against the reference: random multi-step scenarios (poisoned
//! buffers, every mode, 0-4 sources of several dtypes), every corruption kind, benign edits,
//! ring overflow, the plan -> write -> verify pipeline, and every error kind.

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::{DType, TensorData};
use kvplan::KvPlanBackend;
use kvplan::backend::KvBytes;
use kvplan::ops::{
    Canary, CanaryLaunch, CanaryState, FailReasons, KernelKind, PlanInputs, RealKvHashMode,
    RealKvSource, StepPlan, VerifyPlan, WriteInputs, WritePlan,
};
use kvplan::reference::canary::{self as oracle, Launch, SourceBytes, ViolationRow};

use crate::common::{Rng, bytes as u8_bytes, conformance_file, ints, list};

/// A source's byte layout as the library takes it (`kvplan::ops::SourceBytes`; the oracle's
/// `SourceBytes` is the host view of the bytes themselves).
fn layout(page_size: i64, num_bytes_per_token: i64, read_bytes: i64) -> kvplan::ops::SourceBytes {
    kvplan::ops::SourceBytes {
        page_size,
        num_bytes_per_token,
        read_bytes,
    }
}

/// `RealKvSource::int` of 0.21 on a primitive.
fn int_source<B: KvPlanBackend>(
    tensor: IntTensor<B>,
    page_size: i64,
    num_bytes_per_token: i64,
    read_bytes: i64,
) -> Result<RealKvSource<B>, kvplan::Error> {
    RealKvSource::<B>::from_primitive(
        KvBytes::Int(tensor),
        layout(page_size, num_bytes_per_token, read_bytes),
    )
}

fn launch_of<B: KvPlanBackend>(kind: i32) -> CanaryLaunch<B> {
    CanaryLaunch::new(KernelKind(kind))
}

pub fn conformance<B: KvPlanBackend>(device: &B::Device) {
    let text = conformance_file("canary.jsonl");
    let report = kvplan_tools::conformance::check_file::<B>(&text, device);
    crate::conformance::assert_clean("canary.jsonl", &report, 104);
}

/// A source held on the host (the oracle's view) and as the device tensor under test.
struct Source {
    bytes: Vec<u8>,
    row_bytes: usize,
    page_size: usize,
    num_bytes_per_token: usize,
    read_bytes: usize,
    /// 0: i64 words, 1: u8 bytes, 2: f32 values.
    dtype: u8,
}

impl Source {
    fn random(rng: &mut Rng, num_slots: usize) -> Self {
        let page_size = rng.pick(&[1usize, 2, 16]);
        let num_bytes_per_token = rng.pick(&[16usize, 32, 64]);
        let read_bytes = 16 * rng.urange(1, num_bytes_per_token / 16);
        let row_bytes = page_size * num_bytes_per_token + rng.pick(&[0usize, 16]);
        // Sometimes fewer rows than slots need: those slots read zeros, never out of bounds.
        let rows = num_slots.div_ceil(page_size) + rng.urange(0, 1) - usize::from(rng.chance(1, 8));
        let dtype = rng.below(3) as u8;
        let bytes = (0..rows * row_bytes / 4)
            .flat_map(|_| {
                // f32 sources hold small integers (finite, bit-stable through any upload).
                let word = if dtype == 2 {
                    (rng.below(1 << 20) as f32).to_bits()
                } else {
                    rng.next_u64() as u32
                };
                word.to_le_bytes()
            })
            .collect();
        Self {
            bytes,
            row_bytes,
            page_size,
            num_bytes_per_token,
            read_bytes,
            dtype,
        }
    }

    fn view(&self) -> SourceBytes<'_> {
        SourceBytes {
            bytes: &self.bytes,
            row_bytes: self.row_bytes,
            page_size: self.page_size,
            num_bytes_per_token: self.num_bytes_per_token,
            read_bytes: self.read_bytes,
        }
    }

    fn tensor<B: KvPlanBackend>(&self, device: &B::Device) -> RealKvSource<B> {
        let rows = self.bytes.len() / self.row_bytes;
        let (page, nbpt, read) = (
            self.page_size as i64,
            self.num_bytes_per_token as i64,
            self.read_bytes as i64,
        );
        let source = match self.dtype {
            0 => {
                let words: Vec<i64> = self
                    .bytes
                    .chunks_exact(8)
                    .map(|w| i64::from_le_bytes(w.try_into().unwrap()))
                    .collect();
                let data = TensorData::new(words, [rows, self.row_bytes / 8]);
                int_source(B::int_from_data(data, device), page, nbpt, read)
            }
            1 => {
                let tensor = u8_bytes::<B, 2>(self.bytes.clone(), [rows, self.row_bytes], device);
                int_source(tensor, page, nbpt, read)
            }
            _ => {
                let floats: Vec<f32> = self
                    .bytes
                    .chunks_exact(4)
                    .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
                    .collect();
                // A 3-D view: rows stay dim 0, the rest of a row is contiguous.
                let data = TensorData::new(floats, [rows, 2, self.row_bytes / 8]);
                RealKvSource::<B>::from_primitive(
                    KvBytes::Float(B::float_from_data(data, device)),
                    layout(page, nbpt, read),
                )
            }
        };
        source.expect("a valid source")
    }
}

/// One canary on the device and its oracle, driven by the same ops.
struct Harness<B: KvPlanBackend> {
    canary: Canary<B>,
    oracle: CanaryState,
    device: B::Device,
}

struct WriteStep {
    offsets: Vec<i64>,
    seeds: Vec<i64>,
    num_valid_reqs: i32,
    input_ids: Vec<i64>,
    positions: Vec<i64>,
    out_cache_loc: Vec<i64>,
    expected: Option<(Vec<i64>, Vec<i64>)>,
    chain_position_assert: Option<i32>,
}

struct VerifyStep {
    slots: Vec<i64>,
    tokens: Vec<i64>,
    positions: Vec<i64>,
    prev: Vec<i64>,
    num_valid: i32,
    enable: i32,
    check_token: bool,
}

fn i64s<B: KvPlanBackend>(values: &[i64], device: &B::Device) -> IntTensor<B> {
    list::<B>(values, DType::I64, device)
}

fn i32s<B: KvPlanBackend>(value: i32, device: &B::Device) -> IntTensor<B> {
    list::<B>(&[value as i64], DType::I32, device)
}

fn sorted(mut rows: Vec<ViolationRow>) -> Vec<ViolationRow> {
    rows.sort_unstable();
    rows
}

impl<B: KvPlanBackend> Harness<B> {
    fn new(state: CanaryState, device: &B::Device) -> Self {
        Self {
            canary: Canary::from_state(&state, device).unwrap(),
            oracle: state,
            device: device.clone(),
        }
    }

    fn launch(
        &self,
        kind: i32,
        mode: RealKvHashMode,
        sources: &[Source],
        check_token: bool,
    ) -> CanaryLaunch<B> {
        let tensors = sources
            .iter()
            .map(|s| s.tensor::<B>(&self.device))
            .collect();
        launch_of::<B>(kind)
            .real_kv(mode, tensors)
            .check_verify_expected_token(check_token)
    }

    fn write(
        &mut self,
        step: &WriteStep,
        kind: i32,
        mode: RealKvHashMode,
        sources: &[Source],
    ) -> Vec<ViolationRow> {
        let d = &self.device;
        let plan = WritePlan::<B>::from_primitives(
            i64s::<B>(&step.offsets, d),
            i64s::<B>(&step.seeds, d),
            i32s::<B>(step.num_valid_reqs, d),
        )
        .unwrap();
        let mut inputs = WriteInputs::<B>::from_primitives(
            i64s::<B>(&step.input_ids, d),
            i64s::<B>(&step.positions, d),
            i64s::<B>(&step.out_cache_loc, d),
        );
        if let Some((tokens, positions)) = &step.expected {
            inputs = inputs
                .enable_write_input_assert(true)
                .expected_input_tokens_primitive(i64s::<B>(tokens, d))
                .expected_input_positions_primitive(i64s::<B>(positions, d));
        }
        if let Some(flag) = step.chain_position_assert {
            inputs = inputs.chain_position_assert_primitive(i32s::<B>(flag, d));
        }
        let launch = self.launch(kind, mode, sources, true);
        self.canary.write(&plan, inputs, &launch).unwrap();
        let views: Vec<SourceBytes> = sources.iter().map(Source::view).collect();
        let args = oracle::WriteArgs {
            offsets: &step.offsets,
            seed_slot_indices: &step.seeds,
            num_valid_reqs: step.num_valid_reqs,
            input_ids: &step.input_ids,
            positions: &step.positions,
            out_cache_loc: &step.out_cache_loc,
            expected_inputs: step
                .expected
                .as_ref()
                .map(|(t, p)| (t.as_slice(), p.as_slice())),
            chain_position_assert: step.chain_position_assert.is_some_and(|f| f != 0),
        };
        let before = self.oracle.clone();
        let rows = oracle::write(
            &mut self.oracle,
            &args,
            &Launch {
                kernel_kind: kind,
                mode,
                sources: &views,
            },
        );
        self.check(&before, &rows, "write");
        rows
    }

    fn verify(
        &mut self,
        step: &VerifyStep,
        kind: i32,
        mode: RealKvHashMode,
        sources: &[Source],
    ) -> Vec<ViolationRow> {
        let d = &self.device;
        let plan = VerifyPlan::<B>::from_primitives(
            i64s::<B>(&step.slots, d),
            i64s::<B>(&step.tokens, d),
            i64s::<B>(&step.positions, d),
            i64s::<B>(&step.prev, d),
            i32s::<B>(step.num_valid, d),
            i32s::<B>(step.enable, d),
        )
        .unwrap();
        let launch = self.launch(kind, mode, sources, step.check_token);
        self.canary.verify(&plan, &launch).unwrap();
        let views: Vec<SourceBytes> = sources.iter().map(Source::view).collect();
        let args = oracle::VerifyArgs {
            slot_indices: &step.slots,
            expected_tokens: &step.tokens,
            expected_positions: &step.positions,
            prev_slot_indices: &step.prev,
            num_valid: step.num_valid,
            enable: step.enable,
            check_expected_token: step.check_token,
        };
        let before = self.oracle.clone();
        let rows = oracle::verify(
            &mut self.oracle,
            &args,
            &Launch {
                kernel_kind: kind,
                mode,
                sources: &views,
            },
        );
        self.check(&before, &rows, "verify");
        rows
    }

    /// Buffer and counters exactly; ring rows before the step exactly; new rows as a multiset
    /// (a sub-multiset of the produced rows once the ring overflows). The oracle then takes the
    /// device's row order: rows of different requests or entries may land in any order.
    #[track_caller]
    fn check(&mut self, before: &CanaryState, rows: &[ViolationRow], what: &str) {
        let got = self.canary.state().unwrap();
        let want = &self.oracle;
        if let Some(i) = got
            .buffer
            .iter()
            .zip(&want.buffer)
            .position(|(g, w)| g != w)
        {
            let words = want.slot_stride_words;
            panic!(
                "{what}: slot {} word {}: got {}, want {}",
                i / words,
                i % words,
                got.buffer[i],
                want.buffer[i]
            );
        }
        let counters = |s: &CanaryState| (s.write_index, s.slot_run_counter, s.kernel_run_counter);
        assert_eq!(
            counters(&got),
            counters(want),
            "{what}: (write_index, slot_run, kernel_run)"
        );
        let capacity = want.ring.len();
        let stored = |index: i64| (index.max(0) as usize).min(capacity);
        let (old, new) = (stored(before.write_index), stored(want.write_index));
        assert_eq!(
            got.ring[..old],
            want.ring[..old],
            "{what}: ring rows before the step"
        );
        assert_eq!(
            got.ring[new..],
            want.ring[new..],
            "{what}: ring rows past the write index"
        );
        let added = got.ring[old..new].to_vec();
        if added.len() == rows.len() {
            assert_eq!(sorted(added), sorted(rows.to_vec()), "{what}: new rows");
        } else {
            let mut rest = rows.to_vec();
            for row in &added {
                let k = rest
                    .iter()
                    .position(|r| r == row)
                    .unwrap_or_else(|| panic!("{what}: stored row {row:?} was not produced"));
                rest.swap_remove(k);
            }
        }
        self.oracle.ring = got.ring;
    }
}

/// A state with poisoned records (including the caller's words past the 4 fields).
fn poisoned(rng: &mut Rng, num_slots: usize, slot_words: usize, ring: usize) -> CanaryState {
    let mut state = CanaryState::zeroed(num_slots, slot_words, ring);
    for word in &mut state.buffer {
        *word = rng.next_u64() as i64;
    }
    for row in &mut state.ring {
        *row = core::array::from_fn(|_| rng.next_u64() as i64);
    }
    state.write_index = rng.range(0, 3);
    state.slot_run_counter = rng.range(0, 1000);
    state.kernel_run_counter = rng.range(0, 1000);
    state
}

/// Requests over distinct fresh slots, seeded from earlier chains (or heads).
fn random_write(rng: &mut Rng, num_slots: usize, written: &mut Vec<(i64, i64, i64)>) -> WriteStep {
    let capacity = rng.urange(0, 9);
    let mut free: Vec<i64> = (1..num_slots as i64)
        .filter(|s| !written.iter().any(|w| w.0 == *s))
        .collect();
    rng.shuffle(&mut free);
    let mut step = WriteStep {
        offsets: vec![0],
        seeds: vec![],
        num_valid_reqs: rng.range(-1, capacity as i64 + 1) as i32,
        input_ids: vec![],
        positions: vec![],
        out_cache_loc: vec![],
        expected: rng.chance(1, 3).then(|| (vec![], vec![])),
        chain_position_assert: rng.chance(2, 3).then(|| rng.range(0, 2) as i32),
    };
    let seeds_before = written.clone();
    for _ in 0..capacity {
        let (seed, mut position) = match rng
            .chance(1, 2)
            .then(|| seeds_before.get(rng.below(seeds_before.len() as u64) as usize))
            .flatten()
        {
            Some(&(slot, _, position)) => (slot, position + 1),
            None => (rng.pick(&[-1, -7]), 0),
        };
        step.seeds.push(seed);
        for _ in 0..rng.urange(0, 12) {
            let slot = match free.pop() {
                Some(slot) if !rng.chance(1, 10) => slot,
                _ => -1,
            };
            let token = rng.range(-5, 1 << 40);
            if rng.chance(1, 12) {
                position += rng.range(-3, 3);
            }
            step.input_ids.push(token);
            step.positions.push(position);
            step.out_cache_loc.push(slot);
            if let Some((tokens, positions)) = &mut step.expected {
                tokens.push(if rng.chance(1, 8) { token ^ 1 } else { token });
                positions.push(if rng.chance(1, 8) {
                    position + 1
                } else {
                    position
                });
            }
            if slot > 0 {
                written.push((slot, token, position));
            }
            position += 1;
        }
        step.offsets.push(step.input_ids.len() as i64);
    }
    // Padding tail past the last offset: never read.
    for _ in 0..rng.urange(0, 3) {
        step.input_ids.push(9);
        step.positions.push(9);
        step.out_cache_loc.push(rng.range(1, num_slots as i64 - 1));
        if let Some((tokens, positions)) = &mut step.expected {
            tokens.push(0);
            positions.push(0);
        }
    }
    step
}

/// Entries over written (and some never written or out-of-range) slots.
fn random_verify(rng: &mut Rng, num_slots: usize, written: &[(i64, i64, i64)]) -> VerifyStep {
    let capacity = rng.urange(0, 64);
    let mut step = VerifyStep {
        slots: vec![],
        tokens: vec![],
        positions: vec![],
        prev: vec![],
        num_valid: rng.range(-1, capacity as i64 + 2) as i32,
        enable: rng.pick(&[0, 1, 1, 1, 5]),
        check_token: rng.chance(3, 4),
    };
    for _ in 0..capacity {
        let (slot, token, position) =
            match written.get(rng.below(written.len() as u64 + 2) as usize) {
                Some(&entry) => entry,
                None => (
                    rng.pick(&[0, 0, num_slots as i64 - 1, num_slots as i64 + 3, -2]),
                    7,
                    7,
                ),
            };
        step.slots.push(slot);
        step.tokens.push(if rng.chance(1, 10) {
            token + 1
        } else {
            rng.pick(&[token, token, -1])
        });
        step.positions.push(if rng.chance(1, 10) {
            position - 1
        } else {
            position
        });
        let prev = written
            .iter()
            .find(|w| w.2 + 1 == position)
            .map_or(-1, |w| w.0);
        step.prev.push(rng.pick(&[prev, prev, prev, 0, -1, -9]));
    }
    step
}

pub fn random_scenarios<B: KvPlanBackend>(device: &B::Device) {
    for seed in 0..12u64 {
        random_scenario::<B>(0xCA7A_0000 + seed, device);
    }
}

/// One scenario of [`random_scenarios`]: a poisoned canary, random sources, 8 writes and
/// verifies, each compared with the oracle.
pub fn random_scenario<B: KvPlanBackend>(seed: u64, device: &B::Device) {
    let mut rng = Rng::new(seed);
    let num_slots = rng.pick(&[64usize, 300]);
    let slot_words = rng.pick(&[4usize, 5, 8]);
    let ring = rng.urange(0, 24);
    let mut harness = Harness::<B>::new(poisoned(&mut rng, num_slots, slot_words, ring), device);
    let sources: Vec<Source> = (0..rng.urange(0, 4))
        .map(|_| Source::random(&mut rng, num_slots))
        .collect();
    let mut written = Vec::new();
    for step in 0..8 {
        let mode = rng.pick(&[
            RealKvHashMode::None,
            RealKvHashMode::Partial,
            RealKvHashMode::All,
        ]);
        let kind = rng.range(-1, 11) as i32;
        if step % 2 == 0 {
            let write = random_write(&mut rng, num_slots, &mut written);
            harness.write(&write, kind, mode, &sources);
        } else {
            let verify = random_verify(&mut rng, num_slots, &written);
            harness.verify(&verify, kind, mode, &sources);
        }
    }
}

/// One request of `tokens` written from a chain head into slots `first..`, position 0 on.
fn chain(first: i64, tokens: &[i64]) -> WriteStep {
    let n = tokens.len();
    WriteStep {
        offsets: vec![0, n as i64],
        seeds: vec![-1],
        num_valid_reqs: 1,
        input_ids: tokens.to_vec(),
        positions: (0..n as i64).collect(),
        out_cache_loc: (first..first + n as i64).collect(),
        expected: None,
        chain_position_assert: Some(1),
    }
}

/// Verifies the chain `chain(first, tokens)` wrote.
fn chain_check(first: i64, tokens: &[i64]) -> VerifyStep {
    let n = tokens.len() as i64;
    VerifyStep {
        slots: (first..first + n).collect(),
        tokens: tokens.to_vec(),
        positions: (0..n).collect(),
        prev: (0..n)
            .map(|k| if k == 0 { -1 } else { first + k - 1 })
            .collect(),
        num_valid: n as i32,
        enable: 1,
        check_token: true,
    }
}

fn fails(rows: &[ViolationRow]) -> Vec<(i64, FailReasons)> {
    let mut found: Vec<(i64, FailReasons)> =
        rows.iter().map(|r| (r[1], FailReasons(r[7]))).collect();
    found.sort_by_key(|(slot, _)| *slot);
    found
}

/// Every corruption kind is reported with its slot and fail bits; benign edits are not.
pub fn corruption_kinds<B: KvPlanBackend>(device: &B::Device) {
    const TOKENS: [i64; 4] = [11, 12, 13, 14];
    let (chain_bit, position_bit, real_kv_bit, token_bit) = (
        FailReasons::VERIFY_CHAIN_HASH_MISMATCH,
        FailReasons::VERIFY_POSITION_MISMATCH,
        FailReasons::VERIFY_REAL_KV_HASH_MISMATCH,
        FailReasons::VERIFY_TOKEN_MISMATCH,
    );
    let or = |a: FailReasons, b: FailReasons| FailReasons(a.0 | b.0);
    let mut rng = Rng::new(77);
    let source = Source {
        dtype: 0,
        ..Source::random(&mut rng, 32)
    };
    let source = Source {
        page_size: 1,
        num_bytes_per_token: 32,
        read_bytes: 16,
        row_bytes: 48,
        bytes: (0..32 * 48).map(|k| k as u8).collect(),
        ..source
    };
    let sources = [source];
    type Edit = fn(&mut CanaryState, &mut Vec<u8>);
    let cases: [(&str, Edit, Vec<(i64, FailReasons)>); 8] = [
        (
            "token flip",
            |s, _| s.buffer[5 * s.slot_stride_words] ^= 1,
            vec![(5, token_bit), (6, chain_bit)],
        ),
        (
            "position flip",
            |s, _| s.buffer[5 * s.slot_stride_words + 1] ^= 4,
            vec![(5, position_bit), (6, chain_bit)],
        ),
        (
            "chain flip",
            |s, _| s.buffer[5 * s.slot_stride_words + 2] ^= 1 << 40,
            // The successor's link folds the flipped chain value too.
            vec![(5, chain_bit), (6, chain_bit)],
        ),
        (
            "real-KV field flip",
            |s, _| s.buffer[6 * s.slot_stride_words + 3] ^= 2,
            vec![(6, real_kv_bit)],
        ),
        (
            "real-KV byte flip",
            |_, bytes| bytes[5 * 48 + 3] ^= 0x80,
            vec![(5, real_kv_bit)],
        ),
        (
            "swapped slots",
            |s, _| {
                let w = s.slot_stride_words;
                for k in 0..w {
                    s.buffer.swap(4 * w + k, 5 * w + k);
                }
            },
            vec![
                (
                    4,
                    or(or(chain_bit, position_bit), or(token_bit, real_kv_bit)),
                ),
                (
                    5,
                    or(or(chain_bit, position_bit), or(token_bit, real_kv_bit)),
                ),
                (6, chain_bit),
            ],
        ),
        (
            "benign: bytes past read_bytes and row padding",
            |_, bytes| {
                bytes[5 * 48 + 20] ^= 1;
                bytes[5 * 48 + 40] ^= 1;
            },
            vec![],
        ),
        (
            "benign: the caller's words past the record",
            |s, _| s.buffer[5 * s.slot_stride_words + 4] ^= 1,
            vec![],
        ),
    ];
    for (name, edit, want) in cases {
        let mut harness = Harness::<B>::new(CanaryState::zeroed(32, 6, 8), device);
        let mut sources = [Source {
            bytes: sources[0].bytes.clone(),
            ..sources[0]
        }];
        harness.write(&chain(4, &TOKENS), 0, RealKvHashMode::All, &sources);
        assert!(
            harness
                .verify(&chain_check(4, &TOKENS), 1, RealKvHashMode::All, &sources)
                .is_empty(),
            "{name}: clean before"
        );
        let mut state = harness.canary.state().unwrap();
        edit(&mut state, &mut sources[0].bytes);
        harness.oracle = state.clone();
        harness.canary = Canary::from_state(&state, device).unwrap();
        let rows = harness.verify(&chain_check(4, &TOKENS), 1, RealKvHashMode::All, &sources);
        assert_eq!(fails(&rows), want, "{name}");
    }

    // Stale slot after reuse: slot 5 is handed to another request while still listed.
    let mut harness = Harness::<B>::new(CanaryState::zeroed(32, 4, 8), device);
    harness.write(&chain(4, &TOKENS), 0, RealKvHashMode::None, &[]);
    harness.write(&chain(5, &[99]), 0, RealKvHashMode::None, &[]);
    let rows = harness.verify(&chain_check(4, &TOKENS), 1, RealKvHashMode::None, &[]);
    assert_eq!(
        fails(&rows),
        vec![
            (5, or(chain_bit, or(position_bit, token_bit))),
            (6, chain_bit)
        ],
        "stale slot"
    );

    // Lost write: the third token's slot was never written (passed as -1); it holds an older record.
    let mut harness = Harness::<B>::new(CanaryState::zeroed(32, 4, 8), device);
    harness.write(&chain(4, &[1, 2, 3]), 0, RealKvHashMode::None, &[]);
    let mut lost = chain(10, &TOKENS);
    lost.out_cache_loc[2] = -1;
    lost.chain_position_assert = None;
    harness.write(&lost, 0, RealKvHashMode::None, &[]);
    let mut check = chain_check(10, &TOKENS);
    check.slots[2] = 6;
    check.prev[3] = 6;
    let rows = harness.verify(&check, 1, RealKvHashMode::None, &[]);
    assert_eq!(
        fails(&rows),
        vec![(6, or(chain_bit, token_bit)), (13, chain_bit)],
        "lost write"
    );
}

/// Long requests and many rows per launch: every unit loops several times (chain batches,
/// grid-stride verify entries), and every row must still land.
pub fn long_chains<B: KvPlanBackend>(device: &B::Device) {
    let tokens: Vec<i64> = (0..3000).map(|k| 5 + 3 * k).collect();
    let mut harness = Harness::<B>::new(CanaryState::zeroed(4096, 4, 4096), device);
    harness.write(&chain(7, &tokens), 0, RealKvHashMode::None, &[]);
    let mut check = chain_check(7, &tokens);
    for (k, token) in check.tokens.iter_mut().enumerate() {
        if k % 3 == 0 {
            *token += 1;
        }
    }
    let rows = harness.verify(&check, 1, RealKvHashMode::None, &[]);
    assert_eq!(rows.len(), 1000);

    // One request writes a slot twice within a tile (entries 3 and 17 of a 40-entry write, the
    // group's first tile): within a request everything is sequential, so entry 17's record stays.
    let tokens: Vec<i64> = (0..40).map(|k| 9000 + k).collect();
    let mut step = chain(3200, &tokens);
    step.out_cache_loc[17] = step.out_cache_loc[3];
    harness.write(&step, 2, RealKvHashMode::None, &[]);
}

/// A full ring keeps counting; stored rows are a subset of the produced ones.
pub fn ring_overflow<B: KvPlanBackend>(device: &B::Device) {
    let tokens: Vec<i64> = (100..164).collect();
    for capacity in [0usize, 1, 5] {
        let mut harness = Harness::<B>::new(CanaryState::zeroed(128, 4, capacity), device);
        harness.write(&chain(1, &tokens), 0, RealKvHashMode::None, &[]);
        let mut check = chain_check(1, &tokens);
        check.tokens.iter_mut().for_each(|t| *t += 1);
        let rows = harness.verify(&check, 3, RealKvHashMode::None, &[]);
        assert_eq!(rows.len(), 64);
        let violations = harness.canary.violations().unwrap();
        assert_eq!(
            (violations.recorded, violations.dropped),
            (64, 64 - capacity as u64)
        );
        assert_eq!(violations.rows.len(), capacity);
        assert!(violations.rows.iter().all(|v| v.kernel_kind == 3 && v.fail_reasons == FailReasons::VERIFY_TOKEN_MISMATCH));
        harness.canary.clear();
        let cleared = harness.canary.violations().unwrap();
        assert_eq!((cleared.recorded, cleared.rows.len()), (0, 0));
        assert_eq!(
            harness.canary.state().unwrap().kernel_run_counter,
            2,
            "clear keeps the health counters"
        );
    }
}

/// `plan` fills the plans on the device; `write` and `verify` read their counts from there.
pub fn plan_write_verify<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let mut plans = StepPlan::<B>::allocate_on(256, 4, d).unwrap();
    let mut canary = Canary::<B>::allocate_on(64, 32, 16, d).unwrap();
    // req_to_token rows 1 and 2 map positions to slots 10.. and 40..
    let mut table = vec![0i64; 3 * 16];
    for c in 0..16 {
        table[16 + c] = 10 + c as i64;
        table[32 + c] = 40 + c as i64;
    }
    let table = ints::<B, 2>(&table, [3, 16], DType::I64, d);
    // Step 1 prefills 5 and 3 tokens (slots 10.. and 40..); step 2 decodes one token each and
    // verifies step 1's records through the chains the plan lists.
    let steps: [(&[i64], &[i64], &[i64], &[i64]); 2] = [
        (
            &[0, 0],
            &[5, 3],
            &[0, 1, 2, 3, 4, 0, 1, 2],
            &[10, 11, 12, 13, 14, 40, 41, 42],
        ),
        (&[5, 3], &[1, 1], &[5, 3], &[15, 43]),
    ];
    for (prefix, extend, positions, slots) in steps {
        plan::<B>(&mut plans, [1, 2], prefix, extend, &table, d);
        let tokens: Vec<i64> = slots.iter().map(|s| s * 3).collect();
        let inputs = WriteInputs::<B>::from_primitives(
            i64s::<B>(&tokens, d),
            i64s::<B>(positions, d),
            i64s::<B>(slots, d),
        )
        .chain_position_assert_primitive(i32s::<B>(1, d));
        canary
            .write(&plans.write, inputs, &launch_of::<B>(0))
            .unwrap();
        canary.verify(&plans.verify, &launch_of::<B>(1)).unwrap();
    }
    assert_eq!(canary.violations().unwrap().recorded, 0, "clean pipeline");
    let state = canary.state().unwrap();
    // Writes 8 + 2 records; verifies 0, then 5 + 3 entries; four launches.
    assert_eq!((state.slot_run_counter, state.kernel_run_counter), (18, 4));
    assert_eq!(
        state.record(15),
        [45, 5, oracle::link(&state, 14) as i64, 0],
        "decode continues the chain"
    );

    // A corrupted slot is then caught by the next step's verify, with its slot and position.
    let mut corrupted = state.clone();
    corrupted.buffer[12 * 4 + 2] ^= 1;
    let mut canary = Canary::<B>::from_state(&corrupted, d).unwrap();
    canary.verify(&plans.verify, &launch_of::<B>(1)).unwrap();
    let rows = canary.violations().unwrap().rows;
    let found: Vec<(i64, i64)> = rows.iter().map(|v| (v.slot, v.position)).collect();
    // Its own chain value, and its successor's link into it.
    assert_eq!(sorted_pairs(found), vec![(12, 2), (13, 3)], "{rows:?}");
}

fn sorted_pairs(mut pairs: Vec<(i64, i64)>) -> Vec<(i64, i64)> {
    pairs.sort_unstable();
    pairs
}

fn plan<B: KvPlanBackend>(
    plans: &mut StepPlan<B>,
    rows: [i64; 2],
    prefix: &[i64],
    extend: &[i64],
    table: &IntTensor<B>,
    d: &B::Device,
) {
    let inputs = PlanInputs::<B>::from_primitives(
        i64s::<B>(&rows, d),
        i64s::<B>(prefix, d),
        i64s::<B>(extend, d),
        table.clone(),
    );
    kvplan::ops::plan(plans, inputs)
        .and_then(|status| status.check().map(drop))
        .unwrap();
}

/// Every host rule returns its kind and changes nothing.
pub fn errors<B: KvPlanBackend>(device: &B::Device) {
    let d = device;
    let kind = |result: Result<(), kvplan::Error>| result.err().map(|e| e.kind());
    let alloc = |stride| {
        Canary::<B>::allocate_on(8, stride, 2, d)
            .err()
            .map(|e| e.kind())
    };
    assert_eq!(alloc(36), Some("slot_stride_not_multiple_of_8"));
    assert_eq!(alloc(24), Some("slot_stride_too_small"));
    let bytes =
        |rows: usize, cols: usize| u8_bytes::<B, 2>(vec![0u8; rows * cols], [rows, cols], d);
    let source = |page, nbpt, read| {
        int_source::<B>(bytes(8, 64), page, nbpt, read)
            .err()
            .map(|e| e.kind())
    };
    assert_eq!(source(0, 32, 32), Some("source_page_size"));
    assert_eq!(source(1, 24, 16), Some("source_num_bytes_per_token"));
    assert_eq!(source(1, 32, 48), Some("source_read_bytes"));
    assert_eq!(source(1, 32, 8), Some("source_read_bytes"));
    let flat = u8_bytes::<B, 1>(vec![0u8; 64], [64], d);
    assert_eq!(
        int_source::<B>(flat, 1, 16, 16).err().map(|e| e.kind()),
        Some("source_not_2d")
    );
    assert_eq!(
        int_source::<B>(bytes(8, 40), 1, 16, 16)
            .err()
            .map(|e| e.kind()),
        Some("source_row_stride")
    );
    let message = int_source::<B>(bytes(8, 64), 0, 32, 32)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        message,
        "kv-canary: RealKvSource.page_size must be >= 1, got 0"
    );

    let state = CanaryState::zeroed(16, 4, 4);
    let mut canary = Canary::<B>::from_state(&state, d).unwrap();
    let good = || int_source::<B>(bytes(16, 32), 2, 16, 16).unwrap();
    let narrow = || int_source::<B>(bytes(16, 32), 2, 32, 32).unwrap();
    let plan = WritePlan::<B>::from_primitives(
        i64s::<B>(&[0, 1], d),
        i64s::<B>(&[-1], d),
        i32s::<B>(1, d),
    )
    .unwrap();
    let verify_plan = VerifyPlan::<B>::from_primitives(
        i64s::<B>(&[1], d),
        i64s::<B>(&[1], d),
        i64s::<B>(&[0], d),
        i64s::<B>(&[-1], d),
        i32s::<B>(1, d),
        i32s::<B>(1, d),
    )
    .unwrap();
    let inputs = || {
        WriteInputs::<B>::from_primitives(
            i64s::<B>(&[1], d),
            i64s::<B>(&[0], d),
            i64s::<B>(&[1], d),
        )
    };
    let launch = |sources: Vec<RealKvSource<B>>, mode| launch_of::<B>(0).real_kv(mode, sources);
    let five = launch((0..5).map(|_| good()).collect(), RealKvHashMode::All);
    assert_eq!(
        kind(canary.write(&plan, inputs(), &five)),
        Some("too_many_sources")
    );
    assert_eq!(
        kind(canary.verify(&verify_plan, &five)),
        Some("too_many_sources")
    );
    let narrow_all = launch(vec![narrow()], RealKvHashMode::Partial);
    assert_eq!(
        kind(canary.write(&plan, inputs(), &narrow_all)),
        Some("source_row_too_narrow")
    );
    assert_eq!(
        kind(canary.verify(&verify_plan, &narrow_all)),
        Some("source_row_too_narrow")
    );
    // Mode NONE never reads the rows: a narrow source is accepted.
    let plain = launch_of::<B>(0);
    let tokens = || i64s::<B>(&[1], d);
    assert_eq!(
        kind(canary.write(&plan, inputs().enable_write_input_assert(true), &plain)),
        Some("expected_inputs_missing")
    );
    assert_eq!(
        kind(
            canary.write(
                &plan,
                inputs()
                    .enable_write_input_assert(true)
                    .expected_input_tokens_primitive(tokens()),
                &plain
            )
        ),
        Some("expected_inputs_missing")
    );
    assert_eq!(
        kind(canary.write(
            &plan,
            inputs().expected_input_positions_primitive(tokens()),
            &plain
        )),
        Some("expected_inputs_unexpected")
    );
    let short = WriteInputs::<B>::from_primitives(
        i64s::<B>(&[1, 2], d),
        i64s::<B>(&[0], d),
        i64s::<B>(&[1, 2], d),
    );
    assert_eq!(
        kind(canary.write(&plan, short, &plain)),
        Some("token_arrays_length")
    );
    let i32_ids = WriteInputs::<B>::from_primitives(
        list::<B>(&[1], DType::I32, d),
        i64s::<B>(&[0], d),
        i64s::<B>(&[1], d),
    );
    assert_eq!(
        kind(canary.write(&plan, i32_ids, &plain)),
        Some("canary_argument")
    );
    let wide_flag = inputs().chain_position_assert_primitive(i64s::<B>(&[1], d));
    assert_eq!(
        kind(canary.write(&plan, wide_flag, &plain)),
        Some("canary_argument")
    );
    let offsets = WritePlan::<B>::from_primitives(
        i64s::<B>(&[0, 1, 1], d),
        i64s::<B>(&[-1], d),
        i32s::<B>(1, d),
    );
    assert_eq!(
        offsets.err().map(|e| e.kind()),
        Some("write_offsets_length")
    );
    let lengths = VerifyPlan::<B>::from_primitives(
        i64s::<B>(&[1, 2], d),
        i64s::<B>(&[1], d),
        i64s::<B>(&[0], d),
        i64s::<B>(&[-1], d),
        i32s::<B>(1, d),
        i32s::<B>(1, d),
    );
    assert_eq!(lengths.err().map(|e| e.kind()), Some("verify_plan_length"));
    assert_eq!(
        canary.state().unwrap(),
        state,
        "host-rule errors change nothing"
    );

    // Plans of capacity 0 are fine for write and verify, but `plan` refuses to fill them.
    let empty = || i64s::<B>(&[], d);
    let no_entries = VerifyPlan::<B>::from_primitives(
        empty(),
        empty(),
        empty(),
        empty(),
        i32s::<B>(0, d),
        i32s::<B>(1, d),
    )
    .unwrap();
    let no_requests =
        WritePlan::<B>::from_primitives(i64s::<B>(&[0], d), empty(), i32s::<B>(0, d)).unwrap();
    // `StepPlan`'s fields are public: a plan of one empty half and one allocated half.
    let allocated = StepPlan::<B>::allocate_on(8, 2, d).unwrap();
    let table = ints::<B, 2>(&[0i64; 8], [2, 4], DType::I64, d);
    let inputs = || {
        PlanInputs::<B>::from_primitives(
            i64s::<B>(&[1], d),
            i64s::<B>(&[2], d),
            i64s::<B>(&[1], d),
            table.clone(),
        )
    };
    let StepPlan { verify, write } = allocated;
    let mut plans = StepPlan {
        verify: no_entries,
        write,
    };
    let planned =
        kvplan::ops::plan(&mut plans, inputs()).and_then(|status| status.check().map(drop));
    assert_eq!(kind(planned), Some("non_positive_verify_capacity"));
    let mut plans = StepPlan {
        verify,
        write: no_requests,
    };
    let planned =
        kvplan::ops::plan(&mut plans, inputs()).and_then(|status| status.check().map(drop));
    assert_eq!(kind(planned), Some("non_positive_write_capacity"));
}
