//! The kv-canary plan through the backend API (`StepPlan<B>`, `PlanInputs::from_primitives`),
//! compared buffer-for-buffer with the host reference run on a host copy of the same prior state.

use burn_core::tensor::DType;
use kvplan::ops::{PlanInputs, StepPlan, read_plans};
use kvplan::reference::{self, ExpectedTokens, PlanArgs, PlanBuffers, Table};
use kvplan::{Error, KvPlanBackend};

use crate::common::{Rng, assert_disabled, assert_plans_eq, int_slice, int_transpose, ints, list};

/// One plan step's inputs as host data, with the dtype of every int tensor.
#[derive(Debug, Clone)]
pub struct Step {
    pub rpi: Vec<i64>,
    pub prefix: Vec<i64>,
    pub extend: Vec<i64>,
    pub rows: usize,
    pub cols: usize,
    pub table: Vec<i64>,
    pub window: i32,
    pub lut: Option<Vec<i64>>,
    /// `(rows, cols, data)`.
    pub pool: Option<(usize, usize, Vec<i64>)>,
    pub valid_lens: Vec<i64>,
    pub offset: i32,
    /// rpi, prefix, extend, table, lut, pool, valid_lens.
    pub dtypes: [DType; 7],
}

impl Step {
    pub fn new(rows: usize, cols: usize, table: Vec<i64>) -> Self {
        assert_eq!(table.len(), rows * cols);
        Self {
            rpi: vec![],
            prefix: vec![],
            extend: vec![],
            rows,
            cols,
            table,
            window: 0,
            lut: None,
            pool: None,
            valid_lens: vec![],
            offset: 0,
            dtypes: [
                DType::I64,
                DType::I64,
                DType::I64,
                DType::I32,
                DType::I64,
                DType::I32,
                DType::I64,
            ],
        }
    }

    pub fn batch(mut self, rpi: &[i64], prefix: &[i64], extend: &[i64]) -> Self {
        self.rpi = rpi.to_vec();
        self.prefix = prefix.to_vec();
        self.extend = extend.to_vec();
        self
    }

    pub fn window(mut self, window: i32, lut: Option<Vec<i64>>) -> Self {
        self.window = window;
        self.lut = lut;
        self
    }

    pub fn pool(
        mut self,
        rows: usize,
        cols: usize,
        data: Vec<i64>,
        valid_lens: &[i64],
        offset: i32,
    ) -> Self {
        self.pool = Some((rows, cols, data));
        self.valid_lens = valid_lens.to_vec();
        self.offset = offset;
        self
    }

    /// The reference on host buffers.
    pub fn reference(&self, buffers: &mut PlanBuffers) -> Result<(), Error> {
        let args = PlanArgs {
            req_pool_indices: &self.rpi,
            prefix_lens: &self.prefix,
            extend_seq_lens: &self.extend,
            req_to_token: Table::new(self.rows, self.cols, &self.table),
            swa_window_size: self.window,
            full_to_swa: self.lut.as_deref(),
            expected_tokens: self.pool.as_ref().map(|(rows, cols, data)| ExpectedTokens {
                pool: Table::new(*rows, *cols, data),
                valid_lens: &self.valid_lens,
            }),
            position_offset: self.offset,
        };
        reference::plan(&args, buffers)
    }

    /// The verify total of this step (from a reference run on roomy buffers).
    /// The largest total any batch of this size can have on this table: a verify capacity this
    /// large lets the plan run as one launch (no count launch).
    pub fn largest_total(&self) -> usize {
        let longest = if self.window > 0 {
            self.cols.min(self.window as usize)
        } else {
            self.cols
        };
        self.rpi.len() * longest
    }

    pub fn verify_total(&self) -> usize {
        let total: i64 = self
            .rpi
            .iter()
            .zip(&self.prefix)
            .filter(|&(&q, &p)| q != 0 && p > 0)
            .map(|(_, &p)| {
                if self.window > 0 {
                    p.min(i64::from(self.window))
                } else {
                    p
                }
            })
            .sum();
        total as usize
    }

    pub fn inputs<B: KvPlanBackend>(&self, device: &B::Device) -> PlanInputs<B> {
        let d = self.dtypes;
        let mut inputs = PlanInputs::<B>::from_primitives(
            list::<B>(&self.rpi, d[0], device),
            list::<B>(&self.prefix, d[1], device),
            list::<B>(&self.extend, d[2], device),
            ints::<B, 2>(&self.table, [self.rows, self.cols], d[3], device),
        )
        .swa_window_size(self.window)
        .position_offset(self.offset);
        if let Some(lut) = &self.lut {
            inputs = inputs.full_to_swa_index_mapping_primitive(list::<B>(lut, d[4], device));
        }
        if let Some((rows, cols, data)) = &self.pool {
            inputs = inputs.expected_tokens_primitive(
                ints::<B, 2>(data, [*rows, *cols], d[5], device),
                list::<B>(&self.valid_lens, d[6], device),
            );
        }
        inputs
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Checked,
    Deferred,
}

pub const MODES: [Mode; 2] = [Mode::Checked, Mode::Deferred];

/// Device plans plus a host mirror of what they must hold.
pub struct Mirror<B: KvPlanBackend> {
    pub plans: StepPlan<B>,
    pub host: PlanBuffers,
    pub device: B::Device,
}

impl<B: KvPlanBackend> Mirror<B> {
    pub fn new(verify_capacity: usize, write_req_capacity: usize, device: &B::Device) -> Self {
        let plans =
            StepPlan::<B>::allocate_on(verify_capacity, write_req_capacity, device).unwrap();
        assert_eq!(
            (plans.verify.capacity(), plans.write.capacity()),
            (verify_capacity, write_req_capacity)
        );
        let host = PlanBuffers::fresh(verify_capacity, write_req_capacity);
        let mirror = Self {
            plans,
            host,
            device: device.clone(),
        };
        assert_plans_eq(&mirror.read(), &mirror.host, "fresh plans");
        mirror
    }

    pub fn read(&self) -> PlanBuffers {
        read_plans(&self.plans).expect("read_plans")
    }

    /// Runs `step` on the device and on the mirror; compares the result and every buffer.
    /// Device-checked errors must match the reference's (kind and facts) and leave the plans
    /// disabled; the mirror then adopts the device state (the rest is unspecified).
    #[track_caller]
    pub fn step(&mut self, step: &Step, mode: Mode, what: &str) -> Result<(), Error> {
        let inputs = step.inputs::<B>(&self.device);
        self.step_with(step, inputs, mode, what)
    }

    /// `step` with caller-built tensors (other layouts) holding the same values as `step`.
    #[track_caller]
    pub fn step_with(
        &mut self,
        step: &Step,
        inputs: PlanInputs<B>,
        mode: Mode,
        what: &str,
    ) -> Result<(), Error> {
        let mut want = self.host.clone();
        let want_result = step.reference(&mut want);
        let got_result = match mode {
            Mode::Checked => kvplan::ops::plan(&mut self.plans, inputs)
                .and_then(|status| status.check().map(drop)),
            Mode::Deferred => {
                let status = kvplan::ops::plan(&mut self.plans, inputs).unwrap_or_else(|error| {
                    panic!("{what}: deferred plan refused at once: {error}")
                });
                // The plans are final before anyone looks at the status.
                let before = self.read();
                match &want_result {
                    Ok(()) => {
                        assert_plans_eq(&before, &want, &format!("{what} (deferred, before check)"))
                    }
                    Err(_) => assert_disabled(&before, &format!("{what} (deferred, before check)")),
                }
                status.check().map(drop)
            }
        };
        assert_eq!(got_result, want_result, "{what} ({mode:?}): result");
        let got = self.read();
        match &want_result {
            Ok(()) => assert_plans_eq(&got, &want, &format!("{what} ({mode:?})")),
            Err(_) => assert_disabled(&got, &format!("{what} ({mode:?})")),
        }
        self.host = got;
        got_result
    }
}

#[derive(Debug, Clone, Copy)]
enum Lut {
    None,
    Identity,
    Shifted,
    Permuted,
}

/// A random valid-looking step over a random table; the caller picks bs.
fn random_step(rng: &mut Rng, bs: usize) -> Step {
    let rows = rng.urange(2, 6);
    let cols = rng.urange(1, 24);
    let mut window = rng.pick(&[0, 0, -1, 1, 2, 3, 5, cols as i32 + 5]);
    let mut lut_kind = rng.pick(&[
        Lut::None,
        Lut::None,
        Lut::Identity,
        Lut::Shifted,
        Lut::Permuted,
    ]);
    if window > 0 && matches!(lut_kind, Lut::None) {
        lut_kind = Lut::Identity;
    }
    if rng.chance(1, 10) {
        window = 0;
    }
    let lut_len = rng.urange(rows * cols, rows * cols + 16);
    let lut: Option<Vec<i64>> = match lut_kind {
        Lut::None => None,
        Lut::Identity => Some((0..lut_len as i64).collect()),
        Lut::Shifted => Some((0..lut_len as i64).map(|i| i + 1000).collect()),
        Lut::Permuted => {
            let mut lut: Vec<i64> = (0..lut_len as i64).collect();
            rng.shuffle(&mut lut);
            for entry in lut.iter_mut() {
                if rng.chance(1, 10) {
                    *entry = -1;
                }
            }
            Some(lut)
        }
    };
    let table: Vec<i64> = (0..rows * cols)
        .map(|_| match (&lut, rng.below(10)) {
            (_, 0) => rng.range(-3, -1),
            (Some(lut), _) => rng.range(0, lut.len() as i64 - 1),
            (None, 1) => i32::MAX as i64,
            (None, _) => rng.range(0, i32::MAX as i64),
        })
        .collect();
    let mut step = Step::new(rows, cols, table).window(window, lut);
    step.dtypes = [0; 7].map(|_| rng.int_dtype());
    step = with_batch(rng, step, bs);
    if rng.chance(2, 5) {
        let pool_cols = cols + rng.urange(0, 2);
        let data = (0..rows * pool_cols).map(|_| rng.i32_value()).collect();
        let valid_lens: Vec<i64> = (0..bs).map(|_| rng.range(-1, pool_cols as i64)).collect();
        let offset = rng.pick(&[-1, 0, 1]);
        // Keep every read inside the pool: the largest column read is < pool_cols.
        let valid_lens = valid_lens
            .iter()
            .map(|&v| v.min(pool_cols as i64))
            .collect::<Vec<_>>();
        step = step.pool(rows, pool_cols, data, &valid_lens, offset);
    }
    step
}

/// A new random batch of `bs` requests over `step`'s table (pool valid lengths redrawn too).
fn with_batch(rng: &mut Rng, mut step: Step, bs: usize) -> Step {
    let (rows, cols) = (step.rows, step.cols);
    step.rpi = (0..bs)
        .map(|_| {
            if rng.chance(1, 4) {
                0
            } else {
                rng.range(1, rows as i64 - 1)
            }
        })
        .collect();
    step.prefix = step
        .rpi
        .iter()
        .map(|&q| {
            if q == 0 && rng.chance(1, 2) {
                // Padding rows carry anything (that fits the tensor's dtype).
                if step.dtypes[1] == DType::I64 {
                    rng.pick(&[-7, cols as i64 + 1, 1 << 40, i64::MAX, i64::MIN])
                } else {
                    rng.pick(&[-7, cols as i64 + 1, i32::MAX as i64, i32::MIN as i64])
                }
            } else if rng.chance(1, 4) {
                cols as i64
            } else {
                rng.range(-1, cols as i64)
            }
        })
        .collect();
    step.extend = (0..bs).map(|_| rng.range(-1, 4)).collect();
    if let Some((_, pool_cols, _)) = &step.pool {
        step.valid_lens = (0..bs).map(|_| rng.range(-1, *pool_cols as i64)).collect();
    }
    step
}

/// Random batches, each run on plans poisoned by a different prior run, then reused with a
/// smaller batch; capacity fitting exactly, roomy, overflowing by one and by many, and large
/// enough for any batch (one launch, no count launch).
pub fn random_plans<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x706c_616e);
    for case in 0..30 {
        random_plan_case::<B>(&mut rng, case, device);
    }
}

/// Case `case` of [`random_plans`]: fresh plans, a poisoning batch, the batch, a smaller batch.
pub fn random_plan_case<B: KvPlanBackend>(rng: &mut Rng, case: usize, device: &B::Device) {
    let bs = rng.pick(&[0, 1, 2, 5, 9, 17]);
    let step = random_step(rng, bs);
    let total = step.verify_total();
    let verify_capacity = match case % 5 {
        0 => total.max(1),
        1 => total + rng.urange(1, 8),
        2 => total.saturating_sub(1).max(1),
        3 => (total / 4).max(1),
        _ => step.largest_total().max(1),
    };
    let write_capacity = (bs + rng.urange(0, 2)).max(1);
    let mode = MODES[case % 2];
    let mut mirror = Mirror::<B>::new(verify_capacity, write_capacity, device);
    // Poison: a different batch (up to K requests) fills the plans first.
    let poison_bs = rng.urange(0, write_capacity);
    let poison = with_batch(rng, step.clone(), poison_bs);
    let what = format!("case {case}: {step:?}");
    mirror
        .step(&poison, mode, &format!("{what} [poison]"))
        .unwrap();
    mirror.step(&step, mode, &what).unwrap();
    let smaller_bs = rng.urange(0, bs);
    let smaller = with_batch(rng, step.clone(), smaller_bs);
    mirror
        .step(
            &smaller,
            MODES[(case + 1) % 2],
            &format!("{what} [smaller batch]"),
        )
        .unwrap();
}

/// Overflow by exactly one and by many keeps every verify array stale.
pub fn overflow<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6f76_6572);
    for mode in MODES {
        for shrink in [1, 7, 100] {
            let step = loop {
                let step = random_step(&mut rng, 8);
                if step.verify_total() > shrink {
                    break step;
                }
            };
            let total = step.verify_total();
            let mut mirror = Mirror::<B>::new(total - shrink, 8, device);
            // A fitting batch first, so that there is something to keep.
            let mut fitting = step.clone();
            fitting.prefix.iter_mut().for_each(|p| *p = (*p).min(1));
            mirror.step(&fitting, mode, "fitting").unwrap();
            let before = mirror.read();
            mirror
                .step(&step, mode, &format!("overflow by {shrink}"))
                .unwrap();
            let after = mirror.read();
            assert_eq!(
                (after.verify_num_valid, after.enable),
                ((total - shrink) as i32, 0)
            );
            assert_eq!(after.verify_slot_indices, before.verify_slot_indices);
            assert_eq!(after.verify_expected_tokens, before.verify_expected_tokens);
            assert_eq!(
                after.verify_expected_positions,
                before.verify_expected_positions
            );
            assert_eq!(
                after.verify_prev_slot_indices,
                before.verify_prev_slot_indices
            );
        }
    }
}

/// The spec's worked examples A, F and G, with exact whole buffers.
pub fn spec_examples<B: KvPlanBackend>(device: &B::Device) {
    let linear = |rows: usize, cols: usize| (0..(rows * cols) as i64).collect::<Vec<_>>();
    for mode in MODES {
        // A.
        let mut mirror = Mirror::<B>::new(64, 8, device);
        mirror
            .step(
                &Step::new(4, 16, linear(4, 16)).batch(&[1, 2, 3], &[0, 4, 10], &[8, 1, 1]),
                mode,
                "A",
            )
            .unwrap();
        let got = mirror.read();
        assert_eq!(got.verify_num_valid, 14);
        assert_eq!(
            &got.verify_slot_indices[..14],
            &[32, 33, 34, 35, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]
        );
        assert_eq!(
            &got.verify_prev_slot_indices[..6],
            &[-1, 32, 33, 34, -1, 48]
        );
        assert_eq!(got.write_offsets, vec![0, 8, 9, 10, 0, 0, 0, 0, 0]);
        assert_eq!(&got.write_seed_slot_indices[..3], &[-1, 35, 57]);
        assert_eq!(got.write_num_valid_reqs, 3);
        // F.
        let mut mirror = Mirror::<B>::new(6, 2, device);
        mirror
            .step(
                &Step::new(4, 8, linear(4, 8)).batch(&[1, 2], &[3, 4], &[1, 1]),
                mode,
                "F",
            )
            .unwrap();
        let got = mirror.read();
        assert_eq!((got.verify_num_valid, got.enable), (6, 0));
        assert_eq!(got.verify_slot_indices, vec![0; 6]);
        assert_eq!(got.write_offsets, vec![0, 1, 2]);
        assert_eq!(got.write_seed_slot_indices, vec![10, 19]);
        // G.
        let mut mirror = Mirror::<B>::new(16, 4, device);
        let base = Step::new(4, 8, linear(4, 8));
        mirror
            .step(
                &base
                    .clone()
                    .batch(&[1, 2, 3, 1], &[2, 3, 4, 5], &[1, 1, 1, 1]),
                mode,
                "G run 1",
            )
            .unwrap();
        mirror
            .step(&base.batch(&[1], &[3], &[1]), mode, "G run 2")
            .unwrap();
        let got = mirror.read();
        assert_eq!(
            got.verify_slot_indices,
            vec![8, 9, 10, 17, 18, 24, 25, 26, 27, 8, 9, 10, 11, 12, 0, 0]
        );
        assert_eq!(got.write_seed_slot_indices, vec![10, 18, 27, 12]);
        assert_eq!(got.write_offsets, vec![0, 1, 0, 0, 0]);
        assert_eq!(
            (got.verify_num_valid, got.enable, got.write_num_valid_reqs),
            (3, 1, 1)
        );
    }
}

/// Batches far past one block (no 4096 cap; the bs = 65,536), mixed with padding rows;
/// then a wide table, where every request is a tile of its own (hundreds of chained tiles), with
/// a capacity for any batch (one launch) and one that the plan overflows.
pub fn large_batch<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6c61_7267);
    let (rows, cols) = (4, 4100);
    let table = (0..rows * cols)
        .map(|_| rng.range(0, i32::MAX as i64))
        .collect();
    let wide = with_batch(&mut rng, Step::new(rows, cols, table), 300);
    let total = wide.verify_total();
    for (mode, capacity) in [
        (Mode::Deferred, wide.largest_total()),
        (Mode::Checked, total - 1),
    ] {
        let mut mirror = Mirror::<B>::new(capacity, 301, device);
        let what = format!("wide table, bs=300 V={capacity}");
        mirror.step(&wide, mode, &what).unwrap();
        let smaller = with_batch(&mut rng, wide.clone(), 77);
        mirror
            .step(&smaller, mode, &format!("{what} [smaller batch]"))
            .unwrap();
    }
    for bs in [5000, 65_536] {
        let mut step = random_step(&mut rng, bs);
        step = with_batch(&mut rng, step, bs);
        let total = step.verify_total();
        for (mode, capacity) in [
            (Mode::Checked, total + 3),
            (Mode::Deferred, total.max(2) - 1),
        ] {
            let mut mirror = Mirror::<B>::new(capacity.max(1), bs + 1, device);
            mirror
                .step(&step, mode, &format!("bs={bs} V={capacity}"))
                .unwrap();
            let smaller = with_batch(&mut rng, step.clone(), 4097);
            mirror
                .step(&smaller, mode, &format!("bs=4097 after bs={bs}"))
                .unwrap();
        }
    }
}

/// Non-contiguous inputs (a transposed table and pool, offset slices of the per-request lists
/// and the LUT) are read through their layout: the kernels take every stride from the launch, so
/// each input's is exercised here against the reference on the same values.
pub fn strided_inputs<B: KvPlanBackend>(device: &B::Device) {
    let mut rng = Rng::new(0x6c61_796f);
    let mut planned = 0;
    for round in 0..6 {
        let mut step = random_step(&mut rng, 7);
        let (rows, cols) = (step.rows, step.cols);
        // A reversed LUT of the same length keeps the table's slots inside it.
        if let Some(len) = step.lut.as_ref().map(Vec::len) {
            step = step.window(3, Some((0..len as i64).rev().collect()));
        }
        if step.pool.is_none() {
            let data = (0..rows * (cols + 1)).map(|_| rng.i32_value()).collect();
            let valid_lens: Vec<i64> = (0..7).map(|_| rng.range(-1, cols as i64 + 1)).collect();
            step = step.pool(rows, cols + 1, data, &valid_lens, 1);
        }
        let d = step.dtypes;
        // `data` as the transpose of a [cols, rows] tensor.
        let transposed = |data: &[i64], rows: usize, cols: usize, dtype: DType| {
            let t: Vec<i64> = (0..cols)
                .flat_map(|c| (0..rows).map(move |r| data[r * cols + c]))
                .collect();
            int_transpose::<B>(ints::<B, 2>(&t, [cols, rows], dtype, device))
        };
        // `data` as the slice 3.. of a longer list.
        let sliced = |data: &[i64], dtype: DType| {
            let long: Vec<i64> = [0, 1, 2].into_iter().chain(data.iter().copied()).collect();
            int_slice::<B>(list::<B>(&long, dtype, device), &[3..3 + data.len()])
        };
        let mut inputs = PlanInputs::<B>::from_primitives(
            sliced(&step.rpi, d[0]),
            sliced(&step.prefix, d[1]),
            sliced(&step.extend, d[2]),
            transposed(&step.table, rows, cols, d[3]),
        )
        .swa_window_size(step.window)
        .position_offset(step.offset);
        if let Some(lut) = &step.lut {
            inputs = inputs.full_to_swa_index_mapping_primitive(sliced(lut, d[4]));
        }
        if let Some((pool_rows, pool_cols, data)) = &step.pool {
            inputs = inputs.expected_tokens_primitive(
                transposed(data, *pool_rows, *pool_cols, d[5]),
                sliced(&step.valid_lens, d[6]),
            );
        }
        let mut mirror = Mirror::<B>::new(step.largest_total().max(1), 8, device);
        let what = format!("strided round {round}: {step:?}");
        // Device-checked errors are compared like results: both sides must agree.
        if mirror
            .step_with(&step, inputs, MODES[round % 2], &what)
            .is_ok()
        {
            planned += 1;
        }
    }
    // Most rounds must fill entries, not stop at an error.
    assert!(planned >= 4, "only {planned} of 6 strided rounds planned");
}
