//! The main job: a synthetic speculative-decoding serving trace.

use std::process::ExitCode;

use crate::backends::BackendName;

/// Runs the demo on `backend`, or on the best backend present.
pub fn run(backend: Option<BackendName>) -> Result<ExitCode, String> {
    let _ = backend;
    Ok(ExitCode::SUCCESS)
}
