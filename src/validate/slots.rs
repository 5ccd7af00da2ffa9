//! Immediate rules of `segment_assign` and `store_kv` (spec `slots.md`): ranks, dtypes, devices,
//! and the lengths and shapes the host knows. The value rules are the ops' (kernels and reference).

use core::fmt::Debug;

use super::{Arg, dtype_name, require_device, require_int, require_rank};
use crate::error::{ASSIGN_CONTEXT, Dims, Error, STORE_CONTEXT};

/// Ranks, dtypes and devices of the five inputs, then one `start` and one length per request.
pub fn segment_assign<D: PartialEq + Debug>(
    req_to_token: &Arg<D>,
    req_pool_indices: &Arg<D>,
    start: &Arg<D>,
    lengths: &Arg<D>,
    out_cache_loc: &Arg<D>,
) -> Result<(), Error> {
    let context = ASSIGN_CONTEXT;
    let vectors = [req_pool_indices, start, lengths, out_cache_loc];
    require_rank(req_to_token, 2, context)?;
    for arg in vectors {
        require_rank(arg, 1, context)?;
    }
    require_int(req_to_token, context)?;
    for arg in vectors {
        require_int(arg, context)?;
    }
    for arg in vectors {
        require_device(arg, &req_to_token.device, context)?;
    }
    let bs = req_pool_indices.dim(0);
    for arg in [start, lengths] {
        if arg.dim(0) != bs {
            return Err(Error::SegmentLengthMismatch {
                context: context.into(),
                name: arg.name,
                len: arg.dim(0),
                bs,
            });
        }
    }
    Ok(())
}

/// `loc` is 1-D and `values` one cache row per entry; the cache holds floats or ints and `values`
/// the same dtype; one device; and the cache has at most the store's `capacity` slots.
pub fn store_kv<D: PartialEq + Debug>(
    cache: &Arg<D>,
    loc: &Arg<D>,
    values: &Arg<D>,
    capacity: usize,
) -> Result<(), Error> {
    require_rank(loc, 1, STORE_CONTEXT)?;
    rows(cache, loc, values)?;
    fits(cache.dim(0), capacity)
}

/// A store's slots: `loc` 1-D ints on the store's device, for caches of at most the store's
/// `capacity` rows.
pub fn store_slots<D: PartialEq + Debug>(
    loc: &Arg<D>,
    device: &D,
    cache_rows: usize,
    capacity: usize,
) -> Result<(), Error> {
    require_rank(loc, 1, STORE_CONTEXT)?;
    require_int(loc, STORE_CONTEXT)?;
    require_device(loc, device, STORE_CONTEXT)?;
    fits(cache_rows, capacity)
}

/// One cache and its rows through checked slots: [`store_kv`]'s rules of the two, and the cache
/// has the rows the slots were checked against.
pub fn store_write<D: PartialEq + Debug>(
    cache: &Arg<D>,
    loc: &Arg<D>,
    values: &Arg<D>,
    cache_rows: usize,
) -> Result<(), Error> {
    rows(cache, loc, values)?;
    if cache.dim(0) != cache_rows {
        return Err(Error::CacheRowsMismatch {
            context: STORE_CONTEXT.into(),
            name: cache.name,
            cache: cache.dims(),
            cache_rows,
        });
    }
    Ok(())
}

/// `values` one cache row per slot of `loc`, the cache's dtype (a float or int one), one device.
fn rows<D: PartialEq + Debug>(cache: &Arg<D>, loc: &Arg<D>, values: &Arg<D>) -> Result<(), Error> {
    let context = STORE_CONTEXT;
    let mut expected = vec![loc.dim(0)];
    expected.extend(cache.shape.iter().skip(1));
    if cache.shape.is_empty() || values.shape != expected {
        return Err(Error::ValueShapeMismatch {
            context: context.into(),
            values: values.dims(),
            expected: Dims(expected),
            cache: cache.dims(),
        });
    }
    let dtype = cache.dtype;
    if !(dtype.is_float() || dtype.is_int() || dtype.is_uint()) {
        return Err(Error::DtypeMismatch {
            context: context.into(),
            name: cache.name,
            got: dtype_name(dtype),
            accepted: "a float or int dtype",
        });
    }
    require_int(loc, context)?;
    if values.dtype != dtype {
        return Err(Error::ValueDtypeMismatch {
            context: context.into(),
            values: dtype_name(values.dtype),
            cache: dtype_name(dtype),
        });
    }
    for arg in [loc, values] {
        require_device(arg, &cache.device, context)?;
    }
    Ok(())
}

/// Caches of `rows` rows fit a store allocated for `capacity` slots.
fn fits(rows: usize, capacity: usize) -> Result<(), Error> {
    if rows > capacity {
        return Err(Error::StoreCapacity {
            context: STORE_CONTEXT.into(),
            slots: rows,
            capacity,
        });
    }
    Ok(())
}
