//! The write side of the KV bookkeeping (spec `slots.md`): [`segment_assign`] writes a step's new
//! KV slots into their requests' rows of `req_to_token`, and a [`KvStore`] stores the step's K and
//! V rows at those slots. Both check every value rule on the device before writing anything.
//!
//! Tables and caches are consumed and handed back, written in place when no one else holds their
//! buffer: pass them by value, without keeping a clone (a kept clone makes the op copy the whole
//! tensor first). On an error found on the device the tensor handed back is the unchanged input;
//! an `Err` returned at once (a host rule: ranks, dtypes, shapes, devices) has consumed the inputs.
//!
//! A model stores every layer at the same slots, so a step checks them once
//! ([`KvStore::slots`]) and each layer's store is then one launch:
//!
//! ```no_run
//! use burn_core::tensor::{Device, Int, Tensor};
//! use kvplan::ops::KvStore;
//! # fn step(device: &Device, req_to_token: Tensor<2, Int>, rpi: Tensor<1, Int>,
//! #     start: Tensor<1, Int>, lengths: Tensor<1, Int>, out_cache_loc: Tensor<1, Int>,
//! #     kv_pool: Tensor<2>, kv_rows: Tensor<2>,
//! # ) -> Result<(), kvplan::Error> {
//! // Once, at start-up: the duplicate-slot scratch for caches of 2^20 slots.
//! let mut store = KvStore::allocate(1 << 20, device)?;
//! // Every step: no read-back until the step checks its statuses.
//! let assigned = kvplan::ops::segment_assign(req_to_token, rpi, start, lengths, out_cache_loc.clone())?;
//! let mut slots = store.slots(out_cache_loc, 1 << 20)?;
//! // Every layer: its pool moves in and comes back, one launch (a kept clone of a pool would
//! // make the store copy it).
//! let kv_pool = slots.store(kv_pool, kv_rows)?;
//! kvplan::check_all([assigned.status, slots.into_status()])?;
//! # Ok(()) }
//! ```

use burn_core::backend::tensor::{FloatTensor, IntTensor};
use burn_core::backend::{Backend, Dispatch, TensorData, TensorMetadata};
use burn_core::tensor::kind::Basic;
use burn_core::tensor::{Device, Int, IntDType, Shape, Tensor};
use kvplan_kernels::slots::{STORE_CLOCK, STORE_CLOCK_LIMIT, fresh_store_control};

use crate::attention::KeyRuns;
use crate::backend::{
    self, AttendedPrimitive, KvPlanBackend, KvRows, NewRowsPrimitive, OneLaunch,
    StoreScratchPrimitive, StoreTargets,
};
use crate::deferred::Status;
use crate::error::{ASSIGN_CONTEXT, Error, STORE_CONTEXT};
use crate::gather::arg;
use crate::room::{self, Buffer};
use crate::validate;

/// The result of [`segment_assign`]: nothing was read back.
#[derive(Debug, Clone)]
pub struct Assigned {
    /// The table with the runs written, or, after an error the status holds, as it was.
    pub req_to_token: Tensor<2, Int>,
    /// The device-side status; its count is the number of slots written.
    pub status: Status,
}

/// The slot assignment ops on any backend's primitives: what the `Tensor` API runs with
/// `B = Dispatch` (kvplan's own tools call them on unfused backends; not a stable API).
#[doc(hidden)]
pub mod generic {
    use super::*;

    /// A deferred `segment_assign` on primitives.
    #[derive(Debug, Clone)]
    pub struct DeferredAssign<B: Backend = Dispatch> {
        /// The table (see [`Assigned::req_to_token`]).
        pub req_to_token: IntTensor<B>,
        /// The device-side status.
        pub status: Status<B>,
    }

    /// A deferred store on primitives.
    #[derive(Debug, Clone)]
    pub struct DeferredStore<B: Backend = Dispatch> {
        /// The cache, with the rows stored (as it was after an error the status holds).
        pub cache: KvRows<B>,
        /// The device-side status.
        pub status: Status<B>,
    }

    /// [`segment_assign`](super::segment_assign) on primitives.
    ///
    /// # Errors
    /// As [`segment_assign`](super::segment_assign).
    pub fn segment_assign<B: KvPlanBackend>(
        req_to_token: IntTensor<B>,
        req_pool_indices: IntTensor<B>,
        start: IntTensor<B>,
        lengths: IntTensor<B>,
        out_cache_loc: IntTensor<B>,
    ) -> Result<DeferredAssign<B>, Error> {
        validate::segment_assign(
            &arg("req_to_token", &req_to_token),
            &arg("req_pool_indices", &req_pool_indices),
            &arg("start", &start),
            &arg("lengths", &lengths),
            &arg("out_cache_loc", &out_cache_loc),
        )?;
        let output = B::segment_assign(
            req_to_token,
            req_pool_indices,
            start,
            lengths,
            out_cache_loc,
        );
        Ok(DeferredAssign {
            req_to_token: output.req_to_token,
            status: Status::new(output.status, ASSIGN_CONTEXT),
        })
    }

    /// One cache's store on primitives (the slots' check, then the write), for a float or an
    /// int cache.
    ///
    /// # Errors
    /// As [`KvStore::slots`], then [`StoreSlots::store`], and `not_1d` for a `loc` of
    /// another rank.
    pub fn store<B: KvPlanBackend>(
        store: &mut KvStore<B>,
        cache: KvRows<B>,
        loc: IntTensor<B>,
        values: KvRows<B>,
    ) -> Result<DeferredStore<B>, Error> {
        store.store_rows(cache, loc, values)
    }
}

/// `req_to_token[req_pool_indices[i], start[i] + j] = out_cache_loc[offset(i) + j]` for
/// `j < lengths[i]`, `offset(i) = sum(lengths[..i])` (spec `slots.md` §1): the inverse of
/// [`segment_gather`](crate::ops::segment_gather). Nothing is read back.
///
/// Int inputs may be i32 or i64. A padding request has `req_pool_indices[i] == 0` and length 0.
/// Every value rule (rows, padding, lengths, positions, the slot count, slots that do not fit the
/// table, two requests writing one cell) is checked before any cell is written: after an error
/// the status holds, the table comes back unchanged.
///
/// # Errors
/// At once, the inputs consumed: `not_1d` / `not_2d`, `dtype_mismatch`, `device_mismatch`,
/// `segment_length_mismatch`. Later, in `status` (value rules, all checked before any write):
/// `req_pool_index_out_of_range`, `padding_row_length`, `negative_length`, `position_out_of_range`,
/// `slot_count_mismatch`, `slot_out_of_range`, `write_conflict`, `index_range`.
pub fn segment_assign(
    req_to_token: Tensor<2, Int>,
    req_pool_indices: Tensor<1, Int>,
    start: Tensor<1, Int>,
    lengths: Tensor<1, Int>,
    out_cache_loc: Tensor<1, Int>,
) -> Result<Assigned, Error> {
    let assigned = generic::segment_assign::<Dispatch>(
        req_to_token.into_dispatch(),
        req_pool_indices.into_dispatch(),
        start.into_dispatch(),
        lengths.into_dispatch(),
        out_cache_loc.into_dispatch(),
    )?;
    Ok(Assigned {
        req_to_token: Tensor::from_dispatch(assigned.req_to_token),
        status: assigned.status,
    })
}

/// Stores token rows (K, V, or any per-slot payload) at their KV slots: `cache[loc[i]] =
/// values[i]` (spec `slots.md` §2), for caches of at most `num_slots` slots.
///
/// The store keeps the duplicate-slot scratch: one 32-bit word per slot, allocated once and reset
/// without a memset (each call claims slots with clock values above every earlier call's), so a
/// call uploads nothing and allocates only its status; and a second 32-bit word per slot, where a
/// store-and-attend's parts count their arrivals. One store serves every cache of the model (K and
/// V of every layer), one call at a time.
///
/// A step's slots are checked once ([`slots`](Self::slots)); each store through them
/// ([`StoreSlots`]) is then one launch.
#[derive(Debug)]
pub struct KvStore<B: KvPlanBackend = Dispatch> {
    // `None` only while a store call has lent it to the op.
    scratch: Option<StoreScratchPrimitive<B>>,
    num_slots: usize,
    // The next call's first clock value.
    clock: u64,
    // One u32 a slot, zeroed once: each store-and-attend counts its attention's parts in them
    // (`NewRowsPrimitive::arrivals`), and leaves them multiples of the parts.
    arrivals: IntTensor<B>,
    device: B::Device,
    one_launch: OneLaunch,
}

impl KvStore {
    /// A store for caches of at most `num_slots` slots, on `device`.
    ///
    /// # Errors
    /// `allocation_too_large` when the device cannot hold the scratch's two words a slot.
    pub fn allocate(num_slots: usize, device: &Device) -> Result<Self, Error> {
        Self::allocate_on(num_slots, device.as_dispatch())
    }

    /// Checks the slots `loc [N]` (i32 or i64) once for any number of stores into caches of
    /// `cache_rows` rows (at most the store's slots), without any transfer to the host: value
    /// errors (a slot outside the caches, a slot other than 0 named twice) stay in the slots'
    /// status, and then no store through them writes anything.
    ///
    /// # Errors
    /// At once: `dtype_mismatch` (`loc` not int), `device_mismatch` (`loc` off the store's device),
    /// `store_capacity` (`cache_rows` past the store's slots). Later, in the slots' status:
    /// `loc_out_of_range`, `duplicate_slot`, `index_range`.
    pub fn slots(&mut self, loc: Tensor<1, Int>, cache_rows: usize) -> Result<StoreSlots, Error> {
        self.check_slot_primitives(loc.into_dispatch(), cache_rows)
    }
}

/// A cache a store hands back, as a tensor of the kind it was given as.
fn cache_tensor<K: Basic>(cache: KvRows<Dispatch>) -> Tensor<2, K> {
    match cache {
        KvRows::Float(tensor) | KvRows::Int(tensor) => Tensor::from_dispatch(tensor),
    }
}

impl<B: KvPlanBackend> KvStore<B> {
    /// [`KvStore::allocate`] on a backend's device.
    ///
    /// # Errors
    /// As [`KvStore::allocate`].
    #[doc(hidden)]
    pub fn allocate_on(num_slots: usize, device: &B::Device) -> Result<Self, Error> {
        // Two u32 words a slot: its claim, and an arrival count of the attention's parts.
        let words = Buffer::new("KvStore slot words", num_slots.max(1), 8);
        room::on_device(device, &[words])?;
        Ok(Self {
            scratch: Some(fresh_scratch::<B>(num_slots, device, 0)),
            num_slots,
            clock: 1,
            arrivals: zeroed_words::<B>(num_slots, device),
            device: device.clone(),
            one_launch: OneLaunch::on(device),
        })
    }

    /// The most slots a cache of this store may have.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// The store's scratch (tests, debugging).
    pub fn scratch(&self) -> &StoreScratchPrimitive<B> {
        self.scratch
            .as_ref()
            .expect("the scratch is only lent out during a store")
    }

    /// The store's device.
    pub fn device(&self) -> &B::Device {
        &self.device
    }

    /// Moves the clock on as if `tokens` more tokens had been stored (tests of the clock's end;
    /// a captured step's replays).
    #[doc(hidden)]
    pub fn advance_clock(&mut self, tokens: u64) {
        self.clock = (self.clock + tokens).min(STORE_CLOCK_LIMIT);
        if let Some(scratch) = self.scratch.as_mut() {
            let clean = fresh_scratch::<B>(0, &self.device, self.clock - 1);
            scratch.control = clean.control;
        }
    }

    /// Starts the clock again on fresh scratch (new buffers).
    pub(crate) fn restart(&mut self) {
        self.scratch = Some(fresh_scratch::<B>(self.num_slots, &self.device, 0));
        self.clock = 1;
    }

    /// The host's clock follows `tokens` claimed by a replayed check (the device advanced its own).
    pub(crate) fn replayed(&mut self, tokens: u64) {
        self.clock = (self.clock + tokens).min(STORE_CLOCK_LIMIT);
    }

    /// Whether a check of `tokens` tokens claims its clock values without starting again from
    /// fresh scratch (new buffers: a captured graph that holds the old ones is stale then).
    pub(crate) fn room(&self, tokens: u64) -> bool {
        self.clock + tokens <= STORE_CLOCK_LIMIT
    }

    /// [`slots`](KvStore::slots) on primitives.
    ///
    /// # Errors
    /// As [`slots`](KvStore::slots), and `not_1d` for a `loc` of another rank.
    #[doc(hidden)]
    pub fn check_slot_primitives(
        &mut self,
        loc: IntTensor<B>,
        cache_rows: usize,
    ) -> Result<StoreSlots<B>, Error> {
        validate::store_slots(&arg("loc", &loc), &self.device, cache_rows, self.num_slots)?;
        Ok(self.checked(loc, cache_rows))
    }

    /// One deferred store on primitives: the host rules, then the slots' check and the write (see
    /// [`generic::store`]).
    ///
    /// # Errors
    /// As [`generic::store`].
    #[doc(hidden)]
    pub fn store_rows(
        &mut self,
        cache: KvRows<B>,
        loc: IntTensor<B>,
        values: KvRows<B>,
    ) -> Result<generic::DeferredStore<B>, Error> {
        validate::store_kv(
            &rows_arg("cache", &cache),
            &arg("loc", &loc),
            &rows_arg("values", &values),
            self.num_slots,
        )?;
        let cache_rows = cache.shape()[0];
        validate::store_slots(&arg("loc", &loc), &self.device, cache_rows, self.num_slots)?;
        let mut slots = self.checked(loc, cache_rows);
        let StoreTargets::One(cache) =
            slots.write(StoreTargets::One(cache), StoreTargets::One(values))
        else {
            unreachable!("a write hands back the targets it was given");
        };
        Ok(generic::DeferredStore {
            cache,
            status: slots.into_status(),
        })
    }

    /// The slots' check, its host rules passed.
    fn checked(&mut self, loc: IntTensor<B>, cache_rows: usize) -> StoreSlots<B> {
        let tokens = loc.shape()[0] as u64;
        // Past the clock's range the words start again from zero: the one fill in 2^31 stored
        // tokens. A single call of that many tokens is refused by the op (`index_range`). The
        // host follows the device's clock (every check advances it by its tokens) to know when.
        if !self.room(tokens) && tokens < STORE_CLOCK_LIMIT {
            self.restart();
        }
        let Some(scratch) = self.scratch.take() else {
            unreachable!("the scratch is always returned to its store");
        };
        self.clock = (self.clock + tokens).min(STORE_CLOCK_LIMIT);
        let output = B::check_store_slots(loc.clone(), scratch, cache_rows);
        // Held while the slots live: a later check then writes a copy of the words, not these.
        let claims = output.scratch.slot_words.clone();
        self.scratch = Some(output.scratch);
        StoreSlots {
            loc,
            cache_rows,
            status: Some(Status::new(output.status, STORE_CONTEXT)),
            claims,
            arrivals: self.arrivals.clone(),
            one_launch: self.one_launch,
        }
    }
}

/// A step's store slots, checked once by [`KvStore::slots`]: each store through them is
/// one launch, for one cache or a layer's K and V together. Every cache must have the rows the
/// slots were checked against.
#[derive(Debug)]
pub struct StoreSlots<B: Backend = Dispatch> {
    loc: IntTensor<B>,
    cache_rows: usize,
    // Private: the writes trust it, so only the check and the writes may set it. Each write
    // takes it (a tensor moved into an op costs Fusion no drop later) and sets the one it returns.
    status: Option<Status<B>>,
    // The store scratch's slot words after this check (with its first clock value, in the
    // status): which new row holds a slot, for `store_and_attend`.
    claims: IntTensor<B>,
    arrivals: IntTensor<B>,
    one_launch: OneLaunch,
}

impl StoreSlots {
    /// Stores `values [N, D]` at the slots into a float `cache [rows, D]`: one launch, nothing
    /// read back.
    ///
    /// # Errors
    /// At once: `value_shape_mismatch`, `value_dtype_mismatch`, `dtype_mismatch`, `device_mismatch`
    /// (against the cache), `cache_rows_mismatch` (not the rows the slots were checked against).
    /// Later, in [`status`](StoreSlots::status): the check's errors, and `index_range` for this
    /// write.
    pub fn store(&mut self, cache: Tensor<2>, values: Tensor<2>) -> Result<Tensor<2>, Error> {
        let caches = self.store_primitives(
            StoreTargets::One(KvRows::Float(cache.into_dispatch())),
            StoreTargets::One(KvRows::Float(values.into_dispatch())),
        )?;
        Ok(cache_tensor(one(caches)))
    }

    /// [`store`](Self::store) for an int cache (any int dtype).
    ///
    /// # Errors
    /// As [`store`](Self::store).
    pub fn store_int(
        &mut self,
        cache: Tensor<2, Int>,
        values: Tensor<2, Int>,
    ) -> Result<Tensor<2, Int>, Error> {
        let caches = self.store_primitives(
            StoreTargets::One(KvRows::Int(cache.into_dispatch())),
            StoreTargets::One(KvRows::Int(values.into_dispatch())),
        )?;
        Ok(cache_tensor(one(caches)))
    }

    /// A layer's new K and V rows stored at the slots into its pool, then the paged attention of
    /// its queries over that pool through `keys` ([`paged_attention`](crate::ops::paged_attention)),
    /// nothing read back. `kv_pool` is `[rows, 2 * kv_heads * head_dim]` (each row a slot's K, then
    /// its V); `qkv` `[N, heads * head_dim + kv_pool columns]` holds each token's queries, then its
    /// K and V row (what one fused projection gives after RoPE), stored whole at its slot. One
    /// launch on the Cube backend (a key this store writes is read from the new rows): the same
    /// pool and output bits as the store, then the attention. The store's status stays in
    /// [`status`](Self::status), the runs' in `keys`. While these slots live a later check of
    /// the same store writes a copy of its scratch words (the op reads these).
    ///
    /// # Errors
    /// At once: `not_2d` for a `qkv` of another rank; the store's errors, as
    /// [`store`](Self::store) with `qkv`'s last `kv_pool` columns as its values; those of
    /// [`paged_attention`](crate::ops::paged_attention) with the rest as `q`. Later: the store's
    /// in [`status`](Self::status), the runs' in `keys.status()`.
    pub fn store_and_attend(
        &mut self,
        kv_pool: Tensor<2>,
        qkv: Tensor<2>,
        keys: &KeyRuns,
        heads: usize,
    ) -> Result<Attended, Error> {
        self.store_and_attend_primitives(
            [kv_pool.into_dispatch(), qkv.into_dispatch()],
            keys,
            heads,
        )
    }
}

/// What [`StoreSlots::store_and_attend`] hands back.
#[derive(Debug, Clone)]
pub struct Attended<B: Backend = Dispatch> {
    /// The attention's output, `[tokens, heads * head_dim]`.
    pub out: FloatTensor<B>,
    /// The pool, with the layer's K and V rows stored (unchanged after an error the slots'
    /// status holds).
    pub kv_pool: FloatTensor<B>,
}

impl Attended {
    /// The output and the pool as `Tensor`s: `(out, kv_pool)`.
    pub fn into_tensors(self) -> (Tensor<2>, Tensor<2>) {
        (
            Tensor::from_dispatch(self.out),
            Tensor::from_dispatch(self.kv_pool),
        )
    }
}

impl<B: Backend> From<AttendedPrimitive<B>> for Attended<B> {
    fn from(output: AttendedPrimitive<B>) -> Self {
        Self {
            out: output.out,
            kv_pool: output.kv_pool,
        }
    }
}

/// The cache of a one-cache write.
fn one(caches: StoreTargets<Dispatch>) -> KvRows<Dispatch> {
    match caches {
        StoreTargets::One(cache) => cache,
        StoreTargets::Pair(..) => unreachable!("a write hands back the targets it was given"),
    }
}

impl<B: KvPlanBackend> StoreSlots<B> {
    /// [`store`](StoreSlots::store) on primitives, for one cache or two written by one launch:
    /// the host rules of each cache and its rows, then the launch.
    ///
    /// # Errors
    /// As [`store`](StoreSlots::store) for each cache; `store_targets_mismatch` when `caches` and
    /// `values` hold different numbers of tensors.
    #[doc(hidden)]
    pub fn store_primitives(
        &mut self,
        caches: StoreTargets<B>,
        values: StoreTargets<B>,
    ) -> Result<StoreTargets<B>, Error> {
        let names: &[(&'static str, &'static str)] = match caches {
            StoreTargets::One(_) => &[("cache", "values")],
            StoreTargets::Pair(..) => &[("k_cache", "k"), ("v_cache", "v")],
        };
        let (cache_rows, value_rows) = (caches.rows(), values.rows());
        if cache_rows.len() != value_rows.len() {
            return Err(Error::StoreTargetsMismatch {
                context: STORE_CONTEXT.into(),
                caches: cache_rows.len(),
                values: value_rows.len(),
            });
        }
        for ((cache, values), (cache_name, values_name)) in
            cache_rows.into_iter().zip(value_rows).zip(names)
        {
            self.check_write(rows_arg(cache_name, cache), rows_arg(values_name, values))?;
        }
        Ok(self.write(caches, values))
    }

    /// [`store_and_attend`](StoreSlots::store_and_attend) on primitives.
    ///
    /// # Errors
    /// As [`store_and_attend`](StoreSlots::store_and_attend).
    #[doc(hidden)]
    pub fn store_and_attend_primitives(
        &mut self,
        [kv_pool, qkv]: [FloatTensor<B>; 2],
        keys: &KeyRuns<B>,
        heads: usize,
    ) -> Result<Attended<B>, Error> {
        let qkv_arg = arg("qkv", &qkv);
        validate::require_rank(&qkv_arg, 2, STORE_CONTEXT)?;
        // The new rows are the last pool's width of columns; the queries the rest.
        let kv_cols = kv_pool.shape().get(1).copied().unwrap_or(0);
        let q_cols = qkv_arg.dim(1).saturating_sub(kv_cols);
        self.check_write(arg("kv_pool", &kv_pool), qkv_arg.columns(kv_cols))?;
        let [slots, runs] = keys.launch_args(&qkv_arg.columns(q_cols), &kv_pool, heads)?;
        if !self.one_launch.runs(qkv.dtype()) {
            let [q, kv] = backend::split_columns::<B>(qkv, q_cols);
            let one = |rows| StoreTargets::One(KvRows::Float(rows));
            let StoreTargets::One(KvRows::Float(kv_pool)) = self.write(one(kv_pool), one(kv))
            else {
                unreachable!("a write hands back the targets it was given");
            };
            let out = B::paged_attention(q, kv_pool.clone(), slots, runs, heads);
            return Ok(Attended { out, kv_pool });
        }
        let rows = self.new_rows();
        let output = B::store_and_attend(qkv, kv_pool, rows, slots, runs, heads);
        Ok(Attended::from(output))
    }

    /// These slots, for one store-and-attend, which reads their status.
    fn new_rows(&self) -> NewRowsPrimitive<B> {
        NewRowsPrimitive {
            loc: self.loc.clone(),
            status: self.status().words().clone(),
            claims: self.claims.clone(),
            arrivals: self.arrivals.clone(),
        }
    }

    /// Rows of the caches the slots were checked against.
    pub fn cache_rows(&self) -> usize {
        self.cache_rows
    }

    /// The slots' check on the device, and after each store, why it could not run if it could
    /// not (a launch the device cannot index): a store writes only while it is clear. Its count
    /// is the number of tokens. Check it once, after the last store.
    pub fn status(&self) -> &Status<B> {
        self.status
            .as_ref()
            .expect("a write gives back the status it takes")
    }

    /// The status, when no store follows (see [`status`](Self::status)).
    pub fn into_status(mut self) -> Status<B> {
        self.take_status()
    }

    /// The status, moved out for a write, which sets the one it hands back.
    fn take_status(&mut self) -> Status<B> {
        self.status
            .take()
            .expect("a write gives back the status it takes")
    }

    /// The host rules of one cache's write at these slots.
    fn check_write(
        &self,
        cache: validate::Arg<B::Device>,
        values: validate::Arg<B::Device>,
    ) -> Result<(), Error> {
        validate::store_write(&cache, &arg("loc", &self.loc), &values, self.cache_rows)
    }

    /// The write, its host rules passed; the status moves on to the write's.
    fn write(&mut self, caches: StoreTargets<B>, values: StoreTargets<B>) -> StoreTargets<B> {
        let output = B::store_rows(
            caches,
            values,
            self.loc.clone(),
            self.take_status().into_words(),
        );
        self.status = Some(Status::new(output.status, STORE_CONTEXT));
        output.caches
    }
}

fn rows_arg<B: Backend>(name: &'static str, rows: &KvRows<B>) -> validate::Arg<B::Device> {
    match rows {
        KvRows::Float(tensor) => arg(name, tensor),
        KvRows::Int(tensor) => arg(name, tensor),
    }
}

/// One zeroed u32 word per slot (at least one: zero-sized buffers are not bindable everywhere).
fn zeroed_words<B: Backend>(num_slots: usize, device: &B::Device) -> IntTensor<B> {
    B::int_zeros(Shape::new([num_slots.max(1)]), device, IntDType::U32)
}

/// The scratch of a fresh store: zeroed slot words, clean control words, `clock` values claimed.
fn fresh_scratch<B: Backend>(
    num_slots: usize,
    device: &B::Device,
    clock: u64,
) -> StoreScratchPrimitive<B> {
    let mut control: Vec<i64> = fresh_store_control()
        .into_iter()
        .map(|word| word as i64)
        .collect();
    control[STORE_CLOCK] = clock as i64;
    let len = control.len();
    StoreScratchPrimitive {
        slot_words: zeroed_words::<B>(num_slots, device),
        control: B::int_from_data(TensorData::new(control, [len]), device),
    }
}
