//! [`StreamingKv`]: the streaming implementation of the model's [`AttentionKv`] seam.
//!
//! Per step (one forward of `width` tokens) and attention layer `l`:
//!
//! 1. The new K/V rows are written (`KvOps::kv_write`) at their device location: the layer's
//!    resident page, or the ring slot that holds the tail page in the current wave.
//! 2. A producer fence is recorded and the rows are published device → host
//!    (`CopyEngine::copy_d2h`) into the pinned [`HostKvStore`]; at the end of the step the
//!    publications are waited and committed (`commit_published`). The host history only ever
//!    grows by fully published rows, so it is the truth; nothing is dropped.
//! 3. The layer's `SpanPlan` walks its resident prefix and then ring spans in token order. When
//!    its streamed pages exceed the ring, it is attended in several *waves*, each one plan that
//!    continues the same accumulator (`attention_accumulate`); normalisation happens once
//!    (`attention_finish`). So streamed == resident bit for bit on one backend.
//! 4. Ring fills are planned for the whole step at [`StreamingKv::begin_step`] and issued in
//!    layer order by the [`RingScheduler`] as slots free up: while layer `l` computes, the copy
//!    engine fills free slots for the next streamed layers (one `copy_h2d` per contiguous run of
//!    pages; only rows already published, i.e. stable, are ever copied). Attention waits on the
//!    wave's ready fences; after its last read it records a consumed fence that the slot's next
//!    fill waits on. A late copy stalls only its consumer.
//!
//! Failure: any error inside a step drains the queues, drops the step's uncommitted rows, marks
//! every device page stale (they are refilled from the host on the next step) and returns the
//! error. The host history is untouched and the manager stays usable.

use crate::error::{Result, RuntimeError};
use crate::phase::{Phase, PhaseArena};
use crate::placement::{PoolLayout, RingRun};
use crate::policy::{self, Feedback, PolicyConfig, PolicyInput, PolicyPhase, PolicyState};
use crate::prefetch::RingScheduler;
use crate::stats::KvStats;
use kvstream_memory_contracts::attention::{
    attention_accumulate, attention_begin, attention_finish, AttentionShape,
};
use kvstream_memory_contracts::backend::{DeviceBuffer, DeviceTensor, Fence};
use kvstream_memory_contracts::host::{HostKvStore, HostRange};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_model_qwen::attention_kv::{AttentionKv, AttentionPhase};
use std::sync::Arc;
use std::time::Instant;

#[path = "synthetic_kv.rs"]
mod synthetic_kv;

/// Static configuration of the KV manager.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamingKvConfig {
    /// Page geometry (page tokens, KV heads, head dim, K/V types).
    pub geometry: PageGeometry,
    /// Attention layers.
    pub layers: usize,
    /// Host history capacity in tokens (the context size).
    pub ctx_tokens: usize,
    /// Policy parameters; `layers`, `pool_pages` and `max_pages_per_layer` are filled in.
    pub policy: PolicyConfig,
    /// The last of `layers` is the MTP head's attention layer (logical layer L+1 of the same
    /// pool, counted by the same policy). [`AttentionPhase::Mtp`] steps touch only that layer;
    /// every other step touches only the target layers. Each side keeps its own host history
    /// length; the MTP layer is truncated with [`StreamingKv::truncate_layer`].
    pub mtp: bool,
    /// Bytes of ring the policy aims for while streaming (the policy's `stream_ring_slots`, in
    /// pages of this geometry, capped at an eighth of the pool). 0 = no floor.
    pub stream_ring_bytes: u64,
}

#[derive(Debug)]
struct StepState {
    phase: AttentionPhase,
    /// The layers this step touches (target layers, or the MTP layer alone).
    layers: std::ops::Range<usize>,
    width: usize,
    start: usize,
    done: Vec<bool>,
    started: Instant,
}

/// The streaming KV manager: host history + device pool (resident pages and a shared ring).
#[derive(Debug)]
pub struct StreamingKv<B: ModelBackend> {
    cfg: StreamingKvConfig,
    host: HostKvStore<B>,
    arena: PhaseArena<B>,
    layout: Option<PoolLayout>,
    policy_state: PolicyState,
    lens: Vec<usize>,
    valid: Vec<usize>,
    refill: Vec<Vec<B::Fence>>,
    publish: Vec<B::Fence>,
    ring: RingScheduler<B::Fence>,
    step: Option<StepState>,
    feedback: Feedback,
    wait_seconds: f64,
    planned_tokens: usize,
    stats: KvStats,
}

fn policy_phase(p: AttentionPhase) -> PolicyPhase {
    match p {
        AttentionPhase::Prefill => PolicyPhase::Prefill,
        AttentionPhase::Decode => PolicyPhase::Decode,
        AttentionPhase::Verify | AttentionPhase::Mtp => PolicyPhase::Verify,
    }
}

impl<B: ModelBackend> StreamingKv<B> {
    /// Allocates the pinned host history for `cfg.ctx_tokens` tokens of every layer and takes
    /// ownership of the phase arena. No phase is committed yet: call [`StreamingKv::set_phase`].
    pub fn new(backend: &B, cfg: StreamingKvConfig, arena: PhaseArena<B>) -> Result<Self> {
        let host = HostKvStore::new(backend, cfg.geometry, cfg.layers, cfg.ctx_tokens)?;
        let layers = cfg.layers;
        Ok(Self {
            cfg,
            host,
            arena,
            layout: None,
            policy_state: PolicyState::default(),
            lens: vec![0; layers],
            valid: vec![0; layers],
            refill: (0..layers).map(|_| Vec::new()).collect(),
            publish: Vec::new(),
            ring: RingScheduler::new(0),
            step: None,
            feedback: Feedback::default(),
            wait_seconds: 0.0,
            planned_tokens: 0,
            stats: KvStats::default(),
        })
    }

    /// The authoritative host history.
    pub fn host(&self) -> &HostKvStore<B> {
        &self.host
    }
    /// The page geometry.
    pub fn geometry(&self) -> &PageGeometry {
        &self.cfg.geometry
    }
    /// The pool layout in force (None while suspended or before the first phase).
    pub fn layout(&self) -> Option<&PoolLayout> {
        self.layout.as_ref()
    }
    /// The phase arena.
    pub fn arena(&self) -> &PhaseArena<B> {
        &self.arena
    }
    /// Committed tokens (every layer holds the same number between steps).
    pub fn committed_tokens(&self) -> usize {
        self.host.len(0).unwrap_or(0)
    }
    /// Target attention layers (excluding the MTP layer).
    pub fn target_layers(&self) -> usize {
        self.cfg.layers - usize::from(self.cfg.mtp)
    }
    /// Committed rows of the MTP layer (0 without one). MTP row i sits at position i.
    pub fn mtp_tokens(&self) -> usize {
        if self.cfg.mtp {
            self.host.len(self.cfg.layers - 1).unwrap_or(0)
        } else {
            0
        }
    }
    /// The layers a step of `phase` touches.
    fn step_layers(&self, phase: AttentionPhase) -> std::ops::Range<usize> {
        if self.cfg.mtp && phase == AttentionPhase::Mtp {
            self.cfg.layers - 1..self.cfg.layers
        } else {
            0..self.target_layers()
        }
    }
    /// Counters, with the current layout filled in.
    pub fn stats(&self) -> KvStats {
        let mut s = self.stats.clone();
        if let Some(l) = &self.layout {
            s.resident_pages = l.placement().resident.clone();
            s.ring_slots = l.ring_slots();
            s.pool_pages = l.placement().total_pages();
        }
        s.peak_arena = self.arena.peaks();
        s
    }
    /// Tells the policy how many tokens the session is expected to reach in the current phase
    /// (the prompt length for prefill, prompt + n_predict for decode). Layouts are then planned
    /// for that size once instead of growing chunk by chunk (each growth would re-lay out the
    /// pool and refill resident pages). `0` (the default) plans for what each step needs.
    pub fn set_planned_tokens(&mut self, tokens: usize) {
        self.planned_tokens = tokens.min(self.cfg.ctx_tokens);
    }

    /// Clears the counters (not the layout or the history).
    pub fn reset_stats(&mut self) {
        self.stats = KvStats::default();
    }

    fn policy_cfg(&self, pool_pages: usize) -> PolicyConfig {
        let mut p = self.cfg.policy.clone();
        p.layers = self.cfg.layers;
        p.pool_pages = pool_pages;
        p.max_pages_per_layer = self.cfg.geometry.pages_for(self.cfg.ctx_tokens);
        let page = self.cfg.geometry.page_bytes().max(1) as u64;
        let want = usize::try_from(self.cfg.stream_ring_bytes / page).unwrap_or(usize::MAX);
        p.stream_ring_slots = p.stream_ring_slots.max(want.min(pool_pages / 8));
        p
    }

    /// Waits for every tracked fence (errors ignored: a failed copy only poisons what it wrote,
    /// and that is marked stale) and forgets them.
    fn drain(&mut self, backend: &B) {
        let _ = backend.synchronize();
        for f in self.ring.outstanding() {
            let _ = backend.host_wait(&f);
        }
        for f in self.publish.drain(..) {
            let _ = backend.host_wait(&f);
        }
        for fs in &mut self.refill {
            for f in fs.drain(..) {
                let _ = backend.host_wait(&f);
            }
        }
        let slots = self.layout.as_ref().map_or(0, |l| l.ring_slots());
        self.ring.reset(slots);
    }

    /// Rolls back a failed step: drains, drops uncommitted rows, marks the device stale.
    fn fail_step(&mut self, backend: &B) {
        let _span = tracing::warn_span!("kv_step_rollback").entered();
        self.drain(backend);
        self.step = None;
        for l in 0..self.cfg.layers {
            self.lens[l] = self.host.len(l).unwrap_or(0);
            self.valid[l] = 0;
        }
        self.stats.failed_steps += 1;
    }

    /// Phase transition: drain → invalidate → release leases → commit → rebind. The resident
    /// pages are refilled from the host history at the next step. On failure the old layout stays
    /// in force.
    pub fn set_phase(&mut self, backend: &B, phase: Phase) -> Result<()> {
        if self.step.is_some() {
            return Err(RuntimeError::Protocol(
                "phase change inside a step; finish_step first".into(),
            ));
        }
        if self.arena.phase() == Some(phase) && self.layout.is_some() {
            return Ok(());
        }
        self.drain(backend);
        let layout = self.arena.transition(phase)?;
        self.stats.phase_transitions += 1;
        self.valid.iter_mut().for_each(|v| *v = 0);
        if layout.pool_pages == 0 {
            self.layout = None;
            self.ring.reset(0);
            return Ok(());
        }
        let width = match phase {
            Phase::Decode { width } | Phase::Verify { width } => width,
            _ => 1,
        };
        let pcfg = self.policy_cfg(layout.pool_pages);
        let input = PolicyInput {
            active_pages: self
                .cfg
                .geometry
                .pages_for((self.committed_tokens() + width).max(self.planned_tokens)),
            query_width: width,
            phase: match phase {
                Phase::Prefill => PolicyPhase::Prefill,
                Phase::Verify { .. } => PolicyPhase::Verify,
                _ => PolicyPhase::Decode,
            },
            feedback: Feedback::default(),
        };
        let d = policy::decide(&pcfg, &PolicyState::default(), &input)
            .map_err(|e| RuntimeError::Placement(e.to_string()))?;
        let (off, len) = self.arena.pool_range()?;
        let pool_len = self.arena.parent().len();
        let new = PoolLayout::new(self.cfg.geometry, d.placement, pool_len, off, len)?;
        self.ring.reset(new.ring_slots());
        self.layout = Some(new);
        self.policy_state = d.state;
        self.stats.layout_changes += 1;
        Ok(())
    }

    /// Drops the whole history (a new session). The layout stays.
    pub fn reset(&mut self, backend: &B) -> Result<()> {
        self.drain(backend);
        self.step = None;
        for l in 0..self.cfg.layers {
            self.host.truncate(l, 0)?;
            self.lens[l] = 0;
            self.valid[l] = 0;
        }
        Ok(())
    }

    /// Suffix truncation of every layer to `to` tokens (speculative rollback hook): host
    /// history and device validity (resident rows beyond `to` are rewritten by the next step).
    pub fn truncate(&mut self, backend: &B, to: usize) -> Result<()> {
        for l in 0..self.cfg.layers {
            self.truncate_layer(backend, l, to)?;
        }
        Ok(())
    }

    /// Suffix truncation of one layer (e.g. the MTP layer's speculative draft rows); a layer
    /// shorter than `to` is left as is.
    pub fn truncate_layer(&mut self, backend: &B, layer: usize, to: usize) -> Result<()> {
        if self.step.is_some() {
            return Err(RuntimeError::Protocol("truncate inside a step".into()));
        }
        if layer >= self.cfg.layers {
            return Err(RuntimeError::Protocol(format!(
                "truncate of layer {layer}: the KV manager has {} layers",
                self.cfg.layers
            )));
        }
        self.drain(backend);
        let to = to.min(self.host.len(layer)?);
        self.host.truncate(layer, to)?;
        self.lens[layer] = self.lens[layer].min(to);
        self.valid[layer] = self.valid[layer].min(to);
        Ok(())
    }

    /// Applies a policy decision if the device accepts the layout; otherwise keeps the old one.
    fn apply_decision(&mut self, backend: &B, d: policy::Decision) {
        if !d.changed {
            self.policy_state = d.state;
            return;
        }
        let Ok((off, len)) = self.arena.pool_range() else {
            self.stats.layout_rejections += 1;
            return;
        };
        let buf_len = self.arena.parent().len();
        let Ok(new) = PoolLayout::new(self.cfg.geometry, d.placement, buf_len, off, len) else {
            self.stats.layout_rejections += 1;
            return;
        };
        let _span = tracing::debug_span!("relayout").entered();
        self.drain(backend);
        if let Some(old) = &self.layout {
            for l in 0..self.cfg.layers {
                let same_base = old.resident_offset(l, 0) == new.resident_offset(l, 0);
                let cap = new.resident(l) * self.cfg.geometry.tokens_per_page();
                self.valid[l] = if same_base { self.valid[l].min(cap) } else { 0 };
            }
        }
        self.ring.reset(new.ring_slots());
        self.layout = Some(new);
        self.policy_state = d.state;
        self.stats.layout_changes += 1;
    }

    /// Copies the stable rows (`< stable`) of pages `[first_page, first_page + n)` of `layer`
    /// from the host to `dst` in the pool: full pages as one request, a partial tail page as a
    /// K-prefix and a V-prefix request. Returns the ready fences and the bytes copied.
    fn copy_stable_pages(
        &self,
        backend: &B,
        layer: usize,
        first_page: usize,
        n: usize,
        dst: usize,
        stable: usize,
        wait: &[B::Fence],
    ) -> Result<(Vec<B::Fence>, u64)> {
        let g = self.cfg.geometry;
        let tpp = g.tokens_per_page();
        let pb = g.page_bytes();
        let pool = self.arena.parent();
        let full = (stable / tpp).saturating_sub(first_page).min(n);
        let mut fences = Vec::new();
        let mut bytes = 0u64;
        if full > 0 {
            let src = self.host.page_range(layer, first_page, full)?;
            let _span =
                tracing::trace_span!("copy_batch", layer, first_page, pages = full).entered();
            fences.push(backend.copy_h2d(&src, pool, dst, wait)?);
            bytes += src.len as u64;
        }
        let p = first_page + full;
        if full < n && p * tpp < stable {
            let rows = stable - p * tpp;
            let page = self.host.page_range(layer, p, 1)?;
            let k = HostRange {
                bytes: Arc::clone(&page.bytes),
                offset: page.offset,
                len: rows * g.k_row_bytes(),
            };
            let v = HostRange {
                bytes: Arc::clone(&page.bytes),
                offset: page.offset + g.v_plane_offset(),
                len: rows * g.v_row_bytes(),
            };
            let d = dst + full * pb;
            fences.push(backend.copy_h2d(&k, pool, d, wait)?);
            fences.push(backend.copy_h2d(&v, pool, d + g.v_plane_offset(), wait)?);
            bytes += (k.len + v.len) as u64;
        }
        Ok((fences, bytes))
    }

    /// Issues every queued wave that fits in the free ring slots.
    fn pump(&mut self, backend: &B) -> Result<()> {
        let Some(stable) = self.step.as_ref().map(|s| s.start) else {
            return Ok(());
        };
        let Some(layout) = self.layout.clone() else {
            return Ok(());
        };
        while let Some((job, runs, waits)) = self.ring.next_issuable() {
            let mut ready = Vec::new();
            for run in &runs {
                let (f, bytes) = self.copy_stable_pages(
                    backend,
                    job.layer,
                    run.first_page,
                    run.pages,
                    layout.slot_offset(run.first_slot),
                    stable,
                    &waits,
                )?;
                self.stats.h2d_requests += f.len() as u64;
                self.stats.h2d_ring_bytes += bytes;
                ready.extend(f);
            }
            // A run whose pages hold no stable rows issues no copy, so nothing on the copy queue
            // orders it after its slots' previous owners (their last reads and the publication of
            // rows written there). The consumer writes this step's rows into those slots, so it
            // must wait for them itself: the previous owners' fences join the ready fences.
            // (Where a copy exists it already waited on them; waiting again is free.)
            ready.extend(waits.iter().cloned());
            self.ring.mark_issued(runs, ready);
        }
        Ok(())
    }

    /// Opens a step of `width` tokens: consults the policy (applying a new layout only if the
    /// device accepts it), refills stale resident pages from the host and starts prefetching the
    /// ring waves of the streamed layers. Called implicitly by the first `append_and_attend` of a
    /// step; calling it explicitly before the forward starts the copies earlier.
    pub fn begin_step(&mut self, backend: &B, phase: AttentionPhase, width: usize) -> Result<()> {
        if self.step.is_some() {
            return Err(RuntimeError::Protocol(
                "begin_step while a step is open".into(),
            ));
        }
        if width == 0 {
            return Err(RuntimeError::Protocol("step of zero tokens".into()));
        }
        let layers = self.step_layers(phase);
        let start = self.host.len(layers.start)?;
        if start + width > self.cfg.ctx_tokens {
            return Err(RuntimeError::PromptTooLong {
                prompt: start + width,
                ctx: self.cfg.ctx_tokens,
            });
        }
        let Some(pool_pages) = self.layout.as_ref().map(|l| l.placement().total_pages()) else {
            return Err(RuntimeError::Protocol(
                "no device layout: set_phase before the first step".into(),
            ));
        };
        let g = self.cfg.geometry;
        let tpp = g.tokens_per_page();
        let pcfg = self.policy_cfg(pool_pages);
        let input = PolicyInput {
            active_pages: g.pages_for((start + width).max(self.planned_tokens)),
            query_width: width,
            phase: policy_phase(phase),
            feedback: std::mem::take(&mut self.feedback),
        };
        let d = policy::decide(&pcfg, &self.policy_state, &input)
            .map_err(|e| RuntimeError::Placement(e.to_string()))?;
        self.apply_decision(backend, d);
        let layout = self
            .layout
            .clone()
            .ok_or_else(|| RuntimeError::Protocol("layout vanished".into()))?;

        // Refill stale resident pages from the host (stable rows only).
        let mut wait = Vec::new();
        for l in layers.clone() {
            let need = start.min(layout.resident(l) * tpp);
            if self.valid[l] >= need {
                self.valid[l] = self.valid[l].min(need);
                continue;
            }
            if wait.is_empty() {
                wait.push(backend.record_compute_fence()?);
            }
            let first_page = self.valid[l] / tpp;
            let pages = g.pages_for(need) - first_page;
            let res = self.copy_stable_pages(
                backend,
                l,
                first_page,
                pages,
                layout.resident_offset(l, first_page),
                start,
                &wait,
            );
            let (f, bytes) = match res {
                Ok(x) => x,
                Err(e) => {
                    self.fail_step(backend);
                    return Err(e);
                }
            };
            self.stats.h2d_requests += f.len() as u64;
            self.stats.h2d_refill_bytes += bytes;
            self.refill[l].extend(f);
            self.valid[l] = need;
        }

        // Plan the ring waves of this step and start filling.
        for l in layers.clone() {
            let r = layout.resident(l);
            let end = g.pages_for(start + width);
            if end > r {
                self.ring.plan_layer(l, r, end);
            }
        }
        self.step = Some(StepState {
            phase,
            width,
            start,
            done: (0..self.cfg.layers).map(|l| !layers.contains(&l)).collect(),
            layers,
            started: Instant::now(),
        });
        if let Err(e) = self.pump(backend) {
            self.fail_step(backend);
            return Err(e);
        }
        Ok(())
    }

    /// Abandons an open step (e.g. the model failed between two layers): rolls it back like a
    /// failed step. A no-op without an open step.
    pub fn abort_step(&mut self, backend: &B) {
        if self.step.is_some() {
            self.fail_step(backend);
        }
    }

    /// Closes the step: waits for its publications, commits the rows to the host history and
    /// records feedback. On error the step is rolled back (nothing committed).
    pub fn finish_step(&mut self, backend: &B) -> Result<()> {
        let Some(st) = self.step.as_ref() else {
            return Err(RuntimeError::Protocol("finish_step without a step".into()));
        };
        if let Some(l) = st.done.iter().position(|d| !d) {
            let e = RuntimeError::Protocol(format!(
                "attention layer {l} was not attended in this step"
            ));
            self.fail_step(backend);
            return Err(e);
        }
        let (start, width, started) = (st.start, st.width, st.started);
        let layers = st.layers.clone();
        let _span = tracing::trace_span!("kv_commit", start, width).entered();
        let mut failure = None;
        for f in self.publish.drain(..) {
            if let Err(e) = backend.host_wait(&f) {
                failure.get_or_insert(e);
            }
        }
        if let Some(e) = failure {
            self.fail_step(backend);
            return Err(e.into());
        }
        for l in layers {
            self.host.commit_published(l, start, width)?;
            let cap = self.layout.as_ref().map_or(0, |x| x.resident(l))
                * self.cfg.geometry.tokens_per_page();
            self.valid[l] = (start + width).min(cap);
        }
        self.step = None;
        let elapsed = started.elapsed().as_secs_f64();
        let busy = if elapsed > 0.0 {
            (self.wait_seconds / elapsed).min(1.0)
        } else {
            0.0
        };
        let slots = self.ring.slots().max(1);
        let occ = self.ring.take_peak() as f64 / slots as f64;
        self.feedback.copy_busy = busy;
        self.feedback.ring_occupancy = occ;
        self.stats.copy_busy = busy;
        self.stats.ring_occupancy = self.stats.ring_occupancy.max(occ);
        self.stats.ready_wait_seconds += self.wait_seconds;
        self.wait_seconds = 0.0;
        self.stats.steps += 1;
        self.stats.tokens += width as u64;
        Ok(())
    }

    /// Writes rows `[first, first + n)` of the step (tensor rows `[first - start, ...)`) at the
    /// device page addresses given by `page_base(page)` and publishes them to the host. Returns
    /// the publication fences.
    fn write_and_publish(
        &mut self,
        backend: &B,
        layer: usize,
        k: &B::Tensor,
        v: &B::Tensor,
        start: usize,
        first: usize,
        n: usize,
        page_base: &dyn Fn(usize) -> usize,
    ) -> Result<Vec<B::Fence>> {
        let g = self.cfg.geometry;
        let tpp = g.tokens_per_page();
        let rows: Vec<(usize, usize)> = (first..first + n)
            .map(|t| {
                let base = page_base(t / tpp);
                let first_tok = t / tpp * tpp;
                (
                    g.k_row_offset(base, first_tok, t),
                    g.v_row_offset(base, first_tok, t),
                )
            })
            .collect();
        let (ks, vs);
        let (kr, vr) = if first == start && n * g.row_values() == k.numel() {
            (k, v)
        } else {
            ks = backend.rows(k, first - start, n)?;
            vs = backend.rows(v, first - start, n)?;
            (&ks, &vs)
        };
        let pool = self.arena.parent();
        backend.kv_write(kr, vr, &g, pool, &rows)?;
        let producer = backend.record_compute_fence()?;
        let host_bytes = Arc::clone(self.host.layer_bytes(layer)?);
        let mut fences = Vec::new();
        let mut t = first;
        while t < first + n {
            let page_end = (t / tpp + 1) * tpp;
            let m = page_end.min(first + n) - t;
            let (hk, hv) = self.host.row_offsets(t);
            let (dk, dv) = rows[t - first];
            for (dev, host, len) in [(dk, hk, m * g.k_row_bytes()), (dv, hv, m * g.v_row_bytes())] {
                let dst = HostRange {
                    bytes: Arc::clone(&host_bytes),
                    offset: host,
                    len,
                };
                fences.push(backend.copy_d2h(pool, dev, &dst, std::slice::from_ref(&producer))?);
                self.stats.d2h_bytes += len as u64;
            }
            t += m;
        }
        self.publish.extend(fences.iter().cloned());
        Ok(fences)
    }

    fn attend_layer(
        &mut self,
        backend: &B,
        layer: usize,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
    ) -> Result<B::Tensor> {
        let g = self.cfg.geometry;
        let tpp = g.tokens_per_page();
        let (start, width) = match &self.step {
            Some(s) => (s.start, s.width),
            None => return Err(RuntimeError::Protocol("no step open".into())),
        };
        if self.lens[layer] != start {
            return Err(RuntimeError::Protocol(format!(
                "layer {layer} holds {} tokens, step starts at {start}",
                self.lens[layer]
            )));
        }
        let layout = self
            .layout
            .clone()
            .ok_or_else(|| RuntimeError::Protocol("no device layout".into()))?;
        let total = start + width;
        let head_dim = g.head_dim();
        if q.numel() % (width * head_dim) != 0 {
            return Err(RuntimeError::Protocol(format!(
                "q has {} elements, not a multiple of width {width} × head_dim {head_dim}",
                q.numel()
            )));
        }
        let shape = AttentionShape {
            q_heads: q.numel() / (width * head_dim),
            kv_heads: g.kv_heads(),
            head_dim,
            width,
            total,
            scale: 1.0 / (head_dim as f32).sqrt(),
            k_type: g.k_type(),
            v_type: g.v_type(),
        };
        let mut acc = attention_begin(backend, shape)?;
        for f in std::mem::take(&mut self.refill[layer]) {
            backend.compute_wait(&f)?;
        }
        let res_cap = layout.resident(layer) * tpp;
        let res_end = total.min(res_cap);
        if start < res_end {
            let base = |p: usize| layout.resident_offset(layer, p);
            self.write_and_publish(backend, layer, k, v, start, start, res_end - start, &base)?;
        }
        if total <= res_cap {
            let plan = layout.plan(layer, 0, total, &[])?;
            attention_accumulate(backend, &mut acc, q, self.arena.parent(), &plan)?;
        } else {
            let mut from = 0usize;
            while from < total {
                self.pump(backend)?;
                let wave = self.ring.take(layer).ok_or_else(|| {
                    RuntimeError::Protocol(format!(
                        "ring wave of layer {layer} was not issued ({} queued, {} in flight)",
                        self.ring.queued(),
                        self.ring.in_flight()
                    ))
                })?;
                for f in &wave.ready {
                    self.stats.ready_waits += 1;
                    self.feedback.ready_waits += 1;
                    if !f.is_complete() {
                        self.stats.ready_misses += 1;
                        self.feedback.ready_misses += 1;
                    }
                    let t = Instant::now();
                    let r = backend.compute_wait(f);
                    self.wait_seconds += t.elapsed().as_secs_f64();
                    r?;
                }
                let job = wave.job;
                let wave_first = job.first_page * tpp;
                let wave_end = ((job.first_page + job.pages) * tpp).min(total);
                let new_lo = start.max(wave_first);
                let mut fences = Vec::new();
                if new_lo < wave_end {
                    let runs = wave.runs.clone();
                    let slot_base = |p: usize| {
                        let run = runs
                            .iter()
                            .find(|r| p >= r.first_page && p < r.first_page + r.pages)
                            .copied()
                            .unwrap_or(RingRun {
                                first_page: p,
                                pages: 1,
                                first_slot: 0,
                            });
                        layout.slot_offset(run.first_slot + (p - run.first_page))
                    };
                    fences = self.write_and_publish(
                        backend,
                        layer,
                        k,
                        v,
                        start,
                        new_lo,
                        wave_end - new_lo,
                        &slot_base,
                    )?;
                }
                let plan = layout.plan(layer, from, wave_end, &wave.runs)?;
                attention_accumulate(backend, &mut acc, q, self.arena.parent(), &plan)?;
                fences.push(backend.record_compute_fence()?);
                self.ring.release(&wave, &fences);
                self.stats.waves += 1;
                self.stats.ring_pages += job.pages as u64;
                from = wave_end;
            }
            self.pump(backend)?;
        }
        let out = attention_finish(backend, acc)?;
        self.lens[layer] = total;
        if let Some(s) = &mut self.step {
            s.done[layer] = true;
        }
        Ok(out)
    }
}

impl<B: ModelBackend> AttentionKv<B> for StreamingKv<B> {
    type Error = RuntimeError;

    fn append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        phase: AttentionPhase,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
    ) -> Result<B::Tensor> {
        let _span = tracing::trace_span!("attend", layer).entered();
        if layer >= self.cfg.layers {
            return Err(RuntimeError::Protocol(format!(
                "attention layer {layer} is not managed (the KV manager has {} layers; MTP is not configured)",
                self.cfg.layers
            )));
        }
        let rv = self.cfg.geometry.row_values();
        if k.numel() == 0 || k.numel() % rv != 0 || v.numel() != k.numel() {
            return Err(RuntimeError::Protocol(format!(
                "k/v have {}/{} elements, expected equal multiples of {rv}",
                k.numel(),
                v.numel()
            )));
        }
        let width = k.numel() / rv;
        let needs_finish = self.step.as_ref().is_some_and(|s| s.done[layer]);
        if needs_finish {
            self.finish_step(backend)?;
        }
        if self.step.is_none() {
            self.begin_step(backend, phase, width)?;
        }
        if let Some(s) = &self.step {
            if s.width != width || s.phase != phase {
                let e = RuntimeError::Protocol(format!(
                    "layer {layer} got {width} tokens ({phase:?}) inside a step of {} ({:?})",
                    s.width, s.phase
                ));
                self.fail_step(backend);
                return Err(e);
            }
        }
        match self.attend_layer(backend, layer, q, k, v) {
            Ok(out) => Ok(out),
            Err(e) => {
                self.fail_step(backend);
                Err(e)
            }
        }
    }

    fn len(&self, layer: usize) -> usize {
        self.lens.get(layer).copied().unwrap_or(0)
    }
}
