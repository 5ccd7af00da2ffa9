//! The serving loop: continuous batching over a paged KV cache kept by kvplan, speculative steps
//! (n-gram or self-speculative drafts verified by the target in one forward), and the kv-canary
//! on the real cache every step.
//!
//! One step, for every running request (a row of `req_to_token`):
//! 1. host: the row's input (its tokens not yet in the cache: a whole prompt, or the last
//!    token) and, for a decode row, a draft; slots for all of them from the free list;
//! 2. `segment_assign` writes those slots into the rows at the committed length;
//! 3. self-speculative only: `draft_tokens` forwards of the first layers draft on the device;
//! 4. the target forward over every row's window: each layer's new K/V stored at the slots that
//!    `masked_gather` reads back out of the table and its attention over the slots
//!    `segment_gather` returns for each row's whole context, one `store_qkv_and_attend` launch;
//! 5. one read-back of the target's tokens; host acceptance; rejected slots back to the free list;
//! 6. the canary: the accepted suffix's slots through `segment_gather`, `plan_deferred` (prefix =
//!    the committed length before the step, extend = the tokens committed now), a write of their
//!    records fingerprinting layer 0's K and V rows, a verify of every committed prefix; one status
//!    check for all of the step's kvplan ops, one read of the violation ring.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use burn_core::tensor::{Bool, DType, Device, FloatDType, Int, Tensor, TensorData};
use kvplan::canary::Violations;
use kvplan::reference::RealKvHashMode;
use kvplan::{
    Canary, CanaryLaunch, GatherOptions, KernelKind, PlanInputs, RealKvSource, SourceBytes, Status,
    StepPlan, WriteInputs,
};

use crate::clock::{OpKind, OpTimes};
use crate::draft::ngram_draft;
use crate::kv::{FreeList, KvCache};
use crate::model::{Attention, Llama, PaddedAttention, StepInput};
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
    /// Batch sizes a step's rows are padded up to (the CUDA-graph sizes of a server).
    pub batch_buckets: Vec<usize>,
    /// A fault injected at step `.1`.
    pub corruption: Option<(Corruption, usize)>,
    /// Pad every n-gram match's draft to `draft_tokens` (two window sizes, so few step shapes,
    /// which a GPU compiles once); off on the CPU, where each extra verified token costs time.
    pub fixed_windows: bool,
    /// Attention through kvplan's paged attention op, each token over its run of the step's
    /// slot list; off: Burn ops over K/V gathered into a padded layout (for backends where the op
    /// is the host reference, which reads every pool back each layer).
    pub paged_attention: bool,
    /// With paged attention, steps of at most this many tokens store each layer's K/V and attend
    /// in one launch (`store_qkv_and_attend`); larger ones store, then attend. The one launch
    /// saves host time per layer and costs GPU time per token (`benches/RESULTS.md`, session 26).
    pub fused_store_tokens: usize,
    /// Wait for the device at the end of each step phase and record where the time went
    /// ([`StepTimes::phases`]); slower, for finding what a step spends.
    pub profile: bool,
    /// Benchmarks only: on every other step each kvplan call of this kind (bookkeeping, stores or
    /// attention) runs twice, so that those steps' rise over the others is the calls' cost in a pipelined
    /// step ([`StepTimes::step_walls`]). A repeated store writes the same rows again (with paged
    /// attention, the layer's store-and-attend op runs again on the same rows and queries); a
    /// repeated attention attends alone again with the first one's output as queries, which
    /// changes the tokens. Repeated bookkeeping (every call outside the forward's layers, and
    /// each forward's slots check) computes and writes the same values again.
    pub repeat: Option<OpKind>,
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
            batch_buckets: vec![1, 2, 4, 8, 16, 32, 64],
            corruption: None,
            fixed_windows: true,
            paged_attention: true,
            fused_store_tokens: 16,
            profile: false,
            repeat: None,
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
    row: i64,
    prompt_tokens: usize,
    /// Prompt and generated tokens.
    tokens: Vec<u32>,
    /// Tokens whose K/V are in the cache (`tokens[..kv_len]`).
    kv_len: usize,
    /// The slot of each cached position (the host's view of the table row).
    slots: Vec<i64>,
    max_new_tokens: usize,
    drafted: usize,
    accepted: usize,
    steps: usize,
    reported: Vec<Reported>,
}

impl Running {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_tokens
    }
}

/// One row's work in a step.
struct RowWork {
    /// Index into `running` (`None`: a padding row).
    index: Option<usize>,
    row: i64,
    /// The committed length: where the row's window starts.
    start: usize,
    /// Tokens known to follow (`tokens[kv_len..]`).
    input: Vec<u32>,
    /// Draft tokens after them.
    draft: Vec<u32>,
    /// The draft's distribution at each draft token (sampled self-speculative drafts; `None`: a
    /// deterministic draft, a point mass).
    draft_probs: Option<Vec<Vec<f32>>>,
    /// Slots of the window's positions.
    slots: Vec<i64>,
}

impl RowWork {
    fn window(&self) -> usize {
        self.input.len() + self.draft.len()
    }

    /// A padding row of one token (stored to slot 0, its output unread).
    fn padding() -> Self {
        Self {
            index: None,
            row: 0,
            start: 0,
            input: vec![0],
            draft: Vec::new(),
            draft_probs: None,
            slots: Vec::new(),
        }
    }
}

/// A run of positions of one table row that a forward processes.
struct Window {
    row: i64,
    start: usize,
    len: usize,
}

/// What a step committed for one row: tokens whose K/V are now part of the context.
struct Committed {
    tokens: Vec<u32>,
}

const WRITE_KIND: KernelKind = KernelKind::HEAD_K_FULL;
const VERIFY_KIND: KernelKind = KernelKind::HEAD_K_FULL;
/// Violation rows the canary's ring keeps between reads.
const RING_ROWS: usize = 256;
/// Keys per row are padded to a multiple of this.
const KV_BLOCK: usize = 64;
/// The layer whose K/V pool the canary fingerprints (each slot's K and V bytes).
const CANARY_LAYER: usize = 0;

/// A model, its paged KV cache, and the requests being served.
pub struct Engine {
    model: Llama,
    options: EngineOptions,
    cache: KvCache,
    req_to_token: Tensor<2, Int>,
    slots: FreeList,
    rows: FreeList,
    plan: StepPlan,
    canary: Canary,
    eos: Vec<u32>,
    rng: Rng,
    waiting: VecDeque<Request>,
    running: Vec<Running>,
    finished: Vec<Outcome>,
    step: usize,
    times: StepTimes,
    /// Deferred statuses of this step's kvplan ops, checked once at its end.
    statuses: Vec<Status>,
    injected: Option<Reported>,
    /// The end of the last profiled phase.
    lap: Instant,
}

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
        let table_rows = options.max_batch + 1;
        let cache = KvCache::new(
            config.layers,
            options.kv_slots,
            config.kv_dim(),
            &device,
            model.dtype(),
        )?;
        let req_to_token =
            Tensor::<2, Int>::zeros([table_rows, options.max_context], (&device, DType::I32));
        let verify_capacity = options.max_batch * options.max_context;
        let write_capacity = options
            .batch_buckets
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(table_rows);
        let plan = StepPlan::allocate(verify_capacity, write_capacity, &device)?;
        let canary = Canary::allocate(options.kv_slots, 32, RING_ROWS, &device)?;
        Ok(Self {
            cache,
            req_to_token,
            slots: FreeList::new("KV slots", options.kv_slots),
            rows: FreeList::new("req_to_token rows", table_rows),
            plan,
            canary,
            eos,
            rng: Rng::new(options.sampling.seed),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finished: Vec::new(),
            step: 0,
            times: StepTimes::default(),
            statuses: Vec::new(),
            injected: None,
            lap: Instant::now(),
            model,
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
            if longest > self.slots.capacity() {
                return Err(DecoderError::Options(format!(
                    "request {} may need {longest} KV slots, the pool has {}",
                    request.id,
                    self.slots.capacity()
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
        // Every slot and row is free again; fresh lists hand them out in a fresh engine's order.
        self.slots = FreeList::new("KV slots", self.options.kv_slots);
        self.rows = FreeList::new("req_to_token rows", self.options.max_batch + 1);
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

    /// The model back, for another engine.
    pub fn into_model(self) -> Llama {
        self.model
    }

    /// Where the steps' time went.
    pub fn times(&self) -> &StepTimes {
        &self.times
    }

    /// `((free slots, slots), (free rows, rows))`: equal pairs when nothing is running.
    pub fn free_resources(&self) -> ((usize, usize), (usize, usize)) {
        (
            (self.slots.free(), self.slots.capacity()),
            (self.rows.free(), self.rows.capacity()),
        )
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
        let row = self.rows.take(1)?[0];
        let work = vec![RowWork {
            index: Some(0),
            row,
            start: 0,
            input: context.to_vec(),
            draft: Vec::new(),
            draft_probs: None,
            slots: self.slots.take(context.len())?,
        }];
        self.assign_slots(&work)?;
        let targets = self.verify(&work);
        self.slots.give_back(&work[0].slots);
        self.rows.give_back(&[row]);
        let mut statuses = std::mem::take(&mut self.statuses);
        statuses.extend(self.cache.take_statuses());
        kvplan::check_all(statuses)?;
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
                || self.slots.free() < room + self.reserved_slots()
            {
                break;
            }
            let request = self.waiting.pop_front().expect("front exists");
            let row = self.rows.take(1)?[0];
            self.running.push(Running {
                id: request.id,
                row,
                prompt_tokens: request.prompt.len(),
                tokens: request.prompt,
                kv_len: 0,
                slots: Vec::new(),
                max_new_tokens: request.max_new_tokens,
                drafted: 0,
                accepted: 0,
                steps: 0,
                reported: Vec::new(),
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
        self.cache.repeat = self.options.repeat.filter(|_| self.step % 2 == 1);
        if let Some((kind, at)) = self.options.corruption {
            if at <= self.step && self.injected.is_none() {
                self.inject(kind)?;
            }
        }
        let mut work = self.plan_rows()?;
        let bucket = self
            .options
            .batch_buckets
            .iter()
            .copied()
            .find(|&b| b >= work.len())
            .unwrap_or(work.len());
        // Padding rows verify one token: a window there would only be more work.
        work.resize_with(bucket.max(work.len()), RowWork::padding);
        self.assign_slots(&work)?;
        self.lap("plan rows, segment_assign");
        if let Drafting::SelfSpeculative {
            layers,
            min_confidence,
        } = self.options.drafting
        {
            self.draft_self(&mut work, layers, min_confidence)?;
            self.lap("self-speculative drafts");
        }
        let targets = self.verify(&work)?;
        let committed = self.accept(&work, targets, on_tokens);
        self.lap("accept");
        self.canary_step(&work, &committed)?;
        self.lap("canary, status check");
        self.finish_requests();
        self.cache.clock.drain_into(&mut self.times.kvplan);
        self.times.steps += 1;
        self.times.total += started.elapsed();
        if self.options.profile || self.options.repeat.is_some() {
            self.times.step_walls.push(started.elapsed());
        }
        self.step += 1;
        Ok(())
    }

    /// Each running request's window for this step, with its slots taken from the free list.
    fn plan_rows(&mut self) -> Result<Vec<RowWork>> {
        let k = self.options.draft_tokens;
        let mut work = Vec::with_capacity(self.running.len());
        for (index, request) in self.running.iter().enumerate() {
            let input = request.tokens[request.kv_len..].to_vec();
            let decoding = input.len() == 1;
            let draft = match self.options.drafting {
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
                index: Some(index),
                row: request.row,
                start: request.kv_len,
                input,
                draft,
                draft_probs: None,
                slots: Vec::new(),
            });
        }
        for row in &mut work {
            row.slots = self.slots.take(row.window())?;
        }
        Ok(work)
    }

    /// How many times this step runs each bookkeeping call: twice under
    /// `--repeat-ops bookkeeping` (every other step), else once.
    fn bookkeeping_runs(&self) -> usize {
        1 + usize::from(self.cache.repeat == Some(OpKind::Bookkeeping))
    }

    /// `segment_assign`: every row's new slots into its table row at its committed length.
    fn assign_slots(&mut self, work: &[RowWork]) -> Result<()> {
        let device = self.model.device().clone();
        let rows = ints(work.iter().map(|w| w.row), &device);
        let start = ints(work.iter().map(|w| w.start as i64), &device);
        let lengths = ints(work.iter().map(|w| w.slots.len() as i64), &device);
        let slots = ints(work.iter().flat_map(|w| w.slots.iter().copied()), &device);
        let span = self.cache.clock.start();
        for _ in 0..self.bookkeeping_runs() {
            // The same slots at the same places: a repeat writes the table as it is.
            let assigned = kvplan::segment_assign_deferred(
                self.req_to_token.clone(),
                rows.clone(),
                start.clone(),
                lengths.clone(),
                slots.clone(),
            )?;
            self.req_to_token = assigned.req_to_token;
            self.statuses.push(assigned.status);
        }
        self.cache.clock.stop(span, OpKind::Bookkeeping);
        Ok(())
    }

    /// Self-speculative drafting: up to `k` one-token forwards of the first `layers` blocks over
    /// the decode rows; a row stops after a token the draft gave less than `min_confidence`
    /// (its window shrinks, its unused slots go back at acceptance). The K/V rows land in the
    /// window's slots, which the verify forward then overwrites with the target's (the same
    /// blocks, so the same values).
    fn draft_self(
        &mut self,
        work: &mut [RowWork],
        layers: usize,
        min_confidence: f32,
    ) -> Result<()> {
        let k = self.options.draft_tokens;
        let mut drafting: Vec<usize> = (0..work.len())
            .filter(|&i| work[i].index.is_some() && !work[i].draft.is_empty())
            .collect();
        for &i in &drafting {
            work[i].draft.clear();
        }
        let device = self.model.device().clone();
        let mut current: Vec<u32> = drafting.iter().map(|&i| work[i].input[0]).collect();
        for j in 0..k {
            if drafting.is_empty() {
                break;
            }
            let windows: Vec<Window> = drafting
                .iter()
                .map(|&i| Window {
                    row: work[i].row,
                    start: work[i].start + j,
                    len: 1,
                })
                .collect();
            let ids = ints(current.iter().map(|&t| t as i64), &device);
            let input = self.step_input(&windows, ids)?;
            let hidden = self.model.forward(&mut self.cache, &input, 0..layers)?;
            let logits = self.model.logits(hidden);
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
        Ok(())
    }

    /// The target forward over every row's window; per real row, the target's choice after each
    /// of the row's last input token and draft tokens (`draft.len() + 1` of them): greedy token ids,
    /// or the target's distributions when sampling.
    fn verify(&mut self, work: &[RowWork]) -> Result<Vec<Target>> {
        let device = self.model.device().clone();
        let windows: Vec<Window> = work
            .iter()
            .map(|w| Window {
                row: w.row,
                start: w.start,
                len: w.window(),
            })
            .collect();
        let ids = ints(
            work.iter()
                .flat_map(|w| w.input.iter().chain(&w.draft).map(|&t| t as i64)),
            &device,
        );
        let input = self.step_input(&windows, ids)?;
        self.lap("inputs, gathers");
        let layers = self.model.config().layers;
        let hidden = self.model.forward(&mut self.cache, &input, 0..layers)?;
        self.lap("target forward");
        // Only the positions whose next token is decided: the last input token and the drafts.
        let mut picked = Vec::new();
        let mut offset = 0;
        for w in work {
            if w.index.is_some() {
                let first = offset + w.input.len() - 1;
                picked.extend((first..offset + w.window()).map(|i| i as i64));
            }
            offset += w.window();
        }
        let counts: Vec<usize> = work
            .iter()
            .filter(|w| w.index.is_some())
            .map(|w| w.draft.len() + 1)
            .collect();
        let hidden = hidden.select(0, ints(picked.iter().copied(), &device));
        let logits = self.model.logits(hidden);
        let mut targets = Vec::with_capacity(counts.len());
        if self.options.sampling.is_greedy() {
            let tokens = self.read_tokens(logits.argmax(1).reshape([picked.len()]))?;
            let mut at = 0;
            for n in counts {
                targets.push(Target::Tokens(tokens[at..at + n].to_vec()));
                at += n;
            }
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

    /// Greedy or rejection-sampled acceptance of every real row's draft; commits the accepted
    /// tokens, gives rejected slots back, and returns what each row committed.
    fn accept(
        &mut self,
        work: &[RowWork],
        targets: Vec<Target>,
        on_tokens: &mut impl FnMut(usize, &[u32]),
    ) -> Vec<Committed> {
        let mut committed = Vec::with_capacity(work.len());
        let mut targets = targets.into_iter();
        for w in work {
            let Some(index) = w.index else {
                committed.push(Committed { tokens: Vec::new() });
                continue;
            };
            let target = targets.next().expect("a target per real row");
            let mut emitted = match target {
                Target::Tokens(tokens) => accept_greedy(&w.draft, &tokens),
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
            self.slots.give_back(&w.slots[kept..]);
            request.slots.extend_from_slice(&w.slots[..kept]);
            let mut tokens = w.input.clone();
            tokens.extend_from_slice(&w.draft[..kept - w.input.len()]);
            request.kv_len += kept;
            request.tokens.extend_from_slice(&emitted);
            request.drafted += w.draft.len();
            request.accepted += kept - w.input.len();
            request.steps += 1;
            on_tokens(request.id, &emitted);
            committed.push(Committed { tokens });
        }
        committed
    }

    /// The step's kv-canary: records for the committed tokens (their slots through
    /// `segment_gather` of the accepted suffix), a verify of every committed prefix, one status
    /// check for all of the step's kvplan ops, one read of the violation ring.
    fn canary_step(&mut self, work: &[RowWork], committed: &[Committed]) -> Result<()> {
        let device = self.model.device().clone();
        let rows = ints(work.iter().map(|w| w.row), &device);
        let prefix = ints(work.iter().map(|w| w.start as i64), &device);
        let extend = ints(committed.iter().map(|c| c.tokens.len() as i64), &device);
        let total: usize = committed.iter().map(|c| c.tokens.len()).sum();
        let input_ids = ints(
            committed
                .iter()
                .flat_map(|c| c.tokens.iter().map(|&t| t as i64)),
            &device,
        );
        let positions = ints(
            work.iter()
                .zip(committed)
                .flat_map(|(w, c)| (w.start..w.start + c.tokens.len()).map(|p| p as i64)),
            &device,
        );
        let span = self.cache.clock.start();
        let mut canary_statuses = Vec::new();
        for _ in 0..self.bookkeeping_runs() {
            // A repeat writes the same records again and verifies the same prefixes.
            let accepted = kvplan::segment_gather_deferred(
                self.req_to_token.clone(),
                rows.clone(),
                Some(prefix.clone()),
                extend.clone(),
                // The step's window size, not `total`: one output shape per batch bucket.
                &GatherOptions::new()
                    .capacity(work.iter().map(RowWork::window).sum::<usize>().max(1))
                    .context("accepted suffix"),
            )?;
            let planned = kvplan::plan_deferred(
                &mut self.plan,
                PlanInputs::new(
                    rows.clone(),
                    prefix.clone(),
                    extend.clone(),
                    self.req_to_token.clone(),
                ),
            )?;
            let launch = |kind| {
                let pool = self.cache.kv_pool(CANARY_LAYER);
                let row_bytes = (2 * self.cache.kv_dim() * self.model.dtype().size()) as i64;
                RealKvSource::float(pool, SourceBytes::per_slot(row_bytes)).map(|source| {
                    CanaryLaunch::new(kind).real_kv(RealKvHashMode::All, vec![source])
                })
            };
            if total > 0 {
                let slots = accepted.out_tensor().narrow(0, 0, total);
                let write = launch(WRITE_KIND)?;
                self.canary.write(
                    &self.plan.write,
                    WriteInputs::new(input_ids.clone(), positions.clone(), slots),
                    &write,
                )?;
            }
            let verify = launch(VERIFY_KIND)?;
            self.canary.verify(&self.plan.verify, &verify)?;
            canary_statuses.extend([accepted.status, planned]);
        }
        let mut statuses = std::mem::take(&mut self.statuses);
        statuses.extend(self.cache.take_statuses());
        statuses.extend(canary_statuses);
        // One read-back: every status of the step, the canary's status and its violations.
        let (_, violations) = self.canary.violations_after(statuses)?;
        self.cache.clock.stop(span, OpKind::Bookkeeping);
        if violations.recorded > 0 {
            self.canary.clear();
            self.handle_violations(&violations)?;
        }
        Ok(())
    }

    /// Attributes each violation to the request whose context names its slot, and makes that
    /// request recompute its cache (its slots go back, its whole sequence is prefilled again).
    fn handle_violations(&mut self, violations: &Violations) -> Result<()> {
        let table = self.read_table()?;
        let cols = self.options.max_context;
        let mut victims = Vec::new();
        for violation in &violations.rows {
            // Every (request, position) whose table cell names the violating slot; a cell the
            // host never wrote (a stale row) is the culprit before the slot's own owner.
            let mut stale = Vec::new();
            let mut owned = Vec::new();
            for (index, request) in self.running.iter().enumerate() {
                let row = &table[request.row as usize * cols..][..request.kv_len];
                for (position, &slot) in row.iter().enumerate() {
                    if slot != violation.slot {
                        continue;
                    }
                    if request.slots[position] != slot {
                        stale.push((index, position));
                    } else if position as i64 == violation.position {
                        owned.push((index, position));
                    }
                }
            }
            let culprits = if stale.is_empty() { owned } else { stale };
            for (index, position) in culprits {
                if victims.contains(&index) {
                    continue;
                }
                victims.push(index);
                let request = &mut self.running[index];
                request.reported.push(Reported {
                    request: request.id,
                    slot: violation.slot,
                    position: position as i64,
                    reasons: format!("{:?}", violation.fail_reasons),
                });
            }
        }
        for index in victims {
            let request = &mut self.running[index];
            let slots = std::mem::take(&mut request.slots);
            self.slots.give_back(&slots);
            request.kv_len = 0;
        }
        Ok(())
    }

    /// Requests that hit EOS or their budget leave; their slots and row go back.
    fn finish_requests(&mut self) {
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
            self.slots.give_back(&request.slots);
            self.rows.give_back(&[request.row]);
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
    }

    /// The forward inputs of `windows` (token ids `ids`, packed in window order): positions,
    /// the slots their K/V go to (`masked_gather` of the window cells), and each row's context,
    /// `0..start + len`, through `segment_gather`: each token's run of it for paged attention
    /// (checked once for every layer), or a padded slot list.
    fn step_input(&mut self, windows: &[Window], ids: Tensor<1, Int>) -> Result<StepInput> {
        let device = self.model.device().clone();
        let rows = windows.len();
        // Rounded up so that consecutive steps share shapes (the device compiles per shape).
        let max_q = windows.iter().map(|w| w.len).max().unwrap_or(1);
        let max_q = if max_q > 8 {
            max_q.next_multiple_of(16)
        } else {
            max_q
        };
        let kv_lens: Vec<usize> = windows.iter().map(|w| w.start + w.len).collect();
        let max_kv = kv_lens
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .next_multiple_of(KV_BLOCK);
        let tokens: usize = windows.iter().map(|w| w.len).sum();
        let mut positions = Vec::with_capacity(tokens);
        let mut pos2d = Vec::with_capacity(rows * max_q);
        let mut mask = Vec::with_capacity(rows * max_q);
        let mut kv_offset = 0;
        let mut runs = (Vec::with_capacity(tokens), Vec::with_capacity(tokens));
        for (i, w) in windows.iter().enumerate() {
            for j in 0..max_q {
                let real = j < w.len;
                pos2d.push(if real { (w.start + j) as i64 } else { 0 });
                mask.push(real);
                if real {
                    positions.push((w.start + j) as i64);
                    // Causal: a query sees the keys at and before its own position.
                    runs.0.push(kv_offset as i64);
                    runs.1.push((w.start + j + 1) as i64);
                }
            }
            kv_offset += kv_lens[i];
        }
        let table_rows = ints(windows.iter().map(|w| w.row), &device);
        let pos2d = Tensor::<2, Int>::from_data(
            TensorData::new(pos2d, [rows, max_q]),
            (&device, DType::I64),
        );
        let mask = Tensor::<2, Bool>::from_data(TensorData::new(mask, [rows, max_q]), &device);
        let lengths = ints(kv_lens.iter().map(|&l| l as i64), &device);
        let (starts, counts) = (
            ints(runs.0.into_iter(), &device),
            ints(runs.1.into_iter(), &device),
        );
        let span = self.cache.clock.start();
        let mut step_keys = None;
        for _ in 0..self.bookkeeping_runs() {
            let window_slots = kvplan::masked_gather_deferred(
                self.req_to_token.clone(),
                table_rows.clone(),
                pos2d.clone(),
                mask.clone(),
                &GatherOptions::new()
                    .capacity(tokens)
                    .context("draft window"),
            )?;
            let context_slots = kvplan::segment_gather_deferred(
                self.req_to_token.clone(),
                table_rows.clone(),
                None,
                lengths.clone(),
                // `rows * max_kv`, not the exact total: the output's shape then changes only when
                // a row crosses a key block, like every other shape of the step.
                &GatherOptions::new()
                    .capacity(rows * max_kv)
                    .context("attention context"),
            )?;
            self.statuses.push(window_slots.status.clone());
            self.statuses.push(context_slots.status.clone());
            let attention = if self.options.paged_attention {
                let keys = kvplan::KeyRuns::check_deferred(
                    context_slots.out_tensor(),
                    starts.clone(),
                    counts.clone(),
                    self.cache.slots(),
                )?;
                self.statuses.push(keys.status().clone());
                Attention::Paged {
                    keys,
                    fused_store: tokens <= self.options.fused_store_tokens,
                }
            } else {
                Attention::Padded(padded_attention(
                    windows,
                    [max_q, max_kv],
                    context_slots.out_tensor(),
                    &device,
                ))
            };
            step_keys = Some((window_slots.out_tensor(), attention));
        }
        let (out_cache_loc, attention) = step_keys.expect("bookkeeping runs at least once");
        self.cache.clock.stop(span, OpKind::Bookkeeping);
        Ok(StepInput {
            input_ids: ids,
            positions: ints(positions.into_iter(), &device),
            out_cache_loc,
            attention,
        })
    }

    /// Injects `kind` into the first running request with a committed context.
    fn inject(&mut self, kind: Corruption) -> Result<()> {
        let Some(victim) = self.running.iter().position(|r| r.kv_len >= 2) else {
            return Ok(());
        };
        let position = self.running[victim].kv_len / 2;
        let own_slot = self.running[victim].slots[position];
        let device = self.model.device().clone();
        let slot = match kind {
            Corruption::KvByte => {
                let pool = self.cache.kv_pool(CANARY_LAYER);
                let cols = 2 * self.cache.kv_dim();
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
                self.cache
                    .set_kv_pool(CANARY_LAYER, pool.slice_assign([s..s + 1, 0..cols], row));
                own_slot
            }
            Corruption::StaleRow => {
                // A slot that belongs to another running request now, or a free one handed out.
                let other = self
                    .running
                    .iter()
                    .enumerate()
                    .find(|(i, r)| *i != victim && !r.slots.is_empty())
                    .map(|(_, r)| r.slots[r.slots.len() - 1]);
                let Some(stolen) = other else {
                    return Ok(());
                };
                let row = self.running[victim].row;
                self.req_to_token = kvplan::segment_assign(
                    self.req_to_token.clone(),
                    ints([row].into_iter(), &device),
                    ints([position as i64].into_iter(), &device),
                    ints([1].into_iter(), &device),
                    ints([stolen].into_iter(), &device),
                )?;
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

    fn read_table(&self) -> Result<Vec<i64>> {
        Ok(kvplan::data_to_i64(&self.req_to_token.clone().into_data()))
    }

    fn read_tokens(&mut self, tokens: Tensor<1, Int>) -> Result<Vec<u32>> {
        let timer = Instant::now();
        let values = kvplan::data_to_i64(&tokens.into_data());
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
enum Target {
    /// Greedy: the target's token after each decided position.
    Tokens(Vec<u32>),
    /// Sampling: its distribution there.
    Probs(Vec<Vec<f32>>),
}

/// `[n]` i64 values uploaded.

/// The padded layout of `windows` over their packed context slots (`context`, rows in window
/// order): `[rows, max_q]` queries, `[rows, max_kv]` keys, the causal and padding mask.
fn padded_attention(
    windows: &[Window],
    [max_q, max_kv]: [usize; 2],
    context: Tensor<1, Int>,
    device: &Device,
) -> PaddedAttention {
    let rows = windows.len();
    let tokens: usize = windows.iter().map(|w| w.len).sum();
    let mut q_pad = Vec::with_capacity(rows * max_q);
    let mut q_unpad = Vec::with_capacity(tokens);
    let mut kv_pad = Vec::with_capacity(rows * max_kv);
    let mut masked = Vec::with_capacity(rows * max_q * max_kv);
    let (mut token_offset, mut kv_offset) = (0, 0);
    for (i, w) in windows.iter().enumerate() {
        let kv_len = w.start + w.len;
        for j in 0..max_q {
            let q = j.min(w.len - 1);
            q_pad.push((token_offset + q) as i64);
            if j < w.len {
                q_unpad.push((i * max_q + j) as i64);
            }
            masked.extend((0..max_kv).map(|key| key > w.start + q));
        }
        kv_pad.extend((0..max_kv).map(|key| (kv_offset + key.min(kv_len - 1)) as i64));
        token_offset += w.len;
        kv_offset += kv_len;
    }
    PaddedAttention {
        rows,
        max_q,
        max_kv,
        q_pad: ints(q_pad.into_iter(), device),
        q_unpad: ints(q_unpad.into_iter(), device),
        kv_slots: context.select(0, ints(kv_pad.into_iter(), device)),
        masked: Tensor::<4, Bool>::from_data(
            TensorData::new(masked, [rows, 1, max_q, max_kv]),
            device,
        ),
    }
}

fn ints(values: impl Iterator<Item = i64>, device: &burn_core::tensor::Device) -> Tensor<1, Int> {
    let values: Vec<i64> = values.collect();
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::I64))
}
