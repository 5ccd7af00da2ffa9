//! GPU kernel timer over the CUPTI Activity API, loaded at run time (no CUDA toolkit needed).
//!
//! `libcupti.so*` is found through `KVPLAN_CUPTI` or a shallow search of CUDA and Python
//! (`nvidia-*-cupti` wheel) install locations. Kernel records
//! (`CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL`) are summed into a process-wide [`KernelStats`].

use std::alloc::{Layout, alloc, dealloc};
use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// Sum of GPU kernel execution time recorded between `start` and `stop`.
#[derive(Debug, Clone, Default)]
pub struct KernelStats {
    /// Number of kernel executions recorded.
    pub kernels: u64,
    /// Sum of `end - start` over all recorded kernels, in nanoseconds.
    pub total_ns: u64,
    /// Per kernel name (first 60 chars): `(name, count, total ns)`, largest total first.
    pub per_kernel: Vec<(String, u64, u64)>,
    /// Driver API calls `(callback id, count, total ns)`, recorded when `KVPLAN_CUPTI_DRIVER` is set.
    pub per_driver: Vec<(u32, u64, u64)>,
}

type BufRequested = extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type BufCompleted = extern "C" fn(*mut c_void, u32, *mut u8, usize, usize);

const KIND_KERNEL: u32 = 3;
const KIND_CONCURRENT_KERNEL: u32 = 10;
const KIND_DRIVER: u32 = 4;
const BUF_SIZE: usize = 8 << 20;
const BUF_ALIGN: usize = 8;

static STATS: Mutex<KernelStats> = Mutex::new(KernelStats {
    kernels: 0,
    total_ns: 0,
    per_kernel: Vec::new(),
    per_driver: Vec::new(),
});
/// The loaded API; leaked on purpose: CUPTI must never be unloaded while its callbacks are registered.
static API: Mutex<Option<&'static Api>> = Mutex::new(None);
/// `cuptiActivityGetNextRecord` for the completed callback, which may run inside `flush_all`
/// on a thread that holds `API`, so it must not lock `API` itself.
static NEXT_RECORD: OnceLock<NextRecordFn> = OnceLock::new();

type NextRecordFn = unsafe extern "C" fn(*mut u8, usize, *mut *mut u8) -> u32;

struct Api {
    _lib: libloading::Library,
    get_next_record: NextRecordFn,
    flush_all: unsafe extern "C" fn(u32) -> u32,
    result_string: Option<unsafe extern "C" fn(u32, *mut *const c_char) -> u32>,
    callback_name: Option<unsafe extern "C" fn(u32, u32, *mut *const c_char) -> u32>,
}

/// Handle on the process-wide CUPTI kernel collection (the library stays loaded for the process).
pub struct KernelTimer {
    api: &'static Api,
}

impl KernelTimer {
    /// Loads libcupti (`KVPLAN_CUPTI`, else a search of common install locations) and enables
    /// concurrent-kernel collection. Works before or after CUDA init. Calling it again reuses the
    /// loaded library and discards what was recorded so far.
    pub fn start() -> Result<KernelTimer, String> {
        let mut slot = API.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(api) = *slot {
            drop(slot);
            let timer = KernelTimer { api };
            timer.take()?;
            return Ok(timer);
        }
        let path = find_library(std::env::var_os("KVPLAN_CUPTI").map(PathBuf::from))?;
        // SAFETY: libcupti's initialisers only set up CUPTI state; nothing else runs on load.
        let lib = unsafe { libloading::Library::new(&path) }
            .map_err(|e| format!("{}: {e}", path.display()))?;
        // SAFETY: the symbol types match the C prototypes in cupti_activity.h / cupti_result.h.
        let (register, enable, api) = unsafe {
            let sym = |name: &str| format!("{}: missing {name}", path.display());
            let register = *lib
                .get::<unsafe extern "C" fn(BufRequested, BufCompleted) -> u32>(
                    "cuptiActivityRegisterCallbacks",
                )
                .map_err(|_| sym("cuptiActivityRegisterCallbacks"))?;
            let enable = *lib
                .get::<unsafe extern "C" fn(u32) -> u32>("cuptiActivityEnable")
                .map_err(|_| sym("cuptiActivityEnable"))?;
            let get_next_record = *lib
                .get("cuptiActivityGetNextRecord")
                .map_err(|_| sym("cuptiActivityGetNextRecord"))?;
            let flush_all = *lib
                .get("cuptiActivityFlushAll")
                .map_err(|_| sym("cuptiActivityFlushAll"))?;
            let result_string = lib.get("cuptiGetResultString").ok().map(|s| *s);
            let callback_name = lib.get("cuptiGetCallbackName").ok().map(|s| *s);
            (
                register,
                enable,
                Api {
                    _lib: lib,
                    get_next_record,
                    flush_all,
                    result_string,
                    callback_name,
                },
            )
        };
        let api: &'static Api = Box::leak(Box::new(api));
        let _ = NEXT_RECORD.set(api.get_next_record);
        // SAFETY: both callbacks are `extern "C"`, never unwind, and live for the whole process.
        api.check("cuptiActivityRegisterCallbacks", unsafe {
            register(buffer_requested, buffer_completed)
        })?;
        // SAFETY: plain call with a valid activity kind.
        api.check("cuptiActivityEnable", unsafe {
            enable(KIND_CONCURRENT_KERNEL)
        })?;
        if std::env::var_os("KVPLAN_CUPTI_DRIVER").is_some() {
            // SAFETY: plain call with a valid activity kind.
            api.check("cuptiActivityEnable", unsafe { enable(KIND_DRIVER) })?;
        }
        *slot = Some(api);
        Ok(KernelTimer { api })
    }

    /// Flushes (`cuptiActivityFlushAll(1)`) and returns everything recorded since the previous
    /// `take` (or `start`); the caller synchronises the device first.
    pub fn take(&self) -> Result<KernelStats, String> {
        // SAFETY: plain call; completed buffers are delivered to `buffer_completed`.
        self.api
            .check("cuptiActivityFlushAll", unsafe { (self.api.flush_all)(1) })?;
        let mut stats = std::mem::take(&mut *STATS.lock().unwrap_or_else(|e| e.into_inner()));
        stats.per_kernel.sort_by_key(|k| std::cmp::Reverse(k.2));
        Ok(stats)
    }
}

impl KernelTimer {
    /// A driver API callback id's name (`cuLaunchKernel`, ...).
    pub fn driver_name(&self, cbid: u32) -> String {
        let mut name: *const c_char = std::ptr::null();
        if let Some(f) = self.api.callback_name {
            // SAFETY: valid out-pointer; domain 1 is CUPTI_CB_DOMAIN_DRIVER_API.
            unsafe { f(1, cbid, &mut name) };
        }
        if name.is_null() {
            return format!("cbid {cbid}");
        }
        // SAFETY: CUPTI returns static NUL-terminated names.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }
}

impl Api {
    fn check(&self, what: &str, code: u32) -> Result<(), String> {
        if code == 0 {
            return Ok(());
        }
        let mut msg: *const c_char = std::ptr::null();
        if let Some(f) = self.result_string {
            // SAFETY: `msg` is a valid out-pointer; CUPTI returns a static string or leaves it null.
            unsafe { f(code, &mut msg) };
        }
        let text = if msg.is_null() {
            String::new()
        } else {
            // SAFETY: non-null result strings are static NUL-terminated C strings.
            unsafe { CStr::from_ptr(msg) }
                .to_string_lossy()
                .into_owned()
        };
        Err(format!("{what} failed: CUPTI error {code} {text}"))
    }
}

extern "C" fn buffer_requested(
    buffer: *mut *mut u8,
    size: *mut usize,
    max_num_records: *mut usize,
) {
    // SAFETY: BUF_SIZE is non-zero and BUF_ALIGN a power of two.
    let buf = unsafe { alloc(Layout::from_size_align_unchecked(BUF_SIZE, BUF_ALIGN)) };
    // SAFETY: CUPTI passes valid out-pointers. A null buffer (out of memory) makes CUPTI drop records.
    unsafe {
        *buffer = buf;
        *size = if buf.is_null() { 0 } else { BUF_SIZE };
        *max_num_records = 0;
    }
}

extern "C" fn buffer_completed(
    _ctx: *mut c_void,
    _stream: u32,
    buffer: *mut u8,
    _size: usize,
    valid: usize,
) {
    if buffer.is_null() {
        return;
    }
    // `catch_unwind` so that nothing unwinds into CUPTI; the buffer is freed either way.
    let _ = std::panic::catch_unwind(|| {
        if let Some(next) = NEXT_RECORD.get() {
            parse_buffer(*next, buffer, valid);
        }
    });
    // SAFETY: `buffer` came from `buffer_requested` with this exact layout and is not used again.
    unsafe {
        dealloc(
            buffer,
            Layout::from_size_align_unchecked(BUF_SIZE, BUF_ALIGN),
        )
    };
}

fn parse_buffer(next_record: NextRecordFn, buffer: *mut u8, valid: usize) {
    let mut stats = STATS.lock().unwrap_or_else(|e| e.into_inner());
    let mut record: *mut u8 = std::ptr::null_mut();
    // SAFETY: `buffer`/`valid` are what CUPTI handed us; `record` is a valid in/out pointer.
    // Any non-zero status (normally CUPTI_ERROR_MAX_LIMIT_REACHED = 12: end of buffer) ends the walk.
    while unsafe { next_record(buffer, valid, &mut record) } == 0 {
        // SAFETY: every record starts with a u32 kind and is 8-byte aligned inside the buffer.
        let kind = unsafe { (record as *const u32).read() };
        if kind == KIND_DRIVER {
            // SAFETY: CUpti_ActivityAPI: kind u32, cbid u32 @4, start u64 @8, end u64 @16.
            let (cbid, start, end) = unsafe {
                (
                    (record.add(4) as *const u32).read_unaligned(),
                    (record.add(8) as *const u64).read_unaligned(),
                    (record.add(16) as *const u64).read_unaligned(),
                )
            };
            let ns = end.saturating_sub(start);
            match stats.per_driver.iter_mut().find(|k| k.0 == cbid) {
                Some(k) => (k.1, k.2) = (k.1 + 1, k.2 + ns),
                None => stats.per_driver.push((cbid, 1, ns)),
            }
            continue;
        }
        if kind != KIND_KERNEL && kind != KIND_CONCURRENT_KERNEL {
            continue;
        }
        // SAFETY: CUpti_ActivityKernel4..10 share this prefix: start u64 @16, end u64 @24,
        // name `const char*` @104 (NUL-terminated, owned by CUPTI, possibly null).
        let (start, end, name_ptr) = unsafe {
            (
                (record.add(16) as *const u64).read_unaligned(),
                (record.add(24) as *const u64).read_unaligned(),
                (record.add(104) as *const *const c_char).read_unaligned(),
            )
        };
        let name: String = if name_ptr.is_null() {
            "<unknown>".into()
        } else {
            // SAFETY: non-null per the check above; CUPTI keeps kernel names alive.
            unsafe { CStr::from_ptr(name_ptr) }
                .to_string_lossy()
                .chars()
                .take(60)
                .collect()
        };
        let ns = end.saturating_sub(start);
        stats.kernels += 1;
        stats.total_ns += ns;
        match stats.per_kernel.iter_mut().find(|k| k.0 == name) {
            Some(k) => (k.1, k.2) = (k.1 + 1, k.2 + ns),
            None => stats.per_kernel.push((name, 1, ns)),
        }
    }
}

/// `override_path` if given (it must exist), else the first `libcupti.so*` found in the usual places.
fn find_library(override_path: Option<PathBuf>) -> Result<PathBuf, String> {
    if let Some(p) = override_path {
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("KVPLAN_CUPTI={} is not a file", p.display()))
        };
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_default();
    // (directory, search depth): library directories are read flat, `nvidia/` wheel trees deeper.
    let mut roots: Vec<(PathBuf, u32)> = Vec::new();
    if let Some(ld) = std::env::var_os("LD_LIBRARY_PATH") {
        roots.extend(std::env::split_paths(&ld).map(|d| (d, 0)));
    }
    for cuda in prefixed(Path::new("/usr/local"), "cuda") {
        roots.push((cuda.join("extras/CUPTI/lib64"), 0));
        roots.push((cuda.join("lib64"), 0));
    }
    let mut py_bases = vec![
        PathBuf::from("/usr/local/lib"),
        PathBuf::from("/usr/lib"),
        home.join(".local/lib"),
    ];
    py_bases.push(PathBuf::from("/opt/conda/lib"));
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            py_bases.push(PathBuf::from(v).join("lib"));
        }
    }
    for base in &py_bases {
        for py in prefixed(base, "python3") {
            roots.push((py.join("dist-packages/nvidia"), 3));
            roots.push((py.join("site-packages/nvidia"), 3));
        }
    }
    roots.push((PathBuf::from("/usr/lib/x86_64-linux-gnu"), 0));
    for (root, depth) in &roots {
        let mut found = Vec::new();
        walk(root, *depth, &mut found);
        // Prefer the highest version suffix (libcupti.so.13 over libcupti.so.12 over libcupti.so).
        found.sort_by_key(|p| std::cmp::Reverse(so_version(p)));
        if let Some(p) = found.into_iter().next() {
            return Ok(p);
        }
    }
    Err("libcupti.so* not found (set KVPLAN_CUPTI=/path/to/libcupti.so)".into())
}

/// Sub-directories of `dir` whose name starts with `prefix`.
fn prefixed(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out.reverse();
    out
}

fn walk(dir: &Path, depth: u32, found: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("libcupti.so")
            && path.is_file()
        {
            found.push(path);
        } else if depth > 0 && entry.file_type().is_ok_and(|t| t.is_dir()) {
            walk(&path, depth - 1, found);
        }
    }
}

fn so_version(p: &Path) -> Vec<u32> {
    let name = p
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.trim_start_matches("libcupti.so")
        .split('.')
        .filter_map(|s| s.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_override_is_an_error() {
        let err =
            find_library(Some(PathBuf::from("/nonexistent/kvplan/libcupti.so.13"))).unwrap_err();
        assert!(err.contains("KVPLAN_CUPTI"), "{err}");
    }
}
