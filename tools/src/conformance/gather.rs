//! Gather records: every record in exact mode and in capacity mode (default capacity).

use burn_tensor::{DType, Int, Tensor};
use serde_json::Value;

use super::{
    Dense, Mismatch, expect_eq, expect_slice, int_list, mismatch_kind, parse_error, values,
};
use crate::{CapacityGather, Error, KvPlanBackend};

struct Case {
    masked: bool,
    table: Dense,
    req_pool_indices: Dense,
    pos2d: Option<Dense>,
    mask: Option<Dense>,
    start: Option<Dense>,
    lengths: Option<Dense>,
    context: String,
}

impl Case {
    fn parse(record: &Value) -> Option<Case> {
        let inputs = &record["inputs"];
        Some(Case {
            masked: record["op"] == "masked",
            table: Dense::parse(&inputs["req_to_token"])?,
            req_pool_indices: Dense::list(int_list(&inputs["req_pool_indices"])?),
            pos2d: Dense::parse(&inputs["pos2d"]),
            mask: Dense::parse(&inputs["mask"]),
            start: int_list(&inputs["start"]).map(Dense::list),
            lengths: int_list(&inputs["lengths"]).map(Dense::list),
            context: inputs["context"].as_str().unwrap_or("").to_string(),
        })
    }

    /// Runs the case in capacity mode (default capacity), or exact mode when `exact`.
    fn run<B: KvPlanBackend>(&self, device: &B::Device, exact: bool) -> Result<Gathered<B>, Error> {
        let table = self.table.int::<B, 2>(DType::I32, device);
        let rows = self.req_pool_indices.int::<B, 1>(DType::I64, device);
        if !self.masked {
            let start = self
                .start
                .as_ref()
                .map(|start| start.int::<B, 1>(DType::I64, device));
            let lengths = self.lengths.as_ref().map_or_else(
                || Dense::list(vec![]).int::<B, 1>(DType::I64, device),
                |lengths| lengths.int::<B, 1>(DType::I64, device),
            );
            return if exact {
                crate::segment_gather(table, rows, start, lengths).map(Gathered::Exact)
            } else {
                crate::segment_gather_with_capacity(table, rows, start, lengths, None)
                    .map(Gathered::Capacity)
            };
        }
        let empty = Dense {
            shape: vec![0, 0],
            data: vec![],
        };
        let pos2d = self.pos2d.as_ref().unwrap_or(&empty);
        let mask = self.mask.as_ref().unwrap_or(&empty);
        let context = self.context.as_str();
        // The public API takes tensors of any rank (rank errors are the op's to report).
        macro_rules! call {
            ($dp:literal, $dm:literal) => {{
                let pos2d = pos2d.int::<B, $dp>(DType::I64, device);
                let mask = mask.bool::<B, $dm>(device);
                if exact {
                    crate::masked_gather(table, rows, pos2d, mask, context).map(Gathered::Exact)
                } else {
                    crate::masked_gather_with_capacity(table, rows, pos2d, mask, None, context)
                        .map(Gathered::Capacity)
                }
            }};
        }
        match (pos2d.shape.len(), mask.shape.len()) {
            (1, 1) => call!(1, 1),
            (1, 2) => call!(1, 2),
            (1, 3) => call!(1, 3),
            (2, 1) => call!(2, 1),
            (2, 2) => call!(2, 2),
            (2, 3) => call!(2, 3),
            (3, 1) => call!(3, 1),
            (3, 2) => call!(3, 2),
            (3, 3) => call!(3, 3),
            (dp, dm) => unreachable!("ranks {dp}/{dm} are refused by `check`"),
        }
    }

    /// The default capacity of capacity mode.
    fn default_capacity(&self) -> usize {
        if self.masked {
            self.mask.as_ref().map_or(0, |mask| mask.data.len())
        } else {
            let segments = self
                .lengths
                .as_ref()
                .map_or(0, |lengths| lengths.data.len());
            segments * self.table.shape.get(1).copied().unwrap_or(0)
        }
    }
}

enum Gathered<B: KvPlanBackend> {
    Exact(Tensor<B, 1, Int>),
    Capacity(CapacityGather<B>),
}

pub(super) fn check<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let case = Case::parse(record).ok_or_else(|| parse_error("gather inputs"))?;
    let supported = |dense: &Option<Dense>| {
        dense
            .as_ref()
            .is_none_or(|d| (1..=3).contains(&d.shape.len()))
    };
    if !supported(&case.pos2d) || !supported(&case.mask) {
        return Err(parse_error(
            "pos2d/mask ranks above 3 are not supported by the runner",
        ));
    }
    let expected_kind = record["error_kind"].as_str();
    let expected_out = int_list(&record["expected"]["out"]).unwrap_or_default();

    // Exact mode.
    match (case.run::<B>(device, true), expected_kind) {
        (Ok(Gathered::Exact(out)), None) => {
            expect_slice("exact", "out", &expected_out, &values(out))?
        }
        (Err(error), Some(kind)) => expect_eq("exact", "error kind", kind, error.kind())?,
        (Ok(_), Some(kind)) => return Err(mismatch_kind("exact", kind, "Ok".into())),
        (Err(error), None) => return Err(mismatch_kind("exact", "Ok", error.to_string())),
        (Ok(Gathered::Capacity(_)), None) => unreachable!("exact mode returns a tensor"),
    }

    // Capacity mode: an immediate `Err`, or a status that `check()` turns into one.
    let gathered = match case.run::<B>(device, false) {
        Ok(Gathered::Capacity(gathered)) => gathered,
        Ok(Gathered::Exact(_)) => unreachable!("capacity mode returns a CapacityGather"),
        Err(error) => {
            return match expected_kind {
                Some(kind) => expect_eq("capacity", "error kind", kind, error.kind()),
                None => Err(mismatch_kind("capacity", "Ok", error.to_string())),
            };
        }
    };
    let count = values(gathered.count.clone())[0];
    match (gathered.status.check(), expected_kind) {
        (Ok(checked), None) => {
            expect_eq("capacity", "check()", expected_out.len(), checked)?;
            expect_eq("capacity", "count", expected_out.len() as i64, count)?;
            expect_eq(
                "capacity",
                "out capacity",
                case.default_capacity(),
                gathered.out.dims()[0],
            )?;
            let out = values(gathered.out);
            expect_slice(
                "capacity",
                "out",
                &expected_out,
                &out[..checked.min(out.len())],
            )
        }
        (Err(error), Some(kind)) => {
            expect_eq("capacity", "error kind", kind, error.kind())?;
            expect_eq("capacity", "count after a deferred error", 0, count)
        }
        (Ok(_), Some(kind)) => Err(mismatch_kind("capacity", kind, "Ok".into())),
        (Err(error), None) => Err(mismatch_kind("capacity", "Ok", error.to_string())),
    }
}
