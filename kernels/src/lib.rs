//! kvplan's CubeCL kernels and the constants they share with the host. No Burn types here.

pub mod canary;
pub mod gather;
pub mod hash;
pub mod plan;
pub mod scan;
pub mod status;
