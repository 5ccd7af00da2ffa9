//! Launchers of the paged attention: the key runs' check (one cube), which also writes the runs
//! record each layer's launch binds, and the attention, which runs only on the check's clear
//! status.

use burn_core::backend::TensorMetadata;
use burn_core::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, full_device_dtype};
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;
use kvplan_kernels::attention::{
    AttentionShapeLaunch, NewRowsShapeLaunch, attention_check_kernel, attention_kernel,
    attention_kv_kernel, attention_units, runs_len, store_attention_kernel,
    store_attention_kv_kernel,
};
use kvplan_kernels::scan::CUBE_SIZE;
use kvplan_kernels::status::STATUS_LEN;

use super::slots::owned;
use super::wide_capable;
use super::{
    address_type, bindable, contiguous, grid, output_i64, storage, stride, upload_parts, widened,
};
use crate::ops::{AttendedKvPrimitive, AttendedPrimitive, KeyRunsPrimitive, NewRowsPrimitive};
use cubecl::client::Client;

/// A layer's pools as the kernels bind them: a K and a V pool, or one joined pool whose rows
/// are a slot's K, then its V.
#[allow(clippy::large_enum_variant)] // one a launch, on the stack
enum Pools {
    Split(CubeTensor, CubeTensor),
    Joined(CubeTensor),
}

impl Pools {
    fn map(self, f: impl Fn(CubeTensor) -> CubeTensor) -> Self {
        match self {
            Self::Split(k_pool, v_pool) => Self::Split(f(k_pool), f(v_pool)),
            Self::Joined(kv_pool) => Self::Joined(f(kv_pool)),
        }
    }

    /// The tensors the K rows and the V rows are in (a joined pool twice).
    fn parts(&self) -> [&CubeTensor; 2] {
        match self {
            Self::Split(k_pool, v_pool) => [k_pool, v_pool],
            Self::Joined(kv_pool) => [kv_pool, kv_pool],
        }
    }

    /// Columns of a K row.
    fn k_cols(&self) -> usize {
        match self {
            Self::Split(k_pool, _) => k_pool.shape()[1],
            Self::Joined(kv_pool) => kv_pool.shape()[1] / 2,
        }
    }

    /// Where a V row starts in its pool's row.
    fn v_offset(&self) -> usize {
        match self {
            Self::Split(..) => 0,
            Self::Joined(_) => self.k_cols(),
        }
    }
}

/// The launch scalars; `pool_rows` and `slots_len` are what the check holds the runs to. The
/// starts' and counts' strides are the check's (the attention reads the runs record).
fn attention_shape(
    slots: &CubeTensor,
    [starts_stride, counts_stride]: [u64; 2],
    [tokens, heads, groups, pool_rows]: [usize; 4],
    (q, pools): (Option<&CubeTensor>, Option<&Pools>),
) -> AttentionShapeLaunch {
    let row_stride = |tensor: Option<&CubeTensor>| tensor.map_or(0, |tensor| stride(tensor, 0));
    let [k_pool, v_pool] = pools.map_or([None, None], |pools| pools.parts().map(Some));
    AttentionShapeLaunch::new(
        tokens as u64,
        heads as u64,
        groups as u64,
        pool_rows as u64,
        slots.shape()[0] as u64,
        row_stride(q),
        row_stride(k_pool),
        row_stride(v_pool),
        pools.map_or(0, Pools::v_offset) as u64,
        stride(slots, 0),
        starts_stride,
        counts_stride,
    )
}

pub(crate) fn check_key_runs(
    slots: CubeTensor,
    starts: CubeTensor,
    counts: CubeTensor,
    pool_rows: usize,
) -> KeyRunsPrimitive<CubeBackend> {
    let tokens = starts.shape()[0];
    let address = match address_type([&slots, &starts, &counts], &[runs_len(tokens)]) {
        Ok(address) => address,
        Err(error) => {
            // Nothing runs: the record is the error, and every start and count 0.
            let words = crate::status::encode(&Err(error)).map(|word| word as u64);
            let body = vec![0; 2 * tokens];
            let [status, runs] = upload_parts(
                &slots,
                [
                    (&words, DType::I64),
                    (&[&words[..], &body].concat(), DType::I64),
                ],
            );
            return KeyRunsPrimitive { status, runs };
        }
    };
    let status = output_i64(&slots, STATUS_LEN);
    let runs = output_i64(&slots, runs_len(tokens));
    let [slots, starts, counts] = [slots, starts, counts].map(|ints| bindable(widened(ints)));
    let shape = attention_shape(
        &slots,
        [stride(&starts, 0), stride(&counts, 0)],
        [tokens, 0, 1, pool_rows],
        (None, None),
    );
    let dtypes = [storage(&slots), storage(&starts), storage(&counts)];
    let client = slots.client.clone();
    // SAFETY: every index the kernel forms is bounds-checked against the shape passed here.
    unsafe {
        attention_check_kernel::launch_unchecked(
            &client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(CUBE_SIZE),
            address,
            slots.into_tensor_arg(),
            starts.into_tensor_arg(),
            counts.into_tensor_arg(),
            status.clone().into_tensor_arg(),
            runs.clone().into_tensor_arg(),
            shape,
            dtypes,
        );
    }
    KeyRunsPrimitive { status, runs }
}

/// f64 through SPIR-V, whose exp is 32-bit only (GLSL.std.450): the attention is NaN there.
fn f64_on_spirv(q: &CubeTensor) -> bool {
    q.dtype == DType::F64 && spirv(&q.client)
}

/// NaN of `q`'s dtype in `shape`: the output of an attention that cannot run.
fn nan_output(q: CubeTensor, shape: Shape) -> CubeTensor {
    let nan = InputScalar::new(f32::NAN, storage(&q));
    full_device_dtype(q.client, shape, q.device, nan, q.dtype)
}

fn spirv(client: &Client) -> bool {
    client
        .properties()
        .identity
        .fingerprint
        .starts_with("spirv_")
}

/// Whether `device`'s launches may index with 64 bits, and whether it compiles through SPIR-V
/// (f64 attention is NaN there): where either rules out the one launch of a store and attention,
/// the caller makes them apart, and the store reports a refusal in its status.
pub(crate) fn launch_traits(device: &burn_cubecl::CubeDevice) -> (bool, bool) {
    let client = device.client();
    (wide_capable(&client), spirv(&client))
}

/// Rows whose last dim is contiguous: the tensor itself, or a contiguous copy.
fn unit_rows(tensor: CubeTensor) -> CubeTensor {
    if tensor.shape()[1] <= 1 || stride(&tensor, 1) == 1 {
        tensor
    } else {
        contiguous(tensor)
    }
}

pub(crate) fn paged_attention(
    q: CubeTensor,
    k_pool: CubeTensor,
    v_pool: CubeTensor,
    keys: [CubeTensor; 2],
    heads: usize,
) -> CubeTensor {
    attention(q, Pools::Split(k_pool, v_pool), keys, heads)
}

pub(crate) fn paged_attention_kv(
    q: CubeTensor,
    kv_pool: CubeTensor,
    keys: [CubeTensor; 2],
    heads: usize,
) -> CubeTensor {
    attention(q, Pools::Joined(kv_pool), keys, heads)
}

fn attention(
    q: CubeTensor,
    pools: Pools,
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> CubeTensor {
    let (q, pools) = (unit_rows(q), pools.map(unit_rows));
    let (tokens, q_cols) = (q.shape()[0], q.shape()[1]);
    let head_dim = q_cols / heads;
    let groups = heads / (pools.k_cols() / head_dim);
    let pool_rows = pools.parts()[0].shape()[0];
    let out = empty_device_contiguous_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([tokens, q_cols]),
        q.dtype,
    );
    if tokens == 0 {
        return out;
    }
    // Pools past what the device indexes: NaN, as after an error (a launch never wraps an index).
    // So is f64 through SPIR-V, whose exp is 32-bit only (GLSL.std.450): never silently wrong.
    let [k_part, v_part] = pools.parts();
    let address = address_type([&q, k_part, v_part, &slots, &runs, &out], &[tokens * heads]);
    let (Ok(address), false) = (address, f64_on_spirv(&q)) else {
        return nan_output(q, out.shape());
    };
    let slots = bindable(widened(slots));
    let shape = attention_shape(
        &slots,
        [1, 1],
        [tokens, heads, groups, pool_rows],
        (Some(&q), Some(&pools)),
    );
    let dtypes = [storage(&q), storage(&slots)];
    let units = attention_units(head_dim);
    let (cubes, _) = grid(tokens * heads);
    let client = q.client.clone();
    let dim = CubeDim::new_1d(units as u32);
    // SAFETY: the kernel runs only on the check's clear status: every run inside the slot list
    // and every slot inside the pools, whose rows and strides are the shape's.
    unsafe {
        match pools {
            Pools::Split(k_pool, v_pool) => attention_kernel::launch_unchecked(
                &client,
                cubes,
                dim,
                address,
                bindable(q).into_tensor_arg(),
                bindable(k_pool).into_tensor_arg(),
                bindable(v_pool).into_tensor_arg(),
                slots.into_tensor_arg(),
                runs.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                shape,
                head_dim,
                units,
                dtypes,
            ),
            Pools::Joined(kv_pool) => attention_kv_kernel::launch_unchecked(
                &client,
                cubes,
                dim,
                address,
                bindable(q).into_tensor_arg(),
                bindable(kv_pool).into_tensor_arg(),
                slots.into_tensor_arg(),
                runs.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                shape,
                head_dim,
                units,
                dtypes,
            ),
        }
    }
    out
}

/// A layer's new K and V rows: the tensors they are columns of, from these offsets on.
struct NewKv {
    k: (CubeTensor, usize),
    v: (CubeTensor, usize),
}

/// A layer's store and attention in one launch (`store_attention_kernel`), on a device where
/// that launch cannot be refused (`OneLaunch`: the store makes the two apart elsewhere).
pub(crate) fn store_and_attend(
    [q, k_pool, v_pool, k, v]: [CubeTensor; 5],
    rows: NewRowsPrimitive<CubeBackend>,
    keys: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let new = NewKv {
        k: (unit_rows(k), 0),
        v: (unit_rows(v), 0),
    };
    let pools = Pools::Split(k_pool, v_pool);
    attended(one_launch(unit_rows(q), pools, new, rows, keys, heads))
}

/// `store_and_attend` with the queries and the K rows side by side in `qk`: the queries a view of
/// its first columns (the same buffer from its start: never a copy), the K rows read from it past
/// them. (Burn's slice copies a part that does not start and end on the allocator's alignment,
/// as the keys of a 576 + 192 column row do not.)
pub(crate) fn store_qk_and_attend(
    [qk, k_pool, v_pool, v]: [CubeTensor; 4],
    rows: NewRowsPrimitive<CubeBackend>,
    keys: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let qk = unit_rows(qk);
    let q_cols = qk.shape()[1] - k_pool.shape()[1];
    let new = NewKv {
        k: (qk.clone(), q_cols),
        v: (unit_rows(v), 0),
    };
    let pools = Pools::Split(k_pool, v_pool);
    attended(one_launch(
        columns(qk, q_cols),
        pools,
        new,
        rows,
        keys,
        heads,
    ))
}

/// The store and the attention over a joined pool, the queries, K rows and V rows side by side
/// in `qkv`: all three read from it (the queries a view of its first columns, as in
/// `store_qk_and_attend`).
pub(crate) fn store_qkv_and_attend(
    [qkv, kv_pool]: [CubeTensor; 2],
    rows: NewRowsPrimitive<CubeBackend>,
    keys: [CubeTensor; 2],
    heads: usize,
) -> AttendedKvPrimitive<CubeBackend> {
    let qkv = unit_rows(qkv);
    let kv_cols = kv_pool.shape()[1];
    let q_cols = qkv.shape()[1] - kv_cols;
    let new = NewKv {
        k: (qkv.clone(), q_cols),
        v: (qkv.clone(), q_cols + kv_cols / 2),
    };
    let (out, pools) = one_launch(
        columns(qkv, q_cols),
        Pools::Joined(kv_pool),
        new,
        rows,
        keys,
        heads,
    );
    let Pools::Joined(kv_pool) = pools else {
        unreachable!("a launch hands back the pools it was given");
    };
    AttendedKvPrimitive { out, kv_pool }
}

/// The first `cols` columns of rows whose last dim is contiguous: a view of the same buffer.
fn columns(mut rows: CubeTensor, cols: usize) -> CubeTensor {
    rows.meta.shape = Shape::new([rows.shape()[0], cols]);
    rows
}

fn attended((out, pools): (CubeTensor, Pools)) -> AttendedPrimitive<CubeBackend> {
    let Pools::Split(k_pool, v_pool) = pools else {
        unreachable!("a launch hands back the pools it was given");
    };
    AttendedPrimitive {
        out,
        k_pool,
        v_pool,
    }
}

/// The one launch: the output and the pools, written in place where unique.
fn one_launch(
    q: CubeTensor,
    pools: Pools,
    new: NewKv,
    rows: NewRowsPrimitive<CubeBackend>,
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> (CubeTensor, Pools) {
    let pools = pools.map(|pool| owned(unit_rows(pool)));
    let (tokens, q_cols) = (q.shape()[0], q.shape()[1]);
    let NewKv {
        k: (k, k_offset),
        v: (v, v_offset),
    } = new;
    let new = rows.loc.shape()[0];
    let head_dim = q_cols / heads;
    let groups = heads / (pools.k_cols() / head_dim);
    let pool_rows = pools.parts()[0].shape()[0];
    let cubes = tokens.max(new) * heads;
    let [k_part, v_part] = pools.parts();
    let address = address_type(
        [
            &q,
            k_part,
            v_part,
            &k,
            &v,
            &rows.loc,
            &rows.claims,
            &slots,
            &runs,
        ],
        &[cubes, tokens * q_cols],
    );
    let (Ok(address), false) = (address, f64_on_spirv(&q)) else {
        // Callers make these apart (`OneLaunch`): reached only if the device's properties
        // changed under them. Refused as an attention is: NaN out, the pools as they were.
        return (nan_output(q, Shape::new([tokens, q_cols])), pools);
    };
    let out = empty_device_contiguous_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([tokens, q_cols]),
        q.dtype,
    );
    if cubes == 0 {
        return (out, pools);
    }
    let loc = bindable(widened(rows.loc));
    let slots = bindable(widened(slots));
    let shape = attention_shape(
        &slots,
        [1, 1],
        [tokens, heads, groups, pool_rows],
        (Some(&q), Some(&pools)),
    );
    let new_rows = NewRowsShapeLaunch::new(
        new as u64,
        stride(&k, 0),
        k_offset as u64,
        stride(&v, 0),
        v_offset as u64,
        stride(&loc, 0),
        // The claimed range comes from the check's status, on the device (`stored_rows`).
        1,
        0,
    );
    let dtypes = [storage(&q), storage(&slots), storage(&loc)];
    let units = attention_units(head_dim);
    let (grid, _) = grid(cubes);
    let client = q.client.clone();
    let dim = CubeDim::new_1d(units as u32);
    let claims = bindable(rows.claims);
    // SAFETY: the kernel stores only on the slots' clear status (every slot inside pools of
    // these rows, none but 0 twice) and attends only on the runs' (every run inside the slot
    // list, every slot inside the pools); the claims span the pools' rows.
    unsafe {
        match &pools {
            Pools::Split(k_pool, v_pool) => store_attention_kernel::launch_unchecked(
                &client,
                grid,
                dim,
                address,
                bindable(q).into_tensor_arg(),
                bindable(k_pool.clone()).into_tensor_arg(),
                bindable(v_pool.clone()).into_tensor_arg(),
                bindable(k).into_tensor_arg(),
                bindable(v).into_tensor_arg(),
                loc.into_tensor_arg(),
                claims.into_tensor_arg(),
                rows.status.into_tensor_arg(),
                slots.into_tensor_arg(),
                runs.into_tensor_arg(),
                bindable(out.clone()).into_tensor_arg(),
                shape,
                new_rows,
                head_dim,
                units,
                dtypes,
            ),
            // The queries, K rows and V rows are all `qkv`'s (`k`): one binding.
            Pools::Joined(kv_pool) => store_attention_kv_kernel::launch_unchecked(
                &client,
                grid,
                dim,
                address,
                bindable(k).into_tensor_arg(),
                bindable(kv_pool.clone()).into_tensor_arg(),
                loc.into_tensor_arg(),
                claims.into_tensor_arg(),
                rows.status.into_tensor_arg(),
                slots.into_tensor_arg(),
                runs.into_tensor_arg(),
                bindable(out.clone()).into_tensor_arg(),
                shape,
                new_rows,
                head_dim,
                units,
                dtypes,
            ),
        }
    }
    (out, pools)
}
