//! The conformance runner behind `kvplan check`: runs the public vectors (`tests/data/*.jsonl`)
//! through kvplan's public primitive-level API on one backend and compares each record as its
//! `policy` says.

mod canary;
mod gather;
mod plan;
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
        let (id, outcome) = match serde_json::from_str::<Value>(line) {
            Ok(record) => {
                let id = record["id"].as_str().unwrap_or("?").to_string();
                (id, check_record::<B>(&record, device))
            }
            Err(error) => (format!("line {}", line_no + 1), Err(parse_error(error))),
        };
        match outcome {
            Ok(()) => report.passed += 1,
            Err(mismatch) => report.failures.push((id, mismatch)),
        }
    }
    report
}

fn parse_error(error: impl fmt::Display) -> Mismatch {
    Mismatch {
        mode: "parse",
        field: "record".into(),
        index: None,
        expected: "a valid record".into(),
        got: error.to_string(),
    }
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
        other => Err(parse_error(format!("unknown op {other:?}"))),
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

/// An i64 list of a record (`null` or absent is `None`).
fn int_list(value: &Value) -> Option<Vec<i64>> {
    value.as_array().map(|items| {
        items
            .iter()
            .map(|item| item.as_i64().unwrap_or(0))
            .collect()
    })
}

/// A tensor description of a record: `{rows, cols, data}` or `{shape, data}`.
struct Dense {
    shape: Vec<usize>,
    data: Vec<i64>,
}

impl Dense {
    fn parse(value: &Value) -> Option<Dense> {
        let data = int_list(&value["data"])?;
        let shape = match value.get("shape") {
            Some(shape) => int_list(shape)?.into_iter().map(|d| d as usize).collect(),
            None => vec![
                value["rows"].as_u64()? as usize,
                value["cols"].as_u64()? as usize,
            ],
        };
        Some(Dense { shape, data })
    }

    fn list(values: Vec<i64>) -> Dense {
        Dense {
            shape: vec![values.len()],
            data: values,
        }
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

fn mismatch_kind(mode: &'static str, expected: &str, got: String) -> Mismatch {
    Mismatch {
        mode,
        field: "error kind".into(),
        index: None,
        expected: expected.into(),
        got,
    }
}
