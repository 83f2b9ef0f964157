//! The seam between the model and whoever owns the KV cache.
//!
//! The model computes, for each full-attention layer, the queries and the new K/V rows (after
//! q_norm/k_norm and RoPE) and hands them to an [`AttentionKv`]. The implementation stores the
//! rows (device pages + host history), plans the spans and runs streamed attention. The model
//! never sees pages, rings or arenas. `model-qwen` ships [`crate::resident::ResidentKv`] (all
//! pages resident, for tests and the `logits` reference path); `runtime` ships the streaming one.
//!
//! Attention layer numbering: the model's full-attention layers are `0..n_attention_layers` in
//! order; the MTP layer is `n_attention_layers` (logical layer L+1).

use kvstream_memory_contracts::ops::ModelBackend;

/// What one attention call is for (the phase; never inferred from a batch size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPhase {
    /// Prompt processing: many queries.
    Prefill,
    /// One new token.
    Decode,
    /// Verification of `width - 1` drafted tokens plus the last accepted one.
    Verify,
    /// The MTP head (catch-up or drafting).
    Mtp,
}

/// Stores new KV rows and computes attention for one layer.
pub trait AttentionKv<B: ModelBackend> {
    /// The error type (the runtime's or the model's).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Appends `k` and `v` (`[T, kv_heads · head_dim]`, post-norm/RoPE) as the next `T` tokens of
    /// attention layer `layer`, then returns causal attention of `q` (`[T, q_heads · head_dim]`)
    /// over all of that layer's tokens: `[T, q_heads · head_dim]`.
    fn append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        phase: AttentionPhase,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
    ) -> Result<B::Tensor, Self::Error>;

    /// Tokens currently held by attention layer `layer`.
    fn len(&self, layer: usize) -> usize;
}
