//! End-to-end tests of the engine on the tiny random-weight Llama (written as GGUF and read back
//! through the same loader as SmolLM2), on Flex and on Vulkan.
//!
//! Parity runs in f64 on Flex: the verify forward and a plain step reduce in different orders
//! (other shapes), and f64 makes a near-tie flip between them practically impossible. Vulkan's
//! SPIR-V computes exp in 32 bits only, so there the model runs in f32, and its plain greedy
//! tokens are checked against Flex's f64 ones first.

use burn_core::tensor::{DType, Device, DeviceKind};

use crate::clock::OpKind;
use crate::engine::{Corruption, Drafting, Engine, EngineOptions, Outcome, Request};
use crate::gguf::Gguf;
use crate::model::Llama;
use crate::sample::{Rng, Sampling};
use crate::tiny::{TinyConfig, tiny_llama_bytes};

const SEED: u64 = 0x5EED;

/// f64 where the device's exp is 64-bit, else f32 (see the module docs).
fn dtype(device: &Device) -> DType {
    if crate::model::exp_is_64_bit(device) {
        DType::F64
    } else {
        DType::F32
    }
}

fn tiny_model(device: &Device) -> Llama {
    let gguf = Gguf::from_bytes(tiny_llama_bytes(&TinyConfig::default(), SEED).unwrap()).unwrap();
    Llama::load(&gguf, device, dtype(device)).unwrap()
}

/// Prompts of random tokens, half of them repeating a short phrase (where n-gram drafts pay).
fn prompts(count: usize, arrival_gap: usize, max_new_tokens: usize) -> Vec<Request> {
    let mut rng = Rng::new(SEED);
    (0..count)
        .map(|id| {
            let len = 3 + (rng.next_u64() % 12) as usize;
            let mut prompt: Vec<u32> = (0..len)
                .map(|_| 3 + (rng.next_u64() % 250) as u32)
                .collect();
            if id % 2 == 1 {
                let phrase = prompt.clone();
                prompt.extend(&phrase);
                prompt.extend(&phrase);
            }
            Request {
                id,
                prompt,
                max_new_tokens,
                arrival_step: id * arrival_gap,
            }
        })
        .collect()
}

fn serve(
    device: &Device,
    options: EngineOptions,
    requests: Vec<Request>,
) -> (Vec<Outcome>, Engine) {
    let mut engine = Engine::new(tiny_model(device), vec![2], options).unwrap();
    let mut streamed = vec![Vec::new(); requests.len()];
    let outcomes = engine
        .run(requests, |id, tokens| {
            streamed[id].extend_from_slice(tokens)
        })
        .unwrap();
    for outcome in &outcomes {
        assert_eq!(
            streamed[outcome.id], outcome.tokens,
            "request {}: streamed tokens",
            outcome.id
        );
    }
    let ((free_slots, slots), (free_rows, rows)) = engine.free_resources();
    assert_eq!(
        (free_slots, free_rows),
        (slots, rows),
        "every slot and row is free at the end"
    );
    (outcomes, engine)
}

fn options(drafting: Drafting, max_batch: usize) -> EngineOptions {
    EngineOptions {
        drafting,
        draft_tokens: if drafting == Drafting::Off { 0 } else { 4 },
        max_batch,
        kv_slots: 1024,
        max_context: 128,
        spec_max_tokens: None,
        ..EngineOptions::default()
    }
}

/// Self-speculative rows stop at a draft probability under 0.1: windows of every size.
const DRAFTINGS: [Drafting; 3] = [
    Drafting::Off,
    Drafting::Ngram { max_ngram: 3 },
    Drafting::SelfSpeculative {
        layers: 1,
        min_confidence: 0.1,
    },
];

fn tokens(outcomes: &[Outcome]) -> Vec<Vec<u32>> {
    outcomes.iter().map(|o| o.tokens.clone()).collect()
}

/// Greedy parity: every drafting method and every batch mix gives plain greedy's tokens.
fn greedy_parity(device: &Device) {
    let requests = prompts(5, 0, 24);
    let (plain, _) = serve(device, options(Drafting::Off, 1), requests.clone());
    assert!(plain.iter().all(|o| !o.tokens.is_empty()));
    let (host, _) = serve(&Device::flex(), options(Drafting::Off, 1), requests.clone());
    assert_eq!(
        tokens(&plain),
        tokens(&host),
        "plain greedy against Flex's f64"
    );
    for (max_batch, gap) in [(1, 0), (3, 0), (4, 3), (8, 1)] {
        let mut requests = requests.clone();
        for r in &mut requests {
            r.arrival_step = r.id * gap;
        }
        for drafting in DRAFTINGS {
            let (outcomes, _) = serve(device, options(drafting, max_batch), requests.clone());
            assert_eq!(
                tokens(&outcomes),
                tokens(&plain),
                "{drafting:?}, batch {max_batch}, arrivals every {gap} steps"
            );
            if drafting != Drafting::Off {
                let drafted: usize = outcomes.iter().map(|o| o.drafted).sum();
                let accepted: usize = outcomes.iter().map(|o| o.accepted).sum();
                assert!(
                    drafted > 0 && accepted > 0,
                    "{drafting:?}: {accepted}/{drafted} accepted"
                );
            }
        }
    }
}

/// A self-speculative row drafts `k` tokens a decode step at confidence 0 and one at confidence 1
/// (every draft probability is below 1); `spec_max_tokens` stops drafting where the rows'
/// windows would pass it, and only there (three rows of 5-token windows draft every decode step
/// under a bound of 15, never under one of 4). Plain greedy's tokens every time.
fn confidence_bounds_drafts(device: &Device) {
    let requests = prompts(3, 0, 16);
    let (plain, _) = serve(device, options(Drafting::Off, 3), requests.clone());
    for (min_confidence, most, per_step) in [
        (0.0, None, 4),
        (1.0, None, 1),
        (0.0, Some(15), 4),
        (0.0, Some(4), 0),
    ] {
        let drafting = Drafting::SelfSpeculative {
            layers: 1,
            min_confidence,
        };
        let bounded = EngineOptions {
            spec_max_tokens: most,
            ..options(drafting, 3)
        };
        let (outcomes, _) = serve(device, bounded, requests.clone());
        assert_eq!(
            tokens(&outcomes),
            tokens(&plain),
            "{drafting:?}, bound {most:?}"
        );
        for o in &outcomes {
            // Every step after the prefill decodes (and drafts, within the bound).
            assert_eq!(
                o.drafted,
                per_step * (o.steps - 1),
                "{drafting:?}, bound {most:?}, request {}",
                o.id
            );
        }
    }
}

/// `profile` (each phase waited for) changes no token, and every kind of kvplan call is charged;
/// each layer's store and attention repeated on every other step change no token either.
fn profile_changes_nothing(device: &Device) {
    let requests = prompts(3, 1, 12);
    let drafting = Drafting::Ngram { max_ngram: 3 };
    let (plain, _) = serve(device, options(drafting, 2), requests.clone());
    let profiled_options = EngineOptions {
        profile: true,
        ..options(drafting, 2)
    };
    let (profiled, engine) = serve(device, profiled_options, requests);
    assert_eq!(tokens(&plain), tokens(&profiled));
    let times = engine.times();
    let kvplan = times.kvplan;
    for (kind, time) in [
        ("bookkeeping", kvplan.bookkeeping),
        ("attention", kvplan.attention),
    ] {
        assert!(!time.is_zero(), "{kind}: nothing charged");
    }
    assert!(kvplan.total() < times.total);
    assert_eq!(times.step_walls.len(), times.steps);
    // Each layer's store and attention run twice on every other step (a benchmark's variant)
    // write the same rows again and attend the same queries again.
    for kind in [OpKind::Attention] {
        let repeated_options = EngineOptions {
            repeat: Some(kind),
            ..options(drafting, 2)
        };
        let (repeated, engine) = serve(device, repeated_options, prompts(3, 1, 12));
        assert_eq!(tokens(&plain), tokens(&repeated), "{kind:?}");
        assert!(
            repeated.iter().all(|o| o.canary_violations.is_empty()),
            "{kind:?}"
        );
        assert_eq!(engine.times().step_walls.len(), engine.times().steps);
    }
}

/// The run's one canary report names the injected corruption's request, slot and position.
fn reported_once(outcomes: &[Outcome], engine: &Engine, what: &str) {
    let injected = engine.injected().expect("a corruption was injected");
    let reported: Vec<_> = outcomes
        .iter()
        .flat_map(|o| o.canary_violations.clone())
        .collect();
    assert_eq!(reported.len(), 1, "{what}: {reported:?}");
    assert_eq!(
        (reported[0].request, reported[0].slot, reported[0].position),
        (injected.request, injected.slot, injected.position),
        "{what}"
    );
}

/// Each injected corruption is reported at its request, slot and position; the request
/// recomputes, and every request's tokens equal a clean run's.
fn corruption_is_caught(device: &Device) {
    let requests = prompts(3, 0, 24);
    for drafting in [Drafting::Off, Drafting::Ngram { max_ngram: 3 }] {
        let (clean, _) = serve(device, options(drafting, 3), requests.clone());
        assert!(clean.iter().all(|o| o.canary_violations.is_empty()));
        for kind in [Corruption::KvByte, Corruption::StaleRow] {
            let mut injected_options = options(drafting, 3);
            injected_options.corruption = Some((kind, 4));
            let (outcomes, engine) = serve(device, injected_options, requests.clone());
            reported_once(&outcomes, &engine, &format!("{kind:?}, {drafting:?}"));
            assert_eq!(tokens(&outcomes), tokens(&clean), "{kind:?}, {drafting:?}");
        }
    }
}

/// Greedy steps replayed as graphs (decode and verify steps whole) give the eager
/// steps' tokens in every batch mix and drafting mode, and both injected faults are reported
/// where the eager run reports them.
fn graphs_change_nothing(device: &Device) {
    let requests = prompts(5, 0, 24);
    for drafting in DRAFTINGS {
        for (max_batch, gap) in [(1, 0), (3, 0), (4, 3)] {
            let mut requests = requests.clone();
            for r in &mut requests {
                r.arrival_step = r.id * gap;
            }
            let (eager, _) = serve(device, options(drafting, max_batch), requests.clone());
            let mut o = options(drafting, max_batch);
            o.graphs = true;
            let (graphed, engine) = serve(device, o, requests.clone());
            let what = format!("{drafting:?}, batch {max_batch}, gap {gap}");
            assert_eq!(tokens(&graphed), tokens(&eager), "{what}");
            assert!(engine.graphs() > 0, "{what}: steps were captured");
            if drafting != Drafting::Off && max_batch == 1 {
                // One decode graph at most: the rest are verify steps, whose drafts were
                // accepted on the device.
                assert!(engine.graphs() > 1, "{what}: verify steps were captured");
                let accepted: usize = graphed.iter().map(|o| o.accepted).sum();
                assert!(accepted > 0, "{what}: drafts accepted");
            }
        }
    }
    // Both faults under graphs, n-gram's too: each reported where it was injected, tokens as
    // the eager run's (n-gram's steps differ with graphs, which pad every row's window, so its
    // fault lands elsewhere; decode steps are the same steps, so the same report).
    let requests = prompts(3, 0, 24);
    for drafting in [Drafting::Off, DRAFTINGS[1]] {
        for kind in [Corruption::KvByte, Corruption::StaleRow] {
            let what = format!("{kind:?}, {drafting:?}");
            let mut o = options(drafting, 3);
            o.corruption = Some((kind, 6));
            let (eager, eager_engine) = serve(device, o.clone(), requests.clone());
            o.graphs = true;
            let (graphed, engine) = serve(device, o, requests.clone());
            reported_once(&graphed, &engine, &what);
            if drafting == Drafting::Off {
                assert_eq!(engine.injected(), eager_engine.injected(), "{what}");
            }
            assert_eq!(tokens(&graphed), tokens(&eager), "{what}");
        }
    }
}

/// With temperature > 0 the runs are seeded: the same seed gives the same tokens, drafting or not
/// changes nothing about that, and the tokens stay in the vocabulary.
fn sampling_is_seeded(device: &Device) {
    let requests = prompts(3, 0, 16);
    for drafting in DRAFTINGS {
        let run = |seed| {
            let mut o = options(drafting, 3);
            o.sampling = Sampling {
                temperature: 0.8,
                seed,
            };
            tokens(&serve(device, o, requests.clone()).0)
        };
        let first = run(11);
        assert_eq!(first, run(11), "{drafting:?}");
        assert_ne!(first, run(12), "{drafting:?}");
    }
}

/// A warmed-up engine serves exactly what a fresh one does: the same sampled tokens (arrivals
/// over time, so the step clock restarts too), and a fault injected in the served run, not the
/// warm-up, is still reported.
#[test]
fn warm_up_changes_nothing_flex() {
    let device = Device::flex();
    let mut requests = prompts(3, 2, 12);
    requests[2].arrival_step = 5;
    let mut o = options(Drafting::Ngram { max_ngram: 3 }, 2);
    o.sampling = Sampling {
        temperature: 0.8,
        seed: 5,
    };
    o.corruption = Some((Corruption::StaleRow, 4));
    let (fresh, fresh_engine) = serve(&device, o.clone(), requests.clone());
    let mut engine = Engine::new(tiny_model(&device), vec![2], o).unwrap();
    engine.warm_up(requests.clone()).unwrap();
    assert!(
        engine.injected().is_none(),
        "nothing injected in the warm-up"
    );
    assert_eq!(engine.times().steps, 0);
    let warmed = engine.run(requests, |_, _| {}).unwrap();
    assert_eq!(tokens(&warmed), tokens(&fresh));
    assert_eq!(engine.injected(), fresh_engine.injected());
    let reported = |outcomes: &[Outcome]| -> Vec<_> {
        outcomes
            .iter()
            .flat_map(|o| o.canary_violations.clone())
            .collect()
    };
    assert_eq!(reported(&warmed), reported(&fresh));
    assert_eq!(reported(&warmed).len(), 1);
}

/// Tests share the device; one that captures graphs takes it alone (a wgpu replay beside another
/// thread's work on the device was seen to hand its status words to that thread's tensors).
static DEVICE: std::sync::RwLock<()> = std::sync::RwLock::new(());

#[cfg(feature = "vulkan")]
fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    DEVICE
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(feature = "vulkan")]
fn exclusive() -> std::sync::RwLockWriteGuard<'static, ()> {
    DEVICE
        .write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(feature = "vulkan")]
fn vulkan() -> Device {
    Device::vulkan(DeviceKind::DefaultDevice)
}

/// Vulkan's f64 exp is 32-bit: an f64 model there is refused, not silently wrong.
#[cfg(feature = "vulkan")]
#[test]
fn f64_is_refused_on_vulkan() {
    let _device = shared();
    let gguf = Gguf::from_bytes(tiny_llama_bytes(&TinyConfig::default(), SEED).unwrap()).unwrap();
    let message = match Llama::load(&gguf, &vulkan(), DType::F64) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("f64 loaded on Vulkan"),
    };
    assert_eq!(
        message,
        "model: this device computes f64 exp in 32 bits (Vulkan's SPIR-V does): load as f32"
    );
}

/// bf16 loads where the device has it (not lavapipe), and is refused by name where it has not.
#[cfg(feature = "vulkan")]
#[test]
fn bf16_loads_where_the_device_has_it() {
    let _device = shared();
    let gguf = Gguf::from_bytes(tiny_llama_bytes(&TinyConfig::default(), SEED).unwrap()).unwrap();
    let device = vulkan();
    match Llama::load(&gguf, &device, DType::BF16) {
        Ok(model) => {
            assert!(device.supports_dtype(DType::BF16));
            assert_eq!(model.dtype(), DType::BF16);
        }
        Err(e) => {
            assert!(!device.supports_dtype(DType::BF16));
            assert_eq!(
                e.to_string(),
                "model: this device has no BF16 float tensors: load as f32"
            );
        }
    }
}

#[test]
fn greedy_parity_flex() {
    greedy_parity(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn greedy_parity_vulkan() {
    let _device = shared();
    greedy_parity(&vulkan());
}

#[test]
fn confidence_bounds_drafts_flex() {
    confidence_bounds_drafts(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn confidence_bounds_drafts_vulkan() {
    let _device = shared();
    confidence_bounds_drafts(&vulkan());
}

#[test]
fn profile_changes_nothing_flex() {
    profile_changes_nothing(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn profile_changes_nothing_vulkan() {
    let _device = shared();
    profile_changes_nothing(&vulkan());
}

#[test]
fn corruption_is_caught_flex() {
    corruption_is_caught(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn corruption_is_caught_vulkan() {
    let _device = shared();
    corruption_is_caught(&vulkan());
}

/// Greedy acceptance on the device keeps what the host's keeps: windows of every width up to
/// 5 in one step (padded to the widest) and all as wide, drafts agreeing with the target for a
/// random stretch, then random.
fn device_acceptance_matches_the_host(device: &Device) {
    let mut rng = Rng::new(SEED);
    for uniform in [false, true] {
        let windows: Vec<usize> = (0..7)
            .map(|_| {
                if uniform {
                    4
                } else {
                    1 + (rng.next_u64() % 5) as usize
                }
            })
            .collect();
        let (mut ids, mut targets, mut expected) = (vec![], vec![], vec![]);
        for &n in &windows {
            let agree = (rng.next_u64() % (n as u64 + 1)) as usize;
            let row_targets: Vec<u32> = (0..n).map(|_| (rng.next_u64() % 4) as u32).collect();
            let drafts: Vec<u32> = (0..n - 1)
                .map(|j| {
                    if j < agree {
                        row_targets[j]
                    } else {
                        (rng.next_u64() % 4) as u32
                    }
                })
                .collect();
            ids.push(9);
            ids.extend(&drafts);
            targets.extend(&row_targets);
            expected.push(crate::sample::accept_greedy(&drafts, &row_targets).len() as i64);
        }
        let upload = |values: &[u32]| {
            let values: Vec<i64> = values.iter().map(|&v| i64::from(v)).collect();
            let n = values.len();
            burn_core::tensor::Tensor::<1, burn_core::tensor::Int>::from_data(
                burn_core::tensor::TensorData::new(values, [n]),
                (device, DType::I64),
            )
        };
        let kept =
            crate::engine::Acceptance::new(&windows, device).kept(upload(&ids), upload(&targets));
        let kept = kvplan::backend::data_to_i64(&kept.into_data());
        assert_eq!(kept, expected, "windows {windows:?}");
    }
}

/// A greedy step's attached ints become each row's accepted tokens; a count of ints or a kept
/// count that cannot come from the step is refused, naming it.
#[test]
fn accepted_targets_are_checked() {
    use crate::engine::{Target, accepted_targets};
    // Windows of 1 and 3: the target's 4 tokens, then the rows' kept counts.
    let got = accepted_targets(&[7, 4, 5, 6, 1, 2], &[1, 3]).unwrap();
    let want = vec![Target::Accepted(vec![7]), Target::Accepted(vec![4, 5])];
    assert_eq!(got, want);
    // Without drafts, one token a row and no counts.
    let got = accepted_targets(&[7, 8], &[1, 1]).unwrap();
    assert_eq!(
        got,
        vec![Target::Accepted(vec![7]), Target::Accepted(vec![8])]
    );
    let refusal = |attached: &[i64], windows: &[usize]| {
        accepted_targets(attached, windows).unwrap_err().to_string()
    };
    assert!(refusal(&[7, 4, 5, 6, 1], &[1, 3]).contains("attached 5 ints for 6"));
    assert!(
        refusal(&[7, 4, 5, 6, 1, 4], &[1, 3]).contains("row 1 kept 4 tokens of a 3-token window")
    );
    assert!(
        refusal(&[7, 4, 5, 6, 0, 2], &[1, 3]).contains("row 0 kept 0 tokens of a 1-token window")
    );
}

#[test]
fn device_acceptance_matches_the_host_flex() {
    device_acceptance_matches_the_host(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn device_acceptance_matches_the_host_vulkan() {
    let _device = shared();
    device_acceptance_matches_the_host(&vulkan());
}

#[test]
fn graphs_change_nothing_flex() {
    graphs_change_nothing(&Device::flex());
}

#[cfg(feature = "vulkan")]
#[test]
fn graphs_change_nothing_vulkan() {
    let _device = exclusive();
    graphs_change_nothing(&vulkan());
}

#[test]
fn sampling_is_seeded_flex() {
    sampling_is_seeded(&Device::flex());
}

/// The accepted tokens follow the target's distribution: the token a self-speculative step emits
/// first (after a drafted window) against the target's own distribution, by chi-square.
#[test]
fn speculative_sampling_matches_the_target_flex() {
    speculative_sampling_matches_the_target(0.0);
}

/// The same with sampled drafts that stop under a confidence (windows of random lengths).
#[test]
fn speculative_sampling_with_confidence_stops_matches_the_target_flex() {
    speculative_sampling_matches_the_target(0.5);
}

fn speculative_sampling_matches_the_target(min_confidence: f32) {
    let device = Device::flex();
    let prompt: Vec<u32> = vec![40, 41, 42, 43, 44, 45];
    let temperature = 0.2;
    let sampling = |seed| EngineOptions {
        sampling: Sampling { temperature, seed },
        ..options(
            Drafting::SelfSpeculative {
                layers: 1,
                min_confidence,
            },
            1,
        )
    };
    // The first generated token comes from the prefill; condition on its most likely value.
    let mut probe = Engine::new(tiny_model(&device), vec![], sampling(0)).unwrap();
    let first = probe.next_token_distribution(&prompt).unwrap();
    let t1 = (0..first.len())
        .max_by(|&a, &b| first[a].total_cmp(&first[b]))
        .unwrap() as u32;
    let mut context = prompt.clone();
    context.push(t1);
    let p = probe.next_token_distribution(&context).unwrap();
    let mut counts = vec![0usize; p.len()];
    assert!(
        first[t1 as usize] > 0.2,
        "t1 has probability {}",
        first[t1 as usize]
    );
    let mut engine = probe;
    let (mut kept, mut seed) = (0, 1);
    while kept < 1000 {
        seed += 1;
        engine.reseed(seed);
        let request = Request {
            id: 0,
            prompt: prompt.clone(),
            max_new_tokens: 2,
            arrival_step: 0,
        };
        let outcome = engine.run(vec![request], |_, _| {}).unwrap().remove(0);
        if outcome.tokens[0] == t1 {
            counts[outcome.tokens[1] as usize] += 1;
            kept += 1;
        }
    }
    // Cells with expected count >= 5; the rest pooled into one.
    let n = kept as f64;
    let (mut chi, mut cells, mut rest_p, mut rest_c) = (0.0, 0usize, 0.0, 0usize);
    for (c, &q) in counts.iter().zip(&p) {
        if n * q as f64 >= 5.0 {
            chi += (*c as f64 - n * q as f64).powi(2) / (n * q as f64);
            cells += 1;
        } else {
            rest_p += q as f64;
            rest_c += c;
        }
    }
    if n * rest_p >= 5.0 {
        chi += (rest_c as f64 - n * rest_p).powi(2) / (n * rest_p);
        cells += 1;
    }
    // The 99.9% quantile of chi-square with k degrees of freedom is below 3.2k + 11 for k >= 1.
    let dof = cells.saturating_sub(1).max(1) as f64;
    assert!(
        chi < 3.2 * dof + 11.0,
        "chi-square {chi:.1} over {cells} cells"
    );
}

/// SmolLM2-135M itself (fetched by `scripts/fetch-model.sh` when it is not in the cache), on Flex.
mod smollm2 {
    use super::*;
    use crate::model_file::smollm2_path;
    use crate::tokenizer::Tokenizer;

    fn load(dtype: DType) -> (Llama, Tokenizer) {
        let gguf = Gguf::open(smollm2_path().unwrap()).unwrap();
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        (
            Llama::load(&gguf, &Device::flex(), dtype).unwrap(),
            tokenizer,
        )
    }

    fn chat(tokenizer: &Tokenizer, id: usize, message: &str, max_new_tokens: usize) -> Request {
        let text = tokenizer.render_chat(message).unwrap();
        Request {
            id,
            prompt: tokenizer.encode(&text).unwrap(),
            max_new_tokens,
            arrival_step: 0,
        }
    }

    #[test]
    fn names_paris() {
        let (model, tokenizer) = load(DType::F32);
        let eos = tokenizer.end_of_generation_ids().to_vec();
        let request = chat(&tokenizer, 0, "What is the capital of France?", 24);
        let mut engine = Engine::new(model, eos, options(Drafting::Off, 1)).unwrap();
        let outcome = engine.run(vec![request], |_, _| {}).unwrap().remove(0);
        let text = tokenizer.decode(&outcome.tokens).unwrap();
        assert!(text.contains("Paris"), "{text:?}");
    }

    /// bf16 weights, activations and cache (sums in f32) still answer, with and without a
    /// self-speculative draft (whose token ids pass through f32, not bf16). Not "What is the
    /// capital of France?": in bf16 its first token flips to "L'Étoile".
    #[test]
    fn names_shakespeare_in_bf16() {
        let (model, tokenizer) = load(DType::BF16);
        let eos = tokenizer.end_of_generation_ids().to_vec();
        let request = chat(&tokenizer, 0, "Who wrote Romeo and Juliet?", 16);
        let mut model = Some(model);
        for drafting in [
            Drafting::Off,
            Drafting::SelfSpeculative {
                layers: 26,
                min_confidence: 0.0,
            },
        ] {
            let mut o = options(drafting, 1);
            o.draft_tokens = 3;
            let mut engine = Engine::new(model.take().unwrap(), eos.clone(), o).unwrap();
            let outcome = engine
                .run(vec![request.clone()], |_, _| {})
                .unwrap()
                .remove(0);
            let text = tokenizer.decode(&outcome.tokens).unwrap();
            assert!(text.contains("Shakespeare"), "{drafting:?}: {text:?}");
            model = Some(engine.into_model());
        }
    }

    /// Greedy parity on the real model, f64 (see the module docs), three prompts in one batch.
    #[test]
    fn speculative_greedy_equals_plain_greedy() {
        let (model, tokenizer) = load(DType::F64);
        let eos = tokenizer.end_of_generation_ids().to_vec();
        let requests: Vec<Request> = [
            "List the days of the week, one per line.",
            "Write the numbers from 1 to 20 separated by commas.",
            "What is the capital of France?",
        ]
        .iter()
        .enumerate()
        .map(|(id, m)| chat(&tokenizer, id, m, 32))
        .collect();
        let mut engine = Engine::new(model, eos.clone(), options(Drafting::Off, 3)).unwrap();
        let plain = tokens(&engine.run(requests.clone(), |_, _| {}).unwrap());
        let model = engine.into_model();
        let mut model = Some(model);
        for drafting in [
            Drafting::Ngram { max_ngram: 3 },
            Drafting::SelfSpeculative {
                layers: 26,
                min_confidence: 0.4,
            },
        ] {
            let mut o = options(drafting, 3);
            o.draft_tokens = 3;
            let mut engine = Engine::new(model.take().unwrap(), eos.clone(), o).unwrap();
            let outcomes = engine.run(requests.clone(), |_, _| {}).unwrap();
            assert_eq!(tokens(&outcomes), plain, "{drafting:?}");
            assert!(
                outcomes.iter().map(|o| o.accepted).sum::<usize>() > 0,
                "{drafting:?}"
            );
            model = Some(engine.into_model());
        }
    }
}

/// Every refusal of the engine and the loader, with its message.
#[test]
fn refusals_name_their_values() {
    let device = Device::flex();
    // RoPE turns pairs of a head's columns: an odd head is refused at load (a hand-made file's
    // metadata; the tiny writer, as llama.cpp's converter, makes none).
    let mut odd = crate::gguf::GgufWriter::new();
    odd.metadata("general.architecture", "llama")
        .metadata("llama.embedding_length", 96u32)
        .metadata("llama.attention.head_count", 32u32)
        .metadata("llama.attention.head_count_kv", 32u32);
    let gguf = Gguf::from_bytes(odd.to_bytes()).unwrap();
    assert_eq!(
        crate::model::LlamaConfig::from_gguf(&gguf)
            .unwrap_err()
            .to_string(),
        "model: head dim 3 is odd: RoPE turns pairs of columns"
    );
    // A dtype that is not a float is refused as one the device lacks.
    let tiny = Gguf::from_bytes(tiny_llama_bytes(&TinyConfig::default(), SEED).unwrap()).unwrap();
    match Llama::load(&tiny, &device, DType::I32) {
        Err(e) => assert_eq!(
            e.to_string(),
            "model: this device has no I32 float tensors: load as f32"
        ),
        Ok(_) => panic!("an i32 model loaded"),
    }
    let error = |options: EngineOptions| match Engine::new(tiny_model(&device), vec![2], options) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    let drafting = |layers, min_confidence| Drafting::SelfSpeculative {
        layers,
        min_confidence,
    };
    assert_eq!(
        error(options(drafting(2, 0.4), 1)),
        "options: self-speculative draft layers 2 must be in 1..2"
    );
    for bad in [-0.5, 1.5, f32::NAN] {
        assert_eq!(
            error(options(drafting(1, bad), 1)),
            format!("options: self-speculative draft confidence {bad} must be in 0..=1")
        );
    }
    let mut o = options(Drafting::Off, 1);
    o.max_context = 100_000;
    assert_eq!(
        error(o),
        "options: max context 100000 exceeds the model's context length 512"
    );
    assert_eq!(
        error(options(Drafting::Off, 0)),
        "options: max batch 0 and KV slots 1024 leave nothing to serve with"
    );
    let mut o = options(Drafting::Off, 1);
    o.repeat = Some(OpKind::Bookkeeping);
    assert_eq!(
        error(o),
        "options: repeat: a step's begin and end cannot run twice (attention can)"
    );

    let mut engine = Engine::new(tiny_model(&device), vec![2], options(Drafting::Off, 1)).unwrap();
    let request = |prompt: Vec<u32>, max_new_tokens| Request {
        id: 7,
        prompt,
        max_new_tokens,
        arrival_step: 0,
    };
    for (bad, why) in [
        (request(vec![], 4), "a prompt of 0 tokens"),
        (request(vec![5], 0), "a prompt of 1 tokens, 0 new"),
        (request(vec![5; 120], 16), "a prompt of 120 tokens, 16 new"),
    ] {
        let message = engine.run(vec![bad], |_, _| {}).unwrap_err().to_string();
        assert!(
            message.starts_with(&format!("options: request 7: {why}")),
            "{message}"
        );
    }
    let mut small = options(Drafting::Off, 1);
    small.kv_slots = 8;
    let mut engine = Engine::new(tiny_model(&device), vec![2], small).unwrap();
    let message = engine
        .run(vec![request(vec![5; 4], 8)], |_, _| {})
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "options: request 7 may need 13 KV slots, the pool has 7"
    );
    let message = engine
        .next_token_distribution(&[5])
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("options: next_token_distribution needs a sampling engine"),
        "{message}"
    );

    let mut writer = crate::gguf::GgufWriter::new();
    writer.metadata("general.architecture", "mamba");
    let gguf = Gguf::from_bytes(writer.to_bytes()).unwrap();
    let message = crate::model::LlamaConfig::from_gguf(&gguf)
        .unwrap_err()
        .to_string();
    assert_eq!(
        message,
        "model: general.architecture is \"mamba\", only \"llama\" is supported"
    );
}
