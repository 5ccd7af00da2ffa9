//! Differential fuzzing (`kvplan fuzz`, and the fuzz tests): proptest strategies produce cases
//! for every op family, each case runs on the reference (the host reference path: `Dispatch` on
//! Flex, as `kvplan check --backend reference` runs it) and on the backend under test, and the two
//! must agree exactly: the same outputs, or the same error kind and message, with every output
//! the spec says an error leaves alone left alone. The first disagreement of a family is shrunk
//! by proptest and written as a conformance record (the JSON Lines of `tests/data/*.jsonl`) that
//! `kvplan check FILE --backend B` runs.
//!
//! `KVPLAN_FUZZ_TRACE=1` prints every case before it runs.
//!
//! A case also holds what a record cannot say (dtypes the record format fixes, non-contiguous
//! and broadcast views, caller capacities) in its record's informative `fuzz` field; shrinking
//! moves those towards what the format can say, so a reproducer depends on them only when the
//! disagreement does.

mod canary;
mod gather;
mod plan;
mod slots;

use core::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::str::FromStr;

use burn_core::backend::Dispatch;
use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::tensor::{DType, Device, Shape, Slice};
use kvplan::{Error, KvPlanBackend};
use proptest::prelude::*;
use proptest::strategy::{NewTree, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use serde_json::{Value, json};

use crate::{OnBackend, prim};

/// An op family the fuzzer generates cases for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// `masked_gather` and `segment_gather`, exact and deferred, with caller capacities.
    Gather,
    /// The kv-canary plan (checked and deferred, over prior runs) and plan allocation.
    Plan,
    /// Canary write and verify scenarios on one evolving canary.
    Canary,
    /// `segment_assign` and `KvStore` stores.
    Slots,
}

impl Op {
    /// Every family, in the order `--op all` runs them.
    pub const ALL: [Op; 4] = [Op::Gather, Op::Plan, Op::Canary, Op::Slots];
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Gather => "gather",
            Op::Plan => "plan",
            Op::Canary => "canary",
            Op::Slots => "slots",
        })
    }
}

impl FromStr for Op {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Op::ALL
            .into_iter()
            .find(|op| op.to_string() == name)
            .ok_or_else(|| format!("unknown op {name:?} (gather, plan, canary, slots, all)"))
    }
}

/// The first disagreement of a family, shrunk.
#[derive(Debug, Clone)]
pub struct Finding {
    /// Which case of the run found it (0-based).
    pub case: usize,
    /// What differed, on the shrunk case.
    pub why: String,
    /// The shrunk case as a conformance record (one JSON line; `expected` from the reference).
    pub record: String,
    /// Whether `kvplan check` of the record fails on the backend and passes on the reference
    /// (`None`: the runner panicked on the record).
    pub reproduces: Option<bool>,
}

/// What one family's run found.
#[derive(Debug, Clone)]
pub struct OpReport {
    /// The family.
    pub op: Op,
    /// Cases run.
    pub cases: usize,
    /// Cases on which the backend and the reference disagreed (or either panicked).
    pub disagreements: usize,
    /// The first one, shrunk.
    pub first: Option<Finding>,
    /// How many cases the reference ran to each outcome (`ok` or an error kind): what the cases
    /// covered.
    pub outcomes: std::collections::BTreeMap<String, usize>,
}

/// Runs `cases` cases of `op` from `seed` on backend `B` against the reference.
///
/// The same seed gives the same cases whatever else runs (each family seeds its own generator).
pub fn run<B: KvPlanBackend>(op: Op, seed: u64, cases: usize, device: &B::Device) -> OpReport {
    match op {
        Op::Gather => run_family::<gather::Gather, B>(op, seed, cases, device),
        Op::Plan => run_family::<plan::Plan, B>(op, seed, cases, device),
        Op::Canary => run_family::<canary::CanaryOps, B>(op, seed, cases, device),
        Op::Slots => run_family::<slots::Slots, B>(op, seed, cases, device),
    }
}

/// `kvplan fuzz`'s job: some families on one backend.
pub struct Fuzz {
    /// The families to run.
    pub ops: Vec<Op>,
    /// The seed of every family's generator.
    pub seed: u64,
    /// Cases per family.
    pub cases: usize,
}

impl OnBackend for Fuzz {
    type Output = Vec<OpReport>;

    fn run<B: KvPlanBackend>(self, device: B::Device) -> Vec<OpReport> {
        self.ops
            .iter()
            .map(|&op| run::<B>(op, self.seed, self.cases, &device))
            .collect()
    }
}

/// One op family: its cases, how a case runs on a backend, how two runs compare, and the record.
trait Family {
    /// A generated case: host values only.
    type Case: Clone + fmt::Debug;
    /// What a run of a case shows: outputs, errors, and outputs read back around an error.
    type Observed: fmt::Debug;

    /// The cases.
    fn strategy() -> BoxedStrategy<Self::Case>;

    /// Runs `case` on `B`.
    fn observe<B: KvPlanBackend>(case: &Self::Case, device: &B::Device) -> Self::Observed;

    /// Where `observed` breaks a rule of the spec on its own (an error that changed an output
    /// it must leave alone, a deferred error with a nonzero count).
    fn broken_rule(case: &Self::Case, observed: &Self::Observed) -> Option<String>;

    /// `Err` names the first thing the backend's run does differently from the reference's.
    fn compare(
        case: &Self::Case,
        reference: &Self::Observed,
        got: &Self::Observed,
    ) -> Result<(), String>;

    /// The run's outcome in one word: `ok`, or the first error's kind.
    fn outcome(observed: &Self::Observed) -> String;

    /// The case as a conformance record, `expected` taken from the reference's run.
    fn record(case: &Self::Case, reference: &Self::Observed, id: &str) -> Value;
}

/// The reference's device: Flex through `Dispatch`, as `kvplan check --backend reference`.
fn reference_device() -> <Dispatch as burn_core::backend::BackendTypes>::Device {
    Device::flex().as_dispatch().clone()
}

/// A run that may panic, the panic as text.
fn guarded<T>(run: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(run)).map_err(|payload| {
        let text = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        format!("panicked: {text}")
    })
}

/// The reference's run of `case`, and `Err` when the backend's run disagrees with it.
fn differ<F: Family, B: KvPlanBackend>(
    case: &F::Case,
    device: &B::Device,
) -> (Result<F::Observed, String>, Result<(), String>) {
    let reference = guarded(|| F::observe::<Dispatch>(case, &reference_device()));
    let got = guarded(|| F::observe::<B>(case, device));
    let verdict = match (&reference, &got) {
        (Err(panic), _) => Err(format!("the reference {panic}")),
        (_, Err(panic)) => Err(format!("the backend {panic}")),
        (Ok(reference), Ok(got)) => {
            match (F::broken_rule(case, reference), F::broken_rule(case, got)) {
                (Some(rule), _) => Err(format!("the reference breaks the spec: {rule}")),
                (_, Some(rule)) => Err(format!("the backend breaks the spec: {rule}")),
                _ => F::compare(case, reference, got),
            }
        }
    };
    (reference, verdict)
}

/// Proptest's shrinking walk: simplify while the case still disagrees, complicate when it no
/// longer does, until neither moves (or the step budget is spent).
fn shrink<F: Family, B: KvPlanBackend>(
    tree: &mut impl ValueTree<Value = F::Case>,
    why: String,
    device: &B::Device,
) -> (F::Case, String) {
    const STEPS: usize = 200;
    let mut best = (tree.current(), why);
    // A panic may have lost the device: later runs would prove nothing.
    if best.1.contains("panicked") || !tree.simplify() {
        return best;
    }
    for _ in 0..STEPS {
        let case = tree.current();
        let moved = match differ::<F, B>(&case, device).1 {
            Err(why) => {
                best = (case, why);
                tree.simplify()
            }
            Ok(()) => tree.complicate(),
        };
        if !moved {
            break;
        }
    }
    best
}

/// A generator seeded by `seed` and the family's name.
fn runner(op: Op, seed: u64) -> TestRunner {
    let mut bytes = [0u8; 32];
    let mut state = seed ^ (op as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for chunk in bytes.chunks_exact_mut(8) {
        chunk.copy_from_slice(&kvplan_decoder::sample::splitmix64(&mut state).to_le_bytes());
    }
    let config = Config {
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

fn run_family<F: Family, B: KvPlanBackend>(
    op: Op,
    seed: u64,
    cases: usize,
    device: &B::Device,
) -> OpReport {
    let strategy = F::strategy();
    let mut runner = runner(op, seed);
    let mut report = OpReport {
        op,
        cases: 0,
        disagreements: 0,
        first: None,
        outcomes: Default::default(),
    };
    for k in 0..cases {
        let tree: NewTree<BoxedStrategy<F::Case>> = strategy.new_tree(&mut runner);
        let Ok(mut tree) = tree else {
            // Every strategy here generates without rejection; a refusal ends the run short.
            break;
        };
        report.cases += 1;
        if std::env::var_os("KVPLAN_FUZZ_TRACE").is_some() {
            // Names the case before it runs: the one to blame for a hang or a lost device.
            eprintln!("{op} case {k}: {:?}", tree.current());
        }
        let (reference, verdict) = differ::<F, B>(&tree.current(), device);
        let outcome = reference
            .as_ref()
            .map_or_else(|_| "panic".into(), F::outcome);
        *report.outcomes.entry(outcome).or_default() += 1;
        let Err(why) = verdict else {
            continue;
        };
        report.disagreements += 1;
        if report.first.is_none() {
            let (case, why) = shrink::<F, B>(&mut tree, why, device);
            report.first = Some(finding::<F, B>(op, seed, k, &case, why, device));
        }
    }
    report
}

fn finding<F: Family, B: KvPlanBackend>(
    op: Op,
    seed: u64,
    k: usize,
    case: &F::Case,
    why: String,
    device: &B::Device,
) -> Finding {
    let id = format!("fuzz:{op}:seed{seed}:case{k}");
    let record = match differ::<F, B>(case, device).0 {
        Ok(reference) => F::record(case, &reference, &id),
        // No reference output to expect: the record holds the inputs only.
        Err(panic) => {
            json!({"id": id, "note": format!("the reference {panic}"), "case": format!("{case:?}")})
        }
    };
    let reproduces = guarded(|| {
        let passes = crate::conformance::check_record::<Dispatch>(&record, &reference_device());
        passes.is_ok() && crate::conformance::check_record::<B>(&record, device).is_err()
    })
    .ok();
    Finding {
        case: k,
        why,
        record: record.to_string(),
        reproduces,
    }
}

// ---- failures ----

/// An error as the comparison sees it: kind and message (read-back failures included).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failure {
    kind: String,
    message: String,
}

impl From<Error> for Failure {
    fn from(error: Error) -> Self {
        Self {
            kind: error.kind().into(),
            message: error.to_string(),
        }
    }
}

/// A read-back that failed.
fn read_failure(message: String) -> Failure {
    Failure {
        kind: "read-back".into(),
        message,
    }
}

/// The outcome of one call.
type Outcome<T> = Result<T, Failure>;

/// `ok`, or the error's kind.
fn word<T>(outcome: &Outcome<T>) -> String {
    match outcome {
        Ok(_) => "ok".into(),
        Err(error) => error.kind.clone(),
    }
}

/// An int primitive's values, a failed read-back as a failure.
fn read<B: KvPlanBackend>(tensor: IntTensor<B>) -> Outcome<Vec<i64>> {
    prim::read_ints::<B>(tensor).map_err(read_failure)
}

/// `Err` naming `what` when the two differ (long values cut short).
fn same<T: PartialEq + fmt::Debug>(what: &str, reference: &T, got: &T) -> Result<(), String> {
    if reference == got {
        return Ok(());
    }
    let short = |value: &T| {
        let text = format!("{value:?}");
        match text.char_indices().nth(300) {
            Some((at, _)) => format!("{}...", &text[..at]),
            None => text,
        }
    };
    Err(format!(
        "{what}: reference {}, backend {}",
        short(reference),
        short(got)
    ))
}

/// `Err` naming the first index where two lists differ (or their lengths).
fn same_list(what: &str, reference: &[i64], got: &[i64]) -> Result<(), String> {
    match reference.iter().zip(got).position(|(r, g)| r != g) {
        Some(at) => Err(format!(
            "{what}[{at}]: reference {}, backend {}",
            reference[at], got[at]
        )),
        None => same(&format!("{what} length"), &reference.len(), &got.len()),
    }
}

/// Outcomes compared: both `Ok` as `ok` says, else exactly (kind and message).
fn same_outcome<T: fmt::Debug>(
    what: &str,
    reference: &Outcome<T>,
    got: &Outcome<T>,
    ok: impl FnOnce(&T, &T) -> Result<(), String>,
) -> Result<(), String> {
    match (reference, got) {
        (Ok(reference), Ok(got)) => ok(reference, got),
        (Err(reference), Err(got)) => same(what, reference, got),
        _ => same(
            what,
            &reference.as_ref().map(drop).map_err(Clone::clone),
            &got.as_ref().map(drop).map_err(Clone::clone),
        ),
    }
}

// ---- inputs ----

/// How an input tensor is laid out in memory; every layout holds the same values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Uploaded as is.
    Contiguous,
    /// A 2-D input stored transposed and viewed back (column stride 1 is lost).
    Transposed,
    /// A window one cell inside a larger buffer whose border holds other values.
    Sliced,
    /// Row 0 (or element 0) expanded over dim 0 (a zero stride): the case's values are made so.
    Broadcast,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Contiguous => "contiguous",
            Layout::Transposed => "transposed",
            Layout::Sliced => "sliced",
            Layout::Broadcast => "broadcast",
        }
    }
}

/// Contiguous mostly; shrinks towards it.
fn layout() -> impl Strategy<Value = Layout> + Clone {
    prop_oneof![
        8 => Just(Layout::Contiguous),
        1 => Just(Layout::Transposed),
        1 => Just(Layout::Sliced),
        1 => Just(Layout::Broadcast),
    ]
}

/// An int (or bool: values 0/1) input of a case.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Input {
    shape: Vec<usize>,
    data: Vec<i64>,
    dtype: DType,
    layout: Layout,
}

impl Input {
    /// A contiguous input.
    fn new(shape: Vec<usize>, data: Vec<i64>, dtype: DType) -> Self {
        Self::laid_out(shape, data, dtype, Layout::Contiguous)
    }

    /// An input of `layout`; a broadcast one takes row 0's values for every row. Values wrap
    /// into `dtype` (an edge of a wider dtype stays an edge).
    fn laid_out(shape: Vec<usize>, mut data: Vec<i64>, dtype: DType, layout: Layout) -> Self {
        for value in &mut data {
            *value = match dtype {
                DType::I32 => *value as i32 as i64,
                DType::I16 => *value as i16 as i64,
                DType::I8 => *value as i8 as i64,
                DType::U8 => *value as u8 as i64,
                _ => *value,
            };
        }
        if layout == Layout::Broadcast && !data.is_empty() {
            let row = data.len() / shape.first().copied().unwrap_or(1).max(1);
            let first = data[..row].to_vec();
            for (k, value) in data.iter_mut().enumerate() {
                *value = first[k % row];
            }
        }
        Self {
            shape,
            data,
            dtype,
            layout,
        }
    }

    /// A 1-D input.
    fn list(data: Vec<i64>, dtype: DType) -> Self {
        Self::new(vec![data.len()], data, dtype)
    }

    fn int<B: KvPlanBackend>(&self, device: &B::Device) -> IntTensor<B> {
        let upload =
            |data: &[i64], shape: &[usize]| prim::ints::<B>(data, shape, self.dtype, device);
        let ops = ViewOps {
            upload,
            transpose: |t| B::int_swap_dims(t, 0, 1),
            slice: B::int_slice,
            expand: B::int_expand,
        };
        ops.view(&self.data, &self.shape, self.layout, BORDER)
    }

    fn bool<B: KvPlanBackend>(&self, device: &B::Device) -> BoolTensor<B> {
        let upload = |data: &[i64], shape: &[usize]| {
            let values: Vec<bool> = data.iter().map(|&v| v != 0).collect();
            prim::bools::<B>(&values, shape, device)
        };
        let ops = ViewOps {
            upload,
            transpose: |t| B::bool_swap_dims(t, 0, 1),
            slice: B::bool_slice,
            expand: B::bool_expand,
        };
        ops.view(&self.data, &self.shape, self.layout, BORDER)
    }

    /// The values as a record list, or a `{rows, cols, data}` / `{shape, data}` table.
    fn table_json(&self) -> Value {
        match self.shape.as_slice() {
            [rows, cols] => json!({"rows": rows, "cols": cols, "data": self.data}),
            shape => json!({"shape": shape, "data": self.data}),
        }
    }
}

/// The tensor ops a layout is built with (int, bool or float tensors).
struct ViewOps<U, X, S, E> {
    upload: U,
    transpose: X,
    slice: S,
    expand: E,
}

impl<U, X, S, E> ViewOps<U, X, S, E> {
    /// `data` of `shape` as a tensor of `layout` (1-D and 2-D; other ranks are uploaded as is).
    fn view<V: Copy, T>(&self, data: &[V], shape: &[usize], layout: Layout, border: V) -> T
    where
        U: Fn(&[V], &[usize]) -> T,
        X: Fn(T) -> T,
        S: Fn(T, &[Slice]) -> T,
        E: Fn(T, Shape) -> T,
    {
        if shape.contains(&0) || shape.len() > 2 || shape.is_empty() {
            return (self.upload)(data, shape);
        }
        let (rows, cols) = (shape[0], shape.get(1).copied().unwrap_or(1));
        match layout {
            Layout::Contiguous => (self.upload)(data, shape),
            Layout::Transposed if shape.len() == 2 => {
                let stored: Vec<V> = (0..cols)
                    .flat_map(|c| (0..rows).map(move |r| data[r * cols + c]))
                    .collect();
                (self.transpose)((self.upload)(&stored, &[cols, rows]))
            }
            Layout::Transposed => (self.upload)(data, shape),
            Layout::Sliced if shape.len() == 1 => {
                // The values inside a border of one cell holding `border`.
                let mut padded = vec![border];
                padded.extend(data);
                padded.push(border);
                (self.slice)(
                    (self.upload)(&padded, &[rows + 2]),
                    &[Slice::from(1..rows + 1)],
                )
            }
            Layout::Sliced => {
                let wide = cols + 2;
                let mut padded = vec![border; (rows + 2) * wide];
                for r in 0..rows {
                    let at = (r + 1) * wide + 1;
                    padded[at..at + cols].copy_from_slice(&data[r * cols..(r + 1) * cols]);
                }
                let ranges = [Slice::from(1..rows + 1), Slice::from(1..cols + 1)];
                (self.slice)((self.upload)(&padded, &[rows + 2, wide]), &ranges)
            }
            Layout::Broadcast => {
                let mut one = shape.to_vec();
                one[0] = 1;
                (self.expand)(
                    (self.upload)(&data[..cols], &one),
                    Shape::from(shape.to_vec()),
                )
            }
        }
    }
}

/// The border value of a sliced input: fits every int dtype the cases use, and stands out.
const BORDER: i64 = 77;

/// A dtype as the records spell it.
fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::Bool(_) => "bool",
        _ => "other",
    }
}

/// The int dtypes a caller may pass, `first` most often (shrinks towards it), and now and then
/// one the ops refuse.
fn int_dtype(first: DType) -> impl Strategy<Value = DType> + Clone {
    let other = if first == DType::I32 {
        DType::I64
    } else {
        DType::I32
    };
    prop_oneof![36 => Just(first), 12 => Just(other), 1 => Just(DType::I16)]
}

/// Values at the edges of `dtype` and of `bound` (a width, a row count).
fn edges(dtype: DType, bound: i64) -> Vec<i64> {
    let mut values = vec![-1, -2, bound, bound + 1, i16::MAX as i64, i16::MIN as i64];
    if dtype != DType::I16 {
        values.extend([i32::MAX as i64, i32::MIN as i64]);
    }
    if dtype == DType::I64 {
        values.extend([i64::MAX, i64::MIN, 1 << 31, -(1 << 31) - 1, 1 << 32]);
    }
    values
}

/// An index into `0..bound` mostly; now and then one at or past an end, or a dtype edge.
fn index(bound: usize, dtype: DType) -> BoxedStrategy<i64> {
    let bound = bound as i64;
    prop_oneof![
        48 => 0..bound.max(1),
        1 => Just(bound),
        1 => Just(-1),
        1 => proptest::sample::select(edges(dtype, bound)),
    ]
    .boxed()
}

/// Any value of `dtype`, small ones mostly.
fn value(dtype: DType) -> BoxedStrategy<i64> {
    let wide = match dtype {
        DType::I64 => any::<i64>().boxed(),
        DType::I16 => any::<i16>().prop_map(i64::from).boxed(),
        _ => any::<i32>().prop_map(i64::from).boxed(),
    };
    prop_oneof![8 => 0..1000i64, 1 => wide, 1 => proptest::sample::select(edges(dtype, 0))].boxed()
}

/// `n` values of `strategy`.
fn values(strategy: BoxedStrategy<i64>, n: usize) -> BoxedStrategy<Vec<i64>> {
    proptest::collection::vec(strategy, n).boxed()
}

/// The shape of an input that should have `wanted` dims, now and then another rank (the ops'
/// rank rules).
fn rank_of(wanted: Vec<usize>) -> impl Strategy<Value = Vec<usize>> {
    let flat = vec![wanted.iter().product::<usize>()];
    let mut extra = vec![1];
    extra.extend(wanted.iter().copied());
    prop_oneof![40 => Just(wanted), 1 => Just(flat), 1 => Just(extra)]
}

/// An input of `shape` (as generated by [`rank_of`]): values, dtype and layout drawn.
fn input(
    shape: Vec<usize>,
    dtype: impl Strategy<Value = DType> + 'static,
    value: impl Fn(DType) -> BoxedStrategy<i64> + 'static,
) -> BoxedStrategy<Input> {
    let n = shape.iter().product::<usize>();
    (dtype, layout())
        .prop_flat_map(move |(dtype, layout)| {
            let shape = shape.clone();
            values(value(dtype), n)
                .prop_map(move |data| Input::laid_out(shape.clone(), data, dtype, layout))
        })
        .boxed()
}

/// Records of `[i64]` lists carry no rank: the list's values.
fn list_json(input: &Input) -> Value {
    json!(input.data)
}

/// The case facts a record cannot carry: dtypes and layouts of the named inputs.
fn fuzz_facts(inputs: &[(&str, &Input)]) -> Value {
    let mut facts = serde_json::Map::new();
    for (name, input) in inputs {
        facts.insert(
            name.to_string(),
            json!({"dtype": dtype_name(input.dtype), "layout": input.layout.name(), "shape": input.shape}),
        );
    }
    Value::Object(facts)
}
