//! The decoder's projection (`kvplan_decoder::linear`) against its host reference, on Flex (Burn's
//! ops; the op's own body, the reference, where a case calls the op), Vulkan and CUDA (the kernel;
//! f64 where the device's f64 is exact, and f32):
//! random inputs from a fixed seed, with and without the norm, each of nothing, a residual, RoPE
//! and SwiGLU after; token counts across the kernel's blocks (its plane's columns and its rounds
//! of loads in flight follow the count) and past `MAX_TOKENS` (Burn's ops),
//! shapes off every tile multiple, weights whose rows are strided past their width; and each
//! token's output the same bits alone as beside others. The greedy-token op against its host
//! reference.

use burn_core::tensor::{DType, Device, Tensor, TensorData};

use burn_core::backend::{Dispatch, DispatchDevice};
use kvplan_decoder::linear::{
    Around, LinearBackend, MAX_TOKENS, Rope, RopeShape, Weight, greedy, linear, linear_rope,
    linear_swiglu, reference, rms_norm_reference, rope_reference, swiglu_reference,
};
use kvplan_decoder::model::exp_is_64_bit;
use kvplan_decoder::sample::Rng;

/// RoPE's head in these cases: two pairs.
const HEAD_DIM: usize = 4;

fn random(rng: &mut Rng, len: usize) -> Vec<f64> {
    (0..len).map(|_| rng.uniform() * 2.0 - 1.0).collect()
}

/// `values` rounded to `dtype` (the inputs the device holds, so the reference sees them too).
fn rounded(values: Vec<f64>, dtype: DType) -> Vec<f64> {
    let len = values.len();
    TensorData::new(values, [len])
        .convert_dtype(dtype)
        .convert::<f64>()
        .try_to_vec::<f64>()
        .unwrap()
}

/// A relative tolerance: one rounding to a half-precision output after f32 sums (a sum kept in
/// half precision misses it by far), or several of Burn's ops' roundings (`ops`: the normed input is rounded before a sum of up to 1,100 products, a matmul's
/// output is rounded before SwiGLU, whose `up` scales the gate's rounding); `None` for the wider
/// dtypes, whose tolerances each case sets.
fn half_tolerance(dtype: DType, ops: bool, swiglu: bool) -> Option<f64> {
    let ulp = match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => return None,
    };
    Some(match (ops, swiglu) {
        (false, _) => ulp,
        (true, false) => 16.0 * ulp,
        (true, true) => 24.0 * ulp,
    })
}

fn upload(values: &[f64], shape: [usize; 2], device: &Device, dtype: DType) -> Tensor<2> {
    Tensor::from_data(TensorData::new(values.to_vec(), shape), (device, dtype))
}

fn values(tensor: Tensor<2>) -> Vec<f64> {
    tensor
        .into_data()
        .convert::<f64>()
        .try_to_vec::<f64>()
        .unwrap()
}

/// `got` has `expected`'s length and each value within `tolerance * (1 + |expected|)` of it.
fn assert_close(got: &[f64], expected: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}: length");
    for (i, (g, e)) in got.iter().zip(expected).enumerate() {
        assert!(
            (g - e).abs() <= tolerance * (1.0 + e.abs()),
            "{what}: element {i}: {g} against {e}"
        );
    }
}

/// What follows the projection.
#[derive(Debug, Clone, Copy, PartialEq)]
enum After {
    Nothing,
    Residual,
    Rope,
    /// SwiGLU of each column pair, gate then up (the gate/up projection).
    SwiGlu,
}

/// One case's device inputs: `x`, the weight's rows, the residual, RoPE's angles.
struct Inputs {
    x: Tensor<2>,
    w: Tensor<2>,
    residual: Tensor<2>,
    rope: Rope,
}

impl Inputs {
    /// Token `t`'s rows alone.
    fn token(&self, t: usize) -> Self {
        Self {
            x: self.x.clone().narrow(0, t, 1),
            w: self.w.clone(),
            residual: self.residual.clone().narrow(0, t, 1),
            rope: Rope {
                cos: self.rope.cos.clone().narrow(0, t, 1),
                sin: self.rope.sin.clone().narrow(0, t, 1),
                shape: self.rope.shape,
            },
        }
    }

    /// The projection, after a NaN tensor of the output's size has been freed (its memory is what
    /// the output most likely gets: an element the kernel misses stays NaN).
    fn run(&self, after: After, norm_eps: Option<f64>) -> Vec<f64> {
        let [tokens, outputs] = [self.x.dims()[0], self.w.dims()[0]];
        let columns = if after == After::SwiGlu {
            outputs / 2
        } else {
            outputs
        };
        let poison = Tensor::<2>::full(
            [tokens, columns],
            f64::NAN,
            (&self.x.device(), self.x.dtype()),
        );
        drop(poison.into_data());
        let (x, w) = (self.x.clone(), Weight::new(self.w.clone()));
        values(match after {
            After::Nothing => linear(x, &w, None, norm_eps),
            After::Residual => linear(x, &w, Some(self.residual.clone()), norm_eps),
            After::Rope => linear_rope(x, &w, &self.rope, norm_eps),
            After::SwiGlu => linear_swiglu(x, &w, norm_eps),
        })
    }
}

/// The projection in f32, in half precision (bf16, or f16 where the device has no bf16), and in
/// f64 where the device computes f64 exactly (not Vulkan's SPIR-V); inputs that do not fit each
/// other give NaN, never a read past an input.
pub fn matches_reference(device: &Device) {
    if exp_is_64_bit(device) {
        matches_reference_in(device, DType::F64);
    }
    matches_reference_in(device, DType::F32);
    let half = crate::common::half::<burn_core::backend::Dispatch>(device.as_dispatch());
    matches_reference_in(device, half);
    wide_matches_reference(device, half);
    rope_matches_reference(device, half);
    swiglu_matches_reference(device, DType::F32);
    swiglu_matches_reference(device, half);
    if exp_is_64_bit(device) {
        swiglu_matches_reference(device, DType::F64);
    }
    rms_norm_matches_reference(device, DType::F32);
    rms_norm_matches_reference(device, half);
    if exp_is_64_bit(device) {
        rms_norm_matches_reference(device, DType::F64);
    }
    misfits_are_nan(device);
    rope_matches_reference(device, DType::F32);
    wide_matches_reference(device, DType::F32);
    if exp_is_64_bit(device) {
        rope_matches_reference(device, DType::F64);
        wide_matches_reference(device, DType::F64);
    }
    greedy_matches_reference(device, DType::F32);
    if exp_is_64_bit(device) {
        greedy_matches_reference(device, DType::F64);
    }
}

/// The op itself at wide steps (the kernel on a GPU, up to `MAX_TOKENS` in serving; here past it
/// too) against the reference: every
/// `Around`, several blocks of tokens and of columns with partial ones, weights whose rows are
/// strided past their width.
fn wide_matches_reference(device: &Device, dtype: DType) {
    let mut rng = Rng::new(0x711E);
    let tolerance = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
    let pairs = HEAD_DIM / 2;
    // 600 values a row: the block kernel splits each row into parts, a plane each.
    let shapes = [
        (17, 70, 12),
        (33, 64, 130),
        (40, 37, 9),
        (64, 100, 64),
        (33, 600, 20),
    ];
    for (tokens, inner, outputs) in shapes {
        let mut random = |len| rounded(random(&mut rng, len), dtype);
        let x = random(tokens * inner);
        let wide = random(outputs * (inner + 3));
        let w: Vec<f64> = wide
            .chunks(inner + 3)
            .flat_map(|row| row[..inner].to_vec())
            .collect();
        let residual = random(tokens * outputs);
        let (cos, sin) = (random(tokens * pairs), random(tokens * pairs));
        let rotated = outputs / 2 / HEAD_DIM * HEAD_DIM;
        for (swiglu, add, rope, norm_eps) in [
            (false, false, false, None),
            (false, true, false, Some(1e-5)),
            (false, false, true, Some(1e-5)),
            (true, false, false, Some(1e-5)),
        ] {
            if swiglu && outputs % 2 == 1 {
                continue;
            }
            let around = Around {
                norm_eps,
                swiglu,
                add,
                rope: rope.then_some(RopeShape {
                    rotated,
                    head_dim: HEAD_DIM,
                }),
            };
            let input = &x[..];
            let device_x = upload(input, [tokens, inner], device, dtype);
            let device_w = upload(&wide, [outputs, inner + 3], device, dtype).narrow(1, 0, inner);
            let device_residual = upload(&residual, [tokens, outputs], device, dtype);
            let out = if rope {
                <Dispatch as LinearBackend>::linear_rope(
                    device_x.into_dispatch(),
                    device_w.into_dispatch(),
                    upload(&cos, [tokens, pairs], device, dtype).into_dispatch(),
                    upload(&sin, [tokens, pairs], device, dtype).into_dispatch(),
                    around,
                )
            } else {
                <Dispatch as LinearBackend>::linear(
                    device_x.into_dispatch(),
                    device_w.into_dispatch(),
                    device_residual.into_dispatch(),
                    around,
                )
            };
            let got = values(Tensor::from_dispatch(out));
            let angles = Some([cos.as_slice(), sin.as_slice()]);
            let expected = reference(
                input,
                &w,
                &residual,
                angles,
                [tokens, inner, outputs],
                around,
            );
            let what = format!("{tokens} x {inner} -> {outputs}, {around:?}, {dtype:?}");
            // `silu(gate) * up` scales the gate's rounding by `up`.
            let tolerance = if swiglu && dtype == DType::F32 {
                1e-3
            } else if swiglu && dtype == DType::F64 {
                // As `matches_reference_in`'s (CUDA missed 1e-12 by 3% here).
                1e-11
            } else {
                half_tolerance(dtype, false, swiglu).unwrap_or(tolerance)
            };
            assert_close(&got, &expected, tolerance, &what);
        }
    }
}

/// The RoPE op (the steps past `MAX_TOKENS`) against its host reference: rows that are a view of
/// wider ones, columns past the turned heads, more values than a launch's first row of cubes.
fn rope_matches_reference(device: &Device, dtype: DType) {
    let mut rng = Rng::new(0x2095);
    let pairs = HEAD_DIM / 2;
    for (tokens, heads, width) in [(1, 1, HEAD_DIM), (21, 3, 5 * HEAD_DIM + 3), (300, 9, 960)] {
        let mut random = |len| rounded(random(&mut rng, len), dtype);
        let (wide, cos, sin) = (
            random(tokens * (width + 5)),
            random(tokens * pairs),
            random(tokens * pairs),
        );
        let y = upload(&wide, [tokens, width + 5], device, dtype).narrow(1, 5, width);
        let shape = RopeShape {
            rotated: heads * HEAD_DIM,
            head_dim: HEAD_DIM,
        };
        let plain: Vec<f64> = wide
            .chunks(width + 5)
            .flat_map(|row| row[5..].to_vec())
            .collect();
        let expected = rope_reference(&plain, &cos, &sin, width, shape);
        let got = values(Tensor::from_dispatch(<Dispatch as LinearBackend>::rope(
            y.into_dispatch(),
            upload(&cos, [tokens, pairs], device, dtype).into_dispatch(),
            upload(&sin, [tokens, pairs], device, dtype).into_dispatch(),
            shape,
        )));
        // Two products and a sum, rounded in the dtype (or fused).
        let tolerance = match dtype {
            DType::F64 => 1e-14,
            DType::F32 => 1e-6,
            // Flex turns in Burn's ops, rounding each.
            _ => {
                let flex = matches!(device.as_dispatch(), DispatchDevice::Flex(_));
                half_tolerance(dtype, flex, false).unwrap()
            }
        };
        let what = format!("RoPE {tokens} x {width}, {dtype:?}");
        assert_close(&got, &expected, tolerance, &what);
    }
}

/// The SwiGLU op (the steps past `MAX_TOKENS`) against its host reference: rows that are a view of
/// wider ones, more values than a launch's first row of cubes; an odd width is NaN.
fn swiglu_matches_reference(device: &Device, dtype: DType) {
    let mut rng = Rng::new(0x5161);
    for (tokens, width) in [(1, 2), (17, 70), (300, 3072)] {
        // Gates and ups up to 8: the exp and the product both matter.
        let wide: Vec<f64> = rounded(random(&mut rng, tokens * (width + 5)), dtype)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let y = upload(&wide, [tokens, width + 5], device, dtype).narrow(1, 5, width);
        let plain: Vec<f64> = wide
            .chunks(width + 5)
            .flat_map(|row| row[5..].to_vec())
            .collect();
        let got = values(Tensor::from_dispatch(<Dispatch as LinearBackend>::swiglu(
            y.into_dispatch(),
        )));
        let tolerance = match dtype {
            DType::F64 => 1e-13,
            DType::F32 => 1e-6,
            _ => half_tolerance(dtype, false, true).unwrap(),
        };
        let what = format!("SwiGLU {tokens} x {width}, {dtype:?}");
        assert_close(&got, &swiglu_reference(&plain), tolerance, &what);
    }
    let odd = upload(&[0.5; 6], [2, 3], device, dtype);
    let out = Tensor::<2>::from_dispatch(<Dispatch as LinearBackend>::swiglu(odd.into_dispatch()));
    assert_eq!(out.dims(), [2, 1], "SwiGLU of an odd width: shape");
    assert!(
        values(out).iter().all(|v| v.is_nan()),
        "SwiGLU of an odd width: NaN"
    );
}

/// The RMSNorm op against the host's: rows strided past their width, widths below, at and past a
/// cube's units, values up to 8.
fn rms_norm_matches_reference(device: &Device, dtype: DType) {
    let mut rng = Rng::new(0x4A5);
    let eps = 1e-5;
    for (tokens, width) in [(1, 3), (17, 256), (33, 576), (5, 1536)] {
        let wide: Vec<f64> = rounded(random(&mut rng, tokens * (width + 3)), dtype)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let x = upload(&wide, [tokens, width + 3], device, dtype).narrow(1, 3, width);
        let plain: Vec<f64> = wide
            .chunks(width + 3)
            .flat_map(|row| row[3..].to_vec())
            .collect();
        let got = values(Tensor::from_dispatch(
            <Dispatch as LinearBackend>::rms_norm(x.into_dispatch(), eps),
        ));
        let tolerance = match dtype {
            DType::F64 => 1e-13,
            DType::F32 => 1e-6,
            _ => half_tolerance(dtype, false, false).unwrap(),
        };
        let what = format!("RMSNorm {tokens} x {width}, {dtype:?}");
        assert_close(
            &got,
            &rms_norm_reference(&plain, width, eps),
            tolerance,
            &what,
        );
    }
    // Not a matrix: NaN of its shape, no launch.
    let cube = Tensor::<3>::from_data(TensorData::new(vec![0.5; 12], [2, 3, 2]), (device, dtype));
    let out = Tensor::<3>::from_dispatch(<Dispatch as LinearBackend>::rms_norm(
        cube.into_dispatch(),
        eps,
    ));
    assert_eq!(out.dims(), [2, 3, 2], "RMSNorm of a 3-D tensor: shape");
    let read = out.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    assert!(
        read.iter().all(|v| v.is_nan()),
        "RMSNorm of a 3-D tensor: NaN"
    );
}

/// Each row's greedy token against the host's: random logits with the row's largest value
/// planted again later in the row (the first wins) and once as the last column, vocabularies off
/// the kernel's round of loads, rows strided past their width.
fn greedy_matches_reference(device: &Device, dtype: DType) {
    let mut rng = Rng::new(41);
    for (rows, vocab) in [
        (1, 49_152),
        (3, 1_000),
        (2, 7),
        (5, 8_193),
        (1, 1),
        (4, 600),
    ] {
        let wide = vocab + 3;
        let mut data = random(&mut rng, rows * wide);
        for r in 0..rows {
            let row = &mut data[r * wide..][..vocab];
            let top = (rng.uniform() * vocab as f64) as usize % vocab;
            row[top] = 2.0;
            if top + 1 < vocab {
                row[vocab - 1] = 2.0;
            }
            if r % 2 == 1 && vocab > 1 {
                // A tie with the first column.
                row[0] = 2.0;
            }
        }
        let logits = upload(&data, [rows, wide], device, dtype).narrow(1, 0, vocab);
        let stored = values(logits.clone());
        let expected = kvplan_decoder::linear::greedy_reference(&stored, vocab);
        let got: Vec<i64> = greedy(logits)
            .into_data()
            .convert::<i64>()
            .try_to_vec::<i64>()
            .unwrap();
        assert_eq!(got, expected, "greedy tokens, {rows} x {vocab}, {dtype:?}");
    }
    // Rows without logits: token 0 each.
    let empty = upload(&[], [2, 0], device, dtype);
    let got: Vec<i64> = greedy(empty)
        .into_data()
        .convert::<i64>()
        .try_to_vec::<i64>()
        .unwrap();
    assert_eq!(got, vec![0, 0], "greedy tokens of empty rows, {dtype:?}");
}

/// Through the extension op itself (the public functions only make fitting calls): an input of
/// the wrong width, a residual of the wrong shape, RoPE without angles, over an odd head, past
/// the columns or with another token count's angles.
fn misfits_are_nan(device: &Device) {
    let tensor = |shape: [usize; 2]| Tensor::<2>::ones(shape, (device, DType::F32));
    let around = Around {
        norm_eps: None,
        swiglu: false,
        add: false,
        rope: None,
    };
    let rope = RopeShape {
        rotated: 4,
        head_dim: 4,
    };
    let call = |x: Tensor<2>, residual: Tensor<2>, around: Around| {
        Tensor::<2>::from_dispatch(<Dispatch as LinearBackend>::linear(
            x.into_dispatch(),
            tensor([6, 8]).into_dispatch(),
            residual.into_dispatch(),
            around,
        ))
    };
    let cases = [
        (
            "x narrower than w",
            call(tensor([3, 7]), tensor([3, 6]), around),
        ),
        (
            "SwiGLU with a residual",
            call(
                tensor([3, 8]),
                tensor([3, 6]),
                Around {
                    swiglu: true,
                    add: true,
                    ..around
                },
            ),
        ),
        (
            "SwiGLU of an odd column",
            Tensor::from_dispatch(<Dispatch as LinearBackend>::linear(
                tensor([3, 8]).into_dispatch(),
                tensor([7, 8]).into_dispatch(),
                tensor([3, 7]).into_dispatch(),
                Around {
                    swiglu: true,
                    ..around
                },
            )),
        ),
        (
            "residual of the wrong shape",
            call(
                tensor([3, 8]),
                tensor([3, 5]),
                Around {
                    add: true,
                    ..around
                },
            ),
        ),
        (
            "RoPE without angles",
            call(
                tensor([3, 8]),
                tensor([3, 6]),
                Around {
                    rope: Some(rope),
                    ..around
                },
            ),
        ),
        (
            "RoPE over an odd head",
            Tensor::from_dispatch(<Dispatch as LinearBackend>::linear_rope(
                tensor([3, 8]).into_dispatch(),
                tensor([6, 8]).into_dispatch(),
                tensor([3, 1]).into_dispatch(),
                tensor([3, 1]).into_dispatch(),
                Around {
                    rope: Some(RopeShape {
                        rotated: 3,
                        head_dim: 3,
                    }),
                    ..around
                },
            )),
        ),
        (
            "RoPE past the columns",
            Tensor::from_dispatch(<Dispatch as LinearBackend>::rope(
                tensor([3, 6]).into_dispatch(),
                tensor([3, 4]).into_dispatch(),
                tensor([3, 4]).into_dispatch(),
                RopeShape {
                    rotated: 8,
                    head_dim: 8,
                },
            )),
        ),
        (
            "RoPE with angles of other tokens",
            Tensor::from_dispatch(<Dispatch as LinearBackend>::rope(
                tensor([3, 6]).into_dispatch(),
                tensor([2, 2]).into_dispatch(),
                tensor([2, 2]).into_dispatch(),
                rope,
            )),
        ),
    ];
    for (what, out) in cases {
        // SwiGLU's output: a column a pair.
        let columns = if what.starts_with("SwiGLU") { 3 } else { 6 };
        assert_eq!(out.dims(), [3, columns], "{what}: shape");
        assert!(values(out).iter().all(|v| v.is_nan()), "{what}: NaN");
    }
}

fn matches_reference_in(device: &Device, dtype: DType) {
    let flex = matches!(device.as_dispatch(), DispatchDevice::Flex(_));
    let mut rng = Rng::new(0x11EA);
    let tolerance = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
    let cases = [
        (1, 576, 40),
        (2, 100, 9),
        (3, 37, 17),
        (8, 300, 64),
        (11, 129, 31),
        (33, 64, 8),
        (16, 70, 12),
        (21, 70, 12),
        (MAX_TOKENS + 5, 70, 12),
        // Long rows at a few tokens: a lane's rounds of loads in several batches in flight.
        (1, 1100, 30),
        (3, 2052, 20),
        // Many columns against the row (whole and odd vectors, every block of rows).
        (1, 64, 200),
        (6, 96, 256),
        (8, 1100, 2500),
        (13, 30, 61),
    ];
    for (case, &(tokens, inner, outputs)) in cases.iter().enumerate() {
        let mut random = |len| rounded(random(&mut rng, len), dtype);
        let (x, w) = (random(tokens * inner), random(outputs * inner));
        let residual = random(tokens * outputs);
        let pairs = HEAD_DIM / 2;
        let (cos, sin) = (random(tokens * pairs), random(tokens * pairs));
        // Half the columns turned, in whole heads (as the queries and keys before the values).
        let shape = RopeShape {
            rotated: outputs / 2 / HEAD_DIM * HEAD_DIM,
            head_dim: HEAD_DIM,
        };
        let inputs = Inputs {
            x: upload(&x, [tokens, inner], device, dtype),
            // Odd cases' weights are a view of wider rows (as CUDA pitches a matrix's rows).
            w: if case % 2 == 1 {
                let wide: Vec<f64> = w
                    .chunks(inner)
                    .flat_map(|row| row.iter().copied().chain([f64::NAN; 3]))
                    .collect();
                upload(&wide, [outputs, inner + 3], device, dtype).narrow(1, 0, inner)
            } else {
                upload(&w, [outputs, inner], device, dtype)
            },
            residual: upload(&residual, [tokens, outputs], device, dtype),
            rope: Rope {
                cos: upload(&cos, [tokens, pairs], device, dtype),
                sin: upload(&sin, [tokens, pairs], device, dtype),
                shape,
            },
        };
        for after in [After::Nothing, After::Residual, After::Rope, After::SwiGlu] {
            // SwiGLU takes whole pairs (odd columns: `misfits_are_nan`).
            if after == After::SwiGlu && outputs % 2 == 1 {
                continue;
            }
            let columns = if after == After::SwiGlu {
                outputs / 2
            } else {
                outputs
            };
            for norm_eps in [None, Some(1e-5)] {
                let what = format!(
                    "case {case} ({tokens} x {inner} -> {outputs}), norm {norm_eps:?}, {after:?}"
                );
                let around = Around {
                    norm_eps,
                    swiglu: after == After::SwiGlu,
                    add: after == After::Residual,
                    rope: (after == After::Rope).then_some(shape),
                };
                let angles = Some([cos.as_slice(), sin.as_slice()]);
                let expected =
                    reference(&x, &w, &residual, angles, [tokens, inner, outputs], around);
                let got = inputs.run(after, norm_eps);
                // Past `MAX_TOKENS` Burn's matmul runs, in TF32 on CUDA's tensor cores for f32:
                // each product rounded to 10 bits (about 1e-3), 70 of them summed.
                let ops = tokens > MAX_TOKENS || flex;
                let tolerance =
                    if let Some(half) = half_tolerance(dtype, ops, after == After::SwiGlu) {
                        half
                    } else if tokens > MAX_TOKENS && dtype == DType::F32 {
                        2e-2
                    } else if (flex || after == After::SwiGlu) && dtype == DType::F32 {
                        // Flex: Burn's norm and blocked matmul sum in other orders; `silu(gate) *
                        // up` scales the gate's rounding by `up` (about 10 here).
                        1e-3
                    } else if after == After::SwiGlu {
                        // The same in f64 (up to 55 here: CUDA missed 1e-12 by 5%).
                        1e-11
                    } else {
                        tolerance
                    };
                // Burn's ops in half precision round the normed input and the matmul's output:
                // past rows of about 128 their error outgrows any bound relative to the output.
                let half_ops = ops && half_tolerance(dtype, ops, false).is_some();
                if !half_ops || inner <= 128 {
                    assert_close(&got, &expected, tolerance, &what);
                }
                // Each token alone: the same bits as in the batch (a token's sums never depend on
                // the others, so a verify window and a plain step agree; Flex runs Burn's matmul).
                if tokens <= MAX_TOKENS && !flex {
                    for t in [0, tokens / 2, tokens - 1] {
                        let row = inputs.token(t).run(after, norm_eps);
                        let bits =
                            |values: &[f64]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&row),
                            bits(&got[t * columns..][..columns]),
                            "{what}: token {t}"
                        );
                    }
                }
            }
        }
    }
}
