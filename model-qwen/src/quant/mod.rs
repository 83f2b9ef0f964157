//! Quantized weights (issue 10; formats in `kvstream_memory_contracts::weight_format`, policy
//! and file layout in `docs/weights.md`).
//!
//! * [`WeightPolicy`]: which weights get which format at load time (`LoadOptions::weights`).
//! * [`LoadReport`]: what a load did ([`crate::QwenModel::load_report`]).
//! * [`save_quantized`]: a checkpoint directory already in device formats (loads zero-copy).
//! * [`plan_weight_bytes`]: device/host bytes of a policy from the config alone.
//!
//! Conversion happens tensor by tensor in the loader, in parallel over row blocks, so host
//! memory never holds a second full copy of the model. Public FP8 checkpoints (fine-grained
//! `weight_scale_inv` blocks or compressed-tensors `weight_scale`) load as `fp8_e4m3`.

pub(crate) mod convert;
pub(crate) mod fp8;
pub(crate) mod meta;
pub mod plan;
pub mod policy;
pub mod report;
pub(crate) mod role;
pub mod save;
pub(crate) mod synth;

pub use plan::{plan_weight_bytes, plan_weight_bytes_stored, WeightBytesPlan};
pub use policy::WeightPolicy;
pub use report::LoadReport;
pub use save::save_quantized;
