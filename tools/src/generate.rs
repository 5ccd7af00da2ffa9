//! `kvplan generate`: SmolLM2 served by the speculative decoder of `kvplan-decoder`, on a device.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use burn_core::tensor::{DType, Device};
use kvplan_decoder::clock::OpKind;
use kvplan_decoder::engine::{
    Corruption, Drafting, Engine, EngineOptions, Outcome, Request, StepTimes,
};
use kvplan_decoder::gguf::Gguf;
use kvplan_decoder::model::Llama;
use kvplan_decoder::model_file;
use kvplan_decoder::sample::Sampling;
use kvplan_decoder::tokenizer::Tokenizer;

use crate::backends::BackendName;
use crate::demo;

/// `kvplan generate`'s usage.
pub const USAGE: &str = "usage: kvplan generate [PROMPT ...] [--file FILE] [--raw] [--spec off|ngram|self]
    [--draft-tokens K] [--draft-layers L] [--draft-confidence P] [--backend flex|vulkan|cuda]
    [--max-new-tokens N] [--temperature T] [--seed S] [--batch N] [--dtype f32|f64|bf16]
    [--model FILE.gguf]
    [--inject-corruption kv-byte|stale-row] [--json] [--ignore-eos] [--limit N] [--profile]
    [--warm-up|--no-warm-up] [--repeat-ops attention] [--graphs on|off] [--spec-max-tokens N]
  Each prompt is a user message rendered with the GGUF's chat template (--raw: plain completion).
  FILE holds one JSON object per line ({\"prompt\": ..., \"arrival_step\": 0, \"max_new_tokens\": 64}),
  or plain lines of prompt text (--limit N: the first N). Without prompts, a built-in set runs.
  --spec self drafts with the first L blocks (default: all but 4); a row stops drafting after a
  token the draft gave less probability than P (default 0.4; 0: always K tokens).
  --ignore-eos generates exactly the budget (benchmarks). --profile waits for the device after
  each step phase and prints where the steps' time went. --repeat-ops attention runs each
  layer's store and attention (PagedKv::attend) twice on every other step (benchmarks: the
  steps' difference is what they cost a pipelined step). --graphs on replays greedy decode
  steps as graphs, each window shape's whole step (acceptance on the device) captured once
  (without drafts each batch size; up to 16 verify shapes), on by default on CUDA. --spec-max-tokens N: a step drafts only
  while its rows' windows (K + 1 each) total at most N tokens (default 16 on a GPU, where wider
  verify steps cost more than their drafts save; 0: no bound, Flex's default). On CUDA and Vulkan the requests are first served once untimed (--no-warm-up: not), which compiles and autotunes every
  step shape.";

/// The built-in prompts: two repetitive ones (lists and code, where drafts from the context pay).
const DEFAULT_PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "List the days of the week, one per line, then list them again in the same order.",
    "Write a Python function that returns the squares of the numbers 1 to 10, then call it and print the result.",
    "Explain in two sentences why the sky is blue.",
];

/// Everything `generate` was asked for.
#[derive(Debug, Clone)]
struct Args {
    prompts: Vec<PromptSpec>,
    raw: bool,
    drafting: String,
    draft_tokens: usize,
    draft_layers: Option<usize>,
    draft_confidence: f32,
    backend: Option<BackendName>,
    max_new_tokens: usize,
    temperature: f64,
    seed: u64,
    batch: usize,
    dtype: DType,
    model: Option<PathBuf>,
    corruption: Option<Corruption>,
    json: bool,
    ignore_eos: bool,
    profile: bool,
    repeat: Option<OpKind>,
    warm_up: Option<bool>,
    graphs: Option<bool>,
    spec_max_tokens: Option<usize>,
}

#[derive(Debug, Clone)]
struct PromptSpec {
    text: String,
    arrival_step: usize,
    max_new_tokens: Option<usize>,
}

/// Runs `kvplan generate ARGS`.
pub fn main(args: &[String]) -> Result<ExitCode, String> {
    let args = parse(args)?;
    let backend = match args.backend {
        Some(name) => demo::choose(Some(name))?.name,
        None => best_backend(),
    };
    let device = match backend {
        BackendName::Flex => Device::flex(),
        #[cfg(feature = "vulkan")]
        BackendName::Vulkan => Device::vulkan(burn_core::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "cuda")]
        BackendName::Cuda => Device::cuda(0),
        other => {
            return Err(format!(
                "generate runs on flex, vulkan or cuda (the Tensor API's devices), not {other}"
            ));
        }
    };
    let path = match &args.model {
        Some(path) => path.clone(),
        None => model_file::smollm2_path().map_err(|e| e.to_string())?,
    };
    let loading = Instant::now();
    let gguf = Gguf::open(&path).map_err(|e| e.to_string())?;
    let tokenizer = Tokenizer::from_gguf(&gguf).map_err(|e| format!("{}: {e}", path.display()))?;
    let model = Llama::load(&gguf, &device, args.dtype).map_err(|e| e.to_string())?;
    let config = model.config().clone();
    drop(gguf);
    eprintln!(
        "generate: {} ({} layers, hidden {}) on {backend} as {:?}, loaded in {:.1} s",
        path.display(),
        config.layers,
        config.hidden,
        args.dtype,
        loading.elapsed().as_secs_f64()
    );

    let mut requests = Vec::with_capacity(args.prompts.len());
    for (id, prompt) in args.prompts.iter().enumerate() {
        let text = if args.raw {
            prompt.text.clone()
        } else {
            tokenizer
                .render_chat(&prompt.text)
                .map_err(|e| e.to_string())?
        };
        requests.push(Request {
            id,
            prompt: tokenizer.encode(&text).map_err(|e| e.to_string())?,
            max_new_tokens: prompt.max_new_tokens.unwrap_or(args.max_new_tokens),
            arrival_step: prompt.arrival_step,
        });
    }
    let drafting = match args.drafting.as_str() {
        "off" => Drafting::Off,
        "ngram" => Drafting::Ngram { max_ngram: 3 },
        "self" => Drafting::SelfSpeculative {
            layers: args
                .draft_layers
                .unwrap_or(config.layers.saturating_sub(4).max(1)),
            min_confidence: args.draft_confidence,
        },
        other => return Err(format!("--spec {other:?}: expected off, ngram or self")),
    };
    let longest = requests
        .iter()
        .map(|r| r.prompt.len() + r.max_new_tokens)
        .max()
        .unwrap_or(0);
    let max_context = (longest + args.draft_tokens + 1)
        .next_multiple_of(64)
        .min(config.context_length);
    let max_batch = args.batch.min(requests.len().max(1));
    let options = EngineOptions {
        drafting,
        draft_tokens: if drafting == Drafting::Off {
            0
        } else {
            args.draft_tokens
        },
        max_batch,
        kv_slots: max_batch * max_context + 1,
        max_context,
        sampling: Sampling {
            temperature: args.temperature,
            seed: args.seed,
        },
        corruption: args.corruption.map(|kind| (kind, 8)),
        fixed_windows: backend != BackendName::Flex,
        profile: args.profile,
        repeat: args.repeat,
        // Greedy steps replay as graphs (whole steps, verify steps too), by default on CUDA only.
        graphs: args.graphs.unwrap_or(backend == BackendName::Cuda),
        // 0: no bound.
        spec_max_tokens: match args.spec_max_tokens {
            Some(most) => (most > 0).then_some(most),
            None => (backend != BackendName::Flex).then_some(kvplan_decoder::linear::VERIFY_TOKENS),
        },
    };
    let eos = if args.ignore_eos {
        Vec::new()
    } else {
        tokenizer.end_of_generation_ids().to_vec()
    };
    let mut engine = Engine::new(model, eos, options).map_err(|e| e.to_string())?;
    // A GPU compiles and autotunes each new step shape (seconds); Flex has nothing to compile.
    if args.warm_up.unwrap_or(backend != BackendName::Flex) {
        let took = engine
            .warm_up(requests.clone())
            .map_err(|e| e.to_string())?;
        eprintln!(
            "generate: warm-up (the same requests, untimed) took {:.1} s",
            took.as_secs_f64()
        );
    }

    // One request streams its text; a batch shows a progress line and prints texts at the end.
    let streaming = requests.len() == 1 && !args.json;
    let mut stream = tokenizer.detokenizer();
    let mut turn_ended = false;
    let mut generated = 0usize;
    // Each request's first and latest token's arrival: its decode time (`decode_ms`).
    let mut arrivals: Vec<Option<(Instant, Instant)>> = vec![None; requests.len()];
    let timer = gpu_timer();
    let started = Instant::now();
    let outcomes = engine
        .run(requests.clone(), |id, tokens| {
            generated += tokens.len();
            let now = Instant::now();
            if let Some(arrival) = arrivals.get_mut(id) {
                *arrival = Some((arrival.map_or(now, |(first, _)| first), now));
            }
            if streaming {
                // The text ends at the end of the turn (tokens after it, under --ignore-eos,
                // are counted, not shown).
                for &token in tokens {
                    turn_ended |= tokenizer.is_eos(token);
                    if turn_ended {
                        break;
                    }
                    if let Ok(Some(text)) = stream.step(&tokenizer, token) {
                        print!("{text}");
                    }
                }
                let _ = std::io::stdout().flush();
            } else if !args.json {
                eprint!(
                    "\rgenerate: {generated} tokens, {:.1} s",
                    started.elapsed().as_secs_f64()
                );
            }
        })
        .map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    if streaming {
        println!("{}", stream.finish(&tokenizer).unwrap_or_default());
    } else if !args.json {
        eprintln!();
    }
    for outcome in &outcomes {
        let decode = arrivals[outcome.id].map_or(0.0, |(first, last)| (last - first).as_secs_f64());
        report(
            &args,
            &tokenizer,
            &requests[outcome.id],
            outcome,
            decode,
            streaming,
        )?;
    }
    summary(&engine, &outcomes, elapsed.as_secs_f64());
    all_replayed(backend, engine.fallen_back())?;
    gpu_time(timer, engine.times().steps);
    if args.profile {
        profile(engine.times());
    }
    if let Some(kind) = args.repeat {
        repeated(kind, engine.times());
    }
    if let Some(injected) = engine.injected() {
        let found = outcomes
            .iter()
            .flat_map(|o| &o.canary_violations)
            .any(|r| r.request == injected.request && r.position == injected.position);
        eprintln!(
            "inject-corruption: {} at request {} slot {} position {}: {}",
            injected.reasons,
            injected.request,
            injected.slot,
            injected.position,
            if found {
                "reported by the canary, request recomputed"
            } else {
                "NOT reported"
            }
        );
        if !found {
            return Ok(ExitCode::FAILURE);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// CUDA when a probe runs there, else Flex: lavapipe-class software Vulkan is slower than Flex for
/// a model, so Vulkan runs when asked for (`--backend vulkan`).
fn best_backend() -> BackendName {
    if cfg!(feature = "cuda") {
        if let Ok(choice) = demo::choose(None) {
            if choice.name == BackendName::Cuda {
                return BackendName::Cuda;
            }
        }
    }
    BackendName::Flex
}

/// A request's tokens up to the end of its turn (the first end-of-generation token, not shown).
fn turn<'a>(tokenizer: &Tokenizer, tokens: &'a [u32]) -> &'a [u32] {
    let end = tokens.iter().position(|&t| tokenizer.is_eos(t));
    &tokens[..end.unwrap_or(tokens.len())]
}

fn report(
    args: &Args,
    tokenizer: &Tokenizer,
    request: &Request,
    outcome: &Outcome,
    decode_seconds: f64,
    streamed: bool,
) -> Result<(), String> {
    let text = tokenizer
        .decode(turn(tokenizer, &outcome.tokens))
        .map_err(|e| e.to_string())?;
    let prompt = &args.prompts[outcome.id].text;
    if args.json {
        let violations: Vec<_> = outcome
            .canary_violations
            .iter()
            .map(|r| serde_json::json!({"slot": r.slot, "position": r.position, "reasons": r.reasons}))
            .collect();
        let line = serde_json::json!({
            "prompt": prompt,
            "text": text,
            "tokens": outcome.tokens,
            "prompt_tokens": request.prompt.len(),
            "drafted": outcome.drafted,
            "accepted": outcome.accepted,
            "steps": outcome.steps,
            "decode_ms": (decode_seconds * 1e6).round() / 1e3,
            "finish": format!("{:?}", outcome.finish).to_lowercase(),
            "canary_violations": violations,
        });
        println!("{line}");
    } else if !streamed {
        println!("--- [{}] {prompt}\n{text}", outcome.id);
    }
    Ok(())
}

fn summary(engine: &Engine, outcomes: &[Outcome], seconds: f64) {
    let tokens: usize = outcomes.iter().map(|o| o.tokens.len()).sum();
    let drafted: usize = outcomes.iter().map(|o| o.drafted).sum();
    let accepted: usize = outcomes.iter().map(|o| o.accepted).sum();
    let times = engine.times();
    let total = times.total.as_secs_f64().max(1e-9);
    let share = |time: std::time::Duration| 100.0 * time.as_secs_f64() / total;
    eprintln!(
        "generate: {} requests, {tokens} tokens in {seconds:.2} s: {:.1} tokens/s; {} steps, {:.2} ms/step \
         (kvplan bookkeeping {:.1}%, stores and attention {:.1}%, rest of the model {:.1}%: \
         the caller's time in kvplan's calls, --repeat-ops measures their cost); \
         drafts accepted {accepted}/{drafted} ({:.0}%); {:.2} tokens/step/request; \
         graphs: {} steps replayed, {} captured",
        outcomes.len(),
        tokens as f64 / seconds,
        times.steps,
        1e3 * total / times.steps.max(1) as f64,
        share(times.kvplan.bookkeeping),
        share(times.kvplan.attention),
        100.0 - share(times.kvplan.total()),
        if drafted > 0 {
            100.0 * accepted as f64 / drafted as f64
        } else {
            0.0
        },
        tokens as f64 / outcomes.iter().map(|o| o.steps).sum::<usize>().max(1) as f64,
        times.replayed,
        times.captured,
    );
}

/// `--repeat-ops`: the median step with each call of `kind` run twice (odd steps) against the
/// median of the others, and the difference: those calls' cost in a pipelined step.
fn repeated(kind: OpKind, times: &StepTimes) {
    let median = |parity: usize| {
        let mut ms: Vec<f64> = (times.step_walls.iter().enumerate())
            .filter(|(step, _)| step % 2 == parity)
            .map(|(_, t)| 1e3 * t.as_secs_f64())
            .collect();
        ms.sort_by(f64::total_cmp);
        ms.get(ms.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (plain, twice) = (median(0), median(1));
    eprintln!(
        "repeat-ops {kind:?}: median step {plain:.3} ms, with them twice {twice:.3} ms: \
         {:.3} ms/step, {:.1}% of the step",
        twice - plain,
        100.0 * (twice - plain) / plain
    );
}

/// `--profile`: each phase's host and device-wait time per step, and the step times over the run
/// (a step that compiles new kernels stands out against the median).
fn profile(times: &StepTimes) {
    let steps = times.steps.max(1) as f64;
    eprintln!("profile: phase, host ms/step, device wait ms/step");
    for phase in &times.phases {
        eprintln!(
            "profile: {:<28} {:>9.3} {:>9.3}",
            phase.name,
            1e3 * phase.host.as_secs_f64() / steps,
            1e3 * phase.wait.as_secs_f64() / steps
        );
    }
    let ms: Vec<f64> = times
        .step_walls
        .iter()
        .map(|t| 1e3 * t.as_secs_f64())
        .collect();
    let mut sorted = ms.clone();
    sorted.sort_by(f64::total_cmp);
    if let Some(&median) = sorted.get(sorted.len() / 2) {
        let shown: Vec<String> = ms.iter().take(12).map(|t| format!("{t:.1}")).collect();
        eprintln!(
            "profile: step ms: median {median:.2}, max {:.1}, first steps {}",
            sorted[sorted.len() - 1],
            shown.join(" ")
        );
        let slow: Vec<String> = ms
            .iter()
            .enumerate()
            .filter(|(_, t)| **t > 3.0 * median)
            .map(|(i, t)| format!("{i}:{t:.0}"))
            .collect();
        eprintln!(
            "profile: steps over 3x the median (step:ms): {}",
            slow.join(" ")
        );
    }
}

fn parse(args: &[String]) -> Result<Args, String> {
    let mut parsed = Args {
        prompts: Vec::new(),
        raw: false,
        drafting: "ngram".into(),
        draft_tokens: 4,
        draft_layers: None,
        draft_confidence: 0.4,
        backend: None,
        max_new_tokens: 64,
        temperature: 0.0,
        seed: 0,
        batch: 8,
        dtype: DType::F32,
        model: None,
        corruption: None,
        json: false,
        ignore_eos: false,
        profile: false,
        repeat: None,
        warm_up: None,
        graphs: None,
        spec_max_tokens: None,
    };
    let mut limit = None;
    let mut rest = args.iter();
    let mut file = None;
    while let Some(arg) = rest.next() {
        let mut value = |flag: &str| {
            rest.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        fn number<T: std::str::FromStr>(flag: &str, text: String) -> Result<T, String> {
            text.parse()
                .map_err(|_| format!("{flag} {text:?}: not a valid number\n{USAGE}"))
        }
        match arg.as_str() {
            "--file" => file = Some(value("--file")?),
            "--raw" => parsed.raw = true,
            "--json" => parsed.json = true,
            "--ignore-eos" => parsed.ignore_eos = true,
            "--profile" => parsed.profile = true,
            "--repeat-ops" => {
                parsed.repeat = Some(match value("--repeat-ops")?.as_str() {
                    "attention" => OpKind::Attention,
                    other => {
                        return Err(format!("--repeat-ops {other:?}: only attention\n{USAGE}"));
                    }
                })
            }
            "--graphs" => {
                parsed.graphs = Some(match value("--graphs")?.as_str() {
                    "on" => true,
                    "off" => false,
                    other => return Err(format!("--graphs {other:?}: on or off\n{USAGE}")),
                })
            }
            "--spec-max-tokens" => {
                parsed.spec_max_tokens =
                    Some(number("--spec-max-tokens", value("--spec-max-tokens")?)?)
            }
            "--warm-up" => parsed.warm_up = Some(true),
            "--no-warm-up" => parsed.warm_up = Some(false),
            "--limit" => limit = Some(number::<usize>("--limit", value("--limit")?)?),
            "--spec" => parsed.drafting = value("--spec")?,
            "--draft-tokens" => {
                parsed.draft_tokens = number("--draft-tokens", value("--draft-tokens")?)?
            }
            "--draft-layers" => {
                parsed.draft_layers = Some(number("--draft-layers", value("--draft-layers")?)?)
            }
            "--draft-confidence" => {
                parsed.draft_confidence =
                    number("--draft-confidence", value("--draft-confidence")?)?
            }
            "--max-new-tokens" => {
                parsed.max_new_tokens = number("--max-new-tokens", value("--max-new-tokens")?)?
            }
            "--temperature" => {
                parsed.temperature = number("--temperature", value("--temperature")?)?
            }
            "--seed" => parsed.seed = number("--seed", value("--seed")?)?,
            "--batch" => parsed.batch = number("--batch", value("--batch")?)?,
            "--model" => parsed.model = Some(PathBuf::from(value("--model")?)),
            "--backend" => {
                parsed.backend = Some(value("--backend")?.parse::<BackendName>()?);
            }
            "--dtype" => {
                parsed.dtype = match value("--dtype")?.as_str() {
                    "f32" => DType::F32,
                    "f64" => DType::F64,
                    "bf16" => DType::BF16,
                    other => return Err(format!("--dtype {other:?}: expected f32, f64 or bf16")),
                }
            }
            "--inject-corruption" => {
                parsed.corruption = Some(match value("--inject-corruption")?.as_str() {
                    "kv-byte" => Corruption::KvByte,
                    "stale-row" => Corruption::StaleRow,
                    other => {
                        return Err(format!(
                            "--inject-corruption {other:?}: expected kv-byte or stale-row"
                        ));
                    }
                })
            }
            flag if flag.starts_with("--") => return Err(format!("unknown flag {flag}\n{USAGE}")),
            prompt => parsed.prompts.push(PromptSpec {
                text: prompt.to_string(),
                arrival_step: 0,
                max_new_tokens: None,
            }),
        }
    }
    if !(parsed.temperature >= 0.0 && parsed.temperature.is_finite()) {
        return Err(format!(
            "--temperature {}: must be a finite number >= 0",
            parsed.temperature
        ));
    }
    if parsed.batch == 0 || parsed.max_new_tokens == 0 {
        return Err("--batch and --max-new-tokens must be at least 1".into());
    }
    if parsed.draft_tokens == 0 && parsed.drafting != "off" {
        return Err(format!(
            "--draft-tokens 0 drafts nothing: use --spec off, or --draft-tokens 1 or more with --spec {}",
            parsed.drafting
        ));
    }
    if limit == Some(0) {
        return Err("--limit 0 leaves no prompt to serve".into());
    }
    if let Some(file) = file {
        parsed.prompts.extend(read_workload(&file)?);
    }
    if let Some(limit) = limit {
        parsed.prompts.truncate(limit);
    }
    if parsed.prompts.is_empty() {
        parsed.prompts = DEFAULT_PROMPTS
            .iter()
            .map(|text| PromptSpec {
                text: text.to_string(),
                arrival_step: 0,
                max_new_tokens: None,
            })
            .collect();
    }
    Ok(parsed)
}

/// A workload file: JSON lines with `prompt` and optional `arrival_step` and `max_new_tokens`,
/// or plain prompt lines.
fn read_workload(file: &str) -> Result<Vec<PromptSpec>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
    let mut prompts = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        if !line.starts_with('{') {
            prompts.push(PromptSpec {
                text: line.to_string(),
                arrival_step: 0,
                max_new_tokens: None,
            });
            continue;
        }
        let at = |what: &str| format!("{file}:{}: {what}", number + 1);
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| at(&format!("not JSON: {e}")))?;
        let text = value
            .get("prompt")
            .and_then(|p| p.as_str())
            .ok_or_else(|| at("field \"prompt\" (a string) is missing"))?;
        let count = |field: &str| -> Result<Option<usize>, String> {
            match value.get(field) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| at(&format!("field {field:?} must be a non-negative integer"))),
            }
        };
        prompts.push(PromptSpec {
            text: text.to_string(),
            arrival_step: count("arrival_step")?.unwrap_or(0),
            max_new_tokens: count("max_new_tokens")?,
        });
    }
    Ok(prompts)
}

/// With `KVPLAN_GPU_TIME` set on a CUDA build: CUPTI's kernel records from here on (what came
/// before, the warm-up included, discarded).
#[cfg(feature = "cuda")]
fn gpu_timer() -> Option<crate::cupti::KernelTimer> {
    std::env::var_os("KVPLAN_GPU_TIME")?;
    let timer = crate::cupti::KernelTimer::start()
        .map_err(|error| eprintln!("gpu-time: none ({error})"))
        .ok()?;
    let _ = timer.take();
    Some(timer)
}

#[cfg(not(feature = "cuda"))]
fn gpu_timer() -> Option<()> {
    None
}

/// The kernels' GPU time a step (the prefill step included), in all and kernel by kernel.
#[cfg(feature = "cuda")]
fn gpu_time(timer: Option<crate::cupti::KernelTimer>, steps: usize) {
    let Some(stats) = timer.and_then(|timer| timer.take().ok()) else {
        return;
    };
    let steps = steps.max(1) as f64;
    eprintln!(
        "gpu-time: {steps} steps, {:.0} kernels a step, {:.1} us of kernel time a step (prefill included)",
        stats.kernels as f64 / steps,
        stats.total_ns as f64 / steps / 1e3
    );
    for (name, count, ns) in stats.per_kernel.iter().take(30) {
        eprintln!(
            "gpu-kernel: {:>8.2} us {:>6.1} launches a step  {name}",
            *ns as f64 / steps / 1e3,
            *count as f64 / steps
        );
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu_time(_: Option<()>, _: usize) {}

/// On a GPU every captured step must replay as a graph: a capture that fell back reruns its
/// step eagerly at each replay, so the numbers would not be a replayed step's (Flex always falls
/// back: it has no graphs).
fn all_replayed(backend: BackendName, fallen_back: usize) -> Result<(), String> {
    if backend != BackendName::Flex && fallen_back > 0 {
        return Err(format!(
            "{fallen_back} graph captures fell back to running their steps again: these are not \
             replayed steps' numbers"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{BackendName, all_replayed, parse};

    fn refusal(args: &[&str]) -> String {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        parse(&args).expect_err("refused")
    }

    #[test]
    fn a_capture_that_fell_back_is_refused_on_a_gpu() {
        assert_eq!(all_replayed(BackendName::Flex, 3), Ok(()));
        assert_eq!(all_replayed(BackendName::Vulkan, 0), Ok(()));
        assert_eq!(
            all_replayed(BackendName::Vulkan, 2).unwrap_err(),
            "2 graph captures fell back to running their steps again: these are not replayed \
             steps' numbers"
        );
    }

    #[test]
    fn flags_that_would_serve_nothing_are_refused() {
        assert_eq!(
            refusal(&["--spec", "ngram", "--draft-tokens", "0"]),
            "--draft-tokens 0 drafts nothing: use --spec off, or --draft-tokens 1 or more with --spec ngram"
        );
        assert_eq!(
            refusal(&["--limit", "0"]),
            "--limit 0 leaves no prompt to serve"
        );
        assert!(
            parse(&[
                "--spec".into(),
                "off".into(),
                "--draft-tokens".into(),
                "0".into()
            ])
            .is_ok()
        );
        assert!(refusal(&["--graphs", "maybe"]).starts_with("--graphs \"maybe\": on or off\n"));
        let graphs = |value: &str| parse(&["--graphs".into(), value.into()]).map(|a| a.graphs);
        assert_eq!(graphs("on"), Ok(Some(true)));
        assert_eq!(graphs("off"), Ok(Some(false)));
        assert!(
            refusal(&["--dtype", "f16"]).starts_with("--dtype \"f16\": expected f32, f64 or bf16")
        );
        let dtype = |value: &str| parse(&["--dtype".into(), value.into()]).map(|a| a.dtype);
        assert_eq!(dtype("bf16"), Ok(burn_core::tensor::DType::BF16));
        let bound = |value: &str| parse(&["--spec-max-tokens".into(), value.into()]);
        assert_eq!(bound("0").map(|a| a.spec_max_tokens), Ok(Some(0)));
        assert!(
            bound("x")
                .unwrap_err()
                .starts_with("--spec-max-tokens \"x\": not a valid number\n")
        );
    }
}
