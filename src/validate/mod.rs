//! Host-side rules checked before any launch: ranks, dtypes, devices, lengths, capacities, strides.
//!
//! The rules see tensors only through [`Arg`] (name, shape, dtype, device), so they are plain
//! functions that never touch device memory and never panic. Data-dependent rules live with the
//! ops (kernels and reference) and come back through a status record.

mod attention;
pub mod canary;
mod gather;
mod plan;
mod slots;

pub use attention::{key_runs, paged_attention};
pub use gather::{masked_gather, segment_gather};
pub use plan::{PlanArgs, allocation, plan};
pub use slots::{segment_assign, store_kv, store_slots, store_write};

use core::fmt::Debug;

use burn_core::tensor::DType;

use crate::error::{Dims, Error};

/// Dtypes accepted for integer inputs.
pub const INT_DTYPES: &str = "int32, int64";

/// What the rules know of one tensor argument.
#[derive(Debug, Clone)]
pub struct Arg<D> {
    /// The argument's name, as in the specs.
    pub name: &'static str,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its dtype.
    pub dtype: DType,
    /// Its device.
    pub device: D,
}

impl<D> Arg<D> {
    fn dims(&self) -> Dims {
        Dims(self.shape.clone())
    }

    /// `dims[axis]`, 0 when the axis does not exist.
    pub fn dim(&self, axis: usize) -> usize {
        self.shape.get(axis).copied().unwrap_or(0)
    }

    /// `cols` of a matrix's columns, as one argument of its name: a part a joined tensor holds.
    pub fn columns(&self, cols: usize) -> Self
    where
        D: Clone,
    {
        Self {
            name: self.name,
            shape: vec![self.dim(0), cols],
            dtype: self.dtype,
            device: self.device.clone(),
        }
    }
}

/// A dtype's name as the conformance files spell it.
pub fn dtype_name(dtype: DType) -> String {
    match dtype {
        DType::I64 => "int64".into(),
        DType::I32 => "int32".into(),
        DType::I16 => "int16".into(),
        DType::I8 => "int8".into(),
        DType::U64 => "uint64".into(),
        DType::U32 => "uint32".into(),
        DType::U16 => "uint16".into(),
        DType::U8 => "uint8".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

pub(crate) fn require_rank<D>(arg: &Arg<D>, rank: usize, context: &str) -> Result<(), Error> {
    if arg.shape.len() == rank {
        return Ok(());
    }
    let (context, name, shape) = (context.to_string(), arg.name, arg.dims());
    Err(if rank == 1 {
        Error::Not1d {
            context,
            name,
            shape,
        }
    } else {
        Error::Not2d {
            context,
            name,
            shape,
        }
    })
}

fn require_int<D>(arg: &Arg<D>, context: &str) -> Result<(), Error> {
    match arg.dtype {
        DType::I32 | DType::I64 => Ok(()),
        other => Err(Error::DtypeMismatch {
            context: context.into(),
            name: arg.name,
            got: dtype_name(other),
            accepted: INT_DTYPES,
        }),
    }
}

fn require_bool<D>(arg: &Arg<D>, context: &str) -> Result<(), Error> {
    match arg.dtype {
        DType::Bool(_) => Ok(()),
        other => Err(Error::DtypeMismatch {
            context: context.into(),
            name: arg.name,
            got: dtype_name(other),
            accepted: "bool",
        }),
    }
}

fn require_device<D: PartialEq + Debug>(
    arg: &Arg<D>,
    expected: &D,
    context: &str,
) -> Result<(), Error> {
    if arg.device == *expected {
        return Ok(());
    }
    Err(Error::DeviceMismatch {
        context: context.into(),
        name: arg.name,
        device: format!("{:?}", arg.device),
        expected: format!("{expected:?}"),
    })
}

#[cfg(test)]
mod tests;
