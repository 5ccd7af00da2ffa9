//! The synthetic serving workload: a speculative-decoding scheduler in miniature.
//!
//! Requests arrive over time and are batched continuously. Each one holds a row `1..=pool_size` of
//! `req_to_token` while it runs (row 0 is reserved for padding rows) and takes KV slots from a
//! shared allocator. Every step:
//!
//! * newly admitted requests prefill their prompt (a long extend, sometimes on top of a cached
//!   shared system prompt, whose slots several rows then share);
//! * running requests propose a ragged draft window of `k` tokens, written to fresh KV slots at
//!   positions `prefix_len..prefix_len + k`, and the target model accepts a prefix of it (the
//!   accepted suffix of the sequence); rejected slots go back to the allocator;
//! * the batch is padded to a CUDA-graph size with rows of `req_pool_index` 0.
//!
//! A sliding-window (SWA) KV group mirrors the full pool: every full slot gets an SWA slot through
//! the `full_to_swa` LUT, and the SWA slot is freed once its token has left the window.
//!
//! The trace is host-only and deterministic. [`Step`] is a snapshot of one step's inputs plus
//! what the scheduler itself knows the gathers must return.

use std::collections::VecDeque;

use super::rng::SplitMix64;

/// `req_pool_indices` value of a CUDA-graph padding row; row 0 of `req_to_token` is never a
/// request's.
pub const PADDING_ROW: i64 = 0;
/// Slot 0 of both KV pools is the dummy slot: never handed out. Table cells and LUT entries that
/// hold no live token point there.
pub const DUMMY_SLOT: i64 = 0;
/// `prefix_lens` / `extend_seq_lens` of a padding row: sglang's `seq_len_fill_value`. The plan
/// never reads a padding row's lengths.
const PADDING_FILL: i64 = 1;
/// `pos2d` in masked-off cells. Never read, so any value would do; -1 makes a bug loud.
const MASKED_OFF_POSITION: i64 = -1;
/// Token ids are drawn from a vocabulary of this size.
const VOCAB: usize = 32_000;

/// The knobs of the synthetic workload. Pool sizes are derived so that allocation cannot fail.
#[derive(Debug, Clone)]
pub struct Workload {
    /// RNG seed: same seed, same trace, on every backend.
    pub seed: u64,
    /// Requests in the whole trace.
    pub num_requests: usize,
    /// Request pool size `N`: rows `1..=N` of `req_to_token`, so at most `N` requests run.
    pub pool_size: usize,
    /// New requests admitted (prefilled) per step at most.
    pub max_prefills_per_step: usize,
    /// CUDA-graph batch sizes: a batch is padded up to the next one.
    pub batch_buckets: &'static [usize],
    /// Length of the shared system prompt that the prefix cache already holds.
    pub shared_prefix_len: usize,
    /// Probability that a request starts with the shared system prompt.
    pub shared_prefix_share: f64,
    /// Prompt length range (inclusive), shared prefix included.
    pub prompt_lens: (usize, usize),
    /// Output length range (inclusive).
    pub output_lens: (usize, usize),
    /// Steps between two arrivals (inclusive range).
    pub arrival_gap: (usize, usize),
    /// Largest draft window `k` (the first token of a window, the previous step's bonus token,
    /// is always accepted).
    pub max_draft: usize,
    /// Probability that the target model accepts each further draft token.
    pub accept_prob: f64,
    /// Sliding window `W` of the SWA group.
    pub swa_window: usize,
    /// `V` of the full group's `VerifyPlan`. Deliberately below the peak prefix total, so that
    /// the busiest steps exercise the overflow rule: the plan comes back disabled (`enable = 0`)
    /// and a real verify kernel would skip that step.
    pub full_verify_capacity: usize,
}

impl Default for Workload {
    fn default() -> Self {
        Self {
            seed: 0x6b76_706c_616e,
            num_requests: 48,
            pool_size: 14,
            max_prefills_per_step: 3,
            batch_buckets: &[1, 2, 4, 8, 12, 16],
            shared_prefix_len: 32,
            shared_prefix_share: 0.5,
            prompt_lens: (48, 224),
            output_lens: (24, 112),
            arrival_gap: (0, 4),
            max_draft: 6,
            accept_prob: 0.7,
            swa_window: 64,
            full_verify_capacity: 2304,
        }
    }
}

impl Workload {
    /// Rows of `req_to_token` (and of the expected-token pool): the pool plus padding row 0.
    pub fn table_rows(&self) -> usize {
        self.pool_size + 1
    }

    /// Columns of `req_to_token`: the longest possible sequence (draft windows never run past
    /// the output length).
    pub fn table_cols(&self) -> usize {
        self.prompt_lens.1 + self.output_lens.1
    }

    /// Full-pool KV slots, dummy slot included: enough for every row at its longest.
    pub fn kv_slots(&self) -> usize {
        1 + self.shared_prefix_len + self.pool_size * self.table_cols()
    }

    /// SWA-pool slots, dummy included: a request holds at most a whole prompt (until the
    /// eviction after its prefill) or a window plus its predecessor and a draft.
    pub fn swa_slots(&self) -> usize {
        let per_request = self.prompt_lens.1.max(self.swa_window + 1) + self.max_draft;
        1 + self.shared_prefix_len + self.pool_size * per_request
    }

    /// `K` of both `WritePlan`s: the largest padded batch.
    pub fn write_capacity(&self) -> usize {
        self.batch_buckets
            .iter()
            .copied()
            .max()
            .unwrap_or(1)
            .max(self.pool_size)
    }

    /// `W` as the plan takes it.
    pub fn swa_window_size(&self) -> i32 {
        i32::try_from(self.swa_window).unwrap_or(i32::MAX)
    }

    /// `V` of the SWA group's `VerifyPlan`: at most `W` entries per request, so it never
    /// overflows.
    pub fn swa_verify_capacity(&self) -> usize {
        self.pool_size * self.swa_window
    }

    fn padded_batch(&self, real: usize) -> usize {
        self.batch_buckets
            .iter()
            .copied()
            .find(|&size| size >= real)
            .unwrap_or(real)
    }
}

/// One step's inputs as the scheduler built them (i64 host copies), with the answers the
/// scheduler knows independently of any op.
#[derive(Debug, Clone)]
pub struct Step {
    /// 0-based step number.
    pub index: usize,
    /// Requests in the batch that are decoding (proposing a draft window).
    pub decode_rows: usize,
    /// Requests in the batch that are prefilling.
    pub prefill_rows: usize,
    /// `[bs]` table row per batch row; [`PADDING_ROW`] for the CUDA-graph padding at the end.
    pub req_pool_indices: Vec<i64>,
    /// `[bs]` tokens already in the KV cache.
    pub prefix_lens: Vec<i64>,
    /// `[bs]` tokens written this step: the draft window, or the uncached prompt.
    pub extend_seq_lens: Vec<i64>,
    /// `[bs]` valid length of each request's expected-token pool row (its verified tokens).
    pub expected_tokens_valid_lens: Vec<i64>,
    /// Width `C` of the draft-window rectangle: the longest draft this step (at least 1).
    pub draft_cols: usize,
    /// `[bs, C]` positions of the draft window; masked-off cells hold garbage.
    pub draft_pos2d: Vec<i64>,
    /// `[bs, C]` true where a draft token sits.
    pub draft_mask: Vec<bool>,
    /// `[bs]` first position of each row's accepted suffix (its prefix length).
    pub accepted_start: Vec<i64>,
    /// `[bs]` accepted tokens per row: all of a prefill, a prefix of a draft window, 0 for padding.
    pub accepted_lengths: Vec<i64>,
    /// `[rows, cols]` snapshot of `req_to_token`, draft slots written in.
    pub req_to_token: Vec<i64>,
    /// `[rows, cols]` snapshot of the expected-token pool (`req_to_verify_expected_tokens`).
    pub expected_tokens: Vec<i64>,
    /// `[kv_slots]` snapshot of `full_to_swa_index_mapping`.
    pub full_to_swa: Vec<i64>,
    /// The draft-window slots in batch order: what the masked gather must return.
    pub draft_slots: Vec<i64>,
    /// The accepted-suffix slots in batch order: what the segment gather must return.
    pub accepted_slots: Vec<i64>,
    /// The tokens written this step, in batch order (the write plan's order): ids, positions
    /// and KV slots.
    pub new_tokens: NewTokens,
}

/// Tokens whose KV (and canary records) a step writes.
#[derive(Debug, Clone, Default)]
pub struct NewTokens {
    /// Token ids.
    pub ids: Vec<i64>,
    /// Positions in their sequences.
    pub positions: Vec<i64>,
    /// KV slots.
    pub slots: Vec<i64>,
}

impl Step {
    /// Batch size, padding rows included.
    pub fn batch_size(&self) -> usize {
        self.req_pool_indices.len()
    }

    /// CUDA-graph padding rows at the end of the batch.
    pub fn padding_rows(&self) -> usize {
        self.batch_size() - self.decode_rows - self.prefill_rows
    }

    /// A bound on the accepted-suffix gather that the scheduler knows before verification: no
    /// row accepts more than it wrote. Used as the caller-given capacity of the capacity-mode
    /// segment gather.
    pub fn accepted_capacity(&self) -> usize {
        let real = self.decode_rows + self.prefill_rows;
        self.extend_seq_lens[..real]
            .iter()
            .map(|&len| len.max(0) as usize)
            .sum()
    }
}

/// A request of the trace, from arrival to completion.
#[derive(Debug)]
struct Request {
    arrival: usize,
    prompt_len: usize,
    output_len: usize,
    /// Leading positions served by the shared prefix cache; their slots are not this request's.
    cached_len: usize,
    /// Token ids of the whole prompt (shared prefix included).
    prompt: Vec<i64>,
}

/// A request holding a pool row.
#[derive(Debug)]
struct Running {
    request: Request,
    row: usize,
    /// Committed full-pool slot per position: `prefix_len` is its length.
    slots: Vec<i64>,
    /// Committed token id per position.
    tokens: Vec<i64>,
    /// Output tokens committed so far.
    generated: usize,
    /// False until the prompt has been prefilled.
    prefilled: bool,
    /// Own positions below this have had their SWA slot freed.
    swa_evicted: usize,
}

impl Running {
    fn prefix_len(&self) -> usize {
        self.slots.len()
    }
}

/// What one batch row writes this step, before verification.
struct Window {
    running: usize,
    prefix_len: usize,
    slots: Vec<i64>,
    tokens: Vec<i64>,
    is_draft: bool,
}

/// A free list of slot ids. Handing slots out in shuffled order mimics a fragmented pool, so
/// the gathered slot lists look like real ones rather than ranges.
#[derive(Debug)]
struct SlotAllocator {
    name: &'static str,
    free: Vec<i64>,
}

impl SlotAllocator {
    fn new(name: &'static str, slots: usize, rng: &mut SplitMix64) -> Self {
        let mut free: Vec<i64> = (1..slots as i64).collect();
        rng.shuffle(&mut free);
        Self { name, free }
    }

    fn alloc(&mut self) -> Result<i64, String> {
        self.free
            .pop()
            .ok_or_else(|| format!("{} KV pool exhausted (workload sizing bug)", self.name))
    }

    fn release(&mut self, slot: i64) {
        if slot != DUMMY_SLOT {
            self.free.push(slot);
        }
    }
}

/// The scheduler state that produces the [`Step`]s.
#[derive(Debug)]
pub struct Trace {
    workload: Workload,
    rng: SplitMix64,
    clock: usize,
    steps: usize,
    finished: usize,
    waiting: VecDeque<Request>,
    running: Vec<Running>,
    free_rows: Vec<usize>,
    kv: SlotAllocator,
    swa: SlotAllocator,
    /// `[rows, cols]`, row-major; row 0 stays all dummy.
    req_to_token: Vec<i64>,
    /// `[rows, cols]` verified token ids.
    expected_tokens: Vec<i64>,
    /// `[kv_slots]` full slot -> SWA slot.
    full_to_swa: Vec<i64>,
    /// Slots (and token ids) of the shared system prompt, held by the prefix cache for the whole
    /// run.
    shared_slots: Vec<i64>,
    shared_tokens: Vec<i64>,
}

impl Trace {
    /// Draws the whole arrival schedule and sets up the pools.
    pub fn new(workload: Workload) -> Result<Self, String> {
        let mut rng = SplitMix64::new(workload.seed);
        let mut kv = SlotAllocator::new("full", workload.kv_slots(), &mut rng);
        let mut swa = SlotAllocator::new("SWA", workload.swa_slots(), &mut rng);
        let mut full_to_swa = vec![DUMMY_SLOT; workload.kv_slots()];
        let mut shared_slots = Vec::with_capacity(workload.shared_prefix_len);
        for _ in 0..workload.shared_prefix_len {
            let slot = kv.alloc()?;
            full_to_swa[slot as usize] = swa.alloc()?;
            shared_slots.push(slot);
        }
        let shared_tokens: Vec<i64> = (0..workload.shared_prefix_len)
            .map(|_| rng.range(0, VOCAB - 1) as i64)
            .collect();

        let mut waiting = VecDeque::with_capacity(workload.num_requests);
        let mut arrival = 0;
        for _ in 0..workload.num_requests {
            let prompt_len = rng.range(workload.prompt_lens.0, workload.prompt_lens.1);
            let output_len = rng.range(workload.output_lens.0, workload.output_lens.1);
            let cached_len = if prompt_len > workload.shared_prefix_len
                && rng.chance(workload.shared_prefix_share)
            {
                workload.shared_prefix_len
            } else {
                0
            };
            let mut prompt = shared_tokens[..cached_len].to_vec();
            prompt.extend((cached_len..prompt_len).map(|_| rng.range(0, VOCAB - 1) as i64));
            waiting.push_back(Request {
                arrival,
                prompt_len,
                output_len,
                cached_len,
                prompt,
            });
            arrival += rng.range(workload.arrival_gap.0, workload.arrival_gap.1);
        }

        let cells = workload.table_rows() * workload.table_cols();
        Ok(Self {
            rng,
            clock: 0,
            steps: 0,
            finished: 0,
            waiting,
            running: Vec::with_capacity(workload.pool_size),
            // Popped from the end: row 1 first.
            free_rows: (1..=workload.pool_size).rev().collect(),
            kv,
            swa,
            req_to_token: vec![DUMMY_SLOT; cells],
            expected_tokens: vec![0; cells],
            full_to_swa,
            shared_slots,
            shared_tokens,
            workload,
        })
    }

    /// The shared system prompt, held by the prefix cache: its slots and token ids, written once
    /// before the first step.
    pub fn shared_prefix(&self) -> NewTokens {
        NewTokens {
            ids: self.shared_tokens.clone(),
            positions: (0..self.shared_tokens.len() as i64).collect(),
            slots: self.shared_slots.clone(),
        }
    }

    /// Builds the next step and then applies its verification result to the scheduler state.
    /// `None` once every request has finished.
    pub fn next_step(&mut self) -> Result<Option<Step>, String> {
        if self.finished == self.workload.num_requests {
            return Ok(None);
        }
        // An idle server waits for the next arrival; idle steps run nothing.
        if self.running.is_empty()
            && let Some(next) = self.waiting.front()
        {
            self.clock = self.clock.max(next.arrival);
        }
        self.admit();
        let windows = self.write_windows()?;
        let step = self.snapshot(&windows);
        self.commit(windows, &step);
        self.clock += 1;
        self.steps += 1;
        Ok(Some(step))
    }

    /// Continuous batching: arrived requests take free pool rows, a few per step.
    fn admit(&mut self) {
        let mut admitted = 0;
        while admitted < self.workload.max_prefills_per_step
            && let Some(next) = self.waiting.front()
            && next.arrival <= self.clock
            && let Some(row) = self.free_rows.pop()
            && let Some(request) = self.waiting.pop_front()
        {
            let cols = self.workload.table_cols();
            let running = Running {
                row,
                slots: self.shared_slots[..request.cached_len].to_vec(),
                tokens: self.shared_tokens[..request.cached_len].to_vec(),
                generated: 0,
                prefilled: false,
                swa_evicted: request.cached_len,
                request,
            };
            // The cached prefix is in the KV cache already: its slots go straight into the row.
            let base = row * cols;
            self.req_to_token[base..base + running.slots.len()].copy_from_slice(&running.slots);
            self.expected_tokens[base..base + running.tokens.len()]
                .copy_from_slice(&running.tokens);
            self.running.push(running);
            admitted += 1;
        }
    }

    /// Allocates and writes this step's new KV slots: the uncached prompt of a prefill, or a
    /// draft window of `k` tokens.
    fn write_windows(&mut self) -> Result<Vec<Window>, String> {
        let cols = self.workload.table_cols();
        let mut windows = Vec::with_capacity(self.running.len());
        for (index, running) in self.running.iter().enumerate() {
            let prefix_len = running.prefix_len();
            let (len, is_draft) = if running.prefilled {
                // Never draft past the output length: the window always fits the table.
                let remaining = running.request.output_len - running.generated;
                (
                    self.rng.range(1, self.workload.max_draft).min(remaining),
                    true,
                )
            } else {
                (running.request.prompt_len - prefix_len, false)
            };
            let mut slots = Vec::with_capacity(len);
            let mut tokens = Vec::with_capacity(len);
            for position in prefix_len..prefix_len + len {
                let slot = self.kv.alloc()?;
                self.full_to_swa[slot as usize] = self.swa.alloc()?;
                self.req_to_token[running.row * cols + position] = slot;
                slots.push(slot);
                tokens.push(if is_draft {
                    self.rng.range(0, VOCAB - 1) as i64
                } else {
                    running.request.prompt[position]
                });
            }
            windows.push(Window {
                running: index,
                prefix_len,
                slots,
                tokens,
                is_draft,
            });
        }
        Ok(windows)
    }

    /// The step's op inputs, the target model's verdict on every draft window, and the slots the
    /// gathers must return.
    fn snapshot(&mut self, windows: &[Window]) -> Step {
        let real = windows.len();
        let batch = self.workload.padded_batch(real);
        let draft_cols = windows
            .iter()
            .filter(|w| w.is_draft)
            .map(|w| w.slots.len())
            .max()
            .unwrap_or(0)
            .max(1);

        let mut step = Step {
            index: self.steps,
            decode_rows: windows.iter().filter(|w| w.is_draft).count(),
            prefill_rows: windows.iter().filter(|w| !w.is_draft).count(),
            req_pool_indices: Vec::with_capacity(batch),
            prefix_lens: Vec::with_capacity(batch),
            extend_seq_lens: Vec::with_capacity(batch),
            expected_tokens_valid_lens: Vec::with_capacity(batch),
            draft_cols,
            draft_pos2d: vec![MASKED_OFF_POSITION; batch * draft_cols],
            draft_mask: vec![false; batch * draft_cols],
            accepted_start: Vec::with_capacity(batch),
            accepted_lengths: Vec::with_capacity(batch),
            req_to_token: self.req_to_token.clone(),
            expected_tokens: self.expected_tokens.clone(),
            full_to_swa: self.full_to_swa.clone(),
            draft_slots: Vec::new(),
            accepted_slots: Vec::new(),
            new_tokens: NewTokens::default(),
        };
        for (r, window) in windows.iter().enumerate() {
            let prefix_len = window.prefix_len as i64;
            step.req_pool_indices
                .push(self.running[window.running].row as i64);
            step.prefix_lens.push(prefix_len);
            step.extend_seq_lens.push(window.slots.len() as i64);
            // Every committed token has a known id.
            step.expected_tokens_valid_lens.push(prefix_len);
            let accepted = if window.is_draft {
                for (j, &slot) in window.slots.iter().enumerate() {
                    step.draft_pos2d[r * draft_cols + j] = prefix_len + j as i64;
                    step.draft_mask[r * draft_cols + j] = true;
                    step.draft_slots.push(slot);
                }
                // The window's first token was the previous verify's bonus token: always kept.
                let mut accepted = 1;
                while accepted < window.slots.len() && self.rng.chance(self.workload.accept_prob) {
                    accepted += 1;
                }
                accepted
            } else {
                window.slots.len()
            };
            for (j, (&slot, &token)) in window.slots.iter().zip(&window.tokens).enumerate() {
                step.new_tokens.ids.push(token);
                step.new_tokens.positions.push(prefix_len + j as i64);
                step.new_tokens.slots.push(slot);
            }
            step.accepted_start.push(prefix_len);
            step.accepted_lengths.push(accepted as i64);
            step.accepted_slots
                .extend_from_slice(&window.slots[..accepted]);
        }
        for _ in real..batch {
            step.req_pool_indices.push(PADDING_ROW);
            step.prefix_lens.push(PADDING_FILL);
            step.extend_seq_lens.push(PADDING_FILL);
            step.expected_tokens_valid_lens.push(0);
            step.accepted_start.push(0);
            step.accepted_lengths.push(0);
        }
        step
    }

    /// Keeps the accepted suffix, frees rejected draft slots, evicts SWA slots that left the
    /// window and retires finished requests.
    fn commit(&mut self, windows: Vec<Window>, step: &Step) {
        let cols = self.workload.table_cols();
        let window_keep = self.workload.swa_window + 1; // the window plus its head's predecessor
        for (r, window) in windows.into_iter().enumerate() {
            let accepted = step.accepted_lengths[r] as usize;
            let running = &mut self.running[window.running];
            let base = running.row * cols;
            for (j, &slot) in window.slots.iter().enumerate().skip(accepted) {
                self.req_to_token[base + window.prefix_len + j] = DUMMY_SLOT;
                release(&mut self.kv, &mut self.swa, &mut self.full_to_swa, slot);
            }
            for (j, &token) in window.tokens[..accepted].iter().enumerate() {
                self.expected_tokens[base + window.prefix_len + j] = token;
            }
            running.slots.extend_from_slice(&window.slots[..accepted]);
            running.tokens.extend_from_slice(&window.tokens[..accepted]);
            if window.is_draft {
                running.generated += accepted;
            }
            running.prefilled = true;

            // A token stays in the SWA pool while a plan can still read it.
            let keep_from = running.prefix_len().saturating_sub(window_keep);
            while running.swa_evicted < keep_from {
                let slot = running.slots[running.swa_evicted];
                self.swa.release(self.full_to_swa[slot as usize]);
                self.full_to_swa[slot as usize] = DUMMY_SLOT;
                running.swa_evicted += 1;
            }
        }
        // Retire finished requests: their own slots, their SWA slots and their row go back.
        let mut index = 0;
        while index < self.running.len() {
            let running = &self.running[index];
            if running.generated < running.request.output_len {
                index += 1;
                continue;
            }
            let running = self.running.remove(index);
            for &slot in &running.slots[running.request.cached_len..] {
                release(&mut self.kv, &mut self.swa, &mut self.full_to_swa, slot);
            }
            let base = running.row * cols;
            self.req_to_token[base..base + cols].fill(DUMMY_SLOT);
            self.free_rows.push(running.row);
            self.finished += 1;
        }
    }
}

/// Returns a full slot and its SWA slot (if still mapped) to their pools.
fn release(kv: &mut SlotAllocator, swa: &mut SlotAllocator, full_to_swa: &mut [i64], slot: i64) {
    let mapped = &mut full_to_swa[slot as usize];
    swa.release(*mapped);
    *mapped = DUMMY_SLOT;
    kv.release(slot);
}
