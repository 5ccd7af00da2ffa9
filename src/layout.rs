//! What the kernels, the reference and the public API share: buffer layouts and their constants.
//!
//! The numbers themselves are defined once, in the kernel crate (the lowest crate, which cannot
//! import the library); every side of the library takes them from here.

pub use kvplan_kernels::canary::{
    COUNTERS, KERNEL_RUN, MAX_SOURCES, ROW_WORDS, SLOT_RUN, WRITE_INDEX,
};
pub use kvplan_kernels::status::{COUNT, STATUS_LEN};

/// A real-KV source's layout in bytes (spec §4.2), validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceLayout {
    /// Rows of the byte matrix.
    pub rows: usize,
    /// Bytes per row (the row stride), a multiple of 16.
    pub row_bytes: usize,
    /// Slots per row.
    pub page_size: usize,
    /// Bytes per slot strip, a positive multiple of 16.
    pub num_bytes_per_token: usize,
    /// Bytes `ALL` folds, a positive multiple of 16, at most the strip.
    pub read_bytes: usize,
}
