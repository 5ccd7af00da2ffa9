//! kvplan's CubeCL kernels and the constants they share with the host. No Burn types here.
//!
//! Input strides travel as launch scalars in each kernel's shape struct, never through
//! `Tensor::stride`: cubecl 0.10 keeps a tensor's strides in a metadata buffer in global memory,
//! so every kernel began with a dependent global load before its first data load. Scalars are read
//! from the kernel's parameter space.

pub mod attention;
pub mod canary;
pub mod gather;
pub mod hash;
pub mod plan;
pub mod scan;
pub mod slots;
pub mod status;
