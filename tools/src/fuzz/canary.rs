//! Canary cases: a poisoned canary (records, ring, counters), 0-5 real-KV sources of several
//! dtypes (some too short for their slots, some refused), then a write and a verify, each with
//! a launch tag, a hash mode and its asserts; the verify partly follows the write's chains.
//!
//! Every slot a step touches is inside the canary and no two requests of a write share a slot:
//! the spec leaves the outcome of anything else unspecified (§11).

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::{DType, TensorData};
use kvplan::backend::KvBytes;
use kvplan::ops::{
    Canary, CanaryLaunch, CanaryState, KernelKind, RealKvHashMode, RealKvSource, SourceBytes,
    VerifyPlan, WriteInputs, WritePlan,
};
use kvplan::reference::canary::{self as oracle, ViolationRow};
use kvplan::{Error, KvPlanBackend};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{Failure, Family, Outcome, same, same_list};
use crate::conformance::canary::{sorted, sub_multiset};
use crate::prim;

/// A scenario: the canary's first state, the sources, then its steps in order.
#[derive(Debug, Clone)]
pub struct CanaryCase {
    slot_stride_bytes: usize,
    init: CanaryState,
    sources: Vec<Source>,
    steps: Vec<Step>,
}

/// A real-KV source: its layout as given (maybe refused) and its bytes.
#[derive(Debug, Clone)]
struct Source {
    page_size: i64,
    num_bytes_per_token: i64,
    read_bytes: i64,
    row_bytes: usize,
    bytes: Vec<u8>,
    /// How the bytes are handed over: i64 words, u8, or f32 `[rows, 2, row_bytes / 8]`.
    dtype: SourceDtype,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SourceDtype {
    Words,
    Bytes,
    Floats,
}

/// What every kernel step takes besides its plan.
#[derive(Debug, Clone)]
struct Launch {
    kernel_kind: i32,
    mode: RealKvHashMode,
    sources_used: Vec<usize>,
}

#[derive(Debug, Clone)]
enum Step {
    Write {
        launch: Launch,
        offsets: Vec<i64>,
        seeds: Vec<i64>,
        num_valid_reqs: i32,
        input_ids: Vec<i64>,
        positions: Vec<i64>,
        out_cache_loc: Vec<i64>,
        input_assert: bool,
        expected: Option<(Vec<i64>, Vec<i64>)>,
        chain_position_assert: i32,
    },
    Verify {
        launch: Launch,
        check_token: bool,
        /// Slots, expected tokens, expected positions, predecessors.
        plan: [Vec<i64>; 4],
        num_valid: i32,
        enable: i32,
    },
}

/// What a run shows: the canary's creation, then per step the state before, the step's result
/// and the state after (a scenario ends at its first error).
#[derive(Debug)]
pub struct CanaryRun {
    setup: Outcome<()>,
    steps: Vec<StepRun>,
}

#[derive(Debug)]
struct StepRun {
    before: Outcome<CanaryState>,
    result: Outcome<()>,
    after: Outcome<CanaryState>,
}

pub struct CanaryOps;

fn mode() -> impl Strategy<Value = RealKvHashMode> {
    prop_oneof![
        Just(RealKvHashMode::None),
        Just(RealKvHashMode::Partial),
        Just(RealKvHashMode::All)
    ]
}

fn source(num_slots: usize) -> BoxedStrategy<Source> {
    // Each refused layout now and then: page size 0, a width or a read that is not a multiple
    // of 16 or is too wide, a row stride of 8 bytes, a row narrower than its slots.
    let layout = (
        prop_oneof![30 => proptest::sample::select(vec![1i64, 2, 16]), 1 => Just(0i64)],
        prop_oneof![30 => proptest::sample::select(vec![16i64, 32, 64]), 1 => Just(24i64)],
        prop_oneof![30 => 0..3i64, 1 => Just(3i64)],
        prop_oneof![30 => Just(0usize), 6 => Just(16usize), 1 => Just(8usize), 1 => Just(usize::MAX)],
    );
    (
        layout,
        prop_oneof![Just(0usize), Just(1), Just(2)],
        0..=2usize,
    )
        .prop_flat_map(move |((page, nbpt, read, pad), extra_rows, dtype)| {
            let read_bytes = 16 * (read % (nbpt / 16).max(1) + 1) + if read == 3 { 16 } else { 0 };
            let width = (page.max(1) * nbpt) as usize;
            // `usize::MAX` stands for a row narrower than its slots.
            let row_bytes = if pad == usize::MAX {
                width.saturating_sub(16).max(16)
            } else {
                width + pad
            };
            let rows = (num_slots.div_ceil(page.max(1) as usize) + extra_rows).saturating_sub(1);
            let dtype = match dtype {
                _ if row_bytes % 8 != 0 => SourceDtype::Bytes,
                0 => SourceDtype::Words,
                1 => SourceDtype::Bytes,
                _ => SourceDtype::Floats,
            };
            let byte = if dtype == SourceDtype::Floats {
                (0..64u8).boxed()
            } else {
                any::<u8>().boxed()
            };
            proptest::collection::vec(byte, rows * row_bytes).prop_map(move |mut bytes| {
                if dtype == SourceDtype::Floats {
                    // Small whole floats: finite and bit-stable through any upload.
                    for word in bytes.chunks_exact_mut(4) {
                        word.copy_from_slice(&f32::from(word[0]).to_le_bytes());
                    }
                }
                Source {
                    page_size: page,
                    num_bytes_per_token: nbpt,
                    read_bytes,
                    row_bytes,
                    bytes,
                    dtype,
                }
            })
        })
        .boxed()
}

fn launch(sources: usize) -> BoxedStrategy<Launch> {
    let used = prop_oneof![
        30 => proptest::collection::vec(0..sources.max(1), 0..=sources.min(4)),
        1 => proptest::collection::vec(0..sources.max(1), 5..=5),
    ];
    let kind = prop_oneof![8 => 0..12i32, 1 => Just(i32::MIN), 1 => Just(i32::MAX)];
    (
        kind,
        mode(),
        if sources == 0 {
            Just(vec![]).boxed()
        } else {
            used.boxed()
        },
    )
        .prop_map(|(kernel_kind, mode, sources_used)| Launch {
            kernel_kind,
            mode,
            sources_used,
        })
        .boxed()
}

/// A request of a write: its seed choice, tokens, position jumps and skipped entries.
type Request = (u8, Vec<(i64, bool, i64)>);

/// A write over distinct slots from `order` (a permutation of the canary's slots); seeds come
/// from the end of `order`, which no request writes.
fn write(num_slots: usize, sources: usize) -> BoxedStrategy<Step> {
    let request = (
        any::<u8>(),
        proptest::collection::vec(
            (
                prop_oneof![8 => 0..100i64, 1 => any::<i64>()],
                proptest::bool::weighted(0.1),
                prop_oneof![12 => Just(1i64), 1 => -3..3i64],
            ),
            0..=5,
        ),
    );
    let order = Just((0..num_slots as i64).collect::<Vec<_>>()).prop_shuffle();
    let flags = (
        proptest::bool::weighted(0.3),
        prop_oneof![20 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8), 1 => Just(3u8)],
        prop_oneof![Just(0i32), Just(1), Just(-1)],
        -1..=6i32,
    );
    (
        launch(sources),
        proptest::collection::vec(request, 0..=4),
        order,
        flags,
        any::<u64>(),
    )
        .prop_map(
            move |(launch, requests, order, (input_assert, fault, chain, valid), salt)| {
                build_write(
                    num_slots,
                    launch,
                    &requests,
                    &order,
                    (input_assert, fault, chain, valid),
                    salt,
                )
            },
        )
        .boxed()
}

fn build_write(
    num_slots: usize,
    launch: Launch,
    requests: &[Request],
    order: &[i64],
    (input_assert, fault, chain, valid): (bool, u8, i32, i32),
    salt: u64,
) -> Step {
    let seeds_room = 4.min(num_slots);
    let mut free = order[..num_slots - seeds_room].iter().copied();
    let (mut offsets, mut seeds) = (vec![0i64], vec![]);
    let (mut input_ids, mut positions, mut out_cache_loc) = (vec![], vec![], vec![]);
    for (k, (seed, entries)) in requests.iter().enumerate() {
        let seed = match seed % 3 {
            _ if seeds_room == 0 => -1,
            0 => -1,
            1 => order[num_slots - 1 - k % seeds_room],
            _ => -7,
        };
        seeds.push(seed);
        let mut position = (salt % 7) as i64;
        for &(token, skip, jump) in entries {
            let slot = match free.next() {
                Some(slot) if !skip => slot,
                _ => -1,
            };
            position = position.wrapping_add(jump);
            input_ids.push(token);
            positions.push(position);
            out_cache_loc.push(slot);
        }
        offsets.push(input_ids.len() as i64);
    }
    // Fault 1: expected arrays without the assert; fault 2: the assert without them.
    let given = match fault {
        1 => true,
        2 => false,
        _ => input_assert,
    };
    let input_assert = match fault {
        1 => false,
        2 => true,
        _ => input_assert,
    };
    let expected = given.then(|| {
        let flip = |v: &i64, k: usize| {
            if (salt >> (k % 64)) & 1 == 1 && k % 3 == 0 {
                v ^ 1
            } else {
                *v
            }
        };
        let tokens = input_ids
            .iter()
            .enumerate()
            .map(|(k, v)| flip(v, k))
            .collect();
        let positions = positions
            .iter()
            .enumerate()
            .map(|(k, v)| flip(v, k + 1))
            .collect();
        (tokens, positions)
    });
    match fault {
        // One token array too short, or the offsets one entry short of K + 1.
        3 if !positions.is_empty() => {
            positions.pop();
        }
        3 => {
            offsets.pop();
        }
        _ => {}
    }
    Step::Write {
        launch,
        offsets,
        num_valid_reqs: valid.min(seeds.len() as i32 + 1),
        seeds,
        input_ids,
        positions,
        out_cache_loc,
        input_assert,
        expected,
        chain_position_assert: chain,
    }
}

/// A verify: entries following the written chains (from `follow`) or random ones.
fn verify(num_slots: usize, sources: usize) -> BoxedStrategy<Step> {
    let slot = 0..num_slots.max(1) as i64;
    let entry = (
        slot.clone(),
        prop_oneof![4 => 0..100i64, 1 => Just(-1i64)],
        0..8i64,
        prop_oneof![4 => slot, 1 => Just(-1i64), 1 => Just(0i64)],
    );
    let counts = (
        prop_oneof![8 => Just(1i32), 1 => Just(0i32), 1 => Just(2i32)],
        any::<bool>(),
        0u8..12,
    );
    (
        launch(sources),
        proptest::collection::vec(entry, 0..=10),
        counts,
        -1..=12i32,
    )
        .prop_map(
            move |(launch, entries, (enable, check_token, short), valid)| {
                let mut plan: [Vec<i64>; 4] = Default::default();
                for (slot, token, position, prev) in entries {
                    for (field, value) in plan.iter_mut().zip([slot, token, position, prev]) {
                        field.push(value);
                    }
                }
                if short == 0 && !plan[2].is_empty() {
                    plan[2].pop();
                }
                Step::Verify {
                    launch,
                    check_token,
                    num_valid: valid.min(plan[0].len() as i32 + 1),
                    plan,
                    enable,
                }
            },
        )
        .boxed()
}

/// The verify entries that recheck a write's stored records and chains.
fn follow(write: &Step, verify: Step) -> Step {
    let (
        Step::Write {
            offsets,
            seeds,
            input_ids,
            positions,
            out_cache_loc,
            ..
        },
        Step::Verify {
            launch,
            check_token,
            plan,
            enable,
            ..
        },
    ) = (write, &verify)
    else {
        return verify;
    };
    let (launch, check_token, enable, mut plan) =
        (launch.clone(), *check_token, *enable, plan.clone());
    for (r, &seed) in seeds.iter().enumerate() {
        let (start, end) = (
            offsets[r].max(0) as usize,
            offsets.get(r + 1).map_or(0, |&e| e.max(0) as usize),
        );
        let mut prev = seed;
        for i in start..end.min(out_cache_loc.len()).min(positions.len()) {
            if out_cache_loc[i] < 0 {
                continue;
            }
            let entry = [out_cache_loc[i], input_ids[i], positions[i], prev];
            for (field, value) in plan.iter_mut().zip(entry) {
                field.push(value);
            }
            prev = out_cache_loc[i];
        }
    }
    let num_valid = plan[0].len() as i32;
    Step::Verify {
        launch,
        check_token,
        plan,
        num_valid,
        enable,
    }
}

fn init(num_slots: usize, stride_words: usize) -> BoxedStrategy<CanaryState> {
    let record =
        proptest::collection::vec(prop_oneof![4 => 0..8i64, 1 => any::<i64>()], stride_words);
    let ring_row = proptest::array::uniform8(any::<i64>());
    (
        proptest::collection::vec(record, num_slots),
        prop_oneof![Just(0usize), Just(1), Just(3), Just(16), Just(64)],
        0..3i64,
        (0..1000i64, 0..1000i64),
    )
        .prop_flat_map(move |(records, ring, write_index, counters)| {
            proptest::collection::vec(ring_row, ring).prop_map(move |ring| CanaryState {
                slot_stride_words: stride_words,
                buffer: records.concat(),
                ring,
                write_index,
                slot_run_counter: counters.0,
                kernel_run_counter: counters.1,
            })
        })
        .boxed()
}

impl Source {
    fn tensor<B: KvPlanBackend>(&self, device: &B::Device) -> Result<RealKvSource<B>, Error> {
        let rows = self.bytes.len().checked_div(self.row_bytes).unwrap_or(0);
        let layout = SourceBytes {
            page_size: self.page_size,
            num_bytes_per_token: self.num_bytes_per_token,
            read_bytes: self.read_bytes,
        };
        let tensor = match self.dtype {
            SourceDtype::Words => {
                let words: Vec<i64> = self
                    .bytes
                    .chunks_exact(8)
                    .map(|w| i64::from_le_bytes(w.try_into().unwrap_or_default()))
                    .collect();
                KvBytes::Int(prim::ints::<B>(
                    &words,
                    &[rows, self.row_bytes / 8],
                    DType::I64,
                    device,
                ))
            }
            SourceDtype::Bytes => KvBytes::Int(prim::bytes::<B>(
                &self.bytes,
                &[rows, self.row_bytes],
                device,
            )),
            SourceDtype::Floats if rows == 0 => KvBytes::Float(B::float_empty(
                [0, 2, self.row_bytes / 8].into(),
                device,
                DType::F32.into(),
            )),
            SourceDtype::Floats => {
                let floats: Vec<f32> = self
                    .bytes
                    .chunks_exact(4)
                    .map(|w| f32::from_le_bytes(w.try_into().unwrap_or_default()))
                    .collect();
                let data = TensorData::new(floats, [rows, 2, self.row_bytes / 8]);
                KvBytes::Float(B::float_from_data(data, device))
            }
        };
        RealKvSource::from_primitive(tensor, layout)
    }

    fn oracle(&self) -> oracle::SourceBytes<'_> {
        oracle::SourceBytes {
            bytes: &self.bytes,
            row_bytes: self.row_bytes,
            page_size: self.page_size.max(1) as usize,
            num_bytes_per_token: self.num_bytes_per_token.max(0) as usize,
            read_bytes: self.read_bytes.max(0) as usize,
        }
    }

    fn json(&self) -> Value {
        let rows: Vec<String> = self
            .bytes
            .chunks(self.row_bytes.max(1))
            .map(|row| row.iter().map(|b| format!("{b:02x}")).collect())
            .collect();
        json!({
            "page_size": self.page_size,
            "num_bytes_per_token": self.num_bytes_per_token,
            "read_bytes": self.read_bytes,
            "row_bytes": self.row_bytes,
            "rows_hex": rows,
        })
    }
}

fn i64s<B: KvPlanBackend>(values: &[i64], device: &B::Device) -> IntTensor<B> {
    prim::i64s::<B>(values, device)
}

impl CanaryCase {
    fn launch<B: KvPlanBackend>(
        &self,
        launch: &Launch,
        check_token: bool,
        device: &B::Device,
    ) -> Result<CanaryLaunch<B>, Error> {
        let sources = launch
            .sources_used
            .iter()
            .map(|&k| self.sources[k].tensor::<B>(device))
            .collect::<Result<Vec<_>, Error>>()?;
        Ok(CanaryLaunch::new(KernelKind(launch.kernel_kind))
            .real_kv(launch.mode, sources)
            .check_verify_expected_token(check_token))
    }

    fn step<B: KvPlanBackend>(
        &self,
        canary: &mut Canary<B>,
        step: &Step,
        device: &B::Device,
    ) -> Result<(), Error> {
        let d = device;
        match step {
            Step::Write {
                launch,
                offsets,
                seeds,
                num_valid_reqs,
                input_ids,
                positions,
                out_cache_loc,
                input_assert,
                expected,
                chain_position_assert,
            } => {
                let launch = self.launch::<B>(launch, true, d)?;
                let plan = WritePlan::from_primitives(
                    i64s::<B>(offsets, d),
                    i64s::<B>(seeds, d),
                    prim::i32_scalar::<B>(i64::from(*num_valid_reqs), d),
                )?;
                let mut inputs = WriteInputs::<B>::from_primitives(
                    i64s::<B>(input_ids, d),
                    i64s::<B>(positions, d),
                    i64s::<B>(out_cache_loc, d),
                )
                .enable_write_input_assert(*input_assert)
                .chain_position_assert_primitive(prim::i32_scalar::<B>(
                    i64::from(*chain_position_assert),
                    d,
                ));
                if let Some((tokens, positions)) = expected {
                    inputs = inputs
                        .expected_input_tokens_primitive(i64s::<B>(tokens, d))
                        .expected_input_positions_primitive(i64s::<B>(positions, d));
                }
                canary.write(&plan, inputs, &launch)
            }
            Step::Verify {
                launch,
                check_token,
                plan,
                num_valid,
                enable,
            } => {
                let launch = self.launch::<B>(launch, *check_token, d)?;
                let [slots, tokens, positions, prev] =
                    plan.each_ref().map(|values| i64s::<B>(values, d));
                let plan = VerifyPlan::from_primitives(
                    slots,
                    tokens,
                    positions,
                    prev,
                    prim::i32_scalar::<B>(i64::from(*num_valid), d),
                    prim::i32_scalar::<B>(i64::from(*enable), d),
                )?;
                canary.verify(&plan, &launch)
            }
        }
    }

    /// Every row the reference produces for `step` from `before` (ring overflow included).
    fn rows(&self, before: &CanaryState, step: &Step) -> Vec<ViolationRow> {
        let mut state = before.clone();
        let views: Vec<oracle::SourceBytes> = self.sources.iter().map(Source::oracle).collect();
        let (launch, check_token) = match step {
            Step::Write { launch, .. } => (launch, true),
            Step::Verify {
                launch,
                check_token,
                ..
            } => (launch, *check_token),
        };
        let used: Vec<oracle::SourceBytes> =
            launch.sources_used.iter().map(|&k| views[k]).collect();
        let run = oracle::Launch {
            kernel_kind: launch.kernel_kind,
            mode: launch.mode,
            sources: &used,
        };
        match step {
            Step::Write {
                offsets,
                seeds,
                num_valid_reqs,
                input_ids,
                positions,
                out_cache_loc,
                expected,
                chain_position_assert,
                ..
            } => {
                let args = oracle::WriteArgs {
                    offsets,
                    seed_slot_indices: seeds,
                    num_valid_reqs: *num_valid_reqs,
                    input_ids,
                    positions,
                    out_cache_loc,
                    expected_inputs: expected.as_ref().map(|(t, p)| (t.as_slice(), p.as_slice())),
                    chain_position_assert: *chain_position_assert != 0,
                };
                oracle::write(&mut state, &args, &run)
            }
            Step::Verify {
                plan,
                num_valid,
                enable,
                ..
            } => {
                let args = oracle::VerifyArgs {
                    slot_indices: &plan[0],
                    expected_tokens: &plan[1],
                    expected_positions: &plan[2],
                    prev_slot_indices: &plan[3],
                    num_valid: *num_valid,
                    enable: *enable,
                    check_expected_token: check_token,
                };
                oracle::verify(&mut state, &args, &run)
            }
        }
    }
}

/// A step's state against the reference's: buffer and counters exactly, the ring as §8 allows
/// (rows of one launch in any order; past an overflow, any of its rows that fit).
fn compare_states(
    before: &CanaryState,
    reference: &CanaryState,
    got_before: &CanaryState,
    got: &CanaryState,
    rows: &[ViolationRow],
) -> Result<(), String> {
    same_list("canary buffer", &reference.buffer, &got.buffer)?;
    let counters = |s: &CanaryState| (s.write_index, s.slot_run_counter, s.kernel_run_counter);
    same(
        "(write_index, slot_run, kernel_run)",
        &counters(reference),
        &counters(got),
    )?;
    let capacity = reference.ring.len();
    let stored = |index: i64| (index.max(0) as usize).min(capacity);
    let (old, new) = (stored(before.write_index), stored(reference.write_index));
    same(
        "ring rows before the step",
        &got_before.ring.get(..old),
        &got.ring.get(..old),
    )?;
    same(
        "ring rows past the write index",
        &reference.ring.get(new..),
        &got.ring.get(new..),
    )?;
    let added = got.ring.get(old..new).unwrap_or_default().to_vec();
    if added.len() == rows.len() {
        same(
            "the step's rows (sorted)",
            &sorted(rows.to_vec()),
            &sorted(added),
        )
    } else if sub_multiset(&added, rows) {
        Ok(())
    } else {
        Err(format!(
            "stored rows {added:?} are not among the step's rows {rows:?}"
        ))
    }
}

impl Family for CanaryOps {
    type Case = CanaryCase;
    type Observed = CanaryRun;

    fn strategy() -> BoxedStrategy<CanaryCase> {
        let stride = prop_oneof![36 => Just(32usize), 6 => Just(48usize), 1 => Just(36usize), 1 => Just(24usize)];
        (1..=24usize, stride, 0..=3usize)
            .prop_flat_map(|(num_slots, stride, sources)| {
                let steps = (
                    write(num_slots, sources),
                    verify(num_slots, sources),
                    0..4u8,
                    any::<bool>(),
                )
                    .prop_map(|(write, verify, pick, follows)| {
                        let verify = if follows {
                            follow(&write, verify)
                        } else {
                            verify
                        };
                        match pick {
                            0 => vec![write],
                            1 => vec![verify],
                            _ => vec![write, verify],
                        }
                    });
                (
                    Just(stride),
                    init(num_slots, (stride / 8).max(4)),
                    proptest::collection::vec(source(num_slots), sources),
                    steps,
                )
            })
            .prop_map(|(slot_stride_bytes, init, sources, steps)| CanaryCase {
                slot_stride_bytes,
                init,
                sources,
                steps,
            })
            .boxed()
    }

    fn observe<B: KvPlanBackend>(case: &CanaryCase, device: &B::Device) -> CanaryRun {
        // As the conformance runner makes one: the stride is `allocate`'s to refuse.
        let created = Canary::<B>::allocate_on(1, case.slot_stride_bytes, 0, device)
            .and_then(|_| Canary::<B>::from_state(&case.init, device));
        let mut run = CanaryRun {
            setup: created.as_ref().map(drop).map_err(|e| e.clone().into()),
            steps: vec![],
        };
        let Ok(mut canary) = created else {
            return run;
        };
        for step in &case.steps {
            let before = canary.state().map_err(Failure::from);
            let result = case
                .step::<B>(&mut canary, step, device)
                .map_err(Failure::from);
            let after = canary.state().map_err(Failure::from);
            let failed = result.is_err();
            run.steps.push(StepRun {
                before,
                result,
                after,
            });
            if failed {
                break;
            }
        }
        run
    }

    fn broken_rule(_: &CanaryCase, run: &CanaryRun) -> Option<String> {
        run.steps
            .iter()
            .find_map(|step| match (&step.result, &step.before, &step.after) {
                (Err(error), Ok(before), Ok(after)) if before != after => {
                    Some(format!("{} changed the canary", error.kind))
                }
                _ => None,
            })
    }

    fn compare(case: &CanaryCase, reference: &CanaryRun, got: &CanaryRun) -> Result<(), String> {
        same("canary creation", &reference.setup, &got.setup)?;
        same("steps run", &reference.steps.len(), &got.steps.len())?;
        for (k, (r, g)) in reference.steps.iter().zip(&got.steps).enumerate() {
            let step = |why: String| format!("step {k}: {why}");
            same("result", &r.result, &g.result).map_err(step)?;
            match (&r.before, &r.after, &g.before, &g.after) {
                (Ok(before), Ok(after), Ok(got_before), Ok(got_after)) if r.result.is_ok() => {
                    let rows = case.rows(before, &case.steps[k]);
                    compare_states(before, after, got_before, got_after, &rows).map_err(step)?;
                }
                _ => {
                    same(
                        "state before",
                        &r.before.as_ref().map(drop),
                        &g.before.as_ref().map(drop),
                    )
                    .map_err(step)?;
                    same(
                        "state after",
                        &r.after.as_ref().map(drop),
                        &g.after.as_ref().map(drop),
                    )
                    .map_err(step)?;
                }
            }
        }
        Ok(())
    }

    fn outcome(run: &CanaryRun) -> String {
        let failed = run.steps.iter().find_map(|step| step.result.as_ref().err());
        match (&run.setup, failed) {
            (Err(error), _) | (_, Some(error)) => error.kind.clone(),
            _ => format!("ok ({} steps)", run.steps.len()),
        }
    }

    fn record(case: &CanaryCase, reference: &CanaryRun, id: &str) -> Value {
        let words = case.init.slot_stride_words.max(1);
        let records = |state: &CanaryState| -> Vec<Vec<i64>> {
            state.buffer.chunks(words).map(<[i64]>::to_vec).collect()
        };
        let init = &case.init;
        let mut steps = vec![];
        let error = |failure: &Failure| json!({"kind": failure.kind, "message": failure.message});
        if let Err(failure) = &reference.setup {
            // The runner reports a refused canary at its first kernel step.
            let mut first = step_json(&case.steps[0]);
            first["expect_error"] = error(failure);
            steps.push(first);
        }
        for (k, run) in reference.steps.iter().enumerate() {
            let mut json = step_json(&case.steps[k]);
            match (&run.result, &run.before, &run.after) {
                (Err(failure), _, _) => json["expect_error"] = error(failure),
                (Ok(()), Ok(before), Ok(after)) => {
                    json["expect"] = json!({
                        "canary": records(after),
                        "ring": after.ring,
                        "write_index": after.write_index,
                        "slot_run_counter": after.slot_run_counter,
                        "kernel_run_counter": after.kernel_run_counter,
                        "violations": case.rows(before, &case.steps[k]),
                    });
                }
                (Ok(()), _, Err(failure)) | (Ok(()), Err(failure), _) => {
                    json["expect_error"] = error(failure)
                }
            }
            steps.push(json);
        }
        let sources: Vec<Value> = case.sources.iter().map(Source::json).collect();
        json!({
            "id": id,
            "source": "fuzz",
            "group": "random",
            "init": {
                "num_slots": init.num_slots(),
                "slot_stride_bytes": case.slot_stride_bytes,
                "canary": records(init),
                "ring_capacity": init.ring.len(),
                "ring": init.ring,
                "write_index": init.write_index,
                "slot_run_counter": init.slot_run_counter,
                "kernel_run_counter": init.kernel_run_counter,
                "sources": sources,
            },
            "steps": steps,
            "fuzz": {"source_dtypes": case.sources.iter().map(|s| format!("{:?}", s.dtype)).collect::<Vec<_>>()},
        })
    }
}

fn mode_name(mode: RealKvHashMode) -> &'static str {
    match mode {
        RealKvHashMode::None => "NONE",
        RealKvHashMode::Partial => "PARTIAL",
        RealKvHashMode::All => "ALL",
    }
}

/// A step's inputs as a record's step.
fn step_json(step: &Step) -> Value {
    let launch = |launch: &Launch| json!({"kernel_kind": launch.kernel_kind, "real_kv_hash_mode": mode_name(launch.mode), "sources_used": launch.sources_used});
    match step {
        Step::Write {
            launch: l,
            offsets,
            seeds,
            num_valid_reqs,
            input_ids,
            positions,
            out_cache_loc,
            input_assert,
            expected,
            chain_position_assert,
        } => {
            let mut json = launch(l);
            json["op"] = json!("write");
            json["enable_chain_position_assert"] = json!(chain_position_assert);
            json["write_offsets"] = json!(offsets);
            json["write_seed_slot_indices"] = json!(seeds);
            json["write_num_valid_reqs"] = json!(num_valid_reqs);
            json["input_ids"] = json!(input_ids);
            json["positions"] = json!(positions);
            json["out_cache_loc"] = json!(out_cache_loc);
            json["enable_write_input_assert"] = json!(input_assert);
            json["expected_input_tokens"] = expected.as_ref().map_or(Value::Null, |e| json!(e.0));
            json["expected_input_positions"] =
                expected.as_ref().map_or(Value::Null, |e| json!(e.1));
            json
        }
        Step::Verify {
            launch: l,
            check_token,
            plan,
            num_valid,
            enable,
        } => {
            let mut json = launch(l);
            json["op"] = json!("verify");
            json["check_verify_expected_token"] = json!(check_token);
            json["verify_slot_indices"] = json!(plan[0]);
            json["verify_expected_tokens"] = json!(plan[1]);
            json["verify_expected_positions"] = json!(plan[2]);
            json["verify_prev_slot_indices"] = json!(plan[3]);
            json["verify_num_valid"] = json!(num_valid);
            json["enable"] = json!(enable);
            json
        }
    }
}
