//! Speculative decoding with the MTP head, sharing the KV pool.
//!
//! The MTP attention layer is logical layer L+1 of the same [`crate::StreamingKv`]: its own
//! authoritative host history, its pages counted by the same policy (resident pages + ring
//! suffix). Steps are sequential, so the ring belongs to one side at a time and every wave is
//! consumed before the next step (the target's verification) plans its own.
//!
//! MTP row `i` (at position `i`) consumes the target hidden `h_i` (post final norm) and token
//! `i + 1`, and predicts token `i + 2`. Invariant between cycles: the target has processed
//! positions `0..n`, the pending token `x = t_n` is sampled but not yet processed, and the MTP
//! layer holds the real rows `0..n - c` where `c` rows wait in the catch-up batch.
//!
//! One cycle:
//! 1. **catch-up**: the MTP head runs the waiting rows (target hidden + confirmed next tokens);
//!    the last row's logits give draft `d_1`;
//! 2. **draft**: rows chained on the MTP's own output (hidden = previous MTP output, token =
//!    previous draft) give `d_2..d_k`;
//! 3. **verify**: the target runs `[x, d_1..d_k]` (width `k + 1`, [`AttentionPhase::Verify`])
//!    with a recurrent checkpoint after every token;
//! 4. **accept** ([`accept_greedy`] / [`accept_sampled`]) `a` drafts and the target's next token;
//! 5. **rollback**: target KV truncated to `n + a + 1` (host history and device validity), the
//!    recurrent state restored from checkpoint `a`, the MTP layer truncated to its real rows
//!    (its draft rows used MTP outputs as hidden). Accepted work is never recomputed: the
//!    verified hidden rows `h_n..h_{n+a}` become the next catch-up batch.

use crate::engine::{from_model, Emitter, Engine, StepOut};
use crate::error::{Result, RuntimeError};
use crate::phase::Phase;
use crate::sampling::Sampler;
use crate::speculative::{accept_greedy, accept_sampled, probs, sample_from, SpecReport};
use crate::{Flow, StopReason, TokenEvent};
use kvstream_memory_contracts::error::CapabilityError;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_model_qwen::weights::Checkpoint;
use kvstream_model_qwen::{AttentionPhase, ImageEmbeds, LogitRows, QwenConfig};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::Path;

/// The rows of `rows` (one `h`-wide row per `token_id` in `c`, in order) that belong to the
/// placeholders inside `c[range]`; `None` when that range holds none (or `rows` is too short,
/// which the model then reports as a typed row-count error).
fn placeholder_rows<'r>(
    c: &[u32],
    range: std::ops::Range<usize>,
    token_id: u32,
    rows: &'r [f32],
    h: usize,
) -> Option<&'r [f32]> {
    let count = |s: &[u32]| s.iter().filter(|&&t| t == token_id).count();
    let before = count(c.get(..range.start)?);
    let k = count(c.get(range)?);
    (k > 0)
        .then(|| rows.get(before * h..(before + k) * h))
        .flatten()
}

/// Fails with a [`CapabilityError`] (operation `spec_draft_mtp`) unless the model has exactly
/// one MTP layer and its checkpoint holds the `mtp.*` weights. Reads only the checkpoint's
/// tensor index (no weight is loaded).
pub fn check_mtp_capability<B: ModelBackend>(
    backend: &B,
    config: &QwenConfig,
    dir: &Path,
) -> Result<()> {
    let name = backend.capabilities().backend;
    let n = config.mtp_num_hidden_layers();
    if n != 1 {
        return Err(CapabilityError::new(
            name,
            "spec_draft_mtp",
            format!(
                "--spec-type draft-mtp needs exactly one MTP layer; the model has \
                 mtp_num_hidden_layers = {n}"
            ),
        )
        .into());
    }
    let ck = Checkpoint::open(dir)?;
    let missing: Vec<&str> = [
        "mtp.fc.weight",
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ]
    .into_iter()
    .filter(|t| !ck.contains(t))
    .collect();
    if !missing.is_empty() {
        return Err(CapabilityError::new(
            name,
            "spec_draft_mtp",
            format!(
                "--spec-type draft-mtp: the checkpoint in {} has no MTP weights (missing {})",
                dir.display(),
                missing.join(", ")
            ),
        )
        .into());
    }
    Ok(())
}

impl<B: ModelBackend> Engine<B> {
    /// One MTP step: rows at positions following the MTP layer's history, `next_tokens[i]` the
    /// token after hidden row i. The recurrent state is untouched; a failure rolls the KV step
    /// back.
    pub(crate) fn mtp_step(
        &mut self,
        next_tokens: &[u32],
        hidden: &B::Tensor,
        rows: LogitRows,
    ) -> Result<StepOut<B>> {
        self.mtp_step_with(next_tokens, None, hidden, rows)
    }

    /// [`Engine::mtp_step`] where the next tokens may be image placeholders: `image` holds their
    /// vision rows (one per placeholder of `next_tokens`, in order), which the MTP head embeds
    /// instead of the placeholder id.
    pub(crate) fn mtp_step_with(
        &mut self,
        next_tokens: &[u32],
        image: Option<ImageEmbeds<'_>>,
        hidden: &B::Tensor,
        rows: LogitRows,
    ) -> Result<StepOut<B>> {
        let _span = tracing::debug_span!("mtp_step", t = next_tokens.len()).entered();
        let p0 = self.kv.mtp_tokens();
        // The MTP head gets the target's positions (M-RoPE after images).
        let positions = self.mm.positions.range(p0, next_tokens.len());
        self.kv
            .begin_step(&self.backend, AttentionPhase::Mtp, next_tokens.len())?;
        let out = match image {
            Some(image) => self.model.mtp_forward_multimodal(
                &self.backend,
                next_tokens,
                image,
                hidden,
                &positions,
                &mut self.kv,
                rows,
            ),
            None => self.model.mtp_forward(
                &self.backend,
                next_tokens,
                hidden,
                &positions,
                &mut self.kv,
                rows,
            ),
        };
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                self.kv.abort_step(&self.backend);
                return Err(from_model(e));
            }
        };
        self.kv.finish_step(&self.backend)?;
        let logits = out
            .logits
            .map(|l| self.backend.tensor_to_f32(&l))
            .transpose()?;
        Ok(StepOut {
            hidden: out.hidden,
            logits,
        })
    }

    /// After a prefill chunk `c` with final-norm hidden rows `hidden`: the MTP rows whose next
    /// token is now known (the previous chunk's last row, then all rows but this chunk's last).
    /// Returns the logits rows requested, in position order.
    pub(crate) fn mtp_prefill_chunk(
        &mut self,
        c: &[u32],
        hidden: &B::Tensor,
        rows: LogitRows,
    ) -> Result<Vec<f32>> {
        self.mtp_prefill_chunk_with(c, None, hidden, rows)
    }

    /// [`Engine::mtp_prefill_chunk`] for a chunk holding image placeholders: `image.rows` are
    /// the vision rows of the chunk's placeholders, in order; each MTP row whose next token is a
    /// placeholder embeds its vision row (as vLLM's multimodal MTP drafter does), so drafts after
    /// an image see what the target saw.
    pub(crate) fn mtp_prefill_chunk_with(
        &mut self,
        c: &[u32],
        image: Option<ImageEmbeds<'_>>,
        hidden: &B::Tensor,
        rows: LogitRows,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::new();
        // The placeholder rows of c[..1] and of c[1..].
        let h = self.config.hidden_size();
        let split = |range: std::ops::Range<usize>| -> Option<ImageEmbeds<'_>> {
            let img = image.as_ref()?;
            let rows = placeholder_rows(c, range, img.token_id, img.rows, h)?;
            Some(ImageEmbeds {
                token_id: img.token_id,
                rows,
            })
        };
        if let Some(tail) = self.mtp_tail.take() {
            if let Some(l) = self
                .mtp_step_with(&c[..1], split(0..1), &tail, rows)?
                .logits
            {
                out.extend(l);
            }
        }
        let n = c.len();
        if n > 1 {
            let h = self.backend.rows(hidden, 0, n - 1)?;
            if let Some(l) = self.mtp_step_with(&c[1..], split(1..n), &h, rows)?.logits {
                out.extend(l);
            }
        }
        self.mtp_tail = Some(self.backend.rows(hidden, n - 1, 1)?);
        Ok(out)
    }

    /// MTP logits `[T - 1, V]` (row-major) of `tokens` in a fresh session, through the streaming
    /// path: row i from the target hidden of position i and token i + 1 (it predicts token
    /// i + 2). Needs an engine loaded with [`crate::EngineConfig::spec`].
    pub fn mtp_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        if !self.model.has_mtp() {
            return Err(RuntimeError::InvalidRequest(
                "mtp_logits needs an engine loaded with speculative decoding (MTP head)".into(),
            ));
        }
        if tokens.len() < 2 {
            return Err(RuntimeError::InvalidRequest(
                "mtp_logits needs at least two tokens".into(),
            ));
        }
        self.check_tokens(tokens)?;
        self.kv.reset_stats();
        self.stats = crate::EngineStats::default();
        self.reset()?;
        self.kv.set_planned_tokens(tokens.len());
        self.kv.set_phase(&self.backend, Phase::Prefill)?;
        let chunk = self.cfg.prefill_chunk.max(1);
        let mut out = Vec::new();
        for c in tokens.chunks(chunk) {
            let step = self.step_full(c, AttentionPhase::Prefill, LogitRows::None, None)?;
            out.extend(self.mtp_prefill_chunk(c, &step.hidden, LogitRows::All)?);
        }
        self.stats.prefill_tokens = tokens.len() as u64;
        Ok(out)
    }

    /// The speculative report of the current call (None without speculation).
    pub(crate) fn spec_report(&self) -> Option<SpecReport> {
        let spec = self.cfg.spec?;
        let mtp_layer = self.kv.target_layers();
        let resident = self.kv.layout().map_or(0, |l| {
            l.placement().resident.get(mtp_layer).copied().unwrap_or(0)
        });
        Some(SpecReport::new(
            spec.draft_n_max,
            &self.spec_stats,
            self.model.mtp_weight_bytes() as u64,
            resident,
            self.checkpoint_stage_peak,
        ))
    }

    /// Picks draft `d` from MTP logits: greedy (the sampler's own rule) or sampled from the
    /// transformed distribution q (returned for the acceptance test).
    fn draft_pick(
        &self,
        sampler: &mut Sampler,
        rng: &mut StdRng,
        logits: &[f32],
        history: &[u32],
    ) -> Result<(u32, Vec<f32>)> {
        if sampler.params().temperature == 0.0 {
            Ok((sampler.sample(logits, history)?, Vec::new()))
        } else {
            let q = probs(sampler.params(), logits, history)?;
            Ok((sample_from(&q, rng), q))
        }
    }

    /// Drafts up to `k` tokens: catch-up of the waiting rows, then chained MTP rows.
    fn draft(
        &mut self,
        k: usize,
        cu_tokens: &[u32],
        cu_hidden: &B::Tensor,
        history: &[u32],
        sampler: &mut Sampler,
        rng: &mut StdRng,
    ) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
        let rows = if k > 0 {
            LogitRows::Last
        } else {
            LogitRows::None
        };
        let mut out = self.mtp_step(cu_tokens, cu_hidden, rows)?;
        let mut drafts = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        let mut hist = history.to_vec();
        for j in 0..k {
            let logits = out
                .logits
                .take()
                .ok_or_else(|| RuntimeError::Protocol("MTP step returned no logits".into()))?;
            let (d, q) = self.draft_pick(sampler, rng, &logits, &hist)?;
            drafts.push(d);
            qs.push(q);
            hist.push(d);
            if j + 1 < k {
                let n = out.hidden.numel_rows(self.config.hidden_size());
                let h = self.backend.rows(&out.hidden, n - 1, 1)?;
                out = self.mtp_step(&[d], &h, LogitRows::Last)?;
            }
        }
        Ok((drafts, qs))
    }

    /// The speculative decode loop (see the module docs). Greedy output equals
    /// [`Engine::generate`] without speculation token for token; sampled output has the same
    /// distribution.
    pub(crate) fn decode_speculative(
        &mut self,
        em: &mut Emitter,
        first_logits: Vec<f32>,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<StopReason> {
        let spec = self
            .cfg
            .spec
            .ok_or_else(|| RuntimeError::Protocol("speculative decode without spec".into()))?;
        let n_max = spec.draft_n_max;
        let mut rng = StdRng::seed_from_u64(sampler.params().seed ^ 0x5eed_5bec);
        self.kv
            .set_phase(&self.backend, Phase::Verify { width: n_max + 1 })?;
        let x = sampler.sample(&first_logits, &em.history)?;
        if let Some(stop) = em.push(self.codec.as_ref(), x, on_token)? {
            return Ok(stop);
        }
        let mut cu = self.first_catch_up(x)?;
        loop {
            let n = self.kv.committed_tokens();
            if n >= self.cfg.ctx_size {
                return Ok(StopReason::ContextFull);
            }
            let k = n_max
                .min(em.remaining().saturating_sub(1))
                .min(self.cfg.ctx_size - n - 1);
            let history = em.history.clone();
            let (drafts, a, next) =
                self.spec_cycle(&mut cu, k, &history, sampler, &mut rng, None)?;
            self.stats.decode_tokens += (a + 1) as u64;
            for &t in drafts[..a].iter().chain(std::iter::once(&next)) {
                if let Some(stop) = em.push(self.codec.as_ref(), t, on_token)? {
                    return Ok(stop);
                }
            }
        }
    }

    /// The first catch-up batch after a prefill whose next token is `x`.
    pub(crate) fn first_catch_up(&mut self, x: u32) -> Result<CatchUp<B>> {
        let hidden = self
            .mtp_tail
            .take()
            .ok_or_else(|| RuntimeError::Protocol("no target hidden row after prefill".into()))?;
        Ok(CatchUp {
            hidden,
            tokens: vec![x],
        })
    }

    /// One cycle: catch-up + `k` drafts (or `forced` drafts, a test hook), verification,
    /// acceptance and exact rollback. `cu.tokens` last entry is the pending token `x`; `cu` is
    /// replaced by the next catch-up batch. Returns (drafts, accepted, next token).
    pub(crate) fn spec_cycle(
        &mut self,
        cu: &mut CatchUp<B>,
        k: usize,
        history: &[u32],
        sampler: &mut Sampler,
        rng: &mut StdRng,
        forced: Option<&[u32]>,
    ) -> Result<(Vec<u32>, usize, u32)> {
        let n = self.kv.committed_tokens();
        let _span = tracing::debug_span!("spec_cycle", n, k).entered();
        let x = *cu
            .tokens
            .last()
            .ok_or_else(|| RuntimeError::Protocol("empty catch-up batch".into()))?;
        let (mut drafts, mut qs) = self.draft(k, &cu.tokens, &cu.hidden, history, sampler, rng)?;
        if let Some(f) = forced {
            drafts = f.to_vec();
            qs = vec![vec![0.0; self.config.vocab_size()]; f.len()];
            for (q, &d) in qs.iter_mut().zip(f) {
                if let Some(v) = q.get_mut(d as usize) {
                    *v = 1.0;
                }
            }
        }
        let (verdict, hidden, mut cps) = self.verify(x, &drafts, &qs, sampler, rng, history)?;
        let a = verdict.accepted;
        if !drafts.is_empty() {
            self.spec_stats.record(drafts.len(), a);
        }
        // Rollback: target KV to n + a + 1 and the recurrent state after x, d_1..d_a; the MTP
        // layer to its real rows (0..n).
        let mtp_layer = self.kv.target_layers();
        self.kv.truncate(&self.backend, n + a + 1)?;
        self.kv.truncate_layer(&self.backend, mtp_layer, n)?;
        self.session_tokens.truncate(n + a + 1);
        let cp = cps
            .get(a)
            .ok_or_else(|| RuntimeError::Protocol("missing recurrent checkpoint".into()))?;
        self.state.restore_from(&self.backend, cp)?;
        cps.clear();
        cu.hidden = self.backend.rows(&hidden, 0, a + 1)?;
        cu.tokens = drafts[..a].to_vec();
        cu.tokens.push(verdict.next);
        Ok((drafts, a, verdict.next))
    }

    /// Runs the target over `[x, drafts..]` with a checkpoint after every token and applies the
    /// acceptance rule. Returns the verdict, the hidden rows and the checkpoints.
    fn verify(
        &mut self,
        x: u32,
        drafts: &[u32],
        qs: &[Vec<f32>],
        sampler: &mut Sampler,
        rng: &mut StdRng,
        history: &[u32],
    ) -> Result<(
        crate::speculative::Verdict,
        B::Tensor,
        Vec<kvstream_model_qwen::RecurrentState<B>>,
    )> {
        let vocab = self.config.vocab_size();
        let mut tokens = Vec::with_capacity(drafts.len() + 1);
        tokens.push(x);
        tokens.extend_from_slice(drafts);
        let mut cps = Vec::with_capacity(tokens.len());
        let out = self.step_full(
            &tokens,
            AttentionPhase::Verify,
            LogitRows::All,
            Some(&mut cps),
        )?;
        let stage =
            (cps.len() + usize::from(self.cfg.checkpoint_steps)) * self.state.device_bytes();
        self.checkpoint_stage_peak = self.checkpoint_stage_peak.max(stage as u64);
        let logits = out
            .logits
            .ok_or_else(|| RuntimeError::Protocol("verify returned no logits".into()))?;
        if logits.len() != tokens.len() * vocab {
            return Err(RuntimeError::Protocol(format!(
                "verify returned {} logits for {} rows of {vocab}",
                logits.len(),
                tokens.len()
            )));
        }
        let mut hist = history.to_vec();
        let verdict = if sampler.params().temperature == 0.0 {
            let mut argmax = Vec::with_capacity(tokens.len());
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                argmax.push(sampler.sample(row, &hist)?);
                if let Some(&d) = drafts.get(j) {
                    hist.push(d);
                }
            }
            accept_greedy(drafts, &argmax)
        } else {
            let mut ps = Vec::with_capacity(tokens.len());
            for (j, row) in logits.chunks_exact(vocab).enumerate() {
                ps.push(probs(sampler.params(), row, &hist)?);
                if let Some(&d) = drafts.get(j) {
                    hist.push(d);
                }
            }
            accept_sampled(drafts, qs, &ps, rng)
        }
        .ok_or_else(|| RuntimeError::Protocol("acceptance shapes do not match".into()))?;
        Ok((verdict, out.hidden, cps))
    }
}

/// The MTP rows waiting for their catch-up: target hidden rows (post final norm) and, for each,
/// the confirmed token after it (the last one is the pending token).
pub(crate) struct CatchUp<B: ModelBackend> {
    pub(crate) hidden: B::Tensor,
    pub(crate) tokens: Vec<u32>,
}

/// Rows of a `[T, H]` tensor.
trait NumelRows {
    fn numel_rows(&self, h: usize) -> usize;
}

impl<T: kvstream_memory_contracts::backend::DeviceTensor> NumelRows for T {
    fn numel_rows(&self, h: usize) -> usize {
        self.numel() / h.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{argmax, SamplingParams};
    use crate::speculative::SpecConfig;
    use crate::EngineConfig;
    use kvstream_backend_cpu::CpuBackend;
    use kvstream_memory_contracts::kv::format::KvType;
    use kvstream_memory_contracts::ops::TensorOps;
    use std::path::PathBuf;

    #[test]
    fn placeholder_rows_follow_the_chunk_split() {
        // Placeholder 9, rows of width 2 numbered by placeholder: [0,0], [1,1], [2,2].
        let c = [9, 5, 9, 9, 7];
        let rows = [0., 0., 1., 1., 2., 2.];
        assert_eq!(placeholder_rows(&c, 0..1, 9, &rows, 2), Some(&rows[0..2]));
        assert_eq!(placeholder_rows(&c, 1..5, 9, &rows, 2), Some(&rows[2..6]));
        assert_eq!(placeholder_rows(&c, 3..4, 9, &rows, 2), Some(&rows[4..6]));
        assert_eq!(
            placeholder_rows(&c, 1..2, 9, &rows, 2),
            None,
            "no placeholder"
        );
        assert_eq!(
            placeholder_rows(&c, 0..5, 9, &rows[..4], 2),
            None,
            "too few rows"
        );
        assert_eq!(
            placeholder_rows(&c, 4..9, 9, &rows, 2),
            None,
            "range past the chunk"
        );
    }

    fn fixture(name: &str) -> PathBuf {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
        match name.strip_prefix("models/") {
            Some(model) => root.join("models").join(model),
            None => root.join("fixtures").join(name),
        }
    }

    /// One resident page per layer + a 3-slot ring: most pages stream.
    fn tiny(name: &str, spec: Option<usize>) -> EngineConfig {
        let mut c = EngineConfig::new(fixture(name));
        c.ctx_size = 256;
        c.k_type = KvType::F32;
        c.v_type = KvType::F32;
        c.page_tokens = 4;
        c.prefill_chunk = 8;
        c.arena_bytes = 8 << 20;
        c.min_ring_slots = 3;
        let layers = QwenConfig::from_model_dir(&fixture(name))
            .expect("config")
            .n_attention_layers();
        c.max_pool_pages = Some(layers + 1 + 3);
        c.spec = spec.map(|draft_n_max| SpecConfig { draft_n_max });
        c
    }

    fn state_f32(e: &Engine<CpuBackend>) -> Vec<Vec<f32>> {
        e.state
            .layers
            .iter()
            .flat_map(|l| [&l.conv, &l.ssm])
            .map(|t| e.backend.tensor_to_f32(t).expect("read state"))
            .collect()
    }

    fn host_rows(e: &Engine<CpuBackend>, layer: usize) -> Vec<u8> {
        let h = e.kv.host();
        let g = *h.geometry();
        let n = h.len(layer).expect("len");
        let mut out = Vec::new();
        let (mut k, mut v) = (vec![0u8; g.k_row_bytes()], vec![0u8; g.v_row_bytes()]);
        for t in 0..n {
            h.read_row(layer, t, &mut k, &mut v).expect("row");
            out.extend_from_slice(&k);
            out.extend_from_slice(&v);
        }
        out
    }

    fn prompt(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as usize % vocab) as u32
            })
            .collect()
    }

    /// Forced drafts = the target's own greedy tokens, wrong at position j: the cycle accepts
    /// exactly j drafts, emits the target's token, and leaves recurrent state and KV history
    /// (host rows of every target layer) bit-identical to a non-speculative run at the same
    /// position; the MTP layer keeps only its real rows; the next (unforced) cycles continue
    /// the plain greedy sequence.
    #[test]
    fn rejection_at_every_draft_position_restores_state_and_kv_exactly() {
        for name in [
            "tiny-gqa-f32",
            "tiny-mha-tied-bf16",
            "tiny-bare-text",
            "models/kvstream-demo-tiny",
        ] {
            let mut plain = Engine::load(CpuBackend::new(), tiny(name, None)).expect("plain");
            let vocab = plain.config.vocab_size();
            let p = prompt(vocab, 13, name.len() as u64);
            // Greedy reference g[0..8].
            let mut g = Vec::new();
            let mut logits = plain.start_session(&p).expect("prefill");
            for _ in 0..8 {
                let t = argmax(&logits).expect("argmax") as u32;
                g.push(t);
                logits = plain.decode_step(t).expect("step");
            }
            for n_max in 1..=4 {
                let mut e = Engine::load(CpuBackend::new(), tiny(name, Some(n_max))).expect("spec");
                for j in 0..=n_max {
                    let mut sampler = Sampler::new(SamplingParams::default()).expect("sampler");
                    let mut rng = StdRng::seed_from_u64(1);
                    e.start_session(&p).expect("prefill");
                    assert_eq!(e.kv.mtp_tokens(), p.len() - 1);
                    e.kv.set_phase(&e.backend, Phase::Verify { width: n_max + 1 })
                        .expect("phase");
                    let mut cu = e.first_catch_up(g[0]).expect("catch-up");
                    let mut drafts = g[1..=n_max].to_vec();
                    if j < n_max {
                        drafts[j] = (drafts[j] + 1) % vocab as u32;
                    }
                    let mut history = p.clone();
                    history.push(g[0]);
                    let (_, a, next) = e
                        .spec_cycle(
                            &mut cu,
                            n_max,
                            &history,
                            &mut sampler,
                            &mut rng,
                            Some(&drafts),
                        )
                        .expect("cycle");
                    assert_eq!(a, j, "{name} N={n_max}: accepted");
                    assert_eq!(next, g[j + 1], "{name} N={n_max} j={j}: corrected token");
                    // The plain run at the same position: prompt + g[0..=a].
                    let mut r = Engine::load(CpuBackend::new(), tiny(name, None)).expect("ref");
                    r.start_session(&p).expect("prefill");
                    for &t in &g[..=a] {
                        r.decode_step(t).expect("step");
                    }
                    assert_eq!(e.kv.committed_tokens(), r.kv.committed_tokens());
                    assert!(
                        state_f32(&e) == state_f32(&r),
                        "{name} N={n_max} j={j}: recurrent state differs after rollback"
                    );
                    for l in 0..r.kv.target_layers() {
                        assert!(
                            host_rows(&e, l) == host_rows(&r, l),
                            "{name} N={n_max} j={j}: KV history of layer {l} differs"
                        );
                    }
                    assert_eq!(e.kv.mtp_tokens(), p.len(), "MTP keeps its real rows only");
                    // Continue unforced: the sequence goes on exactly as plain greedy.
                    history.extend_from_slice(&g[1..=a]);
                    history.push(next);
                    let mut emitted = a + 2;
                    while emitted < g.len() {
                        let k = n_max.min(g.len() - emitted);
                        let (d, a2, nx) = e
                            .spec_cycle(&mut cu, k, &history, &mut sampler, &mut rng, None)
                            .expect("cycle");
                        for &t in d[..a2].iter().chain(std::iter::once(&nx)) {
                            if emitted < g.len() {
                                assert_eq!(t, g[emitted], "{name} N={n_max} j={j} at {emitted}");
                            }
                            history.push(t);
                            emitted += 1;
                        }
                    }
                }
                let s = e.spec_report().expect("report");
                assert!(s.accepted > 0 && s.drafted > s.accepted, "{s:?}");
            }
        }
    }
}
