//! `paged_attention` and its key runs' check against the f64 reference: random shapes, heads and
//! runs; bit-identical rows whatever else is in the launch; every error.

use burn_core::backend::tensor::FloatTensor;
use burn_core::backend::{TensorData, read_sync};
use burn_core::tensor::{DType, Shape, Slice};
use kvplan::attention::KeyRuns;
use kvplan::attention::backend::{paged_attention, paged_attention_kv};
use kvplan::error::Dims;
use kvplan::ops::{KvRows, StoreTargets};
use kvplan::reference::{self, Heads};
use kvplan::slots::KvStore;
use kvplan::{Error, KvPlanBackend};

use crate::common::{Rng, list};
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
        let pool =
            |values: &[f64]| floats::<B>(values, [self.pool_rows, self.kv_cols()], float, device);
        let keys = KeyRuns::<B>::check_primitives(
            [
                list::<B>(&self.slots, int, device),
                list::<B>(&self.starts, int, device),
                list::<B>(&self.counts, int, device),
            ],
            self.pool_rows,
        )
        .expect("host rules hold");
        let out = paged_attention::<B>(q, pool(&self.k), pool(&self.v), &keys, self.heads.heads)
            .expect("host rules hold");
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

/// `got` within f32 rounding of the reference, element by element.
#[track_caller]
fn assert_close(got: &[f64], expected: &[f64], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= 1e-5 + 1e-5 * e.abs(),
            "{what}: element {i}: {g} against the reference's {e}"
        );
    }
}

/// Random heads (GQA groups, head widths across the cube's unit counts), runs across key
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
    ];
    for (case_index, &(heads, kv_heads, head_dim)) in shapes.iter().cycle().take(18).enumerate() {
        let layout = Heads {
            heads,
            kv_heads,
            head_dim,
        };
        let tokens = rng.urange(1, 24);
        let pool_rows = rng.urange(1, 300);
        let longest = rng.pick(&[1, 5, 63, 64, 65, 200]);
        let case = Case::random(&mut rng, layout, tokens, pool_rows, longest);
        let what = format!("case {case_index}: {layout:?}, {tokens} tokens, runs <= {longest}");
        let expected = case.reference().expect("valid runs");
        let (got, outcome) = case.run::<B>(device, [DType::F32, rng.int_dtype()], rng.chance(1, 2));
        assert_eq!(outcome, Ok(tokens), "{what}: status");
        assert_close(&got, &expected, &what);
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

/// A token's row is the same bits alone and in a batch (a plain step and a verify window agree).
pub fn rows_do_not_depend_on_the_batch<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(7);
    let layout = Heads {
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
    };
    let case = Case::random(&mut rng, layout, 12, 400, 150);
    let (batch, _) = case.run::<B>(device, [DType::F32, DType::I64], false);
    let cols = case.q_cols();
    for t in [0, 5, 11] {
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
    let broken = |edit: &dyn Fn(&mut Case)| {
        let mut case = case.clone();
        edit(&mut case);
        case
    };
    let value_cases: Vec<(Case, Error)> = vec![
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
    let run = |qs: [usize; 2], ks: [usize; 2], vs: [usize; 2], heads: usize, tokens: usize| {
        paged_attention::<B>(q(qs), q(ks), q(vs), &keys(DType::I64, tokens, ks[0]), heads)
    };
    let head_shape =
        |qs: [usize; 2], ks: [usize; 2], vs: [usize; 2], heads: usize| Error::HeadShape {
            context: context(),
            q: Dims(qs.to_vec()),
            k_pool: Dims(ks.to_vec()),
            v_pool: Dims(vs.to_vec()),
            heads,
            max_head_dim: 256,
        };
    for (qs, ks, vs, heads) in [
        ([2, 30], [5, 16], [5, 16], 4),    // q not whole heads
        ([2, 32], [5, 12], [5, 12], 4),    // the pool not whole heads
        ([2, 24], [5, 16], [5, 16], 3),    // 3 query heads over 2 K/V heads
        ([2, 32], [5, 16], [5, 8], 4),     // V unlike K
        ([2, 32], [5, 16], [5, 16], 0),    // no heads
        ([2, 514], [5, 514], [5, 514], 1), // head_dim past 256
    ] {
        assert_eq!(
            run(qs, ks, vs, heads, 2).unwrap_err(),
            head_shape(qs, ks, vs, heads)
        );
    }
    assert_eq!(
        run([3, 32], [5, 16], [5, 16], 4, 2).unwrap_err(),
        Error::RunCountMismatch {
            context: context(),
            name: "starts",
            len: 2,
            tokens: 3,
        }
    );
    assert_eq!(
        paged_attention::<B>(
            q([2, 32]),
            q([6, 16]),
            q([6, 16]),
            &keys(DType::I32, 2, 5),
            4
        )
        .unwrap_err(),
        Error::PoolRowsMismatch {
            context: context(),
            k_pool: Dims(vec![6, 16]),
            v_pool: Dims(vec![6, 16]),
            pool_rows: 5,
        }
    );
    let rank3 = B::float_reshape(q([2, 32]), Shape::new([2, 4, 8]));
    assert_eq!(
        paged_attention::<B>(rank3, q([5, 16]), q([5, 16]), &keys(DType::I64, 2, 5), 4)
            .unwrap_err(),
        Error::Not2d {
            context: context(),
            name: "q",
            shape: Dims(vec![2, 4, 8]),
        }
    );
    let f64_pool = B::float_from_data(TensorData::new(vec![0.0f64; 80], [5, 16]), device);
    assert_eq!(
        paged_attention::<B>(q([2, 32]), f64_pool, q([5, 16]), &keys(DType::I64, 2, 5), 4)
            .unwrap_err(),
        Error::DtypeMismatch {
            context: context(),
            name: "k_pool",
            got: "f64".into(),
            accepted: "a float dtype, the same for q, k_pool and v_pool",
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

/// `store_kv_and_attend`: the pools hold what a separate `store_kv` leaves, exactly, and the
/// output is the bits of a separate attention over them (the reference's values), as do the
/// one-tensor forms (`store_qk_and_attend`; `store_qkv_and_attend` over the joined pool, and
/// `paged_attention_kv` over it); a duplicate
/// store slot leaves the pools unchanged and reports the store's error; every host rule of the
/// store and of the attention fails as in the separate op; no new rows leave the attention over
/// the pools as they are. Case 6 runs in f64: NaN out where
/// exp is 32-bit only (`exp_64` false), the pools stored all the same.
pub fn store_then_attend<B: KvPlanBackend>(device: &B::Device, exp_64: bool) {
    let mut rng = Rng::new(0x5707E);
    let shapes = [(9, 3, 64), (4, 2, 80), (1, 1, 8), (2, 2, 128)];
    for (case_index, &(heads, kv_heads, head_dim)) in shapes.iter().cycle().take(8).enumerate() {
        let layout = Heads {
            heads,
            kv_heads,
            head_dim,
        };
        // The last case stores two tokens at one slot; odd cases store more or fewer rows than
        // there are queries.
        let duplicate = case_index == 7;
        let tokens = rng.urange(1, 12);
        let new = if case_index % 2 == 1 {
            rng.urange(1 + usize::from(duplicate), 12)
        } else {
            tokens.max(1 + usize::from(duplicate))
        };
        let pool_rows = rng.urange(new + 2, 200);
        let mut case = Case::random(&mut rng, layout, tokens, pool_rows, 40);
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
        let float = if case_index == 6 {
            DType::F64
        } else {
            DType::F32
        };
        let what = format!(
            "case {case_index}: {layout:?}, {tokens} tokens, {new} new rows over {pool_rows} rows, {float:?}"
        );
        let int = rng.int_dtype();
        let inputs = || {
            let pool = |values: &[f64]| floats::<B>(values, [pool_rows, cols], float, device);
            let rows = |values: &[f64]| floats::<B>(values, [new, cols], float, device);
            let q = floats::<B>(&case.q, [tokens, case.q_cols()], float, device);
            let keys = KeyRuns::<B>::check_primitives(
                [&case.slots, &case.starts, &case.counts].map(|v| list::<B>(v, int, device)),
                pool_rows,
            )
            .expect("host rules hold");
            let store = KvStore::<B>::allocate_on(pool_rows, device).unwrap();
            let parts = [pool(&case.k), pool(&case.v), rows(&k_new), rows(&v_new), q];
            (parts, keys, store)
        };
        // Together; a later check of other slots through the same store sits between.
        let ([k_pool, v_pool, k, v, q], keys, mut store) = inputs();
        let mut slots = store
            .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
            .unwrap();
        let later: Vec<i64> = free[free.len() - 3..].iter().chain(&loc).copied().collect();
        let later = store.check_slot_primitives(list::<B>(&later, int, device), pool_rows);
        let attended = slots
            .store_kv_and_attend_primitives([k_pool, v_pool, k, v, q], &keys, heads)
            .expect("host rules hold");
        let status = slots.status().check();
        drop(later);
        let (out, k_got, v_got) = (
            float_values::<B>(attended.out),
            float_values::<B>(attended.k_pool),
            float_values::<B>(attended.v_pool),
        );
        let bits = |values: &[f64]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        // The queries and keys as one tensor, where there is a key row per query: the same.
        if new == tokens {
            let ([k_pool, v_pool, _, v, _], keys, mut store) = inputs();
            let q_cols = case.q_cols();
            let qk: Vec<f64> = (0..tokens)
                .flat_map(|t| {
                    let key = &k_new[t * cols..][..cols];
                    case.q[t * q_cols..][..q_cols].iter().chain(key).copied()
                })
                .collect();
            let qk = floats::<B>(&qk, [tokens, q_cols + cols], float, device);
            let mut slots = store
                .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
                .unwrap();
            let attended = slots
                .store_qk_and_attend_primitives([k_pool, v_pool, qk, v], &keys, heads)
                .expect("host rules hold");
            assert_eq!(slots.status().check(), status, "{what}: qk status");
            let got = float_values::<B>(attended.out);
            assert_eq!(bits(&got), bits(&out), "{what}: qk output");
            assert_eq!(
                float_values::<B>(attended.k_pool),
                k_got,
                "{what}: qk K pool"
            );
            assert_eq!(
                float_values::<B>(attended.v_pool),
                v_got,
                "{what}: qk V pool"
            );
        }
        // One joined pool, the queries, keys and values as one tensor: the same.
        if new == tokens {
            let (_, keys, mut store) = inputs();
            let q_cols = case.q_cols();
            let qkv: Vec<f64> = (0..tokens)
                .flat_map(|t| {
                    let q = &case.q[t * q_cols..][..q_cols];
                    let kv = join(&k_new[t * cols..][..cols], &v_new[t * cols..][..cols], cols);
                    q.iter().copied().chain(kv).collect::<Vec<_>>()
                })
                .collect();
            let qkv = floats::<B>(&qkv, [tokens, q_cols + 2 * cols], float, device);
            let kv_pool = join(&case.k, &case.v, cols);
            let kv_pool = floats::<B>(&kv_pool, [pool_rows, 2 * cols], float, device);
            let mut slots = store
                .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
                .unwrap();
            let attended = slots
                .store_qkv_and_attend_primitives([kv_pool, qkv], &keys, heads)
                .expect("host rules hold");
            assert_eq!(slots.status().check(), status, "{what}: qkv status");
            let got = float_values::<B>(attended.out);
            assert_eq!(bits(&got), bits(&out), "{what}: qkv output");
            assert_eq!(
                float_values::<B>(attended.kv_pool),
                join(&k_got, &v_got, cols),
                "{what}: joined pool"
            );
        }
        // Apart.
        let ([k_pool, v_pool, k, v, q], keys, mut store) = inputs();
        let mut slots = store
            .check_slot_primitives(list::<B>(&loc, int, device), pool_rows)
            .unwrap();
        let pair = |a, b| StoreTargets::Pair(KvRows::Float(a), KvRows::Float(b));
        let StoreTargets::Pair(KvRows::Float(k_pool), KvRows::Float(v_pool)) = slots
            .store_primitives(pair(k_pool, v_pool), pair(k, v))
            .expect("host rules hold")
        else {
            unreachable!("a pair comes back")
        };
        let kv_pool = B::float_cat(vec![k_pool.clone(), v_pool.clone()], 1);
        let joined = paged_attention_kv::<B>(q.clone(), kv_pool, &keys, heads).unwrap();
        let apart = paged_attention::<B>(q, k_pool.clone(), v_pool.clone(), &keys, heads).unwrap();
        assert_eq!(status, slots.status().check(), "{what}: status");
        assert_eq!(
            bits(&out),
            bits(&float_values::<B>(apart)),
            "{what}: output"
        );
        assert_eq!(
            bits(&out),
            bits(&float_values::<B>(joined)),
            "{what}: over the joined pool"
        );
        assert_eq!(k_got, float_values::<B>(k_pool), "{what}: K pool");
        assert_eq!(v_got, float_values::<B>(v_pool), "{what}: V pool");
        if duplicate {
            assert!(status.is_err(), "{what}: a duplicate slot");
            assert_eq!(
                (k_got, v_got),
                (case.k.clone(), case.v.clone()),
                "{what}: unchanged"
            );
        } else {
            assert_eq!(status, Ok(new), "{what}: status");
            assert_eq!(
                (k_got, v_got),
                (stored.k.clone(), stored.v.clone()),
                "{what}: pools"
            );
            if float == DType::F32 || exp_64 {
                assert_close(&out, &stored.reference().unwrap(), &what);
            } else {
                assert!(out.iter().all(|v| v.is_nan()), "{what}: NaN out");
            }
        }
    }
    // Host rules: the store's, then the attention's, each as its own op reports it.
    let zeros =
        |shape: [usize; 2]| floats::<B>(&vec![0.0; shape[0] * shape[1]], shape, DType::F32, device);
    let keys = KeyRuns::<B>::check_primitives(
        [&[1, 2][..], &[0, 0], &[1, 2]].map(|v| list::<B>(v, DType::I64, device)),
        5,
    )
    .unwrap();
    let mut store = KvStore::<B>::allocate_on(5, device).unwrap();
    let run = |store: &mut KvStore<B>, [q, k_pool, k]: [[usize; 2]; 3], heads: usize| {
        let mut slots = store
            .check_slot_primitives(list::<B>(&[3, 4], DType::I64, device), 5)
            .unwrap();
        let together = slots
            .store_kv_and_attend_primitives(
                [zeros(k_pool), zeros(k_pool), zeros(k), zeros(k), zeros(q)],
                &keys,
                heads,
            )
            .map(drop);
        let pair = |a, b| StoreTargets::Pair(KvRows::Float(a), KvRows::Float(b));
        let apart = slots
            .store_primitives(pair(zeros(k_pool), zeros(k_pool)), pair(zeros(k), zeros(k)))
            .and_then(|_| {
                paged_attention::<B>(zeros(q), zeros(k_pool), zeros(k_pool), &keys, heads)
            })
            .map(drop);
        (together, apart)
    };
    for (shapes, heads) in [
        ([[2, 32], [5, 16], [3, 16]], 4), // three K rows for two slots
        ([[2, 32], [5, 16], [2, 8]], 4),  // K rows narrower than the pool
        ([[2, 32], [4, 16], [2, 16]], 4), // a pool of fewer rows than the slots were checked for
        ([[2, 30], [5, 16], [2, 16]], 4), // q not whole heads
        ([[3, 32], [5, 16], [2, 16]], 4), // a query more than the runs
        ([[2, 24], [5, 16], [2, 16]], 3), // 3 query heads over 2 K/V heads
    ] {
        let (together, apart) = run(&mut store, shapes, heads);
        assert!(together.is_err(), "{shapes:?}: refused");
        // The pools are named as this op's arguments, where `store_kv` names caches.
        let apart = apart.map_err(|error| match error {
            Error::CacheRowsMismatch {
                context,
                name: "k_cache",
                cache,
                cache_rows,
            } => Error::CacheRowsMismatch {
                context,
                name: "k_pool",
                cache,
                cache_rows,
            },
            error => error,
        });
        assert_eq!(together, apart, "{shapes:?}");
    }
    // The one-tensor form's rules: its rank (named `qk`), then its parts' as the other form
    // reports them (the key columns as the store's values, the rest as `q`); the slots' status
    // stays theirs.
    let mut slots = store
        .check_slot_primitives(list::<B>(&[3, 4], DType::I64, device), 5)
        .unwrap();
    let (store_kv, attention) = ("store_kv:".to_string(), "paged_attention:".to_string());
    let head_shape = |q: Vec<usize>| Error::HeadShape {
        context: attention.clone(),
        q: Dims(q),
        k_pool: Dims(vec![5, 16]),
        v_pool: Dims(vec![5, 16]),
        heads: 4,
        max_head_dim: 256,
    };
    for (qk, expected) in [
        (
            B::float_from_data(TensorData::new(vec![0f32; 4], [4]), device),
            Error::Not2d {
                context: store_kv.clone(),
                name: "qk",
                shape: Dims(vec![4]),
            },
        ),
        (
            zeros([3, 48]), // three K rows for two slots
            Error::ValueShapeMismatch {
                context: store_kv.clone(),
                values: Dims(vec![3, 16]),
                expected: Dims(vec![2, 16]),
                cache: Dims(vec![5, 16]),
            },
        ),
        (zeros([2, 16]), head_shape(vec![2, 0])), // no query columns
        (zeros([2, 46]), head_shape(vec![2, 30])), // queries not whole heads
        (
            floats::<B>(&[0.0; 96], [2, 48], DType::F64, device),
            Error::ValueDtypeMismatch {
                context: store_kv.clone(),
                values: "f64".into(),
                cache: "f32".into(),
            },
        ),
    ] {
        let error = slots
            .store_qk_and_attend_primitives(
                [zeros([5, 16]), zeros([5, 16]), qk, zeros([2, 16])],
                &keys,
                4,
            )
            .map(drop);
        assert_eq!(error, Err(expected.clone()));
        assert_eq!(
            slots.status().check(),
            Ok(2),
            "{expected}: the status stays"
        );
    }
    let attended = slots
        .store_qk_and_attend_primitives(
            [
                zeros([5, 16]),
                zeros([5, 16]),
                zeros([2, 48]),
                zeros([2, 16]),
            ],
            &keys,
            4,
        )
        .unwrap();
    assert_eq!(
        float_values::<B>(attended.out),
        vec![0.0; 2 * 32],
        "zeros attend to zeros"
    );
    // The joined form's rules: `qkv`'s rank, then the store's (its last pool-width columns as
    // the values, the pool as the cache), then the attention's (the rest as `q`, the pool's halves
    // as the K and V pools); the slots' status stays theirs.
    let halves = |cols: [usize; 2]| Error::HeadShape {
        context: attention.clone(),
        q: Dims(vec![2, 32]),
        k_pool: Dims(vec![5, cols[0]]),
        v_pool: Dims(vec![5, cols[1]]),
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
        (zeros([5, 33]), zeros([2, 65]), halves([16, 17])), // an odd width: unequal halves
        (
            zeros([5, 32]),
            zeros([2, 62]), // queries not whole heads
            Error::HeadShape {
                context: attention.clone(),
                q: Dims(vec![2, 30]),
                k_pool: Dims(vec![5, 16]),
                v_pool: Dims(vec![5, 16]),
                heads: 4,
                max_head_dim: 256,
            },
        ),
    ] {
        let error = slots
            .store_qkv_and_attend_primitives([kv_pool, qkv], &keys, 4)
            .map(drop);
        assert_eq!(error, Err(expected.clone()));
        assert_eq!(
            slots.status().check(),
            Ok(2),
            "{expected}: the status stays"
        );
    }
    assert_eq!(
        paged_attention_kv::<B>(zeros([2, 32]), zeros([5, 33]), &keys, 4).unwrap_err(),
        halves([16, 17]),
        "the attention over an odd-width pool"
    );
    let pool_1d = B::float_from_data(TensorData::new(vec![0f32; 160], [160]), device);
    assert_eq!(
        paged_attention_kv::<B>(zeros([2, 32]), pool_1d, &keys, 4).unwrap_err(),
        Error::Not2d {
            context: attention.clone(),
            name: "kv_pool",
            shape: Dims(vec![160]),
        },
        "the attention over a pool of rank 1"
    );
    assert_eq!(
        paged_attention_kv::<B>(zeros([2, 32]), zeros([4, 32]), &keys, 4).unwrap_err(),
        Error::PoolRowsMismatch {
            context: attention.clone(),
            k_pool: Dims(vec![4, 16]),
            v_pool: Dims(vec![4, 16]),
            pool_rows: 5,
        },
        "the attention over a pool of fewer rows than the runs were checked against"
    );
    let attended = slots
        .store_qkv_and_attend_primitives([zeros([5, 32]), zeros([2, 64])], &keys, 4)
        .unwrap();
    assert_eq!(
        float_values::<B>(attended.out),
        vec![0.0; 2 * 32],
        "zeros attend to zeros (joined)"
    );

    // A key outside the pools: the runs' error, NaN out, and the rows stored all the same.
    let keys = KeyRuns::<B>::check_primitives(
        [&[1, 9][..], &[0, 0], &[1, 2]].map(|v| list::<B>(v, DType::I64, device)),
        5,
    )
    .unwrap();
    let mut slots = store
        .check_slot_primitives(list::<B>(&[3, 4], DType::I64, device), 5)
        .unwrap();
    let rows: Vec<f64> = (0..32).map(f64::from).collect();
    let attended = slots
        .store_kv_and_attend_primitives(
            [
                zeros([5, 16]),
                zeros([5, 16]),
                floats::<B>(&rows, [2, 16], DType::F32, device),
                floats::<B>(&rows, [2, 16], DType::F32, device),
                zeros([2, 32]),
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
    let mut stored = vec![0.0; 3 * 16];
    stored.extend(&rows);
    assert_eq!(float_values::<B>(attended.k_pool), stored);
    assert_eq!(float_values::<B>(attended.v_pool), stored);

    // No new rows (no store slots): the attention over the pools as they are, bit for bit.
    let pool: Vec<f64> = (0..5 * 16).map(|i| f64::from(i % 7) / 8.0).collect();
    let keys = KeyRuns::<B>::check_primitives(
        [&[1, 2, 3][..], &[0, 1], &[2, 2]].map(|v| list::<B>(v, DType::I64, device)),
        5,
    )
    .unwrap();
    let mut slots = store
        .check_slot_primitives(list::<B>(&[], DType::I64, device), 5)
        .unwrap();
    let q: Vec<f64> = (0..2 * 32).map(|i| f64::from(i % 5) / 4.0).collect();
    let attended = slots
        .store_kv_and_attend_primitives(
            [
                floats::<B>(&pool, [5, 16], DType::F32, device),
                floats::<B>(&pool, [5, 16], DType::F32, device),
                zeros([0, 16]),
                zeros([0, 16]),
                floats::<B>(&q, [2, 32], DType::F32, device),
            ],
            &keys,
            4,
        )
        .unwrap();
    let alone = paged_attention::<B>(
        floats::<B>(&q, [2, 32], DType::F32, device),
        floats::<B>(&pool, [5, 16], DType::F32, device),
        floats::<B>(&pool, [5, 16], DType::F32, device),
        &keys,
        4,
    )
    .unwrap();
    let bits = |values: &[f64]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(slots.status().check(), Ok(0));
    assert_eq!(keys.status().check(), Ok(2));
    assert_eq!(
        bits(&float_values::<B>(attended.out)),
        bits(&float_values::<B>(alone)),
        "no new rows: output"
    );
    assert_eq!(
        float_values::<B>(attended.k_pool),
        pool,
        "no new rows: K pool"
    );
}

/// On a device whose 32-bit indexes reach `span` elements (`crate::narrow`): a key runs' check
/// over a slot list past the span is refused with `index_range` in its status, and an attention
/// through those runs (which binds that list too) is NaN; runs within the span over pools past it pass their check,
/// and the attention, which cannot index the pools, is NaN (as after an error, never wrapped).
/// A store and attention in one launch over such pools falls back to the two launchers: the
/// store's refusal in the slots' status, the pools unchanged, the attention NaN; so do the forms
/// with the queries and keys in one tensor (the keys then a copy of their columns) and with a
/// joined pool.
pub fn narrow_checks<B: KvPlanBackend>(device: &B::Device, span: usize) {
    let l = |values: &[i64]| list::<B>(values, DType::I64, device);
    let q = || floats::<B>(&[0.5; 2 * 16], [2, 16], DType::F32, device);
    let pool = |rows: usize| floats::<B>(&vec![0.25; rows * 16], [rows, 16], DType::F32, device);
    let slots = list::<B>(&vec![1; span + 1], DType::I64, device);
    let keys = KeyRuns::<B>::check_primitives([slots, l(&[0, 1]), l(&[1, 2])], 4).unwrap();
    match keys.status().check() {
        Err(Error::IndexRange { elements, limit }) => {
            assert_eq!(limit, span as u64, "runs' check: limit");
            assert!(elements > span as u64, "runs' check: {elements} elements");
        }
        other => panic!("runs' check: expected index_range, got {other:?}"),
    }
    let out = paged_attention::<B>(q(), pool(4), pool(4), &keys, 1).unwrap();
    assert!(
        float_values::<B>(out).iter().all(|v| v.is_nan()),
        "attention through refused runs"
    );
    let rows = span / 16 + 1;
    let keys = KeyRuns::<B>::check_primitives([l(&[1, 2]), l(&[0, 1]), l(&[1, 1])], rows).unwrap();
    assert_eq!(keys.status().check(), Ok(2), "runs within the span");
    let out = paged_attention::<B>(q(), pool(rows), pool(rows), &keys, 1).unwrap();
    assert!(
        float_values::<B>(out).iter().all(|v| v.is_nan()),
        "attention over pools past the span"
    );
    let mut store = KvStore::<B>::allocate_on(rows, device).unwrap();
    for what in ["q, k", "qk", "qkv"] {
        let mut slots = store.check_slot_primitives(l(&[1, 2]), rows).unwrap();
        let new = || floats::<B>(&[0.75; 2 * 16], [2, 16], DType::F32, device);
        let wide = |cols: usize| floats::<B>(&vec![0.5; 2 * cols], [2, cols], DType::F32, device);
        // The output and the pools' values (a joined pool's as the K pool's and the V pool's).
        let (out, pools) = match what {
            "q, k" => {
                let parts = [pool(rows), pool(rows), new(), new(), q()];
                let attended = slots.store_kv_and_attend_primitives(parts, &keys, 1);
                attended.map(|a| (a.out, vec![a.k_pool, a.v_pool]))
            }
            "qk" => {
                let parts = [pool(rows), pool(rows), wide(32), new()];
                let attended = slots.store_qk_and_attend_primitives(parts, &keys, 1);
                attended.map(|a| (a.out, vec![a.k_pool, a.v_pool]))
            }
            _ => {
                let kv_pool = floats::<B>(&vec![0.25; rows * 32], [rows, 32], DType::F32, device);
                let attended = slots.store_qkv_and_attend_primitives([kv_pool, wide(48)], &keys, 1);
                attended.map(|a| (a.out, vec![a.kv_pool]))
            }
        }
        .unwrap();
        match slots.status().check() {
            Err(Error::IndexRange { limit, .. }) => assert_eq!(limit, span as u64, "{what}"),
            other => panic!("{what}: expected index_range, got {other:?}"),
        }
        assert!(
            float_values::<B>(out).iter().all(|v| v.is_nan()),
            "{what}: attention over pools past the span"
        );
        let pool_values: Vec<f64> = pools.into_iter().flat_map(float_values::<B>).collect();
        assert_eq!(pool_values, vec![0.25; 2 * rows * 16], "{what}: unchanged");
    }
}
