//! The conformance runner behind `kvplan check`: runs the public vectors (`tests/data/*.jsonl`)
//! through kvplan's public primitive-level API on one backend and compares each record as its
//! `policy` says.

pub(crate) mod canary;
mod gather;
pub(crate) mod plan;
mod slots;
pub mod slots_data;

use std::fmt;

use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use serde_json::Value;

use crate::prim;

/// Why one record failed: the field, the first differing index, expected vs got.
#[derive(Debug, Clone)]
pub struct Mismatch {
    /// Which run of the record (`exact`, `capacity`, `checked`, `deferred`).
    pub mode: &'static str,
    /// The field compared.
    pub field: String,
    /// First differing index, for arrays.
    pub index: Option<usize>,
    /// What the record expects.
    pub expected: String,
    /// What the library produced.
    pub got: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.mode, self.field)?;
        if let Some(index) = self.index {
            write!(f, "[{index}]")?;
        }
        write!(f, ": expected {}, got {}", self.expected, self.got)
    }
}

/// The outcome of a file: passed count and one line per failing record.
#[derive(Debug, Default)]
pub struct Report {
    /// Records that matched.
    pub passed: usize,
    /// `(id, mismatch)` of every record that did not.
    pub failures: Vec<(String, Mismatch)>,
}

impl Report {
    /// `N passed, M failed`.
    pub fn summary(&self) -> String {
        format!("{} passed, {} failed", self.passed, self.failures.len())
    }
}

/// Runs every record of a JSON Lines conformance file (plan, gather, canary or slot records).
pub fn check_file<B: KvPlanBackend>(text: &str, device: &B::Device) -> Report {
    let mut report = Report::default();
    for (line_no, line) in text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
    {
        let line_id = || format!("line {}", line_no + 1);
        let (id, outcome) = match serde_json::from_str::<Value>(line) {
            Ok(record) => {
                let id = record["id"].as_str().map_or_else(line_id, str::to_string);
                (id, check_record::<B>(&record, device))
            }
            Err(error) => (line_id(), Err(parse_error(error))),
        };
        match outcome {
            Ok(()) => report.passed += 1,
            Err(mismatch) => report.failures.push((id, mismatch)),
        }
    }
    report
}

/// A line that is not one JSON record.
fn parse_error(error: impl fmt::Display) -> Mismatch {
    malformed("record", "a valid record", error)
}

/// A field of a record that does not hold what it must.
fn malformed(
    field: impl Into<String>,
    expected: impl Into<String>,
    got: impl fmt::Display,
) -> Mismatch {
    Mismatch {
        mode: "parse",
        field: field.into(),
        index: None,
        expected: expected.into(),
        got: got.to_string(),
    }
}

/// A field the record must have.
fn missing(field: impl Into<String>) -> Mismatch {
    malformed(field, "a value", "none")
}

/// A field that must name one of `names`.
fn unknown(field: &str, names: &str, got: Option<&str>) -> Mismatch {
    malformed(field, format!("one of {names}"), format!("{got:?}"))
}

/// Runs one record.
pub fn check_record<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    if record.get("steps").is_some() {
        return canary::check::<B>(record, device);
    }
    match record["op"].as_str() {
        Some("plan") | Some("allocate") => plan::check::<B>(record, device),
        Some("masked") | Some("segments") => gather::check::<B>(record, device),
        Some("segment_assign") | Some("assign_gather") | Some("store_kv") => {
            slots::check::<B>(record, device)
        }
        other => Err(unknown(
            "op",
            "plan, allocate, masked, segments, segment_assign, assign_gather, store_kv",
            other,
        )),
    }
}

/// Compares two values; `Err` names the field.
fn expect_eq<T: PartialEq + fmt::Debug>(
    mode: &'static str,
    field: &str,
    expected: T,
    got: T,
) -> Result<(), Mismatch> {
    if expected == got {
        return Ok(());
    }
    Err(Mismatch {
        mode,
        field: field.into(),
        index: None,
        expected: format!("{expected:?}"),
        got: format!("{got:?}"),
    })
}

/// Compares two arrays; `Err` names the first differing index (or the length).
fn expect_slice(
    mode: &'static str,
    field: &str,
    expected: &[i64],
    got: &[i64],
) -> Result<(), Mismatch> {
    if let Some(index) = expected.iter().zip(got).position(|(e, g)| e != g) {
        return Err(Mismatch {
            mode,
            field: field.into(),
            index: Some(index),
            expected: expected[index].to_string(),
            got: got[index].to_string(),
        });
    }
    expect_eq(mode, &format!("{field} length"), expected.len(), got.len())
}

/// An i64 list of a record (`null` or absent is `None`); anything but a list of integers that
/// fit i64 is malformed.
fn int_list(value: &Value, field: &str) -> Result<Option<Vec<i64>>, Mismatch> {
    list_of(value, field, "an integer that fits int64", Value::as_i64)
}

/// A list of `item`s of a record (`null` or absent is `None`); an item `item` refuses is
/// malformed, named by its index and `what` it must be.
fn list_of<T>(
    value: &Value,
    field: &str,
    what: &str,
    item: impl Fn(&Value) -> Option<T>,
) -> Result<Option<Vec<T>>, Mismatch> {
    if value.is_null() {
        return Ok(None);
    }
    let items = (value.as_array()).ok_or_else(|| malformed(field, "a list", value))?;
    let each = |(index, value): (usize, &Value)| {
        item(value).ok_or_else(|| Mismatch {
            index: Some(index),
            ..malformed(field, what, value)
        })
    };
    items
        .iter()
        .enumerate()
        .map(each)
        .collect::<Result<_, _>>()
        .map(Some)
}

/// An i64 list the record must have.
fn required_list(value: &Value, field: &str) -> Result<Vec<i64>, Mismatch> {
    int_list(value, field)?.ok_or_else(|| missing(field))
}

/// A size or count the record must have: a non-negative integer.
fn size(value: &Value, field: &str) -> Result<usize, Mismatch> {
    let size = value.as_u64().and_then(|size| usize::try_from(size).ok());
    size.ok_or_else(|| match value {
        Value::Null => missing(field),
        _ => malformed(field, "a non-negative integer", value),
    })
}

/// A shape the record must have: a list of sizes.
fn shape(value: &Value, field: &str) -> Result<Vec<usize>, Mismatch> {
    let dims = value.as_array().ok_or_else(|| match value {
        Value::Null => missing(field),
        _ => malformed(field, "a list of sizes", value),
    })?;
    dims.iter().map(|dim| size(dim, field)).collect()
}

/// An optional integer of a record, within `i32` (the dtype of the field it fills); absent is
/// `default`.
fn i32_field(value: &Value, field: &str, default: i32) -> Result<i32, Mismatch> {
    if value.is_null() {
        return Ok(default);
    }
    let fits = value.as_i64().and_then(|v| i32::try_from(v).ok());
    fits.ok_or_else(|| malformed(field, "an integer that fits int32", value))
}

/// Whether `value` fits `dtype` (int dtypes; any value fits the others).
fn fits(dtype: DType, value: i64) -> bool {
    let (min, max): (i64, i64) = match dtype {
        DType::I32 => (i32::MIN.into(), i32::MAX.into()),
        DType::I16 => (i16::MIN.into(), i16::MAX.into()),
        DType::I8 => (i8::MIN.into(), i8::MAX.into()),
        DType::U32 => (0, u32::MAX.into()),
        DType::U16 => (0, u16::MAX.into()),
        DType::U8 => (0, u8::MAX.into()),
        DType::U64 => (0, i64::MAX),
        _ => (i64::MIN, i64::MAX),
    };
    (min..=max).contains(&value)
}

/// The first of `values` that does not fit `dtype`, as a mismatch of `field`.
fn check_dtype(field: &str, values: &[i64], dtype: DType) -> Result<(), Mismatch> {
    match values.iter().position(|&value| !fits(dtype, value)) {
        Some(index) => Err(Mismatch {
            index: Some(index),
            ..malformed(field, format!("a value that fits {dtype:?}"), values[index])
        }),
        None => Ok(()),
    }
}

/// Whether `len` values fill `shape`; otherwise the mismatch of the data's field.
fn check_shape(field: &str, shape: &[usize], len: usize) -> Result<(), Mismatch> {
    let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if elements == Some(len) {
        return Ok(());
    }
    let want = elements.map_or_else(|| "an overflowing count of".into(), |n| n.to_string());
    Err(malformed(
        field,
        format!("{want} values (shape {shape:?})"),
        format!("{len} values"),
    ))
}

/// A tensor description of a record: `{rows, cols, data}` or `{shape, data}`, its data as long
/// as its shape says.
struct Dense {
    field: String,
    shape: Vec<usize>,
    data: Vec<i64>,
}

impl Dense {
    /// The tensor of field `field`; `None` when absent.
    fn parse(value: &Value, field: &str) -> Result<Option<Dense>, Mismatch> {
        if value.is_null() {
            return Ok(None);
        }
        if !value.is_object() {
            return Err(malformed(
                field,
                "{shape, data} or {rows, cols, data}",
                value,
            ));
        }
        let data = required_list(&value["data"], &format!("{field}.data"))?;
        let shape = match value.get("shape") {
            Some(dims) => shape(dims, &format!("{field}.shape"))?,
            None => vec![
                size(&value["rows"], &format!("{field}.rows"))?,
                size(&value["cols"], &format!("{field}.cols"))?,
            ],
        };
        check_shape(&format!("{field}.data"), &shape, data.len())?;
        Ok(Some(Dense {
            field: field.to_string(),
            shape,
            data,
        }))
    }

    /// The tensor of field `field`, which the record must have.
    fn required(value: &Value, field: &str) -> Result<Dense, Mismatch> {
        Self::parse(value, field)?.ok_or_else(|| missing(field))
    }

    /// A tensor, or a plain list (a 1-D tensor), of field `field`; `None` when absent.
    fn parse_or_list(value: &Value, field: &str) -> Result<Option<Dense>, Mismatch> {
        match value.is_array() {
            true => Ok(int_list(value, field)?.map(|values| Dense::list(field, values))),
            false => Self::parse(value, field),
        }
    }

    fn list(field: &str, values: Vec<i64>) -> Dense {
        Dense {
            field: field.to_string(),
            shape: vec![values.len()],
            data: values,
        }
    }

    /// The tensor itself when every value fits `dtype` (its upload would panic otherwise).
    fn fitting(self, dtype: DType) -> Result<Dense, Mismatch> {
        check_dtype(&self.field, &self.data, dtype)?;
        Ok(self)
    }

    fn int<B: KvPlanBackend>(&self, dtype: DType, device: &B::Device) -> IntTensor<B> {
        prim::ints::<B>(&self.data, &self.shape, dtype, device)
    }

    fn bool<B: KvPlanBackend>(&self, device: &B::Device) -> BoolTensor<B> {
        let values: Vec<bool> = self.data.iter().map(|&v| v != 0).collect();
        prim::bools::<B>(&values, &self.shape, device)
    }
}

/// The i64 values of an int primitive; a failed read-back is a mismatch of `mode`.
fn values<B: KvPlanBackend>(
    mode: &'static str,
    tensor: IntTensor<B>,
) -> Result<Vec<i64>, Mismatch> {
    prim::read_ints::<B>(tensor).map_err(|error| Mismatch {
        mode,
        field: "read-back".into(),
        index: None,
        expected: "Ok".into(),
        got: error,
    })
}

/// The first `len` values of a deferred output (its tail was never written).
fn prefix_values<B: KvPlanBackend>(
    mode: &'static str,
    tensor: IntTensor<B>,
    len: usize,
) -> Result<Vec<i64>, Mismatch> {
    prim::read_prefix::<B>(tensor, len).map_err(|error| Mismatch {
        mode,
        field: "read-back".into(),
        index: None,
        expected: "Ok".into(),
        got: error,
    })
}

fn mismatch_kind(mode: &'static str, expected: &str, got: String) -> Mismatch {
    Mismatch {
        mode,
        field: "error kind".into(),
        index: None,
        expected: expected.into(),
        got,
    }
}
