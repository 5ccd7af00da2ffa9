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
    AttentionShapeLaunch, NewRowsShapeLaunch, PLANE, SPLITS, STAGED_TOKENS, attention_check_kernel,
    attention_combine_kernel, attention_kv_kernel, attention_units, partial_len, runs_len,
    store_attention_kv_kernel,
};
use kvplan_kernels::scan::CUBE_SIZE;
use kvplan_kernels::status::STATUS_LEN;

use super::slots::owned;
use super::wide_capable;
use super::{
    address_type, bindable, contiguous, fixed_planes, grid, output_i64, storage, stride,
    upload_parts, widened,
};
use crate::backend::{AttendedPrimitive, KeyRunsPrimitive, NewRowsPrimitive};
use cubecl::client::Client;

/// The launch scalars; `pool_rows` and `slots_len` are what the check holds the runs to. The
/// starts' and counts' strides are the check's (the attention reads the runs record).
fn attention_shape(
    slots: &CubeTensor,
    [starts_stride, counts_stride]: [u64; 2],
    [tokens, heads, groups, pool_rows]: [usize; 4],
    (q, kv_pool): (Option<&CubeTensor>, Option<&CubeTensor>),
) -> AttentionShapeLaunch {
    let row_stride = |tensor: Option<&CubeTensor>| tensor.map_or(0, |tensor| stride(tensor, 0));
    AttentionShapeLaunch::new(
        tokens as u64,
        heads as u64,
        groups as u64,
        pool_rows as u64,
        slots.shape()[0] as u64,
        row_stride(q),
        row_stride(kv_pool),
        row_stride(kv_pool),
        kv_pool.map_or(0, k_cols) as u64,
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

/// Columns of a K row of a joined pool (each row a slot's K, then its V): where its V starts.
fn k_cols(kv_pool: &CubeTensor) -> usize {
    kv_pool.shape()[1] / 2
}

/// An attention's sizes: tokens, query columns, head dim, query heads a K/V head, pool rows.
fn sizes(q: &CubeTensor, kv_pool: &CubeTensor, heads: usize) -> [usize; 5] {
    let (tokens, q_cols) = (q.shape()[0], q.shape()[1]);
    let head_dim = q_cols / heads;
    let groups = heads / (k_cols(kv_pool) / head_dim);
    [tokens, q_cols, head_dim, groups, kv_pool.shape()[0]]
}

/// Query heads an attention cube takes for a launch of `tokens` (and new rows): past
/// `STAGED_TOKENS` (many cubes) every query head of a K/V head, each key's K and V rows read once
/// for them (a third of the cubes for SmolLM2's 3: batch 32 1.12x faster on an H100, RESULTS
/// session 44); up to it one, whose cubes' chains of loads are shorter (batch 1 1.17x faster).
/// `KVPLAN_ATTENTION_GROUPED=1` groups every launch, `=0` none. The bits are the same.
fn cube_heads(groups: usize, tokens: usize) -> usize {
    static GROUPED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let knob =
        *GROUPED.get_or_init(
            || match std::env::var("KVPLAN_ATTENTION_GROUPED").as_deref() {
                Ok("1") => Some(true),
                Ok("0") => Some(false),
                _ => None,
            },
        );
    if knob.unwrap_or(tokens > STAGED_TOKENS) {
        groups.max(1)
    } else {
        1
    }
}

/// Whether a launch of `tokens` (and new rows) stages each chunk's K rows in shared memory: up to
/// `STAGED_TOKENS`, where its few cubes' chains of loads are its time (batch 1 1.15x faster on
/// an H100, RESULTS session 41). `KVPLAN_ATTENTION_STAGED=N` stages up to `N` tokens instead (at
/// most `STAGED_TOKENS`; 0: none). The bits are the same.
fn staged(tokens: usize) -> bool {
    static MOST: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let most = *MOST.get_or_init(|| {
        std::env::var("KVPLAN_ATTENTION_STAGED")
            .ok()
            .and_then(|value| value.parse().ok())
            .map_or(STAGED_TOKENS, |most: usize| most.min(STAGED_TOKENS))
    });
    tokens <= most
}

/// The attention's output, uninitialised: `q`'s shape and dtype, contiguous.
fn empty_out(q: &CubeTensor) -> CubeTensor {
    empty_device_contiguous_dtype(q.client.clone(), q.device.clone(), q.shape(), q.dtype)
}

pub(crate) fn paged_attention(
    q: CubeTensor,
    kv_pool: CubeTensor,
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> CubeTensor {
    let (q, kv_pool) = (unit_rows(q), unit_rows(kv_pool));
    let [tokens, _, head_dim, groups, pool_rows] = sizes(&q, &kv_pool, heads);
    let out = empty_out(&q);
    if tokens == 0 {
        return out;
    }
    // Pools past what the device indexes: NaN, as after an error (a launch never wraps an index).
    // So is f64 through SPIR-V, whose exp is 32-bit only (GLSL.std.450): never silently wrong.
    let partials = empty_partials(&q, tokens * heads, head_dim);
    let address = address_type(
        [&q, &kv_pool, &slots, &runs, &out, &partials],
        &[tokens * heads * SPLITS],
    );
    let (Ok(address), false) = (address, f64_on_spirv(&q)) else {
        return nan_output(q, out.shape());
    };
    let slots = bindable(widened(slots));
    // Two launches read the shape: the parts, then their fold.
    let [shape, folded] = [(); 2].map(|_| {
        attention_shape(
            &slots,
            [1, 1],
            [tokens, heads, groups, pool_rows],
            (Some(&q), Some(&kv_pool)),
        )
    });
    let dtypes = [storage(&q), storage(&slots), storage(&partials)];
    let units = attention_units(head_dim);
    let group = cube_heads(groups, tokens);
    let (cubes, _) = grid(tokens * heads / group * SPLITS);
    let client = q.client.clone();
    let dim = CubeDim::new_1d(units as u32);
    let planes = fixed_planes(&q, PLANE as u32);
    let combined = [storage(&q), storage(&partials)];
    // SAFETY: the kernel runs only on the check's clear status: every run inside the slot list
    // and every slot inside the pool, whose rows and strides are the shape's; each cube writes
    // its own partial.
    unsafe {
        attention_kv_kernel::launch_unchecked(
            &client,
            cubes,
            dim,
            address,
            bindable(q).into_tensor_arg(),
            bindable(kv_pool).into_tensor_arg(),
            slots.into_tensor_arg(),
            runs.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            shape,
            head_dim,
            units,
            planes,
            staged(tokens),
            group,
            dtypes,
        );
    }
    combine(
        partials,
        runs,
        &out,
        folded,
        [head_dim, units],
        address,
        combined,
    );
    out
}

/// Room for the partials of `heads` (token, query head) pairs, `SPLITS` each, in the
/// attention's accumulator dtype.
fn empty_partials(q: &CubeTensor, heads: usize, head_dim: usize) -> CubeTensor {
    let len = (heads * SPLITS * partial_len(head_dim)).max(1);
    empty_device_contiguous_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([len]),
        accumulator(q.dtype),
    )
}

/// The dtype an attention of `dtype` queries and pools sums in: f32 for half precision (a
/// bf16 cache attends in f32), else their own.
fn accumulator(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    }
}

/// Folds the parts' partials into `out` (`attention_combine_kernel`): a cube a (token, query
/// head), a unit a dimension.
fn combine(
    partials: CubeTensor,
    runs: CubeTensor,
    out: &CubeTensor,
    shape: AttentionShapeLaunch,
    [head_dim, units]: [usize; 2],
    address: cubecl::ir::AddressType,
    dtypes: [ElemType; 2],
) {
    let heads = out.shape()[0] * (out.shape()[1] / head_dim);
    let (cubes, _) = grid(heads);
    // SAFETY: each cube reads the partials of its own pair, those the parts wrote (the runs'
    // counts say which), and writes its row of `out`.
    unsafe {
        attention_combine_kernel::launch_unchecked(
            &out.client,
            cubes,
            CubeDim::new_1d(units as u32),
            address,
            partials.into_tensor_arg(),
            runs.into_tensor_arg(),
            bindable(out.clone()).into_tensor_arg(),
            shape,
            head_dim,
            units,
            dtypes,
        );
    }
}

/// A layer's store and attention in one launch (`store_attention_kv_kernel`), the queries, K
/// rows and V rows side by side in `qkv`: all three read from it, the queries a view of its
/// first columns (the same buffer from its start: never a copy; Burn's slice copies a part that
/// does not start and end on the allocator's alignment). Only on a device where that launch
/// cannot be refused (`OneLaunch`: the store makes the two apart elsewhere).
pub(crate) fn store_and_attend(
    [qkv, kv_pool]: [CubeTensor; 2],
    rows: NewRowsPrimitive<CubeBackend>,
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let qkv = unit_rows(qkv);
    let kv_pool = owned(unit_rows(kv_pool));
    let kv_cols = kv_pool.shape()[1];
    let q_cols = qkv.shape()[1] - kv_cols;
    let q = columns(qkv.clone(), q_cols);
    let [tokens, _, head_dim, groups, pool_rows] = sizes(&q, &kv_pool, heads);
    let new = rows.loc.shape()[0];
    let group = cube_heads(groups, tokens.max(new));
    let cubes = tokens.max(new) * heads / group * SPLITS;
    let partials = empty_partials(&q, tokens * heads, head_dim);
    let address = address_type(
        [
            &qkv,
            &kv_pool,
            &rows.loc,
            &rows.claims,
            &rows.arrivals,
            &slots,
            &runs,
            &partials,
        ],
        &[cubes, tokens * q_cols],
    );
    let (Ok(address), false) = (address, f64_on_spirv(&q)) else {
        // Callers make these apart (`OneLaunch`): reached only if the device's properties
        // changed under them. Refused as an attention is: NaN out, the pool as it was.
        let out = nan_output(q, Shape::new([tokens, q_cols]));
        return AttendedPrimitive { out, kv_pool };
    };
    let out = empty_out(&q);
    if cubes == 0 {
        return AttendedPrimitive { out, kv_pool };
    }
    let loc = bindable(widened(rows.loc));
    let slots = bindable(widened(slots));
    // Two launches read the shape: the parts, then their fold.
    let [shape, folded] = [(); 2].map(|_| {
        attention_shape(
            &slots,
            [1, 1],
            [tokens, heads, groups, pool_rows],
            (Some(&q), Some(&kv_pool)),
        )
    });
    let row_stride = stride(&qkv, 0);
    let new_rows = NewRowsShapeLaunch::new(
        new as u64,
        row_stride,
        q_cols as u64,
        row_stride,
        (q_cols + kv_cols / 2) as u64,
        stride(&loc, 0),
        // The claimed range comes from the check's status, on the device (`stored_rows`).
        1,
        0,
    );
    let dtypes = [
        storage(&q),
        storage(&slots),
        storage(&loc),
        storage(&partials),
    ];
    let units = attention_units(head_dim);
    let (grid, _) = grid(cubes);
    let client = q.client.clone();
    let dim = CubeDim::new_1d(units as u32);
    let planes = fixed_planes(&q, PLANE as u32);
    let claims = bindable(rows.claims);
    // The parts fold themselves where one cube's storage writes reach another's and the store
    // counts every (token, query head) pair apart; else a second launch folds them.
    let fold = client.properties().features.device_memory_scope
        && rows.arrivals.shape()[0] >= tokens * heads;
    // SAFETY: the kernel stores only on the slots' clear status (every slot inside a pool of
    // these rows, none but 0 twice) and attends only on the runs' (every run inside the slot
    // list, every slot inside the pool); the claims span the pool's rows, the arrivals every
    // pair when `fold`. The queries, K rows and V rows are all `qkv`'s: one binding.
    unsafe {
        store_attention_kv_kernel::launch_unchecked(
            &client,
            grid,
            dim,
            address,
            bindable(qkv).into_tensor_arg(),
            bindable(kv_pool.clone()).into_tensor_arg(),
            loc.into_tensor_arg(),
            claims.into_tensor_arg(),
            rows.status.into_tensor_arg(),
            slots.into_tensor_arg(),
            runs.clone().into_tensor_arg(),
            partials.clone().into_tensor_arg(),
            bindable(rows.arrivals).into_tensor_arg(),
            bindable(out.clone()).into_tensor_arg(),
            shape,
            new_rows,
            head_dim,
            units,
            planes,
            staged(tokens.max(new)),
            fold,
            group,
            dtypes,
        );
    }
    if tokens > 0 && !fold {
        let dtypes = [storage(&out), storage(&partials)];
        combine(
            partials,
            runs,
            &out,
            folded,
            [head_dim, units],
            address,
            dtypes,
        );
    }
    AttendedPrimitive { out, kv_pool }
}

/// The first `cols` columns of rows whose last dim is contiguous: a view of the same buffer.
fn columns(mut rows: CubeTensor, cols: usize) -> CubeTensor {
    rows.meta.shape = Shape::new([rows.shape()[0], cols]);
    rows
}
