//! `index_range` end to end. A device without 64-bit indexing refuses a launch that spans more
//! elements than its 32-bit indexes reach: on a real device that takes a tensor past 2^31
//! elements. `KVPLAN_NARROW_DEVICE=N` makes every device act as one whose 32-bit span is `N`
//! elements, so that small inputs reach the refusal. It is read once per process, so the checks
//! run in a child process of this test binary.

use burn_tensor::{DType, Int, Tensor};
use kvplan::canary::{Canary, CanaryLaunch, WriteInputs};
use kvplan::error::{Error, Site};
use kvplan::{KvPlanBackend, PlanInputs, VerifyPlan, WritePlan};

use crate::common::{bools, ints, list};

/// The child's 32-bit span, in elements.
pub const SPAN: usize = 4096;

/// Whether this process is the child (the narrow device is in force).
pub fn in_child() -> bool {
    std::env::var_os("KVPLAN_NARROW_DEVICE").is_some()
}

/// Runs the test named `test` of this binary again, alone, in a child with the narrow device.
pub fn run_in_child(test: &str) {
    let exe = std::env::current_exe().expect("the test binary");
    let output = std::process::Command::new(exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env("KVPLAN_NARROW_DEVICE", SPAN.to_string())
        .output()
        .expect("the child test process");
    let log = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{test} in the child failed:\n{log}"
    );
    // The filter must have matched: a child that ran nothing would pass silently.
    assert!(
        log.contains("1 passed"),
        "{test} did not run in the child:\n{log}"
    );
}

fn index_range(result: Result<impl Sized, Error>, what: &str) {
    match result {
        Err(Error::IndexRange { elements, limit }) => {
            assert_eq!(limit, SPAN as u64, "{what}: limit");
            assert!(elements > SPAN as u64, "{what}: {elements} elements");
        }
        Err(other) => panic!("{what}: expected index_range, got {other}"),
        Ok(_) => panic!("{what}: expected index_range, got a result"),
    }
}

/// Every gather and plan form over a table of 2 x 4,096 values is refused with `index_range`
/// (exact results, capacity and deferred statuses); inputs within the span still run; and a plan
/// refused this way leaves fresh plans behind, which a later plan's device-checked error proves
/// (its facts name the right request only if the plan's scratch is fresh).
pub fn checks<B: KvPlanBackend>(device: &B::Device) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let wide = || ints::<B, 2>(&vec![7; 2 * SPAN], [2, SPAN], DType::I32, device);
    let small = || ints::<B, 2>(&(0..64).collect::<Vec<_>>(), [2, 32], DType::I32, device);
    let pos = || ints::<B, 2>(&[0, 1, 2], [1, 3], DType::I64, device);
    let mask = || bools::<B, 2>(&[true, false, true], [1, 3], device);

    index_range(
        kvplan::masked_gather(wide(), l(&[1]), pos(), mask(), "narrow"),
        "masked exact",
    );
    // The refusal comes at the call where the launch is made there and then (unfused), or from
    // the status later (fused: the launch runs when the stream is flushed).
    index_range(
        kvplan::masked_gather_with_capacity(wide(), l(&[1]), pos(), mask(), None, "n")
            .and_then(|gather| gather.status.check()),
        "masked capacity",
    );
    index_range(
        kvplan::segment_gather(wide(), l(&[1]), Some(l(&[2])), l(&[3])),
        "segments exact",
    );
    let got: Tensor<B, 1, Int> = kvplan::masked_gather(small(), l(&[1]), pos(), mask(), "narrow")
        .expect("a table within the span");
    assert_eq!(
        crate::common::values(got),
        vec![32, 34],
        "masked within the span"
    );

    let mut verify = VerifyPlan::<B>::allocate(64, device).unwrap();
    let mut write = WritePlan::<B>::allocate(4, device).unwrap();
    let inputs = |table: Tensor<B, 2, Int>, rows: &[i64]| {
        PlanInputs::new(l(rows), l(&[3, 3]), l(&[1, 1]), table)
    };
    index_range(
        kvplan::plan(&mut verify, &mut write, inputs(wide(), &[1, 1])),
        "plan checked",
    );
    index_range(
        kvplan::plan_deferred(&mut verify, &mut write, inputs(wide(), &[1, 1]))
            .and_then(|status| status.check()),
        "plan deferred",
    );
    assert_eq!(
        crate::common::values(verify.enable()),
        vec![0],
        "a refused plan is disabled"
    );
    // Request 1's row is outside the small table (2 rows): the error names request 1.
    let error = kvplan::plan(&mut verify, &mut write, inputs(small(), &[1, 5])).unwrap_err();
    assert!(
        matches!(
            error,
            Error::ReqPoolIndexOutOfRange {
                site: Site::Request(1),
                value: 5,
                rows: 2,
                ..
            }
        ),
        "the error names request 1: {error}"
    );
    kvplan::plan(&mut verify, &mut write, inputs(small(), &[1, 1]))
        .expect("a plan within the span");
    assert_eq!(crate::common::values(verify.num_valid()), vec![6]);
    canary_checks::<B>(&verify, &write, device);
}

/// A canary whose records span more than 32-bit indexes reach: its write and verify are refused
/// with `index_range`, by the op itself (unfused) or by the canary's next read (fused: the op ran
/// lazily), which reports it until `clear`; the refused op leaves a zeroed canary either way.
fn canary_checks<B: KvPlanBackend>(
    verify: &VerifyPlan<B>,
    write: &WritePlan<B>,
    device: &B::Device,
) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let tokens = || WriteInputs::new(l(&[5, 6]), l(&[3, 3]), l(&[10, 11]));
    // 4 words per slot: SPAN slots span 4 x SPAN words.
    let mut canary = Canary::<B>::allocate(SPAN, 32, 4, device).unwrap();
    match canary.write(write, tokens(), &CanaryLaunch::new(0)) {
        Err(error) => index_range(Err::<(), _>(error), "canary write"),
        // Fused: every read reports the failure until `clear`.
        Ok(()) => {
            index_range(canary.violations(), "fused canary write, violations");
            index_range(canary.state(), "fused canary write, state");
        }
    }
    canary.clear();
    let state = canary.state().expect("cleared");
    assert!(state.buffer.iter().all(|&word| word == 0), "zeroed records");
    index_range(
        canary
            .verify(verify, &CanaryLaunch::new(1))
            .and_then(|()| canary.check()),
        "canary verify",
    );
    canary.clear();
    assert_eq!(canary.violations().expect("cleared").recorded, 0);

    // A canary within the span runs, and its reads are clean.
    let mut canary = Canary::<B>::allocate(16, 32, 4, device).unwrap();
    canary
        .write(write, tokens(), &CanaryLaunch::new(0))
        .expect("a write within the span");
    canary.verify(verify, &CanaryLaunch::new(1)).unwrap();
    canary.check().expect("no failure");
    assert_eq!(canary.state().unwrap().buffer[10 * 4], 5, "slot 10's token");
}
