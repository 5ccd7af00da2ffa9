//! Plan cases: one plan step, checked and deferred, on plans poisoned by earlier runs, over
//! padding rows, windows, LUTs, expected-token pools, overflowing and too-small capacities; and
//! plan allocation at the capacities it refuses.

use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan::ops::{PlanInputs, StepPlan, read_plans};
use kvplan::reference::PlanBuffers;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{
    Failure, Family, Input, Layout, Outcome, dtype_name, fuzz_facts, index, input, int_dtype,
    list_json, rank_of, same, value, word,
};
use crate::conformance::plan::DEVICE_KINDS;

/// A plan case: a step over prior runs, or an allocation.
#[derive(Debug, Clone)]
pub enum PlanCase {
    /// One step on fresh plans after `priors`.
    Step(Box<Step>),
    /// `StepPlan::allocate_on` of one refused capacity (the other plan's is 1).
    Allocate {
        /// Whether the verify plan's capacity is the refused one (else the write plan's).
        verify: bool,
        /// The capacity.
        capacity: usize,
    },
}

/// The inputs of one step, as a plan record holds them.
#[derive(Debug, Clone)]
pub struct Step {
    table: Input,
    /// `req_pool_indices`, `prefix_lens`, `extend_seq_lens`.
    batch: [Input; 3],
    /// Earlier batches on the same plans (same table, LUT and pool; the batch's dtypes).
    priors: Vec<[Vec<i64>; 3]>,
    window: i32,
    lut: Option<Input>,
    pool: Option<Input>,
    valid_lens: Option<Input>,
    offset: i32,
    /// The `verify_capacity` argument.
    verify_capacity: usize,
    /// The verify plan's capacity `V`.
    plan_capacity: usize,
    /// The write plan's capacity `K`.
    write_capacity: usize,
}

/// What a run shows.
#[derive(Debug)]
pub enum PlanRun {
    /// A step, checked then deferred.
    Step([ModeRun; 2]),
    /// An allocation.
    Allocate(Outcome<()>),
}

/// One mode's run of a step: the allocation, the prior runs, the step, and the plans read back
/// before and after it.
#[derive(Debug)]
pub struct ModeRun {
    setup: Outcome<()>,
    priors: Vec<Outcome<()>>,
    result: Outcome<()>,
    before: Outcome<PlanBuffers>,
    after: Outcome<PlanBuffers>,
}

/// The kinds of the host rules (and rule 11, which a Cube launch checks): plans unchanged.
const UNCHANGING_KINDS: [&str; 12] = [
    "missing_lut_for_swa",
    "capacity_mismatch",
    "missing_valid_lens",
    "valid_lens_without_pool",
    "device_mismatch",
    "dtype_mismatch",
    "not_1d",
    "not_2d",
    "length_mismatch",
    "empty_lut",
    "bs_exceeds_write_capacity",
    "req_to_token_stride",
];

const MODES: [&str; 2] = ["checked", "deferred"];

pub struct Plan;

fn is_device_error(outcome: &Outcome<()>) -> bool {
    matches!(outcome, Err(error) if DEVICE_KINDS.contains(&error.kind.as_str()))
}

/// A list of `len` values, `len` the batch size mostly (rule 8 otherwise).
fn batch_list(
    bs: usize,
    dtype: DType,
    value: impl Fn(DType) -> BoxedStrategy<i64> + Clone + 'static,
) -> BoxedStrategy<Input> {
    let len = prop_oneof![20 => Just(bs), 1 => Just(bs + 1), 1 => Just(bs.saturating_sub(1))];
    (len, super::layout())
        .prop_flat_map(move |(len, layout)| {
            proptest::collection::vec(value(dtype), len)
                .prop_map(move |data| Input::laid_out(vec![data.len()], data, dtype, layout))
        })
        .boxed()
}

fn extend_len(dtype: DType) -> BoxedStrategy<i64> {
    prop_oneof![8 => 0..=4i64, 1 => Just(-1i64), 1 => value(dtype)].boxed()
}

fn batch(rows: usize, cols: usize, bs: usize) -> BoxedStrategy<[Input; 3]> {
    let dtypes = (
        int_dtype(DType::I64),
        int_dtype(DType::I64),
        int_dtype(DType::I64),
    );
    dtypes
        .prop_flat_map(move |(rpi, prefix, extend)| {
            (
                batch_list(bs, rpi, move |d| index(rows, d)),
                batch_list(bs, prefix, move |d| index(cols + 1, d)),
                batch_list(bs, extend, extend_len),
            )
        })
        .prop_map(|(rpi, prefix, extend)| [rpi, prefix, extend])
        .boxed()
}

/// A valid earlier batch of at most `k` requests.
fn prior(rows: usize, cols: usize, k: usize) -> BoxedStrategy<[Vec<i64>; 3]> {
    (0..=k)
        .prop_flat_map(move |bs| {
            let request = (0..rows.max(1) as i64, 0..=cols as i64, 0..=3i64);
            proptest::collection::vec(request, bs)
        })
        .prop_map(|requests| {
            let column = |k: usize| requests.iter().map(|r| [r.0, r.1, r.2][k]).collect();
            [column(0), column(1), column(2)]
        })
        .boxed()
}

/// A slot id of the table: small ones (inside a LUT of 64) mostly.
fn slot(dtype: DType) -> BoxedStrategy<i64> {
    prop_oneof![8 => 0..64i64, 1 => Just(-1i64), 1 => value(dtype)].boxed()
}

fn lut(window: i32) -> BoxedStrategy<Option<Input>> {
    let given = if window > 0 { 0.9 } else { 0.2 };
    let len = prop_oneof![4 => Just(64usize), 2 => 1..64usize, 1 => Just(0usize)];
    let lut = (len, int_dtype(DType::I64)).prop_flat_map(|(len, dtype)| {
        let entry = prop_oneof![8 => 0..1000i64, 1 => Just(-1i64)].boxed();
        input(vec![len], Just(dtype), move |_| entry.clone())
    });
    proptest::option::weighted(given, lut).boxed()
}

/// The expected-token pool and its valid lengths, each now and then without the other.
fn pool(rows: usize, cols: usize, bs: usize) -> BoxedStrategy<(Option<Input>, Option<Input>)> {
    let shape = (
        prop_oneof![Just(rows), Just(rows + 1), Just(rows.saturating_sub(1))],
        prop_oneof![Just(cols + 1), Just(cols), Just(cols / 2)],
    );
    let with_pool = shape.prop_flat_map(move |(prow, pcol)| {
        let valid = move |d: DType| {
            prop_oneof![8 => 0..=pcol as i64, 1 => Just(pcol as i64 + 1), 1 => value(d)].boxed()
        };
        let lens = int_dtype(DType::I64).prop_flat_map(move |d| batch_list(bs, d, valid));
        (
            rank_of(vec![prow, pcol]).prop_flat_map(|shape| input(shape, Just(DType::I32), value)),
            proptest::option::weighted(0.9, lens),
        )
            .prop_map(|(pool, lens)| (Some(pool), lens))
    });
    let lens_alone = int_dtype(DType::I64)
        .prop_flat_map(move |d| batch_list(bs, d, |d| index(4, d)))
        .prop_map(|lens| (None, Some(lens)));
    prop_oneof![12 => Just((None, None)), 6 => with_pool, 1 => lens_alone].boxed()
}

fn step() -> BoxedStrategy<PlanCase> {
    let sizes = prop_oneof![
        30 => (0..=5usize, 0..=12usize, 0..=6usize),
        1 => (1..=40usize, 1..=40usize, 200..=600usize),
    ];
    sizes
        .prop_flat_map(|(rows, cols, bs)| {
            let k = prop_oneof![6 => Just(bs.max(1)), 2 => bs.max(1)..=bs + 3, 1 => Just(bs.saturating_sub(1).max(1))];
            let v = prop_oneof![4 => Just((bs * cols).max(64)), 2 => 1..=8usize];
            let window = prop_oneof![6 => Just(0i32), 3 => 1..=4i32, 1 => Just(-1i32), 1 => Just(i32::MAX)];
            let offset = prop_oneof![6 => Just(0i32), 2 => Just(1i32), 1 => Just(-1i32), 1 => Just(i32::MIN)];
            let table = rank_of(vec![rows, cols])
                .prop_flat_map(|shape| input(shape, int_dtype(DType::I32), slot))
                // A broadcast table is the one known difference: Flex reads values, a Cube
                // launch refuses the zero row stride (rule 11; `errors::stride` covers it).
                .prop_map(|mut table| {
                    if table.layout == Layout::Broadcast {
                        table.layout = Layout::Contiguous;
                    }
                    table
                });
            let capacities = (v, k).prop_flat_map(|(v, k)| {
                let argument = prop_oneof![20 => Just(v), 1 => Just(v + 1)];
                (argument, Just(v), Just(k))
            });
            (
                table,
                batch(rows, cols, bs),
                window.prop_flat_map(|w| (Just(w), lut(w))),
                pool(rows, cols, bs),
                offset,
                capacities.prop_flat_map(move |(argument, v, k)| {
                    (Just((argument, v, k)), proptest::collection::vec(prior(rows, cols, k), 0..=2))
                }),
            )
        })
        .prop_map(
            |(table, batch, (window, lut), (pool, valid_lens), offset, ((argument, v, k), priors))| {
                PlanCase::Step(Box::new(Step {
                    table,
                    batch,
                    priors,
                    window,
                    lut,
                    pool,
                    valid_lens,
                    offset,
                    verify_capacity: argument,
                    plan_capacity: v,
                    write_capacity: k,
                }))
            },
        )
        .boxed()
}

fn allocate() -> BoxedStrategy<PlanCase> {
    let capacity = proptest::sample::select(vec![0, 1 << 31, (1 << 32) + 1, usize::MAX]);
    (any::<bool>(), capacity)
        .prop_map(|(verify, capacity)| PlanCase::Allocate { verify, capacity })
        .boxed()
}

impl Step {
    fn inputs<B: KvPlanBackend>(&self, batch: &[Input; 3], device: &B::Device) -> PlanInputs<B> {
        let [rpi, prefix, extend] = batch.each_ref().map(|list| list.int::<B>(device));
        let mut inputs =
            PlanInputs::<B>::from_primitives(rpi, prefix, extend, self.table.int::<B>(device))
                .swa_window_size(self.window)
                .position_offset(self.offset)
                .verify_capacity(self.verify_capacity);
        if let Some(lut) = &self.lut {
            inputs = inputs.full_to_swa_index_mapping_primitive(lut.int::<B>(device));
        }
        if let Some(pool) = &self.pool {
            inputs = inputs.expected_tokens_pool_primitive(pool.int::<B>(device));
        }
        if let Some(lens) = &self.valid_lens {
            inputs = inputs.expected_tokens_valid_lens_primitive(lens.int::<B>(device));
        }
        inputs
    }

    /// A prior batch as inputs of the step's dtypes.
    fn prior_batch(&self, prior: &[Vec<i64>; 3]) -> [Input; 3] {
        [0, 1, 2].map(|k| Input::list(prior[k].clone(), self.batch[k].dtype))
    }

    fn run<B: KvPlanBackend>(&self, mode: &str, device: &B::Device) -> ModeRun {
        let mut run = ModeRun {
            setup: Ok(()),
            priors: vec![],
            result: Ok(()),
            before: Ok(PlanBuffers::fresh(0, 0)),
            after: Ok(PlanBuffers::fresh(0, 0)),
        };
        let mut plans =
            match StepPlan::<B>::allocate_on(self.plan_capacity, self.write_capacity, device) {
                Ok(plans) => plans,
                Err(error) => {
                    run.setup = Err(error.into());
                    return run;
                }
            };
        let call = |plans: &mut StepPlan<B>, batch: &[Input; 3]| -> Outcome<()> {
            let inputs = self.inputs::<B>(batch, device);
            let result = match mode {
                "checked" => {
                    kvplan::ops::plan(plans, inputs).and_then(|status| status.check().map(drop))
                }
                _ => kvplan::ops::plan(plans, inputs).and_then(|status| status.check().map(drop)),
            };
            result.map_err(Failure::from)
        };
        for prior in &self.priors {
            let outcome = call(&mut plans, &self.prior_batch(prior));
            run.priors.push(outcome);
        }
        run.before = read_plans(&plans).map_err(Failure::from);
        run.result = call(&mut plans, &self.batch);
        run.after = read_plans(&plans).map_err(Failure::from);
        run
    }
}

/// Where a mode's run breaks §5: what an error leaves in the plans.
fn broken_mode(run: &ModeRun) -> Option<String> {
    let (Ok(before), Ok(after), Err(error)) = (&run.before, &run.after, &run.result) else {
        return None;
    };
    let scalars = (
        after.enable,
        after.verify_num_valid,
        after.write_num_valid_reqs,
    );
    if DEVICE_KINDS.contains(&error.kind.as_str()) && scalars != (0, 0, 0) {
        return Some(format!(
            "{} left (enable, num_valid, reqs) = {scalars:?}, not disabled",
            error.kind
        ));
    }
    if UNCHANGING_KINDS.contains(&error.kind.as_str()) && before != after {
        return Some(format!("{} changed the plans", error.kind));
    }
    None
}

fn compare_modes(mode: &str, reference: &ModeRun, got: &ModeRun) -> Result<(), String> {
    same(&format!("{mode} allocation"), &reference.setup, &got.setup)?;
    same(
        &format!("{mode} prior runs"),
        &reference.priors,
        &got.priors,
    )?;
    same(&format!("{mode} result"), &reference.result, &got.result)?;
    let unspecified = reference
        .priors
        .iter()
        .chain([&reference.result])
        .any(is_device_error);
    if unspecified {
        // A disabled plan's other elements are unspecified: the scalars only.
        let scalars = |plans: &Outcome<PlanBuffers>| {
            plans
                .as_ref()
                .map(|p| (p.enable, p.verify_num_valid, p.write_num_valid_reqs))
                .map_err(Clone::clone)
        };
        return same(
            &format!("{mode} plans (scalars)"),
            &scalars(&reference.after),
            &scalars(&got.after),
        );
    }
    same(
        &format!("{mode} plans before the step"),
        &reference.before,
        &got.before,
    )?;
    same(
        &format!("{mode} plans after the step"),
        &reference.after,
        &got.after,
    )
}

impl Family for Plan {
    type Case = PlanCase;
    type Observed = PlanRun;

    fn strategy() -> BoxedStrategy<PlanCase> {
        prop_oneof![30 => step(), 1 => allocate()].boxed()
    }

    fn observe<B: KvPlanBackend>(case: &PlanCase, device: &B::Device) -> PlanRun {
        match case {
            PlanCase::Step(step) => PlanRun::Step(MODES.map(|mode| step.run::<B>(mode, device))),
            &PlanCase::Allocate { verify, capacity } => {
                let (v, k) = if verify { (capacity, 1) } else { (1, capacity) };
                PlanRun::Allocate(
                    StepPlan::<B>::allocate_on(v, k, device)
                        .map(drop)
                        .map_err(Failure::from),
                )
            }
        }
    }

    fn broken_rule(_: &PlanCase, run: &PlanRun) -> Option<String> {
        let PlanRun::Step([checked, deferred]) = run else {
            return None;
        };
        if checked.result != deferred.result {
            return Some(format!(
                "plan + check() gave {:?}, plan then check() {:?}",
                checked.result, deferred.result
            ));
        }
        broken_mode(checked).or_else(|| broken_mode(deferred))
    }

    fn compare(_: &PlanCase, reference: &PlanRun, got: &PlanRun) -> Result<(), String> {
        match (reference, got) {
            (PlanRun::Step(reference), PlanRun::Step(got)) => {
                for (k, mode) in MODES.iter().enumerate() {
                    compare_modes(mode, &reference[k], &got[k])?;
                }
                Ok(())
            }
            (PlanRun::Allocate(reference), PlanRun::Allocate(got)) => {
                same("allocate", reference, got)
            }
            _ => Err("the runs differ in kind".into()),
        }
    }

    fn outcome(run: &PlanRun) -> String {
        match run {
            PlanRun::Step([checked, _]) => word(&checked.setup.clone().and(checked.result.clone())),
            PlanRun::Allocate(outcome) => format!("allocate {}", word(outcome)),
        }
    }

    fn record(case: &PlanCase, reference: &PlanRun, id: &str) -> Value {
        match (case, reference) {
            (PlanCase::Step(step), PlanRun::Step([checked, _])) => step_record(step, checked, id),
            (&PlanCase::Allocate { verify, capacity }, PlanRun::Allocate(outcome)) => {
                let (name, v, k) = if verify {
                    ("VerifyPlan", json!(capacity), Value::Null)
                } else {
                    ("WritePlan", Value::Null, json!(capacity))
                };
                let mut record = json!({
                    "id": id, "source": "fuzz", "op": "allocate",
                    "inputs": {"allocate": name, "verify_capacity": v, "write_req_capacity": k},
                });
                outcome_fields(&mut record, outcome);
                record
            }
            _ => json!({"id": id, "note": "the reference's run does not match the case"}),
        }
    }
}

/// `policy` and, for an error, `error_kind` and `expected_error`.
fn outcome_fields(record: &mut Value, outcome: &Outcome<()>) {
    match outcome {
        Ok(()) => record["policy"] = json!("equal"),
        Err(error) => {
            record["policy"] = json!("error");
            record["error_kind"] = json!(error.kind);
            record["expected_error"] = json!({"kind": error.kind, "message": error.message});
        }
    }
}

fn step_record(step: &Step, run: &ModeRun, id: &str) -> Value {
    let [rpi, prefix, extend] = &step.batch;
    let names = [
        ("req_pool_indices", rpi),
        ("prefix_lens", prefix),
        ("extend_seq_lens", extend),
        ("req_to_token", &step.table),
    ];
    let mut overrides = serde_json::Map::new();
    for (name, input) in names {
        overrides.insert(name.into(), json!(dtype_name(input.dtype)));
    }
    let mut facts = names.to_vec();
    if let Some(lut) = &step.lut {
        overrides.insert(
            "full_to_swa_index_mapping".into(),
            json!(dtype_name(lut.dtype)),
        );
        facts.push(("full_to_swa_index_mapping", lut));
    }
    if let Some(lens) = &step.valid_lens {
        let name = "req_to_verify_expected_tokens_valid_lens";
        overrides.insert(name.into(), json!(dtype_name(lens.dtype)));
        facts.push((name, lens));
    }
    if let Some(pool) = &step.pool {
        facts.push(("req_to_verify_expected_tokens", pool));
    }
    // The runner needs every prior run to succeed; a refused one left the plans as they were.
    let priors: Vec<Value> = step
        .priors
        .iter()
        .zip(&run.priors)
        .filter(|(_, outcome)| outcome.is_ok())
        .map(|(prior, _)| {
            json!({"req_pool_indices": prior[0], "prefix_lens": prior[1], "extend_seq_lens": prior[2]})
        })
        .collect();
    let mut record = json!({
        "id": id,
        "source": "fuzz",
        "op": "plan",
        "inputs": {
            "req_pool_indices": list_json(rpi),
            "prefix_lens": list_json(prefix),
            "extend_seq_lens": list_json(extend),
            "req_to_token": step.table.table_json(),
            "swa_window_size": step.window,
            "full_to_swa_index_mapping": step.lut.as_ref().map_or(Value::Null, list_json),
            "verify_capacity": step.verify_capacity,
            "plan_verify_capacity": step.plan_capacity,
            "write_req_capacity": step.write_capacity,
            "req_to_verify_expected_tokens": step.pool.as_ref().map_or(Value::Null, Input::table_json),
            "req_to_verify_expected_tokens_valid_lens": step.valid_lens.as_ref().map_or(Value::Null, list_json),
            "kv_token_id_vs_position_offset": step.offset,
            "dtype_overrides": Value::Object(overrides),
            "prior_runs": priors,
        },
        "fuzz": fuzz_facts(&facts),
    });
    outcome_fields(&mut record, &run.result);
    if let (Ok(()), Ok(plans)) = (&run.result, &run.after) {
        record["expected"] = expected(plans, rpi.data.len());
    }
    record
}

/// The plans as a record's `expected`: the compared prefixes and the whole buffers.
fn expected(plans: &PlanBuffers, bs: usize) -> Value {
    let valid = (plans.verify_num_valid.max(0) as usize).min(plans.verify_slot_indices.len());
    let verify = |values: &[i64]| {
        if plans.enable == 1 {
            json!(values[..valid])
        } else {
            Value::Null
        }
    };
    let seeds = &plans.write_seed_slot_indices;
    json!({
        "verify_num_valid": plans.verify_num_valid,
        "enable": plans.enable,
        "write_num_valid_reqs": plans.write_num_valid_reqs,
        "verify_slot_indices": verify(&plans.verify_slot_indices),
        "verify_expected_tokens": verify(&plans.verify_expected_tokens),
        "verify_expected_positions": verify(&plans.verify_expected_positions),
        "verify_prev_slot_indices": verify(&plans.verify_prev_slot_indices),
        "write_offsets": plans.write_offsets,
        "write_seed_slot_indices": seeds[..bs.min(seeds.len())],
        "plan_state_full": {
            "verify_slot_indices": plans.verify_slot_indices,
            "verify_expected_tokens": plans.verify_expected_tokens,
            "verify_expected_positions": plans.verify_expected_positions,
            "verify_prev_slot_indices": plans.verify_prev_slot_indices,
            "write_seed_slot_indices": seeds,
        },
    })
}
