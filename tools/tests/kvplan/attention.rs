//! `paged_attention` and its key runs' check against the f64 reference: random shapes, heads and
//! runs; bit-identical rows whatever else is in the launch; every error.

use burn_core::backend::tensor::FloatTensor;
use burn_core::backend::{TensorData, read_sync};
use burn_core::tensor::{DType, Shape, Slice};
use kvplan::backend::{KvRows, StoreTargets};
use kvplan::error::Dims;
use kvplan::generic::paged_attention;
use kvplan::ops::KeyRuns;
use kvplan::ops::KvStore;
use kvplan::reference::{self, Heads};
use kvplan::{Error, KvPlanBackend};

use crate::common::{Rng, half, list};
use crate::errors::INT_DTYPES;

/// One attention's inputs.
#[derive(Debug, Clone)]
struct Case {
    heads: Heads,
    tokens: usize,
    pool_rows: usize,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    slots: Vec<i64>,
    starts: Vec<i64>,
    counts: Vec<i64>,
}

impl Case {
    fn random(
        rng: &mut Rng,
        heads: Heads,
        tokens: usize,
        pool_rows: usize,
        longest: usize,
    ) -> Self {
        let Heads {
            heads: h,
            kv_heads,
            head_dim,
        } = heads;
        let mut floats = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| rng.range(-256, 256) as f64 / 128.0)
                .collect()
        };
        let q = floats(tokens * h * head_dim);
        let k = floats(pool_rows * kv_heads * head_dim);
        let v = floats(pool_rows * kv_heads * head_dim);
        let slots_len = rng.urange(longest, 2 * longest + 3);
        let slots: Vec<i64> = (0..slots_len)
            .map(|_| rng.below(pool_rows as u64) as i64)
            .collect();
        let (mut starts, mut counts) = (Vec::new(), Vec::new());
        for _ in 0..tokens {
            let count = rng.urange(0, longest);
            starts.push(rng.urange(0, slots_len - count) as i64);
            counts.push(count as i64);
        }
        Self {
            heads,
            tokens,
            pool_rows,
            q,
            k,
            v,
            slots,
            starts,
            counts,
        }
    }

    fn reference(&self) -> Result<Vec<f64>, Error> {
        reference::paged_attention(
            &self.q,
            &self.k,
            &self.v,
            self.heads,
            &self.slots,
            &self.starts,
            &self.counts,
            "paged_attention:",
        )
    }

    fn q_cols(&self) -> usize {
        self.heads.heads * self.heads.head_dim
    }

    fn kv_cols(&self) -> usize {
        self.heads.kv_heads * self.heads.head_dim
    }

    /// Runs the check and the attention on `B`: the output values and the check's outcome.
    /// `strided_q` passes q as a column range of a wider tensor.
    fn run<B: KvPlanBackend>(
        &self,
        device: &B::Device,
        [float, int]: [DType; 2],
        strided_q: bool,
    ) -> (Vec<f64>, Result<usize, Error>) {
        let q = if strided_q {
            let cols = self.q_cols();
            let mut wide = vec![f64::NAN; self.tokens * (cols + 3)];
            for t in 0..self.tokens {
                wide[t * (cols + 3) + 1..][..cols].copy_from_slice(&self.q[t * cols..][..cols]);
            }
            let wide = floats::<B>(&wide, [self.tokens, cols + 3], float, device);
            B::float_slice(
                wide,
                &[Slice::from(0..self.tokens), Slice::from(1..cols + 1)],
            )
        } else {
            floats::<B>(&self.q, [self.tokens, self.q_cols()], float, device)
        };
        let cols = self.kv_cols();
        let kv_pool = join(&self.k, &self.v, cols);
        let kv_pool = floats::<B>(&kv_pool, [self.pool_rows, 2 * cols], float, device);
        let keys = KeyRuns::<B>::check_primitives(
            [
                list::<B>(&self.slots, int, device),
                list::<B>(&self.starts, int, device),
                list::<B>(&self.counts, int, device),
            ],
            self.pool_rows,
        )
        .expect("host rules hold");
        let out =
            paged_attention::<B>(q, kv_pool, &keys, self.heads.heads).expect("host rules hold");
        (float_values::<B>(out), keys.status().check())
    }
}

/// Rows of `cols` K values and rows of as many V values side by side: each row K, then V.
fn join(k: &[f64], v: &[f64], cols: usize) -> Vec<f64> {
    k.chunks(cols)
        .zip(v.chunks(cols))
        .flat_map(|(k, v)| k.iter().chain(v).copied())
        .collect()
}

fn floats<B: KvPlanBackend>(
    values: &[f64],
    shape: [usize; 2],
    float: DType,
    device: &B::Device,
) -> FloatTensor<B> {
    let data = TensorData::new(values.to_vec(), shape).convert_dtype(float);
    B::float_from_data(data, device)
}

fn float_values<B: KvPlanBackend>(tensor: FloatTensor<B>) -> Vec<f64> {
    let data = read_sync(B::float_into_data(tensor)).expect("a float read-back");
    data.convert::<f64>()
        .try_to_vec::<f64>()
        .expect("f64 values")
}

/// `got` within f32 rounding of the reference, element by element; for a half-precision
/// output, within its one rounding of an f32 sum (a sum kept in bf16 misses this by far).
#[track_caller]
fn assert_close(got: &[f64], expected: &[f64], float: DType, what: &str) {
    let relative = match float {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-5,
    };
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= 1e-5 + relative * e.abs(),
            "{what}: element {i}: {g} against the reference's {e}"
        );
    }
}

/// Random heads (GQA groups, head widths across the cube's unit counts and K tiles), runs across key
/// chunks, empty runs, i32 and i64 runs, a strided q.
pub fn random_cases<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0xA77E);
    let shapes = [
        (1, 1, 8),
        (2, 1, 16),
        (3, 3, 32),
        (9, 3, 64),
        (4, 2, 80),
        (2, 2, 128),
        (2, 1, 256),
    ];
    for (case_index, &(heads, kv_heads, head_dim)) in shapes.iter().cycle().take(21).enumerate() {
        let layout = Heads {
            heads,
            kv_heads,
            head_dim,
        };
        let tokens = rng.urange(1, 24);
        let pool_rows = rng.urange(1, 300);
        // Runs of one chunk, a few, and more chunks than the attention's parts (several a part).
        let longest = rng.pick(&[1, 5, 63, 64, 65, 200, 1100]);
        let case = Case::random(&mut rng, layout, tokens, pool_rows, longest);
        let what = format!("case {case_index}: {layout:?}, {tokens} tokens, runs <= {longest}");
        let expected = case.reference().expect("valid runs");
        // Every third case in half precision (its inputs, multiples of 1/128 below 2, exact).
        let float = if case_index % 3 == 2 {
            half::<B>(device)
        } else {
            DType::F32
        };
        let (got, outcome) = case.run::<B>(device, [float, rng.int_dtype()], rng.chance(1, 2));
        assert_eq!(outcome, Ok(tokens), "{what}: status");
        assert_close(&got, &expected, float, &format!("{what}, {float:?}"));
    }
}

/// f64 pools: the reference's values to f64 rounding where the device has a 64-bit exp; NaN
/// where it has not (SPIR-V's exp is 32-bit only), never a silently wrong value.
pub fn f64_cases<B: KvPlanBackend>(device: &B::Device, exp_64: bool) {
    let mut rng = Rng::new(0xF64);
    for (heads, kv_heads, head_dim) in [(1, 1, 8), (9, 3, 64), (4, 2, 80)] {
        let layout = Heads {
            heads,
            kv_heads,
            head_dim,
        };
        let tokens = rng.urange(1, 12);
        let case = Case::random(&mut rng, layout, tokens, 200, 130);
        let expected = case.reference().expect("valid runs");
        let (got, outcome) = case.run::<B>(device, [DType::F64, DType::I64], false);
        assert_eq!(outcome, Ok(tokens), "{layout:?}: status");
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            if exp_64 {
                assert!(
                    (g - e).abs() <= 1e-12 * (1.0 + e.abs()),
                    "{layout:?}: element {i}: {g} against {e}"
                );
            } else {
                assert!(g.is_nan(), "{layout:?}: element {i}: {g}, not NaN");
            }
        }
    }
}

/// Tokens up to which an attention launch stages its K rows in shared memory (the kernels'
/// `STAGED_TOKENS`): a batch past it is read another way.
const STAGED_TOKENS: usize = 16;

/// A token's row is the same bits alone and in a batch (a plain step and a verify window agree;
/// so do a launch of few tokens, which stages its K rows in shared memory, and one of many).
pub fn rows_do_not_depend_on_the_batch<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(7);
    let layout = Heads {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    let case = Case::random(&mut rng, layout, STAGED_TOKENS + 4, 400, 150);
    let (batch, _) = case.run::<B>(device, [DType::F32, DType::I64], false);
    let cols = case.q_cols();
    for t in [0, 5, 11, STAGED_TOKENS + 3] {
        let alone = Case {
            tokens: 1,
            q: case.q[t * cols..][..cols].to_vec(),
            starts: vec![case.starts[t]],
            counts: vec![case.counts[t]],
            ..case.clone()
        };
        let (row, _) = alone.run::<B>(device, [DType::F32, DType::I64], false);
        let bits = |values: &[f64]| {
            values
                .iter()
                .map(|v| (*v as f32).to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&row), bits(&batch[t * cols..][..cols]), "token {t}");
    }
}

/// `case` with `edit` made.
fn broken_from(case: &Case, edit: &dyn Fn(&mut Case)) -> Case {
    let mut case = case.clone();
    edit(&mut case);
    case
}

/// Every host rule and every value rule, with the values named; NaN out after a value error.
pub fn errors<B: KvPlanBackend>(device: &B::Device) {
    let context = || "paged_attention:".to_string();
    let layout = Heads {
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let mut rng = Rng::new(3);
    let case = Case::random(&mut rng, layout, 3, 10, 4);
    // Value rules, the lowest faulty token first.
    let broken = |edit: &dyn Fn(&mut Case)| broken_from(&case, edit);
    let mut value_cases: Vec<(Case, Error)> = vec![
        (
            broken(&|c| {
                c.starts[2] = c.slots.len() as i64;
                c.counts[2] = 1;
            }),
            Error::KeyRunOutOfRange {
                context: context(),
                token: 2,
                start: case.slots.len() as i64,
                count: 1,
                slots: case.slots.len(),
            },
        ),
        (
            broken(&|c| c.starts[1] = -1),
            Error::KeyRunOutOfRange {
                context: context(),
                token: 1,
                start: -1,
                count: case.counts[1],
                slots: case.slots.len(),
            },
        ),
        (
            broken(&|c| c.counts[0] = -3),
            Error::KeyRunOutOfRange {
                context: context(),
                token: 0,
                start: case.starts[0],
                count: -3,
                slots: case.slots.len(),
            },
        ),
        (
            broken(&|c| {
                c.starts = vec![0, 0, 0];
                c.counts = vec![1, 3, 3];
                c.slots[2] = 10;
                c.slots[1] = -4;
            }),
            Error::KeySlotOutOfRange {
                context: context(),
                token: 1,
                key: 1,
                slot: -4,
                pool_rows: 10,
            },
        ),
        (
            broken(&|c| {
                c.starts = vec![0, 0, 0];
                c.counts = vec![1, 1, 3];
                c.slots[2] = 10;
            }),
            Error::KeySlotOutOfRange {
                context: context(),
                token: 2,
                key: 2,
                slot: 10,
                pool_rows: 10,
            },
        ),
    ];
    // The check shares each run out over a group of units (every group-th key each): a fault
    // deep in one long run (one token: groups of 256), and faults in two of 100 tokens (groups of
    // 2), the lower token's at a key its group's second unit walks.
    let long = Case {
        tokens: 1,
        q: case.q[..case.q_cols()].to_vec(),
        slots: (0..700).map(|i| i % 10).collect(),
        starts: vec![0],
        counts: vec![700],
        ..case.clone()
    };
    let many = Case {
        tokens: 100,
        q: case.q[..case.q_cols()].repeat(100),
        slots: (0..40).map(|i| i % 10).collect(),
        starts: vec![3; 100],
        counts: vec![30; 100],
        ..case.clone()
    };
    value_cases.extend([
        (
            broken_from(&long, &|c| c.slots[513] = 10),
            Error::KeySlotOutOfRange {
                context: context(),
                token: 0,
                key: 513,
                slot: 10,
                pool_rows: 10,
            },
        ),
        (
            broken_from(&many, &|c| {
                c.starts[97] = 0;
                c.slots[1] = -2;
                c.starts[41] = 0;
                c.counts[41] = 40;
                c.slots[33] = 12;
            }),
            Error::KeySlotOutOfRange {
                context: context(),
                token: 41,
                key: 1,
                slot: -2,
                pool_rows: 10,
            },
        ),
    ]);
    for (case, error) in value_cases {
        assert_eq!(case.reference(), Err(error.clone()), "reference");
        for int in [DType::I32, DType::I64] {
            let (out, outcome) = case.run::<B>(device, [DType::F32, int], false);
            assert_eq!(outcome, Err(error.clone()), "{int:?}");
            assert!(out.iter().all(|v| v.is_nan()), "{error}: output is NaN");
        }
    }
    // Host rules.
    let q =
        |shape: [usize; 2]| floats::<B>(&vec![0.0; shape[0] * shape[1]], shape, DType::F32, device);
    let keys = |int: DType, tokens: usize, rows: usize| {
        KeyRuns::<B>::check_primitives(
            [
                list::<B>(&[1, 2], int, device),
                list::<B>(&vec![0; tokens], int, device),
                list::<B>(&vec![1; tokens], int, device),
            ],
            rows,
        )
        .unwrap()
    };
    let run = |qs: [usize; 2], kvs: [usize; 2], heads: usize, tokens: usize| {
        paged_attention::<B>(q(qs), q(kvs), &keys(DType::I64, tokens, kvs[0]), heads)
    };
    let head_shape = |qs: [usize; 2], kvs: [usize; 2], heads: usize| Error::HeadShape {
        context: context(),
        q: Dims(qs.to_vec()),
        kv_pool: Dims(kvs.to_vec()),
        heads,
        max_head_dim: 256,
    };
    for (qs, kvs, heads) in [
        ([2, 30], [5, 32], 4),    // q not whole heads
        ([2, 32], [5, 24], 4),    // the pool not whole heads
        ([2, 24], [5, 32], 3),    // 3 query heads over 2 K/V heads
        ([2, 32], [5, 33], 4),    // an odd width: V unlike K
        ([2, 32], [5, 32], 0),    // no heads
        ([2, 514], [5, 1028], 1), // head_dim past 256
    ] {
        assert_eq!(
            run(qs, kvs, heads, 2).unwrap_err(),
            head_shape(qs, kvs, heads)
        );
    }
    assert_eq!(
        run([3, 32], [5, 32], 4, 2).unwrap_err(),
        Error::RunCountMismatch {
            context: context(),
            name: "starts",
            len: 2,
            tokens: 3,
        }
    );
    assert_eq!(
        paged_attention::<B>(q([2, 32]), q([6, 32]), &keys(DType::I32, 2, 5), 4).unwrap_err(),
        Error::PoolRowsMismatch {
            context: context(),
            kv_pool: Dims(vec![6, 32]),
            pool_rows: 5,
        }
    );
    let rank3 = B::float_reshape(q([2, 32]), Shape::new([2, 4, 8]));
    assert_eq!(
        paged_attention::<B>(rank3, q([5, 32]), &keys(DType::I64, 2, 5), 4).unwrap_err(),
        Error::Not2d {
            context: context(),
            name: "q",
            shape: Dims(vec![2, 4, 8]),
        }
    );
    let pool_1d = B::float_from_data(TensorData::new(vec![0f32; 160], [160]), device);
    assert_eq!(
        paged_attention::<B>(q([2, 32]), pool_1d, &keys(DType::I64, 2, 5), 4).unwrap_err(),
        Error::Not2d {
            context: context(),
            name: "kv_pool",
            shape: Dims(vec![160]),
        }
    );
    let f64_pool = B::float_from_data(TensorData::new(vec![0.0f64; 160], [5, 32]), device);
    assert_eq!(
        paged_attention::<B>(q([2, 32]), f64_pool, &keys(DType::I64, 2, 5), 4).unwrap_err(),
        Error::DtypeMismatch {
            context: context(),
            name: "kv_pool",
            got: "f64".into(),
            accepted: "a float dtype, the same for q and kv_pool",
        }
    );
    let two_d = crate::common::ints::<B, 2>(&[0, 1], [1, 2], DType::I64, device);
    let one = || list::<B>(&[0], DType::I64, device);
    assert_eq!(
        KeyRuns::<B>::check_primitives([two_d, one(), one()], 5).unwrap_err(),
        Error::Not1d {
            context: context(),
            name: "slots",
            shape: Dims(vec![1, 2]),
        }
    );
    let u8_slots = B::int_from_data(TensorData::new(vec![0u8, 1], [2]), device);
    assert_eq!(
        KeyRuns::<B>::check_primitives([u8_slots, one(), one()], 5).unwrap_err(),
        Error::DtypeMismatch {
            context: context(),
            name: "slots",
            got: "uint8".into(),
            accepted: INT_DTYPES,
        }
    );
    assert_eq!(
        KeyRuns::<B>::check_primitives([one(), one(), list::<B>(&[1, 1], DType::I64, device)], 5)
            .unwrap_err(),
        Error::RunCountMismatch {
            context: context(),
            name: "counts",
            len: 2,
            tokens: 1,
        }
    );
}

/// `store_and_attend`: the joined pool holds what a separate store leaves, exactly, and the
/// output is the bits of a separate attention over it (the reference's values); a duplicate
/// store slot leaves the pool unchanged and reports the store's error; every host rule of the
/// store and of the attention fails as in the separate op; no new rows leave the attention over
/// the pool as it is. Case 6 runs in f64: NaN out where exp is 32-bit only (`exp_64` false), the
/// pool stored all the same.
pub fn store_then_attend<B: KvPlanBackend>(device: &B::Device, exp_64: bool) {
    let mut rng = Rng::new(0x5707E);
    let shapes = [(9, 3, 64), (4, 2, 80), (1, 1, 8), (2, 2, 128)];
    for (case_index, &(heads, kv_heads, head_dim)) in shapes.iter().cycle().take(8).enumerate() {
        let layout = Heads {
            heads,
            kv_heads,
            head_dim,
        };
        // The last case stores two tokens at one slot. The new rows are the queries' tokens.
        let duplicate = case_index == 7;
        // Up to past `STAGED_TOKENS`: both ways of reading the K rows meet new rows.
        let tokens = rng.urange(1 + usize::from(duplicate), STAGED_TOKENS + 8);
        let new = tokens;
        let pool_rows = rng.urange(new + 2, 200);
        // Odd cases' runs span the attention's parts, several chunks each.
        let longest = if case_index % 2 == 1 { 1100 } else { 40 };
        let mut case = Case::random(&mut rng, layout, tokens, pool_rows, longest);
        let mut free: Vec<i64> = (1..pool_rows as i64).collect();
        rng.shuffle(&mut free);
        let mut loc = free[..new].to_vec();
        if duplicate {
            loc[1] = loc[0];
        }
        // Cases 2 and 3 name the padding slot 0 at two rows (allowed; only the last is stored).
        if (2..4).contains(&case_index) && new >= 2 {
            (loc[0], loc[new - 1]) = (0, 0);
        }
        // Half the keys are this step's new rows.
        for slot in case.slots.iter_mut() {
            if rng.chance(1, 2) {
                *slot = loc[rng.below(new as u64) as usize];
            }
        }
        let cols = case.kv_cols();
        let fresh = |rng: &mut Rng| -> Vec<f64> {
            (0..new * cols)
                .map(|_| rng.range(-256, 256) as f64 / 128.0)
                .collect()
        };
        let (k_new, v_new) = (fresh(&mut rng), fresh(&mut rng));
        let mut stored = case.clone();
        for (i, &slot) in loc.iter().enumerate() {
            let at = slot as usize * cols;
            stored.k[at..][..cols].copy_from_slice(&k_new[i * cols..][..cols]);
            stored.v[at..][..cols].copy_from_slice(&v_new[i * cols..][..cols]);
        }
        let float = match case_index {
            6 => DType::F64,
            4 | 5 => half::<B>(device),
            _ => DType::F32,
        };
        let what = format!(
            "case {case_index}: {layout:?}, {tokens} tokens over {pool_rows} rows, {float:?}"
        );
        let int = rng.int_dtype();
        let q_cols = case.q_cols();
        let new_rows = join(&k_new, &v_new, cols);
        let inputs = || {
            let kv_pool = join(&case.k, &case.v, cols);
            let kv_pool = floats::<B>(&kv_pool, [pool_rows, 2 * cols], float, device);
            let keys = KeyRuns::<B>::check_primitives(
                [&case.slots, &case.starts, &case.counts].map(|v| list::<B>(v, int, device)),
                pool_rows,
            )
            .expect("host rules hold");
            let store = KvStore::<B>::allocate_on(pool_rows, device).unwrap();
            (kv_pool, keys, store)
        };
        // Together; a later check of other slots through the same store sits between.
        let (kv_pool, keys, mut store) = inputs();
        let qkv: Vec<f64> = (0..tokens)
            .flat_map(|t| {
                let q = &case.q[t * q_cols..][..q_cols];
                q.iter()
                    .chain(&new_rows[t * 2 * cols..][..2 * cols])
                    .copied()
            })
            .collect();
        let qkv = floats::<B>(&qkv, [tokens, q_cols + 2 * cols], float, device);
        let mut slots = store
            .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
            .unwrap();
        let later: Vec<i64> = free[free.len().saturating_sub(3)..]
            .iter()
            .chain(&loc)
            .copied()
            .collect();
        let later = store.check_slot_primitives(list::<B>(&later, int, device), pool_rows);
        let attended = slots
            .store_and_attend_primitives([kv_pool, qkv], &keys, heads)
            .expect("host rules hold");
        let status = slots.status().check();
        drop(later);
        let (out, pool_got) = (
            float_values::<B>(attended.out),
            float_values::<B>(attended.kv_pool),
        );
        let bits = |values: &[f64]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // Apart: the store, then the attention.
        let (kv_pool, keys, mut store) = inputs();
        let mut slots = store
            .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
            .unwrap();
        let rows = floats::<B>(&new_rows, [new, 2 * cols], float, device);
        let one = |rows| StoreTargets::One(KvRows::Float(rows));
        let StoreTargets::One(KvRows::Float(kv_pool)) = slots
            .store_primitives(one(kv_pool), one(rows))
            .expect("host rules hold")
        else {
            unreachable!("one cache comes back")
        };
        let q = floats::<B>(&case.q, [tokens, q_cols], float, device);
        let apart = paged_attention::<B>(q, kv_pool.clone(), &keys, heads).unwrap();
        assert_eq!(status, slots.status().check(), "{what}: status");
        assert_eq!(
            bits(&out),
            bits(&float_values::<B>(apart)),
            "{what}: output"
        );
        assert_eq!(pool_got, float_values::<B>(kv_pool), "{what}: pool");
        if duplicate {
            assert!(status.is_err(), "{what}: a duplicate slot");
            assert_eq!(pool_got, join(&case.k, &case.v, cols), "{what}: unchanged");
        } else {
            assert_eq!(status, Ok(new), "{what}: status");
            assert_eq!(pool_got, join(&stored.k, &stored.v, cols), "{what}: pool");
            if float != DType::F64 || exp_64 {
                assert_close(&out, &stored.reference().unwrap(), float, &what);
            } else {
                assert!(out.iter().all(|v| v.is_nan()), "{what}: NaN out");
            }
        }
    }
    // Host rules: `qkv`'s rank, then the store's (its last pool-width columns as the values, the
    // pool as the cache), then the attention's (the rest as `q`); the slots' status stays theirs.
    let zeros =
        |shape: [usize; 2]| floats::<B>(&vec![0.0; shape[0] * shape[1]], shape, DType::F32, device);
    let keys = KeyRuns::<B>::check_primitives(
        [&[1, 2][..], &[0, 0], &[1, 2]].map(|v| list::<B>(v, DType::I64, device)),
        5,
    )
    .unwrap();
    let mut store = KvStore::<B>::allocate_on(5, device).unwrap();
    let mut slots = store
        .check_slot_primitives(list::<B>(&[3, 4], DType::I64, device), 5)
        .unwrap();
    let (store_kv, attention) = ("store_kv:".to_string(), "paged_attention:".to_string());
    let head_shape = |q: Vec<usize>, kv_pool: Vec<usize>| Error::HeadShape {
        context: attention.clone(),
        q: Dims(q),
        kv_pool: Dims(kv_pool),
        heads: 4,
        max_head_dim: 256,
    };
    for (kv_pool, qkv, expected) in [
        (
            zeros([5, 32]),
            B::float_from_data(TensorData::new(vec![0f32; 4], [4]), device),
            Error::Not2d {
                context: store_kv.clone(),
                name: "qkv",
                shape: Dims(vec![4]),
            },
        ),
        (
            zeros([5, 32]),
            zeros([3, 64]), // three new rows for two slots
            Error::ValueShapeMismatch {
                context: store_kv.clone(),
                values: Dims(vec![3, 32]),
                expected: Dims(vec![2, 32]),
                cache: Dims(vec![5, 32]),
            },
        ),
        (
            zeros([4, 32]), // a pool of fewer rows than the slots were checked for
            zeros([2, 64]),
            Error::CacheRowsMismatch {
                context: store_kv.clone(),
                name: "kv_pool",
                cache: Dims(vec![4, 32]),
                cache_rows: 5,
            },
        ),
        (
            B::float_from_data(TensorData::new(vec![0f32; 160], [160]), device), // a pool of rank 1
            zeros([2, 64]),
            Error::ValueShapeMismatch {
                context: store_kv.clone(),
                values: Dims(vec![2, 0]),
                expected: Dims(vec![2]),
                cache: Dims(vec![160]),
            },
        ),
        (
            zeros([5, 32]),
            floats::<B>(&[0.0; 128], [2, 64], DType::F64, device),
            Error::ValueDtypeMismatch {
                context: store_kv.clone(),
                values: "f64".into(),
                cache: "f32".into(),
            },
        ),
        (
            zeros([5, 33]),
            zeros([2, 65]),
            head_shape(vec![2, 32], vec![5, 33]),
        ), // odd width
        (
            zeros([5, 32]),
            zeros([2, 62]),
            head_shape(vec![2, 30], vec![5, 32]),
        ), // q not whole heads
        (
            zeros([5, 32]),
            zeros([2, 32]),
            head_shape(vec![2, 0], vec![5, 32]),
        ), // no query columns
    ] {
        let error = slots
            .store_and_attend_primitives([kv_pool, qkv], &keys, 4)
            .map(drop);
        assert_eq!(error, Err(expected.clone()));
        assert_eq!(
            slots.status().check(),
            Ok(2),
            "{expected}: the status stays"
        );
    }
    let attended = slots
        .store_and_attend_primitives([zeros([5, 32]), zeros([2, 64])], &keys, 4)
        .unwrap();
    assert_eq!(
        float_values::<B>(attended.out),
        vec![0.0; 2 * 32],
        "zeros attend to zeros"
    );

    // A key outside the pool: the runs' error, NaN out, and the rows stored all the same.
    let keys = KeyRuns::<B>::check_primitives(
        [&[1, 9][..], &[0, 0], &[1, 2]].map(|v| list::<B>(v, DType::I64, device)),
        5,
    )
    .unwrap();
    let mut slots = store
        .check_slot_primitives(list::<B>(&[3, 4], DType::I64, device), 5)
        .unwrap();
    let rows: Vec<f64> = (0..64).map(f64::from).collect();
    let mut qkv = vec![0.0; 2 * 32];
    qkv.splice(32..32, rows[..32].iter().copied());
    qkv.extend(&rows[32..]);
    let attended = slots
        .store_and_attend_primitives(
            [
                zeros([5, 32]),
                floats::<B>(&qkv, [2, 64], DType::F32, device),
            ],
            &keys,
            4,
        )
        .unwrap();
    assert_eq!(
        keys.status().check(),
        Err(Error::KeySlotOutOfRange {
            context: "paged_attention:".into(),
            token: 1,
            key: 1,
            slot: 9,
            pool_rows: 5,
        })
    );
    assert_eq!(slots.status().check(), Ok(2));
    assert!(float_values::<B>(attended.out).iter().all(|v| v.is_nan()));
    let mut stored = vec![0.0; 3 * 32];
    stored.extend(&rows);
    assert_eq!(float_values::<B>(attended.kv_pool), stored);
}

/// On a device whose 32-bit indexes reach `span` elements (`crate::narrow`): a key runs' check
/// over a slot list past the span is refused with `index_range` in its status, and an attention
/// through those runs (which binds that list too) is NaN; runs within the span over a pool past
/// it pass their check, and the attention, which cannot index the pool, is NaN (as after an
/// error, never wrapped). A store and attention in one launch over such a pool falls back to the
/// two launchers: the store's refusal in the slots' status, the pool unchanged, the attention NaN.
pub fn narrow_checks<B: KvPlanBackend>(device: &B::Device, span: usize) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let q = || floats::<B>(&[0.5; 2 * 16], [2, 16], DType::F32, device);
    let pool = |rows: usize| floats::<B>(&vec![0.25; rows * 32], [rows, 32], DType::F32, device);
    let slots = list::<B>(&vec![1; span + 1], DType::I64, device);
    let keys = KeyRuns::<B>::check_primitives([slots, l(&[0, 1]), l(&[1, 2])], 4).unwrap();
    match keys.status().check() {
        Err(Error::IndexRange { elements, limit }) => {
            assert_eq!(limit, span as u64, "runs' check: limit");
            assert!(elements > span as u64, "runs' check: {elements} elements");
        }
        other => panic!("runs' check: expected index_range, got {other:?}"),
    }
    let out = paged_attention::<B>(q(), pool(4), &keys, 1).unwrap();
    assert!(
        float_values::<B>(out).iter().all(|v| v.is_nan()),
        "attention through refused runs"
    );
    let rows = span / 32 + 1;
    let keys = KeyRuns::<B>::check_primitives([l(&[1, 2]), l(&[0, 1]), l(&[1, 1])], rows).unwrap();
    assert_eq!(keys.status().check(), Ok(2), "runs within the span");
    let out = paged_attention::<B>(q(), pool(rows), &keys, 1).unwrap();
    assert!(
        float_values::<B>(out).iter().all(|v| v.is_nan()),
        "attention over a pool past the span"
    );
    let mut store = KvStore::<B>::allocate_on(rows, device).unwrap();
    let mut slots = store.check_slot_primitives(l(&[1, 2]), rows).unwrap();
    let qkv = floats::<B>(&[0.5; 2 * 48], [2, 48], DType::F32, device);
    let attended = slots
        .store_and_attend_primitives([pool(rows), qkv], &keys, 1)
        .unwrap();
    match slots.status().check() {
        Err(Error::IndexRange { limit, .. }) => assert_eq!(limit, span as u64),
        other => panic!("expected index_range, got {other:?}"),
    }
    assert!(
        float_values::<B>(attended.out).iter().all(|v| v.is_nan()),
        "store and attention over a pool past the span"
    );
    assert_eq!(
        float_values::<B>(attended.kv_pool),
        vec![0.25; rows * 32],
        "unchanged"
    );
}
