//! Small primitive-level helpers: uploads of host values as int or bool primitives, read-backs
//! as i64, and a device sync, with errors as text.

use burn_core::backend::tensor::{BoolTensor, IntTensor};
use burn_core::backend::{Backend, TensorData, TensorMetadata, get_device_settings, try_read_sync};
use burn_core::tensor::{DType, Slice};

pub use kvplan::backend::data_to_i64;

/// An int primitive of `shape` holding `values` in `dtype` (values must fit it).
///
/// An empty tensor is allocated empty, not uploaded: CubeCL's CUDA runtime was seen to break on a
/// zero-byte upload (the next read-back fails).
pub fn ints<B: Backend>(
    values: &[i64],
    shape: &[usize],
    dtype: DType,
    device: &B::Device,
) -> IntTensor<B> {
    if shape.contains(&0) {
        return B::int_empty(shape.to_vec().into(), device, dtype.into());
    }
    B::int_from_data(
        TensorData::new(values.to_vec(), shape.to_vec()).convert_dtype(dtype),
        device,
    )
}

/// A 1-D int primitive of `values` in `dtype`.
pub fn list<B: Backend>(values: &[i64], dtype: DType, device: &B::Device) -> IntTensor<B> {
    ints::<B>(values, &[values.len()], dtype, device)
}

/// A 1-D i64 primitive.
pub fn i64s<B: Backend>(values: &[i64], device: &B::Device) -> IntTensor<B> {
    list::<B>(values, DType::I64, device)
}

/// An i32 `[1]` primitive.
pub fn i32_scalar<B: Backend>(value: i64, device: &B::Device) -> IntTensor<B> {
    list::<B>(&[value], DType::I32, device)
}

/// A u8 primitive of `shape` holding raw `bytes` (empty: allocated, see [`ints`]).
pub fn bytes<B: Backend>(bytes: &[u8], shape: &[usize], device: &B::Device) -> IntTensor<B> {
    if shape.contains(&0) {
        return B::int_empty(shape.to_vec().into(), device, DType::U8.into());
    }
    B::int_from_data(TensorData::new(bytes.to_vec(), shape.to_vec()), device)
}

/// A bool primitive of `shape` in the device's bool dtype (empty: allocated, see [`ints`]).
pub fn bools<B: Backend>(values: &[bool], shape: &[usize], device: &B::Device) -> BoolTensor<B> {
    let store = get_device_settings::<B>(device).bool_dtype;
    if shape.contains(&0) {
        return B::bool_empty(shape.to_vec().into(), device, store);
    }
    B::bool_from_data(
        TensorData::new(values.to_vec(), shape.to_vec()).convert_dtype(DType::Bool(store)),
        device,
    )
}

/// The values of an int primitive as i64, row-major (one read-back).
pub fn read_ints<B: Backend>(tensor: IntTensor<B>) -> Result<Vec<i64>, String> {
    let data = try_read_sync(B::int_into_data(tensor))
        .ok_or_else(|| "read-back failed: cannot block on a read here".to_string())?
        .map_err(|error| format!("read-back failed: {error:?}"))?;
    Ok(data_to_i64(&data))
}

/// The first `len` values of an int primitive (at most all of them), in one read-back of just
/// those: a deferred output's tail was never written, and reading it reads uninitialised memory.
pub fn read_prefix<B: Backend>(tensor: IntTensor<B>, len: usize) -> Result<Vec<i64>, String> {
    let len = len.min(tensor.shape().num_elements());
    if len == 0 {
        return Ok(Vec::new());
    }
    read_ints::<B>(B::int_slice(tensor, &[Slice::from(0..len)]))
}

/// Waits for the device's queued work.
pub fn sync<B: Backend>(device: &B::Device) -> Result<(), String> {
    B::sync(device).map_err(|error| format!("device sync failed: {error:?}"))
}
