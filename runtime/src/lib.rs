//! # kvstream runtime
//!
//! The engine that serves a Qwen3.5/3.8 hybrid model whose KV cache does not fit the device:
//! every full-attention layer's K/V history lives in pinned host memory (the truth), the device
//! holds per-layer resident pages plus one shared ring of page slots inside a phase arena, and
//! attention walks resident + ring spans in token order with one final normalisation, so the
//! streamed result equals the all-resident one bit for bit on one backend.
//!
//! ## Public API (what the `kvstream` CLI uses)
//!
//! ```no_run
//! # use kvstream_runtime::*;
//! # fn demo<B: kvstream_memory_contracts::ops::ModelBackend>(backend: B) -> Result<(), RuntimeError> {
//! let mut cfg = EngineConfig::new("/models/qwen");
//! cfg.ctx_size = 32_768;
//! cfg.k_type = "q8_0".parse()?;
//! cfg.v_type = "q4_0".parse()?;
//! cfg.arena_bytes = parse_size("2240MiB")?;
//! cfg.page_tokens = 256;
//! // Admission (every phase's arena layout) runs before any weight is read.
//! let mut engine = Engine::load(backend, cfg)?;
//! let req = GenerateRequest {
//!     prompt: Prompt::Chat(vec![ChatMessage::new("user", "Hello")]),
//!     n_predict: 64,
//!     sampling: SamplingParams { temperature: 0.7, top_p: 0.9, seed: 1, ..Default::default() },
//!     stop_at_eos: true,
//!     reuse_prefix: false,
//! };
//! let out = engine.generate(&req, |ev| {
//!     print!("{}", ev.text);
//!     Flow::Continue
//! })?;
//! println!("\n{}", out.stats.to_json());
//! let logits = engine.logits(&out.prompt_tokens)?; // [T, V] row-major, streaming path
//! # let _ = logits; Ok(()) }
//! ```
//!
//! * [`EngineConfig`]: model dir, `ctx_size`, `k_type`/`v_type` (f32, f16, bf16, q8_0, q4_0),
//!   `arena_bytes` (parse with [`parse_size`]: `2240MiB`, `96KiB`, plain bytes), `page_tokens`
//!   (default 256), `prefill_chunk` (default 256), `min_ring_slots`, `min_resident_pages`.
//! * [`Engine::load`] → typed errors: [`RuntimeError::ArenaTooSmall`] (phase, required and
//!   missing bytes), [`RuntimeError::ContextTooLarge`], [`RuntimeError::Capability`] (K/V pair),
//!   [`RuntimeError::Model`], [`RuntimeError::File`]. [`check_admission`] runs admission alone.
//! * [`Engine::generate`] with a [`GenerateRequest`] ([`Prompt::Text`], [`Prompt::Tokens`] or
//!   [`Prompt::Chat`]; `n_predict`; [`SamplingParams`]: temperature (0 = greedy), top_k, top_p,
//!   min_p, seed, repeat_penalty) and a callback returning [`Flow`] → [`GenerateResult`]
//!   (tokens, text, [`StopReason`], [`EngineStats`]). A prompt longer than the context is
//!   [`RuntimeError::PromptTooLong`]. Generation stops at the config's EOS ids.
//! * [`Engine::logits`]: `[T, V]` f32 logits through the streaming path.
//! * [`Engine::stats`]: [`EngineStats`] (prefill and decode tok/s separately, host→device bytes
//!   per decoded token) with [`KvStats`] (resident pages per layer, ring slots, ring traffic,
//!   copy-busy, ready misses, waves, peak arena use by region); `serde` serialisable
//!   ([`EngineStats::to_json`]).
//!
//! ## Modules
//! * [`policy`]: the pure adaptive placement policy (property-tested).
//! * [`placement`]: pool byte layout and span plans.
//! * [`prefetch`]: ring-slot scheduler (FIFO ownership, waves, bounded lookahead).
//! * [`streaming_kv`]: [`StreamingKv`], the model's `AttentionKv` implementation.
//! * [`phase`]: phase arena layouts, admission and the transition protocol.
//! * [`memory_plan`]: the device memory plan (weights by class + recurrent state + arena +
//!   fixed overhead) and its verdict against a device budget.
//! * [`engine`], [`sampling`], [`chat`], [`stats`], [`size`], [`error`].
//!
//! Speculative decoding with the MTP head ([`EngineConfig::spec`] = [`SpecConfig`]`{ draft_n_max }`,
//! 1..=4): the MTP attention layer is logical layer L+1 of the same pool; see [`mtp`] for the
//! cycle (catch-up → draft → verify → accept → exact rollback) and [`speculative`] for the
//! acceptance rules. [`Engine::mtp_logits`] gives the MTP head's logits through the streaming
//! path; [`EngineStats::spec`] reports drafted/accepted tokens and the extra device memory.
//!
//! Images ([`multimodal`]): [`Engine::preprocess_image`] → [`ImageInput`];
//! [`Engine::generate_multimodal`] / [`Engine::start_session_multimodal`] encode each image in an
//! arena loan ([`Phase::Vision`]), prefill with the image rows at M-RoPE positions and decode on
//! (plain or MTP); [`Engine::vision_stats`] records every loan and the arena use after it.
//!
//! Prompt cache: [`GenerateRequest::reuse_prefix`] reuses the session's host KV history and a
//! recurrent-state checkpoint at the shared prefix ([`prompt_cache`]);
//! [`GenerateResult::cached_tokens`] reports how many prompt tokens were not prefilled.

pub mod chat;
pub mod engine;
pub mod error;
pub mod memory_plan;
pub mod mtp;
pub mod multimodal;
pub mod phase;
pub mod placement;
pub mod policy;
pub mod prefetch;
pub mod prompt_cache;
pub mod sampling;
pub mod size;
pub mod speculative;
pub mod stats;
pub mod streaming_kv;

pub use chat::{expand_image_pads, ChatMessage, ChatPart, TextCodec, IMAGE_PLACEHOLDER};
pub use engine::TimedStep;
pub use engine::{
    check_admission, check_admission_for_config, check_kv_pair, Engine, EngineConfig, Flow,
    GenerateRequest, GenerateResult, Prompt, StopReason, TokenEvent,
};
pub use error::RuntimeError;
pub use memory_plan::{
    plan_from_config, plan_memory, MemoryPlan, PlanOptions, Verdict, WeightRows,
};
pub use multimodal::{
    vision_weight_bytes, vision_workspace_bytes, ImageInput, LoanRecord, PositionMap,
    VisionOptions, VisionStats,
};
pub use phase::{Phase, PhaseLayout};
pub use sampling::{Sampler, SamplingParams};
pub use size::parse_size;
pub use speculative::{SpecConfig, SpecReport, SpecStats};
pub use stats::{EngineStats, KvStats};
pub use streaming_kv::{StreamingKv, StreamingKvConfig};
