//! The paged KV cache: per layer a K and a V pool of `[slots, kv_heads * head_dim]` on the device,
//! stored into and read through kvplan, and the host allocators of its slots and table rows.

use burn_core::tensor::{DType, Device, Int, Tensor};
use kvplan::{Attended, KeyRuns, KvStore, Status, StoreSlots};

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

/// K and V pools of every layer, with the statuses of the stores enqueued since the last
/// [`KvCache::take_statuses`].
pub struct KvCache {
    k: Vec<Tensor<2>>,
    v: Vec<Tensor<2>>,
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
    /// Zeroed pools of `slots` rows of `kv_dim` values for `layers` layers.
    pub fn new(
        layers: usize,
        slots: usize,
        kv_dim: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let pool = || Tensor::<2>::zeros([slots, kv_dim], (device, dtype));
        Ok(Self {
            k: (0..layers).map(|_| pool()).collect(),
            v: (0..layers).map(|_| pool()).collect(),
            store: KvStore::allocate(slots, device)?,
            statuses: Vec::new(),
            clock: OpClock::default(),
            repeat: None,
            placeholder: Tensor::<2>::zeros([1, kv_dim], (device, dtype)),
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

    /// Stores `k` and `v` (`[tokens, kv_dim]`) of `layer` at `slots`, in one launch.
    pub fn store(
        &mut self,
        layer: usize,
        slots: &mut StoreSlots,
        k: Tensor<2>,
        v: Tensor<2>,
    ) -> Result<()> {
        let span = self.clock.start();
        // The pools move into the store (a kept clone would make it copy the whole pool).
        let k_pool = std::mem::replace(&mut self.k[layer], self.placeholder.clone());
        let v_pool = std::mem::replace(&mut self.v[layer], self.placeholder.clone());
        let stored = if self.repeat == Some(OpKind::Stores) {
            slots
                .store_kv(k_pool, v_pool, k.clone(), v.clone())
                .and_then(|(k_pool, v_pool)| slots.store_kv(k_pool, v_pool, k, v))
        } else {
            slots.store_kv(k_pool, v_pool, k, v)
        };
        self.clock.stop(span, OpKind::Stores);
        (self.k[layer], self.v[layer]) = stored?;
        Ok(())
    }

    /// Stores the K rows of `qk` (queries and keys side by side) and `v` of `layer` at `slots`,
    /// then attends its queries (`heads` query heads) over the layer's pools through `keys`: one
    /// launch on the GPU (kvplan's `store_qk_and_attend`). Charged to the attention.
    pub fn store_and_attend(
        &mut self,
        layer: usize,
        slots: &mut StoreSlots,
        qk: Tensor<2>,
        v: Tensor<2>,
        keys: &KeyRuns,
        heads: usize,
    ) -> Result<Tensor<2>> {
        let span = self.clock.start();
        let k_pool = std::mem::replace(&mut self.k[layer], self.placeholder.clone());
        let v_pool = std::mem::replace(&mut self.v[layer], self.placeholder.clone());
        // Clones only for a repeat: a kept tensor is one the op may not reuse.
        let again = (self.repeat == Some(OpKind::Stores)).then(|| (qk.clone(), v.clone()));
        let mut attended = slots
            .store_qk_and_attend(k_pool, v_pool, qk, v, keys, heads)
            .map(Attended::into_tensors);
        match (self.repeat, again) {
            // The same rows stored again with the same queries: the same pools and output.
            (Some(OpKind::Stores), Some((qk, v))) => {
                attended = attended.and_then(|(_, k_pool, v_pool)| {
                    slots
                        .store_qk_and_attend(k_pool, v_pool, qk, v, keys, heads)
                        .map(Attended::into_tensors)
                });
            }
            // The attention alone again, its first output as queries (other tokens).
            (Some(OpKind::Attention), _) => {
                attended = attended.and_then(|(out, k_pool, v_pool)| {
                    let out =
                        kvplan::paged_attention(out, k_pool.clone(), v_pool.clone(), keys, heads)?;
                    Ok((out, k_pool, v_pool))
                });
            }
            _ => {}
        }
        self.clock.stop(span, OpKind::Attention);
        let (out, k_pool, v_pool) = attended?;
        (self.k[layer], self.v[layer]) = (k_pool, v_pool);
        Ok(out)
    }

    /// Attends `q` (`heads` query heads) over `layer`'s pools through `keys`: one launch
    /// (kvplan's `paged_attention`).
    pub fn attend(
        &mut self,
        layer: usize,
        q: Tensor<2>,
        keys: &KeyRuns,
        heads: usize,
    ) -> Result<Tensor<2>> {
        let (k_pool, v_pool) = self.pools(layer);
        let span = self.clock.start();
        let mut out = kvplan::paged_attention(q, k_pool.clone(), v_pool.clone(), keys, heads);
        if self.repeat == Some(OpKind::Attention) {
            out = out.and_then(|q| kvplan::paged_attention(q, k_pool, v_pool, keys, heads));
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
        (
            self.k[layer].clone().select(0, slots.clone()),
            self.v[layer].clone().select(0, slots),
        )
    }

    /// The K and V pools of `layer`.
    pub fn pools(&self, layer: usize) -> (Tensor<2>, Tensor<2>) {
        (self.k[layer].clone(), self.v[layer].clone())
    }

    /// The K pool of `layer` (the canary fingerprints its bytes).
    pub fn k_pool(&self, layer: usize) -> Tensor<2> {
        self.k[layer].clone()
    }

    /// Replaces the K pool of `layer` (fault injection writes a corrupted pool back).
    pub fn set_k_pool(&mut self, layer: usize, pool: Tensor<2>) {
        self.k[layer] = pool;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_list_hands_out_low_ids_first_and_never_zero() {
        let mut list = FreeList::new("KV slots", 5);
        assert_eq!(list.take(2).unwrap(), vec![1, 2]);
        assert_eq!(list.free(), 2);
        let error = list.take(3).unwrap_err().to_string();
        assert_eq!(error, "out of KV slots: 3 needed, 2 free");
        assert_eq!(list.free(), 2);
        list.give_back(&[2, 1]);
        assert_eq!(list.take(4).unwrap(), vec![2, 1, 3, 4]);
        assert_eq!(list.free(), 0);
    }
}
