//! `index_range` end to end. A device without 64-bit indexing refuses a launch that spans more
//! elements than its 32-bit indexes reach: on a real device that takes a tensor past 2^31
//! elements. `KVPLAN_NARROW_DEVICE=N` makes every device act as one whose 32-bit span is `N`
//! elements, so that small inputs reach the refusal. It is read once per process, so the checks
//! run in a child process of this test binary.
//!
//! The 0.22 backend ops are infallible: a refused launch always comes back in the op's status
//! record (gathers and plans: `Status::check`; the canary: `Canary::check` and every read), fused
//! or not. The unfused backend no longer refuses at the call.

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::DType;
use kvplan::error::Site;
use kvplan::ops::{
    Canary, CanaryLaunch, KernelKind, PlanInputs, StepPlan, VerifyPlan, WriteInputs, WritePlan,
};
use kvplan::{Error, KvPlanBackend};

use crate::common::{bools, ints, list, values};
use crate::gather::{masked, masked_deferred, segments};

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

#[track_caller]
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

    index_range(masked::<B>(wide(), l(&[1]), pos(), mask()), "masked exact");
    // The op is only enqueued: the refusal comes from the status.
    let deferred = masked_deferred::<B>(wide(), l(&[1]), pos(), mask(), None)
        .expect("host rules pass: the refusal is the launch's");
    index_range(deferred.status.check(), "masked capacity");
    index_range(
        segments::<B>(wide(), l(&[1]), Some(l(&[2])), l(&[3])),
        "segments exact",
    );
    let got: IntTensor<B> =
        masked::<B>(small(), l(&[1]), pos(), mask()).expect("a table within the span");
    assert_eq!(values::<B>(got), vec![32, 34], "masked within the span");

    let mut plans = StepPlan::<B>::allocate_on(64, 4, device).unwrap();
    let inputs = |table: IntTensor<B>, rows: &[i64]| {
        PlanInputs::<B>::from_primitives(l(rows), l(&[3, 3]), l(&[1, 1]), table)
    };
    index_range(
        kvplan::ops::plan(&mut plans, inputs(wide(), &[1, 1]))
            .and_then(|status| status.check().map(drop)),
        "plan checked",
    );
    let status = kvplan::ops::plan(&mut plans, inputs(wide(), &[1, 1]))
        .expect("host rules pass: the refusal is the launch's");
    index_range(status.check(), "plan deferred");
    assert_eq!(
        values::<B>(plans.verify.enable()),
        vec![0],
        "a refused plan is disabled"
    );
    // Request 1's row is outside the small table (2 rows): the error names request 1.
    let error = kvplan::ops::plan(&mut plans, inputs(small(), &[1, 5]))
        .and_then(|status| status.check().map(drop))
        .unwrap_err();
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
    kvplan::ops::plan(&mut plans, inputs(small(), &[1, 1]))
        .and_then(|status| status.check().map(drop))
        .expect("a plan within the span");
    assert_eq!(values::<B>(plans.verify.num_valid()), vec![6]);
    canary_checks::<B>(&plans.verify, &plans.write, device);
    crate::slots::narrow_checks::<B>(device, SPAN);
    crate::attention::narrow_checks::<B>(device, SPAN);
}

/// A canary whose records span more than 32-bit indexes reach: its write and verify are accepted
/// (host rules pass) and refused with `index_range` by the canary's next check or read, which
/// reports it until `clear`; the refused op leaves a zeroed canary.
fn canary_checks<B: KvPlanBackend>(
    verify: &VerifyPlan<B>,
    write: &WritePlan<B>,
    device: &B::Device,
) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let tokens = || WriteInputs::<B>::from_primitives(l(&[5, 6]), l(&[3, 3]), l(&[10, 11]));
    let launch = |kind: i32| CanaryLaunch::<B>::new(KernelKind(kind));
    // 4 words per slot: SPAN slots span 4 x SPAN words.
    let mut canary = Canary::<B>::allocate_on(SPAN, 32, 4, device).unwrap();
    canary
        .write(write, tokens(), &launch(0))
        .expect("host rules pass: the refusal is the launch's");
    // Every read reports the failure until `clear`.
    index_range(canary.check(), "canary write, check");
    index_range(canary.violations(), "canary write, violations");
    index_range(canary.state(), "canary write, state");
    canary.clear();
    let state = canary.state().expect("cleared");
    assert!(state.buffer.iter().all(|&word| word == 0), "zeroed records");
    canary
        .verify(verify, &launch(1))
        .expect("host rules pass: the refusal is the launch's");
    index_range(canary.check(), "canary verify");
    canary.clear();
    assert_eq!(canary.violations().expect("cleared").recorded, 0);

    // A canary within the span runs, and its reads are clean.
    let mut canary = Canary::<B>::allocate_on(16, 32, 4, device).unwrap();
    canary
        .write(write, tokens(), &launch(0))
        .expect("a write within the span");
    canary.verify(verify, &launch(1)).unwrap();
    canary.check().expect("no failure");
    assert_eq!(canary.state().unwrap().buffer[10 * 4], 5, "slot 10's token");
}
