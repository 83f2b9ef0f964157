//! # kvstream Qwen3.5/3.8 model
//!
//! Config parsing, safetensors loading, the hybrid forward pass (Gated DeltaNet + gated
//! attention) written against the backend-neutral ops of `kvstream-memory-contracts`, and the
//! MTP (NextN) head.
//!
//! * [`config`]: `config.json` (wrapper or bare text form) → [`QwenConfig`].
//! * [`weights`]: memory-mapped safetensors (single file or sharded).
//! * [`model`]: [`QwenModel`] (`load`, `forward`, `mtp_forward`).
//! * [`state`]: per-sequence GDN state ([`RecurrentState`]).
//! * [`vision`]: the vision tower (preprocess + encode on a backend); [`rope_index`]: multimodal
//!   M-RoPE positions.
//! * [`attention_kv`]: the seam to whoever owns the KV cache; [`resident`]: all-resident KV.
//! * [`quant`]: quantized weights ([`WeightPolicy`], [`save_quantized`], [`plan_weight_bytes`]);
//!   [`embedding`]: the host-resident embedding table.
//! * Linears that share their input (MLP gate/up, GDN in_proj_qkv/z, attention q/k/v) are
//!   loaded fused into one weight (`fused`, [`FUSE_ENV`], [`LoadOptions::fuse_projections`]).

pub mod attention_kv;
pub mod config;
pub mod embedding;
pub mod error;
mod fused;
mod layers;
pub mod model;
pub mod quant;
pub mod resident;
pub mod rope_index;
pub mod state;
pub mod synthetic;
pub mod vision;
pub mod weights;

pub use attention_kv::{AttentionKv, AttentionPhase};
pub use config::{GateActivation, LayerType, QwenConfig};
pub use embedding::HostEmbedding;
pub use error::ModelError;
pub use fused::FUSE_ENV;
pub use model::ImageEmbeds;
pub use model::{text_positions, ForwardOutput, LoadOptions, LogitRows, QwenModel, GDN_CHUNK};
pub use quant::{
    plan_weight_bytes, plan_weight_bytes_stored, save_quantized, LoadReport, WeightBytesPlan,
    WeightPolicy,
};
pub use resident::{ResidentKv, ResidentKvError, ResidentKvOptions};
pub use rope_index::{mrope_positions, MropePositions, RopeIndexError};
pub use state::{GdnState, RecurrentState};
pub use synthetic::{SyntheticWeights, TensorSource};
pub use vision::{
    DeviceVisionWeights, PreprocessedImage, PreprocessorConfig, VisionBackend, VisionConfig,
    VisionError, VisionTower,
};
