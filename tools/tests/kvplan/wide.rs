//! Tables past 2^32 elements (CUDA only: 17 GB of device memory). With 32-bit indexing, row 1's
//! late columns would wrap to the start of row 0; the launchers switch these launches to 64-bit
//! indexing.

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::{DType, TensorData};
use kvplan::KvPlanBackend;

use crate::common::{bools, ints, list, values};
use crate::gather::{masked, segments};

/// Columns of the wide table: 2 rows of them pass 2^32 elements.
const COLS: usize = (1 << 31) + 8;

/// Markers at row 1's columns, and the row-0 cell each would wrap to with 32-bit indexes.
const MARKED: [(usize, i64); 4] = [
    (0, 11),
    ((1 << 31) - 1, 33),
    ((1 << 31) + 4, 44),
    (COLS - 1, 22),
];

/// The wide table, zero except at the markers (row 1) and at the cells a wrapped index would read
/// (row 0, value -1). Uploaded from the host (i32 values, no conversion pass).
fn wide_table<B: KvPlanBackend>(device: &B::Device) -> IntTensor<B> {
    let mut cells = vec![0i32; 2 * COLS];
    for (column, value) in MARKED {
        cells[COLS + column] = value as i32;
        let wrapped = (COLS + column) % (1 << 32);
        if wrapped < COLS {
            cells[wrapped] = -1;
        }
    }
    B::int_from_data(TensorData::new(cells, [2, COLS]), device)
}

pub fn wide_tables<B: KvPlanBackend>(device: &B::Device) {
    let table = wide_table::<B>(device);
    let positions: Vec<i64> = MARKED.iter().map(|&(column, _)| column as i64).collect();
    let want: Vec<i64> = MARKED.iter().map(|&(_, value)| value).collect();
    let gathered = masked::<B>(
        table.clone(),
        list::<B>(&[1], DType::I64, device),
        ints::<B, 2>(&positions, [1, positions.len()], DType::I64, device),
        bools::<B, 2>(&[true; 4], [1, 4], device),
    )
    .expect("a wide masked gather");
    assert_eq!(values::<B>(gathered), want, "masked gather on a wide table");

    let got = segments::<B>(
        table,
        list::<B>(&[1], DType::I64, device),
        Some(list::<B>(&[(COLS - 4) as i64], DType::I64, device)),
        list::<B>(&[4], DType::I64, device),
    )
    .expect("a wide segment gather");
    assert_eq!(
        values::<B>(got),
        vec![44, 0, 0, 22],
        "segment gather on a wide table"
    );
}
