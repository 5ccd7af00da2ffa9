//! Which backends implement `KvPlanBackend`, and how.
//!
//! Flex uses the default (reference) bodies, the Cube backend its kernels (`cube`), `Fusion<B>`
//! the macro's lazy ops. `Autodiff` delegates to its inner backend: int tensors are not tracked and
//! KV bytes are only read, so there is no gradient to record.

use burn_core::backend::Flex;
use burn_core::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_core::backend::tensor::FloatTensor;
use burn_core::backend::{Autodiff, AutodiffBackend, Backend};

use super::{
    AssignPrimitive, AttendedPrimitive, CanaryLaunchPrimitive, CanaryPrimitive, GatherPrimitive,
    KeyRunsPrimitive, KvBytes, KvPlanBackend, KvRows, NewRowsPrimitive, OptionalInt,
    PlanInputsPrimitive, PlanOutput, StoreCheckPrimitive, StoreScratchPrimitive, StoreTargets,
    StoreWritePrimitive, VerifyPlanPrimitive, WriteInputsPrimitive, WritePlanPrimitive,
};

impl KvPlanBackend for Flex {}

#[cfg(any(feature = "vulkan", feature = "cuda"))]
impl KvPlanBackend for burn_cubecl::CubeBackend {
    fn masked_gather(
        req_to_token: burn_cubecl::tensor::CubeTensor,
        req_pool_indices: burn_cubecl::tensor::CubeTensor,
        pos2d: burn_cubecl::tensor::CubeTensor,
        mask: burn_cubecl::tensor::CubeTensor,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        super::cube::masked_gather(req_to_token, req_pool_indices, pos2d, mask, capacity)
    }

    fn segment_gather(
        req_to_token: burn_cubecl::tensor::CubeTensor,
        req_pool_indices: burn_cubecl::tensor::CubeTensor,
        start: OptionalInt<Self>,
        lengths: burn_cubecl::tensor::CubeTensor,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        super::cube::segment_gather(
            req_to_token,
            req_pool_indices,
            start.into_option(),
            lengths,
            capacity,
        )
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<Self>,
        write: WritePlanPrimitive<Self>,
        inputs: PlanInputsPrimitive<Self>,
    ) -> PlanOutput<Self> {
        super::cube::canary_plan(verify, write, inputs)
    }

    fn segment_assign(
        req_to_token: burn_cubecl::tensor::CubeTensor,
        req_pool_indices: burn_cubecl::tensor::CubeTensor,
        start: burn_cubecl::tensor::CubeTensor,
        lengths: burn_cubecl::tensor::CubeTensor,
        out_cache_loc: burn_cubecl::tensor::CubeTensor,
    ) -> AssignPrimitive<Self> {
        super::cube::segment_assign(
            req_to_token,
            req_pool_indices,
            start,
            lengths,
            out_cache_loc,
        )
    }

    fn check_store_slots(
        loc: burn_cubecl::tensor::CubeTensor,
        scratch: StoreScratchPrimitive<Self>,
        cache_rows: usize,
    ) -> StoreCheckPrimitive<Self> {
        super::cube::check_store_slots(loc, scratch, cache_rows)
    }

    fn store_rows(
        caches: StoreTargets<Self>,
        values: StoreTargets<Self>,
        loc: burn_cubecl::tensor::CubeTensor,
        status: burn_cubecl::tensor::CubeTensor,
    ) -> StoreWritePrimitive<Self> {
        super::cube::store_rows(caches, values, loc, status)
    }

    fn canary_write(
        canary: CanaryPrimitive<Self>,
        plan: WritePlanPrimitive<Self>,
        inputs: WriteInputsPrimitive<Self>,
        launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        super::cube::canary_write(canary, plan, inputs, launch)
    }

    fn canary_verify(
        canary: CanaryPrimitive<Self>,
        plan: VerifyPlanPrimitive<Self>,
        launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        super::cube::canary_verify(canary, plan, launch)
    }

    fn int_view(
        tensor: burn_cubecl::tensor::CubeTensor,
        offset: usize,
        len: usize,
    ) -> burn_cubecl::tensor::CubeTensor {
        super::cube::view(tensor, offset, len)
    }

    fn write_i64(
        target: burn_cubecl::tensor::CubeTensor,
        values: Vec<i64>,
    ) -> burn_cubecl::tensor::CubeTensor {
        super::cube::write_i64(target, values)
    }

    fn check_key_runs(
        slots: burn_cubecl::tensor::CubeTensor,
        starts: burn_cubecl::tensor::CubeTensor,
        counts: burn_cubecl::tensor::CubeTensor,
        pool_rows: usize,
    ) -> KeyRunsPrimitive<Self> {
        super::cube::check_key_runs(slots, starts, counts, pool_rows)
    }

    fn paged_attention(
        q: burn_cubecl::tensor::CubeTensor,
        kv_pool: burn_cubecl::tensor::CubeTensor,
        slots: burn_cubecl::tensor::CubeTensor,
        runs: burn_cubecl::tensor::CubeTensor,
        heads: usize,
    ) -> burn_cubecl::tensor::CubeTensor {
        super::cube::paged_attention(q, kv_pool, [slots, runs], heads)
    }

    fn store_and_attend(
        qkv: burn_cubecl::tensor::CubeTensor,
        kv_pool: burn_cubecl::tensor::CubeTensor,
        rows: NewRowsPrimitive<Self>,
        slots: burn_cubecl::tensor::CubeTensor,
        runs: burn_cubecl::tensor::CubeTensor,
        heads: usize,
    ) -> AttendedPrimitive<Self> {
        super::cube::store_and_attend([qkv, kv_pool], rows, [slots, runs], heads)
    }
}

/// Moves a value between `Autodiff<B>` and `B`: their int primitives are one type.
trait Rebase<T> {
    fn rebase(self) -> T;
}

/// The same struct over another backend whose int primitive is the same type, field by field.
macro_rules! rebase_ints {
    ($name:ident { $($field:ident),* } $(, $keep:ident)*) => {
        impl<B: Backend, C: CheckpointStrategy> Rebase<$name<B>> for $name<Autodiff<B, C>> {
            fn rebase(self) -> $name<B> {
                $name { $($field: self.$field.rebase(),)* $($keep: self.$keep,)* }
            }
        }
        impl<B: Backend, C: CheckpointStrategy> Rebase<$name<Autodiff<B, C>>> for $name<B> {
            fn rebase(self) -> $name<Autodiff<B, C>> {
                $name { $($field: self.$field.rebase(),)* $($keep: self.$keep,)* }
            }
        }
    };
}

impl<T> Rebase<T> for T {
    fn rebase(self) -> T {
        self
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<OptionalInt<B>> for OptionalInt<Autodiff<B, C>> {
    fn rebase(self) -> OptionalInt<B> {
        match self {
            Self::Given(tensor) => OptionalInt::Given(tensor),
            Self::Absent => OptionalInt::Absent,
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<KvBytes<B>> for KvBytes<Autodiff<B, C>> {
    fn rebase(self) -> KvBytes<B> {
        match self {
            Self::Float(tensor) => KvBytes::Float(tensor.into_primitive()),
            Self::Int(tensor) => KvBytes::Int(tensor),
            Self::Absent => KvBytes::Absent,
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<StoreTargets<B>> for StoreTargets<Autodiff<B, C>> {
    fn rebase(self) -> StoreTargets<B> {
        match self {
            Self::One(first) => StoreTargets::One(first.rebase()),
            Self::Pair(first, second) => StoreTargets::Pair(first.rebase(), second.rebase()),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<StoreTargets<Autodiff<B, C>>> for StoreTargets<B> {
    fn rebase(self) -> StoreTargets<Autodiff<B, C>> {
        match self {
            Self::One(first) => StoreTargets::One(first.rebase()),
            Self::Pair(first, second) => StoreTargets::Pair(first.rebase(), second.rebase()),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<KvRows<B>> for KvRows<Autodiff<B, C>> {
    fn rebase(self) -> KvRows<B> {
        match self {
            Self::Float(tensor) => KvRows::Float(tensor.into_primitive()),
            Self::Int(tensor) => KvRows::Int(tensor),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<KvRows<Autodiff<B, C>>> for KvRows<B> {
    fn rebase(self) -> KvRows<Autodiff<B, C>> {
        match self {
            // A cache is a constant: no gradient flows through a store.
            Self::Float(tensor) => KvRows::Float(Autodiff::<B, C>::from_inner(tensor)),
            Self::Int(tensor) => KvRows::Int(tensor),
        }
    }
}

rebase_ints!(GatherPrimitive { out, status });
rebase_ints!(AssignPrimitive {
    req_to_token,
    status
});
rebase_ints!(StoreScratchPrimitive {
    slot_words,
    control
});
rebase_ints!(StoreCheckPrimitive { scratch, status });
rebase_ints!(StoreWritePrimitive { caches, status });
rebase_ints!(VerifyPlanPrimitive {
    slot_indices,
    expected_tokens,
    expected_positions,
    prev_slot_indices,
    num_valid,
    enable
});
rebase_ints!(WritePlanPrimitive {
    offsets,
    seed_slot_indices,
    num_valid_reqs,
    scratch
});
rebase_ints!(
    CanaryPrimitive {
        buffer,
        ring,
        counters,
        status
    },
    num_slots,
    slot_words,
    ring_capacity
);
rebase_ints!(PlanOutput {
    verify,
    write,
    status
});

impl<B: Backend, C: CheckpointStrategy> Rebase<PlanInputsPrimitive<B>>
    for PlanInputsPrimitive<Autodiff<B, C>>
{
    fn rebase(self) -> PlanInputsPrimitive<B> {
        PlanInputsPrimitive {
            req_pool_indices: self.req_pool_indices,
            prefix_lens: self.prefix_lens,
            extend_seq_lens: self.extend_seq_lens,
            req_to_token: self.req_to_token,
            full_to_swa: self.full_to_swa.rebase(),
            expected_tokens: self.expected_tokens.rebase(),
            expected_tokens_valid_lens: self.expected_tokens_valid_lens.rebase(),
            swa_window_size: self.swa_window_size,
            position_offset: self.position_offset,
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<WriteInputsPrimitive<B>>
    for WriteInputsPrimitive<Autodiff<B, C>>
{
    fn rebase(self) -> WriteInputsPrimitive<B> {
        WriteInputsPrimitive {
            input_ids: self.input_ids,
            positions: self.positions,
            out_cache_loc: self.out_cache_loc,
            expected_input_tokens: self.expected_input_tokens.rebase(),
            expected_input_positions: self.expected_input_positions.rebase(),
            chain_position_assert: self.chain_position_assert.rebase(),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> Rebase<CanaryLaunchPrimitive<B>>
    for CanaryLaunchPrimitive<Autodiff<B, C>>
{
    fn rebase(self) -> CanaryLaunchPrimitive<B> {
        CanaryLaunchPrimitive {
            source_0: self.source_0.rebase(),
            source_1: self.source_1.rebase(),
            source_2: self.source_2.rebase(),
            source_3: self.source_3.rebase(),
            meta: self.meta,
        }
    }
}

impl<B: KvPlanBackend, C: CheckpointStrategy> KvPlanBackend for Autodiff<B, C> {
    fn masked_gather(
        req_to_token: B::IntTensorPrimitive,
        req_pool_indices: B::IntTensorPrimitive,
        pos2d: B::IntTensorPrimitive,
        mask: B::BoolTensorPrimitive,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        B::masked_gather(req_to_token, req_pool_indices, pos2d, mask, capacity).rebase()
    }

    fn segment_gather(
        req_to_token: B::IntTensorPrimitive,
        req_pool_indices: B::IntTensorPrimitive,
        start: OptionalInt<Self>,
        lengths: B::IntTensorPrimitive,
        capacity: usize,
    ) -> GatherPrimitive<Self> {
        B::segment_gather(
            req_to_token,
            req_pool_indices,
            start.rebase(),
            lengths,
            capacity,
        )
        .rebase()
    }

    fn canary_plan(
        verify: VerifyPlanPrimitive<Self>,
        write: WritePlanPrimitive<Self>,
        inputs: PlanInputsPrimitive<Self>,
    ) -> PlanOutput<Self> {
        B::canary_plan(verify.rebase(), write.rebase(), inputs.rebase()).rebase()
    }

    fn segment_assign(
        req_to_token: B::IntTensorPrimitive,
        req_pool_indices: B::IntTensorPrimitive,
        start: B::IntTensorPrimitive,
        lengths: B::IntTensorPrimitive,
        out_cache_loc: B::IntTensorPrimitive,
    ) -> AssignPrimitive<Self> {
        B::segment_assign(
            req_to_token,
            req_pool_indices,
            start,
            lengths,
            out_cache_loc,
        )
        .rebase()
    }

    fn check_store_slots(
        loc: B::IntTensorPrimitive,
        scratch: StoreScratchPrimitive<Self>,
        cache_rows: usize,
    ) -> StoreCheckPrimitive<Self> {
        B::check_store_slots(loc, scratch.rebase(), cache_rows).rebase()
    }

    fn store_rows(
        caches: StoreTargets<Self>,
        values: StoreTargets<Self>,
        loc: B::IntTensorPrimitive,
        status: B::IntTensorPrimitive,
    ) -> StoreWritePrimitive<Self> {
        B::store_rows(caches.rebase(), values.rebase(), loc, status).rebase()
    }

    fn canary_write(
        canary: CanaryPrimitive<Self>,
        plan: WritePlanPrimitive<Self>,
        inputs: WriteInputsPrimitive<Self>,
        launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        B::canary_write(
            canary.rebase(),
            plan.rebase(),
            inputs.rebase(),
            launch.rebase(),
        )
        .rebase()
    }

    fn canary_verify(
        canary: CanaryPrimitive<Self>,
        plan: VerifyPlanPrimitive<Self>,
        launch: CanaryLaunchPrimitive<Self>,
    ) -> CanaryPrimitive<Self> {
        B::canary_verify(canary.rebase(), plan.rebase(), launch.rebase()).rebase()
    }

    fn int_view(tensor: B::IntTensorPrimitive, offset: usize, len: usize) -> B::IntTensorPrimitive {
        B::int_view(tensor, offset, len)
    }

    fn write_i64(target: B::IntTensorPrimitive, values: Vec<i64>) -> B::IntTensorPrimitive {
        B::write_i64(target, values)
    }

    fn check_key_runs(
        slots: B::IntTensorPrimitive,
        starts: B::IntTensorPrimitive,
        counts: B::IntTensorPrimitive,
        pool_rows: usize,
    ) -> KeyRunsPrimitive<Self> {
        let KeyRunsPrimitive { status, runs } = B::check_key_runs(slots, starts, counts, pool_rows);
        KeyRunsPrimitive { status, runs }
    }

    fn paged_attention(
        q: FloatTensor<Self>,
        kv_pool: FloatTensor<Self>,
        slots: B::IntTensorPrimitive,
        runs: B::IntTensorPrimitive,
        heads: usize,
    ) -> FloatTensor<Self> {
        // The pool is a constant; no gradient flows through the attention (inference only).
        Autodiff::<B, C>::from_inner(B::paged_attention(
            q.into_primitive(),
            kv_pool.into_primitive(),
            slots,
            runs,
            heads,
        ))
    }

    fn store_and_attend(
        qkv: FloatTensor<Self>,
        kv_pool: FloatTensor<Self>,
        rows: NewRowsPrimitive<Self>,
        slots: B::IntTensorPrimitive,
        runs: B::IntTensorPrimitive,
        heads: usize,
    ) -> AttendedPrimitive<Self> {
        // As the store and the attention alone: constants, no gradient (inference only).
        let inner = B::store_and_attend(
            qkv.into_primitive(),
            kv_pool.into_primitive(),
            inner_rows(rows),
            slots,
            runs,
            heads,
        );
        AttendedPrimitive {
            out: Autodiff::<B, C>::from_inner(inner.out),
            kv_pool: Autodiff::<B, C>::from_inner(inner.kv_pool),
        }
    }
}

/// A store's slots as the inner backend's (int tensors: the same type).
fn inner_rows<B: Backend, C: CheckpointStrategy>(
    rows: NewRowsPrimitive<Autodiff<B, C>>,
) -> NewRowsPrimitive<B> {
    NewRowsPrimitive {
        loc: rows.loc,
        status: rows.status,
        claims: rows.claims,
        arrivals: rows.arrivals,
    }
}
