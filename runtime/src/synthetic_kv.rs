//! Synthetic KV history (benchmarks): fills every attention layer's host history with encoded
//! random rows so that decode at a long context can be measured without prefilling it.
//!
//! A child module of [`crate::streaming_kv`] (declared there with `#[path]`) so that it can keep
//! the manager's per-layer bookkeeping consistent.

use super::StreamingKv;
use crate::error::{Result, RuntimeError};
use kvstream_memory_contracts::kv::format::encode;
use kvstream_memory_contracts::ops::ModelBackend;
use rand::{Rng, SeedableRng};

/// Distinct random pages generated per layer; the history tiles them (the timing of attention
/// does not depend on the values, only on their being finite).
const DISTINCT_PAGES: usize = 4;

impl<B: ModelBackend> StreamingKv<B> {
    /// Replaces the history of every attention layer with `tokens` rows of encoded random K/V
    /// (values in [-1, 1), deterministic in `seed`). Outside a step only. Device pages are marked
    /// stale (refilled from the host at the next step); the current layout stays.
    pub fn fill_synthetic(&mut self, backend: &B, tokens: usize, seed: u64) -> Result<()> {
        let _span = tracing::info_span!("kv_fill_synthetic", tokens).entered();
        if self.step.is_some() {
            return Err(RuntimeError::Protocol(
                "fill_synthetic inside a step".into(),
            ));
        }
        if tokens > self.cfg.ctx_tokens {
            return Err(RuntimeError::PromptTooLong {
                prompt: tokens,
                ctx: self.cfg.ctx_tokens,
            });
        }
        self.reset(backend)?;
        let g = self.cfg.geometry;
        let tpp = g.tokens_per_page();
        let pb = g.page_bytes();
        let pages = g.pages_for(tokens);
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut row = vec![0f32; g.row_values()];
        let mut k = vec![0u8; g.k_row_bytes()];
        let mut v = vec![0u8; g.v_row_bytes()];
        for l in 0..self.cfg.layers {
            let mut distinct = Vec::with_capacity(DISTINCT_PAGES.min(pages));
            for _ in 0..DISTINCT_PAGES.min(pages) {
                let mut page = vec![0u8; pb];
                for t in 0..tpp {
                    row.iter_mut()
                        .for_each(|x| *x = rng.random_range(-1.0f32..1.0));
                    encode(g.k_type(), &row, &mut k)?;
                    row.iter_mut()
                        .for_each(|x| *x = rng.random_range(-1.0f32..1.0));
                    encode(g.v_type(), &row, &mut v)?;
                    let ko = g.k_row_offset(0, 0, t);
                    let vo = g.v_row_offset(0, 0, t);
                    page[ko..ko + k.len()].copy_from_slice(&k);
                    page[vo..vo + v.len()].copy_from_slice(&v);
                }
                distinct.push(page);
            }
            let bytes = std::sync::Arc::clone(self.host.layer_bytes(l)?);
            for p in 0..pages {
                bytes.write(p * pb, &distinct[p % distinct.len()])?;
            }
            self.host.commit_published(l, 0, tokens)?;
            self.lens[l] = tokens;
            self.valid[l] = 0;
        }
        Ok(())
    }
}
