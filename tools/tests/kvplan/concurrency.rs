//! Several threads calling the ops at once on one device, each with its own plans, canary and
//! store, all of them also reading one shared `req_to_token` (gathers, and `segment_assign` on
//! clones of it, which must copy rather than write it): every result equals the reference, and
//! the shared table is unchanged at the end. The same with the threads split over two devices.

use std::thread;

use burn_core::backend::tensor::IntTensor;
use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan::ops::KvStore;

use crate::common::{Rng, bools, ints, list, values};
use crate::gather::{
    MaskKind, check_exact, masked, random_masked_on, random_segments_on, random_table, run_masked,
    run_segments, segments,
};
use crate::slots::{Rows, broken, random_assign, random_loc, run_assign, run_store};

/// Threads calling the ops at once.
pub const THREADS: usize = 8;
/// Rounds of every op per thread.
pub const ROUNDS: usize = 3;

/// The shared table: `[ROWS, COLS]` int32.
const ROWS: usize = 16;
const COLS: usize = 48;

/// `THREADS` threads on `device`.
pub fn threads_on_one_device<B: KvPlanBackend>(device: &B::Device) {
    threads_on_devices::<B>(&[device.clone()]);
}

/// `THREADS` threads, alternately on each of `devices`, each device with its own shared table.
pub fn threads_on_devices<B: KvPlanBackend>(devices: &[B::Device]) {
    let mut rng = Rng::new(0x7468_7265_6164);
    let table = random_table(&mut rng, ROWS, COLS);
    let shared: Vec<IntTensor<B>> = devices
        .iter()
        .map(|device| ints::<B, 2>(&table, [ROWS, COLS], DType::I32, device))
        .collect();
    thread::scope(|scope| {
        for t in 0..THREADS {
            let on = t % devices.len();
            let (device, shared, table) = (&devices[on], &shared[on], &table);
            scope.spawn(move || one_thread::<B>(t, device, shared, table));
        }
    });
    for (on, shared) in shared.into_iter().enumerate() {
        assert_eq!(values::<B>(shared), table, "device {on}: the shared table");
    }
}

/// `ROUNDS` rounds of every op, on inputs seeded by the thread's number.
fn one_thread<B: KvPlanBackend>(
    t: usize,
    device: &B::Device,
    shared: &IntTensor<B>,
    table: &[i64],
) {
    let mut rng = Rng::new(0x7468_0000 + t as u64);
    let mut store = KvStore::<B>::allocate_on(64, device).unwrap();
    let mut cache = Rows::random(&mut rng, DType::F32, vec![64, 4]);
    let mut current = cache.primitive::<B>(device);
    for round in 0..ROUNDS {
        let what = |op: &str| format!("thread {t} round {round}: {op}");
        shared_gathers::<B>(&mut rng, device, shared, table, &what("shared table"));
        shared_assign::<B>(
            &mut rng,
            device,
            shared,
            table,
            &what("shared table assign"),
        );

        let own = (ROWS, COLS, random_table(&mut rng, ROWS, COLS));
        let (r, c) = (rng.urange(0, 9), rng.urange(0, 17));
        let case = random_masked_on(&mut rng, own.clone(), r, c, MaskKind::Random);
        run_masked::<B>(&case, device, &[r * c / 2], &what("masked gather"));
        let s = rng.urange(0, 9);
        let case = random_segments_on(&mut rng, own, s);
        run_segments::<B>(&case, device, &[3], &what("segment gather"));

        crate::plan::random_plan_case::<B>(&mut rng, round, device);
        crate::canary::random_scenario::<B>(rng.next_u64(), device);

        let bs = rng.urange(0, 12);
        let case = random_assign(&mut rng, bs, 8, 16);
        run_assign::<B>(&case, device, &what("segment_assign"));
        let case = broken(&mut rng, case);
        run_assign::<B>(&case, device, &what("segment_assign, broken"));

        for call in 0..2 {
            let loc = random_loc(&mut rng, 64, 20, call == 1);
            let rows = Rows::random(&mut rng, DType::F32, vec![loc.len(), 4]);
            let what = what(&format!("store call {call}"));
            let deferred = call == 0;
            current = run_store::<B>(
                &mut store, current, &mut cache, &loc, &rows, deferred, device, &what,
            );
        }
    }
}

/// A masked and a segment gather that only read the shared table.
fn shared_gathers<B: KvPlanBackend>(
    rng: &mut Rng,
    device: &B::Device,
    shared: &IntTensor<B>,
    table: &[i64],
    what: &str,
) {
    let on_table = || (ROWS, COLS, table.to_vec());
    let (r, c) = (rng.urange(1, 9), rng.urange(1, 17));
    let case = random_masked_on(rng, on_table(), r, c, MaskKind::Ragged);
    let got = masked::<B>(
        shared.clone(),
        list::<B>(&case.rpi, case.dtypes[1], device),
        ints::<B, 2>(&case.pos2d, [r, c], case.dtypes[2], device),
        bools::<B, 2>(&case.mask, [r, c], device),
    );
    check_exact::<B>(got, &case.reference(None), &format!("{what}: masked"));
    let s = rng.urange(1, 9);
    let case = random_segments_on(rng, on_table(), s);
    let got = segments::<B>(
        shared.clone(),
        list::<B>(&case.rpi, case.dtypes[1], device),
        (case.start.as_ref()).map(|start| list::<B>(start, case.dtypes[2], device)),
        list::<B>(&case.lengths, case.dtypes[3], device),
    );
    check_exact::<B>(got, &case.reference(None), &format!("{what}: segments"));
}

/// `segment_assign` on a clone of the shared table: the result is the reference's, written into
/// a copy (the shared table is checked once every thread is done).
fn shared_assign<B: KvPlanBackend>(
    rng: &mut Rng,
    device: &B::Device,
    shared: &IntTensor<B>,
    table: &[i64],
    what: &str,
) {
    let bs = rng.urange(1, 12);
    let mut case = random_assign(rng, bs, ROWS, COLS);
    if case.dtypes[0] != DType::I32 {
        // A case for an int64 table holds slots past int32: it runs on its own table.
        return run_assign::<B>(&case, device, what);
    }
    case.table = table.to_vec();
    let [_, rpi, start, lengths, loc] = case.tensors::<B>(device);
    let got = crate::common::checked_assign::<B>(shared.clone(), rpi, start, lengths, loc)
        .map(values::<B>);
    assert_eq!(got, case.reference(), "{what}");
}
