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
//! Capture-safe by construction (a step of one shape replays as a graph): every per-step host
//! value reaches the device through one in-place write into a buffer kept per step shape, no
//! launch takes a value that changes from step to step as a scalar except the store's clock
//! (see the README), the pools, table and canary are written in place.

mod alloc;
mod padded;

use std::collections::{BTreeMap, HashMap};

use burn_core::backend::{Dispatch, DispatchDevice};
use burn_core::tensor::{DType, Device, Int, Tensor};

use crate::attention::KeyRuns;
use crate::canary::{
    Canary, CanaryLaunch, FailReasons, KernelKind, PlanInputs, RealKvSource, SourceBytes, StepPlan,
    WriteInputs,
};
use crate::deferred::Status;
use crate::error::{Dims, Error};
use crate::gather::GatherOptions;
use crate::ops::KvPlanBackend;
use crate::reference::RealKvHashMode;
use crate::slots::{KvStore, StoreSlots};

/// Steps of at most this many tokens store and attend in one launch; larger ones store, then
/// attend (the one launch reads each key it stores from the new rows: GPU time per token).
const ONE_LAUNCH_TOKENS: usize = 16;
/// Parts of a step record start at multiples of this many values (512 bytes: the allocators'
/// alignment, so that each part is a view of the record, not a copy).
const RECORD_ALIGN: usize = 64;
/// Bytes of a canary record (token, position, chain hash, real-KV hash).
const CANARY_RECORD_BYTES: usize = 32;
/// Real-KV sources a canary launch folds at most.
const MAX_FINGERPRINTED_LAYERS: usize = 4;

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
    /// The pools' float dtype.
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

/// What a model's forward takes from [`PagedKv::begin`].
#[derive(Debug, Clone)]
pub struct StepInputs {
    /// Each new token's position in its request, in the order `begin` was given (i64 `[tokens]`;
    /// its buffer is rewritten by the next step of the same shape).
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
#[derive(Debug)]
struct Entry {
    id: RequestId,
    row: i64,
    /// Committed tokens before the step: where the window starts.
    start: usize,
    /// The window's slots.
    slots: Vec<i64>,
}

/// The step between `begin` and `end`.
#[derive(Debug)]
struct OpenStep {
    entries: Vec<Entry>,
    tokens: usize,
    rows: Tensor<1, Int>,
    window: Tensor<1, Int>,
    store: StoreSlots,
    keys: KeyRuns,
    /// Flex only: the attention's padded layout.
    padded: Option<padded::Padded>,
    statuses: Vec<Status>,
}

/// The paged KV state of a serving engine: pools, `req_to_token`, allocators, canary, and the
/// begin / attend / end step over them. See the [module docs](self).
#[derive(Debug)]
pub struct PagedKv {
    config: PagedKvConfig,
    device: Device,
    pools: Vec<Tensor<2>>,
    /// Stands in for a pool while a store has it (a kept clone would make the store copy it).
    placeholder: Tensor<2>,
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

    /// Starts a step: `windows` gives each request's new tokens (drafts included), in the order
    /// the forward lays them out. Slots are allocated and written into the requests' rows, and
    /// the step's window slots, contexts and causal key runs are prepared on the device; nothing
    /// is read back.
    ///
    /// # Errors
    /// `StepOrder` (a step is open, or `windows` is empty), `UnknownRequest`,
    /// `RequestTwiceInStep`, `EmptyWindow`, `ContextFull` (past `max_context`), `OutOfSlots`.
    /// Nothing changes on an error.
    pub fn begin(&mut self, windows: &[(RequestId, usize)]) -> Result<StepInputs, Error> {
        if self.step.is_some() {
            return Err(step_order("begin", "needs the open step to end first"));
        }
        if windows.is_empty() {
            return Err(step_order("begin", "needs at least one request"));
        }
        let mut needed = 0;
        for (i, &(id, window)) in windows.iter().enumerate() {
            let len = self.request(id)?.slots.len() + window;
            if windows[..i].iter().any(|&(other, _)| other == id) {
                return Err(Error::RequestTwiceInStep { request: id.0 });
            }
            if window == 0 {
                return Err(Error::EmptyWindow { request: id.0 });
            }
            if len > self.config.max_context {
                return Err(Error::ContextFull {
                    request: id.0,
                    len,
                    max_context: self.config.max_context,
                });
            }
            needed += window;
        }
        let mut taken = self.slots.take(needed)?;
        let mut entries = Vec::with_capacity(windows.len());
        for &(id, window) in windows {
            let request = &self.requests[&id];
            let rest = taken.split_off(window);
            entries.push(Entry {
                id,
                row: request.row,
                start: request.slots.len(),
                slots: std::mem::replace(&mut taken, rest),
            });
        }
        match self.launch_begin(&entries) {
            Ok((step, positions)) => {
                for entry in &entries {
                    self.requests.get_mut(&entry.id).expect("checked").unwritten = 0;
                }
                self.step = Some(OpenStep { entries, ..step });
                Ok(StepInputs {
                    positions,
                    tokens: needed,
                })
            }
            Err(error) => {
                for entry in &entries {
                    self.slots.release(&entry.slots);
                }
                Err(error)
            }
        }
    }

    /// The step record (rows, table runs, windows, contexts, key runs, positions) written into
    /// its buffer, then the table's assignment, the gathers and the checks, all enqueued.
    fn launch_begin(&mut self, entries: &[Entry]) -> Result<(OpenStep, Tensor<1, Int>), Error> {
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
            rows.push(entry.row);
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
        let tokens = positions.len();
        let [
            rows,
            assign_start,
            assign_len,
            assign_slots,
            window_start,
            window_len,
            context_len,
            key_start,
            key_count,
            positions,
        ] = self.record(
            "begin",
            [
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
            ],
        );
        let assigned = crate::slots::segment_assign_deferred(
            self.req_to_token.clone(),
            rows.clone(),
            assign_start,
            assign_len,
            assign_slots,
        )?;
        self.req_to_token = assigned.req_to_token;
        let window = crate::gather::segment_gather_deferred(
            self.req_to_token.clone(),
            rows.clone(),
            Some(window_start.clone()),
            window_len,
            &GatherOptions::new()
                .capacity(tokens)
                .context("paged KV step window"),
        )?;
        let context = crate::gather::segment_gather_deferred(
            self.req_to_token.clone(),
            rows.clone(),
            None,
            context_len,
            &GatherOptions::new().context("paged KV step context"),
        )?;
        let pool_rows = self.config.slots + 1;
        let keys = KeyRuns::check_deferred(context.out_tensor(), key_start, key_count, pool_rows)?;
        let store = self.store.check_slots(window.out_tensor(), pool_rows)?;
        let padded = self.flex.then(|| {
            let windows: Vec<(usize, usize)> =
                entries.iter().map(|e| (e.start, e.slots.len())).collect();
            padded::Padded::new(&windows, context.out_tensor(), &self.device)
        });
        let statuses = vec![
            assigned.status,
            window.status,
            context.status,
            keys.status().clone(),
        ];
        let step = OpenStep {
            entries: Vec::new(),
            tokens,
            rows,
            window: window_start,
            store,
            keys,
            padded,
            statuses,
        };
        Ok((step, positions))
    }

    /// Stores `layer`'s new K and V rows and attends its queries over each token's context:
    /// `qkv` is `[tokens, (query_heads + 2 * kv_heads) * head_dim]`, each token's queries, then
    /// its K, then its V (one fused projection's output). Returns the attention's output,
    /// `[tokens, query_heads * head_dim]`. Which kernels run is chosen here.
    ///
    /// # Errors
    /// `StepOrder` (no step open), `LayerOutOfRange`, `TensorShape`, `TensorDtype`. Nothing changes on
    /// an error.
    pub fn attend(&mut self, layer: usize, qkv: Tensor<2>) -> Result<Tensor<2>, Error> {
        let Some(step) = self.step.as_mut() else {
            return Err(step_order("attend", "needs a step begun"));
        };
        if layer >= self.config.layers {
            return Err(Error::LayerOutOfRange {
                layer,
                layers: self.config.layers,
            });
        }
        let expected = [step.tokens, self.config.qkv_width()];
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
        let attended = if step.padded.is_none() && step.tokens <= ONE_LAUNCH_TOKENS {
            step.store
                .store_qkv_and_attend(pool, qkv, &step.keys, heads)
                .map(|attended| attended.into_tensors())
        } else {
            // The store, then the attention: Burn ops over padded K/V on Flex, the op elsewhere.
            let q_width = heads * self.config.head_dim;
            let kv = qkv.clone().narrow(1, q_width, self.config.kv_width());
            step.store.store(pool, kv).and_then(|pool| {
                let q = qkv.narrow(1, 0, q_width);
                let out = match &step.padded {
                    Some(layout) => {
                        let shape = padded::Heads {
                            heads,
                            kv_heads: self.config.kv_heads,
                            head_dim: self.config.head_dim,
                        };
                        layout.attend(q, pool.clone(), shape)
                    }
                    None => {
                        crate::attention::paged_attention_kv(q, pool.clone(), &step.keys, heads)?
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

    /// Ends the step: `committed[i]` are the tokens the `i`-th request of `begin` keeps (a
    /// prefix of its window: its input and its accepted drafts). The rest of its slots go back;
    /// the canary records the kept tokens and verifies every committed token of the step's
    /// requests; one read-back brings every status of the step and the canary's violations.
    ///
    /// # Errors
    /// `StepOrder` (no step open), `StepRequests` (another count of requests than `begin`),
    /// `KeepPastWindow`: nothing changes then. A device-checked error of the step's ops (the
    /// table, slots or runs were corrupted under the object) after the step's bookkeeping.
    pub fn end(&mut self, committed: &[&[u32]]) -> Result<StepReport, Error> {
        let Some(step) = self.step.as_ref() else {
            return Err(step_order("end", "needs a step begun"));
        };
        if committed.len() != step.entries.len() {
            return Err(Error::StepRequests {
                began: step.entries.len(),
                ended: committed.len(),
            });
        }
        for (entry, tokens) in step.entries.iter().zip(committed) {
            if tokens.len() > entry.slots.len() {
                return Err(Error::KeepPastWindow {
                    request: entry.id.0,
                    keep: tokens.len(),
                    window: entry.slots.len(),
                });
            }
        }
        let step = self.step.take().expect("checked above");
        for (entry, tokens) in step.entries.iter().zip(committed) {
            let (kept, rejected) = entry.slots.split_at(tokens.len());
            self.slots.release(rejected);
            let request = self
                .requests
                .get_mut(&entry.id)
                .expect("held while in a step");
            request.slots.extend_from_slice(kept);
        }
        let mut statuses = step.statuses;
        statuses.push(step.store.into_status());
        if self.canary.is_none() {
            crate::deferred::check_all(statuses)?;
            return Ok(StepReport::default());
        }
        let (violations, dropped) =
            self.canary_step(&step.entries, committed, step.rows, step.window, statuses)?;
        let violations = if violations.is_empty() {
            Vec::new()
        } else {
            self.attribute(&violations)?
        };
        Ok(StepReport {
            violations,
            dropped,
        })
    }

    /// The canary's plan, write and verify for a step, and the one read-back of its statuses and
    /// violations (the ring is emptied after).
    fn canary_step(
        &mut self,
        entries: &[Entry],
        committed: &[&[u32]],
        rows: Tensor<1, Int>,
        prefix: Tensor<1, Int>,
        statuses: Vec<Status>,
    ) -> Result<(Vec<crate::canary::Violation>, u64), Error> {
        let extend: Vec<i64> = committed.iter().map(|tokens| tokens.len() as i64).collect();
        let ids: Vec<i64> = committed
            .iter()
            .flat_map(|t| t.iter().map(|&id| id as i64))
            .collect();
        let positions: Vec<i64> = entries
            .iter()
            .zip(committed)
            .flat_map(|(entry, tokens)| (entry.start..entry.start + tokens.len()).map(|p| p as i64))
            .collect();
        let kept = ids.len();
        let window: usize = entries.iter().map(|entry| entry.slots.len()).sum();
        let (extend, written) = if kept > 0 {
            let [extend, ids, positions] = self.record("end", [&extend, &ids, &positions]);
            (extend, Some((ids, positions)))
        } else {
            let [extend] = self.record("end", [&extend]);
            (extend, None)
        };
        let pools = self.fingerprinted();
        let (canary, plan) = self.canary.as_mut().expect("checked by the caller");
        let accepted = crate::gather::segment_gather_deferred(
            self.req_to_token.clone(),
            rows.clone(),
            Some(prefix.clone()),
            extend.clone(),
            &GatherOptions::new()
                .capacity(window)
                .context("paged KV kept tokens"),
        )?;
        let planned = crate::canary::plan_deferred(
            plan,
            PlanInputs::new(rows, prefix, extend, self.req_to_token.clone()),
        )?;
        let launch = CanaryLaunch::new(KernelKind::HEAD_K_FULL);
        let launch = match pools {
            Some(sources) => launch.real_kv(RealKvHashMode::All, sources?),
            None => launch,
        };
        if let Some((ids, positions)) = written {
            // The gather's first `kept` values as a view (Burn's slice copies off-alignment ends).
            let slots = Tensor::from_dispatch(<Dispatch as KvPlanBackend>::gather_prefix(
                accepted.out.clone(),
                kept,
            ));
            canary.write(
                &plan.write,
                WriteInputs::new(ids, positions, slots),
                &launch,
            )?;
        }
        canary.verify(&plan.verify, &launch)?;
        let statuses = statuses.into_iter().chain([accepted.status, planned]);
        let (_, violations) = canary.violations_after(statuses)?;
        if violations.recorded > 0 {
            canary.clear();
        }
        Ok((violations.rows, violations.dropped))
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
        let table = crate::ops::data_to_i64(&self.req_to_token.clone().into_data());
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
        Ok(())
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
        Ok(())
    }

    /// `parts` (none empty) written into the persistent buffer of this step shape (created on
    /// its first step), each part at an aligned offset; the parts as views of it.
    fn record<const N: usize>(
        &mut self,
        what: &'static str,
        parts: [&[i64]; N],
    ) -> [Tensor<1, Int>; N] {
        let key = (what, parts.iter().map(|part| part.len()).collect());
        let mut values = Vec::new();
        let mut offsets = [0; N];
        for (offset, part) in offsets.iter_mut().zip(parts) {
            *offset = values.len();
            values.extend_from_slice(part);
            values.resize(
                values
                    .len()
                    .next_multiple_of(RECORD_ALIGN)
                    .max(RECORD_ALIGN),
                0,
            );
        }
        let len = values.len();
        let device = &self.device;
        let buffer = self
            .records
            .remove(&key)
            .unwrap_or_else(|| Tensor::zeros([len], (device, DType::I64)));
        let buffer = write_i64(buffer, values);
        self.records.insert(key, buffer.clone());
        std::array::from_fn(|k| buffer.clone().narrow(0, offsets[k], parts[k].len()))
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

fn step_order(call: &'static str, why: &'static str) -> Error {
    Error::StepOrder { call, why }
}

/// `values` written into `target`'s buffer in place (on the Cube backend; elsewhere a new
/// tensor of them).
fn write_i64(target: Tensor<1, Int>, values: Vec<i64>) -> Tensor<1, Int> {
    Tensor::from_dispatch(<Dispatch as KvPlanBackend>::write_i64(
        target.into_dispatch(),
        values,
    ))
}
