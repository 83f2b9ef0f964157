//! The backend: associated types only, plus what it can do.
//!
//! Like wgpu-hal's `Api`, [`Backend`] carries associated types and is used through static
//! dispatch (`Engine<B: Backend>`). The operations live in separate small traits
//! ([`crate::host::PinnedHost`], [`crate::transfer::CopyEngine`],
//! [`crate::attention::StreamedAttention`], the traits in [`crate::ops`]) that a backend
//! implements for itself. Validation lives above these traits, in backend-neutral code.

use crate::kv::format::KvType;
use std::fmt;

/// An f32 activation tensor in device memory. Row-major; dims are informational for validation.
pub trait DeviceTensor: Send + Sync + fmt::Debug {
    /// The tensor's dimensions.
    fn dims(&self) -> &[usize];
    /// Number of elements.
    fn numel(&self) -> usize {
        self.dims().iter().product()
    }
}

/// A buffer of raw device bytes (the arena parent is one of these).
pub trait DeviceBuffer: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A weight tensor in device memory, in its stored dtype.
pub trait DeviceWeight: Send + Sync + fmt::Debug {
    /// Dimensions as stored (PyTorch `[out, in]` for linear layers).
    fn dims(&self) -> &[usize];
    /// Stored dtype.
    fn dtype(&self) -> WeightDType;
    /// Bytes it occupies on the device.
    fn device_bytes(&self) -> usize;
}

/// A completion fence: a CPU latch, a CUDA event.
pub trait Fence: Clone + Send + Sync + fmt::Debug {
    /// True once the work it fences has finished (successfully or not).
    fn is_complete(&self) -> bool;
}

/// Stored type of a weight: a plain element type (`F32`, `F16`, `Bf16`) or one of the
/// block-quantized formats of [`crate::weight_format`] (`Q8_0`, `Q4G128`, `F8E4M3`, `Q4NlG128`), whose byte
/// layouts (codes, then an aligned scale section) are specified there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightDType {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    Bf16,
    /// 8-bit integer codes, one f16 scale per 32 values of a row (`q8_0`).
    Q8_0,
    /// 4-bit codes (low nibble first), one f16 scale per 128 values of a row (`q4_g128`).
    Q4G128,
    /// OCP FP8 E4M3 codes, one f32 scale per 128 values of a row (`fp8_e4m3`).
    F8E4M3,
    /// The `q4_g128` byte layout with a non-uniform integer codebook: code `u` decodes to
    /// `d · Q4_NL_LEVELS[u]` (`q4_nl_g128`).
    Q4NlG128,
}

impl WeightDType {
    /// Every weight dtype, element types first.
    pub const ALL: [WeightDType; 7] = [
        WeightDType::F32,
        WeightDType::F16,
        WeightDType::Bf16,
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ];

    /// Bytes per element for the element types (4 for f32, 2 for f16/bf16).
    ///
    /// For the quantized types this returns 1 and is meaningless: their size is not a whole
    /// number of bytes per element (scales are stored separately); callers must use
    /// [`WeightDType::storage_bytes`] with the tensor's dims.
    pub const fn size(self) -> usize {
        match self {
            WeightDType::F32 => 4,
            WeightDType::F16 | WeightDType::Bf16 => 2,
            WeightDType::Q8_0
            | WeightDType::Q4G128
            | WeightDType::F8E4M3
            | WeightDType::Q4NlG128 => 1,
        }
    }
    /// Lower-case name (the CLI and safetensors-metadata spelling; [`WeightDType::parse`] reads it).
    pub const fn name(self) -> &'static str {
        match self {
            WeightDType::F32 => "f32",
            WeightDType::F16 => "f16",
            WeightDType::Bf16 => "bf16",
            WeightDType::Q8_0 => "q8_0",
            WeightDType::Q4G128 => "q4_g128",
            WeightDType::F8E4M3 => "fp8_e4m3",
            WeightDType::Q4NlG128 => "q4_nl_g128",
        }
    }
}

impl fmt::Display for WeightDType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a backend can do. `kvstream inspect` prints this as a table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Backend name (`cpu`, `cuda`, `wgpu`).
    pub backend: &'static str,
    /// Device / adapter description.
    pub device: String,
    /// Page-locked host memory usable for asynchronous copies.
    pub pinned_host: bool,
    /// An asynchronous copy engine with ready/consumed fences.
    pub copy_engine: bool,
    /// Query widths the streamed-attention decode/verify path supports (1..=max).
    pub max_decode_width: usize,
    /// Streamed attention for prefill chunks of any width.
    pub prefill_attention: bool,
    /// Supported (K, V) element type pairs.
    pub kv_pairs: Vec<(KvType, KvType)>,
    /// The compute ops a model forward needs.
    pub compute_ops: bool,
    /// Weight dtypes the matmul/embedding ops read.
    pub weight_dtypes: Vec<WeightDType>,
    /// Bytes of device memory, if known.
    pub device_memory: Option<u64>,
}

impl Capabilities {
    /// Every (K, V) pair of [`KvType::ALL`].
    pub fn all_kv_pairs() -> Vec<(KvType, KvType)> {
        let mut v = Vec::new();
        for k in KvType::ALL {
            for vt in KvType::ALL {
                v.push((k, vt));
            }
        }
        v
    }

    /// True if the pair is supported.
    pub fn supports_kv_pair(&self, k: KvType, v: KvType) -> bool {
        self.kv_pairs.contains(&(k, v))
    }
}

/// A compute backend. Associated types only; operations come from the other contract traits.
pub trait Backend: Send + Sync + Sized + 'static {
    /// Raw device bytes (arena parent).
    type Buffer: DeviceBuffer;
    /// f32 activations.
    type Tensor: DeviceTensor;
    /// Weights in their stored dtype.
    type Weight: DeviceWeight;
    /// Completion fences (ready / consumed / producer).
    type Fence: Fence;
    /// RAII token of a pinned host registration; dropping it unregisters.
    type HostRegistration: Send + Sync + fmt::Debug;

    /// Short name (`cpu`, `cuda`, `wgpu`).
    fn name(&self) -> &'static str;
    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;
    /// Bytes of device memory in use as the driver reports it (every allocation of this
    /// process and of any other on the device, context included), or `None` where there is no
    /// separate device (CPU) or no way to ask. Benchmarks sample it for their measured peak.
    fn device_memory_in_use(&self) -> Option<u64> {
        None
    }
}
