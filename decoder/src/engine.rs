//! The serving loop: continuous batching over a paged KV cache kept by kvplan, speculative steps
//! (n-gram or self-speculative drafts verified by the target in one forward), and the kv-canary
//! on the real cache every step.
//!
//! The paged KV state is one `kvplan::PagedKv`; a step, for the running requests:
//! 1. host: each request's input (its tokens not yet in the cache: a whole prompt, or the last
//!    token) and, for a decode row, a draft;
//! 2. self-speculative only: `draft_tokens` one-token steps of the first layers draft on the
//!    device (each committed to the cache, all rolled back after);
//! 3. `PagedKv::begin` with each request's window; the target forward, each layer's fused
//!    projection through `PagedKv::attend` (its K/V stored, its queries attended);
//! 4. one read-back of the target's tokens; host acceptance;
//! 5. `PagedKv::end` with the tokens each request keeps: rejected slots go back, the canary
//!    records the kept tokens and verifies every committed one, and the violations it reports
//!    make their requests recompute their caches.
//!
//! With graphs, a greedy step whose rows each decode one token (and its drafts) runs 3 to 5 as
//! one device half: acceptance on the device, `end` keeping every window (the canary records
//! every token the forward stored), one read of the tokens, kept counts and statuses; each
//! row's rejected tokens then go back with `PagedKv::truncate`. Its first step of a window
//! shape runs that device half eagerly (its kernels compiled), the next is captured, the rest
//! replay.

use std::collections::{HashMap, HashSet, VecDeque};
use std::rc::Rc;
use std::time::{Duration, Instant};

use burn_core::tensor::Bool;
use burn_core::tensor::{DType, FloatDType, Int, Tensor, TensorData};
use kvplan::{CanaryConfig, PagedKv, PagedKvConfig, RequestId, StepGraph, StepInputs, StepReport};

use crate::clock::{OpClock, OpKind, OpTimes};
use crate::draft::{Backoff, ngram_draft};
use crate::linear::greedy;
use crate::model::Llama;
use crate::sample::{Rng, Sampling, accept_greedy, accept_sampled};
use crate::{DecoderError, Result};

/// How a decode step drafts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Drafting {
    /// No drafts: one token per request per step.
    Off,
    /// Prompt lookup: the tokens that followed the latest earlier match of the context's last
    /// `1..=max_ngram` tokens.
    Ngram {
        /// Longest suffix tried first.
        max_ngram: usize,
    },
    /// Early exit: the first `layers` blocks, the final norm and the LM head draft.
    SelfSpeculative {
        /// Blocks the draft runs.
        layers: usize,
        /// A row stops drafting after a token the draft gave less probability than this
        /// (transformers' `assistant_confidence_threshold`); 0 drafts every token.
        min_confidence: f32,
    },
}

/// A fault to inject once, to show that the canary catches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Corruption {
    /// A byte flipped in a live, committed K row (layer 0) of a running request.
    KvByte,
    /// A request's table row names a slot that now belongs to another request (vLLM 56734).
    StaleRow,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Drafting method.
    pub drafting: Drafting,
    /// Draft tokens per decode step.
    pub draft_tokens: usize,
    /// Requests running at once (rows of `req_to_token` besides the padding row).
    pub max_batch: usize,
    /// KV slots per pool, slot 0 (the padding sink) included.
    pub kv_slots: usize,
    /// Columns of `req_to_token`: the longest context a request may reach.
    pub max_context: usize,
    /// Greedy (temperature 0) or seeded sampling.
    pub sampling: Sampling,
    /// A fault injected at step `.1`.
    pub corruption: Option<(Corruption, usize)>,
    /// Pad every n-gram match's draft to `draft_tokens` (two window sizes, so few step shapes,
    /// which a GPU compiles once), and with `graphs` every decode row's once one row drafts (one
    /// shape a batch size); off on the CPU, where each extra verified token costs time.
    pub fixed_windows: bool,
    /// Wait for the device at the end of each step phase and record where the time went
    /// ([`StepTimes::phases`]); slower, for finding what a step spends.
    pub profile: bool,
    /// Benchmarks only: on every other step each `PagedKv::attend` runs twice (`Attention`: the
    /// same rows stored again, the same queries attended again: the same output), so that those
    /// steps' rise over the others is the calls' cost in a pipelined step
    /// ([`StepTimes::step_walls`]). `Bookkeeping` is refused: `begin` and `end` cannot run twice.
    pub repeat: Option<OpKind>,
    /// Replay greedy decode steps as graphs: each window shape's whole step (every row one
    /// token and its drafts) is captured once after its first eager run (`PagedKv::capture`)
    /// and replayed after: forward, argmax, acceptance on the device, kvplan's bookkeeping and
    /// the canary inside; one write in, one read out. Decode steps without drafts get a graph
    /// per batch size, verify steps up to [`VERIFY_GRAPHS`] shapes (others run eagerly).
    pub graphs: bool,
    /// A step drafts only while its rows' verify windows (`draft_tokens + 1` each) total at most
    /// this many tokens; past it the step decodes (vLLM's `speculative_disable_by_batch_size`):
    /// a wide verify step costs several decode steps (`benches/RESULTS.md`, session 39), more
    /// than its few kept drafts save. `None`: every step drafts.
    pub spec_max_tokens: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            drafting: Drafting::Off,
            draft_tokens: 4,
            max_batch: 8,
            kv_slots: 8192,
            max_context: 1024,
            sampling: Sampling::greedy(),
            corruption: None,
            fixed_windows: true,
            profile: false,
            repeat: None,
            graphs: false,
            spec_max_tokens: Some(crate::linear::VERIFY_TOKENS),
        }
    }
}

/// A prompt to serve.
#[derive(Debug, Clone)]
pub struct Request {
    /// Caller's id, echoed in the outcome.
    pub id: usize,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// The engine step at which the request arrives.
    pub arrival_step: usize,
}

/// Why a request stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// It produced an end-of-sequence token.
    Eos,
    /// It reached `max_new_tokens`.
    Length,
}

/// A corruption the canary reported, attributed to the request whose context it hit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported {
    /// The request.
    pub request: usize,
    /// The KV slot the request's table row names.
    pub slot: i64,
    /// The position in the request's sequence.
    pub position: i64,
    /// The canary's reasons.
    pub reasons: String,
}

/// A finished request.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The request's id.
    pub id: usize,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids (EOS included when it ended the request).
    pub tokens: Vec<u32>,
    /// Draft tokens proposed for this request.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Steps the request took part in.
    pub steps: usize,
    /// Corruptions the canary found in its context (each made it recompute its cache).
    pub canary_violations: Vec<Reported>,
    /// Why it stopped.
    pub finish: Finish,
}

/// Where the time of the steps went (host wall time; a read-back waits for the device).
#[derive(Debug, Clone, Default)]
pub struct StepTimes {
    /// Steps run.
    pub steps: usize,
    /// Steps replayed from a graph ([`EngineOptions::graphs`]).
    pub replayed: usize,
    /// Steps captured into a graph (a batch size's first, or again after a mismatch).
    pub captured: usize,
    /// Whole steps.
    pub total: Duration,
    /// The caller's time inside kvplan's calls, by kind (see [`crate::clock`]).
    pub kvplan: OpTimes,
    /// Token read-backs (the wait for the model's work on the device).
    pub readback: Duration,
    /// With [`EngineOptions::profile`] or [`EngineOptions::repeat`]: each step's wall time.
    pub step_walls: Vec<Duration>,
    /// With [`EngineOptions::profile`]: the steps' phases in step order, summed over the steps.
    pub phases: Vec<Phase>,
}

/// One phase of the steps, summed over them ([`EngineOptions::profile`]).
#[derive(Debug, Clone)]
pub struct Phase {
    /// What the phase does.
    pub name: &'static str,
    /// Host time until the phase had enqueued its work (read-backs inside it included).
    pub host: Duration,
    /// The wait for the device to finish it after that.
    pub wait: Duration,
}

impl StepTimes {
    fn charge(&mut self, name: &'static str, host: Duration, wait: Duration) {
        match self.phases.iter_mut().find(|phase| phase.name == name) {
            Some(phase) => {
                phase.host += host;
                phase.wait += wait;
            }
            None => self.phases.push(Phase { name, host, wait }),
        }
    }
}

/// A request in the running batch.
struct Running {
    id: usize,
    /// Its request in the paged KV state.
    kv: RequestId,
    prompt_tokens: usize,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache (`tokens[..kv_len]`).
    kv_len: usize,
    max_new_tokens: usize,
    drafted: usize,
    accepted: usize,
    steps: usize,
    reported: Vec<Reported>,
    /// When it looks up n-gram drafts.
    backoff: Backoff,
}

impl Running {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_tokens
    }
}

/// One request's work in a step.
struct RowWork {
    /// Index into `running`.
    index: usize,
    kv: RequestId,
    /// The committed length: where the row's window starts.
    start: usize,
    /// Tokens known to follow (`tokens[kv_len..]`).
    input: Vec<u32>,
    /// Draft tokens after them.
    draft: Vec<u32>,
    /// Whether the draft was looked up (n-gram), not padding.
    lookup: bool,
    /// The draft's distribution at each draft token (sampled self-speculative drafts; `None`: a
    /// deterministic draft, a point mass).
    draft_probs: Option<Vec<Vec<f32>>>,
}

impl RowWork {
    fn window(&self) -> usize {
        self.input.len() + self.draft.len()
    }

    /// The window's tokens: the input, then the draft.
    fn tokens(&self) -> Vec<u32> {
        self.input.iter().chain(&self.draft).copied().collect()
    }
}

/// Each row's window for `PagedKv::begin`, its tokens `tokens[i]`.
fn step_windows<'a>(work: &[RowWork], tokens: &'a [Vec<u32>]) -> Vec<(RequestId, &'a [u32])> {
    work.iter()
        .zip(tokens)
        .map(|(w, tokens)| (w.kv, tokens.as_slice()))
        .collect()
}

/// Violation rows the canary's ring keeps between reads.
const RING_ROWS: usize = 256;
/// The layer whose K/V pool the canary fingerprints (each slot's K and V bytes).
const CANARY_LAYER: usize = 0;

/// A model, its paged KV cache, and the requests being served.
pub struct Engine {
    /// Shared with the captured steps' closures.
    model: Rc<Llama>,
    options: EngineOptions,
    kv: PagedKv,
    /// Times kvplan's calls.
    clock: OpClock,
    eos: Vec<u32>,
    rng: Rng,
    waiting: VecDeque<Request>,
    running: Vec<Running>,
    finished: Vec<Outcome>,
    step: usize,
    times: StepTimes,
    /// Violations reported in this step, attributed (each request once), handled at its end.
    reported: Vec<Reported>,
    injected: Option<Reported>,
    /// The end of the last profiled phase.
    lap: Instant,
    /// Window shapes (each row's window) of greedy steps whose device half ran eagerly (its
    /// kernels compiled), and their graphs.
    warmed: HashSet<Vec<usize>>,
    graphs: HashMap<Vec<usize>, GreedyGraph>,
}

/// The most verify-window shapes captured as graphs (each holds its step's buffers, its logits
/// among them); steps of other shapes run eagerly.
pub const VERIFY_GRAPHS: usize = 16;

/// The device half of a greedy step whose rows each decode one token and its drafts, run
/// eagerly or inside a graph: the forward, the target's token after each window token and,
/// with drafts, each row's kept count (`accept`), attached for the step's one read.
fn greedy_step(
    model: &Llama,
    kv: &mut PagedKv,
    inputs: &StepInputs,
    accept: Option<&Acceptance>,
) -> std::result::Result<(), String> {
    let layers = model.config().layers;
    let hidden = model
        .forward(
            inputs.ids.clone(),
            inputs.positions.clone(),
            0..layers,
            |layer, qkv| Ok(kv.attend(layer, qkv)?),
        )
        .map_err(|error| error.to_string())?;
    let tokens = greedy(model.logits(hidden)).cast(DType::I64);
    let attached = match accept {
        Some(accept) => {
            let kept = accept.kept(inputs.ids.clone(), tokens.clone());
            Tensor::cat(vec![tokens, kept], 0)
        }
        None => tokens,
    };
    kv.attach(attached).map_err(|error| error.to_string())
}

/// Greedy acceptance on the device for one window shape (its tables uploaded once, before a
/// capture: a graph reads stable buffers). A row keeps its input and each draft token up to the
/// first the target disagrees with, then the target's token there: `1 + accepted` tokens.
pub(crate) struct Acceptance {
    /// Each window token's successor in its window (itself for the last).
    next: Tensor<1, Int>,
    /// Whether a token has a draft after it to compare (a window's last stops its row).
    compared: Tensor<1, Bool>,
    /// Each token's count kept if the row stops after it: its place in its window, plus one.
    kept_if_stop: Tensor<1, Int>,
    /// The tokens laid out `[rows, widest]`, a short row padded with its last token (which
    /// always stops it); `None` where every window is as wide.
    padded: Option<Tensor<1, Int>>,
    rows: usize,
    widest: usize,
}

impl Acceptance {
    pub(crate) fn new(windows: &[usize], device: &burn_core::tensor::Device) -> Self {
        let widest = windows.iter().copied().max().unwrap_or(1);
        let (mut next, mut compared, mut kept_if_stop, mut padded) =
            (vec![], vec![], vec![], vec![]);
        let mut offset = 0;
        for &n in windows {
            for j in 0..n {
                let at = (offset + j) as i64;
                next.push(if j + 1 < n { at + 1 } else { at });
                compared.push(j + 1 < n);
                kept_if_stop.push(j as i64 + 1);
            }
            padded.extend((0..widest).map(|j| (offset + j.min(n - 1)) as i64));
            offset += n;
        }
        let uniform = windows.iter().all(|&n| n == widest);
        let bools = TensorData::new(compared, [offset]);
        Self {
            next: ints(next.into_iter(), device),
            compared: Tensor::from_data(bools, device),
            kept_if_stop: ints(kept_if_stop.into_iter(), device),
            padded: (!uniform).then(|| ints(padded.into_iter(), device)),
            rows: windows.len(),
            widest,
        }
    }

    /// Each row's kept count from the window's ids and the target's token after each.
    pub(crate) fn kept(&self, ids: Tensor<1, Int>, targets: Tensor<1, Int>) -> Tensor<1, Int> {
        let drafted = ids.cast(DType::I64).select(0, self.next.clone());
        let agrees = drafted.equal(targets).bool_and(self.compared.clone());
        // Past any stop, so that the row's least value is where it first stops.
        let beyond = self.widest as i64 + 1;
        let stops = self.kept_if_stop.clone().mask_fill(agrees, beyond);
        let stops = match &self.padded {
            Some(padded) => stops.select(0, padded.clone()),
            None => stops,
        };
        stops
            .reshape([self.rows, self.widest])
            .min_dim(1)
            .reshape([self.rows])
    }
}

/// A captured greedy step (or why its forward failed); its tokens come with the step's report.
type GreedyGraph = StepGraph<'static, std::result::Result<(), String>>;

impl Engine {
    /// An engine over `model` with an empty cache; `eos` are the token ids that end a request.
    pub fn new(model: Llama, eos: Vec<u32>, options: EngineOptions) -> Result<Self> {
        let device = model.device().clone();
        let config = model.config().clone();
        if let Drafting::SelfSpeculative {
            layers,
            min_confidence,
        } = options.drafting
        {
            if layers == 0 || layers >= config.layers {
                return Err(DecoderError::Options(format!(
                    "self-speculative draft layers {layers} must be in 1..{}",
                    config.layers
                )));
            }
            if !(0.0..=1.0).contains(&min_confidence) {
                return Err(DecoderError::Options(format!(
                    "self-speculative draft confidence {min_confidence} must be in 0..=1"
                )));
            }
        }
        if options.max_context > config.context_length {
            return Err(DecoderError::Options(format!(
                "max context {} exceeds the model's context length {}",
                options.max_context, config.context_length
            )));
        }
        if options.max_batch == 0 || options.kv_slots < 2 {
            return Err(DecoderError::Options(format!(
                "max batch {} and KV slots {} leave nothing to serve with",
                options.max_batch, options.kv_slots
            )));
        }
        if options.repeat == Some(OpKind::Bookkeeping) {
            return Err(DecoderError::Options(
                "repeat: a step's begin and end cannot run twice (attention can)".into(),
            ));
        }
        let kv = PagedKv::new(
            PagedKvConfig {
                layers: config.layers,
                query_heads: config.heads,
                kv_heads: config.kv_heads,
                head_dim: config.head_dim,
                slots: options.kv_slots - 1,
                max_requests: options.max_batch,
                max_context: options.max_context,
                dtype: model.dtype(),
                canary: Some(CanaryConfig {
                    ring_rows: RING_ROWS,
                    layers: vec![CANARY_LAYER],
                    real_kv: true,
                }),
            },
            &device,
        )?;
        Ok(Self {
            kv,
            clock: OpClock::default(),
            eos,
            rng: Rng::new(options.sampling.seed),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            step: 0,
            times: StepTimes::default(),
            reported: Vec::new(),
            injected: None,
            lap: Instant::now(),
            warmed: HashSet::new(),
            graphs: HashMap::new(),
            model: Rc::new(model),
            options,
        })
    }

    /// Serves `requests` to the end; `on_tokens(id, new_tokens)` sees each request's tokens as
    /// they are committed. Outcomes come back in order of id.
    pub fn run(
        &mut self,
        mut requests: Vec<Request>,
        mut on_tokens: impl FnMut(usize, &[u32]),
    ) -> Result<Vec<Outcome>> {
        requests.sort_by_key(|r| (r.arrival_step, r.id));
        for request in &requests {
            let longest =
                request.prompt.len() + request.max_new_tokens + self.options.draft_tokens + 1;
            if request.prompt.is_empty()
                || request.max_new_tokens == 0
                || longest > self.options.max_context
            {
                return Err(DecoderError::Options(format!(
                    "request {}: a prompt of {} tokens, {} new and {} draft tokens (at least 1 each of prompt and new) do not fit max context {}",
                    request.id,
                    request.prompt.len(),
                    request.max_new_tokens,
                    self.options.draft_tokens,
                    self.options.max_context
                )));
            }
            if longest > self.kv.config().slots {
                return Err(DecoderError::Options(format!(
                    "request {} may need {longest} KV slots, the pool has {}",
                    request.id,
                    self.kv.config().slots
                )));
            }
        }
        self.waiting = requests.into();
        while !self.waiting.is_empty() || !self.running.is_empty() {
            self.admit()?;
            if self.running.is_empty() {
                self.step += 1;
                continue;
            }
            self.run_step(&mut on_tokens)?;
        }
        let mut finished = std::mem::take(&mut self.finished);
        finished.sort_by_key(|o| o.id);
        Ok(finished)
    }

    /// Serves `requests` untimed and forgets them, so that every step shape they reach is
    /// compiled and autotuned before the served run (a server's graph capture at start). The
    /// step clock, the times and the sampler then start again; a fault to inject waits for the
    /// served run.
    pub fn warm_up(&mut self, requests: Vec<Request>) -> Result<Duration> {
        let started = Instant::now();
        let corruption = self.options.corruption.take();
        let served = self.run(requests, |_, _| {});
        self.options.corruption = corruption;
        served?;
        // Every request left: the paged KV state hands out slots and rows as a fresh one does.
        self.step = 0;
        self.times = StepTimes::default();
        self.rng = Rng::new(self.options.sampling.seed);
        Ok(started.elapsed())
    }

    /// Restarts the sampling generator from `seed` (an idle engine serves the next run with it).
    pub fn reseed(&mut self, seed: u64) {
        self.options.sampling.seed = seed;
        self.rng = Rng::new(seed);
    }

    /// The model back, for another engine (its graphs, which hold it, dropped).
    pub fn into_model(mut self) -> Llama {
        self.graphs.clear();
        match Rc::try_unwrap(self.model) {
            Ok(model) => model,
            Err(_) => unreachable!("only the engine's graphs share the model"),
        }
    }

    /// Where the steps' time went.
    pub fn times(&self) -> &StepTimes {
        &self.times
    }

    /// `((free slots, slots), (free rows, rows))`: equal pairs when nothing is running.
    pub fn free_resources(&self) -> ((usize, usize), (usize, usize)) {
        let config = self.kv.config();
        (
            (self.kv.free_slots(), config.slots),
            (self.kv.free_rows(), config.max_requests),
        )
    }

    /// Steps captured as graphs ([`EngineOptions::graphs`]), one per window shape.
    pub fn graphs(&self) -> usize {
        self.graphs.len()
    }

    /// Graphs whose capture fell back to running the step again at each replay (always on Flex;
    /// on a GPU a kernel compiled inside the capture, burn issue 5772).
    pub fn fallen_back(&self) -> usize {
        self.graphs.values().filter(|g| !g.is_hardware()).count()
    }

    /// The corruption injected, if any (request, slot, position).
    pub fn injected(&self) -> Option<&Reported> {
        self.injected.as_ref()
    }

    /// The target's distribution of the token after `context` at the engine's temperature (a
    /// sampling engine, nothing running): one prefill through the same cache, slots given back.
    pub fn next_token_distribution(&mut self, context: &[u32]) -> Result<Vec<f32>> {
        if self.options.sampling.is_greedy() || !self.running.is_empty() || context.is_empty() {
            return Err(DecoderError::Options(
                "next_token_distribution needs a sampling engine with nothing running and a context".into(),
            ));
        }
        let kv = self.kv.add()?;
        let work = vec![RowWork {
            index: 0,
            kv,
            start: 0,
            input: context.to_vec(),
            draft: Vec::new(),
            lookup: false,
            draft_probs: None,
        }];
        let targets = self.verify(&work);
        let ended = self.kv.end(&[0]);
        self.kv.remove(kv)?;
        ended?;
        match targets?.pop() {
            Some(Target::Probs(mut rows)) => Ok(rows.pop().expect("one position")),
            _ => unreachable!("a sampling engine's verify gives distributions"),
        }
    }

    /// Moves arrived requests into the batch while rows and slots last.
    fn admit(&mut self) -> Result<()> {
        while let Some(request) = self.waiting.front() {
            let room = request.prompt.len() + self.options.draft_tokens + 1;
            if request.arrival_step > self.step
                || self.running.len() >= self.options.max_batch
                || self.kv.free_slots() < room + self.reserved_slots()
            {
                break;
            }
            let request = self.waiting.pop_front().expect("front exists");
            let kv = self.kv.add()?;
            self.running.push(Running {
                id: request.id,
                kv,
                prompt_tokens: request.prompt.len(),
                tokens: request.prompt,
                kv_len: 0,
                max_new_tokens: request.max_new_tokens,
                drafted: 0,
                accepted: 0,
                steps: 0,
                reported: Vec::new(),
                backoff: Backoff::default(),
            });
        }
        Ok(())
    }

    /// Slots the running requests may still need for one step each.
    fn reserved_slots(&self) -> usize {
        self.running.len() * (self.options.draft_tokens + 1)
    }

    fn run_step(&mut self, on_tokens: &mut impl FnMut(usize, &[u32])) -> Result<()> {
        let started = Instant::now();
        self.lap = started;
        if let Some((kind, at)) = self.options.corruption {
            if at <= self.step && self.injected.is_none() {
                self.inject(kind)?;
            }
        }
        let mut work = self.plan_rows();
        self.lap("plan rows");
        if let Drafting::SelfSpeculative {
            layers,
            min_confidence,
        } = self.options.drafting
        {
            self.draft_self(&mut work, layers, min_confidence)?;
            self.lap("self-speculative drafts");
        }
        let report = match self.greedy_step(&work)? {
            Some((targets, report)) => {
                let keep = self.accept(&work, targets, on_tokens);
                // The step kept every window: each row's rejected tokens go back.
                for (w, &kept) in work.iter().zip(&keep) {
                    if kept < w.window() {
                        self.kv.truncate(w.kv, w.start + kept)?;
                    }
                }
                self.lap("graph step");
                report
            }
            None => {
                let targets = self.verify(&work)?;
                let keep = self.accept(&work, targets, on_tokens);
                self.lap("accept");
                let span = self.clock.start();
                let report = self.kv.end(&keep);
                self.clock.stop(span, OpKind::Bookkeeping);
                report?
            }
        };
        self.attribute(&report);
        self.recompute_reported()?;
        self.lap("canary, status check");
        self.finish_requests()?;
        self.clock.drain_into(&mut self.times.kvplan);
        self.times.steps += 1;
        self.times.total += started.elapsed();
        if self.options.profile || self.options.repeat.is_some() {
            self.times.step_walls.push(started.elapsed());
        }
        self.step += 1;
        Ok(())
    }

    /// Each row's window in a step that graphs may run: greedy, every row decoding one token
    /// (and its drafts).
    fn graph_windows(&self, work: &[RowWork]) -> Option<Vec<usize>> {
        let decoding = work.iter().all(|w| w.input.len() == 1);
        (self.options.graphs
            && self.options.sampling.is_greedy()
            && self.options.repeat.is_none()
            && decoding)
            .then(|| work.iter().map(RowWork::window).collect())
    }

    /// A greedy step graphs may run ([`Self::graph_windows`]; `None`: not one): its device half
    /// ([`greedy_step`]) run eagerly the first time its window shape comes, captured the next
    /// (a verify shape while there is room), replayed after. Each row's tokens as accepted on
    /// the device, and the step's report; every window is kept (the caller truncates).
    fn greedy_step(&mut self, work: &[RowWork]) -> Result<Option<(Vec<Target>, StepReport)>> {
        let Some(shape) = self.graph_windows(work) else {
            return Ok(None);
        };
        let tokens: Vec<Vec<u32>> = work.iter().map(RowWork::tokens).collect();
        let windows = step_windows(work, &tokens);
        let drafted = shape.iter().any(|&n| n > 1);
        let device = self.model.device().clone();
        let accept = || drafted.then(|| Acceptance::new(&shape, &device));
        let verify_graphs = self.graphs.keys().filter(|s| s.iter().any(|&n| n > 1));
        let room = !drafted || verify_graphs.count() < VERIFY_GRAPHS;
        let mut report = None;
        if let Some(graph) = self.graphs.get_mut(&shape) {
            match self.kv.replay(graph, &windows) {
                Ok((out, replayed)) => {
                    out.clone().map_err(DecoderError::Model)?;
                    self.times.replayed += 1;
                    report = Some(replayed);
                }
                // A pool or the table was replaced (an injected fault): capture again.
                Err(kvplan::Error::GraphMismatch { .. }) => {
                    self.graphs.remove(&shape);
                }
                Err(error) => return Err(error.into()),
            }
        }
        let report = match report {
            Some(report) => report,
            None if self.warmed.contains(&shape) && room => {
                let model = Rc::clone(&self.model);
                let accept = accept();
                let (graph, report) = self.kv.capture(&windows, move |kv, inputs| {
                    greedy_step(&model, kv, inputs, accept.as_ref())
                })?;
                self.captured(&graph)?;
                self.graphs.insert(shape.clone(), graph);
                report
            }
            None => {
                let span = self.clock.start();
                let inputs = self.kv.begin(&windows);
                self.clock.stop(span, OpKind::Bookkeeping);
                let inputs = inputs?;
                greedy_step(&self.model, &mut self.kv, &inputs, accept().as_ref())
                    .map_err(DecoderError::Model)?;
                let span = self.clock.start();
                let report = self.kv.end(&shape);
                self.clock.stop(span, OpKind::Bookkeeping);
                self.warmed.insert(shape.clone());
                report?
            }
        };
        let targets = accepted_targets(&report.attached, &shape)?;
        Ok(Some((targets, report)))
    }

    /// A graph's capture counted (and a warning at the engine's first capture that fell back to
    /// running its closure); its forward's error, if any.
    fn captured(&mut self, graph: &GreedyGraph) -> Result<()> {
        if !graph.is_hardware() && self.fallen_back() == 0 {
            eprintln!("graphs: a capture fell back to running each step again");
        }
        self.times.captured += 1;
        match graph.output() {
            Some(out) => out.clone().map_err(DecoderError::Model),
            None => Err(DecoderError::Model(
                "a capture that returned has its output".to_string(),
            )),
        }
    }

    /// Each running request's window for this step.
    fn plan_rows(&self) -> Vec<RowWork> {
        let k = self.options.draft_tokens;
        let drafts = self
            .options
            .spec_max_tokens
            .is_none_or(|most| self.running.len() * (k + 1) <= most);
        let mut work = Vec::with_capacity(self.running.len());
        for (index, request) in self.running.iter().enumerate() {
            let input = request.tokens[request.kv_len..].to_vec();
            let decoding = drafts && input.len() == 1;
            let draft = match self.options.drafting {
                Drafting::Ngram { .. } if decoding && !request.backoff.ready() => Vec::new(),
                Drafting::Ngram { max_ngram } if decoding => {
                    // A row without a match verifies its one token. A match is padded to k: two
                    // window sizes keep the step's shapes (the device's compiled kernels) few;
                    // a filler token is only a worse guess.
                    let mut draft = ngram_draft(&request.tokens, max_ngram, k);
                    if self.options.fixed_windows && !draft.is_empty() {
                        let filler = draft[draft.len() - 1];
                        draft.resize(k, filler);
                    }
                    draft
                }
                // Placeholders, drafted on the device before the verify forward.
                Drafting::SelfSpeculative { .. } if decoding => vec![0; k],
                _ => Vec::new(),
            };
            work.push(RowWork {
                index,
                kv: request.kv,
                start: request.kv_len,
                lookup: matches!(self.options.drafting, Drafting::Ngram { .. })
                    && !draft.is_empty(),
                input,
                draft,
                draft_probs: None,
            });
        }
        // With graphs, a decode row without a match verifies its last token repeated once any
        // row drafts: the batch's windows one shape (one graph), not one of 2^batch.
        let padded = matches!(self.options.drafting, Drafting::Ngram { .. })
            && self.options.graphs
            && self.options.fixed_windows
            && work.iter().all(|w| w.input.len() == 1)
            && work.iter().any(|w| !w.draft.is_empty());
        if padded {
            for w in work.iter_mut().filter(|w| w.draft.is_empty()) {
                w.draft = vec![w.input[0]; k];
            }
        }
        work
    }

    /// Self-speculative drafting: up to `k` one-token steps of the first `layers` blocks over
    /// the decode rows; a row stops after a token the draft gave less than `min_confidence`
    /// (its window shrinks). Each step commits its token's K/V (the next one attends over it),
    /// and every drafting row is rolled back to its committed length after: the verify forward
    /// stores the target's K/V for the whole window.
    fn draft_self(
        &mut self,
        work: &mut [RowWork],
        layers: usize,
        min_confidence: f32,
    ) -> Result<()> {
        let k = self.options.draft_tokens;
        let mut drafting: Vec<usize> = (0..work.len())
            .filter(|&i| !work[i].draft.is_empty())
            .collect();
        for &i in &drafting {
            work[i].draft.clear();
        }
        let rolled_back = drafting.clone();
        let mut current: Vec<u32> = drafting.iter().map(|&i| work[i].input[0]).collect();
        for _ in 0..k {
            if drafting.is_empty() {
                break;
            }
            let windows: Vec<(RequestId, &[u32])> = drafting
                .iter()
                .zip(&current)
                .map(|(&i, token)| (work[i].kv, std::slice::from_ref(token)))
                .collect();
            let hidden = self.forward(&windows, 0..layers)?;
            let logits = crate::linear::widened(self.model.logits(hidden));
            // Each drafted token and the draft's probability of it.
            let mut drafted = Vec::with_capacity(drafting.len());
            if self.options.sampling.is_greedy() {
                // One read: the argmax and its probability, 1 / sum(exp(logits - max)).
                let max = logits.clone().max_dim(1);
                let top = (logits.clone() - max).exp().sum_dim(1).recip();
                let tokens = logits.argmax(1).cast(FloatDType::from(top.dtype()));
                let read = self.read_floats(Tensor::cat(vec![tokens, top], 1))?;
                drafted.extend(read.chunks(2).map(|pair| (pair[0] as u32, pair[1])));
            } else {
                let probs = self.read_floats(self.options.sampling.probs(logits))?;
                let vocab = probs.len() / drafting.len();
                for (r, &i) in drafting.iter().enumerate() {
                    let q = probs[r * vocab..(r + 1) * vocab].to_vec();
                    let token = self.rng.sample(&q);
                    drafted.push((token as u32, q[token]));
                    work[i].draft_probs.get_or_insert_with(Vec::new).push(q);
                }
            }
            // The step's tokens are now in the cache: the next step attends over them.
            let span = self.clock.start();
            let report = self.kv.end(&vec![1; drafting.len()]);
            self.clock.stop(span, OpKind::Bookkeeping);
            self.attribute(&report?);
            let mut next = Vec::with_capacity(drafting.len());
            current.clear();
            for (&i, &(token, probability)) in drafting.iter().zip(&drafted) {
                work[i].draft.push(token);
                if probability >= min_confidence {
                    next.push(i);
                    current.push(token);
                }
            }
            drafting = next;
        }
        for i in rolled_back {
            self.kv.truncate(work[i].kv, work[i].start)?;
        }
        Ok(())
    }

    /// A forward of blocks `layers` over the windows' tokens (a step of the paged KV state,
    /// begun here; the caller ends it).
    fn forward(
        &mut self,
        windows: &[(RequestId, &[u32])],
        layers: std::ops::Range<usize>,
    ) -> Result<Tensor<2>> {
        let span = self.clock.start();
        let step = self.kv.begin(windows);
        self.clock.stop(span, OpKind::Bookkeeping);
        let step = step?;
        self.lap("begin");
        let repeat = self.options.repeat.is_some() && self.step % 2 == 1;
        let (kv, clock) = (&mut self.kv, &mut self.clock);
        self.model
            .forward(step.ids, step.positions, layers, |layer, qkv| {
                let span = clock.start();
                // A clone only for a repeat: a kept tensor is one the op may not reuse.
                let again = repeat.then(|| qkv.clone());
                let mut out = kv.attend(layer, qkv);
                if let Some(qkv) = again {
                    out = out.and_then(|_| kv.attend(layer, qkv));
                }
                clock.stop(span, OpKind::Attention);
                Ok(out?)
            })
    }

    /// The target forward over every row's window; per real row, the target's choice after each
    /// of the row's last input token and draft tokens (`draft.len() + 1` of them): greedy token ids,
    /// or the target's distributions when sampling.
    fn verify(&mut self, work: &[RowWork]) -> Result<Vec<Target>> {
        let tokens: Vec<Vec<u32>> = work.iter().map(RowWork::tokens).collect();
        let windows = step_windows(work, &tokens);
        let layers = self.model.config().layers;
        let hidden = self.forward(&windows, 0..layers)?;
        self.lap("target forward");
        let (picked, counts) = picked_rows(work);
        let device = self.model.device().clone();
        let hidden = hidden.select(0, ints(picked.iter().copied(), &device));
        let logits = self.model.logits(hidden);
        let mut targets = Vec::with_capacity(counts.len());
        if self.options.sampling.is_greedy() {
            let tokens = self.read_tokens(greedy(logits))?;
            targets = greedy_targets(&tokens, &counts);
        } else {
            let probs = self.read_floats(self.options.sampling.probs(logits))?;
            let vocab = probs.len() / picked.len();
            let mut at = 0;
            for n in counts {
                let rows = (at..at + n)
                    .map(|r| probs[r * vocab..(r + 1) * vocab].to_vec())
                    .collect();
                targets.push(Target::Probs(rows));
                at += n;
            }
        }
        self.lap("logits, read-back");
        Ok(targets)
    }

    /// Greedy or rejection-sampled acceptance of every row's draft; returns what each row
    /// keeps of its window (the paged KV state's `end` takes it).
    fn accept(
        &mut self,
        work: &[RowWork],
        targets: Vec<Target>,
        on_tokens: &mut impl FnMut(usize, &[u32]),
    ) -> Vec<usize> {
        let mut committed = Vec::with_capacity(work.len());
        let mut targets = targets.into_iter();
        for w in work {
            let index = w.index;
            let target = targets.next().expect("a target per row");
            let mut emitted = match target {
                Target::Tokens(tokens) => accept_greedy(&w.draft, &tokens),
                Target::Accepted(tokens) => tokens,
                Target::Probs(p) => {
                    accept_sampled(&w.draft, w.draft_probs.as_deref(), &p, &mut self.rng)
                }
            };
            let request = &mut self.running[index];
            let budget = request.max_new_tokens - request.generated();
            emitted.truncate(budget);
            if let Some(eos) = emitted.iter().position(|t| self.eos.contains(t)) {
                emitted.truncate(eos + 1);
            }
            // The cache now holds the input and the drafts that were emitted after it.
            let accepted = emitted.len() - 1;
            let kept = w.input.len() + accepted.min(w.draft.len());
            request.kv_len += kept;
            request.tokens.extend_from_slice(&emitted);
            request.drafted += w.draft.len();
            request.accepted += kept - w.input.len();
            if w.input.len() == 1 {
                let looked_up = if w.lookup { w.draft.len() } else { 0 };
                request.backoff.after_step(looked_up, kept - w.input.len());
            }
            request.steps += 1;
            on_tokens(request.id, &emitted);
            committed.push(kept);
        }
        committed
    }

    /// Keeps the violations of a step's report, once per request, for the step's end.
    fn attribute(&mut self, report: &StepReport) {
        for violation in &report.violations {
            let Some(request) = self.running.iter().find(|r| r.kv == violation.request) else {
                continue;
            };
            if self.reported.iter().any(|r| r.request == request.id) {
                continue;
            }
            self.reported.push(Reported {
                request: request.id,
                slot: violation.slot,
                position: violation.position as i64,
                reasons: format!("{:?}", violation.reasons),
            });
        }
    }

    /// Each request the canary reported recomputes its cache: its slots go back and its whole
    /// sequence is prefilled again.
    fn recompute_reported(&mut self) -> Result<()> {
        for reported in std::mem::take(&mut self.reported) {
            let request = self
                .running
                .iter_mut()
                .find(|r| r.id == reported.request)
                .expect("reported requests are running");
            self.kv.truncate(request.kv, 0)?;
            request.kv_len = 0;
            request.reported.push(reported);
        }
        Ok(())
    }

    /// Requests that hit EOS or their budget leave; their slots and row go back.
    fn finish_requests(&mut self) -> Result<()> {
        let mut i = 0;
        while i < self.running.len() {
            let request = &self.running[i];
            let eos = request.generated() > 0
                && self.eos.contains(request.tokens.last().expect("non-empty"));
            if !eos && request.generated() < request.max_new_tokens {
                i += 1;
                continue;
            }
            let request = self.running.remove(i);
            self.kv.remove(request.kv)?;
            self.finished.push(Outcome {
                id: request.id,
                prompt_tokens: request.prompt_tokens,
                tokens: request.tokens[request.prompt_tokens..].to_vec(),
                drafted: request.drafted,
                accepted: request.accepted,
                steps: request.steps,
                canary_violations: request.reported,
                finish: if eos { Finish::Eos } else { Finish::Length },
            });
        }
        Ok(())
    }

    /// Injects `kind` into the first running request with a committed context.
    fn inject(&mut self, kind: Corruption) -> Result<()> {
        let Some(victim) = self.running.iter().position(|r| r.kv_len >= 2) else {
            return Ok(());
        };
        let position = self.running[victim].kv_len / 2;
        let own_slot = self.kv.slots(self.running[victim].kv)?[position];
        let device = self.model.device().clone();
        let slot = match kind {
            Corruption::KvByte => {
                let pool = self.kv.pool(CANARY_LAYER)?;
                let cols = self.kv.config().kv_width();
                let row = pool.clone().narrow(0, own_slot as usize, 1).into_data();
                let (shape, dtype) = (row.shape().clone(), row.dtype());
                let mut bytes = row.as_bytes().to_vec();
                // A high exponent bit of the row's first value: a large, visible change.
                bytes[dtype.size() - 1] ^= 0x20;
                let row = Tensor::<2>::from_data(
                    TensorData::from_bytes_vec(bytes, shape, dtype),
                    (&device, dtype),
                );
                let s = own_slot as usize;
                self.kv
                    .set_pool(CANARY_LAYER, pool.slice_assign([s..s + 1, 0..cols], row))?;
                own_slot
            }
            Corruption::StaleRow => {
                // A slot that belongs to another running request now, or a free one handed out.
                let other = self
                    .running
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| *i != victim)
                    .find_map(|(_, r)| self.kv.slots(r.kv).ok()?.last().copied());
                let Some(stolen) = other else {
                    return Ok(());
                };
                let row = self.kv.row(self.running[victim].kv)?;
                let assigned = kvplan::ops::segment_assign(
                    self.kv.req_to_token(),
                    ints([row].into_iter(), &device),
                    ints([position as i64].into_iter(), &device),
                    ints([1].into_iter(), &device),
                    ints([stolen].into_iter(), &device),
                )?;
                assigned.status.check()?;
                self.kv.set_req_to_token(assigned.req_to_token)?;
                stolen
            }
        };
        self.injected = Some(Reported {
            request: self.running[victim].id,
            slot,
            position: position as i64,
            reasons: format!("{kind:?}"),
        });
        Ok(())
    }

    /// With `profile`: charges the host time since the last lap to `phase`, then waits for the
    /// device and charges the wait to it too.
    fn lap(&mut self, phase: &'static str) {
        if !self.options.profile {
            return;
        }
        let enqueued = Instant::now();
        // A failed sync shows up at the step's next read-back; here it only ends the lap.
        self.model.device().sync().ok();
        let done = Instant::now();
        self.times
            .charge(phase, enqueued - self.lap, done - enqueued);
        self.lap = done;
    }

    fn read_tokens(&mut self, tokens: Tensor<1, Int>) -> Result<Vec<u32>> {
        let timer = Instant::now();
        let values = kvplan::backend::data_to_i64(&tokens.into_data());
        self.times.readback += timer.elapsed();
        Ok(values.into_iter().map(|t| t as u32).collect())
    }

    fn read_floats(&mut self, values: Tensor<2>) -> Result<Vec<f32>> {
        let timer = Instant::now();
        let data = values.into_data().convert::<f32>();
        self.times.readback += timer.elapsed();
        data.try_into_vec::<f32>()
            .map_err(|e| DecoderError::Model(format!("reading probabilities: {e:?}")))
    }
}

/// The target's verdict on one row's window.
#[derive(Debug, PartialEq)]
pub(crate) enum Target {
    /// Greedy: the target's token after each decided position.
    Tokens(Vec<u32>),
    /// Sampling: its distribution there.
    Probs(Vec<Vec<f32>>),
    /// Greedy, accepted on the device: the row's tokens (its accepted drafts, then the target's).
    Accepted(Vec<u32>),
}

/// The rows of a verify forward whose next token is decided (each row's last input token and
/// its drafts), and how many each row has.
fn picked_rows(work: &[RowWork]) -> (Vec<i64>, Vec<usize>) {
    let mut picked = Vec::new();
    let mut offset = 0;
    for w in work {
        let first = offset + w.input.len() - 1;
        picked.extend((first..offset + w.window()).map(|i| i as i64));
        offset += w.window();
    }
    (picked, work.iter().map(|w| w.draft.len() + 1).collect())
}

/// Each row's tokens from a greedy step's attached ints: the target's token after each window
/// token (`windows[i]` a row), then with drafts each row's kept count.
pub(crate) fn accepted_targets(attached: &[i64], windows: &[usize]) -> Result<Vec<Target>> {
    let total: usize = windows.iter().sum();
    let drafted = windows.iter().any(|&n| n > 1);
    let expected = total + if drafted { windows.len() } else { 0 };
    if attached.len() != expected {
        return Err(DecoderError::Model(format!(
            "a greedy step attached {} ints for {expected}",
            attached.len()
        )));
    }
    let (tokens, kept) = attached.split_at(total);
    let mut at = 0;
    let mut targets = Vec::with_capacity(windows.len());
    for (row, &n) in windows.iter().enumerate() {
        let keep = if drafted { kept[row] } else { 1 };
        if !(1..=n as i64).contains(&keep) {
            return Err(DecoderError::Model(format!(
                "row {row} kept {keep} tokens of a {n}-token window"
            )));
        }
        let row_tokens = &tokens[at..at + keep as usize];
        targets.push(Target::Accepted(
            row_tokens.iter().map(|&t| t as u32).collect(),
        ));
        at += n;
    }
    Ok(targets)
}

/// Each row's greedy targets: its `counts[i]` tokens of `tokens`, in order.
fn greedy_targets(tokens: &[u32], counts: &[usize]) -> Vec<Target> {
    let mut at = 0;
    counts
        .iter()
        .map(|&n| {
            at += n;
            Target::Tokens(tokens[at - n..at].to_vec())
        })
        .collect()
}

/// `[n]` i64 values uploaded.
fn ints(values: impl Iterator<Item = i64>, device: &burn_core::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = values.collect();
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::I64))
}
