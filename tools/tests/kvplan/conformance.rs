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

/// One record per kind of malformation, each with the line `kvplan check` prints for it; the
/// first record is well formed.
pub fn malformed_records() -> (String, Vec<&'static str>) {
    let good = conformance_file("gather.jsonl");
    let good = good.lines().next().expect("a gather record");
    let table = r#""req_to_token":{"rows":1,"cols":2,"data":[5,6]}"#;
    let masked = |id: &str, inputs: &str| {
        format!(
            r#"{{"id":"{id}","op":"masked","inputs":{{{inputs},"context":""}},"expected":{{"out":[]}}}}"#
        )
    };
    let lines = [
        good.to_string(),
        r#"{"id":"bad-json","op":"#.to_string(),
        "[1, 2]".to_string(),
        r#"{"id":"unknown-op","op":"frobnicate"}"#.to_string(),
        masked("missing-table", r#""req_pool_indices":[0],"pos2d":{"shape":[1,1],"data":[0]},"mask":{"shape":[1,1],"data":[1]}"#),
        masked("short-table", r#""req_to_token":{"rows":2,"cols":3,"data":[1,2,3,4,5]},"req_pool_indices":[0]"#),
        masked("table-past-int32", r#""req_to_token":{"rows":1,"cols":2,"data":[5,2147483648]},"req_pool_indices":[0]"#),
        masked("fractional-index", &format!(r#"{table},"req_pool_indices":[0.5]"#)),
        masked("index-not-a-list", &format!(r#"{table},"req_pool_indices":"zero""#)),
        masked("negative-dim", &format!(r#"{table},"req_pool_indices":[0],"pos2d":{{"shape":[1,-1],"data":[]}}"#)),
        format!(
            r#"{{"id":"window-past-int32","op":"plan","inputs":{{{table},"verify_capacity":4,"write_req_capacity":1,"swa_window_size":4294967296,"req_pool_indices":[0],"prefix_lens":[0],"extend_seq_lens":[0]}}}}"#
        ),
        r#"{"id":"allocate-negative","op":"allocate","inputs":{"allocate":"VerifyPlan","verify_capacity":-1}}"#.to_string(),
        format!(
            r#"{{"id":"bad-dtype","op":"segment_assign","inputs":{{{table},"req_pool_indices":[0],"start":[0],"lengths":[1],"out_cache_loc":[7],"dtypes":{{"lengths":"int4"}}}}}}"#
        ),
        r#"{"id":"short-values","op":"store_kv","inputs":{"cache":{"shape":[2,2],"data":[0,0,0,0]},"num_slots":2,"calls":[{"loc":[1],"values":{"shape":[1,2],"data":[1.5]},"expected":{"cache":[0,0,1.5,0]}}]}}"#.to_string(),
        r#"{"id":"int8-values","op":"store_kv","inputs":{"cache":{"shape":[2,1],"data":[0,0]},"dtypes":{"cache":"int8"},"num_slots":2,"calls":[{"loc":[1],"values":{"shape":[1,1],"data":[300]},"expected":{"cache":[0,44]}}]}}"#.to_string(),
        r#"{"id":"huge-canary","init":{"slot_stride_bytes":32,"num_slots":1099511627776,"write_index":0,"slot_run_counter":0,"kernel_run_counter":0},"steps":[]}"#.to_string(),
        r#"{"id":"bad-hex","init":{"slot_stride_bytes":32,"num_slots":1,"write_index":0,"slot_run_counter":0,"kernel_run_counter":0,"sources":[{"flat_hex":"é0","page_size":1,"num_bytes_per_token":16,"read_bytes":16}]},"steps":[]}"#.to_string(),
        r#"{"id":"steps-not-a-list","init":{"slot_stride_bytes":32,"num_slots":1,"write_index":0,"slot_run_counter":0,"kernel_run_counter":0},"steps":3}"#.to_string(),
    ];
    let expected = vec![
        "line 2 [parse] record: expected a valid record, got EOF while parsing a value at line 1 column 22",
        "line 3 [parse] op: expected one of plan, allocate, masked, segments, segment_assign, assign_gather, store_kv, got None",
        "unknown-op [parse] op: expected one of plan, allocate, masked, segments, segment_assign, assign_gather, store_kv, got Some(\"frobnicate\")",
        "missing-table [parse] req_to_token: expected a value, got none",
        "short-table [parse] req_to_token.data: expected 6 values (shape [2, 3]), got 5 values",
        "table-past-int32 [parse] req_to_token[1]: expected a value that fits I32, got 2147483648",
        "fractional-index [parse] req_pool_indices[0]: expected an integer that fits int64, got 0.5",
        "index-not-a-list [parse] req_pool_indices: expected a list, got \"zero\"",
        "negative-dim [parse] pos2d.shape: expected a non-negative integer, got -1",
        "window-past-int32 [parse] swa_window_size: expected an integer that fits int32, got 4294967296",
        "allocate-negative [parse] verify_capacity: expected a non-negative integer, got -1",
        "bad-dtype [parse] dtypes.lengths: expected one of int64, int32, int16, int8, uint8, float32, float16, bfloat16, got \"int4\"",
        "short-values [parse] calls[0].values.data: expected 2 values (shape [1, 2]), got 1 values",
        "int8-values [parse] calls[0].values.data[0]: expected a value that fits I8, got 300",
        "huge-canary [parse] init.num_slots: expected at most 16777216 canary words (num_slots x slot_stride_bytes / 8), got 1099511627776",
        "bad-hex [parse] init.sources[0].flat_hex: expected an even number of hex digits, got \"é0\"",
        "steps-not-a-list [parse] steps: expected a list of steps, got 3",
    ];
    (lines.join("\n"), expected)
}

/// `FAIL` lines as `kvplan check` prints them, without the prefix.
fn failure_lines(report: &Report) -> Vec<String> {
    let line = |(id, mismatch): &(String, _)| format!("{id} {mismatch}");
    report.failures.iter().map(line).collect()
}

/// Every malformed record fails with a line naming it and its field; the run goes on.
pub fn malformed_file<B: KvPlanBackend>(device: &B::Device) {
    let (text, expected) = malformed_records();
    let report = check_file::<B>(&text, device);
    assert_eq!(failure_lines(&report), expected);
    assert_eq!(
        report.summary(),
        format!("1 passed, {} failed", expected.len())
    );
}

/// Runs the `kvplan` binary: exit code, stdout, stderr.
fn kvplan(args: &[&str]) -> (Option<i32>, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_kvplan"))
        .args(args)
        .output()
        .expect("the kvplan binary runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (
        output.status.code(),
        text(&output.stdout),
        text(&output.stderr),
    )
}

/// The binary on bad input: `kvplan check` prints a line per malformed record and its count and
/// exits 1; a missing file, a folder, bad flags and a bad chart table are one line and exit 2.
/// Nothing panics.
pub fn binary_bad_input() {
    let dir = std::env::temp_dir().join(format!("kvplan-bad-input-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a scratch folder");
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (text, expected) = malformed_records();
    std::fs::write(path("malformed.jsonl"), text).expect("the malformed file");
    std::fs::write(path("bad.csv"), "op,sglang_us,kvplan_us\ngather,1.5,-2\n").expect("a csv");

    let (code, stdout, stderr) = kvplan(&["check", &path("malformed.jsonl")]);
    let failed: Vec<&str> = stdout
        .lines()
        .filter_map(|line| line.strip_prefix("FAIL "))
        .collect();
    assert_eq!(failed, expected, "stdout:\n{stdout}");
    let summary = format!("1 passed, {} failed", expected.len());
    assert!(
        stdout.lines().any(|line| line == summary),
        "stdout:\n{stdout}"
    );
    assert_eq!((code, stderr.as_str()), (Some(1), ""));

    for (args, message) in [
        (vec!["check", &path("absent.jsonl")], "kvplan: cannot read "),
        (vec!["check", &path("")], "kvplan: cannot read "),
        (vec!["check"], "kvplan: unexpected arguments [\"check\"]"),
        (
            vec!["bench", "gather", "--reps", "0"],
            "kvplan: --reps needs a positive number",
        ),
        (
            vec!["bench", "gather", "--reps"],
            "kvplan: --reps needs a positive number",
        ),
        (
            vec!["bench", "gather", "--backend", "tpu"],
            "kvplan: unknown backend \"tpu\"",
        ),
        (
            vec!["bench", "nothing"],
            "kvplan: unknown bench \"nothing\"",
        ),
        (vec!["demo", "--backend"], "kvplan: --backend needs a name"),
        (
            vec!["demo", "again"],
            "kvplan: unexpected arguments [\"demo\", \"again\"]",
        ),
        (
            vec!["chart", &path("bad.csv"), &path("out.png")],
            "is not a positive number",
        ),
        (
            vec!["chart", &path("absent.csv"), &path("out.png")],
            "kvplan: cannot read ",
        ),
    ] {
        let (code, _, stderr) = kvplan(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
