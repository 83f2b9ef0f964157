//! cuBLAS for the prefill GEMM (T > 8 rows): loaded lazily on first use through cudarc's dynamic
//! loading and bound to the compute stream. A missing or incomplete libcublas is a logged (once)
//! fallback to the SIMT kernel `gemm_f32out`, never a panic. `KVSTREAM_GEMM=simt` forces the
//! fallback (A/B tests); [`CudaBackend::set_prefill_gemm`] chooses the path in code.
//!
//! Loader: cudarc tries `libcublas.so`, `libcublas.so.13`, … (`cudarc::get_lib_name_candidates`)
//! with `dlopen`, so the library's folder must be on `LD_LIBRARY_PATH` (pip wheel
//! `nvidia-cublas`: `site-packages/nvidia/cu13/lib`; see scripts/gpu-test.sh).

use crate::CudaBackend;
use cudarc::cublas::{result, sys};
use cudarc::driver::CudaStream;
use kvstream_memory_contracts::error::CapabilityError;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Environment variable choosing the prefill GEMM: `simt` forces the SIMT kernel; `cublas` (or
/// unset) uses cuBLAS when it loads.
pub const GEMM_ENV: &str = "KVSTREAM_GEMM";

/// Which kernel computes `matmul` for more than `GEMV_MAX_T` rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillGemm {
    /// cuBLAS on tensor cores: split bf16 operands (x = hi + lo; quantized and f16 weights
    /// dequantised into hi + lo bf16 tiles, bf16 weights as stored), f32 accumulation and
    /// output, so f32-class accuracy. f32 weights: f32 SGEMM.
    Cublas,
    /// The SIMT kernel `gemm_f32out`: exact dequantised weights, f32 x, f32 FMA.
    Simt,
}

/// The symbols the prefill GEMM calls (checked before the first call, so a partial library is a
/// fallback rather than a panic inside cudarc's lazy symbol lookup).
const SYMBOLS: &[&str] = &[
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasGemmEx",
];

/// Whether `KVSTREAM_GEMM`'s value forces the SIMT kernel (`None`: unset). Unknown values are
/// ignored with a warning.
pub(crate) fn forces_simt(value: Option<&str>) -> bool {
    match value.map(str::trim) {
        None | Some("") => false,
        Some(v) if v.eq_ignore_ascii_case("simt") => true,
        Some(v) if v.eq_ignore_ascii_case("cublas") => false,
        Some(v) => {
            tracing::warn!(
                value = v,
                "{GEMM_ENV}: unknown value (expected `simt` or `cublas`), ignored"
            );
            false
        }
    }
}

/// A cuBLAS handle bound to the compute stream (kept alive here, and with it the context). Unlike
/// cudarc's `CudaBlas`, dropping it never panics (a failed `cublasDestroy` is only logged).
#[derive(Debug)]
pub(crate) struct BlasHandle {
    handle: sys::cublasHandle_t,
    stream: Arc<CudaStream>,
}

// SAFETY: a cuBLAS handle may be used from any thread; the backend serialises its use (Mutex).
unsafe impl Send for BlasHandle {}
// SAFETY: as above; shared access goes through the Mutex of `BlasState`.
unsafe impl Sync for BlasHandle {}

impl BlasHandle {
    pub(crate) fn raw(&self) -> sys::cublasHandle_t {
        self.handle
    }
}

impl Drop for BlasHandle {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the handle was created by `load` and is destroyed once, here.
        if let Err(e) = unsafe { result::destroy_handle(self.handle) } {
            tracing::warn!(error = %e, "cublasDestroy failed");
        }
    }
}

/// The cuBLAS state of one backend.
#[derive(Debug)]
pub(crate) struct BlasState {
    /// `None` inside: cuBLAS could not be loaded (decided once).
    handle: OnceLock<Option<Mutex<BlasHandle>>>,
    force_simt: AtomicBool,
    warned: AtomicBool,
}

impl BlasState {
    pub(crate) fn from_env() -> Self {
        let force = forces_simt(std::env::var(GEMM_ENV).ok().as_deref());
        if force {
            tracing::info!("{GEMM_ENV}=simt: prefill GEMM on the SIMT kernel");
        }
        Self {
            handle: OnceLock::new(),
            force_simt: AtomicBool::new(force),
            warned: AtomicBool::new(false),
        }
    }

    /// Logs `msg` as a warning the first time only (per backend).
    pub(crate) fn warn_once(&self, msg: &str) {
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("{msg} (further cuBLAS failures are not logged)");
        }
    }
}

/// Opens libcublas, checks its symbols and creates a handle on `stream`.
fn load(stream: &Arc<CudaStream>) -> Result<BlasHandle, String> {
    // SAFETY: only opens the shared library (dlopen) to see whether it exists.
    if !unsafe { sys::is_culib_present() } {
        return Err(format!(
            "libcublas was not found (tried {:?} on the loader path; add its folder to \
             LD_LIBRARY_PATH)",
            cudarc::get_lib_name_candidates("cublas")
        ));
    }
    // SAFETY: the library is present (checked above), so `culib` opens it without panicking;
    // `get` only looks symbols up, nothing is called through the type given here.
    let lib = unsafe { sys::culib() };
    for s in SYMBOLS {
        if unsafe { lib.get::<unsafe extern "C" fn()>(s.as_bytes()) }.is_err() {
            return Err(format!("libcublas lacks `{s}`"));
        }
    }
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| format!("cannot bind the context: {e:?}"))?;
    let handle = result::create_handle().map_err(|e| format!("cublasCreate failed: {e}"))?;
    let blas = BlasHandle {
        handle,
        stream: Arc::clone(stream),
    };
    // SAFETY: a live handle and the backend's live compute stream (a CUstream is a cudaStream_t).
    unsafe { result::set_stream(blas.handle, stream.cu_stream() as sys::cudaStream_t) }
        .map_err(|e| format!("cublasSetStream failed: {e}"))?;
    Ok(blas)
}

impl CudaBackend {
    /// The cuBLAS handle (on the compute stream), loaded on first call; `None` if cuBLAS is
    /// unavailable (logged once).
    pub(crate) fn blas(&self) -> Option<&Mutex<BlasHandle>> {
        self.blas
            .handle
            .get_or_init(|| {
                let _span = tracing::info_span!("cublas_init").entered();
                match catch_unwind(AssertUnwindSafe(|| load(&self.compute))) {
                    Ok(Ok(b)) => {
                        tracing::info!("cuBLAS loaded: prefill GEMM on tensor cores");
                        Some(Mutex::new(b))
                    }
                    Ok(Err(reason)) => {
                        tracing::warn!(
                            %reason,
                            "cuBLAS unavailable: prefill GEMM falls back to the SIMT kernel"
                        );
                        None
                    }
                    Err(_) => {
                        tracing::warn!(
                            "cuBLAS initialisation panicked: prefill GEMM falls back to the \
                             SIMT kernel"
                        );
                        None
                    }
                }
            })
            .as_ref()
    }

    /// The path `matmul` takes for more than 8 rows now (loads cuBLAS if not yet tried).
    pub fn prefill_gemm(&self) -> PrefillGemm {
        if self.blas.force_simt.load(Ordering::Relaxed) || self.blas().is_none() {
            PrefillGemm::Simt
        } else {
            PrefillGemm::Cublas
        }
    }

    /// Chooses the prefill GEMM (overrides `KVSTREAM_GEMM`). [`PrefillGemm::Cublas`] is a
    /// [`CapabilityError`] (operation `cublas`) when cuBLAS cannot be loaded; the path is then
    /// unchanged.
    pub fn set_prefill_gemm(&self, path: PrefillGemm) -> Result<(), CapabilityError> {
        if path == PrefillGemm::Cublas && self.blas().is_none() {
            return Err(CapabilityError::new(
                "cuda",
                "cublas",
                "libcublas could not be loaded (see the log; LD_LIBRARY_PATH)",
            ));
        }
        self.blas
            .force_simt
            .store(path == PrefillGemm::Simt, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::forces_simt;

    #[test]
    fn only_simt_forces_the_fallback() {
        assert!(forces_simt(Some("simt")));
        assert!(forces_simt(Some(" SIMT ")));
        assert!(!forces_simt(Some("cublas")));
        assert!(!forces_simt(Some("")));
        assert!(!forces_simt(Some("tensor")));
        assert!(!forces_simt(None));
    }
}
