//! Run-time compilation of the kernel modules with NVRTC for the device's own architecture, with
//! an on-disk cache keyed by source hash, architecture and NVRTC version.
//!
//! Cache file: `$KVSTREAM_KERNEL_CACHE` or `$XDG_CACHE_HOME/kvstream/kernels` or
//! `$HOME/.cache/kvstream/kernels`, then `<sha256(source+options)[..16]>-sm_XY-nvrtcMAJ.MIN.cubin`.
//! A cache that cannot be read or written is not an error (the module is compiled again).

use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};
use kvstream_kernels::{KernelModule, NVRTC_OPTIONS};
use sha2::{Digest, Sha256};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// Why a module could not be compiled.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CompileError {
    #[error("NVRTC library is not available")]
    NoNvrtc,
    #[error("NVRTC failed on module `{module}`: {detail}")]
    Nvrtc {
        module: &'static str,
        detail: String,
    },
}

/// The NVRTC version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), CompileError> {
    // SAFETY: only checks whether the shared library can be opened.
    if !unsafe { nvrtc_sys::is_culib_present() } {
        return Err(CompileError::NoNvrtc);
    }
    let (mut major, mut minor) = (0i32, 0i32);
    // SAFETY: both pointers are valid for writes.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CompileError::Nvrtc {
            module: "<version>",
            detail: format!("{r:?}"),
        });
    }
    Ok((major, minor))
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVSTREAM_KERNEL_CACHE") {
        return Some(PathBuf::from(p));
    }
    if let Some(p) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(p).join("kvstream").join("kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kvstream/kernels"))
}

/// Environment variable of extra preprocessor definitions for every kernel module, for A/B
/// measurements of compile-time kernel variants: `NAME=VALUE` pairs separated by commas (e.g.
/// `QM_L2_HINT=256`). Part of the cache key.
pub const NVRTC_DEFINES_ENV: &str = "KVSTREAM_NVRTC_DEFINES";

/// `-DNAME=VALUE` options from [`NVRTC_DEFINES_ENV`]; entries that are not `NAME=VALUE` with a
/// C identifier and an alphanumeric value are ignored (with a warning).
fn extra_defines() -> Vec<String> {
    let Ok(v) = std::env::var(NVRTC_DEFINES_ENV) else {
        return Vec::new();
    };
    parse_defines(&v)
}

/// The value [`NVRTC_DEFINES_ENV`] gives `name` (the last entry naming it), if any: the host side
/// of a compile-time variant that changes what a launch must pass (e.g. `FA_TMA`'s tensor maps).
pub fn define_value(name: &str) -> Option<String> {
    let v = std::env::var(NVRTC_DEFINES_ENV).ok()?;
    define_value_in(&v, name)
}

/// Whether the on/off define `name` is on: its [`define_value`] is not `0`, or `default` where
/// [`NVRTC_DEFINES_ENV`] does not name it (the kernel source's own default).
pub fn define_on(name: &str, default: bool) -> bool {
    define_on_in(
        std::env::var(NVRTC_DEFINES_ENV).ok().as_deref(),
        name,
        default,
    )
}

fn define_on_in(defines: Option<&str>, name: &str, default: bool) -> bool {
    defines
        .and_then(|v| define_value_in(v, name))
        .map_or(default, |v| v != "0")
}

fn define_value_in(v: &str, name: &str) -> Option<String> {
    parse_defines(v).into_iter().rev().find_map(|d| {
        let (n, val) = d.strip_prefix("-D")?.split_once('=')?;
        (n == name).then(|| val.to_string())
    })
}

fn parse_defines(v: &str) -> Vec<String> {
    let ident = |s: &str| {
        !s.is_empty()
            && !s.starts_with(|c: char| c.is_ascii_digit())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    v.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .filter_map(|e| match e.split_once('=') {
            Some((n, val))
                if ident(n)
                    && !val.is_empty()
                    && val.chars().all(|c| c.is_ascii_alphanumeric()) =>
            {
                Some(format!("-D{n}={val}"))
            }
            _ => {
                tracing::warn!(
                    entry = e,
                    "{NVRTC_DEFINES_ENV}: ignoring an entry that is not NAME=VALUE"
                );
                None
            }
        })
        .collect()
}

/// Environment variable naming a directory of kernel sources (`common.cuh` and `<module>.cu`,
/// the layout of `kernels/src/cu`) that replace the embedded ones, so a kernel edit can be timed
/// on a GPU machine without rebuilding the binaries (`KVSTREAM_KERNEL_SRC=kernels/src/cu` in a
/// copy of the working tree). A file that cannot be read keeps the embedded source (with a
/// warning). The kernel names still come from the embedded table. Part of the cache key (through
/// the source).
pub const KERNEL_SRC_ENV: &str = "KVSTREAM_KERNEL_SRC";

/// The full source NVRTC compiles for `module`: the embedded one, or the files of [`KERNEL_SRC_ENV`].
pub fn module_source(module: &KernelModule) -> String {
    match std::env::var_os(KERNEL_SRC_ENV) {
        Some(dir) => source_from_dir(module, Path::new(&dir)),
        None => module.full_source(),
    }
}

/// [`module_source`] with the sources of `dir`.
fn source_from_dir(module: &KernelModule, dir: &Path) -> String {
    let read = |name: &str, embedded: &str| match std::fs::read_to_string(dir.join(name)) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(file = %dir.join(name).display(), error = %e, "{KERNEL_SRC_ENV}: keeping the embedded source");
            embedded.to_string()
        }
    };
    let common = read("common.cuh", kvstream_kernels::COMMON);
    let own = read(&format!("{}.cu", module.module), module.source);
    kvstream_kernels::compose_source(&common, &own)
}

/// The cache key of `module` for `arch` (e.g. `sm_90`) and NVRTC `version`.
pub fn cache_key(module: &KernelModule, arch: &str, version: (i32, i32)) -> String {
    source_cache_key(module.module, &module_source(module), arch, version)
}

/// [`cache_key`] of module `name` compiled from `source`.
fn source_cache_key(name: &str, source: &str, arch: &str, version: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in NVRTC_OPTIONS
        .iter()
        .map(|s| s.to_string())
        .chain(extra_defines())
    {
        h.update(o.as_bytes());
        h.update([0u8]);
    }
    let digest = h.finalize();
    let hex: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    format!("{name}-{hex}-{arch}-nvrtc{}.{}.cubin", version.0, version.1)
}

/// Compiles `module` to a cubin for `arch` (`sm_90`), using and filling the disk cache.
pub fn compile_module(module: &KernelModule, arch: &str) -> Result<Vec<u8>, CompileError> {
    let version = nvrtc_version()?;
    let source = module_source(module); // read once: the key and the compile see the same text
    let key = source_cache_key(module.module, &source, arch, version);
    let dir = cache_dir();
    if let Some(d) = &dir {
        if let Ok(bytes) = std::fs::read(d.join(&key)) {
            if !bytes.is_empty() {
                tracing::debug!(module = module.module, key, "kernel cache hit");
                return Ok(bytes);
            }
        }
    }
    let _span = tracing::info_span!("nvrtc_compile", module = module.module, arch).entered();
    let cubin = compile_uncached(module.module, &source, arch)?;
    if let Some(d) = &dir {
        let tmp = d.join(format!("{key}.tmp{}", std::process::id()));
        let ok = std::fs::create_dir_all(d).is_ok()
            && std::fs::write(&tmp, &cubin).is_ok()
            && std::fs::rename(&tmp, d.join(&key)).is_ok();
        if !ok {
            tracing::debug!(dir = %d.display(), "kernel cache not writable");
        }
    }
    Ok(cubin)
}

fn nvrtc_err(module: &'static str, detail: impl Into<String>) -> CompileError {
    CompileError::Nvrtc {
        module,
        detail: detail.into(),
    }
}

fn compile_uncached(name: &'static str, source: &str, arch: &str) -> Result<Vec<u8>, CompileError> {
    let src = CString::new(source).map_err(|e| nvrtc_err(name, e.to_string()))?;
    let fname = CString::new(format!("{name}.cu")).map_err(|e| nvrtc_err(name, e.to_string()))?;
    let prog = nvrtc_result::create_program(&src, Some(&fname))
        .map_err(|e| nvrtc_err(name, format!("create: {e:?}")))?;
    let mut opts: Vec<String> = vec![format!("--gpu-architecture={arch}")];
    opts.extend(NVRTC_OPTIONS.iter().map(|s| s.to_string()));
    opts.extend(extra_defines());
    // SAFETY: `prog` was just created and is destroyed exactly once below.
    let compiled = unsafe { nvrtc_result::compile_program(prog, &opts) };
    let out = match compiled {
        Ok(()) => get_cubin(prog).map_err(|e| nvrtc_err(name, e)),
        Err(e) => {
            // SAFETY: `prog` is live.
            let log = unsafe { nvrtc_result::get_program_log(prog) }
                .map(|v| {
                    let bytes: Vec<u8> =
                        v.iter().map(|c| *c as u8).take_while(|b| *b != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            Err(nvrtc_err(name, format!("{e:?}: {log}")))
        }
    };
    // SAFETY: `prog` is live and not used after this.
    let _ = unsafe { nvrtc_result::destroy_program(prog) };
    out
}

fn get_cubin(prog: nvrtc_sys::nvrtcProgram) -> Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: `prog` is a compiled program; `size` is valid for writes.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
        return Err(format!("no cubin ({r:?}, size {size})"));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has exactly `size` bytes, as NVRTC asked for.
    let r = unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast()) };
    if r != nvrtc_sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcGetCUBIN: {r:?}"));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_defines_accept_only_name_value_pairs() {
        assert_eq!(
            parse_defines("QM_L2_HINT=256, FA_L2_HINT=128"),
            vec!["-DQM_L2_HINT=256", "-DFA_L2_HINT=128"]
        );
        assert!(parse_defines("").is_empty());
        assert_eq!(
            define_value_in("FA_TMA=1,SK_FLAGS=2", "FA_TMA").as_deref(),
            Some("1")
        );
        assert_eq!(
            define_value_in("FA_TMA=1,FA_TMA=0", "FA_TMA").as_deref(),
            Some("0")
        );
        assert_eq!(define_value_in("FA_TMAX=1,bad", "FA_TMA"), None);
        // On/off defines: unset keeps the source's default, 0 turns off, anything else on.
        assert!(define_on_in(None, "FA_TMA", true));
        assert!(!define_on_in(Some("SK_FLAGS=2"), "FA_PIPE", false));
        assert!(!define_on_in(Some("FA_TMA=0"), "FA_TMA", true));
        assert!(define_on_in(Some("FA_PIPE=1"), "FA_PIPE", false));
        assert!(parse_defines("1X=2,NOVALUE,A=,B=x y,C=-1").is_empty());
    }

    #[test]
    fn kernel_src_dir_replaces_the_embedded_files_it_has() {
        let m = kvstream_kernels::MODULES
            .iter()
            .find(|m| m.module == "norm")
            .expect("norm module");
        let dir = std::env::temp_dir().join(format!("kvstream-ksrc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // Only the module file: common.cuh stays the embedded one.
        std::fs::write(dir.join("norm.cu"), "// edited norm\n").unwrap();
        let s = source_from_dir(m, &dir);
        assert!(s.starts_with(kvstream_kernels::COMMON));
        assert!(s.ends_with("// edited norm\n"));
        assert!(!s.contains(m.source));
        // Both files.
        std::fs::write(dir.join("common.cuh"), "// edited common\n").unwrap();
        assert_eq!(
            source_from_dir(m, &dir),
            "// edited common\n\n// edited norm\n"
        );
        // A directory without the files keeps the embedded source.
        let empty = dir.join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        assert_eq!(source_from_dir(m, &empty), m.full_source());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cache_key_depends_on_source_arch_and_version() {
        let m = &kvstream_kernels::MODULES[0];
        let other = &kvstream_kernels::MODULES[1];
        let k = cache_key(m, "sm_90", (13, 0));
        assert_ne!(k, cache_key(m, "sm_89", (13, 0)));
        assert_ne!(k, cache_key(m, "sm_90", (13, 1)));
        assert_ne!(k, cache_key(other, "sm_90", (13, 0)));
        assert!(k.ends_with("-sm_90-nvrtc13.0.cubin"));
    }

    /// Compiles every module for sm_90 when an NVRTC library can be loaded (e.g. with
    /// `LD_LIBRARY_PATH` pointing at the nvidia-cuda-nvrtc wheel); skipped otherwise.
    #[test]
    fn every_module_compiles_when_nvrtc_is_present() {
        if nvrtc_version().is_err() {
            eprintln!("NVRTC not found: skipped");
            return;
        }
        for m in kvstream_kernels::MODULES {
            let cubin = compile_uncached(m.module, &m.full_source(), "sm_90");
            assert!(cubin.is_ok(), "{}: {:?}", m.module, cubin.err());
        }
    }
}
