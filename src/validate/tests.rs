//! Unit tests of every host rule in `validate`: the kind, the carried facts, and rule precedence.
//!
//! Devices are plain `u8`s (`Arg<D>` is generic), so `Debug` prints them as `0`, `1`, ...

use burn_core::tensor::BoolStore;
use burn_core::tensor::DType;

use super::plan::MAX_CAPACITY;
use super::{
    Arg, INT_DTYPES, PlanArgs, allocation, dtype_name, masked_gather, plan, segment_gather,
};
use crate::error::{Dims, Error, PLAN_CONTEXT, SEGMENT_CONTEXT};

const DEV: u8 = 0;
const OTHER: u8 = 1;
const CTX: &str = "DFLASH target hidden KV append";
const BOOL: DType = DType::Bool(BoolStore::Native);

fn arg(name: &'static str, shape: &[usize], dtype: DType) -> Arg<u8> {
    Arg {
        name,
        shape: shape.to_vec(),
        dtype,
        device: DEV,
    }
}

fn on(mut arg: Arg<u8>, device: u8) -> Arg<u8> {
    arg.device = device;
    arg
}

fn dtype(mut arg: Arg<u8>, dtype: DType) -> Arg<u8> {
    arg.dtype = dtype;
    arg
}

fn shape(mut arg: Arg<u8>, shape: &[usize]) -> Arg<u8> {
    arg.shape = shape.to_vec();
    arg
}

fn dims(shape: &[usize]) -> Dims {
    Dims(shape.to_vec())
}

// ---------------------------------------------------------------------------------------------
// masked_gather: rules 1-5 and 7
// ---------------------------------------------------------------------------------------------

/// A valid masked-gather call: table 4x6, n = 2, 2x3 block.
struct Masked {
    table: Arg<u8>,
    rows: Arg<u8>,
    pos2d: Arg<u8>,
    mask: Arg<u8>,
}

impl Masked {
    fn new() -> Self {
        Self {
            table: arg("req_to_token", &[4, 6], DType::I32),
            rows: arg("req_pool_indices", &[2], DType::I64),
            pos2d: arg("pos2d", &[2, 3], DType::I64),
            mask: arg("mask", &[2, 3], BOOL),
        }
    }

    fn run(&self) -> Result<(), Error> {
        masked_gather(&self.table, &self.rows, &self.pos2d, &self.mask, CTX)
    }
}

#[test]
fn masked_valid_inputs_pass() {
    assert_eq!(Masked::new().run(), Ok(()));
    // Both int dtypes are accepted for every int input, and the bool store does not matter.
    for dt in [DType::I32, DType::I64] {
        let mut m = Masked::new();
        m.table = dtype(m.table, dt);
        m.rows = dtype(m.rows, dt);
        m.pos2d = dtype(m.pos2d, dt);
        m.mask = dtype(m.mask, DType::Bool(BoolStore::U8));
        assert_eq!(m.run(), Ok(()));
    }
}

#[test]
fn masked_rule1_pos_not_2d() {
    for bad in [&[6][..], &[1, 2, 3][..], &[][..]] {
        let mut m = Masked::new();
        m.pos2d = shape(m.pos2d, bad);
        m.mask = shape(m.mask, bad);
        assert_eq!(
            m.run(),
            Err(Error::PosNot2d {
                context: CTX.into(),
                shape: dims(bad)
            })
        );
    }
}

#[test]
fn masked_rule1_beats_everything_else() {
    let mut m = Masked::new();
    m.pos2d = dtype(on(shape(m.pos2d, &[6]), OTHER), DType::F32);
    m.mask = shape(m.mask, &[9, 9]); // rule 2 would fail too
    m.table = shape(m.table, &[24]); // rule 3 would fail too
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::PosNot2d {
            context: CTX.into(),
            shape: dims(&[6])
        }
    );
    assert_eq!(err.kind(), "pos_not_2d");
    assert_eq!(
        err.to_string(),
        format!("{CTX} pos2d must be 2-D, got shape [6].")
    );
}

#[test]
fn masked_rule2_mask_shape_mismatch() {
    // Same rank, different dims.
    let mut m = Masked::new();
    m.mask = shape(m.mask, &[2, 4]);
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::MaskShapeMismatch {
            context: CTX.into(),
            mask: dims(&[2, 4]),
            pos2d: dims(&[2, 3])
        }
    );
    assert_eq!(err.kind(), "mask_shape_mismatch");
    assert_eq!(
        err.to_string(),
        format!("{CTX} mask shape [2, 4] differs from pos2d shape [2, 3].")
    );
    // Different rank with the same element count.
    let mut m = Masked::new();
    m.mask = shape(m.mask, &[6]);
    assert_eq!(
        m.run(),
        Err(Error::MaskShapeMismatch {
            context: CTX.into(),
            mask: dims(&[6]),
            pos2d: dims(&[2, 3])
        })
    );
    let mut m = Masked::new();
    m.mask = shape(m.mask, &[2, 3, 1]);
    assert_eq!(m.run().unwrap_err().kind(), "mask_shape_mismatch");
    // Transposed.
    let mut m = Masked::new();
    m.mask = shape(m.mask, &[3, 2]);
    assert_eq!(m.run().unwrap_err().kind(), "mask_shape_mismatch");
}

#[test]
fn masked_rule2_beats_rules_3_to_7() {
    let mut m = Masked::new();
    m.mask = dtype(on(shape(m.mask, &[2, 4]), OTHER), DType::I32);
    m.table = shape(m.table, &[24]);
    m.rows = shape(m.rows, &[2, 1]);
    assert_eq!(m.run().unwrap_err().kind(), "mask_shape_mismatch");
}

#[test]
fn masked_rule3_ranks() {
    let mut m = Masked::new();
    m.table = shape(m.table, &[24]);
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::Not2d {
            context: CTX.into(),
            name: "req_to_token",
            shape: dims(&[24])
        }
    );
    assert_eq!(err.kind(), "not_2d");
    assert_eq!(
        err.to_string(),
        format!("{CTX} req_to_token must be 2-D, got shape [24].")
    );

    let mut m = Masked::new();
    m.table = shape(m.table, &[2, 2, 6]);
    assert_eq!(
        m.run(),
        Err(Error::Not2d {
            context: CTX.into(),
            name: "req_to_token",
            shape: dims(&[2, 2, 6])
        })
    );

    let mut m = Masked::new();
    m.rows = shape(m.rows, &[2, 1]);
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::Not1d {
            context: CTX.into(),
            name: "req_pool_indices",
            shape: dims(&[2, 1])
        }
    );
    assert_eq!(err.kind(), "not_1d");
    assert_eq!(
        err.to_string(),
        format!("{CTX} req_pool_indices must be 1-D, got shape [2, 1].")
    );

    // A scalar (rank 0) is not 1-D either.
    let mut m = Masked::new();
    m.rows = shape(m.rows, &[]);
    assert_eq!(
        m.run(),
        Err(Error::Not1d {
            context: CTX.into(),
            name: "req_pool_indices",
            shape: dims(&[])
        })
    );
}

#[test]
fn masked_rule3_table_checked_before_indices_and_beats_dtype_and_device() {
    let mut m = Masked::new();
    m.table = shape(m.table, &[24]);
    m.rows = dtype(on(shape(m.rows, &[2, 1]), OTHER), DType::F32);
    assert_eq!(
        m.run(),
        Err(Error::Not2d {
            context: CTX.into(),
            name: "req_to_token",
            shape: dims(&[24])
        })
    );
    let mut m = Masked::new();
    m.rows = on(shape(m.rows, &[2, 1]), OTHER);
    m.pos2d = dtype(m.pos2d, DType::F32);
    assert_eq!(m.run().unwrap_err().kind(), "not_1d");
}

#[test]
fn masked_rule4_dtypes() {
    let cases: [(&str, DType, &str); 6] = [
        ("req_to_token", DType::F32, "f32"),
        ("req_to_token", DType::U8, "uint8"),
        ("req_pool_indices", DType::I16, "int16"),
        ("req_pool_indices", DType::U64, "uint64"),
        ("pos2d", DType::U32, "uint32"),
        ("pos2d", DType::I8, "int8"),
    ];
    for (name, bad, got) in cases {
        let mut m = Masked::new();
        match name {
            "req_to_token" => m.table = dtype(m.table, bad),
            "req_pool_indices" => m.rows = dtype(m.rows, bad),
            _ => m.pos2d = dtype(m.pos2d, bad),
        }
        let err = m.run().unwrap_err();
        assert_eq!(
            err,
            Error::DtypeMismatch {
                context: CTX.into(),
                name,
                got: got.into(),
                accepted: INT_DTYPES
            },
            "{name} {bad:?}"
        );
        assert_eq!(err.kind(), "dtype_mismatch");
        assert_eq!(
            err.to_string(),
            format!("{CTX} {name} has dtype {got}; accepted: int32, int64.")
        );
    }
    // A bool pos2d is not an int.
    let mut m = Masked::new();
    m.pos2d = dtype(m.pos2d, BOOL);
    match m.run().unwrap_err() {
        Error::DtypeMismatch {
            name,
            got,
            accepted,
            context,
        } => {
            assert_eq!(
                (name, accepted, context.as_str()),
                ("pos2d", INT_DTYPES, CTX)
            );
            assert!(got.starts_with("bool"), "{got}");
        }
        other => panic!("unexpected {other:?}"),
    }
    // The mask must be bool.
    let mut m = Masked::new();
    m.mask = dtype(m.mask, DType::I32);
    assert_eq!(
        m.run(),
        Err(Error::DtypeMismatch {
            context: CTX.into(),
            name: "mask",
            got: "int32".into(),
            accepted: "bool",
        })
    );
}

#[test]
fn masked_rule4_argument_order() {
    // table, req_pool_indices, pos2d, then mask.
    let mut m = Masked::new();
    m.rows = dtype(m.rows, DType::F32);
    m.pos2d = dtype(m.pos2d, DType::U8);
    m.mask = dtype(m.mask, DType::I64);
    assert!(matches!(
        m.run(),
        Err(Error::DtypeMismatch {
            name: "req_pool_indices",
            ..
        })
    ));
    m.rows = dtype(m.rows, DType::I64);
    assert!(matches!(
        m.run(),
        Err(Error::DtypeMismatch { name: "pos2d", .. })
    ));
    m.pos2d = dtype(m.pos2d, DType::I32);
    assert!(matches!(
        m.run(),
        Err(Error::DtypeMismatch { name: "mask", .. })
    ));
    m.table = dtype(m.table, DType::F64);
    assert!(matches!(
        m.run(),
        Err(Error::DtypeMismatch {
            name: "req_to_token",
            ..
        })
    ));
}

#[test]
fn masked_rule4_dtype_beats_device() {
    let mut m = Masked::new();
    m.rows = on(m.rows, OTHER);
    m.pos2d = dtype(m.pos2d, DType::U16);
    assert!(matches!(
        m.run(),
        Err(Error::DtypeMismatch { name: "pos2d", .. })
    ));
}

#[test]
fn masked_rule5_devices() {
    for name in ["req_pool_indices", "pos2d", "mask"] {
        let mut m = Masked::new();
        match name {
            "req_pool_indices" => m.rows = on(m.rows, OTHER),
            "pos2d" => m.pos2d = on(m.pos2d, OTHER),
            _ => m.mask = on(m.mask, OTHER),
        }
        let err = m.run().unwrap_err();
        assert_eq!(
            err,
            Error::DeviceMismatch {
                context: CTX.into(),
                name,
                device: "1".into(),
                expected: "0".into(),
            }
        );
        assert_eq!(err.kind(), "device_mismatch");
        assert_eq!(
            err.to_string(),
            format!("{CTX} {name} is on 1, expected 0.")
        );
    }
    // The expected device is the table's: a table elsewhere names the first other argument.
    let mut m = Masked::new();
    m.table = on(m.table, 7);
    assert_eq!(
        m.run(),
        Err(Error::DeviceMismatch {
            context: CTX.into(),
            name: "req_pool_indices",
            device: "0".into(),
            expected: "7".into(),
        })
    );
    // Argument order among the others.
    let mut m = Masked::new();
    m.pos2d = on(m.pos2d, 2);
    m.mask = on(m.mask, 3);
    assert!(matches!(
        m.run(),
        Err(Error::DeviceMismatch { name: "pos2d", .. })
    ));
}

#[test]
fn masked_rule5_beats_rule7() {
    let mut m = Masked::new();
    m.rows = on(shape(m.rows, &[3]), OTHER);
    assert_eq!(m.run().unwrap_err().kind(), "device_mismatch");
}

#[test]
fn masked_rule7_pairing() {
    // n == R and n == 1 pass.
    for n in [2, 1] {
        let mut m = Masked::new();
        m.rows = shape(m.rows, &[n]);
        assert_eq!(m.run(), Ok(()), "n={n}");
    }
    // R == 1 with n != 1: the mask_index split.
    let mut m = Masked::new();
    m.rows = shape(m.rows, &[3]);
    m.pos2d = shape(m.pos2d, &[1, 2]);
    m.mask = shape(m.mask, &[1, 2]);
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::MaskIndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 1,
            cols: 2
        }
    );
    assert_eq!(err.kind(), "mask_index_shape_mismatch");
    assert_eq!(
        err.to_string(),
        format!("{CTX} a single pos2d row cannot serve 3 req_pool_indices.")
    );
    // R == 1, n == 0 is the mask_index kind too.
    m.rows = shape(m.rows, &[0]);
    assert_eq!(
        m.run(),
        Err(Error::MaskIndexShapeMismatch {
            context: CTX.into(),
            n: 0,
            rows: 1,
            cols: 2
        })
    );
    // R > 1.
    let mut m = Masked::new();
    m.rows = shape(m.rows, &[3]);
    m.pos2d = shape(m.pos2d, &[2, 2]);
    m.mask = shape(m.mask, &[2, 2]);
    let err = m.run().unwrap_err();
    assert_eq!(
        err,
        Error::IndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 2,
            cols: 2
        }
    );
    assert_eq!(err.kind(), "index_shape_mismatch");
    assert_eq!(
        err.to_string(),
        format!("{CTX} 3 req_pool_indices cannot pair with 2 pos2d rows (need 2 or 1).")
    );
    // R == 0: n == 0 and n == 1 pass, n == 2 is index_shape_mismatch.
    for (n, ok) in [(0, true), (1, true), (2, false)] {
        let mut m = Masked::new();
        m.rows = shape(m.rows, &[n]);
        m.pos2d = shape(m.pos2d, &[0, 4]);
        m.mask = shape(m.mask, &[0, 4]);
        let expected = if ok {
            Ok(())
        } else {
            Err(Error::IndexShapeMismatch {
                context: CTX.into(),
                n,
                rows: 0,
                cols: 4,
            })
        };
        assert_eq!(m.run(), expected, "n={n}");
    }
    // C == 0 does not exempt rule 7.
    let mut m = Masked::new();
    m.rows = shape(m.rows, &[3]);
    m.pos2d = shape(m.pos2d, &[2, 0]);
    m.mask = shape(m.mask, &[2, 0]);
    assert_eq!(
        m.run(),
        Err(Error::IndexShapeMismatch {
            context: CTX.into(),
            n: 3,
            rows: 2,
            cols: 0
        })
    );
}

#[test]
fn masked_rule7_skipped_when_table_has_no_columns() {
    for table in [&[4, 0][..], &[0, 0][..]] {
        let mut m = Masked::new();
        m.table = shape(m.table, table);
        m.rows = shape(m.rows, &[3]);
        assert_eq!(m.run(), Ok(()), "{table:?}");
        m.pos2d = shape(m.pos2d, &[1, 3]);
        m.mask = shape(m.mask, &[1, 3]);
        assert_eq!(m.run(), Ok(()), "{table:?} R=1");
    }
    // A table with rows 0 but columns > 0 is not exempt.
    let mut m = Masked::new();
    m.table = shape(m.table, &[0, 6]);
    m.rows = shape(m.rows, &[3]);
    assert_eq!(m.run().unwrap_err().kind(), "index_shape_mismatch");
}

#[test]
fn masked_context_is_carried_verbatim() {
    let mut m = Masked::new();
    m.rows = shape(m.rows, &[2, 2]);
    let err = masked_gather(&m.table, &m.rows, &m.pos2d, &m.mask, "my ctx:").unwrap_err();
    assert_eq!(
        err.to_string(),
        "my ctx: req_pool_indices must be 1-D, got shape [2, 2]."
    );
}

// ---------------------------------------------------------------------------------------------
// segment_gather: rules 1-3
// ---------------------------------------------------------------------------------------------

struct Segments {
    table: Arg<u8>,
    rows: Arg<u8>,
    start: Option<Arg<u8>>,
    lengths: Arg<u8>,
}

impl Segments {
    fn new() -> Self {
        Self {
            table: arg("req_to_token", &[4, 6], DType::I32),
            rows: arg("req_pool_indices", &[3], DType::I64),
            start: Some(arg("start", &[3], DType::I64)),
            lengths: arg("lengths", &[3], DType::I64),
        }
    }

    fn start(&mut self, f: impl FnOnce(Arg<u8>) -> Arg<u8>) {
        self.start = self.start.take().map(f);
    }

    fn run(&self) -> Result<(), Error> {
        segment_gather(
            &self.table,
            &self.rows,
            self.start.as_ref(),
            &self.lengths,
            crate::error::SEGMENT_CONTEXT,
        )
    }
}

#[test]
fn segments_valid_inputs_pass() {
    assert_eq!(Segments::new().run(), Ok(()));
    let mut s = Segments::new();
    s.start = None;
    assert_eq!(s.run(), Ok(()));
    // Shape pairing is not an immediate rule: S != P and n != P pass validation.
    let mut s = Segments::new();
    s.lengths = shape(s.lengths, &[5]);
    s.rows = shape(s.rows, &[2]);
    assert_eq!(s.run(), Ok(()));
    // An empty table and empty vectors pass too (rules 4-10 are deferred).
    let mut s = Segments::new();
    s.table = shape(s.table, &[0, 0]);
    s.rows = shape(s.rows, &[0]);
    s.lengths = shape(s.lengths, &[0]);
    assert_eq!(s.run(), Ok(()));
    for dt in [DType::I32, DType::I64] {
        let mut s = Segments::new();
        s.table = dtype(s.table, dt);
        s.rows = dtype(s.rows, dt);
        s.start(|a| dtype(a, dt));
        s.lengths = dtype(s.lengths, dt);
        assert_eq!(s.run(), Ok(()));
    }
}

#[test]
fn segments_rule1_ranks_in_argument_order() {
    let ctx = SEGMENT_CONTEXT;
    let mut s = Segments::new();
    s.table = shape(s.table, &[4, 6, 1]);
    s.rows = shape(s.rows, &[3, 1]);
    let err = s.run().unwrap_err();
    assert_eq!(
        err,
        Error::Not2d {
            context: ctx.into(),
            name: "req_to_token",
            shape: dims(&[4, 6, 1])
        }
    );
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather req_to_token must be 2-D, got shape [4, 6, 1]."
    );
    s.table = shape(s.table, &[4, 6]);
    s.start(|a| shape(a, &[3, 1]));
    s.lengths = shape(s.lengths, &[]);
    assert_eq!(
        s.run(),
        Err(Error::Not1d {
            context: ctx.into(),
            name: "req_pool_indices",
            shape: dims(&[3, 1])
        })
    );
    s.rows = shape(s.rows, &[3]);
    assert_eq!(
        s.run(),
        Err(Error::Not1d {
            context: ctx.into(),
            name: "start",
            shape: dims(&[3, 1])
        })
    );
    s.start(|a| shape(a, &[3]));
    assert_eq!(
        s.run(),
        Err(Error::Not1d {
            context: ctx.into(),
            name: "lengths",
            shape: dims(&[])
        })
    );
}

#[test]
fn segments_rule1_beats_dtype_and_device() {
    let mut s = Segments::new();
    s.table = on(dtype(s.table, DType::F32), OTHER);
    s.lengths = shape(s.lengths, &[3, 1]);
    assert!(matches!(
        s.run(),
        Err(Error::Not1d {
            name: "lengths",
            ..
        })
    ));
}

#[test]
fn segments_rule2_dtypes_in_argument_order() {
    let ctx = SEGMENT_CONTEXT;
    let mut s = Segments::new();
    s.lengths = dtype(s.lengths, DType::U8);
    s.start(|a| dtype(a, DType::I16));
    s.rows = dtype(s.rows, BOOL);
    s.table = dtype(s.table, DType::F16);
    let expect = |name: &'static str, got: &str| Error::DtypeMismatch {
        context: ctx.into(),
        name,
        got: got.into(),
        accepted: INT_DTYPES,
    };
    assert_eq!(s.run(), Err(expect("req_to_token", "f16")));
    s.table = dtype(s.table, DType::I32);
    assert!(matches!(
        s.run(),
        Err(Error::DtypeMismatch {
            name: "req_pool_indices",
            ..
        })
    ));
    s.rows = dtype(s.rows, DType::I32);
    assert_eq!(s.run(), Err(expect("start", "int16")));
    s.start(|a| dtype(a, DType::I64));
    let err = s.run().unwrap_err();
    assert_eq!(err, expect("lengths", "uint8"));
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather lengths has dtype uint8; accepted: int32, int64."
    );
}

#[test]
fn segments_rule2_beats_device() {
    let mut s = Segments::new();
    s.rows = on(s.rows, OTHER);
    s.lengths = dtype(s.lengths, DType::U32);
    assert!(matches!(
        s.run(),
        Err(Error::DtypeMismatch {
            name: "lengths",
            ..
        })
    ));
}

#[test]
fn segments_rule3_devices_in_argument_order() {
    let ctx = SEGMENT_CONTEXT;
    for name in ["req_pool_indices", "start", "lengths"] {
        let mut s = Segments::new();
        match name {
            "req_pool_indices" => s.rows = on(s.rows, OTHER),
            "start" => s.start(|a| on(a, OTHER)),
            _ => s.lengths = on(s.lengths, OTHER),
        }
        let err = s.run().unwrap_err();
        assert_eq!(
            err,
            Error::DeviceMismatch {
                context: ctx.into(),
                name,
                device: "1".into(),
                expected: "0".into()
            }
        );
        assert_eq!(
            err.to_string(),
            format!("{ctx} {name} is on 1, expected 0.")
        );
    }
    let mut s = Segments::new();
    s.start(|a| on(a, 2));
    s.lengths = on(s.lengths, 3);
    assert!(matches!(
        s.run(),
        Err(Error::DeviceMismatch { name: "start", .. })
    ));
    let mut s = Segments::new();
    s.start = None;
    s.table = on(s.table, 5);
    assert_eq!(
        s.run(),
        Err(Error::DeviceMismatch {
            context: ctx.into(),
            name: "req_pool_indices",
            device: "0".into(),
            expected: "5".into(),
        })
    );
}

// ---------------------------------------------------------------------------------------------
// plan: host rules 1-11 and allocation
// ---------------------------------------------------------------------------------------------

/// A valid plan call: bs = 3, table 4x8, V = 16, K = 4, no LUT, no pool.
fn plan_args() -> PlanArgs<u8> {
    PlanArgs {
        req_pool_indices: arg("req_pool_indices", &[3], DType::I64),
        prefix_lens: arg("prefix_lens", &[3], DType::I64),
        extend_seq_lens: arg("extend_seq_lens", &[3], DType::I64),
        req_to_token: arg("req_to_token", &[4, 8], DType::I32),
        req_to_token_row_stride: 8,
        swa_window_size: 0,
        full_to_swa: None,
        expected_tokens: None,
        valid_lens: None,
        verify_capacity: 16,
        plan_verify_capacity: 16,
        write_req_capacity: 4,
        plan_device: DEV,
    }
}

fn with_lut(mut args: PlanArgs<u8>) -> PlanArgs<u8> {
    args.full_to_swa = Some(arg("full_to_swa_index_mapping", &[40], DType::I64));
    args
}

fn with_pool(mut args: PlanArgs<u8>) -> PlanArgs<u8> {
    args.expected_tokens = Some(arg("req_to_verify_expected_tokens", &[4, 6], DType::I32));
    args.valid_lens = Some(arg(
        "req_to_verify_expected_tokens_valid_lens",
        &[3],
        DType::I64,
    ));
    args
}

#[test]
fn plan_valid_inputs_pass() {
    assert_eq!(plan(&plan_args()), Ok(()));
    assert_eq!(plan(&with_pool(with_lut(plan_args()))), Ok(()));
    let mut args = with_lut(plan_args());
    args.swa_window_size = 4;
    assert_eq!(plan(&args), Ok(()));
    // Negative W is "no window": no LUT needed.
    let mut args = plan_args();
    args.swa_window_size = -3;
    assert_eq!(plan(&args), Ok(()));
    // bs == K and bs == 0 pass.
    let mut args = plan_args();
    args.write_req_capacity = 3;
    assert_eq!(plan(&args), Ok(()));
    let mut args = plan_args();
    for a in [
        &mut args.req_pool_indices,
        &mut args.prefix_lens,
        &mut args.extend_seq_lens,
    ] {
        a.shape = vec![0];
    }
    assert_eq!(plan(&args), Ok(()));
    // Mixed i32/i64 inputs.
    let mut args = with_pool(with_lut(plan_args()));
    args.req_pool_indices.dtype = DType::I32;
    args.req_to_token.dtype = DType::I64;
    args.full_to_swa.as_mut().unwrap().dtype = DType::I32;
    args.expected_tokens.as_mut().unwrap().dtype = DType::I64;
    args.valid_lens.as_mut().unwrap().dtype = DType::I32;
    assert_eq!(plan(&args), Ok(()));
}

#[test]
fn plan_rule1_missing_lut() {
    let mut args = plan_args();
    args.swa_window_size = 1;
    let err = plan(&args).unwrap_err();
    assert_eq!(err, Error::MissingLutForSwa { window: 1 });
    assert_eq!(err.kind(), "missing_lut_for_swa");
    assert!(err.to_string().starts_with("kv-canary: "), "{err}");
    assert!(err.to_string().contains("swa_window_size 1"), "{err}");
    args.swa_window_size = i32::MAX;
    assert_eq!(
        plan(&args),
        Err(Error::MissingLutForSwa { window: i32::MAX })
    );
}

#[test]
fn plan_rule1_beats_every_later_rule() {
    // Missing LUT beats the capacity mismatch and every other host rule.
    let mut args = plan_args();
    args.swa_window_size = 8;
    args.verify_capacity = 99;
    args.expected_tokens = Some(arg("req_to_verify_expected_tokens", &[4], DType::F32));
    args.prefix_lens = on(shape(args.prefix_lens, &[5, 5]), OTHER);
    args.req_to_token_row_stride = 0;
    args.write_req_capacity = 1;
    assert_eq!(plan(&args), Err(Error::MissingLutForSwa { window: 8 }));
}

#[test]
fn plan_rule2_capacity_mismatch() {
    let mut args = plan_args();
    args.verify_capacity = 15;
    let err = plan(&args).unwrap_err();
    assert_eq!(
        err,
        Error::CapacityMismatch {
            argument: 15,
            plan: 16
        }
    );
    assert_eq!(err.kind(), "capacity_mismatch");
    assert!(err.to_string().starts_with("kv-canary: "));
    assert!(
        err.to_string().contains("15") && err.to_string().contains("16"),
        "{err}"
    );
    // Capacity mismatch beats the pool rules.
    args.expected_tokens = Some(arg("req_to_verify_expected_tokens", &[4, 6], DType::I32));
    assert_eq!(
        plan(&args),
        Err(Error::CapacityMismatch {
            argument: 15,
            plan: 16
        })
    );
}

#[test]
fn plan_rules3_4_pool_pairing() {
    let mut args = plan_args();
    args.expected_tokens = Some(arg("req_to_verify_expected_tokens", &[4, 6], DType::I32));
    let err = plan(&args).unwrap_err();
    assert_eq!(err, Error::MissingValidLens);
    assert_eq!(err.kind(), "missing_valid_lens");
    assert!(err.to_string().starts_with("kv-canary: "));
    // Missing valid_lens beats device/dtype/rank problems of the pool itself.
    args.expected_tokens = Some(on(
        arg("req_to_verify_expected_tokens", &[4], DType::F32),
        OTHER,
    ));
    assert_eq!(plan(&args), Err(Error::MissingValidLens));

    let mut args = plan_args();
    args.valid_lens = Some(arg(
        "req_to_verify_expected_tokens_valid_lens",
        &[3],
        DType::I64,
    ));
    let err = plan(&args).unwrap_err();
    assert_eq!(err, Error::ValidLensWithoutPool);
    assert_eq!(err.kind(), "valid_lens_without_pool");
    assert!(err.to_string().starts_with("kv-canary: "));
    // ... and beats rule 5+ problems.
    args.req_pool_indices = on(args.req_pool_indices, OTHER);
    assert_eq!(plan(&args), Err(Error::ValidLensWithoutPool));
}

fn plan_tensor_mut<'a>(args: &'a mut PlanArgs<u8>, name: &str) -> &'a mut Arg<u8> {
    match name {
        "req_pool_indices" => &mut args.req_pool_indices,
        "prefix_lens" => &mut args.prefix_lens,
        "extend_seq_lens" => &mut args.extend_seq_lens,
        "req_to_token" => &mut args.req_to_token,
        "full_to_swa_index_mapping" => args.full_to_swa.as_mut().unwrap(),
        "req_to_verify_expected_tokens" => args.expected_tokens.as_mut().unwrap(),
        "req_to_verify_expected_tokens_valid_lens" => args.valid_lens.as_mut().unwrap(),
        other => panic!("no tensor {other}"),
    }
}

const PLAN_TENSORS: [&str; 7] = [
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "req_to_token",
    "full_to_swa_index_mapping",
    "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens",
];

#[test]
fn plan_rule5_device_of_each_tensor() {
    for name in PLAN_TENSORS {
        let mut args = with_pool(with_lut(plan_args()));
        plan_tensor_mut(&mut args, name).device = OTHER;
        let err = plan(&args).unwrap_err();
        assert_eq!(
            err,
            Error::DeviceMismatch {
                context: PLAN_CONTEXT.into(),
                name,
                device: "1".into(),
                expected: "0".into(),
            }
        );
        assert_eq!(err.kind(), "device_mismatch");
        assert_eq!(
            err.to_string(),
            format!("kv-canary: {name} is on 1, expected 0.")
        );
    }
    // The reference device is the plans', even when every tensor agrees with the others.
    let mut args = with_pool(with_lut(plan_args()));
    args.plan_device = 9;
    assert_eq!(
        plan(&args),
        Err(Error::DeviceMismatch {
            context: PLAN_CONTEXT.into(),
            name: "req_pool_indices",
            device: "0".into(),
            expected: "9".into(),
        })
    );
}

#[test]
fn plan_rule5_argument_order() {
    // Within the rule, the first tensor in argument order is named.
    for (k, &first) in PLAN_TENSORS.iter().enumerate() {
        let mut args = with_pool(with_lut(plan_args()));
        for &later in &PLAN_TENSORS[k..] {
            plan_tensor_mut(&mut args, later).device = OTHER;
        }
        assert!(
            matches!(plan(&args), Err(Error::DeviceMismatch { name, .. }) if name == first),
            "{first}"
        );
    }
}

#[test]
fn plan_rule5_device_beats_dtype() {
    // A later tensor on the wrong device beats an earlier tensor with the wrong dtype.
    let mut args = with_pool(with_lut(plan_args()));
    args.req_pool_indices.dtype = DType::F32;
    args.valid_lens.as_mut().unwrap().device = OTHER;
    assert!(matches!(
        plan(&args),
        Err(Error::DeviceMismatch {
            name: "req_to_verify_expected_tokens_valid_lens",
            ..
        })
    ));
}

#[test]
fn plan_rule6_dtype_of_each_tensor() {
    for name in PLAN_TENSORS {
        for (bad, got) in [
            (DType::U8, "uint8"),
            (DType::I16, "int16"),
            (DType::F32, "f32"),
        ] {
            let mut args = with_pool(with_lut(plan_args()));
            plan_tensor_mut(&mut args, name).dtype = bad;
            let err = plan(&args).unwrap_err();
            assert_eq!(
                err,
                Error::DtypeMismatch {
                    context: PLAN_CONTEXT.into(),
                    name,
                    got: got.into(),
                    accepted: INT_DTYPES,
                },
                "{name}"
            );
            assert_eq!(err.kind(), "dtype_mismatch");
            assert_eq!(
                err.to_string(),
                format!("kv-canary: {name} has dtype {got}; accepted: int32, int64.")
            );
        }
    }
}

#[test]
fn plan_rule6_argument_order_and_beats_rank() {
    for (k, &first) in PLAN_TENSORS.iter().enumerate() {
        let mut args = with_pool(with_lut(plan_args()));
        for &later in &PLAN_TENSORS[k..] {
            plan_tensor_mut(&mut args, later).dtype = DType::U32;
        }
        assert!(
            matches!(plan(&args), Err(Error::DtypeMismatch { name, .. }) if name == first),
            "{first}"
        );
    }
    // A later dtype error beats an earlier rank error.
    let mut args = with_pool(with_lut(plan_args()));
    args.req_pool_indices.shape = vec![3, 1];
    args.valid_lens.as_mut().unwrap().dtype = DType::Bool(BoolStore::Native);
    assert!(matches!(
        plan(&args),
        Err(Error::DtypeMismatch {
            name: "req_to_verify_expected_tokens_valid_lens",
            ..
        })
    ));
}

#[test]
fn plan_rule7_ranks() {
    let ranks = [
        ("req_pool_indices", 1),
        ("prefix_lens", 1),
        ("extend_seq_lens", 1),
        ("req_to_token", 2),
        ("full_to_swa_index_mapping", 1),
        ("req_to_verify_expected_tokens", 2),
        ("req_to_verify_expected_tokens_valid_lens", 1),
    ];
    for (name, rank) in ranks {
        let bad_shapes: [&[usize]; 3] = if rank == 1 {
            [&[3, 1], &[], &[1, 1, 3]]
        } else {
            [&[32], &[], &[4, 8, 1]]
        };
        for bad in bad_shapes {
            let mut args = with_pool(with_lut(plan_args()));
            plan_tensor_mut(&mut args, name).shape = bad.to_vec();
            let context = PLAN_CONTEXT.to_string();
            let expected = if rank == 1 {
                Error::Not1d {
                    context,
                    name,
                    shape: dims(bad),
                }
            } else {
                Error::Not2d {
                    context,
                    name,
                    shape: dims(bad),
                }
            };
            let err = plan(&args).unwrap_err();
            assert_eq!(err, expected, "{name} {bad:?}");
            assert_eq!(
                err.to_string(),
                format!("kv-canary: {name} must be {rank}-D, got shape {:?}.", bad)
            );
        }
    }
}

#[test]
fn plan_rule7_argument_order_and_beats_length() {
    let mut args = with_pool(with_lut(plan_args()));
    args.prefix_lens.shape = vec![3, 1];
    args.req_to_token.shape = vec![32];
    assert!(matches!(
        plan(&args),
        Err(Error::Not1d {
            name: "prefix_lens",
            ..
        })
    ));
    let mut args = with_pool(with_lut(plan_args()));
    args.req_to_token.shape = vec![4, 8, 1];
    args.full_to_swa.as_mut().unwrap().shape = vec![40, 1];
    assert!(matches!(
        plan(&args),
        Err(Error::Not2d {
            name: "req_to_token",
            ..
        })
    ));
    let mut args = with_pool(with_lut(plan_args()));
    args.expected_tokens.as_mut().unwrap().shape = vec![24];
    args.valid_lens.as_mut().unwrap().shape = vec![3, 1];
    assert!(matches!(
        plan(&args),
        Err(Error::Not2d {
            name: "req_to_verify_expected_tokens",
            ..
        })
    ));
    // A later rank error beats an earlier length error.
    let mut args = with_pool(with_lut(plan_args()));
    args.prefix_lens.shape = vec![7];
    args.valid_lens.as_mut().unwrap().shape = vec![3, 1];
    assert!(matches!(
        plan(&args),
        Err(Error::Not1d {
            name: "req_to_verify_expected_tokens_valid_lens",
            ..
        })
    ));
}

#[test]
fn plan_rule8_lengths() {
    for name in [
        "prefix_lens",
        "extend_seq_lens",
        "req_to_verify_expected_tokens_valid_lens",
    ] {
        for len in [2, 4, 0] {
            let mut args = with_pool(with_lut(plan_args()));
            plan_tensor_mut(&mut args, name).shape = vec![len];
            let err = plan(&args).unwrap_err();
            assert_eq!(err, Error::LengthMismatch { name, len, bs: 3 });
            assert_eq!(err.kind(), "length_mismatch");
            assert!(err.to_string().starts_with("kv-canary: "), "{err}");
            assert!(err.to_string().contains(name), "{err}");
        }
    }
    // bs is req_pool_indices' length: changing it alone names prefix_lens.
    let mut args = plan_args();
    args.req_pool_indices.shape = vec![5];
    assert_eq!(
        plan(&args),
        Err(Error::LengthMismatch {
            name: "prefix_lens",
            len: 3,
            bs: 5
        })
    );
    // Argument order.
    let mut args = with_pool(plan_args());
    args.extend_seq_lens.shape = vec![1];
    args.valid_lens.as_mut().unwrap().shape = vec![2];
    assert_eq!(
        plan(&args),
        Err(Error::LengthMismatch {
            name: "extend_seq_lens",
            len: 1,
            bs: 3
        })
    );
}

#[test]
fn plan_rule8_beats_empty_lut() {
    let mut args = with_lut(plan_args());
    args.full_to_swa.as_mut().unwrap().shape = vec![0];
    args.extend_seq_lens.shape = vec![2];
    assert_eq!(
        plan(&args),
        Err(Error::LengthMismatch {
            name: "extend_seq_lens",
            len: 2,
            bs: 3
        })
    );
}

#[test]
fn plan_rule9_empty_lut() {
    // Even with W <= 0 (no reads).
    for window in [0, -1, 4] {
        let mut args = with_lut(plan_args());
        args.swa_window_size = window;
        args.full_to_swa.as_mut().unwrap().shape = vec![0];
        let err = plan(&args).unwrap_err();
        assert_eq!(err, Error::EmptyLut, "W={window}");
        assert_eq!(err.kind(), "empty_lut");
        assert!(err.to_string().starts_with("kv-canary: "));
    }
    // A one-entry LUT is fine.
    let mut args = with_lut(plan_args());
    args.full_to_swa.as_mut().unwrap().shape = vec![1];
    assert_eq!(plan(&args), Ok(()));
}

#[test]
fn plan_rule9_beats_bs_exceeds_capacity() {
    let mut args = with_lut(plan_args());
    args.full_to_swa.as_mut().unwrap().shape = vec![0];
    args.write_req_capacity = 1;
    assert_eq!(plan(&args), Err(Error::EmptyLut));
}

#[test]
fn plan_rule10_bs_exceeds_write_capacity() {
    let mut args = plan_args();
    args.write_req_capacity = 2;
    let err = plan(&args).unwrap_err();
    assert_eq!(err, Error::BsExceedsWriteCapacity { bs: 3, capacity: 2 });
    assert_eq!(err.kind(), "bs_exceeds_write_capacity");
    assert!(err.to_string().starts_with("kv-canary: "));
    // Beats the stride rule.
    args.req_to_token_row_stride = 0;
    assert_eq!(
        plan(&args),
        Err(Error::BsExceedsWriteCapacity { bs: 3, capacity: 2 })
    );
    // A large batch with a large enough capacity passes (no cap at 4096).
    let mut args = plan_args();
    for a in [
        &mut args.req_pool_indices,
        &mut args.prefix_lens,
        &mut args.extend_seq_lens,
    ] {
        a.shape = vec![4097];
    }
    args.write_req_capacity = 4097;
    assert_eq!(plan(&args), Ok(()));
    args.write_req_capacity = 4096;
    assert_eq!(
        plan(&args),
        Err(Error::BsExceedsWriteCapacity {
            bs: 4097,
            capacity: 4096
        })
    );
}

#[test]
fn plan_rule11_stride() {
    let mut args = plan_args();
    args.req_to_token_row_stride = 0;
    let err = plan(&args).unwrap_err();
    assert_eq!(err, Error::ReqToTokenStride { stride: 0 });
    assert_eq!(err.kind(), "req_to_token_stride");
    assert_eq!(
        err.to_string(),
        "kv-canary: req_to_token_stride0 must be positive, got 0"
    );
    args.req_to_token_row_stride = -8;
    assert_eq!(plan(&args), Err(Error::ReqToTokenStride { stride: -8 }));
    // A single row is not exempt.
    args.req_to_token.shape = vec![1, 8];
    args.req_to_token_row_stride = 0;
    assert_eq!(plan(&args), Err(Error::ReqToTokenStride { stride: 0 }));
    // A positive stride other than cols (a padded or sliced view) is accepted.
    args.req_to_token_row_stride = 1;
    assert_eq!(plan(&args), Ok(()));
    args.req_to_token_row_stride = 100;
    assert_eq!(plan(&args), Ok(()));
}

#[test]
fn plan_rule11_empty_table_exempt() {
    for table in [&[0, 8][..], &[4, 0][..], &[0, 0][..]] {
        for stride in [0, -1] {
            let mut args = plan_args();
            args.req_to_token.shape = table.to_vec();
            args.req_to_token_row_stride = stride;
            assert_eq!(plan(&args), Ok(()), "{table:?} stride {stride}");
        }
    }
}

#[test]
fn allocation_rules() {
    assert_eq!(
        allocation("verify_capacity", 0),
        Err(Error::NonPositiveVerifyCapacity { value: 0 })
    );
    assert_eq!(
        allocation("write_req_capacity", 0),
        Err(Error::NonPositiveWriteCapacity { value: 0 })
    );
    assert_eq!(
        allocation("verify_capacity", 0).unwrap_err().kind(),
        "non_positive_verify_capacity"
    );
    assert_eq!(
        allocation("write_req_capacity", 0).unwrap_err().kind(),
        "non_positive_write_capacity"
    );
    for field in ["verify_capacity", "write_req_capacity"] {
        assert_eq!(allocation(field, 1), Ok(()));
        assert_eq!(allocation(field, (1 << 31) - 1), Ok(()));
        assert_eq!(MAX_CAPACITY, (1 << 31) - 1);
        for value in [1usize << 31, (1 << 31) + 1, usize::MAX] {
            let err = allocation(field, value).unwrap_err();
            assert_eq!(err, Error::CapacityTooLarge { field, value });
            assert_eq!(err.kind(), "capacity_too_large");
            assert_eq!(
                err.to_string(),
                format!("kv-canary: {field} {value} exceeds 2^31-1")
            );
        }
    }
    assert!(
        allocation("verify_capacity", 0)
            .unwrap_err()
            .to_string()
            .starts_with("kv-canary: ")
    );
}

// ---------------------------------------------------------------------------------------------
// Helpers and the searchable messages
// ---------------------------------------------------------------------------------------------

#[test]
fn dtype_names() {
    let names = [
        (DType::I64, "int64"),
        (DType::I32, "int32"),
        (DType::I16, "int16"),
        (DType::I8, "int8"),
        (DType::U64, "uint64"),
        (DType::U32, "uint32"),
        (DType::U16, "uint16"),
        (DType::U8, "uint8"),
        (DType::F32, "f32"),
    ];
    for (dtype, name) in names {
        assert_eq!(dtype_name(dtype), name);
    }
    assert_eq!(INT_DTYPES, "int32, int64");
}

#[test]
fn arg_dim_is_zero_past_rank() {
    let a = arg("x", &[3, 5], DType::I32);
    assert_eq!((a.dim(0), a.dim(1), a.dim(2)), (3, 5, 0));
}

#[test]
fn searchable_messages() {
    let err = Error::EmptyTableNonemptyMask {
        context: CTX.into(),
    };
    assert_eq!(
        err.to_string(),
        "DFLASH target hidden KV append req_to_token table is empty but gather mask is non-empty."
    );
    assert_eq!(err.kind(), "empty_table_nonempty_mask");
    let err = Error::EmptyTableNonemptyMask {
        context: SEGMENT_CONTEXT.into(),
    };
    assert_eq!(
        err.to_string(),
        "DFLASH req_to_token segment gather req_to_token table is empty but gather mask is non-empty."
    );

    let mut args = plan_args();
    args.req_to_token_row_stride = 0;
    assert_eq!(
        plan(&args).unwrap_err().to_string(),
        "kv-canary: req_to_token_stride0 must be positive, got 0"
    );

    let err = Error::SwaSlotOutsideLut {
        slot: 70,
        lut_len: 65,
        request: 2,
        position: 5,
    };
    let message = err.to_string();
    assert!(
        message
            .starts_with("kv-canary: SWA slot 70 is outside full_to_swa_index_mapping length 65"),
        "{message}"
    );
    assert_eq!(
        message,
        "kv-canary: SWA slot 70 is outside full_to_swa_index_mapping length 65 (request 2, position 5)"
    );
    assert_eq!(err.kind(), "swa_slot_outside_lut");
}

// ---------------------------------------------------------------------------------------------
// Slots (spec slots.md)
// ---------------------------------------------------------------------------------------------

mod slots {
    use burn_core::tensor::DType;

    use super::{DEV, OTHER, arg, on};
    use crate::error::{ASSIGN_CONTEXT, Dims, Error, STORE_CONTEXT};
    use crate::validate::{INT_DTYPES, segment_assign, store_kv};

    fn assign(args: [(&[usize], DType); 5]) -> Result<(), Error> {
        let names = [
            "req_to_token",
            "req_pool_indices",
            "start",
            "lengths",
            "out_cache_loc",
        ];
        let a: Vec<_> = names
            .iter()
            .zip(args)
            .map(|(name, (shape, dtype))| arg(name, shape, dtype))
            .collect();
        segment_assign(&a[0], &a[1], &a[2], &a[3], &a[4])
    }

    const I: DType = DType::I64;

    #[test]
    fn assign_host_rules_in_order() {
        let ok: [(&[usize], DType); 5] = [
            (&[4, 6], DType::I32),
            (&[2], I),
            (&[2], I),
            (&[2], I),
            (&[5], DType::I32),
        ];
        assert_eq!(assign(ok), Ok(()));
        let mut bad = ok;
        bad[0] = (&[24], DType::F32);
        assert_eq!(
            assign(bad),
            Err(Error::Not2d {
                context: ASSIGN_CONTEXT.into(),
                name: "req_to_token",
                shape: Dims(vec![24]),
            })
        );
        let mut bad = ok;
        bad[3] = (&[2, 1], DType::F32);
        assert_eq!(assign(bad).unwrap_err().kind(), "not_1d");
        let mut bad = ok;
        bad[4] = (&[5], DType::U32);
        assert_eq!(
            assign(bad),
            Err(Error::DtypeMismatch {
                context: ASSIGN_CONTEXT.into(),
                name: "out_cache_loc",
                got: "uint32".into(),
                accepted: INT_DTYPES,
            })
        );
        let mut bad = ok;
        bad[2] = (&[3], I);
        assert_eq!(
            assign(bad),
            Err(Error::SegmentLengthMismatch {
                context: ASSIGN_CONTEXT.into(),
                name: "start",
                len: 3,
                bs: 2,
            })
        );
        // A dtype error before a length mismatch.
        let mut bad = ok;
        bad[2] = (&[3], DType::I16);
        assert_eq!(assign(bad).unwrap_err().kind(), "dtype_mismatch");
        let a = arg("req_to_token", &[4, 6], I);
        let v = arg("req_pool_indices", &[1], I);
        let far = on(arg("lengths", &[1], I), OTHER);
        assert_eq!(
            segment_assign(&a, &v, &v, &far, &arg("out_cache_loc", &[0], I)),
            Err(Error::DeviceMismatch {
                context: ASSIGN_CONTEXT.into(),
                name: "lengths",
                device: format!("{OTHER:?}"),
                expected: format!("{DEV:?}"),
            })
        );
    }

    #[test]
    fn store_host_rules_in_order() {
        let cache = arg("cache", &[16, 2, 4], DType::F16);
        let loc = arg("loc", &[3], DType::I32);
        let values = arg("values", &[3, 2, 4], DType::F16);
        assert_eq!(store_kv(&cache, &loc, &values, 16), Ok(()));
        assert_eq!(
            store_kv(&cache, &loc, &arg("values", &[3, 8], DType::F16), 16),
            Err(Error::ValueShapeMismatch {
                context: STORE_CONTEXT.into(),
                values: Dims(vec![3, 8]),
                expected: Dims(vec![3, 2, 4]),
                cache: Dims(vec![16, 2, 4]),
            })
        );
        assert_eq!(
            store_kv(&cache, &arg("loc", &[3, 1], I), &values, 16)
                .unwrap_err()
                .kind(),
            "not_1d"
        );
        assert_eq!(
            store_kv(&cache, &arg("loc", &[3], DType::F32), &values, 16),
            Err(Error::DtypeMismatch {
                context: STORE_CONTEXT.into(),
                name: "loc",
                got: "f32".into(),
                accepted: INT_DTYPES,
            })
        );
        assert_eq!(
            store_kv(&cache, &loc, &arg("values", &[3, 2, 4], DType::BF16), 16),
            Err(Error::ValueDtypeMismatch {
                context: STORE_CONTEXT.into(),
                values: "bf16".into(),
                cache: "f16".into(),
            })
        );
        let bools = arg("cache", &[16, 2, 4], super::BOOL);
        assert_eq!(
            store_kv(&bools, &loc, &arg("values", &[3, 2, 4], super::BOOL), 16)
                .unwrap_err()
                .kind(),
            "dtype_mismatch"
        );
        assert_eq!(
            store_kv(&on(cache.clone(), OTHER), &loc, &values, 16)
                .unwrap_err()
                .kind(),
            "device_mismatch"
        );
        assert_eq!(
            store_kv(&cache, &loc, &values, 15),
            Err(Error::StoreCapacity {
                context: STORE_CONTEXT.into(),
                slots: 16,
                capacity: 15,
            })
        );
        // Any int dtype is a cache dtype (raw bytes), and a 1-D cache has rows of one element.
        let bytes = arg("cache", &[16], DType::U8);
        assert_eq!(
            store_kv(&bytes, &loc, &arg("values", &[3], DType::U8), 16),
            Ok(())
        );
    }
}
