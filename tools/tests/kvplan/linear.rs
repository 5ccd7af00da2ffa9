//! The decoder's projection (`kvplan_decoder::linear`) against its host reference, on Flex (the
//! reference body), Vulkan and CUDA (the kernel; f64 where the device's f64 is exact, and f32): random inputs from a fixed seed, every combination of norm and residual, token counts
//! across the kernel's row blocks and past `MAX_TOKENS` (Burn's matmul), shapes off every tile
//! multiple, weights whose rows are strided past their width; and each token's output the same
//! bits alone as beside others.

use burn_core::tensor::{DType, Device, Tensor, TensorData};

use kvplan_decoder::linear::{Around, MAX_TOKENS, Weight, linear, reference};
use kvplan_decoder::model::exp_is_64_bit;
use kvplan_decoder::sample::Rng;

fn random(rng: &mut Rng, len: usize) -> Vec<f64> {
    (0..len).map(|_| rng.uniform() * 2.0 - 1.0).collect()
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

/// Runs `linear` after a NaN tensor of the output's size has been freed (its memory is what the
/// output most likely gets: an element the kernel misses stays NaN).
fn run([x, w, residual]: [&Tensor<2>; 3], add: bool, norm_eps: Option<f64>) -> Vec<f64> {
    let [tokens, outputs] = [x.dims()[0], w.dims()[0]];
    let poison = Tensor::<2>::full([tokens, outputs], f64::NAN, (&x.device(), x.dtype()));
    drop(poison.into_data());
    values(linear(
        x.clone(),
        &Weight::new(w.clone()),
        add.then(|| residual.clone()),
        norm_eps,
    ))
}

/// The projection in f32, and in f64 where the device computes f64 exactly (not Vulkan's SPIR-V).
pub fn matches_reference(device: &Device) {
    if exp_is_64_bit(device) {
        matches_reference_in(device, DType::F64);
    }
    matches_reference_in(device, DType::F32);
}

fn matches_reference_in(device: &Device, dtype: DType) {
    let mut rng = Rng::new(0x11EA);
    let tolerance = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
    let cases = [
        (1, 576, 40),
        (2, 100, 9),
        (3, 37, 17),
        (8, 300, 64),
        (11, 129, 31),
        (33, 64, 8),
        (MAX_TOKENS, 70, 12),
        (MAX_TOKENS + 5, 70, 12),
    ];
    for (case, &(tokens, inner, outputs)) in cases.iter().enumerate() {
        let (x, w) = (
            random(&mut rng, tokens * inner),
            random(&mut rng, outputs * inner),
        );
        let residual = random(&mut rng, tokens * outputs);
        let x_t = upload(&x, [tokens, inner], device, dtype);
        // Odd cases' weights are a view of wider rows (as CUDA pitches a matrix's rows).
        let w_t = if case % 2 == 1 {
            let wide: Vec<f64> = w
                .chunks(inner)
                .flat_map(|row| row.iter().copied().chain([f64::NAN; 3]))
                .collect();
            upload(&wide, [outputs, inner + 3], device, dtype).narrow(1, 0, inner)
        } else {
            upload(&w, [outputs, inner], device, dtype)
        };
        let r_t = upload(&residual, [tokens, outputs], device, dtype);
        for (norm_eps, add) in [
            (None, false),
            (Some(1e-5), false),
            (None, true),
            (Some(1e-2), true),
        ] {
            let what = format!(
                "case {case} ({tokens} x {inner} -> {outputs}), norm {norm_eps:?}, add {add}"
            );
            let around = Around { norm_eps, add };
            let expected = reference(&x, &w, &residual, [tokens, inner, outputs], around);
            let got = run([&x_t, &w_t, &r_t], add, norm_eps);
            assert_eq!(got.len(), expected.len(), "{what}: length");
            for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(
                    (g - e).abs() <= tolerance * (1.0 + e.abs()),
                    "{what}: element {i}: {g} against {e}"
                );
            }
            // Each token alone: the same bits as in the batch (one token's sums never depend on
            // the others, so a verify window and a plain step agree).
            if tokens <= MAX_TOKENS {
                for t in [0, tokens / 2, tokens - 1] {
                    let alone = [
                        x_t.clone().narrow(0, t, 1),
                        w_t.clone(),
                        r_t.clone().narrow(0, t, 1),
                    ];
                    let row = run([&alone[0], &alone[1], &alone[2]], add, norm_eps);
                    let bits =
                        |values: &[f64]| values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&row),
                        bits(&got[t * outputs..][..outputs]),
                        "{what}: token {t}"
                    );
                }
            }
        }
    }
}
