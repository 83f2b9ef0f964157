//! The prompt cache: a request that extends the engine's current session reuses the host KV
//! history and a recurrent-state checkpoint at the shared prefix instead of re-prefilling it.
//!
//! KV can be truncated to any length, the GDN recurrent state cannot: it exists only after the
//! tokens it has seen. So a prefix is reusable only at a point where the engine has the state:
//! * the **current point**: the whole session (every token the target processed) is a prefix
//!   of the new prompt: nothing is truncated, the state stays (not with MTP, whose catch-up rows
//!   are pending after speculative decoding);
//! * the **prompt checkpoint**: the state saved after all but the last token of the last prompt
//!   (one device copy of the GDN state; with MTP also the last target hidden row): the KV history
//!   is truncated to that point (host history and device pages, the MTP layer to its rows) and
//!   the state restored together with it. Because it sits one token short of the prompt, the
//!   same prompt again (regenerate), or one that edits only its last token, hits it too.
//!
//! At least one prompt token is always prefilled (its logits start generation).

use crate::engine::Engine;
use crate::error::Result;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_model_qwen::RecurrentState;

/// The recurrent state (and MTP tail) at the end of a prompt prefill.
#[derive(Debug)]
pub struct PromptCheckpoint<B: ModelBackend> {
    /// Tokens processed when it was taken.
    pub pos: usize,
    state: RecurrentState<B>,
    mtp_tail: Option<B::Tensor>,
}

impl<B: ModelBackend> PromptCheckpoint<B> {
    /// Device bytes held by the checkpoint.
    pub fn device_bytes(&self) -> usize {
        self.state.device_bytes()
    }
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl<B: ModelBackend> Engine<B> {
    /// Saves the state after the current session (called at the end of a prompt prefill).
    pub(crate) fn save_prompt_checkpoint(&mut self) -> Result<()> {
        let _span = tracing::debug_span!("prompt_checkpoint").entered();
        let state = self.state.checkpoint(&self.backend)?;
        let mtp_tail = self
            .mtp_tail
            .as_ref()
            .map(|t| self.backend.copy_tensor(t))
            .transpose()?;
        self.prompt_cp = Some(PromptCheckpoint {
            pos: self.kv.committed_tokens(),
            state,
            mtp_tail,
        });
        Ok(())
    }

    /// Prefill with the prompt cache: reuses the longest reusable prefix, prefills the rest with
    /// a checkpoint after `prompt[..len - 1]` (so that the same prompt, or one that edits only
    /// its last token, hits the cache next time) and returns (cached tokens, last logits row).
    pub(crate) fn prefill_cached(&mut self, prompt: &[u32]) -> Result<(usize, Vec<f32>)> {
        let cached = self.reuse_prefix(prompt)?;
        if cached == 0 {
            self.reset()?;
        }
        let body = prompt.len() - 1;
        if cached < body {
            self.prefill_from(&prompt[..body], cached, false)?;
        }
        if body > 0 && self.prompt_cp.as_ref().is_none_or(|cp| cp.pos != body) {
            self.save_prompt_checkpoint()?;
        }
        let last = self.prefill_from(prompt, body.max(cached), false)?;
        Ok((cached, last))
    }

    /// How many rows of `prompt` [`Engine::reuse_prefix`] would reuse, without changing anything
    /// (0: none). The multimodal path uses it to skip encoding images inside the prefix.
    pub(crate) fn reusable_prefix(&self, prompt: &[u32]) -> usize {
        self.reusable(prompt).0
    }

    /// (reusable rows, whether they are the current point rather than the prompt checkpoint).
    fn reusable(&self, prompt: &[u32]) -> (usize, bool) {
        if !self.session_ok
            || self.session_tokens.is_empty()
            || self.session_tokens.len() != self.kv.committed_tokens()
        {
            return (0, false);
        }
        let c = common_prefix(&self.session_tokens, prompt);
        if self.cfg.spec.is_none() && c == self.session_tokens.len() && c < prompt.len() {
            return (c, true);
        }
        match &self.prompt_cp {
            Some(cp) if cp.pos > 0 && cp.pos <= c && cp.pos < prompt.len() => (cp.pos, false),
            _ => (0, false),
        }
    }

    /// Prepares the session for `prompt`: keeps or restores the longest reusable prefix and
    /// returns its length (0: nothing reusable, the caller prefills from scratch).
    pub(crate) fn reuse_prefix(&mut self, prompt: &[u32]) -> Result<usize> {
        let (n, at_current_point) = self.reusable(prompt);
        let _span = tracing::debug_span!("prompt_cache", reusable = n).entered();
        if n == 0 || at_current_point {
            return Ok(n);
        }
        let Some(cp) = self.prompt_cp.take() else {
            return Ok(0);
        };
        let pos = cp.pos;
        let restored = (|| -> Result<()> {
            self.kv.truncate(&self.backend, pos)?;
            if self.cfg.spec.is_some() {
                let mtp_layer = self.kv.target_layers();
                self.kv.truncate_layer(&self.backend, mtp_layer, pos - 1)?;
            }
            self.state.restore_from(&self.backend, &cp.state)?;
            self.mtp_tail = cp
                .mtp_tail
                .as_ref()
                .map(|t| self.backend.copy_tensor(t))
                .transpose()?;
            Ok(())
        })();
        self.session_tokens.truncate(pos);
        self.prompt_cp = Some(cp);
        match restored {
            Ok(()) => Ok(pos),
            Err(e) => {
                // The session is half restored: drop it (the caller prefills from scratch).
                self.reset()?;
                tracing::warn!(error = %e, "prompt cache restore failed; full prefill");
                Ok(0)
            }
        }
    }
}
