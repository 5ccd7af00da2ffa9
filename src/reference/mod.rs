//! The host oracle: every op of the specs as plain Rust over slices.
//!
//! It is the reference that every kernel is tested against, and the fallback that the backend
//! trait's default methods run on backends without CubeCL. Inputs are i64 whatever the tensors'
//! dtypes were; shape-level rules (ranks, dtypes, devices) have been checked by `validate` before.

mod attention;
pub mod canary;
mod gather;
mod plan;
mod slots;

pub use attention::{Heads, key_runs, paged_attention};
pub use canary::{CanaryState, RealKvHashMode};
pub use gather::{masked_gather, segment_gather};
pub use plan::{ExpectedTokens, PlanArgs, PlanBuffers, plan};
pub use slots::{Segments, check_store_slots, segment_assign, store_kv};

/// A row-major 2-D integer table (`req_to_token`, the expected-token pool).
#[derive(Debug, Clone, Copy)]
pub struct Table<'a> {
    /// Number of rows.
    pub rows: usize,
    /// Number of columns.
    pub cols: usize,
    /// `rows * cols` values, row-major.
    pub data: &'a [i64],
}

impl<'a> Table<'a> {
    /// A table over `data`, which must hold `rows * cols` values.
    pub fn new(rows: usize, cols: usize, data: &'a [i64]) -> Self {
        debug_assert_eq!(rows.checked_mul(cols), Some(data.len()));
        Self { rows, cols, data }
    }

    /// `T[row][col]`; callers check the bounds first (the specs order the checks before the read).
    fn at(&self, row: usize, col: usize) -> i64 {
        self.data[row * self.cols + col]
    }

    /// `row` as a table row, when `0 <= row < rows`.
    fn row_index(&self, row: i64) -> Option<usize> {
        usize::try_from(row).ok().filter(|&q| q < self.rows)
    }
}

#[cfg(test)]
mod tests;
