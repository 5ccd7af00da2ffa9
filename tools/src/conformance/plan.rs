//! Plan and allocate records: fresh plans, the prior runs, then the record's run, checked and
//! deferred.

use burn_core::tensor::DType;
use kvplan::ops::{PlanInputs, StepPlan, read_plans};
use kvplan::reference::PlanBuffers;
use kvplan::{Error, KvPlanBackend};
use serde_json::Value;

use super::{
    Dense, Mismatch, expect_eq, expect_slice, i32_field, int_list, mismatch_kind, required_list,
    size, unknown,
};

/// Kinds found on the device: they leave a disabled plan. Every other kind leaves both unchanged.
pub(crate) const DEVICE_KINDS: [&str; 6] = [
    "req_pool_index_out_of_range",
    "position_out_of_range",
    "swa_slot_outside_lut",
    "expected_pool_row_out_of_range",
    "expected_pool_position_out_of_range",
    "write_offsets_overflow",
];

pub(super) fn check<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let inputs = &record["inputs"];
    let expected_kind = record["error_kind"].as_str();
    if record["op"] == "allocate" {
        return check_allocate::<B>(inputs, expected_kind.unwrap_or(""), device);
    }
    for mode in ["checked", "deferred"] {
        let outcome = run::<B>(inputs, device, mode)?;
        match (outcome, expected_kind) {
            (
                Run {
                    result: Ok(()),
                    after,
                    ..
                },
                None,
            ) => compare(mode, &record["expected"], &after)?,
            (
                Run {
                    result: Err(error),
                    before,
                    after,
                },
                Some(kind),
            ) => {
                expect_eq(mode, "error kind", kind, error.kind())?;
                if DEVICE_KINDS.contains(&kind) {
                    let disabled = (
                        after.enable,
                        after.verify_num_valid,
                        after.write_num_valid_reqs,
                    );
                    expect_eq(
                        mode,
                        "disabled plan (enable, num_valid, reqs)",
                        (0, 0, 0),
                        disabled,
                    )?;
                } else {
                    expect_eq(
                        mode,
                        "plans unchanged by a host-rule error",
                        true,
                        before == after,
                    )?;
                }
            }
            (Run { result: Ok(()), .. }, Some(kind)) => {
                return Err(mismatch_kind(mode, kind, "Ok".into()));
            }
            (
                Run {
                    result: Err(error), ..
                },
                None,
            ) => {
                return Err(mismatch_kind(mode, "Ok", error.to_string()));
            }
        }
    }
    Ok(())
}

fn check_allocate<B: KvPlanBackend>(
    inputs: &Value,
    kind: &str,
    device: &B::Device,
) -> Result<(), Mismatch> {
    let capacity = |key: &str| size(&inputs[key], key);
    // Each half is allocated with `StepPlan::allocate_on`, the other half at a valid capacity.
    let result = match inputs["allocate"].as_str() {
        Some("VerifyPlan") => {
            StepPlan::<B>::allocate_on(capacity("verify_capacity")?, 1, device).map(|_| ())
        }
        Some("WritePlan") => {
            StepPlan::<B>::allocate_on(1, capacity("write_req_capacity")?, device).map(|_| ())
        }
        other => return Err(unknown("allocate", "VerifyPlan, WritePlan", other)),
    };
    match result {
        Err(error) => expect_eq("allocate", "error kind", kind, error.kind()),
        Ok(()) => Err(mismatch_kind("allocate", kind, "Ok".into())),
    }
}

/// One run of a record: its result, and the plans read back before and after the final call.
struct Run {
    result: Result<(), Error>,
    before: PlanBuffers,
    after: PlanBuffers,
}

fn run<B: KvPlanBackend>(
    inputs: &Value,
    device: &B::Device,
    mode: &'static str,
) -> Result<Run, Mismatch> {
    let capacity = |key: &str| size(&inputs[key], key);
    let verify_capacity = capacity("verify_capacity")?;
    let plan_capacity = match inputs["plan_verify_capacity"].is_null() {
        true => verify_capacity,
        false => capacity("plan_verify_capacity")?,
    };
    let write_capacity = capacity("write_req_capacity")?;
    let setup = |error: Error| Mismatch {
        mode,
        field: "setup".into(),
        index: None,
        expected: "Ok".into(),
        got: error.to_string(),
    };
    let mut step =
        StepPlan::<B>::allocate_on(plan_capacity, write_capacity, device).map_err(setup)?;
    let call = |step: &mut StepPlan<B>, batch: &Value| {
        let inputs = build::<B>(inputs, batch, device)?;
        Ok(match mode {
            "checked" => {
                kvplan::ops::plan(step, inputs).and_then(|status| status.check().map(drop))
            }
            _ => kvplan::ops::plan(step, inputs)
                .and_then(|status| status.check())
                .map(drop),
        })
    };
    for prior in inputs["prior_runs"].as_array().into_iter().flatten() {
        call(&mut step, prior)?.map_err(setup)?;
    }
    let read = |step: &StepPlan<B>| read_plans(step).map_err(setup);
    let before = read(&step)?;
    let result = call(&mut step, inputs)?;
    let after = read(&step)?;
    Ok(Run {
        result,
        before,
        after,
    })
}

/// The record's inputs as `PlanInputs`, with the three per-request lists taken from `batch`.
fn build<B: KvPlanBackend>(
    inputs: &Value,
    batch: &Value,
    device: &B::Device,
) -> Result<PlanInputs<B>, Mismatch> {
    let dtype = |name: &str, default: DType| match inputs["dtype_overrides"][name].as_str() {
        Some("int32") => DType::I32,
        Some("int64") => DType::I64,
        _ => default,
    };
    let vector = |source: &Value, name: &str| -> Result<_, Mismatch> {
        let dtype = dtype(name, DType::I64);
        let list = Dense::list(name, required_list(&source[name], name)?).fitting(dtype)?;
        Ok(list.int::<B>(dtype, device))
    };
    let table_dtype = dtype("req_to_token", DType::I32);
    let table = Dense::required(&inputs["req_to_token"], "req_to_token")?.fitting(table_dtype)?;
    let (rpi, prefix, extend) = (
        vector(batch, "req_pool_indices")?,
        vector(batch, "prefix_lens")?,
        vector(batch, "extend_seq_lens")?,
    );
    // The table keeps the record's rank (rank errors are the op's to report).
    let table = table.int::<B>(table_dtype, device);
    let mut plan_inputs = PlanInputs::<B>::from_primitives(rpi, prefix, extend, table)
        .swa_window_size(i32_field(&inputs["swa_window_size"], "swa_window_size", 0)?)
        .position_offset(i32_field(
            &inputs["kv_token_id_vs_position_offset"],
            "kv_token_id_vs_position_offset",
            0,
        )?)
        .verify_capacity(size(&inputs["verify_capacity"], "verify_capacity")?);
    if !inputs["full_to_swa_index_mapping"].is_null() {
        plan_inputs = plan_inputs
            .full_to_swa_index_mapping_primitive(vector(inputs, "full_to_swa_index_mapping")?);
    }
    // The pool and its lengths apart: records test the rule that pairs them.
    let pool = Dense::parse(
        &inputs["req_to_verify_expected_tokens"],
        "req_to_verify_expected_tokens",
    )?;
    if let Some(pool) = pool {
        let pool = pool.fitting(DType::I32)?.int::<B>(DType::I32, device);
        plan_inputs = plan_inputs.expected_tokens_pool_primitive(pool);
    }
    if !inputs["req_to_verify_expected_tokens_valid_lens"].is_null() {
        let lens = vector(inputs, "req_to_verify_expected_tokens_valid_lens")?;
        plan_inputs = plan_inputs.expected_tokens_valid_lens_primitive(lens);
    }
    Ok(plan_inputs)
}

/// Compares a successful run with `expected`, as the conformance README's step 4 says.
fn compare(mode: &'static str, expected: &Value, got: &PlanBuffers) -> Result<(), Mismatch> {
    let scalar = |key: &str| expected[key].as_i64().unwrap_or(i64::MIN);
    expect_eq(
        mode,
        "verify_num_valid",
        scalar("verify_num_valid"),
        i64::from(got.verify_num_valid),
    )?;
    expect_eq(mode, "enable", scalar("enable"), i64::from(got.enable))?;
    expect_eq(
        mode,
        "write_num_valid_reqs",
        scalar("write_num_valid_reqs"),
        i64::from(got.write_num_valid_reqs),
    )?;
    let valid = got.verify_num_valid.max(0) as usize;
    let verify_fields: [(&str, &[i64]); 4] = [
        ("verify_slot_indices", &got.verify_slot_indices),
        ("verify_expected_tokens", &got.verify_expected_tokens),
        ("verify_expected_positions", &got.verify_expected_positions),
        ("verify_prev_slot_indices", &got.verify_prev_slot_indices),
    ];
    if got.enable == 1 {
        for (field, values) in verify_fields {
            let want = int_list(&expected[field], field)?.unwrap_or_default();
            expect_slice(mode, field, &want, &values[..valid.min(values.len())])?;
        }
    }
    let offsets = int_list(&expected["write_offsets"], "write_offsets")?.unwrap_or_default();
    expect_slice(mode, "write_offsets", &offsets, &got.write_offsets)?;
    let seeds = int_list(
        &expected["write_seed_slot_indices"],
        "write_seed_slot_indices",
    )?
    .unwrap_or_default();
    let bs = seeds.len().min(got.write_seed_slot_indices.len());
    expect_slice(
        mode,
        "write_seed_slot_indices",
        &seeds,
        &got.write_seed_slot_indices[..bs],
    )?;
    let full = &expected["plan_state_full"];
    if !full.is_null() {
        for (field, values) in verify_fields {
            let want = int_list(&full[field], field)?.unwrap_or_default();
            expect_slice(mode, &format!("plan_state_full.{field}"), &want, values)?;
        }
        let want = int_list(&full["write_seed_slot_indices"], "write_seed_slot_indices")?
            .unwrap_or_default();
        expect_slice(
            mode,
            "plan_state_full.write_seed_slot_indices",
            &want,
            &got.write_seed_slot_indices,
        )?;
    }
    Ok(())
}
