//! # kvstream CPU backend
//!
//! The reference implementation of every memory contract and compute op, over host memory. It is
//! the oracle other backends are compared with and the no-GPU default.
//!
//! * "Device" memory is host memory ([`CpuBuffer`]); the arena is one such allocation.
//! * Pinned-host registration is a no-op that still tracks ownership.
//! * The copy engine is a worker thread with real fences: attention waits for *ready*, copies
//!   wait for *consumed*.
//! * Streamed attention walks spans in token order with f32 accumulators and normalises once.
//! * Compute ops are multithreaded with rayon and read bf16/f16/f32 and quantized (`q8_0`,
//!   `q4_g128`, `fp8_e4m3`) weights directly.

mod attention;
mod copy_engine;
mod host;
mod kv_write;
mod memory;
pub mod ops;
mod tensor;

pub use tensor::{CpuBuffer, CpuFence, CpuRegistration, CpuTensor, CpuWeight};

use kvstream_memory_contracts::backend::{Backend, Capabilities, WeightDType};

/// The CPU backend.
///
/// Owns the copy worker thread (joined when the backend is dropped) and the registry of host
/// registrations.
#[derive(Debug)]
pub struct CpuBackend {
    registry: host::HostRegistry,
    copies: copy_engine::CopyWorker,
    /// `LinearOps::prefetch_weight` hints received (memory is already where the CPU computes:
    /// counted, so tests can see which weights a model names).
    prefetch_hints: std::sync::atomic::AtomicU64,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A new CPU backend with its copy worker started.
    pub fn new() -> Self {
        Self {
            registry: host::HostRegistry::default(),
            copies: copy_engine::CopyWorker::start(),
            prefetch_hints: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// `LinearOps::prefetch_weight` hints received so far (each is otherwise a no-op here).
    pub fn prefetch_hints(&self) -> u64 {
        self.prefetch_hints
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Bytes of host memory currently registered through [`PinnedHost`](kvstream_memory_contracts::host::PinnedHost).
    pub fn registered_host_bytes(&self) -> usize {
        self.registry.bytes()
    }

    /// Number of live host registrations.
    pub fn registered_host_allocations(&self) -> usize {
        self.registry.count()
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Fence = CpuFence;
    type HostRegistration = CpuRegistration;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            backend: "cpu",
            device: format!("host CPU ({} threads)", rayon::current_num_threads()),
            pinned_host: true,
            copy_engine: true,
            max_decode_width: 64,
            prefill_attention: true,
            kv_pairs: Capabilities::all_kv_pairs(),
            compute_ops: true,
            weight_dtypes: WeightDType::ALL.to_vec(),
            device_memory: None,
        }
    }
}
