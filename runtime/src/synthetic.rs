//! Benchmark support on [`Engine`]: synthetic (random-weight) engines, synthetic KV histories
//! and timed multi-token steps that leave the session as it was.
//!
//! A child module of [`crate::engine`] (declared there with `#[path]`), so it works on the
//! engine's own state instead of widening its public surface.

use super::Engine;
use crate::error::{Result, RuntimeError};
use crate::phase::Phase;
use crate::EngineConfig;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_model_qwen::{AttentionPhase, LogitRows, QwenConfig, QwenModel};
use std::time::Instant;

/// What one timed step measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedStep {
    /// Query width (tokens in the forward).
    pub width: usize,
    /// Wall seconds of the forward, including the KV step (fills, attention, publication) and
    /// the logits of every row.
    pub seconds: f64,
    /// Host → device bytes the step copied (ring fills + resident refills).
    pub h2d_bytes: u64,
}

impl<B: ModelBackend> Engine<B> {
    /// An engine over a model of geometry `config` with random weights of `dtype` created
    /// directly on the device (no checkpoint is read or written; no tokenizer). `cfg.model_dir`
    /// is only used in messages. Speculative decoding (`cfg.spec`) needs a checkpoint's MTP
    /// tensors and is refused here with [`RuntimeError::InvalidConfig`].
    pub fn load_synthetic(
        backend: B,
        cfg: EngineConfig,
        config: QwenConfig,
        dtype: WeightDType,
        seed: u64,
    ) -> Result<Self> {
        let _span = tracing::info_span!("engine_load_synthetic", %dtype, seed).entered();
        if cfg.spec.is_some() {
            return Err(RuntimeError::InvalidConfig(
                "speculative decoding needs a checkpoint with MTP tensors; synthetic engines \
                 run without it"
                    .into(),
            ));
        }
        let c = config.clone();
        Self::load_parts(backend, cfg, config, move |b, o| {
            QwenModel::synthetic(b, &c, dtype, seed, o)
        })
    }

    /// Bytes of every loaded weight as stored on the device.
    pub fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    /// Starts a fresh session whose attention history is `tokens` rows of random K/V in every
    /// attention layer (deterministic in `seed`) with a zero recurrent state, so that decode at
    /// a long context can be measured without prefilling it. `planned` is the session length
    /// the layout should be planned for (≥ `tokens`; e.g. `tokens + steps`).
    pub fn fill_synthetic_history(
        &mut self,
        tokens: usize,
        planned: usize,
        seed: u64,
    ) -> Result<()> {
        if tokens == 0 {
            return Err(RuntimeError::InvalidRequest(
                "a synthetic history needs at least one token".into(),
            ));
        }
        self.reset()?;
        self.kv.fill_synthetic(&self.backend, tokens, seed)?;
        self.kv.set_planned_tokens(planned.max(tokens));
        Ok(())
    }

    /// Runs one forward of `tokens` (width `w = tokens.len()`: `w == 1` is a decode step, wider
    /// is a verify-like step with logits for every row) after the session's history, times it
    /// and rolls the session back to before it (KV history truncated, recurrent state
    /// restored), so it can be repeated at the same context length.
    pub fn timed_step(&mut self, tokens: &[u32]) -> Result<TimedStep> {
        let width = tokens.len();
        let _span = tracing::debug_span!("timed_step", width).entered();
        if width == 0 {
            return Err(RuntimeError::InvalidRequest("empty step".into()));
        }
        let before = self.kv.committed_tokens();
        if before == 0 {
            return Err(RuntimeError::Protocol(
                "no session: fill or prefill a history first".into(),
            ));
        }
        let vocab = self.config.vocab_size();
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RuntimeError::InvalidRequest(format!(
                "token {t} is outside the vocabulary of {vocab}"
            )));
        }
        let (phase, attn, rows) = if width == 1 {
            (
                Phase::Decode { width: 1 },
                AttentionPhase::Decode,
                LogitRows::Last,
            )
        } else {
            (
                Phase::Verify { width },
                AttentionPhase::Verify,
                LogitRows::All,
            )
        };
        self.kv.set_phase(&self.backend, phase)?;
        let cp = self.state.checkpoint(&self.backend)?;
        let h2d = |s: &crate::KvStats| s.h2d_ring_bytes + s.h2d_refill_bytes;
        let h0 = h2d(&self.kv.stats());
        let t = Instant::now();
        self.step(tokens, attn, rows)?;
        self.backend.synchronize()?;
        let seconds = t.elapsed().as_secs_f64();
        let h2d_bytes = h2d(&self.kv.stats()).saturating_sub(h0);
        self.kv.truncate(&self.backend, before)?;
        self.state.restore_from(&self.backend, &cp)?;
        Ok(TimedStep {
            width,
            seconds,
            h2d_bytes,
        })
    }
}
