//! Errors of the contracts layer.
//!
//! Every fallible contract returns one of these typed errors; none of them panics on caller
//! input. [`CapabilityError`] is the error a backend returns for something it cannot do (burn's
//! pattern): it names the backend, the operation and why, so a user can pick another backend.

use crate::kv::format::KvType;

/// A capability the backend lacks. Never a silent fallback.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("backend `{backend}` cannot do `{operation}`: {detail}")]
pub struct CapabilityError {
    /// Backend name, e.g. `cpu`, `cuda`, `wgpu`.
    pub backend: &'static str,
    /// The operation that was asked for, e.g. `streamed_attention`.
    pub operation: &'static str,
    /// Why, and what to do instead.
    pub detail: String,
}

impl CapabilityError {
    /// Convenience constructor.
    pub fn new(backend: &'static str, operation: &'static str, detail: impl Into<String>) -> Self {
        Self {
            backend,
            operation,
            detail: detail.into(),
        }
    }
}

/// Errors of KV element encoding and decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("unknown KV type `{0}`: expected one of f32, f16, bf16, q8_0, q4_0")]
    UnknownType(String),
    #[error("{ty} needs a multiple of {block} values, got {len}")]
    NotBlockMultiple {
        ty: KvType,
        block: usize,
        len: usize,
    },
    #[error("{ty}: {values} values need {expected} bytes, buffer has {actual}")]
    BufferSize {
        ty: KvType,
        values: usize,
        expected: usize,
        actual: usize,
    },
}

/// Errors of page geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("tokens per page must be a power of two >= 1, got {0}")]
    TokensPerPage(usize),
    #[error("{field} must be > 0")]
    Zero { field: &'static str },
    #[error("a {ty} quant block of {block} values would straddle a head of dim {head_dim}")]
    BlockStraddlesHead {
        ty: KvType,
        block: usize,
        head_dim: usize,
    },
    #[error("plane alignment must be a power of two, got {0}")]
    Alignment(usize),
    #[error("geometry size overflows usize")]
    Overflow,
}

/// Errors found when validating a span plan. Each failure mode has its own variant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpanError {
    #[error("span plan is empty but must cover tokens [{start}, {end})")]
    Empty { start: usize, end: usize },
    #[error("span {index} has zero tokens")]
    ZeroLength { index: usize },
    #[error("gap: span {index} starts at token {first} but the previous span ended at {expected}")]
    Gap {
        index: usize,
        expected: usize,
        first: usize,
    },
    #[error(
        "overlap: span {index} starts at token {first}, inside the previous span ending at {expected}"
    )]
    Overlap {
        index: usize,
        expected: usize,
        first: usize,
    },
    #[error("span plan covers [{start}, {covered}) but must cover [{start}, {end})")]
    Coverage {
        start: usize,
        covered: usize,
        end: usize,
    },
    #[error("span {index} starts at token {first}, which is not at a page boundary ({tokens_per_page} tokens per page)")]
    PageMisaligned {
        index: usize,
        first: usize,
        tokens_per_page: usize,
    },
    #[error("span {index} byte offset {offset} is not aligned to {align}")]
    ByteMisaligned {
        index: usize,
        offset: usize,
        align: usize,
    },
    #[error("span {index} reads bytes [{offset}, {end}) outside its buffer of {buffer_len} bytes")]
    OutOfBuffer {
        index: usize,
        offset: usize,
        end: usize,
        buffer_len: usize,
    },
    #[error("reordered: span {index} starts at token {first}, before the previous span's start {previous}")]
    Reordered {
        index: usize,
        previous: usize,
        first: usize,
    },
    #[error(
        "plan range [{start}, {end}) is invalid: start must be a page boundary and not after end"
    )]
    Range { start: usize, end: usize },
}

/// Errors of the arena's transactional region map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("arena of {capacity} bytes cannot fit region `{region}` of {size} bytes (align {align}); {free} bytes free in the largest gap")]
    OutOfSpace {
        region: String,
        size: usize,
        align: usize,
        capacity: usize,
        free: usize,
    },
    #[error("region `{region}` at [{offset}, {end}) overlaps region `{other}` or the arena end ({capacity})")]
    Overlap {
        region: String,
        offset: usize,
        end: usize,
        other: String,
        capacity: usize,
    },
    #[error("region `{0}` is reserved twice in one layout")]
    Duplicate(String),
    #[error("alignment {0} is not a power of two")]
    Alignment(usize),
    #[error("no region `{0}` in the committed layout")]
    NoSuchRegion(String),
    #[error("cannot commit: region `{0}` is leased and the new layout changes or drops it; release its leases first")]
    LeasedRegionChanged(String),
    #[error("staging layout belongs to arena generation {staged} but the arena is at {current}; begin again")]
    StaleStaging { staged: u64, current: u64 },
    #[error("view of `{region}` is from arena generation {view} but the arena is at {current}")]
    StaleView {
        region: String,
        view: u64,
        current: u64,
    },
}

/// Errors of transfers and fences.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The backend has no copy engine / fences (e.g. the wgpu stub).
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("copy failed: {0}")]
    CopyFailed(String),
    #[error("copy range [{offset}, {end}) is outside the {what} of {len} bytes")]
    OutOfRange {
        what: &'static str,
        offset: usize,
        end: usize,
        len: usize,
    },
    #[error("fence wait failed: {0}")]
    Fence(String),
    #[error("copy engine is shut down")]
    ShutDown,
}

/// Errors of the host KV store.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// The backend cannot register pinned host memory (e.g. the wgpu stub).
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("layer {layer} is out of range (store has {layers} layers)")]
    Layer { layer: usize, layers: usize },
    #[error("host KV store is full: layer {layer} holds {len} of {capacity} tokens, cannot add {adding}")]
    Full {
        layer: usize,
        len: usize,
        capacity: usize,
        adding: usize,
    },
    #[error("row of {got} bytes does not match the geometry's {expected} bytes")]
    RowBytes { got: usize, expected: usize },
    #[error("cannot truncate layer {layer} to {to} tokens: it holds {len}")]
    Truncate { layer: usize, to: usize, len: usize },
    #[error("page {page} is out of range for layer {layer} ({pages} pages)")]
    Page {
        layer: usize,
        page: usize,
        pages: usize,
    },
    #[error("pinned host allocation of {bytes} bytes failed: {detail}")]
    Alloc { bytes: usize, detail: String },
    #[error("host registration failed: {0}")]
    Register(String),
}

/// Errors of streamed attention requests.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AttentionError {
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("query heads {q_heads} is not a multiple of KV heads {kv_heads}")]
    Gqa { q_heads: usize, kv_heads: usize },
    #[error("query width {width} exceeds the {total} tokens attended")]
    Width { width: usize, total: usize },
    #[error("plan starts at token {plan_start} but the accumulator is at token {next}; spans must be walked in token order")]
    OutOfOrder { plan_start: usize, next: usize },
    #[error("attention finished at token {covered} but {total} tokens are active")]
    Incomplete { covered: usize, total: usize },
    #[error("tensor `{name}` has {got} elements, expected {expected}")]
    Shape {
        name: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("plan geometry does not match the request's K/V types or shape")]
    GeometryMismatch,
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

/// Errors of compute ops.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    #[error(transparent)]
    Capability(#[from] CapabilityError),
    #[error("op `{op}`: {detail}")]
    Shape { op: &'static str, detail: String },
    #[error("op `{op}`: unsupported dtype {dtype}")]
    DType { op: &'static str, dtype: String },
    #[error("device error in `{op}`: {detail}")]
    Device { op: &'static str, detail: String },
    #[error("device out of memory allocating {bytes} bytes for `{what}`")]
    OutOfMemory { what: String, bytes: usize },
    #[error(transparent)]
    Attention(#[from] AttentionError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

impl OpError {
    /// Shape error helper.
    pub fn shape(op: &'static str, detail: impl Into<String>) -> Self {
        Self::Shape {
            op,
            detail: detail.into(),
        }
    }
}
