//! Canary scenarios (`canary.jsonl`, format in `tests/data/canary.md`): an initial state,
//! then write / verify / corrupt steps on one evolving canary, each compared after it runs.

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::DType;
use kvplan::canary::{
    Canary, CanaryLaunch, CanaryState, KernelKind, RealKvHashMode, RealKvSource, SourceBytes,
    VerifyPlan, WriteInputs, WritePlan,
};
use kvplan::reference::canary::ViolationRow;
use kvplan::{Error, KvBytes, KvPlanBackend};
use serde_json::Value;

use super::{Mismatch, expect_eq, expect_slice, int_list, mismatch_kind, parse_error};
use crate::prim;

/// A source's bytes as the scenario holds them (corrupt steps edit them).
struct HostSource {
    page_size: i64,
    num_bytes_per_token: i64,
    read_bytes: i64,
    /// `[rows, row_bytes]`, or `[n]` for the flat (not 2-D) error case.
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl HostSource {
    fn parse(value: &Value) -> Option<Self> {
        let hex = |text: &Value| -> Option<Vec<u8>> {
            let text = text.as_str()?;
            (0..text.len() / 2)
                .map(|k| u8::from_str_radix(&text[2 * k..2 * k + 2], 16).ok())
                .collect()
        };
        let (shape, bytes) = match value.get("rows_hex") {
            Some(rows) => {
                let rows: Vec<Vec<u8>> = rows.as_array()?.iter().map(hex).collect::<Option<_>>()?;
                let row_bytes = value["row_bytes"].as_u64()? as usize;
                (vec![rows.len(), row_bytes], rows.concat())
            }
            None => {
                let flat = hex(&value["flat_hex"])?;
                (vec![flat.len()], flat)
            }
        };
        Some(Self {
            page_size: value["page_size"].as_i64()?,
            num_bytes_per_token: value["num_bytes_per_token"].as_i64()?,
            read_bytes: value["read_bytes"].as_i64()?,
            shape,
            bytes,
        })
    }

    /// The source as a tensor: i64 words when rows split into them (any dtype is read as bytes),
    /// raw u8 otherwise.
    fn to_source<B: KvPlanBackend>(&self, device: &B::Device) -> Result<RealKvSource<B>, Error> {
        let layout = SourceBytes {
            page_size: self.page_size,
            num_bytes_per_token: self.num_bytes_per_token,
            read_bytes: self.read_bytes,
        };
        let row_bytes = self.shape.last().copied().unwrap_or(0);
        let tensor = if self.shape.len() == 2 && row_bytes % 8 == 0 {
            let words: Vec<i64> = self
                .bytes
                .chunks_exact(8)
                .map(|w| i64::from_le_bytes(w.try_into().unwrap_or_default()))
                .collect();
            prim::ints::<B>(&words, &[self.shape[0], row_bytes / 8], DType::I64, device)
        } else {
            // Raw bytes, 2-D or (the flat error case) 1-D.
            prim::bytes::<B>(&self.bytes, &self.shape, device)
        };
        RealKvSource::from_primitive(KvBytes::Int(tensor), layout)
    }
}

fn mode_of(step: &Value) -> RealKvHashMode {
    match step["real_kv_hash_mode"].as_str() {
        Some("PARTIAL") => RealKvHashMode::Partial,
        Some("ALL") => RealKvHashMode::All,
        _ => RealKvHashMode::None,
    }
}

fn list(step: &Value, key: &str) -> Result<Vec<i64>, Mismatch> {
    int_list(&step[key]).ok_or_else(|| parse_error(key))
}

fn i64_tensor<B: KvPlanBackend>(values: Vec<i64>, device: &B::Device) -> IntTensor<B> {
    prim::i64s::<B>(&values, device)
}

fn i32_scalar<B: KvPlanBackend>(value: i64, device: &B::Device) -> IntTensor<B> {
    prim::i32_scalar::<B>(i64::from(value as i32), device)
}

fn launch<B: KvPlanBackend>(
    step: &Value,
    sources: &[HostSource],
    device: &B::Device,
) -> Result<Result<CanaryLaunch<B>, Error>, Mismatch> {
    let used = list(step, "sources_used")?;
    let built: Result<Vec<RealKvSource<B>>, Error> = used
        .iter()
        .map(|&k| {
            sources
                .get(k as usize)
                .ok_or_else(|| parse_error("sources_used"))
                .map(|source| source.to_source::<B>(device))
        })
        .collect::<Result<Vec<_>, Mismatch>>()?
        .into_iter()
        .collect();
    let kind = step["kernel_kind"].as_i64().unwrap_or(0) as i32;
    Ok(built.map(|built| {
        CanaryLaunch::new(KernelKind(kind))
            .real_kv(mode_of(step), built)
            .check_verify_expected_token(
                step["check_verify_expected_token"]
                    .as_bool()
                    .unwrap_or(true),
            )
    }))
}

fn run_write<B: KvPlanBackend>(
    canary: &mut Canary<B>,
    step: &Value,
    launch: CanaryLaunch<B>,
    device: &B::Device,
) -> Result<Result<(), Error>, Mismatch> {
    let plan = WritePlan::from_primitives(
        i64_tensor::<B>(list(step, "write_offsets")?, device),
        i64_tensor::<B>(list(step, "write_seed_slot_indices")?, device),
        i32_scalar::<B>(step["write_num_valid_reqs"].as_i64().unwrap_or(0), device),
    );
    let plan = match plan {
        Ok(plan) => plan,
        Err(error) => return Ok(Err(error)),
    };
    let mut inputs = WriteInputs::<B>::from_primitives(
        i64_tensor::<B>(list(step, "input_ids")?, device),
        i64_tensor::<B>(list(step, "positions")?, device),
        i64_tensor::<B>(list(step, "out_cache_loc")?, device),
    )
    .enable_write_input_assert(step["enable_write_input_assert"].as_bool().unwrap_or(false))
    .chain_position_assert_primitive(i32_scalar::<B>(
        step["enable_chain_position_assert"].as_i64().unwrap_or(0),
        device,
    ));
    if let Some(tokens) = int_list(&step["expected_input_tokens"]) {
        inputs = inputs.expected_input_tokens_primitive(i64_tensor::<B>(tokens, device));
    }
    if let Some(positions) = int_list(&step["expected_input_positions"]) {
        inputs = inputs.expected_input_positions_primitive(i64_tensor::<B>(positions, device));
    }
    Ok(canary.write(&plan, inputs, &launch))
}

fn run_verify<B: KvPlanBackend>(
    canary: &mut Canary<B>,
    step: &Value,
    launch: CanaryLaunch<B>,
    device: &B::Device,
) -> Result<Result<(), Error>, Mismatch> {
    let plan = VerifyPlan::from_primitives(
        i64_tensor::<B>(list(step, "verify_slot_indices")?, device),
        i64_tensor::<B>(list(step, "verify_expected_tokens")?, device),
        i64_tensor::<B>(list(step, "verify_expected_positions")?, device),
        i64_tensor::<B>(list(step, "verify_prev_slot_indices")?, device),
        i32_scalar::<B>(step["verify_num_valid"].as_i64().unwrap_or(0), device),
        i32_scalar::<B>(step["enable"].as_i64().unwrap_or(0), device),
    );
    match plan {
        Ok(plan) => Ok(canary.verify(&plan, &launch)),
        Err(error) => Ok(Err(error)),
    }
}

fn rows_of(value: &Value) -> Vec<ViolationRow> {
    value
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|row| {
                    let values = int_list(row).unwrap_or_default();
                    core::array::from_fn(|k| values.get(k).copied().unwrap_or(0))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn sorted(mut rows: Vec<ViolationRow>) -> Vec<ViolationRow> {
    rows.sort_unstable();
    rows
}

/// Whether `part` is a sub-multiset of `whole`.
fn sub_multiset(part: &[ViolationRow], whole: &[ViolationRow]) -> bool {
    let mut rest = whole.to_vec();
    part.iter()
        .all(|row| match rest.iter().position(|r| r == row) {
            Some(k) => {
                rest.swap_remove(k);
                true
            }
            None => false,
        })
}

/// Compares the state after a kernel step with `expect`, rows as multisets (§8: the kernels
/// append with atomics, so rows of different entries or requests may interleave).
fn compare(
    mode: &'static str,
    expect: &Value,
    before: &CanaryState,
    after: &CanaryState,
    is_write: bool,
) -> Result<(), Mismatch> {
    let counter = |key: &str| expect[key].as_i64().unwrap_or(0);
    expect_eq(
        mode,
        "write_index",
        counter("write_index"),
        after.write_index,
    )?;
    expect_eq(
        mode,
        "slot_run_counter",
        counter("slot_run_counter"),
        after.slot_run_counter,
    )?;
    expect_eq(
        mode,
        "kernel_run_counter",
        counter("kernel_run_counter"),
        after.kernel_run_counter,
    )?;
    if is_write {
        let expected: Vec<i64> = canary_rows(&expect["canary"]).concat();
        expect_slice(mode, "canary", &expected, &after.buffer)?;
    } else {
        expect_slice(
            mode,
            "canary (verify never writes)",
            &before.buffer,
            &after.buffer,
        )?;
    }
    let ring = rows_of(&expect["ring"]);
    let violations = rows_of(&expect["violations"]);
    let capacity = after.ring.len();
    let stored = |index: i64| (index.max(0) as usize).min(capacity);
    let (old, new) = (stored(before.write_index), stored(after.write_index));
    let exact = |range: core::ops::Range<usize>, what: &str| -> Result<(), Mismatch> {
        expect_eq(mode, what, &ring.get(range.clone()), &after.ring.get(range))
    };
    // Earlier steps were compared as multisets, so the rows they stored keep the device's order:
    // the step must leave them as they were.
    expect_eq(
        mode,
        "ring rows before the step",
        &before.ring.get(0..old),
        &after.ring.get(0..old),
    )?;
    exact(new..capacity, "ring rows past the write index")?;
    let added = after.ring[old..new].to_vec();
    let produced = (after.write_index - before.write_index).max(0) as usize;
    expect_eq(mode, "rows produced", violations.len(), produced)?;
    if added.len() == violations.len() {
        expect_eq(
            mode,
            "new rows (multiset)",
            sorted(violations),
            sorted(added),
        )
    } else {
        expect_eq(
            mode,
            "stored rows within the produced ones",
            true,
            sub_multiset(&added, &violations),
        )
    }
}

fn canary_rows(value: &Value) -> Vec<Vec<i64>> {
    value
        .as_array()
        .map(|rows| {
            rows.iter()
                .map(|row| int_list(row).unwrap_or_default())
                .collect()
        })
        .unwrap_or_default()
}

fn initial_state(init: &Value) -> Result<(usize, CanaryState), Mismatch> {
    let field = |key: &str| init[key].as_i64().ok_or_else(|| parse_error(key));
    let stride = field("slot_stride_bytes")? as usize;
    let num_slots = field("num_slots")? as usize;
    let ring = rows_of(&init["ring"]);
    let mut state = CanaryState::zeroed(num_slots, stride / 8, ring.len());
    let rows = canary_rows(&init["canary"]);
    if !rows.is_empty() {
        state.buffer = rows.concat();
    }
    state.ring = ring;
    state.write_index = field("write_index")?;
    state.slot_run_counter = field("slot_run_counter")?;
    state.kernel_run_counter = field("kernel_run_counter")?;
    Ok((stride, state))
}

fn corrupt(
    state: &mut CanaryState,
    sources: &mut [HostSource],
    step: &Value,
) -> Result<(), Mismatch> {
    for edit in step["edits"].as_array().into_iter().flatten() {
        // XOR masks may use all 64 bits.
        let get = |key: &str| {
            (edit[key].as_i64())
                .or(edit[key].as_u64().map(|v| v as i64))
                .ok_or_else(|| parse_error(key))
        };
        match edit["target"].as_str() {
            Some("canary") => {
                let word = get("slot")? as usize * state.slot_stride_words + get("field")? as usize;
                let cell = state
                    .buffer
                    .get_mut(word)
                    .ok_or_else(|| parse_error("slot"))?;
                *cell ^= get("xor")?;
            }
            Some("canary_swap") => {
                let words = state.slot_stride_words;
                let (a, b) = (get("slot_a")? as usize, get("slot_b")? as usize);
                for k in 0..words {
                    state.buffer.swap(a * words + k, b * words + k);
                }
            }
            Some("source") => {
                let source = sources
                    .get_mut(get("source")? as usize)
                    .ok_or_else(|| parse_error("source"))?;
                let row_bytes = source.shape.last().copied().unwrap_or(0);
                let at = get("row")? as usize * row_bytes + get("byte")? as usize;
                let byte = source
                    .bytes
                    .get_mut(at)
                    .ok_or_else(|| parse_error("byte"))?;
                *byte ^= get("xor")? as u8;
            }
            other => return Err(parse_error(format!("unknown edit {other:?}"))),
        }
    }
    Ok(())
}

pub(super) fn check<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let init = &record["init"];
    let (stride, state) = initial_state(init)?;
    let mut sources: Vec<HostSource> = init["sources"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|source| HostSource::parse(source).ok_or_else(|| parse_error("source")))
        .collect::<Result<_, _>>()?;
    // A canary the library refuses (a bad slot stride) fails the first kernel step instead.
    // (`allocate` is the public check of the byte stride; a one-slot canary is enough to ask it.)
    let mut canary = Canary::<B>::allocate_on(1, stride, 0, device)
        .and_then(|_| Canary::<B>::from_state(&state, device));
    for (k, step) in record["steps"].as_array().into_iter().flatten().enumerate() {
        let mode: &'static str = match step["op"].as_str() {
            Some("write") => "write",
            Some("verify") => "verify",
            Some("corrupt") => "corrupt",
            other => return Err(parse_error(format!("step {k}: unknown op {other:?}"))),
        };
        let step_error = |mut mismatch: Mismatch| {
            mismatch.field = format!("step {k}: {}", mismatch.field);
            mismatch
        };
        if mode == "corrupt" {
            if let Ok(live) = &mut canary {
                let mut state = live.state().map_err(|e| parse_error(e.to_string()))?;
                corrupt(&mut state, &mut sources, step)?;
                *live =
                    Canary::from_state(&state, device).map_err(|e| parse_error(e.to_string()))?;
            }
            continue;
        }
        let (before, result) = match &mut canary {
            Err(error) => (None, Err(error.clone())),
            Ok(live) => {
                let before = live.state().map_err(|e| parse_error(e.to_string()))?;
                let result = match launch::<B>(step, &sources, device)? {
                    Err(error) => Err(error),
                    Ok(launch) if mode == "write" => run_write(live, step, launch, device)?,
                    Ok(launch) => run_verify(live, step, launch, device)?,
                };
                (Some(before), result)
            }
        };
        let after = match &canary {
            Ok(live) => Some(live.state().map_err(|e| parse_error(e.to_string()))?),
            Err(_) => None,
        };
        match (result, step.get("expect_error")) {
            (Err(error), Some(expected)) => {
                let kind = expected["kind"].as_str().unwrap_or("");
                expect_eq(mode, "error kind", kind, error.kind()).map_err(step_error)?;
                expect_eq(
                    mode,
                    "state unchanged by a host-rule error",
                    &before,
                    &after,
                )
                .map_err(step_error)?;
                // An error step is always the scenario's last.
                return Ok(());
            }
            (Ok(()), Some(expected)) => {
                let kind = expected["kind"].as_str().unwrap_or("");
                return Err(step_error(mismatch_kind(mode, kind, "Ok".into())));
            }
            (Err(error), None) => {
                return Err(step_error(mismatch_kind(mode, "Ok", error.to_string())));
            }
            (Ok(()), None) => {
                let (Some(before), Some(after)) = (before, after) else {
                    unreachable!("a step that ran has a canary");
                };
                compare(mode, &step["expect"], &before, &after, mode == "write")
                    .map_err(step_error)?;
            }
        }
    }
    Ok(())
}
