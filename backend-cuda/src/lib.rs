//! # kvstream CUDA backend
//!
//! Every contract of `kvstream-memory-contracts` on an NVIDIA GPU through cudarc (dynamic loading:
//! the binary builds and starts without CUDA; [`CudaBackend::new`] then returns a typed
//! [`CapabilityError`]).
//!
//! * Kernels: the CUDA C sources of `kvstream-kernels`, compiled at start-up with NVRTC for the
//!   device's architecture (cached on disk, see [`compile`]). Admission: device, architecture,
//!   NVRTC and every kernel are checked in [`CudaBackend::new`] before any allocation.
//! * Memory: buffers are device allocations with views ([`CudaBuffer::view`]): the arena is one
//!   allocation. Host memory is page-locked by registration (cached, not write-combined).
//! * Streams: one compute stream, one copy stream; fences are CUDA events. cudarc's per-slice
//!   event tracking is disabled: ordering is ours.
//! * Prefill GEMM (more than 8 rows): cuBLAS on tensor cores with split (hi + lo) bf16 operands when libcublas
//!   loads (lazily, see [`PrefillGemm`]), else the SIMT kernel; decode GEMV is always our own.
//! * Streamed attention splits the token range into a fixed number of token-index-owned splits
//!   per evaluation and combines them once in `attn_finish` (streamed == resident bit for bit).

mod alloc_cache;
mod attention;
mod bench;
mod blas;
pub mod compile;
mod graph;
mod launch;
mod lend;
mod memory;
mod ops;
mod tensor_map;
mod types;

pub use blas::{PrefillGemm, GEMM_ENV};
pub use graph::CapturedWork;
pub use lend::{LEND_DEFAULT, LEND_ENV};
pub use ops::linear::q4mma::{Q4Gemv, Q4_GEMV_ENV};
pub use ops::linear::q4mmap::Q4_PDL_ENV;
pub use ops::linear::q4tiles::{Q4Tiles, Q4_TILES_ENV, Q4_TILES_SPLIT_ENV};
pub use ops::linear::sk_plan::{GemvSk, GEMV_SK_ENV, STREAM_K_DTYPES};
pub use ops::{GDN_CHUNK_MIN_TOKENS, GDN_FUSED_ENV, GDN_PATH_ENV, L2_PREFETCH_ENV};
pub use types::{CudaBuffer, CudaFence, CudaHostRegistration, CudaTensor, CudaWeight, DeviceAlloc};

use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use kvstream_memory_contracts::backend::{Backend, Capabilities, WeightDType};
use kvstream_memory_contracts::error::CapabilityError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Lowest compute capability the kernels are written for (Hopper-class features are not needed;
/// sm_80 is the floor for bf16 throughput).
pub const MIN_COMPUTE_CAPABILITY: (i32, i32) = (8, 0);

/// A copy whose host memory must stay alive until its event completes.
#[derive(Debug)]
pub(crate) struct InFlight {
    pub(crate) fence: CudaFence,
    pub(crate) _host: Arc<kvstream_memory_contracts::host::HostBytes>,
    pub(crate) _device: Arc<DeviceAlloc>,
}

/// The CUDA backend of one device.
#[derive(Debug)]
pub struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) compute: Arc<CudaStream>,
    pub(crate) copy: Arc<CudaStream>,
    pub(crate) kernels: HashMap<&'static str, CudaFunction>,
    pub(crate) inflight: Mutex<Vec<InFlight>>,
    device: String,
    arch: String,
    total_mem: usize,
    pub(crate) max_smem_optin: usize,
    /// Streaming multiprocessors (the attention split target counts blocks per SM).
    pub(crate) sm_count: usize,
    /// The fast attention kernel's instance and the blocks of one full wave of it, by head_dim
    /// (cached occupancy).
    pub(crate) attn_wave_blocks: Mutex<HashMap<usize, (&'static str, usize)>>,
    pub(crate) blas: blas::BlasState,
    /// The q4_g128 decode GEMV path (tensor cores or SIMT).
    pub(crate) q4_gemv: ops::linear::q4mma::Q4GemvState,
    /// Producers' fused x prep for the q4 GEMVs (`ops::linear::prepared`).
    pub(crate) fused_prep: ops::linear::prepared::FusedPrep,
    /// The decode GEMV of element and 8-bit weights (`GemvSk` code, from `KVSTREAM_GEMV_SK`).
    pub(crate) gemv_sk: std::sync::atomic::AtomicU8,
    /// Fix-up buffers of the stream-K GEMVs (q4 tensor-core and `gemv_sk`).
    pub(crate) stream_k: Mutex<ops::linear::streamk::StreamKBuffers>,
    /// The arena region lent to the allocator now, if any ([`lend`]).
    pub(crate) lend: Mutex<Option<lend::Lend>>,
    /// Whether region loans redirect allocations ([`lend::LEND_ENV`]).
    pub(crate) lend_enabled: std::sync::atomic::AtomicBool,
    /// The decode recurrence as one fused launch (`KVSTREAM_GDN_FUSED`, default on).
    pub(crate) gdn_fused: std::sync::atomic::AtomicBool,
    /// Free lists of small allocations ([`alloc_cache`]); `None` when turned off.
    pub(crate) alloc_cache: Option<Arc<alloc_cache::AllocCache>>,
    /// Weight prefetches into L2 (`ops::prefetch`, `KVSTREAM_L2_PREFETCH`).
    pub(crate) l2_prefetch: ops::L2Prefetch,
}

fn cap(detail: impl Into<String>) -> CapabilityError {
    CapabilityError::new("cuda", "init", detail)
}

impl CudaBackend {
    /// Opens device `ordinal`, checks it (driver, architecture ≥ [`MIN_COMPUTE_CAPABILITY`],
    /// NVRTC) and compiles and loads every kernel. Any missing piece is a [`CapabilityError`]
    /// (backend `cuda`, operation `init`) returned before any device allocation; never panics.
    pub fn new(ordinal: usize) -> Result<Self, CapabilityError> {
        let _span = tracing::info_span!("cuda_init", ordinal).entered();
        // SAFETY: only probes whether the shared libraries can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(cap("the CUDA driver library (libcuda) was not found"));
        }
        let count = CudaContext::device_count()
            .map_err(|e| cap(format!("cannot query CUDA devices: {e:?}")))?;
        if count <= 0 || ordinal >= count as usize {
            return Err(cap(format!(
                "no CUDA device {ordinal} ({count} device(s) present)"
            )));
        }
        let version = compile::nvrtc_version().map_err(|e| cap(e.to_string()))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| {
            cap(format!(
                "cannot create a context on device {ordinal}: {e:?}"
            ))
        })?;
        // SAFETY: called before any stream or allocation of this context exists; our own fences
        // order every cross-stream access.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| cap(format!("cannot read the compute capability: {e:?}")))?;
        if (major, minor) < MIN_COMPUTE_CAPABILITY {
            return Err(cap(format!(
                "compute capability {major}.{minor} is below the required {}.{}",
                MIN_COMPUTE_CAPABILITY.0, MIN_COMPUTE_CAPABILITY.1
            )));
        }
        let arch = format!("sm_{major}{minor}");
        let mut kernels = HashMap::new();
        for m in kvstream_kernels::MODULES {
            let cubin = compile::compile_module(m, &arch).map_err(|e| cap(e.to_string()))?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
                .map_err(|e| cap(format!("cannot load module `{}`: {e:?}", m.module)))?;
            for k in m.kernels {
                let f = module
                    .load_function(k)
                    .map_err(|e| cap(format!("kernel `{k}` is missing: {e:?}")))?;
                kernels.insert(*k, f);
            }
        }
        let device = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let total_mem = ctx.total_mem().unwrap_or(0);
        let max_smem_optin = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map(|v| v.max(0) as usize)
            .unwrap_or(48 * 1024);
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|v| v.max(1) as usize)
            .unwrap_or(1);
        let l2_bytes = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
            .map(|v| v.max(0) as usize)
            .unwrap_or(0);
        let compute = ctx
            .new_stream()
            .map_err(|e| cap(format!("cannot create the compute stream: {e:?}")))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| cap(format!("cannot create the copy stream: {e:?}")))?;
        tracing::info!(
            device,
            arch,
            nvrtc = ?version,
            kernels = kernels.len(),
            "CUDA backend ready"
        );
        Ok(Self {
            ctx,
            compute,
            copy,
            kernels,
            inflight: Mutex::new(Vec::new()),
            device: format!("{device} ({arch}, NVRTC {}.{})", version.0, version.1),
            arch,
            total_mem,
            max_smem_optin,
            sm_count,
            attn_wave_blocks: Mutex::new(HashMap::new()),
            blas: blas::BlasState::from_env(),
            q4_gemv: ops::linear::q4mma::Q4GemvState::from_env(),
            fused_prep: ops::linear::prepared::FusedPrep::from_env(),
            gemv_sk: std::sync::atomic::AtomicU8::new(
                ops::linear::sk_plan::GemvSk::from_env().code(),
            ),
            stream_k: Mutex::new(Default::default()),
            lend: Mutex::new(None),
            lend_enabled: std::sync::atomic::AtomicBool::new(lend::lend_from_env()),
            gdn_fused: std::sync::atomic::AtomicBool::new(ops::gdn_fused_from_env()),
            alloc_cache: alloc_cache::enabled_from_env()
                .then(|| Arc::new(alloc_cache::AllocCache::default())),
            l2_prefetch: ops::L2Prefetch::new(l2_bytes),
        })
    }

    /// The architecture the kernels were compiled for (`sm_90`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Whether the device's compute capability (as `sm_XY`: major · 10 + minor) is at least `cc`.
    pub fn arch_at_least(&self, cc: u32) -> bool {
        sm_number(&self.arch).is_some_and(|n| n >= cc)
    }

    /// A view `[offset, offset + len)` of `buf` (arena regions), or `None` if out of range.
    pub fn buffer_view(&self, buf: &CudaBuffer, offset: usize, len: usize) -> Option<CudaBuffer> {
        buf.view(offset, len)
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Fence = CudaFence;
    type HostRegistration = CudaHostRegistration;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "cuda",
            device: self.device.clone(),
            pinned_host: true,
            copy_engine: true,
            max_decode_width: kvstream_kernels::launch::ATT_QW,
            prefill_attention: true,
            kv_pairs: Capabilities::all_kv_pairs(),
            compute_ops: true,
            weight_dtypes: vec![
                WeightDType::F32,
                WeightDType::F16,
                WeightDType::Bf16,
                WeightDType::Q8_0,
                WeightDType::Q4G128,
                WeightDType::F8E4M3,
                WeightDType::Q4NlG128,
            ],
            device_memory: Some(self.total_mem as u64),
        }
    }

    fn device_memory_in_use(&self) -> Option<u64> {
        let (free, total) = self.ctx.mem_get_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI) `new` must be a typed capability error, never a panic; with one it must
    /// succeed.
    #[test]
    fn new_is_a_typed_error_or_a_working_backend() {
        match CudaBackend::new(0) {
            Ok(b) => assert_eq!(b.name(), "cuda"),
            Err(e) => {
                assert_eq!(e.backend, "cuda");
                assert_eq!(e.operation, "init");
                assert!(!e.detail.is_empty());
            }
        }
        let e = CudaBackend::new(1_000_000).err().map(|e| e.operation);
        assert_eq!(e, Some("init"));
    }
}

/// `sm_90` → 90, `sm_100` → 100; `None` for anything else.
fn sm_number(arch: &str) -> Option<u32> {
    arch.strip_prefix("sm_")?.parse().ok()
}

#[cfg(test)]
mod arch_tests {
    use super::sm_number;

    #[test]
    fn sm_numbers_parse() {
        assert_eq!(sm_number("sm_90"), Some(90));
        assert_eq!(sm_number("sm_100"), Some(100));
        assert_eq!(sm_number("sm_8x"), None);
        assert_eq!(sm_number("compute_90"), None);
    }
}
