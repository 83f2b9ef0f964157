//! # kvstream Qwen3.5/3.8 model
//!
//! Config parsing, safetensors loading, the hybrid forward pass (Gated DeltaNet + gated
//! attention) written against the backend-neutral ops of `kvstream-memory-contracts`, and the
//! MTP (NextN) head.

pub mod attention_kv;
