//! Paged attention over slot lists: each token's query heads attend over the K|V pool rows that
//! a run of a slot list names (the slots a gather returned), with no K/V gathered or padded.
//! Query heads share K/V heads in groups (GQA); the scale is `1 / sqrt(head_dim)`.
//!
//! The runs are checked once for a step (every layer reads the same runs over pools of one
//! size), then each layer's attention is one launch:
//!
//! ```no_run
//! use burn_core::tensor::{Int, Tensor};
//! use kvplan::ops::KeyRuns;
//! # fn step(q: Tensor<2>, kv_pool: Tensor<2>, slots: Tensor<1, Int>,
//! #     starts: Tensor<1, Int>, counts: Tensor<1, Int>) -> Result<(), kvplan::Error> {
//! // Token t reads slots[starts[t]..][..counts[t]] of a pool with 4096 rows.
//! let keys = KeyRuns::new(slots, starts, counts, 4096)?;
//! // q [tokens, 9 * 64], the pool [4096, 2 * 3 * 64]: 9 query heads over 3 K/V heads.
//! let out = kvplan::ops::paged_attention(q, kv_pool, &keys, 9)?;
//! kvplan::check_all([keys.status().clone()])?;
//! # Ok(()) }
//! ```

use burn_core::backend::tensor::{FloatTensor, IntTensor};
use burn_core::backend::{Backend, Dispatch, TensorMetadata};
use burn_core::tensor::{Int, Tensor};

use crate::backend::KvPlanBackend;
use crate::deferred::Status;
use crate::error::{ATTENTION_CONTEXT, Error};
use crate::gather::arg;
use crate::validate;

/// Where each token's keys are, checked: token `t` attends over the pool rows at
/// `slots[starts[t] .. starts[t] + counts[t]]` (0 keys: its output is zeros).
#[derive(Debug, Clone)]
pub struct KeyRuns<B: Backend = Dispatch> {
    slots: IntTensor<B>,
    // Private, as the status: the attention trusts them, so only the check may set them. The
    // check's status, the starts and the counts in one buffer: one tensor a layer binds.
    runs: IntTensor<B>,
    tokens: usize,
    pool_rows: usize,
    status: Status<B>,
}

impl KeyRuns {
    /// Checks the runs (int32 or int64, one start and count per token) against pools of
    /// `pool_rows` rows, without any transfer to the host: the value rules stay in `status`.
    ///
    /// # Errors
    /// At once: `not_1d`, `dtype_mismatch`, `device_mismatch`, `run_count_mismatch` (`counts` and
    /// `starts` differ in length). Later, in `status` (value rules): `key_run_out_of_range`,
    /// `key_slot_out_of_range`, `index_range`.
    pub fn new(
        slots: Tensor<1, Int>,
        starts: Tensor<1, Int>,
        counts: Tensor<1, Int>,
        pool_rows: usize,
    ) -> Result<Self, Error> {
        Self::check_primitives(
            [
                slots.into_dispatch(),
                starts.into_dispatch(),
                counts.into_dispatch(),
            ],
            pool_rows,
        )
    }
}

impl<B: KvPlanBackend> KeyRuns<B> {
    /// [`new`](KeyRuns::new) on primitives.
    ///
    /// # Errors
    /// As [`new`](KeyRuns::new).
    #[doc(hidden)]
    pub fn check_primitives(
        [slots, starts, counts]: [IntTensor<B>; 3],
        pool_rows: usize,
    ) -> Result<Self, Error> {
        validate::key_runs(
            &arg("slots", &slots),
            &arg("starts", &starts),
            &arg("counts", &counts),
        )?;
        let tokens = starts.shape()[0];
        let checked = B::check_key_runs(slots.clone(), starts, counts, pool_rows);
        Ok(Self {
            slots,
            runs: checked.runs,
            tokens,
            pool_rows,
            status: Status::new(checked.status, ATTENTION_CONTEXT),
        })
    }

    /// Rows of the pools the runs were checked against.
    pub fn pool_rows(&self) -> usize {
        self.pool_rows
    }

    /// The host rules of an attention of `q` over a joined pool through these runs, then what
    /// its launch takes of them: the slots and the runs record.
    pub(crate) fn launch_args(
        &self,
        q: &validate::Arg<B::Device>,
        kv_pool: &FloatTensor<B>,
        heads: usize,
    ) -> Result<[IntTensor<B>; 2], Error> {
        validate::paged_attention(
            q,
            &arg("kv_pool", kv_pool),
            [&arg("slots", &self.slots), &arg("runs", &self.runs)],
            heads,
            [self.tokens, self.pool_rows],
        )?;
        Ok([self.slots.clone(), self.runs.clone()])
    }

    /// The runs' check on the device: a run outside the slot list or a slot outside the pools
    /// (every attention over these runs is NaN then); its count is the number of tokens.
    pub fn status(&self) -> &Status<B> {
        &self.status
    }
}

/// The attention on any backend's primitives (kvplan's own tools; not a stable API).
#[doc(hidden)]
pub mod generic {
    use super::*;

    /// [`paged_attention`](super::paged_attention) on primitives.
    ///
    /// # Errors
    /// As [`paged_attention`](super::paged_attention).
    pub fn paged_attention<B: KvPlanBackend>(
        q: FloatTensor<B>,
        kv_pool: FloatTensor<B>,
        keys: &KeyRuns<B>,
        heads: usize,
    ) -> Result<FloatTensor<B>, Error> {
        let [slots, runs] = keys.launch_args(&arg("q", &q), &kv_pool, heads)?;
        Ok(B::paged_attention(q, kv_pool, slots, runs, heads))
    }
}

/// Attention of `q` (`[tokens, heads * head_dim]`) over a layer's pool `kv_pool` (`[pool_rows,
/// 2 * kv_heads * head_dim]`, q's float dtype; each row a slot's K, then its V: a page of
/// FlashInfer's layout at one token a page) at each token's run of `keys`: softmax of
/// `q . K / sqrt(head_dim)` applied to V, query heads sharing K/V heads in groups. Nothing is
/// read back: the runs' value rules are in `keys.status()` (on an error there, the output is
/// NaN). The host rules (ranks, dtypes, devices, whole heads, the pool's rows) fail at once. A
/// launch the device cannot index (q or the pool past 2^31 elements without 64-bit indexing) is
/// NaN too, and so is f64 on Vulkan, whose SPIR-V computes exp in 32 bits only.
///
/// # Errors
/// Host rules only, at once: `not_2d`, `dtype_mismatch` (not one float dtype), `device_mismatch`,
/// `pool_rows_mismatch` (not the rows `keys` was checked against), `head_shape`,
/// `run_count_mismatch` (`q`'s rows are not `keys`' tokens). The runs' value errors stay in `keys.status()`.
pub fn paged_attention(
    q: Tensor<2>,
    kv_pool: Tensor<2>,
    keys: &KeyRuns,
    heads: usize,
) -> Result<Tensor<2>, Error> {
    generic::paged_attention::<Dispatch>(q.into_dispatch(), kv_pool.into_dispatch(), keys, heads)
        .map(Tensor::from_dispatch)
}
