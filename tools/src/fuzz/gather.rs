//! Gather cases: `masked_gather` and `segment_gather` over random and edge tables, in exact mode
//! and in deferred mode (default or caller capacity).

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{BoolStore, DType};
use kvplan::generic::{exact, masked_gather, segment_gather};
use kvplan::ops::{GatherOptions, Gathered};
use kvplan::{Error, KvPlanBackend};
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{
    Failure, Family, Input, Outcome, fuzz_facts, index, input, int_dtype, list_json, rank_of, read,
    read_failure, same, same_list, same_outcome, value, word,
};
use crate::prim;

/// One gather call.
#[derive(Debug, Clone)]
pub struct GatherCase {
    table: Input,
    req_pool_indices: Input,
    ops: GatherOp,
    capacity: Option<usize>,
}

#[derive(Debug, Clone)]
enum GatherOp {
    Masked {
        pos2d: Input,
        mask: Input,
        context: String,
    },
    Segments {
        start: Option<Input>,
        lengths: Input,
    },
}

/// What a run shows: the exact result and the deferred one.
#[derive(Debug)]
pub struct GatherRun {
    exact: Outcome<Vec<i64>>,
    deferred: Outcome<DeferredRun>,
}

/// A deferred gather read back: `check()`, the device count, the output's length and its first
/// `count` values (the rest is unspecified).
#[derive(Debug, PartialEq)]
struct DeferredRun {
    checked: Outcome<usize>,
    count: Outcome<Vec<i64>>,
    capacity: usize,
    out: Outcome<Vec<i64>>,
}

pub struct Gather;

/// Table sizes: small mostly, now and then a few kernel tiles' worth.
fn sizes() -> impl Strategy<Value = (usize, usize, usize, usize)> {
    prop_oneof![
        30 => (0..=5usize, 0..=9usize, 0..=5usize, 0..=7usize),
        2 => (1..=70usize, 1..=300usize, 1..=70usize, 1..=80usize),
        1 => (Just(8usize), Just(4096usize), Just(300usize), Just(260usize)),
    ]
}

fn capacity(cells: usize) -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        12 => Just(None),
        1 => (0..=3usize).prop_map(Some),
        1 => Just(Some(cells)),
        1 => Just(Some(cells / 2)),
        1 => Just(Some(cells + 5)),
    ]
}

fn masked() -> BoxedStrategy<GatherCase> {
    sizes()
        .prop_flat_map(|(rows, cols, r, c)| {
            let n = prop_oneof![6 => Just(r), 2 => Just(1usize), 1 => 0..=r + 1];
            let mask_shape = prop_oneof![30 => Just(vec![r, c]), 1 => Just(vec![r, c + 1])];
            let density = prop_oneof![Just(0.5), Just(1.0), Just(0.0), Just(0.1)];
            (
                table(rows, cols),
                n.prop_flat_map(move |n| {
                    input(vec![n], int_dtype(DType::I64), move |d| index(rows, d))
                }),
                rank_of(vec![r, c]).prop_flat_map(move |shape| {
                    input(shape, int_dtype(DType::I64), move |d| index(cols, d))
                }),
                (mask_shape, density).prop_flat_map(|(shape, density)| {
                    input(shape, Just(DType::Bool(BoolStore::Native)), move |_| {
                        proptest::bool::weighted(density)
                            .prop_map(i64::from)
                            .boxed()
                    })
                }),
                prop_oneof![Just(String::new()), Just("draft window".to_string())],
                capacity(r * c),
            )
        })
        .prop_map(
            |(table, req_pool_indices, pos2d, mask, context, capacity)| GatherCase {
                table,
                req_pool_indices,
                ops: GatherOp::Masked {
                    pos2d,
                    mask,
                    context,
                },
                capacity,
            },
        )
        .boxed()
}

/// One segment's start and length: inside the table mostly, now and then anything.
fn segment(cols: usize, dtype: DType) -> BoxedStrategy<(i64, i64)> {
    let cols = cols as i64;
    prop_oneof![
        10 => (0..=cols, 0..=cols).prop_map(move |(s, l)| (s, l.min(cols - s))),
        1 => (index(cols as usize, dtype), prop_oneof![Just(-1i64), Just(cols + 1), value(dtype)]),
    ]
    .boxed()
}

fn segments() -> BoxedStrategy<GatherCase> {
    sizes()
        .prop_flat_map(|(rows, cols, s, _)| {
            let n = prop_oneof![6 => Just(s), 2 => Just(1usize), 1 => 0..=s + 1];
            let p = prop_oneof![8 => Just(s), 1 => 0..=s + 1];
            let dtypes = (int_dtype(DType::I64), int_dtype(DType::I64));
            (
                table(rows, cols),
                n.prop_flat_map(move |n| {
                    input(vec![n], int_dtype(DType::I64), move |d| index(rows, d))
                }),
                (p, dtypes, proptest::bool::weighted(0.8)).prop_flat_map(
                    move |(p, (start_dtype, lengths_dtype), with_start)| {
                        let runs = proptest::collection::vec(segment(cols, start_dtype), s.max(p));
                        runs.prop_map(move |runs| {
                            let start: Vec<i64> = runs.iter().take(p).map(|r| r.0).collect();
                            let lengths: Vec<i64> = runs.iter().take(s).map(|r| r.1).collect();
                            (
                                with_start.then(|| Input::list(start, start_dtype)),
                                Input::list(lengths, lengths_dtype),
                            )
                        })
                    },
                ),
                capacity(s * cols),
            )
        })
        .prop_map(
            |(table, req_pool_indices, (start, lengths), capacity)| GatherCase {
                table,
                req_pool_indices,
                ops: GatherOp::Segments { start, lengths },
                capacity,
            },
        )
        .boxed()
}

/// A `rows x cols` table of slot ids (now and then another rank).
fn table(rows: usize, cols: usize) -> BoxedStrategy<Input> {
    rank_of(vec![rows, cols])
        .prop_flat_map(|shape| input(shape, int_dtype(DType::I32), value))
        .boxed()
}

impl GatherCase {
    fn masked(&self) -> bool {
        matches!(self.ops, GatherOp::Masked { .. })
    }

    fn options(&self) -> GatherOptions {
        let options = match &self.ops {
            GatherOp::Masked { context, .. } => GatherOptions::new().context(context.as_str()),
            GatherOp::Segments { .. } => GatherOptions::new(),
        };
        match self.capacity {
            Some(capacity) => options.capacity(capacity),
            None => options,
        }
    }

    fn deferred<B: KvPlanBackend>(&self, device: &B::Device) -> Result<Gathered<B>, Error> {
        let table = self.table.int::<B>(device);
        let rows = self.req_pool_indices.int::<B>(device);
        match &self.ops {
            GatherOp::Masked { pos2d, mask, .. } => masked_gather::<B>(
                table,
                rows,
                pos2d.int::<B>(device),
                mask.bool::<B>(device),
                &self.options(),
            ),
            GatherOp::Segments { start, lengths } => segment_gather::<B>(
                table,
                rows,
                start.as_ref().map(|start| start.int::<B>(device)),
                lengths.int::<B>(device),
                &self.options(),
            ),
        }
    }
}

impl Family for Gather {
    type Case = GatherCase;
    type Observed = GatherRun;

    fn strategy() -> BoxedStrategy<GatherCase> {
        prop_oneof![masked(), segments()].boxed()
    }

    fn observe<B: KvPlanBackend>(case: &GatherCase, device: &B::Device) -> GatherRun {
        let exact = case
            .deferred::<B>(device)
            .and_then(exact::<B>)
            .map_err(Failure::from)
            .and_then(read::<B>);
        let deferred = case
            .deferred::<B>(device)
            .map_err(Failure::from)
            .map(|gathered| {
                let checked = gathered.status.check().map_err(Failure::from);
                let capacity = gathered.out.shape().num_elements();
                let count = read::<B>(gathered.count());
                let out = match &checked {
                    Ok(count) => prim::read_prefix::<B>(gathered.out, *count).map_err(read_failure),
                    Err(_) => Ok(vec![]),
                };
                DeferredRun {
                    checked,
                    count,
                    capacity,
                    out,
                }
            });
        GatherRun { exact, deferred }
    }

    fn broken_rule(_: &GatherCase, run: &GatherRun) -> Option<String> {
        let deferred = run.deferred.as_ref().ok()?;
        let count = deferred.count.as_ref().ok()?.first().copied();
        match &deferred.checked {
            Err(error) if count != Some(0) => Some(format!(
                "a deferred error ({}) left count {count:?}, not 0",
                error.kind
            )),
            Ok(checked) if count != Some(*checked as i64) => Some(format!(
                "check() gave {checked}, the device count {count:?}"
            )),
            _ => None,
        }
    }

    fn compare(_: &GatherCase, reference: &GatherRun, got: &GatherRun) -> Result<(), String> {
        same_outcome("exact", &reference.exact, &got.exact, |r, g| {
            same_list("exact out", r, g)
        })?;
        same_outcome("deferred", &reference.deferred, &got.deferred, |r, g| {
            same("deferred check()", &r.checked, &g.checked)?;
            same("deferred count", &r.count, &g.count)?;
            same("deferred out capacity", &r.capacity, &g.capacity)?;
            same_outcome("deferred out", &r.out, &g.out, |r, g| {
                same_list("deferred out", r, g)
            })
        })
    }

    fn outcome(run: &GatherRun) -> String {
        word(&run.exact)
    }

    fn record(case: &GatherCase, reference: &GatherRun, id: &str) -> Value {
        let mut inputs = json!({
            "req_to_token": case.table.table_json(),
            "req_pool_indices": list_json(&case.req_pool_indices),
        });
        let mut facts = vec![
            ("req_to_token", &case.table),
            ("req_pool_indices", &case.req_pool_indices),
        ];
        match &case.ops {
            GatherOp::Masked {
                pos2d,
                mask,
                context,
            } => {
                inputs["pos2d"] = pos2d.table_json();
                inputs["mask"] = mask.table_json();
                inputs["context"] = json!(context);
                facts.extend([("pos2d", pos2d), ("mask", mask)]);
            }
            GatherOp::Segments { start, lengths } => {
                inputs["start"] = start.as_ref().map_or(Value::Null, list_json);
                inputs["lengths"] = list_json(lengths);
                inputs["context"] = json!("DFLASH req_to_token segment gather");
                facts.push(("lengths", lengths));
                if let Some(start) = start {
                    facts.push(("start", start));
                }
            }
        }
        let mut fuzz = fuzz_facts(&facts);
        fuzz["capacity"] = json!(case.capacity);
        let mut record = json!({
            "id": id,
            "source": "fuzz",
            "op": if case.masked() { "masked" } else { "segments" },
            "inputs": inputs,
            "fuzz": fuzz,
        });
        match &reference.exact {
            Ok(out) => {
                record["policy"] = json!("equal");
                record["expected"] = json!({"out": out});
            }
            Err(error) => {
                record["policy"] = json!("error");
                record["error_kind"] = json!(error.kind);
                record["expected_error"] = json!({"kind": error.kind, "message": error.message});
            }
        }
        record
    }
}
