//! Host rules of kv-canary write and verify (spec `canary-write-verify.md` §10).
//!
//! A failed rule returns before any launch, so nothing (counter, ring, buffer) changes.

use burn_core::tensor::DType;

use super::{Arg, dtype_name};
use crate::error::{Dims, Error};
use crate::layout::SourceLayout;
use crate::reference::RealKvHashMode;

/// `MAX_REAL_KV_SOURCES`.
pub const MAX_SOURCES: usize = kvplan_kernels::canary::MAX_SOURCES;

/// The canary buffer's slot stride: a multiple of 8 bytes holding the four record fields.
pub fn slot_stride(slot_stride_bytes: usize) -> Result<(), Error> {
    if slot_stride_bytes % 8 != 0 {
        return Err(Error::SlotStrideNotMultipleOf8 { slot_stride_bytes });
    }
    if slot_stride_bytes < 32 {
        return Err(Error::SlotStrideTooSmall { slot_stride_bytes });
    }
    Ok(())
}

/// A real-KV source descriptor (rules `source_page_size` .. `source_row_stride`), in the order
/// sglang's `RealKvSource` checks them. `shape` and `dtype` are the tensor's; its rows are dim 0
/// and the rest of each row is contiguous bytes.
pub fn source(
    shape: &[usize],
    dtype: DType,
    page_size: i64,
    num_bytes_per_token: i64,
    read_bytes: i64,
) -> Result<SourceLayout, Error> {
    if page_size < 1 {
        return Err(Error::SourcePageSize { page_size });
    }
    if num_bytes_per_token <= 0 || num_bytes_per_token % 16 != 0 {
        return Err(Error::SourceNumBytesPerToken {
            num_bytes_per_token,
        });
    }
    if read_bytes <= 0 || read_bytes > num_bytes_per_token || read_bytes % 16 != 0 {
        return Err(Error::SourceReadBytes {
            read_bytes,
            num_bytes_per_token,
        });
    }
    if shape.len() < 2 {
        return Err(Error::SourceNot2d {
            shape: Dims(shape.to_vec()),
        });
    }
    let row_bytes = shape[1..].iter().product::<usize>() * dtype.size();
    if row_bytes % 16 != 0 {
        return Err(Error::SourceRowStride {
            row_bytes,
            shape: Dims(shape.to_vec()),
            dtype: dtype_name(dtype),
        });
    }
    Ok(SourceLayout {
        rows: shape[0],
        row_bytes,
        page_size: page_size as usize,
        num_bytes_per_token: num_bytes_per_token as usize,
        read_bytes: read_bytes as usize,
    })
}

/// The launch's source list: at most four, and rows wide enough for their strips when the mode
/// reads them.
pub fn launch(mode: RealKvHashMode, sources: &[SourceLayout]) -> Result<(), Error> {
    if sources.len() > MAX_SOURCES {
        return Err(Error::TooManySources {
            count: sources.len(),
        });
    }
    if mode != RealKvHashMode::None {
        for layout in sources {
            if layout.row_bytes < layout.page_size * layout.num_bytes_per_token {
                return Err(Error::SourceRowTooNarrow {
                    row_bytes: layout.row_bytes,
                    page_size: layout.page_size,
                    num_bytes_per_token: layout.num_bytes_per_token,
                });
            }
        }
    }
    Ok(())
}

/// What the write rules see of a step's token arrays.
#[derive(Debug, Clone)]
pub struct WriteArgs<D> {
    /// `input_ids`, `positions`, `out_cache_loc`.
    pub tokens: [Arg<D>; 3],
    /// `enable_write_input_assert`.
    pub enable_write_input_assert: bool,
    /// `expected_input_tokens`, when given.
    pub expected_input_tokens: Option<Arg<D>>,
    /// `expected_input_positions`, when given.
    pub expected_input_positions: Option<Arg<D>>,
    /// `enable_chain_position_assert`, when given.
    pub chain_position_assert: Option<Arg<D>>,
}

/// The write rules: expected-input presence, then one i64 length for every token array.
pub fn write<D>(args: &WriteArgs<D>) -> Result<(), Error> {
    let expected = [&args.expected_input_tokens, &args.expected_input_positions];
    if args.enable_write_input_assert && expected.iter().any(|arg| arg.is_none()) {
        return Err(Error::ExpectedInputsMissing);
    }
    if !args.enable_write_input_assert && expected.iter().any(|arg| arg.is_some()) {
        return Err(Error::ExpectedInputsUnexpected);
    }
    let arrays: Vec<&Arg<D>> = args
        .tokens
        .iter()
        .chain(expected.into_iter().flatten())
        .collect();
    for arg in &arrays {
        i64_vector(arg)?;
    }
    let len = args.tokens[0].dim(0);
    for arg in &arrays[1..] {
        if arg.dim(0) != len {
            return Err(Error::TokenArraysLength {
                name: arg.name,
                len: arg.dim(0),
                expected: len,
            });
        }
    }
    if let Some(flag) = &args.chain_position_assert {
        i32_scalar(flag)?;
    }
    Ok(())
}

/// The verify plan's arrays: i64, one length (`verify_plan_length`); its counts i32 `[1]`.
pub fn verify_plan<D>(arrays: &[Arg<D>; 4], scalars: &[Arg<D>; 2]) -> Result<(), Error> {
    for arg in arrays {
        i64_vector(arg)?;
    }
    let len = arrays[0].dim(0);
    for arg in &arrays[1..] {
        if arg.dim(0) != len {
            return Err(Error::VerifyPlanLength {
                name: arg.name,
                len: arg.dim(0),
                expected: len,
            });
        }
    }
    scalars.iter().try_for_each(i32_scalar)
}

/// The write plan's arrays: `write_offsets` is `K + 1` long; all i64, the count i32 `[1]`.
pub fn write_plan<D>(
    offsets: &Arg<D>,
    seeds: &Arg<D>,
    num_valid_reqs: &Arg<D>,
) -> Result<(), Error> {
    i64_vector(offsets)?;
    i64_vector(seeds)?;
    if offsets.dim(0) != seeds.dim(0) + 1 {
        return Err(Error::WriteOffsetsLength {
            expected: seeds.dim(0) + 1,
            len: offsets.dim(0),
        });
    }
    i32_scalar(num_valid_reqs)
}

fn describe<D>(arg: &Arg<D>) -> String {
    format!("{} {:?}", dtype_name(arg.dtype), arg.shape)
}

fn i64_vector<D>(arg: &Arg<D>) -> Result<(), Error> {
    if arg.dtype == DType::I64 && arg.shape.len() == 1 {
        return Ok(());
    }
    Err(Error::CanaryArgument {
        name: arg.name,
        got: describe(arg),
        accepted: "int64 [n]",
    })
}

fn i32_scalar<D>(arg: &Arg<D>) -> Result<(), Error> {
    if arg.dtype == DType::I32 && arg.shape == [1] {
        return Ok(());
    }
    Err(Error::CanaryArgument {
        name: arg.name,
        got: describe(arg),
        accepted: "int32 [1]",
    })
}
