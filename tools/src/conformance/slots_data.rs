//! The generator of `tests/data/slots.jsonl`: fixed seeds, outputs from the host reference
//! (`kvplan::reference::{segment_assign, store_kv}`), host-rule errors written out as the
//! library's typed errors. Tables and caches start poisoned (random values), so that every cell
//! an op must leave alone is compared too.
//!
//! Re-run it with `kvplan conformance-data slots tests/data/slots.jsonl`, or with the integration test
//! `slots_file_is_generated` under `KVPLAN_REGENERATE=1`; that test fails whenever the file and
//! this generator disagree.

use kvplan::Error;
use kvplan::error::Dims;
use kvplan::reference::{Segments, segment_assign, store_kv};
use serde_json::{Value, json};

/// The prefix of `segment_assign` messages (the library's `ASSIGN_CONTEXT`).
const ASSIGN: &str = "segment_assign:";
/// The prefix of `store_kv` messages (the library's `STORE_CONTEXT`).
const STORE: &str = "store_kv:";
/// The dtypes the int rules accept, as the errors name them.
const INT_DTYPES: &str = "int32, int64";

/// SplitMix64: small, deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // The project's one splitmix64 step.
        kvplan_decoder::sample::splitmix64(&mut self.0)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = (hi as i128 - lo as i128 + 1) as u128;
        (lo as i128 + (self.next() as u128 % span) as i128) as i64
    }

    fn urange(&mut self, lo: usize, hi: usize) -> usize {
        self.range(lo as i64, hi as i64) as usize
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next() % den < num
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.urange(0, items.len() - 1)]
    }
}

/// One `segment_assign` input, as the record spells it.
#[derive(Clone)]
struct Assign {
    rows: usize,
    cols: usize,
    table: Vec<i64>,
    /// `req_to_token`, `req_pool_indices`, `start`, `lengths`, `out_cache_loc`.
    dtypes: [&'static str; 5],
    rpi: Vec<i64>,
    start: Vec<i64>,
    lengths: Vec<i64>,
    loc: Vec<i64>,
    /// Shapes that are not what the lists imply (rank errors): (input, shape).
    shapes: Vec<(&'static str, Vec<usize>)>,
}

impl Assign {
    /// A 4x6 table poisoned with `100 + k`, and the given runs (dtypes: int32 table, int64 rest).
    fn small(rpi: &[i64], start: &[i64], lengths: &[i64], loc: &[i64]) -> Self {
        Self {
            rows: 4,
            cols: 6,
            table: (0..24).map(|k| 100 + k).collect(),
            dtypes: ["int32", "int64", "int64", "int64", "int64"],
            rpi: rpi.to_vec(),
            start: start.to_vec(),
            lengths: lengths.to_vec(),
            loc: loc.to_vec(),
            shapes: Vec::new(),
        }
    }

    fn slot_max(&self) -> i64 {
        if self.dtypes[0] == "int32" {
            i64::from(i32::MAX)
        } else {
            i64::MAX
        }
    }

    /// The reference's outcome: the whole table after the call.
    fn reference(&self) -> Result<Vec<i64>, Error> {
        let mut table = self.table.clone();
        let segments = Segments {
            req_pool_indices: &self.rpi,
            start: &self.start,
            lengths: &self.lengths,
        };
        segment_assign(
            &mut table,
            [self.rows, self.cols],
            segments,
            &self.loc,
            self.slot_max(),
            ASSIGN,
        )?;
        Ok(table)
    }

    fn tensor(&self, name: &'static str, data: &[i64]) -> Value {
        match self.shapes.iter().find(|(input, _)| *input == name) {
            Some((_, shape)) => json!({"shape": shape, "data": data}),
            None if name == "req_to_token" => {
                json!({"rows": self.rows, "cols": self.cols, "data": data})
            }
            None => json!(data),
        }
    }

    fn inputs(&self) -> Value {
        let names = [
            "req_to_token",
            "req_pool_indices",
            "start",
            "lengths",
            "out_cache_loc",
        ];
        let dtypes: serde_json::Map<String, Value> = names
            .iter()
            .zip(self.dtypes)
            .map(|(name, dtype)| (name.to_string(), json!(dtype)))
            .collect();
        json!({
            "req_to_token": self.tensor("req_to_token", &self.table),
            "req_pool_indices": self.tensor("req_pool_indices", &self.rpi),
            "start": self.tensor("start", &self.start),
            "lengths": self.tensor("lengths", &self.lengths),
            "out_cache_loc": self.tensor("out_cache_loc", &self.loc),
            "dtypes": dtypes,
        })
    }

    /// A `segment_assign` record: the reference's outcome, or `host` (a host rule's error).
    fn record(&self, id: &str, source: &str, host: Option<Error>) -> Value {
        let outcome = match host {
            Some(error) => Err(error),
            None => self.reference(),
        };
        let mut record = json!({
            "id": format!("slots:assign:{id}"),
            "source": source,
            "op": "segment_assign",
            "inputs": self.inputs(),
        });
        match outcome {
            Ok(table) => {
                record["policy"] = json!("equal");
                record["expected"] =
                    json!({"req_to_token": {"rows": self.rows, "cols": self.cols, "data": table}});
            }
            Err(error) => error_fields(&mut record, &error),
        }
        record
    }

    /// An `assign_gather` record (valid inputs only): the gather gives back `out_cache_loc`.
    fn composition(&self, id: &str, source: &str) -> Value {
        assert!(
            self.reference().is_ok(),
            "{id}: a composition needs valid inputs"
        );
        json!({
            "id": format!("slots:assign_gather:{id}"),
            "source": source,
            "op": "assign_gather",
            "policy": "equal",
            "inputs": self.inputs(),
            "expected": {"out": self.loc},
        })
    }
}

fn error_fields(record: &mut Value, error: &Error) {
    record["policy"] = json!("error");
    record["error_kind"] = json!(error.kind());
    record["expected_error"] = json!({"kind": error.kind(), "message": error.to_string()});
}

/// A random valid `segment_assign`: non-overlapping runs (several may share a row), padding rows,
/// random slots that fit the table, random dtypes, a poisoned table.
fn random_assign(rng: &mut Rng) -> Assign {
    let (rows, cols) = (rng.urange(2, 6), rng.urange(1, 10));
    let wide = rng.chance(1, 2);
    let table_dtype = if wide { "int64" } else { "int32" };
    let poison = if wide {
        i64::MAX / 2
    } else {
        i64::from(i32::MAX)
    };
    let table = (0..rows * cols)
        .map(|_| rng.range(-poison, poison))
        .collect();
    let mut taken = vec![false; rows * cols];
    let bs = rng.urange(0, 6);
    let (mut rpi, mut start, mut lengths) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..bs {
        let padding = rng.chance(1, 5);
        let row = if padding { 0 } else { rng.urange(1, rows - 1) };
        let first = rng.urange(0, cols);
        let mut length = if padding {
            0
        } else {
            rng.urange(0, (cols - first).min(4))
        };
        // Shrink the run to its free cells.
        if let Some(taken_at) = (0..length).position(|j| taken[row * cols + first + j]) {
            length = taken_at;
        }
        for j in 0..length {
            taken[row * cols + first + j] = true;
        }
        rpi.push(row as i64);
        start.push(first as i64);
        lengths.push(length as i64);
    }
    let slots: usize = lengths.iter().sum::<i64>() as usize;
    let most = if wide {
        1i64 << 40
    } else {
        i64::from(i32::MAX)
    };
    let loc: Vec<i64> = (0..slots)
        .map(|_| match rng.urange(0, 9) {
            0 => 0,
            1 => most,
            _ => rng.range(1, 4096),
        })
        .collect();
    let int = |rng: &mut Rng| rng.pick(&["int32", "int64"]);
    let loc_dtype = if loc.iter().any(|&slot| slot > i64::from(i32::MAX)) {
        "int64"
    } else {
        int(rng)
    };
    Assign {
        rows,
        cols,
        table,
        dtypes: [table_dtype, int(rng), int(rng), int(rng), loc_dtype],
        rpi,
        start,
        lengths,
        loc,
        shapes: Vec::new(),
    }
}

/// Every `segment_assign` error kind of the file, the rule order between them, and edge cases
/// that must pass.
fn assign_edges() -> Vec<Value> {
    let context = || ASSIGN.to_string();
    let mut records = Vec::new();
    let mut push = |id: &str, case: Assign, host: Option<Error>| {
        records.push(case.record(id, &format!("edge:{id}"), host));
    };
    // Edge cases that pass.
    push(
        "basic",
        Assign::small(&[1, 3], &[0, 2], &[3, 2], &[7, 8, 9, 10, 11]),
        None,
    );
    push(
        "same_row_adjacent_runs",
        Assign::small(&[2, 2, 2], &[3, 0, 5], &[2, 3, 1], &[1, 2, 3, 4, 5, 6]),
        None,
    );
    push(
        "padding_rows_and_empty_runs",
        Assign::small(&[0, 1, 0, 1], &[0, 6, 3, 0], &[0, 0, 0, 1], &[0]),
        None,
    );
    push("empty_batch", Assign::small(&[], &[], &[], &[]), None);
    push(
        "int32_table_largest_slot",
        Assign::small(&[1], &[5], &[1], &[i64::from(i32::MAX)]),
        None,
    );
    let mut wide = Assign::small(&[3], &[0], &[2], &[1 << 40, (1 << 40) + 1]);
    wide.dtypes[0] = "int64";
    push("int64_table_wide_slots", wide, None);
    let mut narrow = Assign::small(&[1, 2], &[1, 0], &[2, 2], &[5, 6, 7, 8]);
    narrow.dtypes = ["int32"; 5];
    push("all_int32", narrow, None);

    // Host rules.
    let mut case = Assign::small(&[1], &[0], &[1], &[5]);
    case.shapes.push(("req_to_token", vec![24]));
    push(
        "table_not_2d",
        case,
        Some(Error::Not2d {
            context: context(),
            name: "req_to_token",
            shape: Dims(vec![24]),
        }),
    );
    let mut case = Assign::small(&[1], &[0], &[2], &[5, 6]);
    case.shapes.push(("out_cache_loc", vec![2, 1]));
    push(
        "out_cache_loc_not_1d",
        case,
        Some(Error::Not1d {
            context: context(),
            name: "out_cache_loc",
            shape: Dims(vec![2, 1]),
        }),
    );
    let mut case = Assign::small(&[1], &[0], &[1], &[5]);
    case.dtypes[3] = "int16";
    push(
        "lengths_int16",
        case,
        Some(Error::DtypeMismatch {
            context: context(),
            name: "lengths",
            got: "int16".into(),
            accepted: INT_DTYPES,
        }),
    );
    push(
        "start_length_mismatch",
        Assign::small(&[1, 2, 3], &[0, 0], &[1, 1, 1], &[5, 6, 7]),
        Some(Error::SegmentLengthMismatch {
            context: context(),
            name: "start",
            len: 2,
            bs: 3,
        }),
    );
    push(
        "lengths_length_mismatch",
        Assign::small(&[1, 2], &[0, 0], &[1], &[5]),
        Some(Error::SegmentLengthMismatch {
            context: context(),
            name: "lengths",
            len: 1,
            bs: 2,
        }),
    );

    // Value rules (the reference's errors), one at a time, then in competition.
    push(
        "row_out_of_range",
        Assign::small(&[1, 4], &[0, 0], &[1, 0], &[5]),
        None,
    );
    push("negative_row", Assign::small(&[-1], &[0], &[0], &[]), None);
    push(
        "padding_row_with_slots",
        Assign::small(&[1, 0], &[0, 0], &[1, 2], &[5, 6, 7]),
        None,
    );
    push(
        "negative_length",
        Assign::small(&[1, 2], &[0, 0], &[1, -2], &[5]),
        None,
    );
    push(
        "negative_start",
        Assign::small(&[1], &[-2], &[1], &[5]),
        None,
    );
    push(
        "run_past_width",
        Assign::small(&[1, 2], &[0, 4], &[2, 3], &[5, 6, 7, 8, 9]),
        None,
    );
    push(
        "empty_run_past_width",
        Assign::small(&[1], &[7], &[0], &[]),
        None,
    );
    push(
        "start_near_i64_max",
        Assign::small(&[1], &[i64::MAX - 1], &[3], &[5, 6, 7]),
        None,
    );
    push(
        "too_few_slots",
        Assign::small(&[1, 2], &[0, 0], &[2, 1], &[5, 6]),
        None,
    );
    push(
        "too_many_slots",
        Assign::small(&[1], &[0], &[1], &[5, 6]),
        None,
    );
    push(
        "negative_slot",
        Assign::small(&[1, 2], &[0, 3], &[2, 2], &[5, 6, 7, -3]),
        None,
    );
    push(
        "slot_past_int32",
        Assign::small(&[2], &[1], &[2], &[5, 1 << 31]),
        None,
    );
    push(
        "overlapping_runs",
        Assign::small(&[1, 2, 1], &[1, 0, 3], &[3, 1, 2], &[5, 6, 7, 8, 9, 10]),
        None,
    );
    push(
        "identical_runs",
        Assign::small(&[3, 3], &[2, 2], &[1, 1], &[5, 6]),
        None,
    );
    push(
        "run_inside_a_run",
        Assign::small(
            &[3, 1, 3],
            &[0, 0, 2],
            &[6, 1, 1],
            &[1, 2, 3, 4, 5, 6, 7, 8],
        ),
        None,
    );
    push(
        "order_row_before_conflict",
        Assign::small(&[1, 1, 9], &[0, 0, 0], &[1, 1, 0], &[5, 6]),
        None,
    );
    push(
        "order_negative_length_before_position",
        Assign::small(&[1, 2, 3], &[-5, 0, 0], &[1, 1, -1], &[5, 6]),
        None,
    );
    push(
        "order_padding_before_negative_length",
        Assign::small(&[1, 0], &[0, 0], &[-1, 3], &[5, 6, 7]),
        None,
    );
    push(
        "order_count_before_slot",
        Assign::small(&[1], &[0], &[2], &[-1]),
        None,
    );
    push(
        "order_slot_before_conflict",
        Assign::small(&[1, 1], &[0, 1], &[2, 2], &[5, 6, 7, -8]),
        None,
    );
    records
}

/// One `store_kv` call: the tokens' slots, their rows, and whether it differs from the cache
/// (a host-rule error, written out).
struct Call {
    loc: Vec<i64>,
    loc_shape: Option<Vec<usize>>,
    loc_dtype: &'static str,
    values: Vec<f64>,
    values_shape: Vec<usize>,
    values_dtype: Option<&'static str>,
    host: Option<Error>,
}

/// A store record: a cache, its store's capacity and a sequence of calls.
struct Store {
    dtype: &'static str,
    shape: Vec<usize>,
    cache: Vec<f64>,
    num_slots: usize,
    calls: Vec<Call>,
}

impl Store {
    fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    fn record(&self, id: &str, source: &str) -> Value {
        let mut cache = self.cache.clone();
        let mut first_error: Option<Error> = None;
        let calls: Vec<Value> = self
            .calls
            .iter()
            .map(|call| {
                let mut attempt = cache.clone();
                let outcome = match &call.host {
                    Some(error) => Err(error.clone()),
                    None => store_kv(
                        &mut attempt,
                        [self.shape[0], self.row_len()],
                        &call.loc,
                        &call.values,
                        STORE,
                    ),
                };
                let loc = match &call.loc_shape {
                    Some(shape) => json!({"shape": shape, "data": call.loc}),
                    None => json!(call.loc),
                };
                let mut value = json!({
                    "loc": loc,
                    "loc_dtype": call.loc_dtype,
                    "values": {"shape": call.values_shape, "data": call.values},
                });
                if let Some(dtype) = call.values_dtype {
                    value["values_dtype"] = json!(dtype);
                }
                match outcome {
                    Ok(_) => cache = attempt,
                    Err(error) => {
                        error_fields(&mut value, &error);
                        value.as_object_mut().expect("an object").remove("policy");
                        first_error.get_or_insert(error);
                    }
                }
                value["expected"] = json!({"cache": cache});
                value
            })
            .collect();
        let mut record = json!({
            "id": format!("slots:store:{id}"),
            "source": source,
            "op": "store_kv",
            "inputs": {
                "num_slots": self.num_slots,
                "cache": {"shape": self.shape, "data": self.cache},
                "dtypes": {"cache": self.dtype},
                "calls": calls,
            },
        });
        match first_error {
            Some(error) => error_fields(&mut record, &error),
            None => record["policy"] = json!("equal"),
        }
        record
    }
}

/// A random value of `dtype` that JSON and the dtype both hold exactly.
fn element(rng: &mut Rng, dtype: &str) -> f64 {
    match dtype {
        // Quarters up to 30: 7 significant bits, exact in bfloat16 and float16.
        "float32" | "float16" | "bfloat16" => rng.range(-120, 120) as f64 / 4.0,
        "uint8" => rng.range(0, 255) as f64,
        "int16" => rng.range(-30_000, 30_000) as f64,
        "int32" => rng.range(i64::from(i32::MIN), i64::from(i32::MAX)) as f64,
        // Integers of at most 53 bits travel through f64 exactly.
        _ => rng.range(-(1 << 52), 1 << 52) as f64,
    }
}

/// A random valid call: distinct slots other than 0, padding tokens on slot 0 among them.
fn random_call(rng: &mut Rng, dtype: &'static str, shape: &[usize]) -> Call {
    let slots = shape[0];
    let mut free: Vec<i64> = (1..slots as i64).collect();
    let tokens = rng.urange(0, free.len().min(10) + 1);
    let loc: Vec<i64> = (0..tokens)
        .map(|_| {
            if free.is_empty() || rng.chance(1, 5) {
                0
            } else {
                free.swap_remove(rng.urange(0, free.len() - 1))
            }
        })
        .collect();
    let row_len: usize = shape.iter().skip(1).product();
    let mut values_shape = shape.to_vec();
    values_shape[0] = loc.len();
    Call {
        values: (0..loc.len() * row_len)
            .map(|_| element(rng, dtype))
            .collect(),
        values_shape,
        loc,
        loc_shape: None,
        loc_dtype: rng.pick(&["int32", "int64"]),
        values_dtype: None,
        host: None,
    }
}

fn random_store(rng: &mut Rng) -> Store {
    let dtype = rng.pick(&[
        "float32", "float16", "bfloat16", "int32", "int64", "uint8", "int16",
    ]);
    let slots = rng.urange(1, 40);
    let shape = match rng.urange(0, 5) {
        0 => vec![slots],
        1 => vec![slots, 2, 3],
        _ => vec![slots, rng.urange(1, 9)],
    };
    let cache = (0..shape.iter().product::<usize>())
        .map(|_| element(rng, dtype))
        .collect();
    let calls = (0..rng.urange(1, 3))
        .map(|_| random_call(rng, dtype, &shape))
        .collect();
    Store {
        dtype,
        num_slots: slots + rng.urange(0, 3),
        shape,
        cache,
        calls,
    }
}

/// Every `store_kv` error kind of the file and edge cases, on small float32 caches of `[16, 4]`.
fn store_edges() -> Vec<Value> {
    let mut rng = Rng(0x5354_4f52_4545_4447);
    let context = || STORE.to_string();
    let mut records = Vec::new();
    let shape = vec![16, 4];
    let cache: Vec<f64> = (0..64).map(|_| element(&mut rng, "float32")).collect();
    let call = |rng: &mut Rng, loc: &[i64]| Call {
        values: (0..loc.len() * 4)
            .map(|_| element(rng, "float32"))
            .collect(),
        values_shape: vec![loc.len(), 4],
        loc: loc.to_vec(),
        loc_shape: None,
        loc_dtype: "int64",
        values_dtype: None,
        host: None,
    };
    let push = |id: &str, calls: Vec<Call>, num_slots: usize, records: &mut Vec<Value>| {
        let store = Store {
            dtype: "float32",
            shape: shape.clone(),
            cache: cache.clone(),
            num_slots,
            calls,
        };
        records.push(store.record(id, &format!("edge:{id}")));
    };
    // Edge cases that pass.
    push("basic", vec![call(&mut rng, &[3, 1, 15])], 16, &mut records);
    push(
        "padding_slot_repeats_last_wins",
        vec![call(&mut rng, &[0, 4, 0, 0, 5])],
        16,
        &mut records,
    );
    push("no_tokens", vec![call(&mut rng, &[])], 16, &mut records);
    push(
        "slots_reused_across_calls",
        vec![
            call(&mut rng, &[1, 2, 3]),
            call(&mut rng, &[3, 2, 1]),
            call(&mut rng, &[2, 0, 1]),
        ],
        16,
        &mut records,
    );
    push(
        "cache_smaller_than_store",
        vec![call(&mut rng, &[7, 0])],
        20,
        &mut records,
    );
    // Value rules.
    push(
        "negative_slot",
        vec![call(&mut rng, &[3, -1])],
        16,
        &mut records,
    );
    push(
        "slot_past_cache",
        vec![call(&mut rng, &[16, 2])],
        16,
        &mut records,
    );
    push(
        "slot_near_i64_max",
        vec![call(&mut rng, &[2, i64::MAX])],
        16,
        &mut records,
    );
    push(
        "duplicate_slot",
        vec![call(&mut rng, &[5, 2, 5])],
        16,
        &mut records,
    );
    push(
        "duplicate_among_padding",
        vec![call(&mut rng, &[0, 3, 0, 3, 0])],
        16,
        &mut records,
    );
    push(
        "order_range_before_duplicate",
        vec![call(&mut rng, &[5, 5, 99])],
        16,
        &mut records,
    );
    push(
        "errors_leave_no_state",
        vec![
            call(&mut rng, &[1, 2, 3]),
            call(&mut rng, &[4, 5, 4]),
            call(&mut rng, &[4, 5, 6]),
            call(&mut rng, &[7, 16]),
            call(&mut rng, &[7, 8, 1]),
        ],
        16,
        &mut records,
    );
    // Host rules.
    let mut wide_rows = call(&mut rng, &[1, 2]);
    wide_rows.values = (0..10).map(|_| element(&mut rng, "float32")).collect();
    wide_rows.values_shape = vec![2, 5];
    wide_rows.host = Some(Error::ValueShapeMismatch {
        context: context(),
        values: Dims(vec![2, 5]),
        expected: Dims(vec![2, 4]),
        cache: Dims(vec![16, 4]),
    });
    push("values_row_shape", vec![wide_rows], 16, &mut records);
    let mut short = call(&mut rng, &[1, 2, 3]);
    short.values.truncate(8);
    short.values_shape = vec![2, 4];
    short.host = Some(Error::ValueShapeMismatch {
        context: context(),
        values: Dims(vec![2, 4]),
        expected: Dims(vec![3, 4]),
        cache: Dims(vec![16, 4]),
    });
    push("values_row_count", vec![short], 16, &mut records);
    let mut ints = call(&mut rng, &[1]);
    ints.values = vec![1.0, 2.0, 3.0, 4.0];
    ints.values_dtype = Some("int32");
    ints.host = Some(Error::ValueDtypeMismatch {
        context: context(),
        values: "int32".into(),
        cache: "f32".into(),
    });
    push("values_int_for_float_cache", vec![ints], 16, &mut records);
    let mut halves = call(&mut rng, &[1]);
    halves.values_dtype = Some("float16");
    halves.host = Some(Error::ValueDtypeMismatch {
        context: context(),
        values: "f16".into(),
        cache: "f32".into(),
    });
    push(
        "values_float16_for_float32_cache",
        vec![halves],
        16,
        &mut records,
    );
    let mut small_loc = call(&mut rng, &[1]);
    small_loc.loc_dtype = "int16";
    small_loc.host = Some(Error::DtypeMismatch {
        context: context(),
        name: "loc",
        got: "int16".into(),
        accepted: INT_DTYPES,
    });
    push("loc_int16", vec![small_loc], 16, &mut records);
    let mut flat = call(&mut rng, &[1, 2]);
    flat.loc_shape = Some(vec![2, 1]);
    flat.host = Some(Error::Not1d {
        context: context(),
        name: "loc",
        shape: Dims(vec![2, 1]),
    });
    push("loc_not_1d", vec![flat], 16, &mut records);
    let mut over = call(&mut rng, &[1]);
    over.host = Some(Error::StoreCapacity {
        context: context(),
        slots: 16,
        capacity: 12,
    });
    push("cache_larger_than_store", vec![over], 12, &mut records);
    records
}

/// Every record of `slots.jsonl`, in file order.
pub fn records() -> Vec<Value> {
    let mut records = assign_edges();
    let mut rng = Rng(0x5345_474d_454e_5431);
    for round in 0..24 {
        let case = random_assign(&mut rng);
        records.push(case.record(
            &format!("random_{round}"),
            "generated:seed=0x5345474d454e5431",
            None,
        ));
    }
    let mut rng = Rng(0x4741_5448_4552_3031);
    for round in 0..12 {
        let case = random_assign(&mut rng);
        records.push(case.composition(
            &format!("random_{round}"),
            "generated:seed=0x4741544845523031",
        ));
    }
    records.extend(store_edges());
    // Rows of every width class the write moves: bytes (odd rows of u8), 2-byte words (odd rows of
    // f16), 4-byte words, vectors of 4-byte words.
    let mut rng = Rng(0x524f_5753_5749_4454);
    for (id, dtype, shape) in [
        ("uint8_rows_of_3", "uint8", vec![10, 3]),
        ("uint8_rows_of_8", "uint8", vec![10, 8]),
        ("float16_rows_of_3", "float16", vec![12, 3]),
        ("bfloat16_rows_of_2x4", "bfloat16", vec![12, 2, 4]),
        ("int64_rows_of_1", "int64", vec![12, 1]),
        ("float32_rows_of_16", "float32", vec![12, 16]),
    ] {
        let cache = (0..shape.iter().product::<usize>())
            .map(|_| element(&mut rng, dtype))
            .collect();
        let calls = (0..2)
            .map(|_| random_call(&mut rng, dtype, &shape))
            .collect();
        let store = Store {
            dtype,
            num_slots: shape[0],
            shape,
            cache,
            calls,
        };
        records.push(store.record(id, &format!("edge:{id}")));
    }
    let mut rng = Rng(0x5354_4f52_454b_5631);
    for round in 0..24 {
        let store = random_store(&mut rng);
        records.push(store.record(
            &format!("random_{round}"),
            "generated:seed=0x53544f52454b5631",
        ));
    }
    records
}

/// The text of `slots.jsonl`: one record per line.
pub fn jsonl() -> String {
    records()
        .iter()
        .map(|record| format!("{record}\n"))
        .collect()
}

/// Writes `slots.jsonl` to `path`.
pub fn write(path: &str) -> Result<(), String> {
    let text = jsonl();
    std::fs::write(path, &text).map_err(|error| format!("cannot write {path}: {error}"))?;
    println!("{path}: {} records", text.lines().count());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_rule_fails_where_named() {
        let kinds: Vec<String> = records()
            .iter()
            .filter_map(|record| record["error_kind"].as_str().map(String::from))
            .collect();
        for kind in [
            "not_1d",
            "not_2d",
            "dtype_mismatch",
            "segment_length_mismatch",
            "req_pool_index_out_of_range",
            "padding_row_length",
            "negative_length",
            "position_out_of_range",
            "slot_count_mismatch",
            "slot_out_of_range",
            "write_conflict",
            "value_shape_mismatch",
            "value_dtype_mismatch",
            "store_capacity",
            "loc_out_of_range",
            "duplicate_slot",
        ] {
            assert!(kinds.iter().any(|k| k == kind), "no {kind} record");
        }
    }
}
