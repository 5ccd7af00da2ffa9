//! Which backend the demo runs on, and why.
//!
//! A GPU backend counts as present only if a tiny gather actually runs on it: being compiled in
//! says nothing about the machine. The probe has to survive a missing device, and cubecl does not
//! report one as an error: without a Vulkan adapter, cubecl-wgpu panics in its device thread and
//! the calling thread then panics on the dropped channel (`RecvError`). The probe therefore runs
//! under `catch_unwind`, with the panic hook swapped for one that records the messages instead of
//! printing them, so a machine without a GPU gets one clear line rather than two backtraces.

use std::panic::{self, AssertUnwindSafe, PanicHookInfo};
use std::sync::{Arc, Mutex};

use burn_tensor::{Bool, DType, Int, Tensor, TensorData};

use crate::KvPlanBackend;
use crate::backends::BackendName;

/// The backend to run on, with the reason shown to the user.
#[derive(Debug, Clone)]
pub struct Choice {
    /// The chosen backend.
    pub name: BackendName,
    /// Why it was chosen.
    pub reason: String,
}

/// `requested` if given (after making sure it works), else the first working of CUDA, Vulkan
/// and the host reference.
pub fn choose(requested: Option<BackendName>) -> Result<Choice, String> {
    if let Some(name) = requested {
        if is_gpu(name) {
            probe(name).map_err(|why| {
                format!("backend {name} was requested but does not work here: {why}")
            })?;
        }
        return Ok(Choice {
            name,
            reason: "requested with --backend".into(),
        });
    }
    let mut passed_over = Vec::new();
    for (name, compiled) in [
        (BackendName::Cuda, cfg!(feature = "cuda")),
        (BackendName::Vulkan, cfg!(feature = "vulkan")),
    ] {
        if !compiled {
            passed_over.push(format!(
                "{name}: not compiled in (cargo feature `{}`)",
                feature(name)
            ));
            continue;
        }
        match probe(name) {
            Ok(()) => {
                let mut reason = format!("best backend present: a probe gather ran on {name}");
                if !passed_over.is_empty() {
                    reason.push_str(&format!("; passed over {}", passed_over.join("; ")));
                }
                return Ok(Choice { name, reason });
            }
            Err(why) => passed_over.push(format!("{name}: {why}")),
        }
    }
    Ok(Choice {
        name: BackendName::Reference,
        reason: format!(
            "no GPU backend works ({}); using the host reference",
            passed_over.join("; ")
        ),
    })
}

fn is_gpu(name: BackendName) -> bool {
    !matches!(name, BackendName::Reference | BackendName::Flex)
}

fn feature(name: BackendName) -> &'static str {
    match name {
        BackendName::Cuda | BackendName::CudaUnfused => "cuda",
        _ => "vulkan",
    }
}

/// Runs [`probe_gather`] on `name`, turning a panic into `Err` with the first panic message.
fn probe(name: BackendName) -> Result<(), String> {
    let messages = Arc::new(Mutex::new(Vec::<String>::new()));
    let previous = panic::take_hook();
    let recorder = Arc::clone(&messages);
    panic::set_hook(Box::new(move |info| {
        if let Ok(mut messages) = recorder.lock() {
            messages.push(panic_message(info));
        }
    }));
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
        crate::with_backend!(name, |device: B| probe_gather::<B>(&device))
    }));
    panic::set_hook(previous);
    match outcome {
        Ok(Ok(result)) => result,
        Ok(Err(not_compiled)) => Err(not_compiled),
        Err(_) => {
            // The first message is the root cause (the device thread's); later ones are echoes.
            let first = messages
                .lock()
                .ok()
                .and_then(|messages| messages.first().cloned());
            Err(format!(
                "device initialisation panicked: {}",
                first.unwrap_or_else(|| "no message".into())
            ))
        }
    }
}

/// The first line of a panic's message, shortened.
fn panic_message(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let text = payload
        .downcast_ref::<&str>()
        .map(|text| (*text).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-text panic".into());
    let line = text.lines().next().unwrap_or("").trim();
    const KEEP: usize = 100;
    if line.chars().count() > KEEP {
        format!("{}...", line.chars().take(KEEP).collect::<String>())
    } else {
        line.into()
    }
}

/// `req_to_token[1][[2, 0]]` on a 2x3 table: initialises the device, compiles and runs the
/// masked-gather kernel and reads the result back.
fn probe_gather<B: KvPlanBackend>(device: &B::Device) -> Result<(), String> {
    let table: Tensor<B, 2, Int> = Tensor::from_data(
        TensorData::new(vec![10i64, 11, 12, 13, 14, 15], [2, 3]),
        (device, DType::I32),
    );
    let rows: Tensor<B, 1, Int> =
        Tensor::from_data(TensorData::new(vec![1i64], [1]), (device, DType::I64));
    let pos2d: Tensor<B, 2, Int> =
        Tensor::from_data(TensorData::new(vec![2i64, 0], [1, 2]), (device, DType::I64));
    let mask: Tensor<B, 2, Bool> =
        Tensor::from_data(TensorData::new(vec![true, true], [1, 2]), device);
    let gathered = crate::masked_gather(table, rows, pos2d, mask, "probe")
        .map_err(|error| error.to_string())?;
    let data = gathered
        .try_into_data()
        .map_err(|error| format!("read-back failed: {error:?}"))?;
    let values: Vec<i64> = crate::ops::data_to_i64(&data);
    if values == [15, 13] {
        Ok(())
    } else {
        Err(format!(
            "probe gather returned {values:?}, expected [15, 13]"
        ))
    }
}
