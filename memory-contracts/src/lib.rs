//! # kvstream memory contracts
//!
//! Backend-neutral types and traits at the bottom of the kvstream dependency graph:
//!
//! * [`kv::format`]: KV element formats (F32, F16, BF16, Q8_0, Q4_0) with encode/decode.
//! * [`kv::geometry`]: page geometry (K plane + aligned V plane, token-major).
//! * [`kv::span`]: validated span plans over resident pages and ring slots.
//! * [`arena`]: the transactional region map of the phase arena, views, leases, generations.
//! * [`host`]: pinned host registration and the authoritative host KV store.
//! * [`transfer`]: device memory, the copy engine and ready/consumed fences.
//! * [`attention`]: streamed attention (one walk in token order, one final normalisation).
//! * [`ops`]: the compute ops a model needs.
//! * [`backend`]: the [`backend::Backend`] trait (associated types) and capabilities.
//! * [`error`]: typed errors, including [`error::CapabilityError`].
//! * [`weight_format`]: quantized weight formats (q8_0, q4_g128, fp8_e4m3): layouts, quantize,
//!   dequantize.
//! * [`report`]: the capability table and the first missing capability of a model run.
//!
//! No backend code lives here. Backends implement the traits; validation stays in this crate
//! and in the runtime.

pub mod arena;
pub mod attention;
pub mod backend;
pub mod error;
pub mod host;
pub mod kv;
pub mod ops;
pub mod region_alloc;
pub mod report;
pub mod transfer;
pub mod weight_format;

#[cfg(feature = "conformance")]
pub mod conformance;

pub use backend::{
    Backend, Capabilities, DeviceBuffer, DeviceTensor, DeviceWeight, Fence, WeightDType,
};
pub use error::CapabilityError;
pub use weight_format::{
    dequantize, dequantize_row, e4m3_to_f32, f32_to_e4m3, quant_layout, quantize, QuantLayout,
    WeightFormatError,
};
