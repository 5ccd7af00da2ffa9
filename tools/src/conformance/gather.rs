//! Gather records: every record in exact mode and in deferred mode (default capacity).

use burn_core::backend::TensorMetadata;
use burn_core::tensor::DType;
use kvplan::generic::{exact, masked_gather, segment_gather};
use kvplan::ops::{GatherOptions, Gathered};
use kvplan::{Error, KvPlanBackend};
use serde_json::Value;

use super::{
    Dense, Mismatch, expect_eq, expect_slice, int_list, mismatch_kind, prefix_values, values,
};

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
    /// The record's inputs (the table is uploaded as int32: its values must fit).
    fn parse(record: &Value) -> Result<Case, Mismatch> {
        let inputs = &record["inputs"];
        let list = |name: &str| -> Result<Option<Dense>, Mismatch> {
            let values = int_list(&inputs[name], name)?;
            Ok(values.map(|values| Dense::list(name, values)))
        };
        Ok(Case {
            masked: record["op"] == "masked",
            table: Dense::required(&inputs["req_to_token"], "req_to_token")?.fitting(DType::I32)?,
            req_pool_indices: list("req_pool_indices")?
                .ok_or_else(|| super::missing("req_pool_indices"))?,
            pos2d: Dense::parse(&inputs["pos2d"], "pos2d")?,
            mask: Dense::parse(&inputs["mask"], "mask")?,
            start: list("start")?,
            lengths: list("lengths")?,
            context: inputs["context"].as_str().unwrap_or("").to_string(),
        })
    }

    /// Runs the case in deferred mode with the default capacity: nothing is read back. The
    /// primitives carry the record's shapes as given (rank errors are the op's to report).
    fn run<B: KvPlanBackend>(&self, device: &B::Device) -> Result<Gathered<B>, Error> {
        let table = self.table.int::<B>(DType::I32, device);
        let rows = self.req_pool_indices.int::<B>(DType::I64, device);
        if !self.masked {
            let start = self
                .start
                .as_ref()
                .map(|start| start.int::<B>(DType::I64, device));
            let no_lengths = Dense::list("lengths", vec![]);
            let lengths = self
                .lengths
                .as_ref()
                .unwrap_or(&no_lengths)
                .int::<B>(DType::I64, device);
            return segment_gather::<B>(table, rows, start, lengths, &GatherOptions::new());
        }
        let empty = Dense {
            field: "pos2d".into(),
            shape: vec![0, 0],
            data: vec![],
        };
        let pos2d = self.pos2d.as_ref().unwrap_or(&empty);
        let mask = self.mask.as_ref().unwrap_or(&empty);
        masked_gather::<B>(
            table,
            rows,
            pos2d.int::<B>(DType::I64, device),
            mask.bool::<B>(device),
            &GatherOptions::new().context(self.context.as_str()),
        )
    }

    /// The default capacity of deferred mode.
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

pub(super) fn check<B: KvPlanBackend>(record: &Value, device: &B::Device) -> Result<(), Mismatch> {
    let case = Case::parse(record)?;
    let expected_kind = record["error_kind"].as_str();
    let expected_out = int_list(&record["expected"]["out"], "expected.out")?.unwrap_or_default();

    // Exact mode: the deferred call, then its one read-back.
    match (case.run::<B>(device).and_then(exact::<B>), expected_kind) {
        (Ok(out), None) => {
            expect_slice("exact", "out", &expected_out, &values::<B>("exact", out)?)?
        }
        (Err(error), Some(kind)) => expect_eq("exact", "error kind", kind, error.kind())?,
        (Ok(_), Some(kind)) => return Err(mismatch_kind("exact", kind, "Ok".into())),
        (Err(error), None) => return Err(mismatch_kind("exact", "Ok", error.to_string())),
    }

    // Deferred mode: an immediate `Err`, or a status that `check()` turns into one.
    let mode = "capacity";
    let gathered = match case.run::<B>(device) {
        Ok(gathered) => gathered,
        Err(error) => {
            return match expected_kind {
                Some(kind) => expect_eq(mode, "error kind", kind, error.kind()),
                None => Err(mismatch_kind(mode, "Ok", error.to_string())),
            };
        }
    };
    let count = values::<B>(mode, gathered.count())?
        .first()
        .copied()
        .unwrap_or(-1);
    match (gathered.status.check(), expected_kind) {
        (Ok(checked), None) => {
            expect_eq(mode, "check()", expected_out.len(), checked)?;
            expect_eq(mode, "count", expected_out.len() as i64, count)?;
            expect_eq(
                mode,
                "out capacity",
                case.default_capacity(),
                gathered.out.shape().num_elements(),
            )?;
            let out = prefix_values::<B>(mode, gathered.out, checked)?;
            expect_slice(mode, "out", &expected_out, &out)
        }
        (Err(error), Some(kind)) => {
            expect_eq(mode, "error kind", kind, error.kind())?;
            expect_eq(mode, "count after a deferred error", 0, count)
        }
        (Ok(_), Some(kind)) => Err(mismatch_kind(mode, kind, "Ok".into())),
        (Err(error), None) => Err(mismatch_kind(mode, "Ok", error.to_string())),
    }
}
