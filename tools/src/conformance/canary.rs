//! Canary scenarios (`canary.jsonl`, format in `tests/data/canary.md`): an initial state,
//! then write / verify / corrupt steps on one evolving canary, each compared after it runs.

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::DType;
use kvplan::backend::KvBytes;
use kvplan::ops::{
    Canary, CanaryLaunch, CanaryState, KernelKind, RealKvHashMode, RealKvSource, SourceBytes,
    VerifyPlan, WriteInputs, WritePlan,
};
use kvplan::reference::canary::ViolationRow;
use kvplan::{Error, KvPlanBackend};
use serde_json::Value;

use super::{
    Mismatch, expect_eq, expect_slice, i32_field, int_list, malformed, mismatch_kind, missing,
    required_list, size, unknown,
};

/// The most canary words a scenario may hold (its records are written out in full).
const MAX_SCENARIO_WORDS: usize = 1 << 24;
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
    /// Source `field` of a scenario: hex rows of `row_bytes` bytes each, or flat hex.
    fn parse(value: &Value, field: &str) -> Result<Self, Mismatch> {
        let hex = |text: &Value, field: &str| -> Result<Vec<u8>, Mismatch> {
            let bad = || malformed(field, "an even number of hex digits", text);
            let text = text
                .as_str()
                .filter(|text| text.len() % 2 == 0)
                .ok_or_else(bad)?;
            (text.as_bytes().chunks(2))
                .map(|pair| {
                    let pair = core::str::from_utf8(pair).map_err(|_| bad())?;
                    u8::from_str_radix(pair, 16).map_err(|_| bad())
                })
                .collect()
        };
        let integer = |key: &str| {
            let field = format!("{field}.{key}");
            value[key].as_i64().ok_or_else(|| match &value[key] {
                Value::Null => missing(&field),
                other => malformed(&field, "an integer", other),
            })
        };
        let (shape, bytes) = match value.get("rows_hex") {
            Some(rows) => {
                let rows_field = format!("{field}.rows_hex");
                let rows = rows
                    .as_array()
                    .ok_or_else(|| malformed(&rows_field, "a list", rows))?;
                let row_bytes = size(&value["row_bytes"], &format!("{field}.row_bytes"))?;
                let mut bytes = Vec::new();
                for (r, row) in rows.iter().enumerate() {
                    let row = hex(row, &format!("{rows_field}[{r}]"))?;
                    if row.len() != row_bytes {
                        let expected = format!("{row_bytes} bytes (row_bytes)");
                        let got = format!("{} bytes", row.len());
                        return Err(malformed(format!("{rows_field}[{r}]"), expected, got));
                    }
                    bytes.extend(row);
                }
                (vec![rows.len(), row_bytes], bytes)
            }
            None => {
                let flat = hex(&value["flat_hex"], &format!("{field}.flat_hex"))?;
                (vec![flat.len()], flat)
            }
        };
        Ok(Self {
            page_size: integer("page_size")?,
            num_bytes_per_token: integer("num_bytes_per_token")?,
            read_bytes: integer("read_bytes")?,
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

/// A canary state the library could not read back or restore.
fn state_error(error: Error) -> Mismatch {
    Mismatch {
        mode: "state",
        field: "canary state".into(),
        index: None,
        expected: "Ok".into(),
        got: error.to_string(),
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
    required_list(&step[key], key)
}

fn i64_tensor<B: KvPlanBackend>(values: Vec<i64>, device: &B::Device) -> IntTensor<B> {
    prim::i64s::<B>(&values, device)
}

/// The i32 `[1]` of field `key` of `step` (0 when absent).
fn i32_scalar<B: KvPlanBackend>(
    step: &Value,
    key: &str,
    device: &B::Device,
) -> Result<IntTensor<B>, Mismatch> {
    let value = i32_field(&step[key], key, 0)?;
    Ok(prim::i32_scalar::<B>(i64::from(value), device))
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
            (usize::try_from(k).ok().and_then(|k| sources.get(k)))
                .ok_or_else(|| malformed("sources_used", "indices of init.sources", k))
                .map(|source| source.to_source::<B>(device))
        })
        .collect::<Result<Vec<_>, Mismatch>>()?
        .into_iter()
        .collect();
    let kind = i32_field(&step["kernel_kind"], "kernel_kind", 0)?;
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
        i32_scalar::<B>(step, "write_num_valid_reqs", device)?,
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
        step,
        "enable_chain_position_assert",
        device,
    )?);
    if let Some(tokens) = int_list(&step["expected_input_tokens"], "expected_input_tokens")? {
        inputs = inputs.expected_input_tokens_primitive(i64_tensor::<B>(tokens, device));
    }
    let positions = int_list(
        &step["expected_input_positions"],
        "expected_input_positions",
    )?;
    if let Some(positions) = positions {
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
        i32_scalar::<B>(step, "verify_num_valid", device)?,
        i32_scalar::<B>(step, "enable", device)?,
    );
    match plan {
        Ok(plan) => Ok(canary.verify(&plan, &launch)),
        Err(error) => Ok(Err(error)),
    }
}

/// The violation rows of field `field` (none when absent), each padded with zeros.
fn rows_of(value: &Value, field: &str) -> Result<Vec<ViolationRow>, Mismatch> {
    let row = |values: Vec<i64>| core::array::from_fn(|k| values.get(k).copied().unwrap_or(0));
    Ok(canary_rows(value, field)?.into_iter().map(row).collect())
}

pub(crate) fn sorted(mut rows: Vec<ViolationRow>) -> Vec<ViolationRow> {
    rows.sort_unstable();
    rows
}

/// Whether `part` is a sub-multiset of `whole`.
pub(crate) fn sub_multiset(part: &[ViolationRow], whole: &[ViolationRow]) -> bool {
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
        let expected: Vec<i64> = canary_rows(&expect["canary"], "expect.canary")?.concat();
        expect_slice(mode, "canary", &expected, &after.buffer)?;
    } else {
        expect_slice(
            mode,
            "canary (verify never writes)",
            &before.buffer,
            &after.buffer,
        )?;
    }
    let ring = rows_of(&expect["ring"], "expect.ring")?;
    let violations = rows_of(&expect["violations"], "expect.violations")?;
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
    let added = after.ring.get(old..new).unwrap_or_default().to_vec();
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

/// The integer rows of field `field` (none when absent).
fn canary_rows(value: &Value, field: &str) -> Result<Vec<Vec<i64>>, Mismatch> {
    let Some(rows) = value.as_array() else {
        return match value {
            Value::Null => Ok(Vec::new()),
            other => Err(malformed(field, "a list of rows", other)),
        };
    };
    let row = |(r, row): (usize, &Value)| required_list(row, &format!("{field}[{r}]"));
    rows.iter().enumerate().map(row).collect()
}

fn initial_state(init: &Value) -> Result<(usize, CanaryState), Mismatch> {
    let counter = |key: &str| {
        let field = format!("init.{key}");
        init[key].as_i64().ok_or_else(|| match &init[key] {
            Value::Null => missing(&field),
            other => malformed(&field, "an integer", other),
        })
    };
    let stride = size(&init["slot_stride_bytes"], "init.slot_stride_bytes")?;
    let num_slots = size(&init["num_slots"], "init.num_slots")?;
    let words = num_slots.checked_mul(stride / 8);
    if words.is_none_or(|words| words > MAX_SCENARIO_WORDS) {
        let expected = format!(
            "at most {MAX_SCENARIO_WORDS} canary words (num_slots x slot_stride_bytes / 8)"
        );
        return Err(malformed("init.num_slots", expected, num_slots));
    }
    let ring = rows_of(&init["ring"], "init.ring")?;
    let mut state = CanaryState::zeroed(num_slots, stride / 8, ring.len());
    let rows = canary_rows(&init["canary"], "init.canary")?;
    if !rows.is_empty() {
        state.buffer = rows.concat();
    }
    state.ring = ring;
    state.write_index = counter("write_index")?;
    state.slot_run_counter = counter("slot_run_counter")?;
    state.kernel_run_counter = counter("kernel_run_counter")?;
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
                .ok_or_else(|| malformed(format!("edits.{key}"), "an integer", &edit[key]))
        };
        // An index must name a cell that exists.
        let index = |key: &str| {
            let value = get(key)?;
            usize::try_from(value).map_err(|_| malformed(format!("edits.{key}"), "an index", value))
        };
        let outside =
            |key: &str| malformed(format!("edits.{key}"), "a cell that exists", &edit[key]);
        let words = state.slot_stride_words;
        let slots = state.num_slots();
        match edit["target"].as_str() {
            Some("canary") => {
                let word = (index("slot")?.checked_mul(words))
                    .and_then(|word| word.checked_add(index("field").ok()?))
                    .ok_or_else(|| outside("slot"))?;
                let cell = state.buffer.get_mut(word).ok_or_else(|| outside("slot"))?;
                *cell ^= get("xor")?;
            }
            Some("canary_swap") => {
                let (a, b) = (index("slot_a")?, index("slot_b")?);
                for (slot, key) in [(a, "slot_a"), (b, "slot_b")] {
                    if slot >= slots {
                        return Err(outside(key));
                    }
                }
                for k in 0..words {
                    state.buffer.swap(a * words + k, b * words + k);
                }
            }
            Some("source") => {
                let source = sources
                    .get_mut(index("source")?)
                    .ok_or_else(|| outside("source"))?;
                let row_bytes = source.shape.last().copied().unwrap_or(0);
                let at = (index("row")?.checked_mul(row_bytes))
                    .and_then(|at| at.checked_add(index("byte").ok()?))
                    .ok_or_else(|| outside("byte"))?;
                let byte = source.bytes.get_mut(at).ok_or_else(|| outside("byte"))?;
                *byte ^= get("xor")? as u8;
            }
            other => {
                return Err(unknown(
                    "edits.target",
                    "canary, canary_swap, source",
                    other,
                ));
            }
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
        .enumerate()
        .map(|(k, source)| HostSource::parse(source, &format!("init.sources[{k}]")))
        .collect::<Result<_, _>>()?;
    // A canary the library refuses (a bad slot stride) fails the first kernel step instead.
    // (`allocate` is the public check of the byte stride; a one-slot canary is enough to ask it.)
    let mut canary = Canary::<B>::allocate_on(1, stride, 0, device)
        .and_then(|_| Canary::<B>::from_state(&state, device));
    let steps = (record["steps"].as_array())
        .ok_or_else(|| malformed("steps", "a list of steps", &record["steps"]))?;
    for (k, step) in steps.iter().enumerate() {
        let mode: &'static str = match step["op"].as_str() {
            Some("write") => "write",
            Some("verify") => "verify",
            Some("corrupt") => "corrupt",
            other => {
                return Err(unknown(
                    &format!("steps[{k}].op"),
                    "write, verify, corrupt",
                    other,
                ));
            }
        };
        let step_error = |mut mismatch: Mismatch| {
            mismatch.field = format!("step {k}: {}", mismatch.field);
            mismatch
        };
        if mode == "corrupt" {
            if let Ok(live) = &mut canary {
                let mut state = live.state().map_err(state_error)?;
                corrupt(&mut state, &mut sources, step)?;
                *live = Canary::from_state(&state, device).map_err(state_error)?;
            }
            continue;
        }
        let (before, result) = match &mut canary {
            Err(error) => (None, Err(error.clone())),
            Ok(live) => {
                let before = live.state().map_err(state_error)?;
                let result = match launch::<B>(step, &sources, device)? {
                    Err(error) => Err(error),
                    Ok(launch) if mode == "write" => run_write(live, step, launch, device)?,
                    Ok(launch) => run_verify(live, step, launch, device)?,
                };
                (Some(before), result)
            }
        };
        let after = match &canary {
            Ok(live) => Some(live.state().map_err(state_error)?),
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
