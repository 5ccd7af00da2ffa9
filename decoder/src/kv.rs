//! The paged KV cache: per layer a K and a V pool of `[slots, kv_heads * head_dim]` on the device,
//! joined as one tensor `[slots, 2 * kv_heads * head_dim]` (each row a slot's K, then its V: one
//! tensor for each layer's op to bind), stored into and read through kvplan, and the host
//! allocators of its slots and table rows.

use burn_core::tensor::{DType, Device, Int, Tensor};
use kvplan::{AttendedKv, KeyRuns, KvStore, Status, StoreSlots};

use crate::clock::{OpClock, OpKind};
use crate::{DecoderError, Result};

/// A free list of ids `1..count`: id 0 is the padding sink (slot) or padding row, never handed out.
#[derive(Debug, Clone)]
pub struct FreeList {
    what: &'static str,
    count: usize,
    free: Vec<i64>,
}

impl FreeList {
    /// Every id of `1..count` free; lower ids are handed out first.
    pub fn new(what: &'static str, count: usize) -> Self {
        Self {
            what,
            count,
            free: (1..count as i64).rev().collect(),
        }
    }

    /// `n` ids, or an error naming how many are free (nothing is taken then).
    pub fn take(&mut self, n: usize) -> Result<Vec<i64>> {
        if n > self.free.len() {
            return Err(DecoderError::OutOf {
                what: self.what,
                needed: n,
                free: self.free.len(),
            });
        }
        Ok(self
            .free
            .split_off(self.free.len() - n)
            .into_iter()
            .rev()
            .collect())
    }

    /// Gives ids back.
    pub fn give_back(&mut self, ids: &[i64]) {
        debug_assert!(ids.iter().all(|&id| id > 0 && (id as usize) < self.count));
        self.free.extend(ids.iter().rev());
    }

    /// Ids free now.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Ids that can ever be handed out (`count - 1`).
    pub fn capacity(&self) -> usize {
        self.count - 1
    }
}

/// The joined K/V pools of every layer, with the statuses of the stores enqueued since the last
/// [`KvCache::take_statuses`].
pub struct KvCache {
    kv: Vec<Tensor<2>>,
    store: KvStore,
    statuses: Vec<Status>,
    /// Times kvplan's calls: the forward's stores and attention here, the engine's bookkeeping.
    pub clock: OpClock,
    /// Benchmarks only: the kind of kvplan call this step runs twice
    /// ([`crate::engine::EngineOptions::repeat`]).
    pub repeat: Option<OpKind>,
    /// Stands in for a pool while a store has it.
    placeholder: Tensor<2>,
    slots: usize,
    kv_dim: usize,
}

impl KvCache {
    /// Zeroed pools of `slots` rows of `kv_dim` K values and as many V values for `layers` layers.
    pub fn new(
        layers: usize,
        slots: usize,
        kv_dim: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        Ok(Self {
            kv: (0..layers)
                .map(|_| Tensor::<2>::zeros([slots, 2 * kv_dim], (device, dtype)))
                .collect(),
            store: KvStore::allocate(slots, device)?,
            statuses: Vec::new(),
            clock: OpClock::default(),
            repeat: None,
            placeholder: Tensor::<2>::zeros([1, 2 * kv_dim], (device, dtype)),
            slots,
            kv_dim,
        })
    }

    /// Checks a forward's slots `loc` (`[tokens]`) once for the stores of all its layers,
    /// without a read-back.
    pub fn check_slots(&mut self, loc: Tensor<1, Int>) -> Result<StoreSlots> {
        let span = self.clock.start();
        let mut slots = self.store.check_slots(loc.clone(), self.slots);
        if self.repeat == Some(OpKind::Bookkeeping) {
            slots = slots.and_then(|first| {
                self.statuses.push(first.into_status());
                self.store.check_slots(loc, self.slots)
            });
        }
        self.clock.stop(span, OpKind::Stores);
        Ok(slots?)
    }

    /// Stores `kv` (`[tokens, 2 * kv_dim]`: each token's K, then its V) of `layer` at `slots`,
    /// in one launch.
    pub fn store(&mut self, layer: usize, slots: &mut StoreSlots, kv: Tensor<2>) -> Result<()> {
        let span = self.clock.start();
        // The pool moves into the store (a kept clone would make it copy the whole pool).
        let pool = std::mem::replace(&mut self.kv[layer], self.placeholder.clone());
        let stored = if self.repeat == Some(OpKind::Stores) {
            slots
                .store(pool, kv.clone())
                .and_then(|pool| slots.store(pool, kv))
        } else {
            slots.store(pool, kv)
        };
        self.clock.stop(span, OpKind::Stores);
        self.kv[layer] = stored?;
        Ok(())
    }

    /// Stores the K and V rows of `qkv` (queries, keys and values side by side) of `layer` at
    /// `slots`, then attends its queries (`heads` query heads) over the layer's pool through
    /// `keys`: one launch on the GPU (kvplan's `store_qkv_and_attend`). Charged to the attention.
    pub fn store_and_attend(
        &mut self,
        layer: usize,
        slots: &mut StoreSlots,
        qkv: Tensor<2>,
        keys: &KeyRuns,
        heads: usize,
    ) -> Result<Tensor<2>> {
        let span = self.clock.start();
        let pool = std::mem::replace(&mut self.kv[layer], self.placeholder.clone());
        // A clone only for a repeat: a kept tensor is one the op may not reuse.
        let again = (self.repeat == Some(OpKind::Stores)).then(|| qkv.clone());
        let mut attended = slots
            .store_qkv_and_attend(pool, qkv, keys, heads)
            .map(AttendedKv::into_tensors);
        match (self.repeat, again) {
            // The same rows stored again with the same queries: the same pool and output.
            (Some(OpKind::Stores), Some(qkv)) => {
                attended = attended.and_then(|(_, pool)| {
                    slots
                        .store_qkv_and_attend(pool, qkv, keys, heads)
                        .map(AttendedKv::into_tensors)
                });
            }
            // The attention alone again, its first output as queries (other tokens).
            (Some(OpKind::Attention), _) => {
                attended = attended.and_then(|(out, pool)| {
                    let out = kvplan::paged_attention_kv(out, pool.clone(), keys, heads)?;
                    Ok((out, pool))
                });
            }
            _ => {}
        }
        self.clock.stop(span, OpKind::Attention);
        let (out, pool) = attended?;
        self.kv[layer] = pool;
        Ok(out)
    }

    /// Attends `q` (`heads` query heads) over `layer`'s pool through `keys`: one launch
    /// (kvplan's `paged_attention_kv`).
    pub fn attend(
        &mut self,
        layer: usize,
        q: Tensor<2>,
        keys: &KeyRuns,
        heads: usize,
    ) -> Result<Tensor<2>> {
        let pool = self.kv_pool(layer);
        let span = self.clock.start();
        let mut out = kvplan::paged_attention_kv(q, pool.clone(), keys, heads);
        if self.repeat == Some(OpKind::Attention) {
            out = out.and_then(|q| kvplan::paged_attention_kv(q, pool, keys, heads));
        }
        self.clock.stop(span, OpKind::Attention);
        Ok(out?)
    }

    /// Keeps a forward's store status (its slots' check and every store's) for the step's one
    /// read: [`KvCache::take_statuses`].
    pub fn keep_status(&mut self, slots: StoreSlots) {
        self.statuses.push(slots.into_status());
    }

    /// The K and V rows (`[n, kv_dim]` each) of `layer` at `slots` (`[n]`).
    pub fn read(&self, layer: usize, slots: Tensor<1, Int>) -> (Tensor<2>, Tensor<2>) {
        let rows = self.kv[layer].clone().select(0, slots);
        (
            rows.clone().narrow(1, 0, self.kv_dim),
            rows.narrow(1, self.kv_dim, self.kv_dim),
        )
    }

    /// The joined K/V pool of `layer` (the canary fingerprints its bytes).
    pub fn kv_pool(&self, layer: usize) -> Tensor<2> {
        self.kv[layer].clone()
    }

    /// Replaces the pool of `layer` (fault injection writes a corrupted pool back).
    pub fn set_kv_pool(&mut self, layer: usize, pool: Tensor<2>) {
        self.kv[layer] = pool;
    }

    /// The statuses of the stores since the last call.
    pub fn take_statuses(&mut self) -> Vec<Status> {
        std::mem::take(&mut self.statuses)
    }

    /// Slots per pool (slot 0 included).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Values per K (or V) row.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }
}
