//! NCCL, loaded at run time, every symbol resolved once up front.
//!
//! Why not through cudarc's `nccl::sys` functions: their loader tries a list
//! of names (`libnccl.so`, `libnccl.so.13`, `.12`, ...) without
//! `libnccl.so.2`, the name every NCCL 2.x runtime package ships (the
//! unversioned `libnccl.so` comes only with the development package, and
//! Python's `nvidia-nccl` wheels have only `libnccl.so.2`), and it panics on
//! a missing library or symbol. So this module loads the library itself and
//! reports absence as an error; the FFI types (unique id, communicator
//! handle, data type, stream) are cudarc's. Result codes are read as plain
//! integers, so a code newer than the bindings is not undefined behaviour.
//!
//! Where it looks, in order: the path in `OFFLOAD_NCCL_LIBRARY` (only that,
//! when set); `libnccl.so.2` and `libnccl.so` through the dynamic loader's
//! search (`LD_LIBRARY_PATH`, the cache); the `libnccl.so.2` of Python's
//! `nvidia-nccl-cu*` wheels in the usual site-packages folders (`/opt/*`
//! virtual environments, `/usr/local/lib/python3*`, `/usr/lib/python3`,
//! `$VIRTUAL_ENV`, `~/.local`).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclUniqueId};
use libloading::Library;

/// The variable naming the NCCL library to load.
pub(crate) const LIBRARY_VAR: &str = "OFFLOAD_NCCL_LIBRARY";

pub(crate) const SUCCESS: u32 = 0;
pub(crate) const INVALID_ARGUMENT: u32 = 4;
pub(crate) const INVALID_USAGE: u32 = 5;
pub(crate) const IN_PROGRESS: u32 = 7;

/// `ncclResult_t`'s name for `code`.
pub(crate) fn result_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// The first fields of `ncclConfig_t`, laid out as NCCL 2.14 defined them
/// (every later version keeps them and reads only `size` bytes, taking
/// its defaults for the rest). `version` 2.14 also makes NCCL ignore
/// fields of later versions.
#[repr(C)]
pub(crate) struct ConfigV214 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
}

impl ConfigV214 {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: calls on the
    /// communicator return `ncclInProgress` instead of blocking the host,
    /// so every wait is ours and has a deadline.
    pub(crate) fn nonblocking() -> Self {
        Self {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            version: 21_400,
            blocking: 0,
            // NCCL_CONFIG_UNDEF_INT: NCCL's default.
            cga_cluster_size: c_int::MIN,
        }
    }
}

type Status = u32;

/// The loaded library and the functions this crate calls.
pub(crate) struct Nccl {
    _lib: Library,
    /// Where it was loaded from (as tried).
    pub(crate) source: String,
    /// `ncclGetVersion`'s code.
    pub(crate) version_code: i32,
    pub(crate) get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Status,
    pub(crate) comm_init_rank_config: unsafe extern "C" fn(
        *mut ncclComm_t,
        c_int,
        ncclUniqueId,
        c_int,
        *mut ConfigV214,
    ) -> Status,
    pub(crate) comm_finalize: unsafe extern "C" fn(ncclComm_t) -> Status,
    pub(crate) comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Status,
    pub(crate) comm_abort: unsafe extern "C" fn(ncclComm_t) -> Status,
    pub(crate) comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut Status) -> Status,
    pub(crate) comm_count: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> Status,
    pub(crate) comm_user_rank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> Status,
    pub(crate) all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> Status,
    get_error_string: unsafe extern "C" fn(Status) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
}

impl Nccl {
    /// `major.minor.patch` of the loaded library.
    pub(crate) fn version(&self) -> (u32, u32, u32) {
        decode_version(self.version_code)
    }

    /// NCCL's description of `code`, with its last-error detail.
    pub(crate) fn describe(&self, code: Status) -> String {
        // SAFETY: ncclGetErrorString accepts any code and returns a static
        // NUL-terminated string (or null, handled by `c_str`).
        let text = c_str(unsafe { (self.get_error_string)(code) });
        // SAFETY: ncclGetLastError ignores its argument (null is the
        // documented value) and returns a NUL-terminated string kept by
        // NCCL; it is copied at once.
        let last = c_str(unsafe { (self.get_last_error)(std::ptr::null_mut()) });
        let mut s = format!("{} ({})", text, result_name(code));
        if !last.is_empty() {
            s.push_str(": ");
            s.push_str(&last);
        }
        s
    }
}

fn c_str(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: callers pass NUL-terminated strings that NCCL keeps alive at
    // least until its next call on this thread; copied here at once.
    unsafe { CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_owned()
}

/// `ncclGetVersion`'s code as `(major, minor, patch)` (the encoding
/// changed at 2.9).
pub(crate) fn decode_version(code: i32) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10_000 {
        (code / 10_000, (code % 10_000) / 100, code % 100)
    } else {
        (code / 1_000, (code % 1_000) / 100, code % 100)
    }
}

/// The process's NCCL, loaded on first use; the error says what was tried.
pub(crate) fn nccl() -> Result<&'static Nccl, String> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Nccl, String> {
    let mut tried = Vec::new();
    if let Some(path) = std::env::var_os(LIBRARY_VAR) {
        let path = PathBuf::from(path);
        return load_from(&path.to_string_lossy())
            .map_err(|e| format!("{LIBRARY_VAR}={}: {e}", path.display()));
    }
    let mut candidates: Vec<String> = vec!["libnccl.so.2".to_owned(), "libnccl.so".to_owned()];
    candidates.extend(
        wheel_libraries()
            .into_iter()
            .map(|p| p.to_string_lossy().into_owned()),
    );
    for name in &candidates {
        match load_from(name) {
            Ok(nccl) => return Ok(nccl),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    if candidates.len() == 2 {
        tried.push("no libnccl.so.2 of Python's nvidia-nccl wheels found".to_owned());
    }
    Err(format!(
        "no usable NCCL library (set {LIBRARY_VAR} to its path); tried {}",
        tried.join("; ")
    ))
}

fn load_from(name: &str) -> Result<Nccl, String> {
    // SAFETY: loading runs the library's initialisers; NCCL's only set up
    // its own globals. The library stays loaded for the process (kept in a
    // static).
    let lib = unsafe { Library::new(name) }.map_err(|e| chain(&e))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the field's type is the symbol's C prototype in
            // nccl.h (unchanged since NCCL 2.14, which `load_from` checks
            // below), with `ncclResult_t` read as the u32 it is.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| format!("missing symbol {}: {}", $name, chain(&e)))?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Status = sym!("ncclGetVersion");
    let mut version_code: c_int = 0;
    // SAFETY: writes one int.
    let rc = unsafe { get_version(&mut version_code) };
    if rc != SUCCESS {
        return Err(format!("ncclGetVersion failed ({})", result_name(rc)));
    }
    let (major, minor, patch) = decode_version(version_code);
    if (major, minor) < (2, 14) {
        return Err(format!(
            "NCCL {major}.{minor}.{patch} is too old; 2.14 or newer is needed (non-blocking communicators)"
        ));
    }
    let get_unique_id = sym!("ncclGetUniqueId");
    let comm_init_rank_config = sym!("ncclCommInitRankConfig");
    let comm_finalize = sym!("ncclCommFinalize");
    let comm_destroy = sym!("ncclCommDestroy");
    let comm_abort = sym!("ncclCommAbort");
    let comm_get_async_error = sym!("ncclCommGetAsyncError");
    let comm_count = sym!("ncclCommCount");
    let comm_user_rank = sym!("ncclCommUserRank");
    let all_gather = sym!("ncclAllGather");
    let get_error_string = sym!("ncclGetErrorString");
    let get_last_error = sym!("ncclGetLastError");
    Ok(Nccl {
        _lib: lib,
        source: name.to_owned(),
        version_code,
        get_unique_id,
        comm_init_rank_config,
        comm_finalize,
        comm_destroy,
        comm_abort,
        comm_get_async_error,
        comm_count,
        comm_user_rank,
        all_gather,
        get_error_string,
        get_last_error,
    })
}

/// An error and its sources (libloading puts dlerror's text in the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(inner) = source {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        source = inner.source();
    }
    s
}

/// `libnccl.so.2` of Python's `nvidia-nccl-cu*` wheels, in the usual
/// site-packages folders.
fn wheel_libraries() -> Vec<PathBuf> {
    let mut sites: Vec<String> = [
        "/opt/*/.venv/lib/python3*/site-packages",
        "/opt/*/lib/python3*/site-packages",
        "/usr/local/lib/python3*/dist-packages",
        "/usr/local/lib/python3*/site-packages",
        "/usr/lib/python3/dist-packages",
    ]
    .map(str::to_owned)
    .to_vec();
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        sites.push(format!(
            "{}/lib/python3*/site-packages",
            venv.to_string_lossy()
        ));
    }
    if let Some(home) = std::env::var_os("HOME") {
        sites.push(format!(
            "{}/.local/lib/python3*/site-packages",
            home.to_string_lossy()
        ));
    }
    let mut found = Vec::new();
    for site in sites {
        for dir in glob(&site) {
            for sub in ["nvidia/nccl/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"] {
                let lib = dir.join(sub).join("libnccl.so.2");
                if lib.is_file() && !found.contains(&lib) {
                    found.push(lib);
                }
            }
        }
    }
    found
}

/// The folders matching an absolute `pattern` whose segments may hold one
/// `*` each (sorted, so the choice is stable).
fn glob(pattern: &str) -> Vec<PathBuf> {
    let mut paths = vec![PathBuf::from("/")];
    for segment in pattern.split('/').filter(|s| !s.is_empty()) {
        let mut next = Vec::new();
        for base in &paths {
            if segment.contains('*') {
                let Ok(entries) = std::fs::read_dir(base) else {
                    continue;
                };
                let mut names: Vec<PathBuf> = entries
                    .filter_map(Result::ok)
                    .filter(|e| wildcard(segment, &e.file_name().to_string_lossy()))
                    .map(|e| e.path())
                    .collect();
                names.sort();
                next.extend(names);
            } else {
                let p = base.join(segment);
                if Path::new(&p).exists() {
                    next.push(p);
                }
            }
        }
        paths = next;
    }
    paths.retain(|p| p.is_dir());
    paths
}

/// Whether `name` matches `pattern` with at most one `*`.
fn wildcard(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((prefix, suffix)) => {
            name.len() >= prefix.len() + suffix.len()
                && name.starts_with(prefix)
                && name.ends_with(suffix)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(decode_version(22_803), (2, 28, 3));
        assert_eq!(decode_version(2_804), (2, 8, 4));
    }

    #[test]
    fn wildcards_match_one_star() {
        assert!(wildcard("python3*", "python3.12"));
        assert!(wildcard("python3*", "python3"));
        assert!(!wildcard("python3*", "python2.7"));
        assert!(wildcard("*-packages", "site-packages"));
        assert!(wildcard("exact", "exact"));
        assert!(!wildcard("ab*ba", "aba"));
    }

    #[test]
    fn glob_finds_folders() {
        let dir = std::env::temp_dir().join(format!("offload-dist-glob-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("venv/lib/python3.12/site-packages")).unwrap();
        let pattern = format!("{}/venv/lib/python3*/site-packages", dir.display());
        assert_eq!(
            glob(&pattern),
            vec![dir.join("venv/lib/python3.12/site-packages")]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_missing_library_is_an_error() {
        let e = load_from("/nonexistent/libnccl.so.2").err().unwrap();
        assert!(e.contains("/nonexistent/libnccl.so.2"), "{e}");
    }

    #[test]
    fn a_library_that_is_not_nccl_is_an_error() {
        // libc is loaded in every process, and has no NCCL symbols.
        let e = load_from("libc.so.6").err().unwrap();
        assert!(e.contains("missing symbol ncclGetVersion"), "{e}");
    }

    #[test]
    fn config_prefix_has_no_padding() {
        // size (8) + magic, version, blocking, cgaClusterSize (4 each).
        assert_eq!(std::mem::size_of::<ConfigV214>(), 24);
    }
}
