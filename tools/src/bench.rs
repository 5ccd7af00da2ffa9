//! `kvplan bench`: the shape grids of `shared/anchors/h200.md`, timed through the public API.
//!
//! Per shape and mode it reports the host wall time per call (the caller's view, one read-back
//! per exact/checked call), the pipelined time per call (N calls queued back to back, one sync:
//! the device-bound cost once launches overlap), and the effective bandwidth over the bytes the op
//! must move (inputs read once, outputs written once). Every shape is first checked against the
//! host reference.

use std::time::Instant;

use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Scalar, TensorData};
use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan::backend::{KvBytes, KvRows, StoreTargets};
use kvplan::generic::paged_attention;
use kvplan::generic::{exact, masked_gather, segment_gather};
use kvplan::ops::GatherOptions;
use kvplan::ops::KeyRuns;
use kvplan::ops::KvStore;
use kvplan::ops::{
    Canary, CanaryLaunch, KernelKind, PlanInputs, RealKvHashMode, RealKvSource, SourceBytes,
    StepPlan, VerifyPlan, WriteInputs, WritePlan, read_plans,
};
use kvplan::reference::{self, PlanArgs, PlanBuffers, Table};

use crate::prim;

pub mod extension;

/// Deterministic inputs (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // The project's one splitmix64 step.
        kvplan_decoder::sample::splitmix64(&mut self.0)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}

fn int<B: KvPlanBackend, const D: usize>(
    values: Vec<i64>,
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> IntTensor<B> {
    prim::ints::<B>(&values, &shape, dtype, device)
}

/// The values of an int primitive, or the read-back's error.
fn read<B: KvPlanBackend>(tensor: IntTensor<B>) -> Result<Vec<i64>, String> {
    prim::read_ints::<B>(tensor)
}

fn sync<B: KvPlanBackend>(device: &B::Device) {
    B::sync(device).ok();
}

/// Whether a grid shape is to run: every shape, or the one `KVPLAN_BENCH_SHAPE=BSxW` names
/// (to profile one shape's kernels).
fn selected(bs: usize, width: usize) -> bool {
    std::env::var("KVPLAN_BENCH_SHAPE").map_or(true, |shape| shape == format!("{bs}x{width}"))
}

/// Median of per-call microseconds.
fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(|a, b| a.total_cmp(b));
    samples[samples.len() / 2]
}

/// GPU kernel time recorded since the previous call, `(ns, kernels)`: CUPTI's activity records on
/// CUDA builds (off with `KVPLAN_NO_CUPTI=1`), `None` elsewhere.
#[cfg(feature = "cuda")]
fn take_kernel_time() -> Option<(u64, u64)> {
    use std::sync::OnceLock;
    static TIMER: OnceLock<Option<crate::cupti::KernelTimer>> = OnceLock::new();
    let timer = TIMER.get_or_init(|| {
        if std::env::var_os("KVPLAN_NO_CUPTI").is_some() {
            return None;
        }
        crate::cupti::KernelTimer::start()
            .map_err(|error| eprintln!("no GPU kernel times: {error}"))
            .ok()
    });
    let stats = timer.as_ref()?.take().ok()?;
    let mut driver = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    driver.clear();
    for &(cbid, count, ns) in &stats.per_driver {
        driver.push((timer.as_ref()?.driver_name(cbid), count, ns));
    }
    Some((stats.total_ns, stats.kernels))
}

#[cfg(not(feature = "cuda"))]
fn take_kernel_time() -> Option<(u64, u64)> {
    None
}

/// Per-call timings of one op: host wall (median), pipelined wall, GPU kernel time.
#[derive(Debug, Clone, Copy)]
struct Timing {
    host_us: f64,
    pipelined_us: f64,
    /// Summed kernel time per call and kernels per call, when CUPTI is available.
    gpu: Option<(f64, f64)>,
}

/// Times `call` `reps` times one by one (host wall, median) and `reps` times queued (one sync),
/// recording GPU kernel time over the queued run.
fn time<B: KvPlanBackend>(
    device: &B::Device,
    reps: usize,
    call: impl FnMut() -> Result<(), kvplan::Error>,
) -> Result<(f64, f64), kvplan::Error> {
    timed::<B>(device, reps, call).map(|t| (t.host_us, t.pipelined_us))
}

fn timed<B: KvPlanBackend>(
    device: &B::Device,
    reps: usize,
    mut call: impl FnMut() -> Result<(), kvplan::Error>,
) -> Result<Timing, kvplan::Error> {
    for _ in 0..3 {
        call()?;
    }
    sync::<B>(device);
    let mut host = Vec::with_capacity(reps);
    for _ in 0..reps {
        let start = Instant::now();
        call()?;
        host.push(start.elapsed().as_secs_f64() * 1e6);
    }
    sync::<B>(device);
    take_kernel_time();
    let start = Instant::now();
    for _ in 0..reps {
        call()?;
    }
    sync::<B>(device);
    let pipelined = start.elapsed().as_secs_f64() * 1e6 / reps as f64;
    let gpu = take_kernel_time()
        .map(|(ns, kernels)| (ns as f64 / 1e3 / reps as f64, kernels as f64 / reps as f64));
    Ok(Timing {
        host_us: median(host),
        pipelined_us: pipelined,
        gpu,
    })
}

/// One row of a gather/plan table: GPU kernel time and GB/s over it (over the pipelined wall
/// time when there is no CUPTI), then the host views.
fn row(label: &str, timing: Timing, bytes: f64) {
    let (gpu, kernels, over) = gpu_columns(timing);
    println!(
        "| {label} | {gpu} | {kernels} | {:.0} | {:.1} | {:.1} |",
        bytes / (over * 1e-6) / 1e9,
        timing.host_us,
        timing.pipelined_us
    );
}

/// The GPU us and kernels/call columns, and the time rates are taken over: GPU kernel time, or
/// the pipelined wall time when there is no CUPTI.
fn gpu_columns(timing: Timing) -> (String, String, f64) {
    match timing.gpu {
        Some((us, kernels)) => (format!("{us:.2}"), format!("{kernels:.1}"), us),
        None => ("-".into(), "-".into(), timing.pipelined_us),
    }
}

/// The header of a gather/plan table.
fn header(shape: &str) {
    println!("| {shape} | GPU us/call | kernels/call | GB/s | host us/call | pipelined us/call |");
    println!("|---|---:|---:|---:|---:|---:|");
}

/// The gather grid: masked (exact, deferred) and segments (exact, deferred).
pub fn gather<B: KvPlanBackend>(device: &B::Device, reps: usize) -> Result<(), String> {
    header("shape (bs, W, valid) op/mode");
    for (bs, width) in [
        (1usize, 8usize),
        (64, 16),
        (1024, 64),
        (4096, 128),
        (4096, 2048),
    ] {
        if !selected(bs, width) {
            continue;
        }
        let mut rng = Rng(bs as u64 * 31 + width as u64);
        let rows = 2 * bs.max(64);
        let cols = 8192.max(2 * width);
        let table: Vec<i64> = (0..rows * cols)
            .map(|_| rng.below(1 << 31) as i64)
            .collect();
        let rpi: Vec<i64> = (0..bs).map(|_| rng.below(rows as u64) as i64).collect();
        let lengths: Vec<i64> = (0..bs)
            .map(|_| rng.below(width as u64 + 1) as i64)
            .collect();
        let start: Vec<i64> = lengths
            .iter()
            .map(|&len| rng.below((cols as i64 - len) as u64) as i64)
            .collect();
        let mut pos2d = vec![0i64; bs * width];
        let mut mask = vec![false; bs * width];
        for i in 0..bs {
            for j in 0..width {
                pos2d[i * width + j] = start[i] + j as i64;
                mask[i * width + j] = (j as i64) < lengths[i];
            }
        }
        let valid: i64 = lengths.iter().sum();
        let expected = reference::segment_gather(
            Table::new(rows, cols, &table),
            &rpi,
            Some(&start),
            &lengths,
            None,
        )
        .map_err(|error| error.to_string())?;
        let t = int::<B, 2>(table, [rows, cols], DType::I32, device);
        let q = int::<B, 1>(rpi, [bs], DType::I32, device);
        let p = int::<B, 2>(pos2d, [bs, width], DType::I32, device);
        let m = prim::bools::<B>(&mask, &[bs, width], device);
        let s = int::<B, 1>(start, [bs], DType::I32, device);
        let l = int::<B, 1>(lengths, [bs], DType::I32, device);
        let options = GatherOptions::new().context("bench");
        let masked = |options: &GatherOptions| {
            masked_gather::<B>(t.clone(), q.clone(), p.clone(), m.clone(), options)
        };
        let segments = |options: &GatherOptions| {
            segment_gather::<B>(t.clone(), q.clone(), Some(s.clone()), l.clone(), options)
        };
        let got = read::<B>(
            masked(&options)
                .and_then(exact::<B>)
                .map_err(|error| error.to_string())?,
        )?;
        let got_segments = read::<B>(
            segments(&options)
                .and_then(exact::<B>)
                .map_err(|error| error.to_string())?,
        )?;
        if got != expected || got_segments != expected {
            return Err(format!("gather ({bs}, {width}) differs from the reference"));
        }
        // Bytes: pos2d (i32) + mask (1 B) + rpi read, values written (i64) and read from the table (i32).
        let cells = (bs * width) as f64;
        let masked_bytes = cells * 5.0 + bs as f64 * 4.0 + valid as f64 * 12.0;
        let segment_bytes = bs as f64 * 12.0 + valid as f64 * 12.0;
        let label = |op: &str| format!("({bs}, {width}, {valid}) {op}");
        let run = |f: &mut dyn FnMut() -> Result<(), kvplan::Error>| timed::<B>(device, reps, f);
        let b = GatherOptions::new().context("b");
        let timing =
            run(&mut || masked(&b).and_then(exact::<B>).map(drop)).map_err(|e| e.to_string())?;
        row(&label("masked exact"), timing, masked_bytes);
        let timing = run(&mut || masked(&b).map(drop)).map_err(|e| e.to_string())?;
        row(&label("masked deferred"), timing, masked_bytes);
        let timing = run(&mut || {
            segments(&GatherOptions::new())
                .and_then(exact::<B>)
                .map(drop)
        })
        .map_err(|e| e.to_string())?;
        row(&label("segments exact"), timing, segment_bytes);
        let by_valid = GatherOptions::new().capacity(valid as usize);
        let timing = run(&mut || segments(&by_valid).map(drop)).map_err(|e| e.to_string())?;
        row(&label("segments deferred"), timing, segment_bytes);
    }
    Ok(())
}

/// The plan grid: FULL and SWA (window 1024, LUT), with and without the expected-token pool.
pub fn plan<B: KvPlanBackend>(device: &B::Device, reps: usize) -> Result<(), String> {
    header("shape (bs, L, mode, entries)");
    let grid = [
        (1usize, 512usize, false),
        (8, 4096, false),
        (64, 4096, false),
        (256, 4096, true),
        (1024, 4096, false),
        (4096, 512, false),
        (4096, 4096, false),
        (4096, 32768, true),
    ];
    for (bs, max_prefix, swa) in grid {
        if !selected(bs, max_prefix) {
            continue;
        }
        for pool in [false, true] {
            let mut rng = Rng(bs as u64 * 7 + max_prefix as u64 + u64::from(pool));
            let rows = bs + 1;
            let cols = max_prefix + 1;
            let slots = rows * cols;
            let table: Vec<i64> = (0..slots).map(|_| rng.below(slots as u64) as i64).collect();
            let rpi: Vec<i64> = (1..=bs as i64).collect();
            let prefix: Vec<i64> = (0..bs)
                .map(|_| rng.below(max_prefix as u64 + 1) as i64)
                .collect();
            let extend = vec![1i64; bs];
            let window = if swa { 1024 } else { 0 };
            let lut: Vec<i64> = (0..slots).map(|_| rng.below(slots as u64) as i64).collect();
            let pool_values: Vec<i64> = (0..slots).map(|_| rng.below(1 << 31) as i64).collect();
            let valid_lens: Vec<i64> = prefix.iter().map(|&p| p - rng.below(4) as i64).collect();
            let args = PlanArgs {
                req_pool_indices: &rpi,
                prefix_lens: &prefix,
                extend_seq_lens: &extend,
                req_to_token: Table::new(rows, cols, &table),
                swa_window_size: window,
                full_to_swa: swa.then_some(&lut[..]),
                expected_tokens: pool.then(|| reference::ExpectedTokens {
                    pool: Table::new(rows, cols, &pool_values),
                    valid_lens: &valid_lens,
                }),
                position_offset: 0,
            };
            let entries: usize = prefix
                .iter()
                .map(|&p| if swa { p.min(window as i64) } else { p } as usize)
                .sum();
            // A capacity for any batch of this shape lets the plan run as one launch; an exact
            // one needs the count launch first.
            let longest = if swa { cols.min(window as usize) } else { cols };
            let one_launch = (bs * longest).max(1);
            let counted = entries.max(1);
            let mut want = PlanBuffers::fresh(one_launch, bs);
            reference::plan(&args, &mut want).map_err(|error| error.to_string())?;
            let t = int::<B, 2>(table, [rows, cols], DType::I32, device);
            let q = int::<B, 1>(rpi, [bs], DType::I32, device);
            let p = int::<B, 1>(prefix, [bs], DType::I32, device);
            let e = int::<B, 1>(extend, [bs], DType::I32, device);
            let lut_t = int::<B, 1>(lut, [slots], DType::I32, device);
            let pool_t = int::<B, 2>(pool_values, [rows, cols], DType::I32, device);
            let lens_t = int::<B, 1>(valid_lens, [bs], DType::I32, device);
            let inputs = || {
                let mut inputs =
                    PlanInputs::<B>::from_primitives(q.clone(), p.clone(), e.clone(), t.clone());
                if swa {
                    inputs = inputs
                        .swa_window_size(window)
                        .full_to_swa_index_mapping_primitive(lut_t.clone());
                }
                if pool {
                    inputs = inputs.expected_tokens_primitive(pool_t.clone(), lens_t.clone());
                }
                inputs
            };
            // Bytes: 4 i64 fields per entry written, 2 table reads (+ LUT, + pool) per entry.
            let per_entry = 32.0 + 8.0 + if swa { 8.0 } else { 0.0 } + if pool { 4.0 } else { 0.0 };
            let bytes = entries as f64 * per_entry + bs as f64 * 28.0;
            let mode = format!(
                "{}{}",
                if swa { "SWA" } else { "FULL" },
                if pool { "+pool" } else { "" }
            );
            let label = format!("({bs}, {max_prefix}, {mode}, {entries})");
            for (capacity, launches) in [(one_launch, "V any batch"), (counted, "V exact")] {
                let mut step =
                    StepPlan::<B>::allocate_on(capacity, bs, device).map_err(|e| e.to_string())?;
                kvplan::ops::plan(&mut step, inputs())
                    .and_then(|status| status.check().map(drop))
                    .map_err(|e| e.to_string())?;
                let got = read_plans(&step).map_err(|e| e.to_string())?;
                if got.verify_slot_indices[..entries] != want.verify_slot_indices[..entries]
                    || got.verify_prev_slot_indices[..entries]
                        != want.verify_prev_slot_indices[..entries]
                    || got.verify_expected_tokens[..entries]
                        != want.verify_expected_tokens[..entries]
                    || got.write_offsets != want.write_offsets
                {
                    return Err(format!(
                        "plan ({bs}, {max_prefix}, {launches}) differs from the reference"
                    ));
                }
                let timing = timed::<B>(device, reps, || {
                    kvplan::ops::plan(&mut step, inputs()).map(drop)
                })
                .map_err(|e| e.to_string())?;
                row(&format!("{label} {launches}, deferred"), timing, bytes);
                let (h, _) = time::<B>(device, reps, || {
                    kvplan::ops::plan(&mut step, inputs())
                        .and_then(|status| status.check().map(drop))
                })
                .map_err(|e| e.to_string())?;
                println!("| {label} {launches}, checked | - | - | - | {h:.1} | - |");
            }
        }
    }
    Ok(())
}

/// One canary table row: GPU us and the throughput over it (pipelined wall when no CUPTI).
fn canary_row(label: &str, timing: Timing, bytes: f64, tokens: f64) {
    let (gpu, kernels, over) = gpu_columns(timing);
    let rate = if bytes > 0.0 {
        format!("{:.0} GB/s", bytes / (over * 1e-6) / 1e9)
    } else {
        format!("{:.1} Mtok/s", tokens / (over * 1e-6) / 1e6)
    };
    println!(
        "| {label} | {gpu} | {kernels} | {rate} | {:.1} | {:.1} |",
        timing.host_us, timing.pipelined_us
    );
}

/// A canary workload: requests of consecutive tokens whose slots are scattered at random over
/// twice as many slots (a fragmented allocator), and an optional real-KV source of 256 bytes per
/// token (page 1).
struct CanaryWorkload<B: KvPlanBackend> {
    canary: Canary<B>,
    source: Option<RealKvSource<B>>,
    /// Slots of every request, in order.
    requests: Vec<Vec<i64>>,
}

fn canary_workload<B: KvPlanBackend>(
    device: &B::Device,
    requests: usize,
    tokens_per_request: usize,
    fingerprints: bool,
) -> Result<CanaryWorkload<B>, String> {
    let tokens = requests * tokens_per_request;
    let num_slots = 2 * tokens + 1;
    let mut rng = Rng(tokens as u64 ^ 0xCA7A);
    let mut slots: Vec<i64> = (1..num_slots as i64).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let requests = slots[..tokens]
        .chunks(tokens_per_request)
        .map(<[i64]>::to_vec)
        .collect();
    let canary =
        Canary::<B>::allocate_on(num_slots, 32, 1024, device).map_err(|e| e.to_string())?;
    let source = if fingerprints {
        let words: Vec<i64> = (0..num_slots * 32).map(|_| rng.next() as i64).collect();
        let kv = int::<B, 2>(words, [num_slots, 32], DType::I64, device);
        Some(
            RealKvSource::from_primitive(KvBytes::Int(kv), SourceBytes::per_slot(256))
                .map_err(|e| e.to_string())?,
        )
    } else {
        None
    };
    Ok(CanaryWorkload {
        canary,
        source,
        requests,
    })
}

impl<B: KvPlanBackend> CanaryWorkload<B> {
    fn launch(&self, kind: i32) -> CanaryLaunch<B> {
        let launch = CanaryLaunch::new(KernelKind(kind));
        match &self.source {
            Some(source) => launch.real_kv(RealKvHashMode::All, vec![source.clone()]),
            None => launch,
        }
    }

    /// The write step of `tokens` tokens per request starting at `first` (seeded from the slot
    /// before it, or a chain head).
    fn write_step(
        &self,
        device: &B::Device,
        first: usize,
        tokens: usize,
    ) -> Result<(WritePlan<B>, WriteInputs<B>), String> {
        let mut offsets = vec![0i64];
        let (mut seeds, mut ids, mut positions, mut slots) = (vec![], vec![], vec![], vec![]);
        for (r, request) in self.requests.iter().enumerate() {
            seeds.push(if first == 0 { -1 } else { request[first - 1] });
            for position in first..first + tokens {
                ids.push((r * 7919 + position) as i64);
                positions.push(position as i64);
                slots.push(request[position]);
            }
            offsets.push(slots.len() as i64);
        }
        let count = self.requests.len();
        let plan = WritePlan::from_primitives(
            int::<B, 1>(offsets, [count + 1], DType::I64, device),
            int::<B, 1>(seeds, [count], DType::I64, device),
            int::<B, 1>(vec![count as i64], [1], DType::I32, device),
        )
        .map_err(|e| e.to_string())?;
        let len = slots.len();
        let inputs = WriteInputs::from_primitives(
            int::<B, 1>(ids, [len], DType::I64, device),
            int::<B, 1>(positions, [len], DType::I64, device),
            int::<B, 1>(slots, [len], DType::I64, device),
        )
        .chain_position_assert_primitive(int::<B, 1>(vec![1], [1], DType::I32, device));
        Ok((plan, inputs))
    }

    /// The verify plan of every written token, each chained to its predecessor.
    fn verify_plan(&self, device: &B::Device) -> Result<VerifyPlan<B>, String> {
        let (mut slots, mut tokens, mut positions, mut prev) = (vec![], vec![], vec![], vec![]);
        for (r, request) in self.requests.iter().enumerate() {
            for (position, &slot) in request.iter().enumerate() {
                slots.push(slot);
                tokens.push((r * 7919 + position) as i64);
                positions.push(position as i64);
                prev.push(if position == 0 {
                    -1
                } else {
                    request[position - 1]
                });
            }
        }
        let len = slots.len();
        let list = |values: Vec<i64>| int::<B, 1>(values, [len], DType::I64, device);
        VerifyPlan::from_primitives(
            list(slots),
            list(tokens),
            list(positions),
            list(prev),
            int::<B, 1>(vec![len as i64], [1], DType::I32, device),
            int::<B, 1>(vec![1], [1], DType::I32, device),
        )
        .map_err(|e| e.to_string())
    }
}

/// The canary grid of `shared/anchors/h200.md`: verify over 1M and 16M entries, decode and
/// prefill writes, each in mode NONE and ALL (one 256-byte source). Every shape is checked
/// clean (write then verify reports nothing) before it is timed.
pub fn canary<B: KvPlanBackend>(
    device: &B::Device,
    reps: usize,
    large: bool,
) -> Result<(), String> {
    println!(
        "| op, shape, mode | GPU us/call | kernels/call | throughput | host us/call | pipelined us/call |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    let e = |error: kvplan::Error| error.to_string();
    for fingerprints in [false, true] {
        let mode = if fingerprints { "ALL" } else { "NONE" };
        // Verify: ~2k-token requests.
        let sizes: &[usize] = if large {
            &[1 << 20, 1 << 24]
        } else {
            &[1 << 12]
        };
        for &entries in sizes.iter().filter(|&&entries| selected(entries, 1)) {
            let mut work = canary_workload::<B>(device, entries / 2048, 2048, fingerprints)?;
            let (plan, inputs) = work.write_step(device, 0, 2048)?;
            work.canary
                .write(&plan, inputs, &work.launch(0))
                .map_err(e)?;
            let verify = work.verify_plan(device)?;
            let launch = work.launch(1);
            work.canary.verify(&verify, &launch).map_err(e)?;
            let found = work.canary.violations().map_err(e)?.recorded;
            if found != 0 {
                return Err(format!(
                    "verify {entries} {mode}: {found} violations on a clean canary"
                ));
            }
            let timing =
                timed::<B>(device, reps, || work.canary.verify(&verify, &launch)).map_err(e)?;
            let bytes = entries as f64 * (88.0 + if fingerprints { 256.0 } else { 0.0 });
            canary_row(
                &format!("verify, {entries} entries, {mode}"),
                timing,
                bytes,
                0.0,
            );
        }
        // Writes: decode steps continue prefilled chains; prefills start chains.
        let shapes: &[(usize, usize, &str)] = if large {
            &[
                (256, 1, "decode"),
                (1024, 1, "decode"),
                (32, 2048, "prefill"),
                (1, 32768, "prefill"),
            ]
        } else {
            &[(256, 1, "decode"), (4, 512, "prefill")]
        };
        for &(requests, tokens, kind) in shapes
            .iter()
            .filter(|&&(requests, tokens, _)| selected(requests, tokens))
        {
            let prefix = if kind == "decode" { 64 } else { 0 };
            let mut work = canary_workload::<B>(device, requests, prefix + tokens, fingerprints)?;
            if prefix > 0 {
                let (plan, inputs) = work.write_step(device, 0, prefix)?;
                work.canary
                    .write(&plan, inputs, &work.launch(0))
                    .map_err(e)?;
            }
            let (plan, inputs) = work.write_step(device, prefix, tokens)?;
            let launch = work.launch(0);
            work.canary
                .write(&plan, inputs.clone(), &launch)
                .map_err(e)?;
            let verify = work.verify_plan(device)?;
            work.canary.verify(&verify, &work.launch(1)).map_err(e)?;
            let found = work.canary.violations().map_err(e)?.recorded;
            if found != 0 {
                return Err(format!(
                    "write {requests}x{tokens} {mode}: {found} violations"
                ));
            }
            let timing = timed::<B>(device, reps, || {
                work.canary.write(&plan, inputs.clone(), &launch)
            })
            .map_err(e)?;
            let label = format!("write {kind}, {requests} x {tokens} tokens, {mode}");
            canary_row(&label, timing, 0.0, (requests * tokens) as f64);
        }
    }
    Ok(())
}

/// A plain Burn launch, per op: `y = x + 1; m = max(y); x = y - m` (a chain fusion cannot merge,
/// as `shared/probes/burn-dispatch` times it), its timing divided by its three ops.
fn plain_launch<B: KvPlanBackend>(
    device: &B::Device,
    reps: usize,
) -> Result<Timing, kvplan::Error> {
    let mut x = int::<B, 1>((0..1024).collect(), [1024], DType::I64, device);
    let chain = timed::<B>(device, reps, || {
        let y = B::int_add_scalar(x.clone(), Scalar::new(1i64, &DType::I64));
        let top = B::int_max(y.clone());
        x = B::int_sub(y, top);
        Ok(())
    })?;
    Ok(Timing {
        host_us: chain.host_us / 3.0,
        pipelined_us: chain.pipelined_us / 3.0,
        gpu: None,
    })
}

/// Host us per call of `call` and the read-back of the int tensor it returns (median).
fn read_back_us<B: KvPlanBackend>(
    device: &B::Device,
    reps: usize,
    mut call: impl FnMut() -> IntTensor<B>,
) -> Result<f64, kvplan::Error> {
    let (host_us, _) = time::<B>(device, reps, || {
        read::<B>(call())
            .map(drop)
            .map_err(|detail| kvplan::Error::Execution { detail })
    })?;
    Ok(host_us)
}

/// The host cost of every op against a plain Burn launch, by one harness (issue 23's gate), at
/// a decode step's size (bs 64): each deferred form queued N times with one sync (`pipelined`),
/// against a launch fusion cannot merge (`y = x + 1; m = max(y); x = y - m`, per op, as
/// `shared/probes/burn-dispatch` times it); each exact or checked form's host time per call
/// against a plain op plus the read-back of its `[4]` result.
pub fn host<B: KvPlanBackend>(device: &B::Device, reps: usize) -> Result<(), String> {
    let e = |error: kvplan::Error| error.to_string();
    let (bs, width, rows, cols) = (64usize, 16usize, 128usize, 8192usize);
    let mut rng = Rng(5);
    let table: Vec<i64> = (0..rows * cols)
        .map(|_| 1 + rng.below(1 << 20) as i64)
        .collect();
    let rpi: Vec<i64> = (1..=bs as i64).collect();
    let pos2d: Vec<i64> = (0..bs * width)
        .map(|_| rng.below(cols as u64) as i64)
        .collect();
    let mask: Vec<bool> = (0..bs * width).map(|_| rng.below(2) == 1).collect();
    let lengths: Vec<i64> = (0..bs)
        .map(|_| 1 + rng.below(width as u64) as i64)
        .collect();
    let prefix: Vec<i64> = (0..bs).map(|_| rng.below(512) as i64).collect();
    let t = int::<B, 2>(table, [rows, cols], DType::I32, device);
    let q = int::<B, 1>(rpi, [bs], DType::I32, device);
    let p = int::<B, 2>(pos2d, [bs, width], DType::I32, device);
    let m = prim::bools::<B>(&mask, &[bs, width], device);
    let lens = int::<B, 1>(lengths, [bs], DType::I32, device);
    let prefix_t = int::<B, 1>(prefix.clone(), [bs], DType::I32, device);
    let starts = prefix_t.clone();
    let ones = int::<B, 1>(vec![1; bs], [bs], DType::I32, device);

    // The baselines: a launch that cannot fuse, and a plain op with its read-back.
    let launch_us = plain_launch::<B>(device, reps).map_err(e)?.pipelined_us;
    let small = int::<B, 1>(vec![0; 4], [4], DType::I64, device);
    let read_us = read_back_us::<B>(device, reps, || {
        B::int_add_scalar(small.clone(), Scalar::new(1i64, &DType::I64))
    })
    .map_err(e)?;

    let options = GatherOptions::new().context("host");
    let masked = || masked_gather::<B>(t.clone(), q.clone(), p.clone(), m.clone(), &options);
    let segments = || {
        segment_gather::<B>(
            t.clone(),
            q.clone(),
            Some(starts.clone()),
            lens.clone(),
            &GatherOptions::new(),
        )
    };
    let mut step = StepPlan::<B>::allocate_on(bs * 512, bs, device).map_err(e)?;
    let plan_inputs =
        || PlanInputs::<B>::from_primitives(q.clone(), prefix_t.clone(), ones.clone(), t.clone());
    let work = canary_workload::<B>(device, bs, 65, false)?;
    let (write_plan, write_inputs) = work.write_step(device, 64, 1)?;
    let verify_plan = work.verify_plan(device)?;
    let (write_launch, verify_launch) = (work.launch(0), work.launch(1));
    let mut canary = work.canary;
    // segment_assign and the store hand back the table and cache they consumed.
    let new_slots: Vec<i64> = (0..bs as i64 * 4).map(|k| 1 + k).collect();
    let loc = int::<B, 1>(new_slots, [bs * 4], DType::I64, device);
    let four = int::<B, 1>(vec![4; bs], [bs], DType::I32, device);
    let mut assigned_table = Some(int::<B, 2>(
        vec![0; rows * cols],
        [rows, cols],
        DType::I32,
        device,
    ));
    let kv_width = 192usize;
    let zeros = vec![0f32; 1024 * kv_width];
    let mut cache = Some(KvRows::Float(B::float_from_data(
        TensorData::new(zeros, [1024, kv_width]),
        device,
    )));
    let k_rows: Vec<f32> = (0..bs * 4 * kv_width).map(|k| k as f32).collect();
    let k_rows = KvRows::Float(B::float_from_data(
        TensorData::new(k_rows, [bs * 4, kv_width]),
        device,
    ));
    let mut store = KvStore::<B>::allocate_on(1024, device).map_err(e)?;
    let mut assign = |checked: bool| -> Result<(), kvplan::Error> {
        let table = assigned_table.take().expect("the table is handed back");
        let assigned = kvplan::generic::segment_assign::<B>(
            table,
            q.clone(),
            starts.clone(),
            four.clone(),
            loc.clone(),
        )?;
        assigned_table = Some(assigned.req_to_token);
        if checked {
            assigned.status.check()?;
        }
        Ok(())
    };
    let mut stores = |checked: bool| -> Result<(), kvplan::Error> {
        let rows = cache.take().expect("the cache is handed back");
        let stored = kvplan::generic::store::<B>(&mut store, rows, loc.clone(), k_rows.clone())?;
        cache = Some(stored.cache);
        if checked {
            stored.status.check()?;
        }
        Ok(())
    };

    println!(
        "plain launch (add, max, sub; per op): {launch_us:.1} us pipelined; plain op + read-back of [4]: {read_us:.1} us"
    );
    println!(
        "| op (bs 64) | pipelined us/call | x plain launch | exact host us/call | exact - (op + read-back) us |"
    );
    println!("|---|---:|---:|---:|---:|");
    let report = |label: &str, deferred: Timing, exact: Option<f64>| {
        let exact = exact.map_or(("-".to_string(), "-".to_string()), |us| {
            (format!("{us:.1}"), format!("{:+.1}", us - read_us))
        });
        println!(
            "| {label} | {:.1} | {:.2} | {} | {} |",
            deferred.pipelined_us,
            deferred.pipelined_us / launch_us,
            exact.0,
            exact.1
        );
        driver_report(reps);
    };
    // Each exact form first, then the deferred one: the driver calls printed after a row are
    // the deferred loop's.
    let exact_us = time::<B>(device, reps, || masked().and_then(exact::<B>).map(drop));
    let deferred = timed::<B>(device, reps, || masked().map(drop)).map_err(e)?;
    report(
        "masked gather (64, 16)",
        deferred,
        Some(exact_us.map_err(e)?.0),
    );
    let exact_us = time::<B>(device, reps, || segments().and_then(exact::<B>).map(drop));
    let deferred = timed::<B>(device, reps, || segments().map(drop)).map_err(e)?;
    report(
        "segment gather (64 x 1-16)",
        deferred,
        Some(exact_us.map_err(e)?.0),
    );
    let exact_us = time::<B>(device, reps, || {
        kvplan::ops::plan(&mut step, plan_inputs()).and_then(|status| status.check().map(drop))
    });
    let deferred = timed::<B>(device, reps, || {
        kvplan::ops::plan(&mut step, plan_inputs()).map(drop)
    })
    .map_err(e)?;
    report(
        "plan (64 requests, prefix < 512)",
        deferred,
        Some(exact_us.map_err(e)?.0),
    );
    let deferred = timed::<B>(device, reps, || {
        canary.write(&write_plan, write_inputs.clone(), &write_launch)
    })
    .map_err(e)?;
    report("canary write (64 x 1 token)", deferred, None);
    let deferred =
        timed::<B>(device, reps, || canary.verify(&verify_plan, &verify_launch)).map_err(e)?;
    report("canary verify (64 x 65 entries)", deferred, None);
    let exact_us = time::<B>(device, reps, || assign(true));
    let deferred = timed::<B>(device, reps, || assign(false)).map_err(e)?;
    report(
        "segment_assign (64 x 4 slots)",
        deferred,
        Some(exact_us.map_err(e)?.0),
    );
    let exact_us = time::<B>(device, reps, || stores(true));
    let deferred = timed::<B>(device, reps, || stores(false)).map_err(e)?;
    report(
        "store (256 rows of 192 f32)",
        deferred,
        Some(exact_us.map_err(e)?.0),
    );
    // A model's store: the slots checked once a step, then one launch per layer for K and V.
    let mut slots = store.check_slot_primitives(loc.clone(), 1024).map_err(e)?;
    let mut pools = Some(StoreTargets::Pair(
        cache.take().expect("the cache is handed back"),
        KvRows::Float(B::float_from_data(
            TensorData::new(vec![0f32; 1024 * kv_width], [1024, kv_width]),
            device,
        )),
    ));
    let pair = StoreTargets::Pair(k_rows.clone(), k_rows.clone());
    let deferred = timed::<B>(device, reps, || {
        let caches = pools.take().expect("the pools are handed back");
        pools = Some(slots.store_primitives(caches, pair.clone())?);
        Ok(())
    })
    .map_err(e)?;
    report("store K and V, slots checked (256 rows)", deferred, None);
    // A layer's attention (9 query heads over 3 K/V heads of 64), alone and with its store in
    // the same launch: the difference is what the store adds to the attention's launch.
    let tokens = bs * 4;
    let q = B::float_from_data(
        TensorData::new(vec![0.5f32; tokens * 576], [tokens, 576]),
        device,
    );
    let run_starts: Vec<i64> = (0..tokens as i64)
        .map(|t| t % (tokens as i64 - 16))
        .collect();
    let keys = KeyRuns::<B>::check_primitives(
        [
            loc.clone(),
            int::<B, 1>(run_starts, [tokens], DType::I32, device),
            int::<B, 1>(vec![16; tokens], [tokens], DType::I32, device),
        ],
        1024,
    )
    .map_err(e)?;
    let float_pools = |pools: StoreTargets<B>| match pools {
        StoreTargets::Pair(KvRows::Float(k), KvRows::Float(v)) => (k, v),
        _ => unreachable!("float pools"),
    };
    let (k_pool, v_pool) = float_pools(pools.take().expect("the pools are handed back"));
    let KvRows::Float(k_rows) = k_rows else {
        unreachable!("float rows")
    };
    // A layer's K and V in one joined pool, its queries, keys and values in one tensor.
    let mut kv_pool = Some(B::float_cat(vec![k_pool, v_pool], 1));
    let qkv = B::float_cat(vec![q.clone(), k_rows.clone(), k_rows.clone()], 1);
    let deferred = timed::<B>(device, reps, || {
        let pool = kv_pool.clone().expect("the pool is handed back");
        paged_attention::<B>(q.clone(), pool, &keys, 9).map(drop)
    })
    .map_err(e)?;
    report("paged attention (256 tokens x 16 keys)", deferred, None);
    let deferred = timed::<B>(device, reps, || {
        let pool = kv_pool.take().expect("the pool is handed back");
        let attended = slots.store_and_attend_primitives([pool, qkv.clone()], &keys, 9)?;
        kv_pool = Some(attended.kv_pool);
        Ok(())
    })
    .map_err(e)?;
    report("store K and V + attention, one launch", deferred, None);
    slots.status().check().map_err(e)?;
    keys.status().check().map_err(e)?;

    // Part of every op's host time: each output is a tensor whose last drop is one more
    // operation for Burn (on Fusion a registered `Drop`); the ops' rows drop all their outputs.
    let mut last = (0..reps)
        .map(|_| B::int_add_scalar(small.clone(), Scalar::new(1i64, &DType::I64)))
        .collect::<Vec<_>>();
    sync::<B>(device);
    let start = Instant::now();
    while let Some(tensor) = last.pop() {
        drop(tensor);
    }
    sync::<B>(device);
    println!(
        "drop of a tensor's last reference: {:.1} us pipelined",
        start.elapsed().as_secs_f64() * 1e6 / reps as f64
    );
    Ok(())
}

/// The CubeCL CUDA client's own costs, below Burn: a blocking round trip to its server thread
/// (`memory_report`) after the thread has been idle for a while (it spins, then yields, then
/// sleeps in 150 us steps), a 64-byte read of a finished buffer, an upload, and a sync.
#[cfg(feature = "cuda")]
pub fn cuda_client(reps: usize) -> Result<(), String> {
    use burn_core::backend::read_sync;
    use cubecl::MemoryScope;
    let client = cubecl::Device::Cuda(Default::default()).client();
    let buffer = client.create_from_slice(&[7u8; 64]);
    let read = || {
        let descriptor = cubecl::server::CopyDescriptor::new(
            buffer.clone().binding(),
            [8].into(),
            [1].into(),
            8,
        );
        read_sync(client.read_one_tensor_async(descriptor)).map(drop)
    };
    let round_trip = || drop(client.memory_report(MemoryScope::Device));
    let probes: [(&str, &dyn Fn()); 4] = [
        ("client round trip (memory_report)", &round_trip),
        ("read 64 B of a finished buffer", &|| read().expect("read")),
        ("upload 64 B", &|| {
            drop(client.create_from_slice(&[1u8; 64]))
        }),
        ("client sync", &|| read_sync(client.sync()).expect("sync")),
    ];
    // How long the client's server thread takes to answer after it has been idle for `idle` us.
    for idle in [0u64, 10, 20, 40, 80, 160, 320, 640, 1280] {
        let mut samples = Vec::with_capacity(reps);
        for _ in 0..reps {
            let until = Instant::now() + std::time::Duration::from_micros(idle);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            let start = Instant::now();
            round_trip();
            samples.push(start.elapsed().as_secs_f64() * 1e6);
        }
        samples.sort_by(|a, b| a.total_cmp(b));
        println!(
            "| cubecl: round trip after {idle} us idle | {:.1} (p90 {:.1}) | - |",
            samples[reps / 2],
            samples[reps * 9 / 10]
        );
    }
    for (label, probe) in probes {
        let mut samples = Vec::with_capacity(reps);
        for _ in 0..reps + 3 {
            let start = Instant::now();
            probe();
            samples.push(start.elapsed().as_secs_f64() * 1e6);
        }
        println!(
            "| cubecl: {label} | {:.1} | - |",
            median(samples.split_off(3))
        );
    }
    Ok(())
}

/// Driver API calls of the last timed loop, `(name, calls, total ns)`, when CUPTI records them
/// (`KVPLAN_CUPTI_DRIVER=1`).
static DRIVER: std::sync::Mutex<Vec<(String, u64, u64)>> = std::sync::Mutex::new(Vec::new());

/// Prints the driver API calls of the last timed loop (per call of the op), largest first.
fn driver_report(reps: usize) {
    let mut driver = DRIVER.lock().unwrap_or_else(|e| e.into_inner());
    driver.sort_by_key(|d| std::cmp::Reverse(d.2));
    for (name, count, ns) in driver.drain(..) {
        println!(
            "|   {name}: {:.1} per call, {:.2} us each | | |",
            count as f64 / reps as f64,
            ns as f64 / 1e3 / count as f64
        );
    }
}
