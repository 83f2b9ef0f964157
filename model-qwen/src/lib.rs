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
//! * [`attention_kv`]: the seam to whoever owns the KV cache; [`resident`]: all-resident KV.

pub mod attention_kv;
pub mod config;
pub mod error;
mod layers;
pub mod model;
pub mod resident;
pub mod state;
pub mod synthetic;
pub mod weights;

pub use attention_kv::{AttentionKv, AttentionPhase};
pub use config::{GateActivation, LayerType, QwenConfig};
pub use error::ModelError;
pub use model::{text_positions, ForwardOutput, LoadOptions, LogitRows, QwenModel, GDN_CHUNK};
pub use resident::{ResidentKv, ResidentKvError, ResidentKvOptions};
pub use state::{GdnState, RecurrentState};
pub use synthetic::{SyntheticWeights, TensorSource};
