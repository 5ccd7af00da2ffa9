//! The public conformance vectors (`tests/data/*.jsonl`) through `kvplan_tools::conformance`.

use kvplan::KvPlanBackend;
use kvplan_tools::conformance::{Report, check_file};

use crate::common::conformance_file;

#[track_caller]
pub fn assert_clean(name: &str, report: &Report, records: usize) {
    let failures: Vec<String> = report
        .failures
        .iter()
        .map(|(id, mismatch)| format!("  {id}: {mismatch}"))
        .collect();
    assert!(
        failures.is_empty(),
        "{name}: {}\n{}",
        report.summary(),
        failures.join("\n")
    );
    assert_eq!(report.passed, records, "{name}: record count");
}

pub fn gather_file<B: KvPlanBackend>(device: &B::Device) {
    let text = conformance_file("gather.jsonl");
    assert_eq!(
        text.lines().filter(|line| !line.trim().is_empty()).count(),
        49,
        "gather.jsonl records"
    );
    assert_clean("gather.jsonl", &check_file::<B>(&text, device), 49);
}

pub fn plan_file<B: KvPlanBackend>(device: &B::Device) {
    let text = conformance_file("plan.jsonl");
    assert_eq!(
        text.lines().filter(|line| !line.trim().is_empty()).count(),
        164,
        "plan.jsonl records"
    );
    assert_clean("plan.jsonl", &check_file::<B>(&text, device), 164);
}
