//! `PagedKv` through the `Tensor` API: a step's values against the reference attention and the
//! stores' exact bytes, every error path (nothing changes after one), random request sequences
//! against a host model of the allocator and table, and the canary's faults attributed.

use std::collections::HashMap;

use burn_core::tensor::{DType, Device, Int, Tensor, TensorData};
use kvplan::ops::FailReasons;
use kvplan::reference::{Heads, paged_attention};
use kvplan::{CanaryConfig, Error, PagedKv, PagedKvConfig, RequestId, StepInputs};

use crate::common::Rng;

/// Values the pools hold where nothing was stored (checked untouched).
const POISON: f32 = 7.0;

fn config() -> PagedKvConfig {
    PagedKvConfig {
        layers: 2,
        query_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        slots: 40,
        max_requests: 3,
        max_context: 24,
        dtype: DType::F32,
        canary: Some(CanaryConfig::default()),
    }
}

/// A `PagedKv` whose pools hold `POISON` everywhere.
fn poisoned(config: PagedKvConfig, device: &Device) -> PagedKv {
    let mut kv = PagedKv::new(config.clone(), device).expect("a valid config");
    for layer in 0..config.layers {
        let shape = [config.slots + 1, config.kv_width()];
        let pool = Tensor::<2>::full(shape, POISON, (device, config.dtype));
        kv.set_pool(layer, pool).expect("the pool's own shape");
    }
    kv
}

fn floats(tensor: Tensor<2>) -> Vec<f32> {
    tensor
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .expect("f32 values")
}

fn table(kv: &PagedKv) -> Vec<i64> {
    kvplan::backend::data_to_i64(&kv.req_to_token().into_data())
}

/// The host's view of what each slot of each layer holds (K|V rows last stored there).
struct HostPools {
    rows: Vec<HashMap<i64, Vec<f32>>>,
}

/// One step through the object with random `qkv` per layer: every output against the reference
/// attention over the host's pools, and the host's pools updated.
fn step(
    kv: &mut PagedKv,
    host: &mut HostPools,
    rng: &mut Rng,
    windows: &[(RequestId, usize)],
    device: &Device,
) -> Vec<Vec<i64>> {
    let config = kv.config().clone();
    let starts: Vec<usize> = windows.iter().map(|&(id, _)| kv.len(id).unwrap()).collect();
    let ids: Vec<Vec<u32>> = windows
        .iter()
        .map(|&(_, window)| (0..window).map(|_| rng.below(50_000) as u32).collect())
        .collect();
    let begun: Vec<(RequestId, &[u32])> = windows
        .iter()
        .zip(&ids)
        .map(|(&(id, _), ids)| (id, ids.as_slice()))
        .collect();
    let inputs = kv.begin(&begun).expect("a valid step");
    let tokens: usize = windows.iter().map(|w| w.1).sum();
    assert_eq!(inputs.tokens, tokens);
    let want_ids: Vec<i64> = ids.iter().flatten().map(|&id| i64::from(id)).collect();
    assert_eq!(
        kvplan::backend::data_to_i64(&inputs.ids.into_data()),
        want_ids,
        "ids"
    );
    let positions = kvplan::backend::data_to_i64(&inputs.positions.into_data());
    let expected: Vec<i64> = windows
        .iter()
        .zip(&starts)
        .flat_map(|(&(_, window), &start)| (start..start + window).map(|p| p as i64))
        .collect();
    assert_eq!(positions, expected, "positions");
    // The window's slots, read from the table the step wrote.
    let t = table(kv);
    let cols = config.max_context;
    let contexts: Vec<Vec<i64>> = windows
        .iter()
        .zip(&starts)
        .map(|(&(id, window), &start)| {
            let row = kv.row(id).unwrap() as usize;
            t[row * cols..][..start + window].to_vec()
        })
        .collect();
    let (q_cols, kv_cols) = (config.query_heads * config.head_dim, config.kv_width());
    for layer in 0..config.layers {
        let values: Vec<f32> = (0..tokens * config.qkv_width())
            .map(|_| rng.range(-1000, 1000) as f32 / 500.0)
            .collect();
        // As the pools' dtype holds them (the host's pools and reference see the same values).
        let data =
            TensorData::new(values, [tokens, config.qkv_width()]).convert_dtype(config.dtype);
        let values = data.clone().convert::<f32>().try_to_vec::<f32>().unwrap();
        let qkv = Tensor::<2>::from_data(data, (device, config.dtype));
        let out = floats(kv.attend(layer, qkv).expect("a valid layer"));
        // The host's stores, then the reference over them.
        let mut token = 0;
        for ((_, window), (context, &start)) in windows.iter().zip(contexts.iter().zip(&starts)) {
            for j in 0..*window {
                let row = &values[(token + j) * config.qkv_width()..][..config.qkv_width()];
                host.rows[layer].insert(context[start + j], row[q_cols..].to_vec());
            }
            token += window;
        }
        let pool_rows = config.slots + 1;
        let mut k_pool = vec![POISON as f64; pool_rows * kv_cols / 2];
        let mut v_pool = k_pool.clone();
        for (&slot, row) in &host.rows[layer] {
            for c in 0..kv_cols / 2 {
                k_pool[slot as usize * kv_cols / 2 + c] = row[c] as f64;
                v_pool[slot as usize * kv_cols / 2 + c] = row[kv_cols / 2 + c] as f64;
            }
        }
        let (mut slots, mut run_starts, mut counts) = (Vec::new(), Vec::new(), Vec::new());
        let mut q = Vec::new();
        let mut token = 0;
        for ((_, window), (context, &start)) in windows.iter().zip(contexts.iter().zip(&starts)) {
            for j in 0..*window {
                run_starts.push(slots.len() as i64);
                counts.push((start + j + 1) as i64);
                slots.extend_from_slice(&context[..start + j + 1]);
                let row = &values[(token + j) * config.qkv_width()..][..q_cols];
                q.extend(row.iter().map(|&v| v as f64));
            }
            token += window;
        }
        let heads = Heads {
            heads: config.query_heads,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
        };
        let want = paged_attention(
            &q,
            &k_pool,
            &v_pool,
            heads,
            &slots,
            &run_starts,
            &counts,
            "",
        )
        .expect("the host's runs are valid");
        // f32, or one rounding to a half-precision output after f32 sums.
        let relative = match config.dtype {
            DType::BF16 => 1.0 / 128.0,
            DType::F16 => 1.0 / 1024.0,
            _ => 1e-4,
        };
        assert_eq!(out.len(), want.len(), "layer {layer}: output length");
        for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
            assert!(
                (got as f64 - want).abs() <= 1e-4 + relative * want.abs(),
                "layer {layer}, element {i}: {got} against the reference's {want}"
            );
        }
    }
    contexts
}

/// Every pool row equals what the host stored there, bit for bit, and every other row is still
/// poison.
fn assert_pools(kv: &PagedKv, host: &HostPools) {
    let config = kv.config();
    let width = config.kv_width();
    for layer in 0..config.layers {
        let pool = floats(kv.pool(layer).unwrap());
        for slot in 0..=config.slots {
            let got = &pool[slot * width..][..width];
            match host.rows[layer].get(&(slot as i64)) {
                Some(row) => assert_eq!(got, row.as_slice(), "layer {layer}, slot {slot}"),
                None => assert!(
                    got.iter().all(|&v| v == POISON),
                    "layer {layer}, slot {slot}: written though no token was stored there"
                ),
            }
        }
    }
}

/// Two requests, one sharing the other's prefix, drafts partly kept, one leaving: outputs
/// against the reference, pools bit for bit, table rows, slot owners, every slot free at the end;
/// in f32 and in half precision (bf16, or f16 where the device has no bf16).
pub fn values(device: &Device) {
    values_in(device, DType::F32);
    let half = crate::common::half::<burn_core::backend::Dispatch>(device.as_dispatch());
    values_in(device, half);
}

fn values_in(device: &Device, dtype: DType) {
    let config = PagedKvConfig { dtype, ..config() };
    let mut kv = poisoned(config.clone(), device);
    let mut host = HostPools {
        rows: vec![HashMap::new(); config.layers],
    };
    let mut rng = Rng::new(42);
    let a = kv.add().unwrap();
    // 17 tokens: past the one launch's 16 on the GPU backends (a store, then the attention).
    step(&mut kv, &mut host, &mut rng, &[(a, 17)], device);
    let prompt: Vec<u32> = (11..28).collect();
    let report = kv.end(&[prompt.len()]).unwrap();
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!(kv.len(a).unwrap(), 17);
    let a_slots = kv.slots(a).unwrap().to_vec();

    let b = kv.share(a, 3).unwrap();
    assert_eq!(kv.slots(b).unwrap(), &a_slots[..3]);
    for &slot in &a_slots[..3] {
        assert_eq!(kv.slot_owners(slot), 2, "shared slot {slot}");
    }
    // A drafts 3 and keeps 2; B prefills 2 after the shared prefix.
    let contexts = step(&mut kv, &mut host, &mut rng, &[(a, 3), (b, 2)], device);
    let rejected = contexts[0][19];
    let report = kv.end(&[2, 2]).unwrap();
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!(
        kv.slot_owners(rejected),
        0,
        "a rejected draft's slot is free again"
    );
    assert_eq!(kv.slots(a).unwrap(), &contexts[0][..19]);
    assert_eq!(kv.slots(b).unwrap(), &contexts[1][..5]);
    assert_eq!(
        &contexts[1][..3],
        &a_slots[..3],
        "B's row names A's prefix slots"
    );
    assert_eq!(kv.free_slots(), config.slots - 19 - 2);

    // Decode steps: the canary keeps verifying the shared slots.
    for _ in 0..3 {
        step(&mut kv, &mut host, &mut rng, &[(b, 1), (a, 1)], device);
        let report = kv.end(&[1, 1]).unwrap();
        assert!(report.violations.is_empty(), "{report:?}");
    }
    // Rows stored at rejected slots stay in the pool (nothing clears them); compare only the
    // live ones, poison elsewhere.
    let live: Vec<i64> = kv
        .requests()
        .flat_map(|id| kv.slots(id).unwrap().to_vec())
        .collect();
    for rows in &mut host.rows {
        rows.retain(|slot, _| live.contains(slot) || *slot == rejected);
    }
    assert_pools(&kv, &host);
    let t = table(&kv);
    for id in [a, b] {
        let row = kv.row(id).unwrap() as usize;
        let slots = kv.slots(id).unwrap();
        assert_eq!(
            &t[row * config.max_context..][..slots.len()],
            slots,
            "request {id}'s row"
        );
    }

    kv.remove(a).unwrap();
    for &slot in &a_slots[..3] {
        assert_eq!(kv.slot_owners(slot), 1, "B still owns shared slot {slot}");
    }
    step(&mut kv, &mut host, &mut rng, &[(b, 2)], device);
    let report = kv.end(&[2]).unwrap();
    assert!(report.violations.is_empty(), "{report:?}");
    kv.remove(b).unwrap();
    assert_eq!(
        (kv.free_slots(), kv.free_rows()),
        (config.slots, config.max_requests)
    );
}

/// What a `PagedKv` shows of its state, to compare before and after a refused call.
#[derive(Debug, PartialEq)]
struct Snapshot {
    free: (usize, usize),
    requests: Vec<(RequestId, Vec<i64>)>,
    table: Vec<i64>,
    pool: Vec<f32>,
}

fn snapshot(kv: &PagedKv) -> Snapshot {
    Snapshot {
        free: (kv.free_slots(), kv.free_rows()),
        requests: kv
            .requests()
            .map(|id| (id, kv.slots(id).unwrap().to_vec()))
            .collect(),
        table: table(kv),
        pool: floats(kv.pool(0).unwrap()),
    }
}

#[track_caller]
fn assert_kind<T: std::fmt::Debug>(result: Result<T, Error>, kind: &str) {
    match result {
        Err(error) => assert_eq!(error.kind(), kind, "{error}"),
        Ok(value) => panic!("expected {kind}, got {value:?}"),
    }
}

/// Every error path: the typed error naming the value, and nothing changed.
pub fn errors(device: &Device) {
    let bad_configs: [(fn(&mut PagedKvConfig), &str); 8] = [
        (|c| c.layers = 0, "layers = 0"),
        (|c| c.kv_heads = 3, "query_heads = 4"),
        (|c| c.slots = 0, "slots = 0"),
        (|c| c.max_context = 0, "max_context = 0"),
        (|c| c.dtype = DType::I64, "dtype"),
        (
            |c| c.canary.as_mut().unwrap().ring_rows = 0,
            "ring_rows = 0",
        ),
        (
            |c| c.canary.as_mut().unwrap().layers = vec![2],
            "canary.layers = 2",
        ),
        (
            |c| c.canary.as_mut().unwrap().layers = vec![0; 5],
            "canary.layers = 5",
        ),
    ];
    for (change, named) in bad_configs {
        let mut config = config();
        change(&mut config);
        let error = PagedKv::new(config, device).expect_err(named);
        assert_eq!(error.kind(), "config");
        assert!(error.to_string().contains(named), "{error} names {named}");
    }

    let config = config();
    let mut kv = poisoned(config.clone(), device);
    let mut rng = Rng::new(7);
    let mut host = HostPools {
        rows: vec![HashMap::new(); config.layers],
    };
    let a = kv.add().unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 4)], device);
    kv.end(&[4]).unwrap();
    let gone = kv.add().unwrap();
    kv.remove(gone).unwrap();
    let before = snapshot(&kv);

    // Requests.
    assert_kind(kv.len(gone), "unknown_request");
    assert_kind(kv.remove(gone), "unknown_request");
    assert_kind(kv.share(gone, 0), "unknown_request");
    let error = kv.share(a, 5).unwrap_err();
    assert_eq!(
        error,
        Error::PrefixTooLong {
            request: 0,
            len: 4,
            prefix: 5
        }
    );
    assert_kind(kv.truncate(a, 5), "keep_past_window");
    let b = kv.add().unwrap();
    let c = kv.add().unwrap();
    assert_eq!(kv.add().unwrap_err(), Error::OutOfRows { max_requests: 3 });
    kv.remove(c).unwrap();
    kv.remove(b).unwrap();
    assert_eq!(snapshot(&kv), before, "after the refused request calls");

    // A step's begin.
    assert_kind(kv.begin(&[]), "step_order");
    assert_kind(kv.begin(&[(gone, &[1])]), "unknown_request");
    assert_kind(kv.begin(&[(a, &[1]), (a, &[1])]), "request_twice_in_step");
    assert_kind(kv.begin(&[(a, &[])]), "empty_window");
    let error = kv.begin(&[(a, &[0; 21])]).unwrap_err();
    assert_eq!(
        error,
        Error::ContextFull {
            request: 0,
            len: 25,
            max_context: 24
        }
    );
    let b = kv.add().unwrap();
    let c = kv.add().unwrap();
    let error = kv
        .begin(&[(a, &[0; 20]), (b, &[0; 15]), (c, &[0; 2])])
        .unwrap_err();
    assert_eq!(
        error,
        Error::OutOfSlots {
            needed: 37,
            free: 36
        }
    );
    kv.remove(c).unwrap();
    kv.remove(b).unwrap();
    assert_eq!(snapshot(&kv), before, "after the refused begins");

    // Outside a step.
    let qkv = || Tensor::<2>::zeros([2, config.qkv_width()], device);
    assert_kind(kv.attend(0, qkv()), "step_order");
    assert_kind(kv.end(&[]), "step_order");
    assert_kind(
        kv.attach(Tensor::from_data(TensorData::new(vec![1i64], [1]), device)),
        "step_order",
    );

    // Inside a step.
    kv.begin(&[(a, &[5, 6])]).unwrap();
    let inside = (kv.free_slots(), kv.slots(a).unwrap().to_vec());
    assert_kind(kv.begin(&[(a, &[1])]), "step_order");
    assert_kind(kv.attend(2, qkv()), "layer_out_of_range");
    let error = kv
        .attend(0, Tensor::<2>::zeros([3, config.qkv_width()], device))
        .unwrap_err();
    assert_eq!(
        error.to_string(),
        "paged KV: qkv has shape [3, 64], expected [2, 64]"
    );
    assert_kind(
        kv.attend(0, Tensor::<2>::zeros([2, 63], device)),
        "tensor_shape",
    );
    assert_kind(
        kv.attend(
            0,
            Tensor::<2>::zeros([2, config.qkv_width()], (device, DType::F64)),
        ),
        "tensor_dtype",
    );
    assert_kind(kv.remove(a), "step_order");
    assert_kind(kv.truncate(a, 0), "step_order");
    assert_kind(kv.set_pool(0, kv.pool(0).unwrap()), "step_order");
    assert_kind(kv.end(&[1, 1]), "step_requests");
    let error = kv.end(&[3]).unwrap_err();
    assert_eq!(
        error,
        Error::KeepPastWindow {
            request: 0,
            keep: 3,
            window: 2
        }
    );
    assert_eq!(
        (kv.free_slots(), kv.slots(a).unwrap().to_vec()),
        inside,
        "inside the step"
    );
    for layer in 0..config.layers {
        kv.attend(layer, qkv()).unwrap();
    }
    kv.end(&[1]).unwrap();
    assert_eq!(kv.len(a).unwrap(), 5);

    // Pools and tables of another shape.
    assert_kind(kv.pool(2), "layer_out_of_range");
    assert_kind(
        kv.set_pool(0, Tensor::<2>::zeros([3, 3], device)),
        "tensor_shape",
    );
    assert_kind(
        kv.set_pool(0, Tensor::<2>::zeros([41, 32], (device, DType::F64))),
        "tensor_dtype",
    );
    assert_kind(
        kv.set_req_to_token(Tensor::<2, Int>::zeros([2, 2], (device, DType::I64))),
        "tensor_shape",
    );
    assert_kind(
        kv.set_req_to_token(Tensor::<2, Int>::zeros([4, 24], (device, DType::I32))),
        "tensor_dtype",
    );

    // A segment gather's messages start with the caller's context (the spec's without one).
    let int = |values: Vec<i64>| {
        let n = values.len();
        Tensor::<1, Int>::from_data(TensorData::new(values, [n]), (device, DType::I64))
    };
    let table = || Tensor::<2, Int>::zeros([2, 4], (device, DType::I64));
    let options = kvplan::ops::GatherOptions::new().context("paged step");
    let error = kvplan::ops::segment_gather(table(), int(vec![5]), None, int(vec![1]), &options)
        .and_then(|gathered| gathered.status.check())
        .unwrap_err();
    assert!(error.to_string().starts_with("paged step "), "{error}");
    let options = kvplan::ops::GatherOptions::new();
    let error = kvplan::ops::segment_gather(table(), int(vec![5]), None, int(vec![1]), &options)
        .and_then(|gathered| gathered.status.check())
        .unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("DFLASH req_to_token segment gather"),
        "{error}"
    );
}

/// Random add / share / step / keep / truncate / remove sequences against a host model: after
/// each call the table rows equal the model's, every live slot has as many owners as requests
/// naming it, live and free slots add up, and at the end every slot and row is free.
pub fn property(device: &Device) {
    let config = PagedKvConfig {
        layers: 1,
        slots: 48,
        max_requests: 4,
        max_context: 20,
        ..config()
    };
    for seed in 0..3 {
        let mut rng = Rng::new(1000 + seed);
        let mut kv = PagedKv::new(config.clone(), device).unwrap();
        // The model: each live request's committed slots.
        let mut model: Vec<(RequestId, Vec<i64>)> = Vec::new();
        for _ in 0..14 {
            match rng.below(6) {
                0 => {
                    if let Ok(id) = kv.add() {
                        model.push((id, Vec::new()));
                    } else {
                        assert_eq!(model.len(), config.max_requests);
                    }
                }
                1 if !model.is_empty() => {
                    let (source, slots) = model[rng.below(model.len() as u64) as usize].clone();
                    let prefix = rng.urange(0, slots.len());
                    match kv.share(source, prefix) {
                        Ok(id) => model.push((id, slots[..prefix].to_vec())),
                        Err(error) => assert_eq!(model.len(), config.max_requests, "{error}"),
                    }
                }
                2 if !model.is_empty() => {
                    let i = rng.below(model.len() as u64) as usize;
                    kv.remove(model.remove(i).0).unwrap();
                }
                3 if !model.is_empty() => {
                    let i = rng.below(model.len() as u64) as usize;
                    let len = rng.urange(0, model[i].1.len());
                    kv.truncate(model[i].0, len).unwrap();
                    model[i].1.truncate(len);
                }
                _ if !model.is_empty() => {
                    let mut windows = Vec::new();
                    let mut free = kv.free_slots();
                    for (id, slots) in &model {
                        let room = (config.max_context - slots.len()).min(free).min(4);
                        if room > 0 && rng.chance(3, 4) {
                            let window = rng.urange(1, room);
                            free -= window;
                            windows.push((*id, window));
                        }
                    }
                    if windows.is_empty() {
                        continue;
                    }
                    let ids = vec![7u32; 4];
                    let begun: Vec<(RequestId, &[u32])> =
                        windows.iter().map(|&(id, n)| (id, &ids[..n])).collect();
                    let inputs = kv.begin(&begun).unwrap();
                    let qkv = Tensor::<2>::ones([inputs.tokens, config.qkv_width()], device);
                    kv.attend(0, qkv).unwrap();
                    let t = table(&kv);
                    let mut keep = Vec::new();
                    for &(id, window) in &windows {
                        let (_, slots) = model.iter_mut().find(|(m, _)| *m == id).unwrap();
                        let row = kv.row(id).unwrap() as usize * config.max_context;
                        let kept = rng.urange(0, window);
                        slots.extend_from_slice(&t[row + slots.len()..][..kept]);
                        keep.push(kept);
                    }
                    let report = kv.end(&keep).unwrap();
                    assert!(report.violations.is_empty(), "seed {seed}: {report:?}");
                }
                _ => {}
            }
            check_model(&kv, &model, &config, seed);
        }
        for (id, _) in model.drain(..) {
            kv.remove(id).unwrap();
        }
        assert_eq!(
            (kv.free_slots(), kv.free_rows()),
            (config.slots, config.max_requests)
        );
    }
}

#[track_caller]
fn check_model(kv: &PagedKv, model: &[(RequestId, Vec<i64>)], config: &PagedKvConfig, seed: u64) {
    let t = table(kv);
    let mut owners: HashMap<i64, u32> = HashMap::new();
    for (id, slots) in model {
        assert_eq!(
            kv.slots(*id).unwrap(),
            slots.as_slice(),
            "seed {seed}: request {id}"
        );
        for &slot in slots {
            assert!(
                slot >= 1 && slot as usize <= config.slots,
                "seed {seed}: slot {slot}"
            );
            *owners.entry(slot).or_default() += 1;
        }
    }
    for (&slot, &count) in &owners {
        assert_eq!(
            kv.slot_owners(slot),
            count,
            "seed {seed}: owners of slot {slot}"
        );
    }
    // A shared slot sits at the same position in every row that names it.
    for (i, (_, a)) in model.iter().enumerate() {
        for (_, b) in &model[i + 1..] {
            for (p, slot) in a.iter().enumerate() {
                if let Some(q) = b.iter().position(|s| s == slot) {
                    assert_eq!(p, q, "seed {seed}: slot {slot} shared at two positions");
                }
            }
        }
    }
    assert_eq!(
        owners.len() + kv.free_slots(),
        config.slots,
        "seed {seed}: live + free slots"
    );
    // The rows of requests that have been in a step hold their slots (a shared prefix is
    // written with its first step).
    let _ = t;
}

/// A byte flipped in a committed (shared) K row and a table cell naming another request's slot:
/// each reported at its request, position and slot.
pub fn faults(device: &Device) {
    let config = config();
    let mut kv = PagedKv::new(config.clone(), device).unwrap();
    let mut rng = Rng::new(3);
    let mut host = HostPools {
        rows: vec![HashMap::new(); config.layers],
    };
    let a = kv.add().unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 4)], device);
    kv.end(&[4]).unwrap();
    let b = kv.share(a, 2).unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 1), (b, 2)], device);
    assert!(kv.end(&[1, 2]).unwrap().violations.is_empty());

    // A high exponent bit of shared slot 1's first K value, in layer 0's pool.
    let slot = kv.slots(a).unwrap()[1];
    let width = config.kv_width();
    let mut pool = floats(kv.pool(0).unwrap());
    let flipped = f32::from_bits(pool[slot as usize * width].to_bits() ^ 0x2000_0000);
    pool[slot as usize * width] = flipped;
    host.rows[0].get_mut(&slot).expect("a stored slot")[0] = flipped;
    kv.set_pool(
        0,
        Tensor::from_data(TensorData::new(pool, [config.slots + 1, width]), device),
    )
    .unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 1), (b, 1)], device);
    let report = kv.end(&[1, 1]).unwrap();
    let mut found: Vec<(RequestId, usize, i64)> = report
        .violations
        .iter()
        .map(|v| (v.request, v.position, v.slot))
        .collect();
    found.sort();
    assert_eq!(found, vec![(a, 1, slot), (b, 1, slot)], "{report:?}");
    assert!(report.violations.iter().all(|v| {
        v.reasons
            .contains(FailReasons::VERIFY_REAL_KV_HASH_MISMATCH)
    }));
    // Both recompute: their caches are dropped and prefilled again.
    kv.truncate(b, 0).unwrap();
    kv.truncate(a, 0).unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 6), (b, 4)], device);
    assert!(kv.end(&[6, 4]).unwrap().violations.is_empty());

    // A's row names B's slot at position 3 (vLLM 56734's stale row).
    let stolen = kv.slots(b).unwrap()[3];
    let mut cells = table(&kv);
    let row = kv.row(a).unwrap() as usize;
    cells[row * config.max_context + 3] = stolen;
    let shape = [config.max_requests + 1, config.max_context];
    kv.set_req_to_token(Tensor::from_data(
        TensorData::new(cells, shape),
        (device, DType::I64),
    ))
    .unwrap();
    step(&mut kv, &mut host, &mut rng, &[(a, 1), (b, 1)], device);
    let report = kv.end(&[1, 1]).unwrap();
    let found: Vec<(RequestId, usize, i64)> = report
        .violations
        .iter()
        .map(|v| (v.request, v.position, v.slot))
        .collect();
    // The stale cell first; its successor's chain no longer verifies either (it was chained
    // from the slot the row named before).
    let own = kv.slots(a).unwrap()[4];
    assert_eq!(found, vec![(a, 3, stolen), (a, 4, own)], "{report:?}");
    kv.remove(a).unwrap();
    kv.remove(b).unwrap();
    assert_eq!(
        (kv.free_slots(), kv.free_rows()),
        (config.slots, config.max_requests)
    );
}

/// A tiny random model over a `PagedKv`: embeddings of ids and positions, each layer's `qkv`
/// projection, attention and output projection, and the greedy next token of every row.
struct Tiny {
    embed: Tensor<2>,
    position: Tensor<2>,
    qkv: Vec<Tensor<2>>,
    out: Vec<Tensor<2>>,
    head: Tensor<2>,
}

impl Tiny {
    fn new(config: &PagedKvConfig, vocab: usize, device: &Device) -> Self {
        let width = config.query_heads * config.head_dim;
        let mut rng = Rng::new(0x7469_6e79);
        let mut random = |rows: usize, cols: usize| {
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| rng.range(-1000, 1000) as f32 / 2000.0)
                .collect();
            Tensor::<2>::from_data(TensorData::new(values, [rows, cols]), device)
        };
        Self {
            embed: random(vocab, width),
            position: random(config.max_context, width),
            qkv: (0..config.layers)
                .map(|_| random(width, config.qkv_width()))
                .collect(),
            out: (0..config.layers).map(|_| random(width, width)).collect(),
            head: random(width, vocab),
        }
    }

    fn forward(&self, kv: &mut PagedKv, inputs: &StepInputs) -> Tensor<1, Int> {
        let mut hidden = self.embed.clone().select(0, inputs.ids.clone())
            + self.position.clone().select(0, inputs.positions.clone());
        for (layer, (qkv, out)) in self.qkv.iter().zip(&self.out).enumerate() {
            let attended = kv
                .attend(layer, hidden.clone().matmul(qkv.clone()))
                .expect("a valid layer");
            hidden = hidden + attended.matmul(out.clone());
        }
        hidden
            .matmul(self.head.clone())
            .argmax(1)
            .reshape([inputs.tokens])
    }
}

/// Everything a step leaves behind, for bit-equality: every pool's bits, the table, the canary's
/// records, ring and write index.
#[derive(Debug, PartialEq)]
struct DeviceState {
    pools: Vec<Vec<u32>>,
    table: Vec<i64>,
    records: Vec<i64>,
    ring: Vec<Vec<i64>>,
    write_index: i64,
}

fn device_state(kv: &PagedKv) -> (DeviceState, [i64; 2]) {
    let layers = kv.config().layers;
    let canary = kv.canary().expect("a canary").state().expect("readable");
    let state = DeviceState {
        pools: (0..layers)
            .map(|layer| {
                floats(kv.pool(layer).unwrap())
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            })
            .collect(),
        table: table(kv),
        records: canary.buffer,
        ring: canary.ring.iter().map(|row| row.to_vec()).collect(),
        write_index: canary.write_index,
    };
    (state, [canary.slot_run_counter, canary.kernel_run_counter])
}

fn ints(tensor: Tensor<1, Int>) -> Vec<u32> {
    kvplan::backend::data_to_i64(&tensor.into_data())
        .into_iter()
        .map(|v| v as u32)
        .collect()
}

/// Burn's capture of one decode step through the object, then replays with inputs refreshed in
/// place, against the same steps run eagerly on a twin: tokens, reports, pools, table and canary
/// state bit for bit (the canary's run counters step for step: a capture runs its step four
/// times). A fault injected into both is reported alike; a replaced pool or another shape is
/// refused with nothing changed.
pub fn capture(device: &Device) {
    let config = config();
    let tiny = Tiny::new(&config, 64, device);
    let hardware = !matches!(
        device.as_dispatch(),
        burn_core::backend::DispatchDevice::Flex(_)
    );
    // Each step attaches its next tokens: they come back in its report, read with its statuses.
    let step = |kv: &mut PagedKv, windows: &[(RequestId, &[u32])]| {
        let inputs = kv.begin(windows).unwrap();
        let next = tiny.forward(kv, &inputs);
        kv.attach(next.clone()).unwrap();
        let next = ints(next);
        let keep: Vec<usize> = windows.iter().map(|(_, ids)| ids.len()).collect();
        let report = kv.end(&keep).unwrap();
        let attached: Vec<u32> = report.attached.iter().map(|&v| v as u32).collect();
        assert_eq!(attached, next, "attached tokens");
        (next, report)
    };
    // Prefill two requests (the second shares the first's prefix), then one eager decode step:
    // every kernel of the decode shape compiled before the capture.
    let mut twins = Vec::new();
    for _ in 0..2 {
        let mut kv = PagedKv::new(config.clone(), device).unwrap();
        let a = kv.add().unwrap();
        let (first, _) = step(&mut kv, &[(a, &[3, 1, 4, 1, 5])]);
        let b = kv.share(a, 3).unwrap();
        let (second, _) = step(&mut kv, &[(b, &[9, 2])]);
        let (next, report) = step(&mut kv, &[(a, &first[4..]), (b, &second[1..])]);
        assert!(report.violations.is_empty(), "{report:?}");
        twins.push((kv, a, b, next));
    }
    let (mut graphed, a, b, mut tokens) = twins.pop().unwrap();
    let (mut eager, ..) = twins.pop().unwrap();

    let (mut graph, report) = graphed
        .capture(&[(a, &tokens[..1]), (b, &tokens[1..])], |kv, inputs| {
            let next = tiny.forward(kv, inputs);
            kv.attach(next.clone()).unwrap();
            next
        })
        .unwrap();
    assert_eq!(graph.is_hardware(), hardware, "{graph:?}");
    let (_, counters) = device_state(&eager);
    let (want, want_report) = step(&mut eager, &[(a, &tokens[..1]), (b, &tokens[1..])]);
    assert_eq!(report, want_report);
    assert_eq!(
        ints(graph.output().unwrap().clone()),
        want,
        "the captured step"
    );
    let (state, eager_counters) = device_state(&eager);
    let (graphed_state, graphed_counters) = device_state(&graphed);
    assert_eq!(graphed_state, state, "after the capture");
    // The canary's run counters after the latest step: graphed, eager.
    let mut last = (graphed_counters, eager_counters);
    let per_step = [
        eager_counters[0] - counters[0],
        eager_counters[1] - counters[1],
    ];
    tokens = want;

    let replay = |graphed: &mut PagedKv,
                  eager: &mut PagedKv,
                  graph: &mut kvplan::StepGraph<'_, Tensor<1, Int>>,
                  last: &mut ([i64; 2], [i64; 2]),
                  tokens: &[u32],
                  what: &str| {
        let windows = [(a, &tokens[..1]), (b, &tokens[1..])];
        let (out, report) = graphed.replay(graph, &windows).unwrap();
        let got = ints(out.clone());
        let (want, want_report) = step(eager, &windows);
        let (state, counters) = device_state(eager);
        let (graphed_state, graphed) = device_state(graphed);
        assert_eq!(got, want, "{what}: tokens");
        assert_eq!(report, want_report, "{what}: report");
        assert_eq!(graphed_state, state, "{what}: device state");
        assert_eq!(
            [graphed[0] - last.0[0], graphed[1] - last.0[1]],
            [counters[0] - last.1[0], counters[1] - last.1[1]],
            "{what}: canary counters"
        );
        *last = (graphed, counters);
        (want, report)
    };
    for k in 0..4 {
        let (next, report) = replay(
            &mut graphed,
            &mut eager,
            &mut graph,
            &mut last,
            &tokens,
            &format!("replay {k}"),
        );
        assert!(report.violations.is_empty(), "{report:?}");
        tokens = next;
    }
    assert!(per_step[1] > 0, "the canary ran");

    // Another shape, another object: refused, nothing changed.
    let (before, _) = device_state(&graphed);
    let free = graphed.free_slots();
    assert_kind(
        graphed.replay(&mut graph, &[(a, &tokens[..1])]),
        "graph_mismatch",
    );
    let mut other = PagedKv::new(config.clone(), device).unwrap();
    let c = other.add().unwrap();
    assert_kind(
        other.replay(&mut graph, &[(c, &[1]), (c, &[2])]),
        "graph_mismatch",
    );
    // A flipped bit in the shared slot of position 1, in both: the pool replaced, the graph
    // stale until captured again.
    let slot = graphed.slots(a).unwrap()[1];
    assert_eq!(graphed.slot_owners(slot), 2);
    for kv in [&mut graphed, &mut eager] {
        let width = config.kv_width();
        let mut pool = floats(kv.pool(0).unwrap());
        pool[slot as usize * width] =
            f32::from_bits(pool[slot as usize * width].to_bits() ^ 0x2000_0000);
        let pool = Tensor::from_data(TensorData::new(pool, [config.slots + 1, width]), device);
        kv.set_pool(0, pool).unwrap();
    }
    let windows = [(a, &tokens[..1]), (b, &tokens[1..])];
    assert_kind(graphed.replay(&mut graph, &windows), "graph_mismatch");
    let (after, _) = device_state(&graphed);
    assert_eq!(graphed.free_slots(), free, "refused replays take no slots");
    assert_ne!(after, before, "the injected bit (only)");
    drop(graph);
    let (mut graph, report) = graphed
        .capture(&windows, |kv, inputs| {
            let next = tiny.forward(kv, inputs);
            kv.attach(next.clone()).unwrap();
            next
        })
        .unwrap();
    let (want, want_report) = step(&mut eager, &windows);
    assert_eq!(report, want_report, "the fault's report");
    let found: Vec<(RequestId, usize, i64)> = report
        .violations
        .iter()
        .map(|v| (v.request, v.position, v.slot))
        .collect();
    assert_eq!(found, vec![(a, 1, slot), (b, 1, slot)], "{report:?}");
    assert_eq!(ints(graph.output().unwrap().clone()), want);
    let (state, counters) = device_state(&eager);
    let (graphed_state, graphed_now) = device_state(&graphed);
    assert_eq!(graphed_state, state, "after the second capture");
    last = (graphed_now, counters);
    let (next, report) = replay(
        &mut graphed,
        &mut eager,
        &mut graph,
        &mut last,
        &want,
        "after the fault",
    );
    assert_eq!(report.violations.len(), 2, "still reported: {report:?}");

    // The store's clock at its end: the next step starts it again on fresh scratch (buffers the
    // graph replays into), so the replay is refused with nothing changed, an eager step runs,
    // and the graph stays refused after it.
    graphed.advance_clock(u64::MAX >> 1);
    let windows = [(a, &next[..1]), (b, &next[1..])];
    let free = graphed.free_slots();
    assert_kind(graphed.replay(&mut graph, &windows), "graph_mismatch");
    assert_eq!(
        graphed.free_slots(),
        free,
        "a refused replay takes no slots"
    );
    let (want, want_report) = step(&mut eager, &windows);
    let (got, report) = step(&mut graphed, &windows);
    assert_eq!(
        (got, report),
        (want.clone(), want_report),
        "the eager step after"
    );
    let windows = [(a, &want[..1]), (b, &want[1..])];
    assert_kind(graphed.replay(&mut graph, &windows), "graph_mismatch");
}

/// A verify step captured whole (`capture`), then replayed with new windows, each request's
/// rejected tokens given back after (`truncate`), against a twin that captures each step afresh
/// and truncates the same way (the same op stream: Burn's fusion tunes each stream's kernels on
/// its own, so a differently built eager step may round differently): tokens, reports, pools,
/// table and canary state bit for bit. A third twin whose steps run eagerly and end keeping only
/// what they keep (`end(&keep)`) gives the same tokens, no violation. `end` inside the captured
/// forward and attending after a replay are refused; a replay of another shape is refused with
/// nothing changed.
pub fn capture_verify(device: &Device) {
    let config = config();
    let tiny = Tiny::new(&config, 64, device);
    let hardware = !matches!(
        device.as_dispatch(),
        burn_core::backend::DispatchDevice::Flex(_)
    );
    // Each row's window: its input token and two drafts.
    let windows_of = |last: [u32; 2]| last.map(|t| vec![t, (t + 1) % 64, (t + 7) % 64]);
    // The input tokens after a step that keeps `keep` of each row's window (its target's next).
    let next_inputs = |next: &[u32], keep: [usize; 2]| [next[keep[0] - 1], next[3 + keep[1] - 1]];
    let eager_step = |kv: &mut PagedKv, windows: &[(RequestId, &[u32])], keep: &[usize]| {
        let inputs = kv.begin(windows).unwrap();
        let next = ints(tiny.forward(kv, &inputs));
        (next, kv.end(keep).unwrap())
    };
    // A step as a graph runs it, captured afresh: every window kept, then each request truncated
    // to what it keeps.
    let captured_step = |kv: &mut PagedKv, windows: &[(RequestId, &[u32])], keep: &[usize]| {
        let starts: Vec<usize> = windows.iter().map(|(id, _)| kv.len(*id).unwrap()).collect();
        let (graph, report) = kv
            .capture(windows, |kv, inputs| tiny.forward(kv, inputs))
            .unwrap();
        let next = ints(graph.output().unwrap().clone());
        for ((id, _), (start, keep)) in windows.iter().zip(starts.iter().zip(keep)) {
            kv.truncate(*id, start + keep).unwrap();
        }
        (next, report)
    };
    // Prefill two requests (the second shares the first's prefix), then one verify step: every
    // kernel of the verify shape compiled before the capture.
    let mut twins = Vec::new();
    for twin in 0..3 {
        let mut kv = PagedKv::new(config.clone(), device).unwrap();
        let a = kv.add().unwrap();
        let (first, _) = eager_step(&mut kv, &[(a, &[3, 1, 4, 1, 5])], &[5]);
        let b = kv.share(a, 3).unwrap();
        let (second, _) = eager_step(&mut kv, &[(b, &[9, 2])], &[2]);
        let window = windows_of([first[4], second[1]]);
        let windows = [(a, window[0].as_slice()), (b, window[1].as_slice())];
        let (next, report) = if twin == 0 {
            eager_step(&mut kv, &windows, &[2, 1])
        } else {
            // As a captured step leaves it (every window kept, then truncated to the same).
            let starts = [kv.len(a).unwrap(), kv.len(b).unwrap()];
            let (next, report) = eager_step(&mut kv, &windows, &[3, 3]);
            kv.truncate(a, starts[0] + 2).unwrap();
            kv.truncate(b, starts[1] + 1).unwrap();
            (next, report)
        };
        assert!(report.violations.is_empty(), "{report:?}");
        twins.push((kv, a, b, next_inputs(&next, [2, 1])));
    }
    let (mut graphed, a, b, mut last) = twins.pop().unwrap();
    let (mut fresh, ..) = twins.pop().unwrap();
    let (mut kept_only, ..) = twins.pop().unwrap();
    let mut graph = None;
    for (k, keep) in [[1, 3], [3, 2], [2, 1], [3, 3]].into_iter().enumerate() {
        let window = windows_of(last);
        let windows = [(a, window[0].as_slice()), (b, window[1].as_slice())];
        let starts = [graphed.len(a).unwrap(), graphed.len(b).unwrap()];
        let (got, report) = match graph.as_mut() {
            None => {
                let tiny = &tiny;
                let (captured, report) = graphed
                    .capture(&windows, move |kv, inputs| {
                        // The graph ends its step itself: refused inside, nothing changed.
                        assert_kind(kv.end(&keep), "step_order");
                        tiny.forward(kv, inputs)
                    })
                    .unwrap();
                assert_eq!(captured.is_hardware(), hardware, "{captured:?}");
                let got = ints(graph.insert(captured).output().unwrap().clone());
                (got, report)
            }
            Some(graph) => {
                let (out, report) = graphed.replay(graph, &windows).unwrap();
                (ints(out.clone()), report)
            }
        };
        for ((id, start), keep) in [(a, starts[0]), (b, starts[1])].into_iter().zip(keep) {
            graphed.truncate(id, start + keep).unwrap();
        }
        let what = format!("step {k}, keep {keep:?}");
        // The step ended in the graph: nothing to attend.
        let qkv = Tensor::<2>::zeros([6, config.qkv_width()], device);
        assert_kind(graphed.attend(0, qkv), "step_order");
        let (want, want_report) = captured_step(&mut fresh, &windows, &keep);
        let (kept_tokens, kept_report) = eager_step(&mut kept_only, &windows, &keep);
        assert_eq!(got, want, "{what}: tokens");
        assert_eq!(
            kept_tokens, want,
            "{what}: tokens of steps keeping only the kept"
        );
        assert_eq!(report, want_report, "{what}: report");
        assert!(report.violations.is_empty(), "{what}: {report:?}");
        assert!(kept_report.violations.is_empty(), "{what}: {kept_report:?}");
        assert_eq!(
            device_state(&graphed).0,
            device_state(&fresh).0,
            "{what}: device state"
        );
        last = next_inputs(&want, keep);
    }
    let (mut graph, window) = (graph.unwrap(), windows_of(last));
    let windows = [(a, &window[0][..2]), (b, window[1].as_slice())];
    let (before, free) = (device_state(&graphed).0, graphed.free_slots());
    assert_kind(graphed.replay(&mut graph, &windows), "graph_mismatch");
    assert_eq!(
        graphed.free_slots(),
        free,
        "a refused replay takes no slots"
    );
    assert_eq!(
        device_state(&graphed).0,
        before,
        "a refused replay changes nothing"
    );
}
