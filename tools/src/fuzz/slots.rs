//! Slot cases: `segment_assign` into poisoned tables (checked and deferred), and sequences of
//! stores into one `KvStore` (checked and deferred) over caches of every dtype and several row
//! shapes, with padding slots, duplicates, slots past the cache and stores too small.

use burn_core::backend::{TensorData, try_read_sync};
use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan::backend::KvRows;
use kvplan::generic;
use kvplan::ops::KvStore;
use proptest::prelude::*;
use serde_json::{Value, json};

use super::{
    Failure, Family, Input, Layout, Outcome, ViewOps, dtype_name, fuzz_facts, index, input,
    int_dtype, layout, rank_of, read, read_failure, same, same_list, same_outcome, value, word,
};

/// A slot case.
#[derive(Debug, Clone)]
pub enum SlotCase {
    /// One `segment_assign`.
    Assign {
        table: Input,
        /// `req_pool_indices`, `start`, `lengths`, `out_cache_loc`.
        inputs: [Input; 4],
    },
    /// Stores in order into one cache of a store of `num_slots`.
    Store {
        num_slots: usize,
        cache: Rows,
        /// `loc` and `values` of each call.
        calls: Vec<(Input, Rows)>,
    },
}

/// A cache or the rows stored into one: exact values of `dtype`.
#[derive(Debug, Clone)]
pub struct Rows {
    dtype: DType,
    shape: Vec<usize>,
    data: Vec<f64>,
    layout: Layout,
}

/// What a run shows.
#[derive(Debug)]
pub enum SlotRun {
    /// The table after the checked call, and after the deferred one with its `check()`.
    Assign {
        checked: Outcome<Vec<i64>>,
        deferred: Outcome<(Outcome<usize>, Outcome<Vec<i64>>)>,
    },
    /// Per mode (checked, deferred), per call: its result and the cache bytes after it.
    Store([Outcome<Vec<(Outcome<usize>, Outcome<Vec<u8>>)>>; 2]),
}

pub struct Slots;

/// One run: a row (0 is padding), a start and a length, inside the table mostly.
fn run(rows: usize, cols: usize) -> BoxedStrategy<(i64, i64, i64)> {
    let cols = cols as i64;
    let inside = (1..rows.max(2) as i64, 0..=cols, 0..=cols)
        .prop_map(move |(row, start, len)| (row, start, len.min(cols - start)));
    let edge = (
        index(rows, DType::I64),
        index(cols as usize + 1, DType::I64),
        prop_oneof![Just(-1i64), Just(cols + 1), Just(0i64)],
    );
    prop_oneof![12 => inside, 1 => Just((0, 0, 0)), 1 => edge].boxed()
}

fn assign() -> BoxedStrategy<SlotCase> {
    let sizes = prop_oneof![
        20 => (0..=5usize, 0..=8usize, 0..=5usize),
        1 => (1..=64usize, 1..=64usize, 100..=300usize),
    ];
    sizes
        .prop_flat_map(|(rows, cols, bs)| {
            let dtypes = [DType::I64; 4].map(int_dtype);
            (
                rank_of(vec![rows, cols])
                    .prop_flat_map(|shape| input(shape, int_dtype(DType::I32), value)),
                proptest::collection::vec(run(rows, cols), bs),
                dtypes,
                prop_oneof![20 => Just(0i64), 1 => Just(1i64), 1 => Just(-1i64)],
                (layout(), layout(), layout(), layout()),
            )
        })
        .prop_flat_map(|(table, runs, dtypes, miscount, layouts)| {
            let total: i64 = runs.iter().map(|r| r.2.max(0)).sum();
            let slot =
                |d: DType| prop_oneof![12 => 0..1000i64, 1 => Just(-1i64), 1 => value(d)].boxed();
            let n = (total + miscount).max(0) as usize;
            (
                Just((table, runs, dtypes, layouts)),
                rank_of(vec![n]).prop_flat_map(move |shape| input(shape, Just(dtypes[3]), slot)),
            )
        })
        .prop_map(|((table, runs, dtypes, layouts), loc)| {
            let column = |k: usize| runs.iter().map(|r| [r.0, r.1, r.2][k]).collect::<Vec<_>>();
            let lists = [0, 1, 2].map(|k| column(k));
            let layouts = [layouts.0, layouts.1, layouts.2];
            let [rpi, start, lengths] = [0, 1, 2].map(|k| {
                Input::laid_out(
                    vec![lists[k].len()],
                    lists[k].clone(),
                    dtypes[k],
                    layouts[k],
                )
            });
            SlotCase::Assign {
                table,
                inputs: [rpi, start, lengths, loc],
            }
        })
        .boxed()
}

/// An exact value of `dtype`.
fn element(dtype: DType) -> BoxedStrategy<f64> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => {
            (-120..120i32).prop_map(|v| f64::from(v) / 4.0).boxed()
        }
        DType::U8 => (0..=255u8).prop_map(f64::from).boxed(),
        DType::I8 => any::<i8>().prop_map(f64::from).boxed(),
        DType::I16 => any::<i16>().prop_map(f64::from).boxed(),
        DType::I32 => any::<i32>().prop_map(f64::from).boxed(),
        _ => (-(1i64 << 40)..(1i64 << 40)).prop_map(|v| v as f64).boxed(),
    }
}

/// Rows of `shape`; a cache is never broadcast (one buffer row would stand for every slot).
fn rows(dtype: DType, shape: Vec<usize>, cache: bool) -> BoxedStrategy<Rows> {
    let n: usize = shape.iter().product();
    (proptest::collection::vec(element(dtype), n), layout())
        .prop_map(move |(mut data, layout)| {
            // A bf16 slice at an unaligned offset is made by Burn's bf16 slice kernel, which
            // loses lavapipe's device before kvplan runs (no bf16 there): bf16 views are made
            // by transposing instead, which moves nothing.
            let layout = match layout {
                Layout::Broadcast if cache => Layout::Contiguous,
                Layout::Sliced if dtype == DType::BF16 => Layout::Transposed,
                layout => layout,
            };
            if layout == Layout::Broadcast && !data.is_empty() {
                let row = n / shape[0].max(1);
                let first = data[..row].to_vec();
                for (k, value) in data.iter_mut().enumerate() {
                    *value = first[k % row];
                }
            }
            Rows {
                dtype,
                shape: shape.clone(),
                data,
                layout,
            }
        })
        .boxed()
}

fn store() -> BoxedStrategy<SlotCase> {
    let dtype = proptest::sample::select(vec![
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I16,
        DType::I8,
    ]);
    let trailing = prop_oneof![
        Just(vec![]),
        (1..=5usize).prop_map(|w| vec![w]),
        (1..=3usize).prop_map(|w| vec![2, w])
    ];
    (dtype, 0..=12usize, trailing)
        .prop_flat_map(|(dtype, slots, trailing)| {
            let num_slots = prop_oneof![16 => Just(slots), 4 => Just(slots + 3), 1 => Just(slots.saturating_sub(1)), 1 => Just(0usize), 1 => Just(1usize)];
            let values_trailing = trailing.clone();
            let call = (0..=6usize, prop_oneof![20 => Just(dtype), 1 => Just(DType::F32), 1 => Just(DType::I32)], prop_oneof![20 => Just(0usize), 1 => Just(1usize)], int_dtype(DType::I64))
                .prop_flat_map(move |(n, values_dtype, widen, loc_dtype)| {
                    let mut shape = vec![n];
                    shape.extend(&values_trailing);
                    if widen == 1 {
                        shape.push(1);
                    }
                    // Duplicates come from a small range of slots.
                    let slot = move |d: DType| prop_oneof![16 => 0..slots.max(1) as i64, 1 => 0..2i64, 1 => index(slots, d)].boxed();
                    (rank_of(vec![n]).prop_flat_map(move |shape| input(shape, Just(loc_dtype), slot)), rows(values_dtype, shape, false))
                });
            let mut cache_shape = vec![slots];
            cache_shape.extend(&trailing);
            (num_slots, rows(dtype, cache_shape, true), proptest::collection::vec(call, 1..=3))
        })
        .prop_map(|(num_slots, cache, calls)| SlotCase::Store { num_slots, cache, calls })
        .boxed()
}

impl Rows {
    fn tensor<B: KvPlanBackend>(&self, device: &B::Device) -> KvRows<B> {
        let dtype = self.dtype;
        if dtype.is_float() {
            let upload = |data: &[f64], shape: &[usize]| {
                if shape.contains(&0) {
                    // CubeCL's CUDA runtime breaks on a zero-byte upload.
                    return B::float_empty(shape.to_vec().into(), device, dtype.into());
                }
                B::float_from_data(
                    TensorData::new(data.to_vec(), shape.to_vec()).convert_dtype(dtype),
                    device,
                )
            };
            let ops = ViewOps {
                upload,
                transpose: |t| B::float_swap_dims(t, 0, 1),
                slice: B::float_slice,
                expand: B::float_expand,
            };
            KvRows::Float(ops.view(&self.data, &self.shape, self.layout, 7.0))
        } else {
            let ints: Vec<i64> = self.data.iter().map(|&v| v as i64).collect();
            KvRows::Int(
                Input {
                    shape: self.shape.clone(),
                    data: ints,
                    dtype,
                    layout: self.layout,
                }
                .int::<B>(device),
            )
        }
    }

    /// A contiguous cache of these shape and dtype holding `bytes`.
    fn from_bytes<B: KvPlanBackend>(&self, bytes: &[u8], device: &B::Device) -> KvRows<B> {
        let data = TensorData::from_bytes_vec(bytes.to_vec(), self.shape.clone(), self.dtype);
        let values: Vec<f64> = data
            .convert_dtype(DType::F64)
            .try_to_vec()
            .unwrap_or_default();
        Rows {
            data: values,
            layout: Layout::Contiguous,
            ..self.clone()
        }
        .tensor::<B>(device)
    }

    /// Bytes as the record's exact values.
    fn values_of(&self, bytes: &[u8]) -> Vec<f64> {
        TensorData::from_bytes_vec(bytes.to_vec(), self.shape.clone(), self.dtype)
            .convert_dtype(DType::F64)
            .try_to_vec()
            .unwrap_or_default()
    }

    fn json(&self) -> Value {
        json!({"shape": self.shape, "data": self.data})
    }
}

fn cache_bytes<B: KvPlanBackend>(cache: KvRows<B>) -> Outcome<Vec<u8>> {
    let data = match cache {
        KvRows::Float(tensor) => try_read_sync(B::float_into_data(tensor)),
        KvRows::Int(tensor) => try_read_sync(B::int_into_data(tensor)),
    };
    match data {
        Some(Ok(data)) => Ok(data.bytes().to_vec()),
        Some(Err(error)) => Err(read_failure(format!("{error:?}"))),
        None => Err(read_failure("cannot block on a read here".into())),
    }
}

fn run_assign<B: KvPlanBackend>(table: &Input, inputs: &[Input; 4], device: &B::Device) -> SlotRun {
    let tensors = || {
        let [rpi, start, lengths, loc] = inputs.each_ref().map(|input| input.int::<B>(device));
        (table.int::<B>(device), rpi, start, lengths, loc)
    };
    let (t, rpi, start, lengths, loc) = tensors();
    // Checked: the status read back, then the table (only where it is clear).
    let checked = generic::segment_assign::<B>(t, rpi, start, lengths, loc)
        .and_then(|assigned| assigned.status.check().map(|_| assigned.req_to_token))
        .map_err(Failure::from)
        .and_then(read::<B>);
    let (t, rpi, start, lengths, loc) = tensors();
    let deferred = generic::segment_assign::<B>(t, rpi, start, lengths, loc)
        .map_err(Failure::from)
        .map(|assigned| {
            (
                assigned.status.check().map_err(Failure::from),
                read::<B>(assigned.req_to_token),
            )
        });
    SlotRun::Assign { checked, deferred }
}

/// The store calls in one mode: a failed call's cache is rebuilt from the bytes before it (the
/// checked form consumes it), so every call but a failing one gets a cache no one else holds.
fn run_stores<B: KvPlanBackend>(
    num_slots: usize,
    cache: &Rows,
    calls: &[(Input, Rows)],
    deferred: bool,
    device: &B::Device,
) -> Outcome<Vec<(Outcome<usize>, Outcome<Vec<u8>>)>> {
    let mut store = KvStore::<B>::allocate_on(num_slots, device).map_err(Failure::from)?;
    let mut current = cache.tensor::<B>(device);
    // From the host: reading a bf16 view back would run Burn's bf16 copy kernel (not on lavapipe).
    let mut bytes = cache_bytes_of(cache);
    let mut seen = vec![];
    for (loc, values) in calls {
        let (loc_tensor, values_tensor) = (loc.int::<B>(device), values.tensor::<B>(device));
        let outcome = if deferred {
            generic::store::<B>(&mut store, current, loc_tensor, values_tensor).map(|stored| {
                (
                    stored.status.check().map_err(Failure::from),
                    Some(stored.cache),
                )
            })
        } else {
            generic::store::<B>(&mut store, current, loc_tensor, values_tensor)
                .and_then(|stored| stored.status.check().map(|_| stored.cache))
                .map(|cache| (Ok(loc.data.len()), Some(cache)))
        };
        let (result, stored) = outcome.unwrap_or_else(|error| (Err(error.into()), None));
        current = match stored {
            Some(stored) => stored,
            None => cache.from_bytes::<B>(&bytes, device),
        };
        let after = cache_bytes::<B>(current.clone());
        if let Ok(after) = &after {
            bytes = after.clone();
        }
        seen.push((result, after));
    }
    Ok(seen)
}

impl Family for Slots {
    type Case = SlotCase;
    type Observed = SlotRun;

    fn strategy() -> BoxedStrategy<SlotCase> {
        prop_oneof![assign(), store()].boxed()
    }

    fn observe<B: KvPlanBackend>(case: &SlotCase, device: &B::Device) -> SlotRun {
        match case {
            SlotCase::Assign { table, inputs } => run_assign::<B>(table, inputs, device),
            SlotCase::Store {
                num_slots,
                cache,
                calls,
            } => SlotRun::Store(
                [false, true]
                    .map(|deferred| run_stores::<B>(*num_slots, cache, calls, deferred, device)),
            ),
        }
    }

    fn broken_rule(case: &SlotCase, run: &SlotRun) -> Option<String> {
        match (case, run) {
            (
                SlotCase::Assign { table, .. },
                SlotRun::Assign {
                    deferred: Ok((Err(error), Ok(after))),
                    ..
                },
            ) => (after != &table.data).then(|| format!("{} changed the table", error.kind)),
            (SlotCase::Store { cache, .. }, SlotRun::Store([_, Ok(calls)])) => {
                let mut before = Some(cache_bytes_of(cache));
                for (k, (result, after)) in calls.iter().enumerate() {
                    let Ok(after) = after else { return None };
                    if let (Err(error), Some(before)) = (result, &before) {
                        if after != before {
                            return Some(format!("call {k}: {} changed the cache", error.kind));
                        }
                    }
                    before = Some(after.clone());
                }
                None
            }
            _ => None,
        }
    }

    fn compare(_: &SlotCase, reference: &SlotRun, got: &SlotRun) -> Result<(), String> {
        match (reference, got) {
            (
                SlotRun::Assign {
                    checked: rc,
                    deferred: rd,
                },
                SlotRun::Assign {
                    checked: gc,
                    deferred: gd,
                },
            ) => {
                same_outcome("checked", rc, gc, |r, g| same_list("checked table", r, g))?;
                same_outcome("deferred", rd, gd, |r, g| {
                    same("deferred check()", &r.0, &g.0)?;
                    same_outcome("deferred table", &r.1, &g.1, |r, g| {
                        same_list("deferred table", r, g)
                    })
                })
            }
            (SlotRun::Store(reference), SlotRun::Store(got)) => {
                for (mode, (r, g)) in ["checked", "deferred"]
                    .iter()
                    .zip(reference.iter().zip(got))
                {
                    same_outcome(mode, r, g, |r, g| {
                        same(&format!("{mode} calls"), &r.len(), &g.len())?;
                        for (k, (r, g)) in r.iter().zip(g).enumerate() {
                            same(&format!("{mode} call {k}"), &r.0, &g.0)?;
                            same(&format!("{mode} cache bytes after call {k}"), &r.1, &g.1)?;
                        }
                        Ok(())
                    })?;
                }
                Ok(())
            }
            _ => Err("the runs differ in kind".into()),
        }
    }

    fn outcome(run: &SlotRun) -> String {
        match run {
            SlotRun::Assign { checked, .. } => format!("assign {}", word(checked)),
            SlotRun::Store([checked, _]) => {
                let calls = checked.as_ref().map(Vec::as_slice).unwrap_or_default();
                let failed = calls.iter().find_map(|call| call.0.as_ref().err());
                match (checked, failed) {
                    (Err(error), _) | (_, Some(error)) => format!("store {}", error.kind),
                    _ => "store ok".into(),
                }
            }
        }
    }

    fn record(case: &SlotCase, reference: &SlotRun, id: &str) -> Value {
        match (case, reference) {
            (SlotCase::Assign { table, inputs }, SlotRun::Assign { checked, .. }) => {
                assign_record(table, inputs, checked, id)
            }
            (
                SlotCase::Store {
                    num_slots,
                    cache,
                    calls,
                },
                SlotRun::Store([checked, _]),
            ) => store_record(*num_slots, cache, calls, checked, id),
            _ => json!({"id": id, "note": "the reference's run does not match the case"}),
        }
    }
}

/// The cache's bytes as uploaded (`None` when they cannot be built on the host).
fn cache_bytes_of(cache: &Rows) -> Vec<u8> {
    let data = if cache.dtype.is_float() {
        TensorData::new(cache.data.clone(), cache.shape.clone()).convert_dtype(cache.dtype)
    } else {
        let ints: Vec<i64> = cache.data.iter().map(|&v| v as i64).collect();
        TensorData::new(ints, cache.shape.clone()).convert_dtype(cache.dtype)
    };
    data.bytes().to_vec()
}

/// A list input as a record's list, another rank as `{shape, data}`.
fn loose(input: &Input) -> Value {
    if input.shape.len() == 1 {
        json!(input.data)
    } else {
        json!({"shape": input.shape, "data": input.data})
    }
}

fn error_fields(record: &mut Value, error: &Failure) {
    record["error_kind"] = json!(error.kind);
    record["expected_error"] = json!({"kind": error.kind, "message": error.message});
}

fn assign_record(
    table: &Input,
    inputs: &[Input; 4],
    checked: &Outcome<Vec<i64>>,
    id: &str,
) -> Value {
    let names = ["req_pool_indices", "start", "lengths", "out_cache_loc"];
    let mut dtypes = json!({"req_to_token": dtype_name(table.dtype)});
    let mut values = json!({"req_to_token": table.table_json()});
    for (name, input) in names.iter().zip(inputs) {
        dtypes[name] = json!(dtype_name(input.dtype));
        values[name] = loose(input);
    }
    values["dtypes"] = dtypes;
    let mut facts = vec![("req_to_token", table)];
    facts.extend(names.iter().copied().zip(inputs));
    let mut record = json!({"id": id, "source": "fuzz", "op": "segment_assign", "inputs": values, "fuzz": fuzz_facts(&facts)});
    match checked {
        Ok(after) => {
            record["policy"] = json!("equal");
            record["expected"] = json!({"req_to_token": Input { data: after.clone(), ..table.clone() }.table_json()});
        }
        Err(error) => {
            record["policy"] = json!("error");
            error_fields(&mut record, error);
        }
    }
    record
}

fn store_record(
    num_slots: usize,
    cache: &Rows,
    calls: &[(Input, Rows)],
    checked: &Outcome<Vec<(Outcome<usize>, Outcome<Vec<u8>>)>>,
    id: &str,
) -> Value {
    let seen = checked.as_ref().map(Vec::as_slice).unwrap_or_default();
    let mut first_error = None;
    let calls: Vec<Value> = calls
        .iter()
        .zip(seen)
        .map(|((loc, values), (result, after))| {
            let mut call = json!({
                "loc": loose(loc),
                "loc_dtype": dtype_name(loc.dtype),
                "values": values.json(),
                "values_dtype": dtype_name(values.dtype),
                "expected": {"cache": after.as_ref().map(|bytes| cache.values_of(bytes)).unwrap_or_default()},
                "fuzz": {"loc_layout": loc.layout.name(), "values_layout": values.layout.name()},
            });
            if let Err(error) = result {
                error_fields(&mut call, error);
                first_error.get_or_insert(error.clone());
            }
            call
        })
        .collect();
    let mut record = json!({
        "id": id,
        "source": "fuzz",
        "op": "store_kv",
        "inputs": {"num_slots": num_slots, "cache": cache.json(), "dtypes": {"cache": dtype_name(cache.dtype)}, "calls": calls},
        "fuzz": {"cache_layout": cache.layout.name()},
    });
    match (&first_error, checked) {
        (_, Err(error)) => {
            record["policy"] = json!("error");
            record["note"] = json!(format!("the store could not be made: {}", error.message));
        }
        (Some(error), _) => {
            record["policy"] = json!("error");
            error_fields(&mut record, error);
        }
        (None, _) => record["policy"] = json!("equal"),
    }
    record
}
