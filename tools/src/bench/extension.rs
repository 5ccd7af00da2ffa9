//! `kvplan bench extension`: what a Burn 0.22 backend extension op costs on the host before it
//! does anything of kvplan's, timed by the host bench's harness beside a plain Burn launch.
//!
//! Three probe ops, declared with `#[backend_extension]` as kvplan's are: one that hands its
//! input back (the extension's path, no launch), one launch of `x + 1` (one input, one output),
//! and a gather's shape (four inputs, two outputs, optionally one upload). Their differences
//! place the host cost of kvplan's ops: the path itself, a launch, bindings, outputs, uploads.

use burn_core as burn; // the paths `#[backend_extension]` generates
use burn_core::backend::fusion::custom::TensorSpec;
use burn_core::backend::tensor::IntTensor;
use burn_core::backend::{Backend, ExtensionType, Scalar, TensorMetadata, backend_extension};
use burn_core::tensor::DType;
use kvplan::KvPlanBackend;

use super::{int, plain_launch, read_back_us, timed};

/// A gather's outputs: values and a status record.
#[derive(ExtensionType, Debug, Clone)]
#[extension_type(fusion)]
pub struct ProbePair<B: Backend> {
    /// The values.
    pub out: IntTensor<B>,
    /// `[4]`.
    pub status: IntTensor<B>,
}

/// The probe ops. The default bodies (Flex) do the same work with Burn's own ops.
#[backend_extension(Fusion, Flex, Cube: cfg(any(feature = "vulkan", feature = "cuda")))]
pub trait HostProbe: Backend {
    /// `x` itself: the extension's registration and execution with no launch.
    #[fusion(dtype = x, shape = x)]
    fn probe_pass(x: IntTensor<Self>) -> IntTensor<Self> {
        x
    }

    /// `x + 1` by one launch into a new output.
    #[fusion(dtype = x, shape = x)]
    fn probe_add(x: IntTensor<Self>) -> IntTensor<Self> {
        Self::int_add_scalar(x, Scalar::new(1i64, &DType::I64))
    }

    /// A gather's shape: four inputs, `out = a + 1` and a zero `[4]` status (`a` of at least 4
    /// values) by one launch that binds all six; `launch` false hands `a` and `b` (`[4]`, as Fusion's metadata says) back instead, with no launch; with `upload`, the
    /// status starts as uploaded words (as a gather's scratch does).
    #[fusion(meta = |a, _b, _c, _d, _launch, _upload| ProbePairMetadata {
        out: a.clone(),
        status: TensorSpec::new([4].into(), DType::I64),
    })]
    fn probe_wide(
        a: IntTensor<Self>,
        b: IntTensor<Self>,
        c: IntTensor<Self>,
        d: IntTensor<Self>,
        launch: bool,
        upload: bool,
    ) -> ProbePair<Self> {
        let _ = (c, d, upload);
        if !launch {
            return ProbePair { out: a, status: b };
        }
        let device = a.device();
        ProbePair {
            out: Self::int_add_scalar(a, Scalar::new(1i64, &DType::I64)),
            status: Self::int_zeros([4].into(), &device, DType::I64.into()),
        }
    }

    /// Four inputs, one output (`a + 1`), by one launch that binds all five.
    #[fusion(dtype = a, shape = a)]
    fn probe_narrow(
        a: IntTensor<Self>,
        b: IntTensor<Self>,
        c: IntTensor<Self>,
        d: IntTensor<Self>,
    ) -> IntTensor<Self> {
        let _ = (b, c, d);
        Self::int_add_scalar(a, Scalar::new(1i64, &DType::I64))
    }
}

impl HostProbe for burn_core::backend::Flex {}

#[cfg(any(feature = "vulkan", feature = "cuda"))]
mod cube {
    use super::ProbePair;
    use burn_core::backend::TensorMetadata;
    use burn_core::tensor::{DType, Shape};
    use burn_cubecl::CubeBackend;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::tensor::CubeTensor;
    use cubecl::prelude::*;

    #[cube(launch_unchecked)]
    fn add_kernel(input: &Tensor<i64>, out: &mut Tensor<i64>) {
        if ABSOLUTE_POS < out.len() {
            out[ABSOLUTE_POS] = input[ABSOLUTE_POS] + 1;
        }
    }

    // `* 0`: the probes bind inputs they must not depend on.
    #[cube(launch_unchecked)]
    #[allow(clippy::erasing_op)]
    fn wide_kernel(
        a: &Tensor<i64>,
        b: &Tensor<i64>,
        c: &Tensor<i64>,
        d: &Tensor<i64>,
        out: &mut Tensor<i64>,
        status: &mut Tensor<i64>,
    ) {
        if ABSOLUTE_POS < out.len() {
            out[ABSOLUTE_POS] = a[ABSOLUTE_POS] + 1;
        }
        if ABSOLUTE_POS < status.len() {
            status[ABSOLUTE_POS] = (b[0] + c[0] + d[0]) * 0;
        }
    }

    #[cube(launch_unchecked)]
    #[allow(clippy::erasing_op)]
    fn narrow_kernel(
        a: &Tensor<i64>,
        b: &Tensor<i64>,
        c: &Tensor<i64>,
        d: &Tensor<i64>,
        out: &mut Tensor<i64>,
    ) {
        if ABSOLUTE_POS < out.len() {
            out[ABSOLUTE_POS] = a[ABSOLUTE_POS] + 1 + (b[0] + c[0] + d[0]) * 0;
        }
    }

    fn empty(like: &CubeTensor, len: usize) -> CubeTensor {
        empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::new([len]),
            DType::I64,
        )
    }

    fn grid(len: usize) -> CubeCount {
        CubeCount::Static(len.div_ceil(256).max(1) as u32, 1, 1)
    }

    impl super::HostProbe for CubeBackend {
        fn probe_pass(x: CubeTensor) -> CubeTensor {
            x
        }

        fn probe_add(x: CubeTensor) -> CubeTensor {
            let len = x.shape().num_elements();
            let out = empty(&x, len);
            // SAFETY: the kernel checks its index against the output's length.
            unsafe {
                add_kernel::launch_unchecked(
                    &x.client.clone(),
                    grid(len),
                    CubeDim::new_1d(256),
                    x.into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                );
            }
            out
        }

        fn probe_wide(
            a: CubeTensor,
            b: CubeTensor,
            c: CubeTensor,
            d: CubeTensor,
            launch: bool,
            upload: bool,
        ) -> ProbePair<Self> {
            if !launch {
                return ProbePair { out: a, status: b };
            }
            let len = a.shape().num_elements();
            let out = empty(&a, len);
            let status = if upload {
                let handle = a.client.create_from_slice(&[0u8; 32]);
                CubeTensor::new_contiguous(
                    a.client.clone(),
                    a.device.clone(),
                    Shape::new([4]),
                    handle,
                    DType::I64,
                )
            } else {
                empty(&a, 4)
            };
            wide(a, [b, c, d], out.clone(), status.clone());
            ProbePair { out, status }
        }

        fn probe_narrow(a: CubeTensor, b: CubeTensor, c: CubeTensor, d: CubeTensor) -> CubeTensor {
            let len = a.shape().num_elements();
            let out = empty(&a, len);
            // SAFETY: the kernel checks its index against the output's length.
            unsafe {
                narrow_kernel::launch_unchecked(
                    &a.client.clone(),
                    grid(len),
                    CubeDim::new_1d(256),
                    a.into_tensor_arg(),
                    b.into_tensor_arg(),
                    c.into_tensor_arg(),
                    d.into_tensor_arg(),
                    out.clone().into_tensor_arg(),
                );
            }
            out
        }
    }

    /// `out = a + 1`, `status[0] = 0`, with `rest` bound.
    fn wide(a: CubeTensor, rest: [CubeTensor; 3], out: CubeTensor, status: CubeTensor) {
        let len = a.shape().num_elements();
        let [b, c, d] = rest;
        // SAFETY: the kernel checks its index against the output's length.
        unsafe {
            wide_kernel::launch_unchecked(
                &a.client.clone(),
                grid(len),
                CubeDim::new_1d(256),
                a.into_tensor_arg(),
                b.into_tensor_arg(),
                c.into_tensor_arg(),
                d.into_tensor_arg(),
                out.into_tensor_arg(),
                status.into_tensor_arg(),
            );
        }
    }
}

/// Times the probes beside the host bench's plain launch: pipelined us per call.
pub fn run<B: KvPlanBackend + HostProbe>(device: &B::Device, reps: usize) -> Result<(), String> {
    let e = |error: kvplan::Error| error.to_string();
    let ones = |len: usize| int::<B, 1>(vec![1; len], [len], DType::I64, device);
    // `b` is `[4]`: the no-launch probe hands it back as the status.
    let (a, b, c, d) = (ones(1024), ones(4), ones(4), ones(4));
    let plain = plain_launch::<B>(device, reps).map_err(e)?;
    println!("| probe | pipelined us/call | x plain launch | host us/call (enqueue) |");
    println!("|---|---:|---:|---:|");
    println!(
        "| plain launch (add, max, sub; per op) | {:.1} | 1.00 | {:.1} |",
        plain.pipelined_us, plain.host_us
    );
    let plain = plain.pipelined_us;
    let row = |label: &str, call: &mut dyn FnMut()| -> Result<(), String> {
        let timing = timed::<B>(device, reps, || {
            call();
            Ok(())
        })
        .map_err(e)?;
        println!(
            "| {label} | {:.1} | {:.2} | {:.1} |",
            timing.pipelined_us,
            timing.pipelined_us / plain,
            timing.host_us
        );
        Ok(())
    };
    let wide = |launch: bool, upload: bool| {
        B::probe_wide(a.clone(), b.clone(), c.clone(), d.clone(), launch, upload)
    };
    row("extension, no launch (1 in, 1 out)", &mut || {
        drop(B::probe_pass(a.clone()))
    })?;
    row("extension, no launch (4 in, 2 out)", &mut || {
        drop(wide(false, false))
    })?;
    row("extension, one launch (1 in, 1 out)", &mut || {
        drop(B::probe_add(a.clone()))
    })?;
    row("extension, one launch (4 in, 1 out)", &mut || {
        drop(B::probe_narrow(a.clone(), b.clone(), c.clone(), d.clone()))
    })?;
    row("extension, one launch (4 in, 2 out)", &mut || {
        drop(wide(true, false))
    })?;
    row(
        "extension, one launch and an upload (4 in, 2 out)",
        &mut || drop(wide(true, true)),
    )?;
    // Exact forms: one call and the read-back of a [4] result, host time per call.
    let small = int::<B, 1>(vec![0; 4], [4], DType::I64, device);
    let exact = |label: &str, call: &mut dyn FnMut() -> IntTensor<B>| -> Result<(), String> {
        let host_us = read_back_us::<B>(device, reps, call).map_err(e)?;
        println!("| {label}, its [4] read back (host us/call) | {host_us:.1} | | |");
        Ok(())
    };
    exact("plain add_scalar", &mut || {
        B::int_add_scalar(small.clone(), Scalar::new(1i64, &DType::I64))
    })?;
    exact("extension, one launch (1 in, 1 out)", &mut || {
        B::probe_add(small.clone())
    })?;
    exact(
        "extension, one launch and an upload (4 in, 2 out), status",
        &mut || wide(true, true).status,
    )?;
    Ok(())
}
