//! Slot records (`slots.jsonl`): `segment_assign` in checked and deferred mode, the composition
//! `segment_assign` then `segment_gather`, and `store_kv` call sequences on one `KvStore`. Every
//! output is compared whole (the untouched cells too), every error by kind and by message (the
//! message carries the offender's facts), and an error must leave its table or cache unchanged.

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{TensorData, try_read_sync};
use burn_core::tensor::DType;
use kvplan::backend::KvRows;
use kvplan::generic::segment_gather;
use kvplan::generic::{self, DeferredAssign};
use kvplan::ops::GatherOptions;
use kvplan::ops::KvStore;
use kvplan::{Error, KvPlanBackend};
use serde_json::Value;

use super::{
    Dense, Mismatch, check_dtype, check_shape, expect_eq, expect_slice, int_list, list_of,
    malformed, mismatch_kind, missing, prefix_values, shape, unknown, values,
};

pub(super) fn check<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    match record["op"].as_str() {
        Some("segment_assign") => assign::<B>(record, device),
        Some("assign_gather") => assign_gather::<B>(record, device),
        Some("store_kv") => store::<B>(record, device),
        other => Err(unknown(
            "op",
            "segment_assign, assign_gather, store_kv",
            other,
        )),
    }
}

/// A dtype as the records spell it (`int32`, `float16`, ...).
pub fn dtype_of(name: &str) -> Option<DType> {
    Some(match name {
        "int64" => DType::I64,
        "int32" => DType::I32,
        "int16" => DType::I16,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "float32" => DType::F32,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        _ => return None,
    })
}

/// The dtype named by field `field`, else `default`.
fn named_dtype(value: &Value, field: &str, default: DType) -> Result<DType, Mismatch> {
    match value {
        Value::Null => Ok(default),
        value => (value.as_str().and_then(dtype_of)).ok_or_else(|| {
            malformed(
                field,
                "one of int64, int32, int16, int8, uint8, float32, float16, bfloat16",
                value,
            )
        }),
    }
}

/// The record's dtype for input `name`: `inputs.dtypes[name]`, else `default`.
fn input_dtype(inputs: &Value, name: &str, default: DType) -> Result<DType, Mismatch> {
    named_dtype(&inputs["dtypes"][name], &format!("dtypes.{name}"), default)
}

/// The expected outcome of a run: `Ok(())` or the error's kind and message.
struct Expected<'a> {
    kind: Option<&'a str>,
    message: Option<&'a str>,
}

impl<'a> Expected<'a> {
    fn of(value: &'a Value) -> Self {
        Self {
            kind: value["error_kind"].as_str(),
            message: value["expected_error"]["message"].as_str(),
        }
    }

    /// Compares an error with the expected kind and message.
    fn error(&self, mode: &'static str, error: &Error) -> Result<(), Mismatch> {
        let Some(kind) = self.kind else {
            return Err(mismatch_kind(mode, "Ok", error.to_string()));
        };
        expect_eq(mode, "error kind", kind, error.kind())?;
        match self.message {
            Some(message) => expect_eq(mode, "error message", message, &error.to_string()),
            None => Ok(()),
        }
    }

    /// An `Ok` where an error may have been expected.
    fn ok(&self, mode: &'static str) -> Result<(), Mismatch> {
        match self.kind {
            Some(kind) => Err(mismatch_kind(mode, kind, "Ok".into())),
            None => Ok(()),
        }
    }
}

struct AssignCase {
    table: Dense,
    table_dtype: DType,
    inputs: [(Dense, DType); 4],
}

impl AssignCase {
    fn parse(record: &Value) -> Result<Self, Mismatch> {
        let inputs = &record["inputs"];
        let table_dtype = input_dtype(inputs, "req_to_token", DType::I32)?;
        let table =
            Dense::required(&inputs["req_to_token"], "req_to_token")?.fitting(table_dtype)?;
        let input = |name: &str| -> Result<(Dense, DType), Mismatch> {
            let dtype = input_dtype(inputs, name, DType::I64)?;
            let dense = Dense::parse_or_list(&inputs[name], name)?.ok_or_else(|| missing(name))?;
            Ok((dense.fitting(dtype)?, dtype))
        };
        Ok(Self {
            table,
            table_dtype,
            inputs: [
                input("req_pool_indices")?,
                input("start")?,
                input("lengths")?,
                input("out_cache_loc")?,
            ],
        })
    }

    fn tensors<B: KvPlanBackend>(&self, device: &B::Device) -> [IntTensor<B>; 5] {
        let [rpi, start, lengths, loc] = &self.inputs;
        [
            self.table.int::<B>(self.table_dtype, device),
            rpi.0.int::<B>(rpi.1, device),
            start.0.int::<B>(start.1, device),
            lengths.0.int::<B>(lengths.1, device),
            loc.0.int::<B>(loc.1, device),
        ]
    }

    fn deferred<B: KvPlanBackend>(&self, device: &B::Device) -> Result<DeferredAssign<B>, Error> {
        let [table, rpi, start, lengths, loc] = self.tensors::<B>(device);
        generic::segment_assign::<B>(table, rpi, start, lengths, loc)
    }
}

fn assign<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let case = AssignCase::parse(record)?;
    let expected = Expected::of(record);
    let expected_table = int_list(
        &record["expected"]["req_to_token"]["data"],
        "expected.req_to_token.data",
    )?
    .unwrap_or_default();

    // Checked: the deferred call, then its one read-back.
    let mode = "checked";
    let [table, rpi, start, lengths, loc] = case.tensors::<B>(device);
    let checked = generic::segment_assign::<B>(table, rpi, start, lengths, loc)
        .and_then(|assigned| assigned.status.check().map(|_| assigned.req_to_token));
    match checked {
        Ok(table) => {
            expected.ok(mode)?;
            expect_slice(
                mode,
                "req_to_token",
                &expected_table,
                &values::<B>(mode, table)?,
            )?;
        }
        Err(error) => expected.error(mode, &error)?,
    }

    // Deferred: an immediate `Err`, or a status that `check()` turns into one; after a deferred
    // error the table handed back is the input.
    let mode = "deferred";
    let assigned = match case.deferred::<B>(device) {
        Ok(assigned) => assigned,
        Err(error) => return expected.error(mode, &error),
    };
    let table = values::<B>(mode, assigned.req_to_token)?;
    match assigned.status.check() {
        Ok(count) => {
            expected.ok(mode)?;
            expect_eq(mode, "check()", case.inputs[3].0.data.len(), count)?;
            expect_slice(mode, "req_to_token", &expected_table, &table)
        }
        Err(error) => {
            expected.error(mode, &error)?;
            expect_slice(
                mode,
                "req_to_token after an error",
                &case.table.data,
                &table,
            )
        }
    }
}

/// `segment_assign` then `segment_gather` over the same runs gives back `out_cache_loc`; both
/// statuses are read in one `check_all`.
fn assign_gather<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let case = AssignCase::parse(record)?;
    let mode = "assign_gather";
    let failed = |error: Error| mismatch_kind(mode, "Ok", error.to_string());
    let assigned = case.deferred::<B>(device).map_err(failed)?;
    let [_, rpi, start, lengths, _] = case.tensors::<B>(device);
    let gathered = segment_gather::<B>(
        assigned.req_to_token,
        rpi,
        Some(start),
        lengths,
        &GatherOptions::new(),
    )
    .map_err(failed)?;
    let counts = kvplan::check_all([assigned.status, gathered.status]).map_err(failed)?;
    let loc = &case.inputs[3].0.data;
    expect_eq(mode, "slots assigned", loc.len(), counts[0])?;
    expect_eq(mode, "slots gathered", loc.len(), counts[1])?;
    let out = prefix_values::<B>(mode, gathered.out, counts[1])?;
    expect_slice(mode, "gathered", loc, &out)
}

/// A tensor of a record: `{shape, data}` in `dtype`, floats or ints.
struct Rows {
    shape: Vec<usize>,
    data: Vec<f64>,
    dtype: DType,
}

impl Rows {
    /// The tensor of field `field`: its data as long as its shape says, in `dtype`.
    fn parse(value: &Value, field: &str, dtype: DType) -> Result<Self, Mismatch> {
        let shape = shape(&value["shape"], &format!("{field}.shape"))?;
        let data_field = format!("{field}.data");
        let data =
            numbers(&value["data"], &data_field, dtype)?.ok_or_else(|| missing(&data_field))?;
        check_shape(&data_field, &shape, data.len())?;
        Ok(Self { shape, data, dtype })
    }

    /// The host data: the record's values converted to the dtype (exact: the generator only
    /// writes values the dtype holds).
    fn data(&self, values: &[f64]) -> TensorData {
        let data = if self.dtype.is_float() {
            TensorData::new(values.to_vec(), self.shape.clone())
        } else {
            let ints: Vec<i64> = values.iter().map(|&v| v as i64).collect();
            TensorData::new(ints, self.shape.clone())
        };
        data.convert_dtype(self.dtype)
    }

    fn primitive<B: KvPlanBackend>(&self, device: &B::Device) -> KvRows<B> {
        let data = self.data(&self.data);
        if self.dtype.is_float() {
            KvRows::Float(B::float_from_data(data, device))
        } else if self.shape.contains(&0) {
            // CubeCL's CUDA runtime breaks on a zero-byte upload.
            KvRows::Int(B::int_empty(
                self.shape.clone().into(),
                device,
                self.dtype.into(),
            ))
        } else {
            KvRows::Int(B::int_from_data(data, device))
        }
    }
}

/// A list of numbers in `dtype` (`None` when absent): for an int dtype, integers (the generator
/// may write them as `1.0`) that fit it.
fn numbers(value: &Value, field: &str, dtype: DType) -> Result<Option<Vec<f64>>, Mismatch> {
    if !dtype.is_float() {
        let Some(ints) = list_of(value, field, "an integer that fits int64", integral)? else {
            return Ok(None);
        };
        check_dtype(field, &ints, dtype)?;
        return Ok(Some(ints.into_iter().map(|v| v as f64).collect()));
    }
    list_of(value, field, "a number", Value::as_f64)
}

/// An integer, or a float within one ulp of one, within i64: serde_json parses a float only to
/// within an ulp (`-4230317641084226.0` as `-4230317641084225.5`), so the nearest one is taken.
fn integral(value: &Value) -> Option<i64> {
    const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;
    let near = |v: &f64| (v - v.round()).abs() <= f64::EPSILON * v.abs();
    let fits = |v: &f64| (-TWO_POW_63..TWO_POW_63).contains(v);
    let float = value.as_f64().filter(|v| near(v) && fits(v));
    value.as_i64().or_else(|| float.map(|v| v.round() as i64))
}

/// The bytes of a cache, read back.
fn cache_bytes<B: KvPlanBackend>(
    mode: &'static str,
    cache: KvRows<B>,
) -> Result<Vec<u8>, Mismatch> {
    let data = match cache {
        KvRows::Float(tensor) => try_read_sync(B::float_into_data(tensor)),
        KvRows::Int(tensor) => try_read_sync(B::int_into_data(tensor)),
    };
    match data {
        Some(Ok(data)) => Ok(data.bytes().to_vec()),
        other => Err(Mismatch {
            mode,
            field: "read-back".into(),
            index: None,
            expected: "Ok".into(),
            got: format!("{other:?}"),
        }),
    }
}

/// Compares a cache's bytes with the expected values, element by element.
fn expect_cache(
    mode: &'static str,
    field: &str,
    rows: &Rows,
    expected: &[f64],
    got: &[u8],
) -> Result<(), Mismatch> {
    let want = rows.data(expected);
    let want = want.bytes();
    let size = rows.dtype.size().max(1);
    if let Some(at) = (0..want.len().min(got.len()))
        .step_by(size)
        .find(|&at| want[at..at + size] != got[at..(at + size).min(got.len())])
    {
        return Err(Mismatch {
            mode,
            field: field.into(),
            index: Some(at / size),
            expected: format!("{}", expected[at / size]),
            got: format!("bytes {:?}", &got[at..(at + size).min(got.len())]),
        });
    }
    expect_eq(mode, &format!("{field} bytes"), want.len(), got.len())
}

/// One call of a store record.
struct Call<'a> {
    loc: Dense,
    loc_dtype: DType,
    values: Rows,
    /// The whole cache after the call (as before it, after an error).
    cache: Vec<f64>,
    expected: Expected<'a>,
}

fn store<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let inputs = &record["inputs"];
    let dtype = input_dtype(inputs, "cache", DType::F32)?;
    let cache = Rows::parse(&inputs["cache"], "cache", dtype)?;
    let num_slots = super::size(&inputs["num_slots"], "num_slots")?;
    let calls = inputs["calls"]
        .as_array()
        .ok_or_else(|| malformed("calls", "a list of calls", &inputs["calls"]))?
        .iter()
        .enumerate()
        .map(|(k, call)| {
            let field = |name: &str| format!("calls[{k}].{name}");
            let values_dtype = named_dtype(&call["values_dtype"], &field("values_dtype"), dtype)?;
            let loc_dtype = named_dtype(&call["loc_dtype"], &field("loc_dtype"), DType::I64)?;
            let loc = Dense::parse_or_list(&call["loc"], &field("loc"))?
                .ok_or_else(|| missing(field("loc")))?;
            let expected_cache = field("expected.cache");
            let after = numbers(&call["expected"]["cache"], &expected_cache, dtype)?
                .ok_or_else(|| missing(&expected_cache))?;
            check_shape(&expected_cache, &cache.shape, after.len())?;
            Ok(Call {
                loc: loc.fitting(loc_dtype)?,
                loc_dtype,
                values: Rows::parse(&call["values"], &field("values"), values_dtype)?,
                cache: after,
                expected: Expected::of(call),
            })
        })
        .collect::<Result<Vec<Call>, Mismatch>>()?;
    for deferred in [false, true] {
        let mode = if deferred { "deferred" } else { "checked" };
        let mut store = match KvStore::<B>::allocate_on(num_slots, device) {
            Ok(store) => store,
            Err(error) => return Err(mismatch_kind(mode, "a store", error.to_string())),
        };
        let mut current = cache.primitive::<B>(device);
        for (k, call) in calls.iter().enumerate() {
            let loc = call.loc.int::<B>(call.loc_dtype, device);
            let values = call.values.primitive::<B>(device);
            let field = format!("cache after call {k}");
            // A call that must fail is handed a clone (the checked form consumes the cache on
            // `Err`); the rest are handed the cache itself, which is then written in place.
            let failing = call.expected.kind.is_some();
            let kept = failing.then(|| current.clone());
            let outcome = if deferred {
                generic::store::<B>(&mut store, current, loc, values).and_then(|stored| {
                    let checked = stored.status.check();
                    Ok((stored.cache, checked))
                })
            } else {
                let checked = generic::store::<B>(&mut store, current, loc, values)
                    .and_then(|stored| stored.status.check().map(|_| stored.cache));
                match checked {
                    Ok(cache) => Ok((cache, Ok(call.loc.data.len()))),
                    Err(error) => Err(error),
                }
            };
            current = match outcome {
                Ok((cache, Ok(count))) => {
                    call.expected.ok(mode)?;
                    expect_eq(mode, "stored", call.loc.data.len(), count)?;
                    cache
                }
                Ok((cache, Err(error))) => {
                    call.expected.error(mode, &error)?;
                    cache
                }
                Err(error) => {
                    call.expected.error(mode, &error)?;
                    kept.ok_or_else(|| mismatch_kind(mode, "Ok", error.to_string()))?
                }
            };
            let bytes = cache_bytes::<B>(mode, current.clone())?;
            expect_cache(mode, &field, &cache, &call.cache, &bytes)?;
        }
    }
    Ok(())
}
