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
    attention_units, runs_len, store_attention_kernel,
};
use kvplan_kernels::scan::CUBE_SIZE;
use kvplan_kernels::status::STATUS_LEN;

use super::slots::owned;
use super::wide_capable;
use super::{
    address_type, bindable, contiguous, grid, output_i64, storage, stride, upload_parts, widened,
};
use crate::ops::{AttendedPrimitive, KeyRunsPrimitive, NewRowsPrimitive};
use cubecl::client::Client;

/// The launch scalars; `pool_rows` and `slots_len` are what the check holds the runs to. The
/// starts' and counts' strides are the check's (the attention reads the runs record).
fn attention_shape(
    slots: &CubeTensor,
    [starts_stride, counts_stride]: [u64; 2],
    [tokens, heads, groups, pool_rows]: [usize; 4],
    [q, k_pool, v_pool]: [Option<&CubeTensor>; 3],
) -> AttentionShapeLaunch {
    let row_stride = |tensor: Option<&CubeTensor>| tensor.map_or(0, |tensor| stride(tensor, 0));
    AttentionShapeLaunch::new(
        tokens as u64,
        heads as u64,
        groups as u64,
        pool_rows as u64,
        slots.shape()[0] as u64,
        row_stride(q),
        row_stride(k_pool),
        row_stride(v_pool),
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
        [None, None, None],
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
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> CubeTensor {
    let (q, k_pool, v_pool) = (unit_rows(q), unit_rows(k_pool), unit_rows(v_pool));
    let (tokens, q_cols) = (q.shape()[0], q.shape()[1]);
    let head_dim = q_cols / heads;
    let groups = heads / (k_pool.shape()[1] / head_dim);
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
    let address = address_type(
        [&q, &k_pool, &v_pool, &slots, &runs, &out],
        &[tokens * heads],
    );
    let (Ok(address), false) = (address, f64_on_spirv(&q)) else {
        return nan_output(q, out.shape());
    };
    let slots = bindable(widened(slots));
    let shape = attention_shape(
        &slots,
        [1, 1],
        [tokens, heads, groups, k_pool.shape()[0]],
        [Some(&q), Some(&k_pool), Some(&v_pool)],
    );
    let dtypes = [storage(&q), storage(&slots)];
    let units = attention_units(head_dim);
    let (cubes, _) = grid(tokens * heads);
    let client = q.client.clone();
    // SAFETY: the kernel runs only on the check's clear status: every run inside the slot list
    // and every slot inside the pools, whose rows and strides are the shape's.
    unsafe {
        attention_kernel::launch_unchecked(
            &client,
            cubes,
            CubeDim::new_1d(units as u32),
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
        );
    }
    out
}

/// A layer's store and attention in one launch (`store_attention_kernel`), on a device where
/// that launch cannot be refused (`OneLaunch`: the store makes the two apart elsewhere).
pub(crate) fn store_and_attend(
    [q, k_pool, v_pool, k]: [CubeTensor; 4],
    rows: NewRowsPrimitive<CubeBackend>,
    base: u32,
    keys: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let (q, k) = (unit_rows(q), unit_rows(k));
    one_launch([q, k_pool, v_pool], (k, 0), rows, base, keys, heads)
}

/// `store_and_attend` with the queries and the K rows side by side in `qk`: the queries a view of
/// its first columns (the same buffer from its start: never a copy), the K rows read from it past
/// them. (Burn's slice copies a part that does not start and end on the allocator's alignment,
/// as the keys of a 576 + 192 column row do not.)
pub(crate) fn store_qk_and_attend(
    [qk, k_pool, v_pool]: [CubeTensor; 3],
    rows: NewRowsPrimitive<CubeBackend>,
    base: u32,
    keys: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let qk = unit_rows(qk);
    let q_cols = qk.shape()[1] - k_pool.shape()[1];
    let mut q = qk.clone();
    q.meta.shape = Shape::new([qk.shape()[0], q_cols]);
    one_launch([q, k_pool, v_pool], (qk, q_cols), rows, base, keys, heads)
}

/// The one launch; the K rows are `k`'s columns from `k_offset` on, as many as the K pool's.
fn one_launch(
    [q, k_pool, v_pool]: [CubeTensor; 3],
    (k, k_offset): (CubeTensor, usize),
    rows: NewRowsPrimitive<CubeBackend>,
    base: u32,
    [slots, runs]: [CubeTensor; 2],
    heads: usize,
) -> AttendedPrimitive<CubeBackend> {
    let v = unit_rows(rows.v);
    let (k_pool, v_pool) = (owned(unit_rows(k_pool)), owned(unit_rows(v_pool)));
    let (tokens, q_cols) = (q.shape()[0], q.shape()[1]);
    let new = k.shape()[0];
    let head_dim = q_cols / heads;
    let groups = heads / (k_pool.shape()[1] / head_dim);
    let cubes = tokens.max(new) * heads;
    let address = address_type(
        [
            &q,
            &k_pool,
            &v_pool,
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
        let out = nan_output(q, Shape::new([tokens, q_cols]));
        return AttendedPrimitive {
            out,
            k_pool,
            v_pool,
        };
    };
    let out = empty_device_contiguous_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::new([tokens, q_cols]),
        q.dtype,
    );
    if cubes == 0 {
        return AttendedPrimitive {
            out,
            k_pool,
            v_pool,
        };
    }
    let loc = bindable(widened(rows.loc));
    let slots = bindable(widened(slots));
    let shape = attention_shape(
        &slots,
        [1, 1],
        [tokens, heads, groups, k_pool.shape()[0]],
        [Some(&q), Some(&k_pool), Some(&v_pool)],
    );
    // The check claimed `[base, base + new - 1]`; without new rows, an empty range.
    let (base, newest) = match new {
        0 => (1, 0),
        new => (u64::from(base), u64::from(base) + new as u64 - 1),
    };
    let new_rows = NewRowsShapeLaunch::new(
        new as u64,
        stride(&k, 0),
        k_offset as u64,
        stride(&v, 0),
        stride(&loc, 0),
        base,
        newest,
    );
    let dtypes = [storage(&q), storage(&slots), storage(&loc)];
    let units = attention_units(head_dim);
    let (grid, _) = grid(cubes);
    let client = q.client.clone();
    // SAFETY: the kernel stores only on the slots' clear status (every slot inside pools of
    // these rows, none but 0 twice) and attends only on the runs' (every run inside the slot
    // list, every slot inside the pools); the claims span the pools' rows.
    unsafe {
        store_attention_kernel::launch_unchecked(
            &client,
            grid,
            CubeDim::new_1d(units as u32),
            address,
            bindable(q).into_tensor_arg(),
            bindable(k_pool.clone()).into_tensor_arg(),
            bindable(v_pool.clone()).into_tensor_arg(),
            bindable(k).into_tensor_arg(),
            bindable(v).into_tensor_arg(),
            loc.into_tensor_arg(),
            bindable(rows.claims).into_tensor_arg(),
            rows.status.into_tensor_arg(),
            slots.into_tensor_arg(),
            runs.into_tensor_arg(),
            bindable(out.clone()).into_tensor_arg(),
            shape,
            new_rows,
            head_dim,
            units,
            dtypes,
        );
    }
    AttendedPrimitive {
        out,
        k_pool,
        v_pool,
    }
}
