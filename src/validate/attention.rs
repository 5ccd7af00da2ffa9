//! Immediate rules of `paged_attention`: ranks, dtypes, devices, whole heads, one run per token.
//! The value rules (runs inside the slot list, slots inside the pools) are the op's.

use core::fmt::Debug;

use kvplan_kernels::attention::MAX_HEAD_DIM;

use super::{Arg, dtype_name, require_device, require_int, require_rank};
use crate::error::{ATTENTION_CONTEXT, Error};
use crate::reference::Heads;

/// `slots`, `starts` and `counts` 1-D ints on one device, one start per count.
pub fn key_runs<D: PartialEq + Debug>(
    slots: &Arg<D>,
    starts: &Arg<D>,
    counts: &Arg<D>,
) -> Result<(), Error> {
    let context = ATTENTION_CONTEXT;
    for arg in [slots, starts, counts] {
        require_rank(arg, 1, context)?;
        require_int(arg, context)?;
    }
    for arg in [starts, counts] {
        require_device(arg, &slots.device, context)?;
    }
    if counts.dim(0) != starts.dim(0) {
        return Err(Error::RunCountMismatch {
            context: context.into(),
            name: counts.name,
            len: counts.dim(0),
            tokens: starts.dim(0),
        });
    }
    Ok(())
}

/// `q` `[tokens, heads * head_dim]` and the joined pool `[pool_rows, 2 * kv_heads * head_dim]`
/// (the rows the runs were checked against), one float dtype; one run per token (`runs` holds
/// `tokens`); one device. Returns the heads.
pub fn paged_attention<D: PartialEq + Debug>(
    q: &Arg<D>,
    kv_pool: &Arg<D>,
    [slots, runs]: [&Arg<D>; 2],
    heads: usize,
    [tokens, pool_rows]: [usize; 2],
) -> Result<Heads, Error> {
    let context = ATTENTION_CONTEXT;
    for arg in [q, kv_pool] {
        require_rank(arg, 2, context)?;
    }
    for arg in [q, kv_pool] {
        if !arg.dtype.is_float() || arg.dtype != q.dtype {
            return Err(Error::DtypeMismatch {
                context: context.into(),
                name: arg.name,
                got: dtype_name(arg.dtype),
                accepted: "a float dtype, the same for q and kv_pool",
            });
        }
    }
    for arg in [kv_pool, slots, runs] {
        require_device(arg, &q.device, context)?;
    }
    if kv_pool.dim(0) != pool_rows {
        return Err(Error::PoolRowsMismatch {
            context: context.into(),
            kv_pool: kv_pool.dims(),
            pool_rows,
        });
    }
    let head_dim = q.dim(1).checked_div(heads).unwrap_or(0);
    let k_cols = kv_pool.dim(1) / 2;
    let kv_heads = k_cols.checked_div(head_dim).unwrap_or(0);
    let whole = head_dim > 0
        && head_dim <= MAX_HEAD_DIM
        && heads * head_dim == q.dim(1)
        && kv_heads > 0
        && 2 * kv_heads * head_dim == kv_pool.dim(1)
        && heads % kv_heads == 0;
    if !whole {
        return Err(Error::HeadShape {
            context: context.into(),
            q: q.dims(),
            kv_pool: kv_pool.dims(),
            heads,
            max_head_dim: MAX_HEAD_DIM,
        });
    }
    if tokens != q.dim(0) {
        return Err(Error::RunCountMismatch {
            context: context.into(),
            name: "starts",
            len: tokens,
            tokens: q.dim(0),
        });
    }
    Ok(Heads {
        heads,
        kv_heads,
        head_dim,
    })
}
