//! Which backend the demo runs on, and why.
//!
//! A GPU backend counts as present only if a tiny gather actually runs on it: being compiled in
//! says nothing about the machine. The probe has to survive a missing device, and cubecl does not
//! report one as an error: without a Vulkan adapter, cubecl-wgpu panics in its device thread and
//! the calling thread then panics on the dropped channel (`RecvError`). The probe therefore runs
//! under `catch_unwind`, with the panic hook swapped for one that records the messages instead of
//! printing them, so a machine without a GPU gets one clear line rather than two backtraces.
//!
//! A driver can also crash outright while it compiles the kernel (lavapipe was seen to segfault
//! in `create_compute_pipeline`), which no `catch_unwind` survives. Inside the `kvplan` binary
//! the probe therefore runs in a child process (`kvplan __probe NAME`), and a crash there only
//! rules the backend out.

use std::panic::{self, AssertUnwindSafe, PanicHookInfo};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use burn_core::tensor::DType;
use kvplan::KvPlanBackend;
use kvplan::generic::{exact, masked_gather};
use kvplan::ops::GatherOptions;

use crate::backends::{BackendName, OnBackend, with_backend};
use crate::prim;

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

/// The hidden subcommand of the `kvplan` binary that runs [`probe_here`] and exits 0 when the
/// backend works (else prints why on stderr and exits 1).
pub const PROBE_SUBCOMMAND: &str = "__probe";

/// Probes `name`: in a child process when this is the `kvplan` binary, else in this one.
fn probe(name: BackendName) -> Result<(), String> {
    child_probe(name).unwrap_or_else(|| probe_here(name))
}

/// `kvplan __probe NAME` in a child process, or `None` when this process is not the `kvplan`
/// binary (tests, other users of the library) or `KVPLAN_PROBE_IN_PROCESS` is set.
fn child_probe(name: BackendName) -> Option<Result<(), String>> {
    if std::env::var_os("KVPLAN_PROBE_IN_PROCESS").is_some() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    if exe.file_stem()? != "kvplan" {
        return None;
    }
    let output = Command::new(exe)
        .args([PROBE_SUBCOMMAND, &name.to_string()])
        .stdin(Stdio::null())
        .output()
        .ok()?;
    if output.status.success() {
        return Some(Ok(()));
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    let last_line = stderr
        .lines()
        .rev()
        .map(str::trim)
        .find(|line| !line.is_empty())
        .map(str::to_string);
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = output.status.signal() {
            return Some(Err(format!(
                "the probe gather killed its process (signal {signal}){}",
                last_line.map_or_else(String::new, |line| format!(" after: {line}"))
            )));
        }
    }
    Some(Err(last_line.unwrap_or_else(|| {
        format!("the probe exited with {}", output.status)
    })))
}

/// Runs `probe_gather` on `name` in this process, turning a panic into `Err` with the first
/// panic message.
pub fn probe_here(name: BackendName) -> Result<(), String> {
    let messages = Arc::new(Mutex::new(Vec::<String>::new()));
    let previous = panic::take_hook();
    let recorder = Arc::clone(&messages);
    panic::set_hook(Box::new(move |info| {
        if let Ok(mut messages) = recorder.lock() {
            messages.push(panic_message(info));
        }
    }));
    let outcome = panic::catch_unwind(AssertUnwindSafe(|| with_backend(name, ProbeGather)));
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

/// [`probe_gather`] as a backend-generic job.
struct ProbeGather;

impl OnBackend for ProbeGather {
    type Output = Result<(), String>;

    fn run<B: KvPlanBackend>(self, device: B::Device) -> Self::Output {
        probe_gather::<B>(&device)
    }
}

/// `req_to_token[1][[2, 0]]` on a 2x3 table: initialises the device, compiles and runs the
/// masked-gather kernel and reads the result back.
fn probe_gather<B: KvPlanBackend>(device: &B::Device) -> Result<(), String> {
    let table = prim::ints::<B>(&[10, 11, 12, 13, 14, 15], &[2, 3], DType::I32, device);
    let rows = prim::i64s::<B>(&[1], device);
    let pos2d = prim::ints::<B>(&[2, 0], &[1, 2], DType::I64, device);
    let mask = prim::bools::<B>(&[true, true], &[1, 2], device);
    let options = GatherOptions::new().context("probe");
    let gathered = masked_gather::<B>(table, rows, pos2d, mask, &options)
        .and_then(exact::<B>)
        .map_err(|error| error.to_string())?;
    let values = prim::read_ints::<B>(gathered)?;
    if values == [15, 13] {
        Ok(())
    } else {
        Err(format!(
            "probe gather returned {values:?}, expected [15, 13]"
        ))
    }
}
