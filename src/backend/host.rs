//! The default bodies of `KvPlanBackend`: read the inputs back, run the reference, upload.
//!
//! The ops are infallible (the macro's contract): a read-back that fails becomes an `execution`
//! status record, and a canary op that cannot read its state hands back a zeroed canary holding it.

use burn_core::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn_core::backend::{Backend, TensorData, TensorMetadata, try_read_sync};
use burn_core::tensor::{BoolStore, DType, Slice};
use kvplan_kernels::status::{CODE, OK, STATUS_LEN};

use super::{
    AssignPrimitive, CanaryLaunchPrimitive, CanaryPrimitive, GatherPrimitive, KeyRunsPrimitive,
    KvBytes, KvRows, OptionalInt, PlanInputsPrimitive, PlanOutput, StoreCheckPrimitive,
    StoreScratchPrimitive, StoreTargets, StoreWritePrimitive, VerifyPlanPrimitive,
    WriteInputsPrimitive, WritePlanPrimitive,
};
use crate::error::Error;
use crate::layout::{COUNTERS, KERNEL_RUN, ROW_WORDS, SLOT_RUN, SourceLayout, WRITE_INDEX};
use crate::reference::canary::{Launch, SourceBytes, VerifyArgs, WriteArgs};
use crate::reference::{self, CanaryState, ExpectedTokens, PlanArgs, PlanBuffers, Segments, Table};
use crate::status::{self, StatusWords};

/// An int tensor's values as i64, row-major, with its shape.
fn read_int<B: Backend>(tensor: IntTensor<B>) -> Result<(Vec<usize>, Vec<i64>), Error> {
    let shape = tensor.shape().to_vec();
    let data = read(B::int_into_data(tensor))?;
    Ok((shape, data_to_i64(&data)))
}

fn read_bool<B: Backend>(tensor: BoolTensor<B>) -> Result<Vec<bool>, Error> {
    Ok(data_to_i64(&read(B::bool_into_data(tensor))?)
        .into_iter()
        .map(|v| v != 0)
        .collect())
}

fn read<F, E>(future: F) -> Result<TensorData, Error>
where
    F: Future<Output = Result<TensorData, E>>,
    E: core::fmt::Debug,
{
    try_read_sync(future)
        .ok_or_else(|| Error::Execution {
            detail: "cannot block on a read here".into(),
        })?
        .map_err(|error| Error::Execution {
            detail: format!("{error:?}"),
        })
}

pub(crate) fn upload_i64<B: Backend>(values: Vec<i64>, device: &B::Device) -> IntTensor<B> {
    let len = values.len();
    B::int_from_data(TensorData::new(values, [len]), device)
}

fn upload_i32<B: Backend>(value: i32, device: &B::Device) -> IntTensor<B> {
    B::int_from_data(TensorData::new(vec![value], [1]), device)
}

/// A status record on the device.
pub(crate) fn upload_status<B: Backend>(words: StatusWords, device: &B::Device) -> IntTensor<B> {
    upload_i64::<B>(words.to_vec(), device)
}

/// Packs a reference outcome as the kernels would: `out` padded to `capacity`, the count 0 on
/// error.
pub(crate) fn gather_output<B: Backend>(
    outcome: Result<Vec<i64>, Error>,
    capacity: usize,
    device: &B::Device,
) -> GatherPrimitive<B> {
    let (mut out, words) = match outcome {
        Ok(values) => {
            let words = status::encode(&Ok(values.len()));
            (values, words)
        }
        Err(error) => (Vec::new(), status::encode(&Err(error))),
    };
    out.resize(capacity, 0);
    GatherPrimitive {
        out: upload_i64::<B>(out, device),
        status: upload_status::<B>(words, device),
    }
}

/// `[rows, cols]` of a validated 2-D tensor.
fn rows_cols(shape: &[usize]) -> (usize, usize) {
    (
        shape.first().copied().unwrap_or(0),
        shape.get(1).copied().unwrap_or(0),
    )
}

pub(super) fn masked_gather<B: Backend>(
    req_to_token: IntTensor<B>,
    req_pool_indices: IntTensor<B>,
    pos2d: IntTensor<B>,
    mask: BoolTensor<B>,
    capacity: usize,
) -> GatherPrimitive<B> {
    let device = req_to_token.device();
    let outcome = (|| {
        let (table_shape, table) = read_int::<B>(req_to_token)?;
        let (_, req_pool_indices) = read_int::<B>(req_pool_indices)?;
        let (pos_shape, pos2d) = read_int::<B>(pos2d)?;
        let mask = read_bool::<B>(mask)?;
        let (rows, cols) = rows_cols(&table_shape);
        let (pos_rows, pos_cols) = rows_cols(&pos_shape);
        // The context is re-attached when the status is decoded.
        reference::masked_gather(
            Table::new(rows, cols, &table),
            &req_pool_indices,
            &pos2d,
            &mask,
            [pos_rows, pos_cols],
            Some(capacity),
            "",
        )
    })();
    gather_output::<B>(outcome, capacity, &device)
}

pub(super) fn segment_gather<B: Backend>(
    req_to_token: IntTensor<B>,
    req_pool_indices: IntTensor<B>,
    start: OptionalInt<B>,
    lengths: IntTensor<B>,
    capacity: usize,
) -> GatherPrimitive<B> {
    let device = req_to_token.device();
    let outcome = (|| {
        let (table_shape, table) = read_int::<B>(req_to_token)?;
        let (_, req_pool_indices) = read_int::<B>(req_pool_indices)?;
        let start = read_optional::<B>(start)?;
        let (_, lengths) = read_int::<B>(lengths)?;
        let (rows, cols) = rows_cols(&table_shape);
        reference::segment_gather(
            Table::new(rows, cols, &table),
            &req_pool_indices,
            start.as_deref(),
            &lengths,
            Some(capacity),
        )
    })();
    gather_output::<B>(outcome, capacity, &device)
}

pub(super) fn segment_assign<B: Backend>(
    req_to_token: IntTensor<B>,
    req_pool_indices: IntTensor<B>,
    start: IntTensor<B>,
    lengths: IntTensor<B>,
    out_cache_loc: IntTensor<B>,
) -> AssignPrimitive<B> {
    let device = req_to_token.device();
    let dtype = req_to_token.dtype();
    let unchanged = req_to_token.clone();
    let run = || -> Result<(Vec<usize>, Vec<i64>, usize), Error> {
        let (shape, mut table) = read_int::<B>(req_to_token)?;
        let (_, req_pool_indices) = read_int::<B>(req_pool_indices)?;
        let (_, start) = read_int::<B>(start)?;
        let (_, lengths) = read_int::<B>(lengths)?;
        let (_, out_cache_loc) = read_int::<B>(out_cache_loc)?;
        let segments = Segments {
            req_pool_indices: &req_pool_indices,
            start: &start,
            lengths: &lengths,
        };
        // The context is re-attached when the status is decoded.
        let written = reference::segment_assign(
            &mut table,
            [shape[0], shape[1]],
            segments,
            &out_cache_loc,
            super::slot_max(dtype),
            "",
        )?;
        Ok((shape, table, written))
    };
    match run() {
        Ok((shape, table, written)) => AssignPrimitive {
            req_to_token: B::int_from_data(
                TensorData::new(table, shape).convert_dtype(dtype),
                &device,
            ),
            status: upload_status::<B>(status::encode(&Ok(written)), &device),
        },
        // A rule that failed, or a read that did: the table as it was.
        Err(error) => AssignPrimitive {
            req_to_token: unchanged,
            status: upload_status::<B>(status::encode(&Err(error)), &device),
        },
    }
}

/// A cache's (or its rows') data, read back.
fn read_rows<B: Backend>(rows: KvRows<B>) -> Result<TensorData, Error> {
    match rows {
        KvRows::Float(tensor) => read(B::float_into_data(tensor)),
        KvRows::Int(tensor) => read(B::int_into_data(tensor)),
    }
}

pub(super) fn check_store_slots<B: Backend>(
    loc: IntTensor<B>,
    scratch: StoreScratchPrimitive<B>,
    cache_rows: usize,
) -> StoreCheckPrimitive<B> {
    let device = loc.device();
    // The context is re-attached when the status is decoded.
    let outcome =
        read_int::<B>(loc).and_then(|(_, loc)| reference::check_store_slots(&loc, cache_rows, ""));
    StoreCheckPrimitive {
        scratch,
        status: upload_status::<B>(status::encode(&outcome), &device),
    }
}

pub(super) fn store_rows<B: Backend>(
    caches: StoreTargets<B>,
    values: StoreTargets<B>,
    loc: IntTensor<B>,
    status: IntTensor<B>,
) -> StoreWritePrimitive<B> {
    let device = loc.device();
    let unchanged = caches.clone();
    let clear = read_status::<B>(status.clone()).map(|words| words[CODE] == OK);
    if matches!(clear, Ok(false)) {
        return StoreWritePrimitive {
            caches: unchanged,
            status,
        };
    }
    let run = || -> Result<StoreTargets<B>, Error> {
        clear?;
        let (_, loc) = read_int::<B>(loc)?;
        let store = |cache: KvRows<B>, values: KvRows<B>| -> Result<KvRows<B>, Error> {
            let float = matches!(cache, KvRows::Float(_));
            let (bytes, shape, dtype) = read_rows::<B>(cache)?.into_parts();
            let values = read_rows::<B>(values)?;
            let row_bytes = shape.iter().skip(1).product::<usize>() * dtype.size();
            let mut bytes = bytes.to_vec();
            reference::store_kv(&mut bytes, [shape[0], row_bytes], &loc, values.bytes(), "")?;
            let data = TensorData::from_bytes_vec(bytes, shape, dtype);
            Ok(if float {
                KvRows::Float(B::float_from_data(data, &device))
            } else {
                KvRows::Int(B::int_from_data(data, &device))
            })
        };
        Ok(match (caches, values) {
            (StoreTargets::Pair(first, second), StoreTargets::Pair(first_rows, second_rows)) => {
                StoreTargets::Pair(store(first, first_rows)?, store(second, second_rows)?)
            }
            (StoreTargets::One(cache), StoreTargets::One(rows)) => {
                StoreTargets::One(store(cache, rows)?)
            }
            (caches, _) => caches,
        })
    };
    match run() {
        Ok(caches) => StoreWritePrimitive { caches, status },
        // A read that failed: the caches as they were.
        Err(error) => StoreWritePrimitive {
            caches: unchanged,
            status: upload_status::<B>(status::encode(&Err(error)), &device),
        },
    }
}

pub(super) fn check_key_runs<B: Backend>(
    slots: IntTensor<B>,
    starts: IntTensor<B>,
    counts: IntTensor<B>,
    pool_rows: usize,
) -> KeyRunsPrimitive<B> {
    let device = slots.device();
    let tokens = starts.shape()[0];
    let read = || -> Result<[Vec<i64>; 3], Error> {
        Ok([
            read_int::<B>(slots)?.1,
            read_int::<B>(starts)?.1,
            read_int::<B>(counts)?.1,
        ])
    };
    // The record holds the starts and counts as given, as the kernel's does (no attention reads
    // them after an error); after a failed read, zeros.
    let (words, body) = match read() {
        Ok([slots, starts, counts]) => {
            // The context is re-attached when the status is decoded.
            let checked = reference::key_runs(&slots, &starts, &counts, pool_rows, "");
            let words = status::encode(&checked.map(|_| tokens));
            (words, [starts, counts].concat())
        }
        Err(error) => (status::encode(&Err(error)), vec![0; 2 * tokens]),
    };
    KeyRunsPrimitive {
        status: upload_status::<B>(words, &device),
        runs: upload_i64::<B>([&words[..], &body].concat(), &device),
    }
}

pub(super) fn paged_attention<B: Backend>(
    q: FloatTensor<B>,
    k_pool: FloatTensor<B>,
    v_pool: FloatTensor<B>,
    [slots, runs]: [IntTensor<B>; 2],
    heads: usize,
) -> FloatTensor<B> {
    let device = q.device();
    let (shape, dtype) = (q.shape(), q.dtype());
    let run = || -> Result<Vec<f64>, Error> {
        let (_, runs) = read_int::<B>(runs)?;
        let (record, body) = runs.split_at(STATUS_LEN);
        status::decode(&record.try_into().unwrap_or_default(), "")?;
        let (starts, counts) = body.split_at(body.len() / 2);
        let floats = |tensor: FloatTensor<B>| -> Result<(Vec<usize>, Vec<f64>), Error> {
            let shape = tensor.shape().to_vec();
            let data = read(B::float_into_data(tensor))?.convert::<f64>();
            let values = data.try_to_vec::<f64>().map_err(|error| Error::Execution {
                detail: format!("{error:?}"),
            })?;
            Ok((shape, values))
        };
        let ((q_shape, q), (pool_shape, k), (_, v)) =
            (floats(q)?, floats(k_pool)?, floats(v_pool)?);
        let (_, slots) = read_int::<B>(slots)?;
        let head_dim = q_shape[1] / heads.max(1);
        let layout = reference::Heads {
            heads,
            kv_heads: pool_shape[1] / head_dim.max(1),
            head_dim,
        };
        reference::paged_attention(&q, &k, &v, layout, &slots, starts, counts, "")
    };
    // An error is the status's to report; the output is NaN, as the kernel's.
    let values = run().unwrap_or_else(|_| vec![f64::NAN; shape.num_elements()]);
    B::float_from_data(TensorData::new(values, shape).convert_dtype(dtype), &device)
}

fn read_optional<B: Backend>(tensor: OptionalInt<B>) -> Result<Option<Vec<i64>>, Error> {
    Ok(match tensor.into_option() {
        Some(tensor) => Some(read_int::<B>(tensor)?.1),
        None => None,
    })
}

fn read_scalar<B: Backend>(tensor: IntTensor<B>) -> Result<i32, Error> {
    Ok(read_int::<B>(tensor)?.1.first().copied().unwrap_or(0) as i32)
}

pub(super) fn canary_plan<B: Backend>(
    verify: VerifyPlanPrimitive<B>,
    write: WritePlanPrimitive<B>,
    inputs: PlanInputsPrimitive<B>,
) -> PlanOutput<B> {
    let device = verify.slot_indices.device();
    let (verify_ref, write_ref) = (verify.clone(), write.clone());
    let run = || -> Result<(PlanBuffers, Result<(), Error>), Error> {
        let mut buffers = PlanBuffers {
            verify_slot_indices: read_int::<B>(verify.slot_indices)?.1,
            verify_expected_tokens: read_int::<B>(verify.expected_tokens)?.1,
            verify_expected_positions: read_int::<B>(verify.expected_positions)?.1,
            verify_prev_slot_indices: read_int::<B>(verify.prev_slot_indices)?.1,
            verify_num_valid: read_scalar::<B>(verify.num_valid)?,
            enable: read_scalar::<B>(verify.enable)?,
            write_offsets: read_int::<B>(write.offsets)?.1,
            write_seed_slot_indices: read_int::<B>(write.seed_slot_indices)?.1,
            write_num_valid_reqs: read_scalar::<B>(write.num_valid_reqs)?,
        };
        let (_, req_pool_indices) = read_int::<B>(inputs.req_pool_indices)?;
        let (_, prefix_lens) = read_int::<B>(inputs.prefix_lens)?;
        let (_, extend_seq_lens) = read_int::<B>(inputs.extend_seq_lens)?;
        let (table_shape, table) = read_int::<B>(inputs.req_to_token)?;
        let lut = read_optional::<B>(inputs.full_to_swa)?;
        let pool = match inputs.expected_tokens.into_option() {
            Some(pool) => Some(read_int::<B>(pool)?),
            None => None,
        };
        let valid_lens = read_optional::<B>(inputs.expected_tokens_valid_lens)?;
        let (rows, cols) = rows_cols(&table_shape);
        let args = PlanArgs {
            req_pool_indices: &req_pool_indices,
            prefix_lens: &prefix_lens,
            extend_seq_lens: &extend_seq_lens,
            req_to_token: Table::new(rows, cols, &table),
            swa_window_size: inputs.swa_window_size,
            full_to_swa: lut.as_deref(),
            expected_tokens: pool.as_ref().map(|(shape, values)| {
                let (prow, pcol) = rows_cols(shape);
                ExpectedTokens {
                    pool: Table::new(prow, pcol, values),
                    valid_lens: valid_lens.as_deref().unwrap_or(&[]),
                }
            }),
            position_offset: inputs.position_offset,
        };
        let outcome = reference::plan(&args, &mut buffers);
        Ok((buffers, outcome))
    };
    match run() {
        Ok((buffers, outcome)) => {
            let (verify, write) = upload_plans::<B>(buffers, write_ref.scratch, &device);
            PlanOutput {
                verify,
                write,
                status: upload_status::<B>(status::encode(&outcome.map(|()| 0)), &device),
            }
        }
        // A read that failed: fresh, disabled plans, the failure in the status.
        Err(error) => refused_plan::<B>(verify_ref, write_ref, error),
    }
}
/// Plans holding `buffers`, uploaded, with the write plan's kernel scratch `scratch`.
pub(crate) fn upload_plans<B: Backend>(
    buffers: PlanBuffers,
    scratch: IntTensor<B>,
    device: &B::Device,
) -> (VerifyPlanPrimitive<B>, WritePlanPrimitive<B>) {
    (
        VerifyPlanPrimitive {
            slot_indices: upload_i64::<B>(buffers.verify_slot_indices, device),
            expected_tokens: upload_i64::<B>(buffers.verify_expected_tokens, device),
            expected_positions: upload_i64::<B>(buffers.verify_expected_positions, device),
            prev_slot_indices: upload_i64::<B>(buffers.verify_prev_slot_indices, device),
            num_valid: upload_i32::<B>(buffers.verify_num_valid, device),
            enable: upload_i32::<B>(buffers.enable, device),
        },
        WritePlanPrimitive {
            offsets: upload_i64::<B>(buffers.write_offsets, device),
            seed_slot_indices: upload_i64::<B>(buffers.write_seed_slot_indices, device),
            num_valid_reqs: upload_i32::<B>(buffers.write_num_valid_reqs, device),
            scratch,
        },
    )
}

/// A plan whose launch could not run: fresh, disabled plans (never stale halves), the kernel
/// scratch as it was (nothing ran, so it is still ready), and the failure in the status.
pub(crate) fn refused_plan<B: Backend>(
    verify: VerifyPlanPrimitive<B>,
    write: WritePlanPrimitive<B>,
    error: Error,
) -> PlanOutput<B> {
    let device = verify.slot_indices.device();
    let mut buffers = PlanBuffers::fresh(
        verify.slot_indices.shape()[0],
        write.seed_slot_indices.shape()[0],
    );
    buffers.enable = 0;
    let (verify, write) = upload_plans::<B>(buffers, write.scratch, &device);
    PlanOutput {
        verify,
        write,
        status: upload_status::<B>(status::encode(&Err(error)), &device),
    }
}

/// Values `offset..offset + len` of a 1-D i64 tensor, as an i64 tensor of exactly `len` values.
pub(crate) fn int_view<B: Backend>(
    tensor: IntTensor<B>,
    offset: usize,
    len: usize,
) -> IntTensor<B> {
    if len == 0 {
        // `slice` answers an empty range with the backend's default int dtype, not i64.
        return upload_i64::<B>(Vec::new(), &tensor.device());
    }
    B::int_slice(tensor, &[Slice::from(offset..offset + len)])
}

/// `write_i64` off the Cube backend: the values as a new tensor on the target's device.
pub(super) fn write_i64<B: Backend>(target: IntTensor<B>, values: Vec<i64>) -> IntTensor<B> {
    upload_i64::<B>(values, &target.device())
}

/// `tensor`'s columns before `at`, and the rest: a joined pool's K and V, or the queries of a
/// fused projection and the rows stored beside them.
pub(crate) fn split_columns<B: Backend>(tensor: FloatTensor<B>, at: usize) -> [FloatTensor<B>; 2] {
    let [rows, cols] = [tensor.shape()[0], tensor.shape()[1]];
    let part = |columns| [Slice::from(0..rows), Slice::from(columns)];
    [
        B::float_slice(tensor.clone(), &part(0..at)),
        B::float_slice(tensor, &part(at..cols)),
    ]
}

/// Reads a status record back: the single transfer of a checked call.
pub(crate) fn read_status<B: Backend>(status: IntTensor<B>) -> Result<StatusWords, Error> {
    let (_, words) = read_int::<B>(status)?;
    let mut record = [0; STATUS_LEN];
    for (slot, word) in record.iter_mut().zip(words) {
        *slot = word;
    }
    Ok(record)
}

/// The values of int or bool tensor data as i64, whatever the dtype, without assuming the bytes
/// are aligned (`TensorData::iter` panics on unaligned bytes, which CUDA read-backs can give).
pub fn data_to_i64(data: &TensorData) -> Vec<i64> {
    let bytes: &[u8] = data.bytes();
    macro_rules! read {
        ($t:ty) => {
            bytes
                .chunks_exact(size_of::<$t>())
                .map(|chunk| <$t>::from_le_bytes(chunk.try_into().unwrap_or_default()) as i64)
                .collect()
        };
    }
    match data.dtype() {
        DType::I64 => read!(i64),
        DType::I32 => read!(i32),
        DType::I16 => read!(i16),
        DType::I8 => read!(i8),
        DType::U64 => read!(u64),
        DType::U32 => read!(u32),
        DType::U16 => read!(u16),
        DType::U8 => read!(u8),
        DType::Bool(BoolStore::U32) => read!(u32),
        DType::Bool(_) => read!(u8),
        _ => data.iter::<i64>().collect(),
    }
}

/// An int tensor's values as i64 (one read-back).
pub(crate) fn read_ints<B: Backend>(tensor: IntTensor<B>) -> Result<Vec<i64>, Error> {
    Ok(read_int::<B>(tensor)?.1)
}

/// A source's bytes, read back (little-endian, whatever the dtype).
fn read_source<B: Backend>(tensor: KvBytes<B>) -> Result<Vec<u8>, Error> {
    let data = match tensor {
        KvBytes::Float(tensor) => read(B::float_into_data(tensor))?,
        KvBytes::Int(tensor) => read(B::int_into_data(tensor))?,
        KvBytes::Absent => return Ok(Vec::new()),
    };
    Ok(data.bytes().to_vec())
}

fn read_canary<B: Backend>(canary: &CanaryPrimitive<B>) -> Result<CanaryState, Error> {
    let buffer = read_int::<B>(canary.buffer.clone())?.1;
    let ring = read_int::<B>(canary.ring.clone())?.1;
    let counters = read_int::<B>(canary.counters.clone())?.1;
    let mut state = CanaryState::zeroed(canary.num_slots, canary.slot_words, canary.ring_capacity);
    let words = state.buffer.len();
    state.buffer.copy_from_slice(&buffer[..words]);
    for (row, values) in state.ring.iter_mut().zip(ring.chunks_exact(ROW_WORDS)) {
        row.copy_from_slice(values);
    }
    state.write_index = counters[WRITE_INDEX];
    state.slot_run_counter = counters[SLOT_RUN];
    state.kernel_run_counter = counters[KERNEL_RUN];
    Ok(state)
}

/// Uploads a host state as a canary's tensors (at least one buffer and one ring row), with a
/// status record.
pub(crate) fn upload_canary<B: Backend>(
    state: &CanaryState,
    status: StatusWords,
    device: &B::Device,
) -> CanaryPrimitive<B> {
    let (num_slots, slot_words) = (state.num_slots(), state.slot_stride_words);
    let mut buffer = state.buffer.clone();
    buffer.resize(num_slots.max(1) * slot_words, 0);
    let mut ring: Vec<i64> = state.ring.iter().flatten().copied().collect();
    ring.resize(state.ring.len().max(1) * ROW_WORDS, 0);
    let mut counters = [0i64; COUNTERS];
    counters[WRITE_INDEX] = state.write_index;
    counters[SLOT_RUN] = state.slot_run_counter;
    counters[KERNEL_RUN] = state.kernel_run_counter;
    // 1-D on purpose: CUDA may pad the rows of a 2-D allocation, and the kernels index words.
    CanaryPrimitive {
        buffer: upload_i64::<B>(buffer, device),
        ring: upload_i64::<B>(ring, device),
        counters: upload_i64::<B>(counters.to_vec(), device),
        status: upload_status::<B>(status, device),
        num_slots,
        slot_words,
        ring_capacity: state.ring.len(),
    }
}

/// A canary whose op could not run: zeroed, holding the failure's status.
pub(crate) fn failed_canary<B: Backend>(
    num_slots: usize,
    slot_words: usize,
    ring_capacity: usize,
    error: Error,
    device: &B::Device,
) -> CanaryPrimitive<B> {
    let state = CanaryState::zeroed(num_slots, slot_words, ring_capacity);
    upload_canary::<B>(&state, status::encode(&Err(error)), device)
}

/// The canary's standing status: a failure recorded earlier stays until `clear`.
fn standing_status<B: Backend>(canary: &CanaryPrimitive<B>) -> Result<StatusWords, Error> {
    read_status::<B>(canary.status.clone())
}

type Sources = Vec<(Vec<u8>, SourceLayout)>;

fn read_sources<B: Backend>(
    launch: CanaryLaunchPrimitive<B>,
) -> Result<(super::LaunchMeta, Sources), Error> {
    let (meta, sources) = launch.sources();
    let sources = sources
        .into_iter()
        .map(|(tensor, layout)| Ok((read_source::<B>(tensor)?, layout)))
        .collect::<Result<_, Error>>()?;
    Ok((meta, sources))
}

fn source_views(sources: &Sources) -> Vec<SourceBytes<'_>> {
    sources
        .iter()
        .map(|(bytes, layout)| SourceBytes {
            bytes,
            row_bytes: layout.row_bytes,
            page_size: layout.page_size,
            num_bytes_per_token: layout.num_bytes_per_token,
            read_bytes: layout.read_bytes,
        })
        .collect()
}

/// Runs a canary op on the host state; a failed read hands back a zeroed canary holding it.
fn with_state<B: Backend>(
    canary: CanaryPrimitive<B>,
    op: impl FnOnce(&mut CanaryState) -> Result<(), Error>,
) -> CanaryPrimitive<B> {
    let device = canary.buffer.device();
    let (num_slots, slot_words, ring_capacity) =
        (canary.num_slots, canary.slot_words, canary.ring_capacity);
    let run = || -> Result<(CanaryState, StatusWords), Error> {
        let standing = standing_status::<B>(&canary)?;
        let mut state = read_canary::<B>(&canary)?;
        op(&mut state)?;
        Ok((state, standing))
    };
    match run() {
        Ok((state, standing)) => upload_canary::<B>(&state, standing, &device),
        Err(error) => failed_canary::<B>(num_slots, slot_words, ring_capacity, error, &device),
    }
}

pub(super) fn canary_write<B: Backend>(
    canary: CanaryPrimitive<B>,
    plan: WritePlanPrimitive<B>,
    inputs: WriteInputsPrimitive<B>,
    launch: CanaryLaunchPrimitive<B>,
) -> CanaryPrimitive<B> {
    with_state(canary, |state| {
        let offsets = read_int::<B>(plan.offsets)?.1;
        let seeds = read_int::<B>(plan.seed_slot_indices)?.1;
        let num_valid_reqs = read_scalar::<B>(plan.num_valid_reqs)?;
        let input_ids = read_int::<B>(inputs.input_ids)?.1;
        let positions = read_int::<B>(inputs.positions)?.1;
        let out_cache_loc = read_int::<B>(inputs.out_cache_loc)?.1;
        let expected_tokens = read_optional::<B>(inputs.expected_input_tokens)?;
        let expected_positions = read_optional::<B>(inputs.expected_input_positions)?;
        let chain_position_assert = match inputs.chain_position_assert.into_option() {
            Some(flag) => read_scalar::<B>(flag)? != 0,
            None => false,
        };
        let (meta, sources) = read_sources::<B>(launch)?;
        let views = source_views(&sources);
        let args = WriteArgs {
            offsets: &offsets,
            seed_slot_indices: &seeds,
            num_valid_reqs,
            input_ids: &input_ids,
            positions: &positions,
            out_cache_loc: &out_cache_loc,
            expected_inputs: expected_tokens
                .as_deref()
                .zip(expected_positions.as_deref()),
            chain_position_assert,
        };
        let launch = Launch {
            kernel_kind: meta.kernel_kind,
            mode: meta.mode,
            sources: &views,
        };
        reference::canary::write(state, &args, &launch);
        Ok(())
    })
}

pub(super) fn canary_verify<B: Backend>(
    canary: CanaryPrimitive<B>,
    plan: VerifyPlanPrimitive<B>,
    launch: CanaryLaunchPrimitive<B>,
) -> CanaryPrimitive<B> {
    with_state(canary, |state| {
        let slot_indices = read_int::<B>(plan.slot_indices)?.1;
        let expected_tokens = read_int::<B>(plan.expected_tokens)?.1;
        let expected_positions = read_int::<B>(plan.expected_positions)?.1;
        let prev_slot_indices = read_int::<B>(plan.prev_slot_indices)?.1;
        let num_valid = read_scalar::<B>(plan.num_valid)?;
        let enable = read_scalar::<B>(plan.enable)?;
        let (meta, sources) = read_sources::<B>(launch)?;
        let views = source_views(&sources);
        let args = VerifyArgs {
            slot_indices: &slot_indices,
            expected_tokens: &expected_tokens,
            expected_positions: &expected_positions,
            prev_slot_indices: &prev_slot_indices,
            num_valid,
            enable,
            check_expected_token: meta.check_expected_token,
        };
        let launch = Launch {
            kernel_kind: meta.kernel_kind,
            mode: meta.mode,
            sources: &views,
        };
        reference::canary::verify(state, &args, &launch);
        Ok(())
    })
}

/// Reads a canary's whole state back (tests, conformance, `Canary::state`).
pub(crate) fn canary_state<B: Backend>(canary: &CanaryPrimitive<B>) -> Result<CanaryState, Error> {
    read_canary::<B>(canary)
}
