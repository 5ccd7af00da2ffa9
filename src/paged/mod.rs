//! [`PagedKv`]: the paged KV state of a serving engine as one object, as sglang's
//! `ReqToTokenPool`, token-to-KV allocator, per-layer KV buffers and attention backend split the
//! job, and FlashInfer's `plan` / `run`.
//!
//! It owns every layer's joined K|V pool, `req_to_token`, the row and slot allocators, the store's
//! scratch and the kv-canary. A step is three calls:
//!
//! 1. [`PagedKv::begin`]: each request's new tokens get slots, written into its table row; the
//!    window's slots, each row's context and every token's causal key run are prepared on the
//!    device. Nothing is read back.
//! 2. [`PagedKv::attend`], once per layer: the layer's new K/V rows are stored at their slots
//!    and its queries attend over their context (one launch where the backend can).
//! 3. [`PagedKv::end`]: how many tokens each request keeps; the rest of its slots go back, the
//!    canary records the kept tokens and verifies every committed one, and one read-back brings
//!    every status and the canary's violations, attributed to (request, position, slot).
//!
//! Every error is typed and returned before anything changes: pools, table and allocators stay
//! as they were.
//!
//! Capture-safe by construction: every per-step host value (token ids and positions included)
//! reaches the device through one in-place write into a buffer kept per step shape; no launch
//! takes a value that changes from step to step (the store's clock is a device word its check
//! advances); the pools, table, store scratch and canary are written in place. Each call is a
//! host half (rules, allocators, the record) and a device half (launches only), so
//! [`PagedKv::capture`] records a decode step's device half with the model's forward inside
//! (`burn::tensor::capture`) and [`PagedKv::replay`] runs later steps of its shape as one
//! dispatch. A captured step keeps every window; a verify step, whose kept tokens its forward
//! decides (on the device, inside the graph), gives each request's rejected tokens back after
//! the replay with [`PagedKv::truncate`].

mod alloc;
mod padded;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

use burn_core::backend::{Dispatch, DispatchDevice};
use burn_core::tensor::{DType, Device, Int, Tensor};

use crate::attention::KeyRuns;
use crate::backend::KvPlanBackend;
use crate::canary::{
    Canary, CanaryLaunch, FailReasons, KernelKind, PlanInputs, RealKvSource, SourceBytes, StepPlan,
    WriteInputs,
};
use crate::deferred::Status;
use crate::error::{Dims, Error};
use crate::gather::GatherOptions;
use crate::reference::RealKvHashMode;
use crate::slots::{KvStore, StoreSlots};

/// Steps of at most this many tokens store and attend in one launch; larger ones store, then
/// attend (the one launch reads each key it stores from the new rows: GPU time per token).
/// `KVPLAN_ONE_LAUNCH_TOKENS` overrides it (a benchmark's knob: where the two cross depends on
/// the device).
const ONE_LAUNCH_TOKENS: usize = 16;

fn one_launch_tokens() -> usize {
    static MOST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MOST.get_or_init(|| {
        std::env::var("KVPLAN_ONE_LAUNCH_TOKENS")
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or(ONE_LAUNCH_TOKENS)
    })
}
/// Parts of a step record start at multiples of this many values (512 bytes: the allocators'
/// alignment, so that each part is a view of the record, not a copy).
const RECORD_ALIGN: usize = 64;
/// Bytes of a canary record (token, position, chain hash, real-KV hash).
const CANARY_RECORD_BYTES: usize = 32;
/// Real-KV sources a canary launch folds at most.
const MAX_FINGERPRINTED_LAYERS: usize = 4;
/// A capture runs a step's device half this many times (Burn's three warm-up runs, the recorded
/// one, and one replay that fills the graph's outputs): the store's clock must have room for all.
const CAPTURE_RUNS: u64 = 5;

static NEXT_INSTANCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The shape of a [`PagedKv`]: the model's attention, the pool's size and the canary.
#[derive(Debug, Clone)]
pub struct PagedKvConfig {
    /// Transformer layers (one joined K|V pool each).
    pub layers: usize,
    /// Query heads.
    pub query_heads: usize,
    /// K/V heads (query heads share them in groups).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
    /// KV slots (tokens the pools hold), the padding slot not counted.
    pub slots: usize,
    /// Requests held at once (rows of `req_to_token`, the padding row not counted).
    pub max_requests: usize,
    /// The longest context a request may reach (columns of `req_to_token`).
    pub max_context: usize,
    /// The pools' float dtype (f16 and bf16 pools are attended in f32, each output rounded once).
    pub dtype: DType,
    /// The kv-canary, or `None` for none.
    pub canary: Option<CanaryConfig>,
}

/// What the kv-canary checks.
#[derive(Debug, Clone)]
pub struct CanaryConfig {
    /// Violation rows kept between reads.
    pub ring_rows: usize,
    /// Layers whose K|V bytes are fingerprinted (at most 4; with `real_kv`).
    pub layers: Vec<usize>,
    /// Fingerprint the real KV bytes; off: only tokens, positions and the slot chains.
    pub real_kv: bool,
}

impl Default for CanaryConfig {
    /// 256 ring rows, layer 0's K|V bytes fingerprinted.
    fn default() -> Self {
        Self {
            ring_rows: 256,
            layers: vec![0],
            real_kv: true,
        }
    }
}

impl PagedKvConfig {
    /// Columns of a layer's pool: each slot's K, then its V.
    pub fn kv_width(&self) -> usize {
        2 * self.kv_heads * self.head_dim
    }

    /// Columns of a layer's `qkv`: queries, then K, then V.
    pub fn qkv_width(&self) -> usize {
        self.query_heads * self.head_dim + self.kv_width()
    }

    fn validate(&self) -> Result<(), Error> {
        let positive = [
            ("layers", self.layers),
            ("query_heads", self.query_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("slots", self.slots),
            ("max_requests", self.max_requests),
            ("max_context", self.max_context),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(Error::Config {
                    field,
                    value,
                    why: "must be at least 1",
                });
            }
        }
        if self.query_heads % self.kv_heads != 0 {
            return Err(Error::Config {
                field: "query_heads",
                value: self.query_heads,
                why: "must be a multiple of kv_heads",
            });
        }
        if !self.dtype.is_float() {
            return Err(Error::Config {
                field: "dtype",
                value: self.dtype.size(),
                why: "must be a float dtype",
            });
        }
        if let Some(canary) = &self.canary {
            if canary.ring_rows == 0 {
                return Err(Error::Config {
                    field: "canary.ring_rows",
                    value: 0,
                    why: "must be at least 1",
                });
            }
            if canary.real_kv && !(1..=MAX_FINGERPRINTED_LAYERS).contains(&canary.layers.len()) {
                return Err(Error::Config {
                    field: "canary.layers",
                    value: canary.layers.len(),
                    why: "must name 1 to 4 layers with real_kv",
                });
            }
            if let Some(&layer) = canary.layers.iter().find(|&&l| l >= self.layers) {
                return Err(Error::Config {
                    field: "canary.layers",
                    value: layer,
                    why: "must be below layers",
                });
            }
        }
        Ok(())
    }
}

/// A request held by a [`PagedKv`]: an opaque id, never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What a model's forward takes from [`PagedKv::begin`]: views of the step's record, whose
/// buffer the next step of the same shape rewrites in place.
#[derive(Debug, Clone)]
pub struct StepInputs {
    /// The new tokens' ids, in the order `begin` was given (i64 `[tokens]`).
    pub ids: Tensor<1, Int>,
    /// Each new token's position in its request (i64 `[tokens]`).
    pub positions: Tensor<1, Int>,
    /// New tokens in the step: the rows of every layer's `qkv`.
    pub tokens: usize,
}

/// A corruption the canary found, attributed to a request whose context names the slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvViolation {
    /// The request.
    pub request: RequestId,
    /// The position in the request's sequence.
    pub position: usize,
    /// The KV slot its table row names there.
    pub slot: i64,
    /// The canary's reasons.
    pub reasons: FailReasons,
}

/// What [`PagedKv::end`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Corruptions of committed KV, attributed (empty without a canary).
    pub violations: Vec<KvViolation>,
    /// Violation rows the canary's ring had no room for.
    pub dropped: u64,
    /// The ints the step attached ([`PagedKv::attach`]), read in the same transfer as its
    /// statuses (empty when it attached none).
    pub attached: Vec<i64>,
}

#[derive(Debug, Clone)]
struct Request {
    row: i64,
    /// The slot of each committed position.
    slots: Vec<i64>,
    /// Leading slots not yet written into the device row (a shared prefix; the next `begin`
    /// writes them with the window's).
    unwritten: usize,
}

/// A request's part of the open step.
#[derive(Debug, Clone)]
struct Entry {
    id: RequestId,
    /// Committed tokens before the step: where the window starts.
    start: usize,
    /// The window's slots.
    slots: Vec<i64>,
    /// The window's tokens.
    ids: Vec<u32>,
}

/// A record: one buffer of host values written in place, its parts' `(offset, len)`. A part's
/// view is made when a launch reads it (a replayed step makes none).
#[derive(Debug, Clone)]
struct Record {
    buffer: Tensor<1, Int>,
    parts: Vec<(usize, usize)>,
}

impl Record {
    fn part(&self, k: usize) -> Tensor<1, Int> {
        let (offset, len) = self.parts[k];
        view(self.buffer.clone(), offset, len)
    }
}

/// A step's record's parts, in order.
#[derive(Debug, Clone, Copy)]
enum Part {
    Rows,
    AssignStart,
    AssignLen,
    AssignSlots,
    WindowStart,
    WindowLen,
    ContextLen,
    KeyStart,
    KeyCount,
    Positions,
    Ids,
}

/// A step's host values (one in-place write) and its windows.
#[derive(Debug, Clone)]
struct StepRecord {
    record: Record,
    /// Each request's window `(start, len)` (the padded layout on Flex).
    windows: Vec<(usize, usize)>,
    tokens: usize,
}

impl StepRecord {
    fn get(&self, part: Part) -> Tensor<1, Int> {
        self.record.part(part as usize)
    }
}

/// What the canary's launches read at the end of a step: the kept tokens.
#[derive(Debug, Clone)]
struct Kept {
    /// Their extend lengths, ids and positions; `None`: every token kept (the step record's).
    own: Option<Record>,
    kept: usize,
    window: usize,
}

/// The device half of a begun step: what its attends read, and its launches' statuses.
#[derive(Debug)]
struct Launched {
    store: StoreSlots,
    keys: KeyRuns,
    /// Flex only: the attention's padded layout.
    padded: Option<padded::Padded>,
    statuses: Vec<Status>,
    /// The record's parts the forward and the end read (each view made once).
    rows: Tensor<1, Int>,
    window_start: Tensor<1, Int>,
    window_len: Tensor<1, Int>,
    inputs: StepInputs,
}

impl Launched {
    /// What the end reads once the forward has run: the store's status joins the others.
    fn finish(self) -> Forwarded {
        let mut statuses = self.statuses;
        statuses.push(self.store.into_status());
        Forwarded {
            statuses,
            rows: self.rows,
            window_start: self.window_start,
            window_len: self.window_len,
            inputs: self.inputs,
        }
    }
}

/// A step's device half after its forward: its statuses and the record's parts the end reads.
#[derive(Debug)]
struct Forwarded {
    statuses: Vec<Status>,
    rows: Tensor<1, Int>,
    window_start: Tensor<1, Int>,
    window_len: Tensor<1, Int>,
    inputs: StepInputs,
}

/// The step between `begin` and `end`: its requests' parts, its device half (its layers
/// attend).
#[derive(Debug)]
struct OpenStep {
    entries: Vec<Entry>,
    device: Launched,
}

/// A step staged for a graph: its host halves done, what its device half reads.
#[derive(Debug, Clone)]
struct StagedStep {
    entries: Vec<Entry>,
    record: StepRecord,
    kept: Option<Kept>,
}

/// The paged KV state of a serving engine: pools, `req_to_token`, allocators, canary, and the
/// begin / attend / end step over them. See the [module docs](self).
#[derive(Debug)]
pub struct PagedKv {
    config: PagedKvConfig,
    device: Device,
    pools: Vec<Tensor<2>>,
    /// Stand in for a pool and the table while an op writes them (a kept clone would make the
    /// op copy them: a captured step would write the old buffer).
    placeholder: Tensor<2>,
    placeholder_table: Tensor<2, Int>,
    req_to_token: Tensor<2, Int>,
    store: KvStore,
    slots: alloc::Slots,
    rows: alloc::Rows,
    requests: BTreeMap<RequestId, Request>,
    next_id: u64,
    canary: Option<(Canary, StepPlan)>,
    /// The per-step host values' buffers, one per step shape, written in place each step.
    records: HashMap<(&'static str, Vec<usize>), Tensor<1, Int>>,
    step: Option<OpenStep>,
    /// Ints the open step hands back with its report (`attach`).
    attached: Option<Tensor<1, Int>>,
    /// The step a graph's capture or replay runs.
    staged: Option<StagedStep>,
    /// This object, and its buffers' generation (a graph replays only into the buffers it saw).
    instance: u64,
    generation: u64,
    /// On Flex the attention runs as Burn ops over padded K/V (the op is the host reference).
    flex: bool,
}

impl PagedKv {
    /// Zeroed pools, an empty table, every slot and row free.
    ///
    /// # Errors
    /// `Config` for a field that leaves nothing to serve with; `AllocationTooLarge` when the
    /// pools, table or canary do not fit the device.
    pub fn new(config: PagedKvConfig, device: &Device) -> Result<Self, Error> {
        config.validate()?;
        let pool_rows = config.slots + 1;
        let kv_width = config.kv_width();
        let store = KvStore::allocate(pool_rows, device)?;
        let canary = match &config.canary {
            Some(canary) => Some((
                Canary::allocate(pool_rows, CANARY_RECORD_BYTES, canary.ring_rows, device)?,
                StepPlan::allocate(
                    config.max_requests * config.max_context,
                    config.max_requests,
                    device,
                )?,
            )),
            None => None,
        };
        let dtype = config.dtype;
        Ok(Self {
            pools: (0..config.layers)
                .map(|_| Tensor::zeros([pool_rows, kv_width], (device, dtype)))
                .collect(),
            placeholder: Tensor::zeros([1, kv_width], (device, dtype)),
            placeholder_table: Tensor::zeros([1, 1], (device, DType::I64)),
            req_to_token: Tensor::zeros(
                [config.max_requests + 1, config.max_context],
                (device, DType::I64),
            ),
            store,
            slots: alloc::Slots::new(pool_rows),
            rows: alloc::Rows::new(config.max_requests),
            requests: BTreeMap::new(),
            next_id: 0,
            canary,
            records: HashMap::new(),
            step: None,
            attached: None,
            staged: None,
            instance: NEXT_INSTANCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            generation: 0,
            flex: matches!(device.as_dispatch(), DispatchDevice::Flex(_)),
            device: device.clone(),
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &PagedKvConfig {
        &self.config
    }

    /// A new request with an empty context.
    ///
    /// # Errors
    /// `OutOfRows` when `max_requests` are held.
    pub fn add(&mut self) -> Result<RequestId, Error> {
        let row = self.rows.take()?;
        Ok(self.insert(Request {
            row,
            slots: Vec::new(),
            unwritten: 0,
        }))
    }

    /// A new request whose context starts with the first `prefix` committed tokens of `source`:
    /// it names the same slots (stored once, freed when their last owner goes) and continues
    /// with slots of its own.
    ///
    /// # Errors
    /// `UnknownRequest`, `PrefixTooLong` (more than `source` has committed), `OutOfRows`.
    pub fn share(&mut self, source: RequestId, prefix: usize) -> Result<RequestId, Error> {
        let committed = &self.request(source)?.slots;
        if prefix > committed.len() {
            return Err(Error::PrefixTooLong {
                request: source.0,
                len: committed.len(),
                prefix,
            });
        }
        let shared = committed[..prefix].to_vec();
        let row = self.rows.take()?;
        self.slots.share(&shared);
        Ok(self.insert(Request {
            row,
            unwritten: shared.len(),
            slots: shared,
        }))
    }

    /// Removes a request: its row and its slots go back (a shared slot when its last owner
    /// goes).
    ///
    /// # Errors
    /// `UnknownRequest`; `StepOrder` while the request is in the open step.
    pub fn remove(&mut self, id: RequestId) -> Result<(), Error> {
        self.request(id)?;
        self.not_in_step(id, "remove")?;
        let request = self.requests.remove(&id).expect("checked above");
        self.slots.release(&request.slots);
        self.rows.give_back(request.row);
        if self.requests.is_empty() {
            // Empty again: slots and rows go out in a new state's order (a served run after a
            // warm-up makes the same choices as a fresh one).
            self.slots = alloc::Slots::new(self.config.slots + 1);
            self.rows = alloc::Rows::new(self.config.max_requests);
        }
        Ok(())
    }

    /// Forgets a request's committed tokens from `len` on (their slots go back): a rollback, or
    /// a recompute after the canary reported its cache.
    ///
    /// # Errors
    /// `UnknownRequest`; `KeepPastWindow` for a `len` past its committed tokens; `StepOrder`
    /// while the request is in the open step.
    pub fn truncate(&mut self, id: RequestId, len: usize) -> Result<(), Error> {
        let committed = self.request(id)?.slots.len();
        if len > committed {
            return Err(Error::KeepPastWindow {
                request: id.0,
                keep: len,
                window: committed,
            });
        }
        self.not_in_step(id, "truncate")?;
        let request = self.requests.get_mut(&id).expect("checked above");
        let dropped = request.slots.split_off(len);
        request.unwritten = request.unwritten.min(len);
        self.slots.release(&dropped);
        Ok(())
    }

    /// Committed tokens of a request (its context's length).
    ///
    /// # Errors
    /// `UnknownRequest`.
    pub fn len(&self, id: RequestId) -> Result<usize, Error> {
        Ok(self.request(id)?.slots.len())
    }

    /// The KV slot of each committed position of a request.
    ///
    /// # Errors
    /// `UnknownRequest`.
    pub fn slots(&self, id: RequestId) -> Result<&[i64], Error> {
        Ok(&self.request(id)?.slots)
    }

    /// The `req_to_token` row of a request.
    ///
    /// # Errors
    /// `UnknownRequest`.
    pub fn row(&self, id: RequestId) -> Result<i64, Error> {
        Ok(self.request(id)?.row)
    }

    /// The requests held, in the order they were added.
    pub fn requests(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.keys().copied()
    }

    /// Moves the store's clock on as if `tokens` more tokens had been stored (tests of its end:
    /// the next step starts it again on fresh scratch).
    #[doc(hidden)]
    pub fn advance_clock(&mut self, tokens: u64) {
        self.store.advance_clock(tokens);
    }

    /// KV slots free now (of `config.slots`).
    pub fn free_slots(&self) -> usize {
        self.slots.free()
    }

    /// Request rows free now (of `config.max_requests`).
    pub fn free_rows(&self) -> usize {
        self.rows.free()
    }

    /// Requests that name `slot` (two or more for a shared prefix).
    pub fn slot_owners(&self, slot: i64) -> u32 {
        self.slots.owners(slot)
    }

    /// Starts a step: `windows` gives each request's new tokens (its next input, then any
    /// drafts), in the order the forward lays them out. Slots are allocated and written into the
    /// requests' rows, and the step's window slots, contexts and causal key runs are prepared on
    /// the device; nothing is read back.
    ///
    /// # Errors
    /// `StepOrder` (a step is open, or `windows` is empty), `UnknownRequest`,
    /// `RequestTwiceInStep`, `EmptyWindow`, `ContextFull` (past `max_context`), `OutOfSlots`.
    /// Nothing changes on an error.
    pub fn begin(&mut self, windows: &[(RequestId, &[u32])]) -> Result<StepInputs, Error> {
        let (entries, record) = self.open(windows)?;
        self.attached = None;
        match self.launch(&record) {
            Ok(launched) => {
                self.mark_written(&entries);
                let inputs = launched.inputs.clone();
                self.step = Some(OpenStep {
                    entries,
                    device: launched,
                });
                Ok(inputs)
            }
            Err(error) => {
                for entry in &entries {
                    self.slots.release(&entry.slots);
                }
                Err(error)
            }
        }
    }

    /// The host half of `begin`: its rules, the window's slots, and the step's record written.
    fn open(&mut self, windows: &[(RequestId, &[u32])]) -> Result<(Vec<Entry>, StepRecord), Error> {
        if self.step.is_some() {
            return Err(step_order("begin", "needs the open step to end first"));
        }
        if windows.is_empty() {
            return Err(step_order("begin", "needs at least one request"));
        }
        let mut needed = 0;
        for (i, &(id, tokens)) in windows.iter().enumerate() {
            let len = self.request(id)?.slots.len() + tokens.len();
            if windows[..i].iter().any(|&(other, _)| other == id) {
                return Err(Error::RequestTwiceInStep { request: id.0 });
            }
            if tokens.is_empty() {
                return Err(Error::EmptyWindow { request: id.0 });
            }
            if len > self.config.max_context {
                return Err(Error::ContextFull {
                    request: id.0,
                    len,
                    max_context: self.config.max_context,
                });
            }
            needed += tokens.len();
        }
        let mut taken = self.slots.take(needed)?;
        if !self.store.room(CAPTURE_RUNS * needed as u64) {
            // Once in 2^31 stored tokens: fresh scratch, so graphs captured before are stale.
            self.store.restart();
            self.generation += 1;
        }
        let mut entries = Vec::with_capacity(windows.len());
        for &(id, tokens) in windows {
            let rest = taken.split_off(tokens.len());
            entries.push(Entry {
                id,
                start: self.requests[&id].slots.len(),
                slots: std::mem::replace(&mut taken, rest),
                ids: tokens.to_vec(),
            });
        }
        let record = self.write_record(&entries);
        Ok((entries, record))
    }

    /// The step's host values (rows, table runs, windows, contexts, key runs, positions, ids)
    /// written into the record of its shape.
    fn write_record(&mut self, entries: &[Entry]) -> StepRecord {
        let mut rows = Vec::new();
        let (mut assign_start, mut assign_len, mut assign_slots) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut window_start, mut window_len, mut context_len) =
            (Vec::new(), Vec::new(), Vec::new());
        let (mut key_start, mut key_count, mut positions) = (Vec::new(), Vec::new(), Vec::new());
        let mut context_offset = 0;
        for entry in entries {
            let request = &self.requests[&entry.id];
            let window = entry.slots.len();
            let unwritten = request.unwritten;
            rows.push(request.row);
            assign_start.push((entry.start - unwritten) as i64);
            assign_len.push((unwritten + window) as i64);
            assign_slots.extend_from_slice(&request.slots[entry.start - unwritten..]);
            assign_slots.extend_from_slice(&entry.slots);
            window_start.push(entry.start as i64);
            window_len.push(window as i64);
            context_len.push((entry.start + window) as i64);
            for position in entry.start..entry.start + window {
                // Causal: a token sees its row's keys up to its own position.
                key_start.push(context_offset);
                key_count.push(position as i64 + 1);
                positions.push(position as i64);
            }
            context_offset += (entry.start + window) as i64;
        }
        let ids: Vec<i64> = entries
            .iter()
            .flat_map(|entry| entry.ids.iter().map(|&id| i64::from(id)))
            .collect();
        let tokens = positions.len();
        // In `Part`'s order.
        let record = self.record(
            "begin",
            &[
                &rows,
                &assign_start,
                &assign_len,
                &assign_slots,
                &window_start,
                &window_len,
                &context_len,
                &key_start,
                &key_count,
                &positions,
                &ids,
            ],
        );
        StepRecord {
            record,
            windows: entries.iter().map(|e| (e.start, e.slots.len())).collect(),
            tokens,
        }
    }

    /// The device half of `begin`: the table's assignment, the gathers and the checks, all
    /// enqueued, reading only the record.
    fn launch(&mut self, record: &StepRecord) -> Result<Launched, Error> {
        let tokens = record.tokens;
        let (rows, window_start, window_len) = (
            record.get(Part::Rows),
            record.get(Part::WindowStart),
            record.get(Part::WindowLen),
        );
        // Moved, not cloned: the assignment writes the table in place. (Its at-once errors cannot
        // come from a record the host rules passed.)
        let table = std::mem::replace(&mut self.req_to_token, self.placeholder_table.clone());
        let assigned = crate::slots::segment_assign(
            table,
            rows.clone(),
            record.get(Part::AssignStart),
            record.get(Part::AssignLen),
            record.get(Part::AssignSlots),
        )?;
        self.req_to_token = assigned.req_to_token;
        let window = crate::gather::segment_gather(
            self.req_to_token.clone(),
            rows.clone(),
            Some(window_start.clone()),
            window_len.clone(),
            &GatherOptions::new()
                .capacity(tokens)
                .context("paged KV step window"),
        )?;
        let context = crate::gather::segment_gather(
            self.req_to_token.clone(),
            rows.clone(),
            None,
            record.get(Part::ContextLen),
            &GatherOptions::new().context("paged KV step context"),
        )?;
        let pool_rows = self.config.slots + 1;
        let keys = KeyRuns::new(
            context.slots(),
            record.get(Part::KeyStart),
            record.get(Part::KeyCount),
            pool_rows,
        )?;
        let store = self.store.slots(window.slots(), pool_rows)?;
        let padded = self
            .flex
            .then(|| padded::Padded::new(&record.windows, context.slots(), &self.device));
        let statuses = vec![
            assigned.status,
            window.status,
            context.status,
            keys.status().clone(),
        ];
        Ok(Launched {
            store,
            keys,
            padded,
            statuses,
            rows,
            window_start,
            window_len,
            inputs: StepInputs {
                ids: record.get(Part::Ids),
                positions: record.get(Part::Positions),
                tokens,
            },
        })
    }

    /// A shared prefix's cells are in the table once its request's first step is launched.
    fn mark_written(&mut self, entries: &[Entry]) {
        for entry in entries {
            self.requests.get_mut(&entry.id).expect("checked").unwritten = 0;
        }
    }

    /// Stores `layer`'s new K and V rows and attends its queries over each token's context:
    /// `qkv` is `[tokens, (query_heads + 2 * kv_heads) * head_dim]`, each token's queries, then
    /// its K, then its V (one fused projection's output). Returns the attention's output,
    /// `[tokens, query_heads * head_dim]`. Which kernels run is chosen here.
    ///
    /// # Errors
    /// `StepOrder` (no step open), `LayerOutOfRange`, `TensorShape`,
    /// `TensorDtype`. Nothing changes on an error.
    pub fn attend(&mut self, layer: usize, qkv: Tensor<2>) -> Result<Tensor<2>, Error> {
        let Some(step) = self.step.as_mut() else {
            return Err(step_order("attend", "needs a step begun"));
        };
        let launched = &mut step.device;
        if layer >= self.config.layers {
            return Err(Error::LayerOutOfRange {
                layer,
                layers: self.config.layers,
            });
        }
        let tokens = launched.inputs.tokens;
        let expected = [tokens, self.config.qkv_width()];
        if qkv.dims() != expected {
            return Err(Error::TensorShape {
                name: "qkv",
                got: Dims(qkv.dims().to_vec()),
                expected: Dims(expected.to_vec()),
            });
        }
        if qkv.dtype() != self.config.dtype {
            return Err(Error::TensorDtype {
                name: "qkv",
                got: qkv.dtype(),
                expected: self.config.dtype,
            });
        }
        let heads = self.config.query_heads;
        let pool = std::mem::replace(&mut self.pools[layer], self.placeholder.clone());
        let attended = if launched.padded.is_none() && tokens <= one_launch_tokens() {
            launched
                .store
                .store_and_attend(pool, qkv, &launched.keys, heads)
                .map(|attended| attended.into_tensors())
        } else {
            // The store, then the attention: Burn ops over padded K/V on Flex, the op elsewhere.
            let q_width = heads * self.config.head_dim;
            let kv = qkv.clone().narrow(1, q_width, self.config.kv_width());
            launched.store.store(pool, kv).and_then(|pool| {
                let q = qkv.narrow(1, 0, q_width);
                let out = match &launched.padded {
                    Some(layout) => {
                        let shape = padded::Heads {
                            heads,
                            kv_heads: self.config.kv_heads,
                            head_dim: self.config.head_dim,
                        };
                        layout.attend(q, pool.clone(), shape)
                    }
                    None => {
                        crate::attention::paged_attention(q, pool.clone(), &launched.keys, heads)?
                    }
                };
                Ok((out, pool))
            })
        };
        // The host rules above are every rule the ops check at once: an error here is a bug.
        let (out, pool) = attended?;
        self.pools[layer] = pool;
        Ok(out)
    }

    /// Ends the step: `keep[i]` is how many tokens the `i`-th request of `begin` keeps (a prefix
    /// of its window: its input and its accepted drafts). The rest of its slots go back; the
    /// canary records the kept tokens and verifies every committed token of the step's requests;
    /// one read-back brings every status of the step and the canary's violations.
    ///
    /// # Errors
    /// `StepOrder` (no step open, or called inside a captured step's forward: its graph ends it),
    /// `StepRequests` (another count of requests than `begin`), `KeepPastWindow`: nothing changes
    /// then. A device-checked error of the step's ops (the table, slots or runs were corrupted
    /// under the object) after the step's bookkeeping.
    pub fn end(&mut self, keep: &[usize]) -> Result<StepReport, Error> {
        if self.staged.is_some() {
            return Err(step_order("end", "cannot run inside a captured step"));
        }
        let Some(step) = self.step.as_ref() else {
            return Err(step_order("end", "needs a step begun"));
        };
        if keep.len() != step.entries.len() {
            return Err(Error::StepRequests {
                began: step.entries.len(),
                ended: keep.len(),
            });
        }
        for (entry, &keep) in step.entries.iter().zip(keep) {
            if keep > entry.slots.len() {
                return Err(Error::KeepPastWindow {
                    request: entry.id.0,
                    keep,
                    window: entry.slots.len(),
                });
            }
        }
        let step = self.step.take().expect("checked above");
        let kept = self.commit(&step.entries, keep);
        let statuses = self.launch_end(step.device.finish(), kept.as_ref())?;
        let packed = self.pack(statuses);
        self.report(&packed)
    }

    /// Hands `ints` (a decode step's next tokens, say) back with the step's report
    /// ([`StepReport::attached`]), read in the one transfer that reads its statuses: call it
    /// between [`begin`](Self::begin) and [`end`](Self::end), or inside a captured step's
    /// forward, whose replays then hand back each run's values. A later call replaces them.
    ///
    /// # Errors
    /// `step_order` outside a step.
    pub fn attach(&mut self, ints: Tensor<1, Int>) -> Result<(), Error> {
        if self.step.is_none() {
            return Err(step_order("attach", "needs a step begun"));
        }
        self.attached = Some(ints.cast(DType::I64));
        Ok(())
    }

    /// The step's status records, the canary's and the attached ints side by side in one i64
    /// tensor (made inside a captured step, so a replay rewrites it): one read for the report.
    fn pack(&mut self, statuses: Vec<Status>) -> Packed {
        let (mut parts, contexts) = crate::deferred::split(statuses);
        if let Some((canary, _)) = &self.canary {
            parts.extend(canary.record_words());
        }
        let mut parts: Vec<Tensor<1, Int>> = parts.into_iter().map(Tensor::from_dispatch).collect();
        let attached_len = self.attached.as_ref().map_or(0, |ints| ints.dims()[0]);
        parts.extend(self.attached.take());
        Packed {
            words: Tensor::cat(parts, 0),
            contexts,
            attached: attached_len,
        }
    }

    /// The host half of `end`: rejected slots back, kept ones committed, and what the canary
    /// reads (the step record's parts when every token is kept, else a record of the kept ones).
    fn commit(&mut self, entries: &[Entry], keep: &[usize]) -> Option<Kept> {
        for (entry, &keep) in entries.iter().zip(keep) {
            let (kept, rejected) = entry.slots.split_at(keep);
            self.slots.release(rejected);
            let request = self.requests.get_mut(&entry.id).expect("held in a step");
            request.slots.extend_from_slice(kept);
        }
        self.canary.as_ref()?;
        let window: usize = entries.iter().map(|entry| entry.slots.len()).sum();
        let kept: usize = keep.iter().sum();
        let own = (kept < window).then(|| {
            let extend: Vec<i64> = keep.iter().map(|&n| n as i64).collect();
            let ids: Vec<i64> = entries
                .iter()
                .zip(keep)
                .flat_map(|(entry, &n)| entry.ids[..n].iter().map(|&id| i64::from(id)))
                .collect();
            let positions: Vec<i64> = entries
                .iter()
                .zip(keep)
                .flat_map(|(entry, &n)| (entry.start..entry.start + n).map(|p| p as i64))
                .collect();
            self.record("end", &[&extend, &ids, &positions])
        });
        Some(Kept { own, kept, window })
    }

    /// The device half of `end`: the canary's plan, write and verify, enqueued; every status of
    /// the step, to read.
    fn launch_end(
        &mut self,
        forwarded: Forwarded,
        kept: Option<&Kept>,
    ) -> Result<Vec<Status>, Error> {
        let mut statuses = forwarded.statuses;
        let Some(kept) = kept else {
            return Ok(statuses);
        };
        let (rows, prefix) = (forwarded.rows, forwarded.window_start);
        let (extend, ids, positions) = match &kept.own {
            Some(own) => (own.part(0), own.part(1), own.part(2)),
            None => {
                let inputs = forwarded.inputs;
                (forwarded.window_len, inputs.ids, inputs.positions)
            }
        };
        let pools = self.fingerprinted();
        let (canary, plan) = self.canary.as_mut().expect("a kept record needs a canary");
        let accepted = crate::gather::segment_gather(
            self.req_to_token.clone(),
            rows.clone(),
            Some(prefix.clone()),
            extend.clone(),
            &GatherOptions::new()
                .capacity(kept.window)
                .context("paged KV kept tokens"),
        )?;
        let planned = crate::canary::plan(
            plan,
            PlanInputs::new(rows, prefix, extend, self.req_to_token.clone()),
        )?;
        let launch = CanaryLaunch::new(KernelKind::HEAD_K_FULL);
        let launch = match pools {
            Some(sources) => launch.real_kv(RealKvHashMode::All, sources?),
            None => launch,
        };
        if kept.kept > 0 {
            // The gather's first `kept` values, as a view.
            let slots = view(Tensor::from_dispatch(accepted.out.clone()), 0, kept.kept);
            canary.write(
                &plan.write,
                WriteInputs::new(ids, positions, slots),
                &launch,
            )?;
        }
        canary.verify(&plan.verify, &launch)?;
        statuses.extend([accepted.status, planned]);
        Ok(statuses)
    }

    /// One read-back of a step's statuses and the canary's violations (its ring emptied after),
    /// the violations attributed.
    fn report(&mut self, packed: &Packed) -> Result<StepReport, Error> {
        let words = crate::backend::read_ints::<Dispatch>(packed.words.clone().into_dispatch())?;
        crate::deferred::decode_all(&packed.contexts, &words)?;
        let rest = &words[(packed.contexts.len() * crate::layout::STATUS_LEN).min(words.len())..];
        let (record, attached) = rest.split_at(rest.len().saturating_sub(packed.attached));
        let attached = attached.to_vec();
        let Some((canary, _)) = self.canary.as_mut() else {
            return Ok(StepReport {
                attached,
                ..StepReport::default()
            });
        };
        let violations = canary.violations_in(record)?;
        if violations.recorded > 0 {
            canary.clear();
        }
        Ok(StepReport {
            violations: if violations.rows.is_empty() {
                Vec::new()
            } else {
                self.attribute(&violations.rows)?
            },
            dropped: violations.dropped,
            attached,
        })
    }

    /// Captures a whole step as a graph: the step's launches and `forward` (the model's, calling
    /// [`attend`](Self::attend) for each layer) recorded once, for [`replay`](Self::replay) to
    /// run later steps of the same shape as one dispatch (CUDA, wgpu; on Flex a replay runs the
    /// step again). Every request keeps its whole window (the canary records every token the
    /// forward stored); a verify step's forward decides what each keeps on the device, and the
    /// caller gives the rest back with [`truncate`](Self::truncate) after each run. `forward`
    /// reads its inputs from the [`StepInputs`] it is given (stable buffers, refreshed in place
    /// by each replay's one write) and returns its outputs, which the graph rewrites in place.
    ///
    /// Run each of the step's shapes eagerly once before (a kernel compiled inside the capture
    /// makes Burn fall back to re-running the closure). Pools and `req_to_token` must not be held
    /// elsewhere across a step (an op then writes a copy, not the buffer the graph replays into).
    /// Capture and replay with the device to this thread: CUDA's global capture mode refuses
    /// other threads' syncs meanwhile, and on wgpu a replay beside another thread's work was seen
    /// to hand its status words to that thread's tensors.
    ///
    /// # Errors
    /// As [`begin`](Self::begin); the step's device-checked errors.
    pub fn capture<'f, T: 'f>(
        &mut self,
        windows: &[(RequestId, &[u32])],
        forward: impl FnMut(&mut PagedKv, &StepInputs) -> T + 'f,
    ) -> Result<(StepGraph<'f, T>, StepReport), Error> {
        let shape = self.stage(windows)?;
        let target: Rc<Cell<*mut PagedKv>> = Rc::new(Cell::new(std::ptr::null_mut()));
        let kv = target.clone();
        let mut forward = forward;
        let closure: StepClosure<'f, T> = Box::new(move || {
            // SAFETY: `capture` and `replay` point it at the `PagedKv` they hold by `&mut` for
            // exactly the span of Burn's capture or replay call, and touch it in no other way
            // meanwhile; null otherwise, never dereferenced then.
            let kv = unsafe { &mut *kv.get() };
            kv.device_step(&mut forward)
        });
        let device = self.device.clone();
        target.set(self);
        let mut graph = burn_core::tensor::capture(&device, closure);
        if graph.is_hardware() {
            // The recorded run only recorded: its outputs are buffers no kernel has written yet
            // (they hold whatever the pool's memory held). One replay writes them; the step's
            // device half runs again on the same record, which leaves the same state.
            // SAFETY: as in `replay`: this `PagedKv`'s buffers and the staged record, on the
            // capture's stream and thread.
            unsafe { graph.replay() };
        }
        target.set(std::ptr::null_mut());
        let graph = StepGraph {
            graph,
            target,
            shape,
            owner: self.instance,
            generation: self.generation,
        };
        let report = self.read_output(graph.graph.output());
        Ok((graph, report?))
    }

    /// Runs a step of `graph`'s shape by replaying it: the step's host values written in place,
    /// one dispatch, one read-back. Returns `forward`'s outputs (the graph's buffers) and the
    /// step's report, as [`end`](Self::end) with every window kept.
    ///
    /// # Errors
    /// `GraphMismatch` (another shape, another `PagedKv`, buffers replaced since the capture);
    /// as [`begin`](Self::begin); the step's device-checked errors. Nothing changes before the
    /// replay on an error.
    pub fn replay<'g, T>(
        &mut self,
        graph: &'g mut StepGraph<'_, T>,
        windows: &[(RequestId, &[u32])],
    ) -> Result<(&'g T, StepReport), Error> {
        self.replay_step(graph, windows)?;
        let graph: &'g StepGraph<'_, T> = graph;
        let report = self.read_output(graph.graph.output())?;
        let out = graph
            .output()
            .expect("read_output returns a failed run's error");
        Ok((out, report))
    }

    fn replay_step<T>(
        &mut self,
        graph: &mut StepGraph<'_, T>,
        windows: &[(RequestId, &[u32])],
    ) -> Result<(), Error> {
        if graph.owner != self.instance {
            return Err(Error::GraphMismatch {
                why: "it was captured on another PagedKv",
            });
        }
        let tokens: usize = windows.iter().map(|(_, ids)| ids.len()).sum();
        // `begin` starts the store's clock again (new scratch: a stale graph) below this room.
        if graph.generation != self.generation || !self.store.room(CAPTURE_RUNS * tokens as u64) {
            return Err(Error::GraphMismatch {
                why: "buffers it replays into were replaced since",
            });
        }
        if self.shape_of(windows)? != graph.shape {
            return Err(Error::GraphMismatch {
                why: "the step has another shape (requests, tokens, prefix cells to write)",
            });
        }
        self.stage(windows)?;
        graph.target.set(self);
        // SAFETY: every buffer the graph touched is one of this `PagedKv`'s (the same generation:
        // none replaced), a record of this shape, or pinned by the graph; the host write above
        // and the read below are on the capture's stream and thread.
        unsafe { graph.graph.replay() };
        graph.target.set(std::ptr::null_mut());
        if graph.graph.is_hardware() {
            // The closure did not run: the host follows the device's clock.
            self.store.replayed(tokens as u64);
        }
        Ok(())
    }

    /// The record's shape a step of `windows` has: requests, tokens, shared-prefix cells.
    fn shape_of(&self, windows: &[(RequestId, &[u32])]) -> Result<[usize; 3], Error> {
        let mut unwritten = 0;
        for (id, _) in windows {
            unwritten += self.request(*id)?.unwritten;
        }
        let tokens = windows.iter().map(|(_, ids)| ids.len()).sum();
        Ok([windows.len(), tokens, unwritten])
    }

    /// The host halves of a graph's step, every window kept: what its device half reads.
    fn stage(&mut self, windows: &[(RequestId, &[u32])]) -> Result<[usize; 3], Error> {
        let shape = self.shape_of(windows)?;
        let (entries, record) = self.open(windows)?;
        self.mark_written(&entries);
        self.attached = None;
        let keep: Vec<usize> = entries.iter().map(|entry| entry.slots.len()).collect();
        let kept = self.commit(&entries, &keep);
        self.staged = Some(StagedStep {
            entries,
            record,
            kept,
        });
        Ok(shape)
    }

    /// The device half of a staged step, `forward` inside: what a graph records.
    fn device_step<T>(
        &mut self,
        forward: &mut dyn FnMut(&mut PagedKv, &StepInputs) -> T,
    ) -> StepOutput<T> {
        let staged = self.staged.clone().expect("a graph runs a staged step");
        let launched = self.launch(&staged.record)?;
        let inputs = launched.inputs.clone();
        self.step = Some(OpenStep {
            entries: staged.entries,
            device: launched,
        });
        let out = forward(self, &inputs);
        let Some(OpenStep {
            device: launched, ..
        }) = self.step.take()
        else {
            // Not reached: inside a captured step `end` is refused and `begin` finds it open.
            return Err(step_order("end", "cannot run inside a captured step"));
        };
        let statuses = self.launch_end(launched.finish(), staged.kept.as_ref())?;
        Ok((out, self.pack(statuses)))
    }

    /// The report of a whole step's graph from its output's statuses.
    fn read_output<T>(&mut self, output: &StepOutput<T>) -> Result<StepReport, Error> {
        self.staged = None;
        match output {
            Ok((_, packed)) => self.report(packed),
            Err(error) => Err(error.clone()),
        }
    }

    /// The fingerprinted layers' pools as the canary's real-KV sources (`None`: no real KV).
    fn fingerprinted(&self) -> Option<Result<Vec<RealKvSource>, Error>> {
        let canary = self.config.canary.as_ref().filter(|c| c.real_kv)?;
        let row_bytes = (self.config.kv_width() * self.config.dtype.size()) as i64;
        Some(
            canary
                .layers
                .iter()
                .map(|&layer| {
                    RealKvSource::float(self.pools[layer].clone(), SourceBytes::per_slot(row_bytes))
                })
                .collect(),
        )
    }

    /// Each violation attributed to the requests whose table row names its slot: a cell the
    /// host never wrote (a stale row) first, else the slot's owner at the violation's position.
    fn attribute(
        &self,
        violations: &[crate::canary::Violation],
    ) -> Result<Vec<KvViolation>, Error> {
        let table = crate::backend::data_to_i64(&self.req_to_token.clone().into_data());
        let cols = self.config.max_context;
        let mut found: Vec<KvViolation> = Vec::new();
        for violation in violations {
            let (mut stale, mut owned) = (Vec::new(), Vec::new());
            for (&id, request) in &self.requests {
                let row = &table[request.row as usize * cols..][..request.slots.len()];
                for (position, &slot) in row.iter().enumerate() {
                    if slot != violation.slot {
                        continue;
                    }
                    if request.slots[position] != slot {
                        stale.push((id, position));
                    } else if position as i64 == violation.position {
                        owned.push((id, position));
                    }
                }
            }
            let culprits = if stale.is_empty() { owned } else { stale };
            for (request, position) in culprits {
                let report = KvViolation {
                    request,
                    position,
                    slot: violation.slot,
                    reasons: violation.fail_reasons,
                };
                match found
                    .iter_mut()
                    .find(|f| (f.request, f.position, f.slot) == (request, position, report.slot))
                {
                    Some(known) => known.reasons = FailReasons(known.reasons.0 | report.reasons.0),
                    None => found.push(report),
                }
            }
        }
        Ok(found)
    }

    /// The pool of `layer` (reading it, or a fault injected into it by a test).
    ///
    /// # Errors
    /// `LayerOutOfRange`.
    pub fn pool(&self, layer: usize) -> Result<Tensor<2>, Error> {
        self.pools
            .get(layer)
            .cloned()
            .ok_or(Error::LayerOutOfRange {
                layer,
                layers: self.config.layers,
            })
    }

    /// Replaces the pool of `layer` (fault injection, restoring a snapshot).
    ///
    /// # Errors
    /// `LayerOutOfRange`; `TensorShape` / `TensorDtype` for a pool of another shape or dtype;
    /// `StepOrder` inside a step.
    pub fn set_pool(&mut self, layer: usize, pool: Tensor<2>) -> Result<(), Error> {
        if self.step.is_some() {
            return Err(step_order("set_pool", "cannot run inside a step"));
        }
        let expected = self.pool(layer)?;
        if pool.dims() != expected.dims() {
            return Err(Error::TensorShape {
                name: "pool",
                got: Dims(pool.dims().to_vec()),
                expected: Dims(expected.dims().to_vec()),
            });
        }
        if pool.dtype() != self.config.dtype {
            return Err(Error::TensorDtype {
                name: "pool",
                got: pool.dtype(),
                expected: self.config.dtype,
            });
        }
        self.pools[layer] = pool;
        self.generation += 1;
        Ok(())
    }

    /// The kv-canary (its state: tests, debugging), or `None` without one.
    pub fn canary(&self) -> Option<&Canary> {
        self.canary.as_ref().map(|(canary, _)| canary)
    }

    /// `req_to_token` (i64 `[max_requests + 1, max_context]`; row 0 is the padding row).
    pub fn req_to_token(&self) -> Tensor<2, Int> {
        self.req_to_token.clone()
    }

    /// Replaces `req_to_token` (fault injection: a stale row).
    ///
    /// # Errors
    /// `TensorShape` / `TensorDtype` for a table of another shape or dtype (i64); `StepOrder`
    /// inside a step.
    pub fn set_req_to_token(&mut self, table: Tensor<2, Int>) -> Result<(), Error> {
        if self.step.is_some() {
            return Err(step_order("set_req_to_token", "cannot run inside a step"));
        }
        if table.dims() != self.req_to_token.dims() {
            return Err(Error::TensorShape {
                name: "req_to_token",
                got: Dims(table.dims().to_vec()),
                expected: Dims(self.req_to_token.dims().to_vec()),
            });
        }
        if table.dtype() != DType::I64 {
            return Err(Error::TensorDtype {
                name: "req_to_token",
                got: table.dtype(),
                expected: DType::I64,
            });
        }
        self.req_to_token = table;
        self.generation += 1;
        Ok(())
    }

    /// `parts` written into the persistent buffer of this record's shape (created on its first
    /// step), each part at an aligned offset.
    fn record(&mut self, what: &'static str, parts: &[&[i64]]) -> Record {
        let key = (what, parts.iter().map(|part| part.len()).collect());
        let mut values = Vec::new();
        let mut spans = Vec::with_capacity(parts.len());
        for part in parts {
            spans.push((values.len(), part.len()));
            values.extend_from_slice(part);
            let end = values
                .len()
                .next_multiple_of(RECORD_ALIGN)
                .max(RECORD_ALIGN);
            values.resize(end, 0);
        }
        let len = values.len();
        let device = &self.device;
        let buffer = self
            .records
            .remove(&key)
            .unwrap_or_else(|| Tensor::zeros([len], (device, DType::I64)));
        let buffer = write_i64(buffer, values);
        self.records.insert(key, buffer.clone());
        Record {
            buffer,
            parts: spans,
        }
    }

    fn request(&self, id: RequestId) -> Result<&Request, Error> {
        self.requests
            .get(&id)
            .ok_or(Error::UnknownRequest { request: id.0 })
    }

    fn insert(&mut self, request: Request) -> RequestId {
        let id = RequestId(self.next_id);
        self.next_id += 1;
        self.requests.insert(id, request);
        id
    }

    fn not_in_step(&self, id: RequestId, call: &'static str) -> Result<(), Error> {
        match &self.step {
            Some(step) if step.entries.iter().any(|entry| entry.id == id) => {
                Err(step_order(call, "cannot change a request inside its step"))
            }
            _ => Ok(()),
        }
    }
}

/// What a graph's step returns: the forward's outputs and the step's statuses, or (a forward
/// graph) what its eager end reads.
type StepOutput<T> = Result<(T, Packed), Error>;

/// A step's statuses and attached ints in one i64 tensor (`PagedKv::pack`).
#[derive(Debug, Clone)]
struct Packed {
    words: Tensor<1, Int>,
    /// Each status record's context, in order.
    contexts: Vec<String>,
    /// The attached ints at the end.
    attached: usize,
}
type StepClosure<'f, T> = Box<dyn FnMut() -> StepOutput<T> + 'f>;

/// A step's device work, the model's forward inside, captured once by [`PagedKv::capture`] and
/// replayed by [`PagedKv::replay`] for later steps of the same shape.
pub struct StepGraph<'f, T> {
    graph: burn_core::tensor::Graph<StepOutput<T>, StepClosure<'f, T>>,
    /// The `PagedKv` the closure runs on, set only while Burn's capture or replay runs.
    target: Rc<Cell<*mut PagedKv>>,
    shape: [usize; 3],
    owner: u64,
    generation: u64,
}

impl<T> StepGraph<'_, T> {
    /// The forward's outputs of the latest run (the capture or the latest replay; its buffers on
    /// hardware), or `None` when that run failed.
    pub fn output(&self) -> Option<&T> {
        self.graph.output().as_ref().ok().map(|(out, _)| out)
    }

    /// Whether a replay is one hardware dispatch (false: it runs the step again, as on Flex or
    /// after a capture that fell back).
    pub fn is_hardware(&self) -> bool {
        self.graph.is_hardware()
    }
}

impl<T> std::fmt::Debug for StepGraph<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepGraph")
            .field("hardware", &self.graph.is_hardware())
            .field("shape", &self.shape)
            .finish()
    }
}

fn step_order(call: &'static str, why: &'static str) -> Error {
    Error::StepOrder { call, why }
}

/// Values `offset..offset + len` of `tensor` as a view of its buffer (Burn's slice may copy, and
/// a copy made before a capture window is not replayed).
fn view(tensor: Tensor<1, Int>, offset: usize, len: usize) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as KvPlanBackend>::int_view(
        tensor.into_dispatch(),
        offset,
        len,
    ))
}

/// `values` written into `target`'s buffer in place (on the Cube backend; elsewhere a new
/// tensor of them).
fn write_i64(target: Tensor<1, Int>, values: Vec<i64>) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as KvPlanBackend>::write_i64(
        target.into_dispatch(),
        values,
    ))
}
