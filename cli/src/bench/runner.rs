//! The sweep on one backend: for one arena size, every context and draft count.

use super::row::BenchRow;
use super::BenchPlan;
use anyhow::{Context, Result};
use indicatif::ProgressBar;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_runtime::{Engine, EngineConfig, KvStats};
use rand::{Rng, SeedableRng};
use std::time::Instant;

/// How the history before the measured steps is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fill {
    /// Random K/V rows written straight into the host history (no prefill cost).
    Synthetic,
    /// A real prefill of random tokens (also measures prefill tok/s).
    Prefill,
}

impl Fill {
    fn name(self) -> &'static str {
        match self {
            Fill::Synthetic => "synthetic",
            Fill::Prefill => "prefill",
        }
    }
}

fn h2d(s: &KvStats) -> u64 {
    s.h2d_ring_bytes + s.h2d_refill_bytes
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Loads the engine for `arena` (capacity for the largest context plus the measured steps).
fn load<B: ModelBackend>(backend: B, plan: &BenchPlan, arena: u64) -> Result<Engine<B>> {
    let mut cfg = EngineConfig::new(plan.model_dir.clone().unwrap_or_else(|| {
        format!("synthetic:{}", plan.synthetic.as_deref().unwrap_or("?")).into()
    }));
    cfg.ctx_size = plan.ctx_size;
    cfg.k_type = plan.k_type;
    cfg.v_type = plan.v_type;
    cfg.arena_bytes = arena;
    cfg.page_tokens = plan.page_tokens;
    cfg.prefill_chunk = plan.prefill_chunk;
    cfg.max_pool_pages = plan.max_pool_pages;
    cfg.min_ring_slots = plan.min_ring_slots;
    cfg.stream_ring_bytes = plan.stream_ring_bytes;
    cfg.weights = plan.weights;
    Ok(match &plan.synthetic_config {
        Some(qc) => Engine::load_synthetic(backend, cfg, qc.clone(), plan.weight_dtype, plan.seed)?,
        None => Engine::load(backend, cfg)?,
    })
}

/// Runs every (context, draft count) point for one arena size; one row per point. A point that
/// fails is recorded as `skipped` with the error; a failed load skips the whole arena.
pub fn run_arena<B: ModelBackend>(
    backend: B,
    plan: &BenchPlan,
    arena: u64,
    bar: &ProgressBar,
) -> Result<Vec<BenchRow>> {
    let backend_name = backend.name().to_string();
    let base = BenchRow {
        backend: backend_name,
        model: plan.model_label(),
        kv_types: format!("{}/{}", plan.k_type, plan.v_type),
        weights: crate::args::describe_policy(&plan.weights),
        arena_bytes: arena,
        max_pool_pages: plan.max_pool_pages,
        fill: plan.fill.name().into(),
        step_ms_by_width: vec![None; 4],
        ..Default::default()
    };
    let skipped = |ctx: usize, n: usize, why: String| BenchRow {
        context: ctx,
        spec_draft_n_max: n,
        status: "skipped".into(),
        note: why,
        ..base.clone()
    };
    let mut engine = match load(backend, plan, arena) {
        Ok(e) => e,
        Err(e) => {
            let mut rows = Vec::new();
            for &ctx in &plan.contexts {
                for &n in &plan.draft_ns {
                    rows.push(skipped(ctx, n, format!("load failed: {e:#}")));
                    bar.inc(1);
                }
            }
            return Ok(rows);
        }
    };
    let mut rows = Vec::new();
    for &ctx in &plan.contexts {
        bar.set_message(format!("arena {} MiB, context {ctx}", arena >> 20));
        let point = measure_context(&mut engine, plan, &base, ctx);
        match point {
            Ok(mut r) => {
                for x in r.iter_mut() {
                    x.apply_roofline(plan.ceilings);
                }
                bar.inc(r.len() as u64);
                rows.extend(r);
            }
            Err(e) => {
                for &n in &plan.draft_ns {
                    rows.push(skipped(ctx, n, format!("{e:#}")));
                    bar.inc(1);
                }
            }
        }
    }
    Ok(rows)
}

/// All rows of one context: the history is made once, widths 1..=4 are timed (rolled back),
/// then `decode_tokens` real decode steps are timed.
fn measure_context<B: ModelBackend>(
    engine: &mut Engine<B>,
    plan: &BenchPlan,
    base: &BenchRow,
    ctx: usize,
) -> Result<Vec<BenchRow>> {
    let _span = tracing::info_span!("bench_context", ctx).entered();
    let vocab = engine.model_config().vocab_size() as u32;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(plan.seed ^ ctx as u64);
    let extra = plan.decode_tokens + 8;
    let history = ctx.min(plan.ctx_size.saturating_sub(extra)).max(1);
    let mut prefill_tps = None;
    // The driver's view of device memory, sampled after every phase of the measurement.
    let mut measured_peak: Option<u64> = None;
    let mut sample = |e: &Engine<B>| {
        if let Some(used) = e.backend().device_memory_in_use() {
            measured_peak = Some(measured_peak.map_or(used, |p| p.max(used)));
        }
    };
    match plan.fill {
        Fill::Synthetic => {
            engine.fill_synthetic_history(history, history + extra, plan.seed)?;
        }
        Fill::Prefill => {
            let prompt: Vec<u32> = (0..history).map(|_| rng.random_range(0..vocab)).collect();
            let t = Instant::now();
            engine.start_session(&prompt).context("prefill")?;
            prefill_tps = Some(history as f64 / t.elapsed().as_secs_f64());
        }
    }
    sample(engine);

    // Step time and H2D bytes for widths 1..=4 (warm-up first: it refills resident pages).
    let mut width_ms = vec![None; 4];
    let mut width_h2d = [0.0; 4];
    for w in 1..=4usize {
        let toks: Vec<u32> = (0..w).map(|_| rng.random_range(0..vocab)).collect();
        engine
            .timed_step(&toks)
            .with_context(|| format!("warm-up step of width {w}"))?;
        let mut ms = Vec::new();
        let mut bytes = 0u64;
        for _ in 0..plan.reps.max(1) {
            let s = engine.timed_step(&toks)?;
            ms.push(s.seconds * 1e3);
            bytes += s.h2d_bytes;
        }
        sample(engine);
        width_h2d[w - 1] = bytes as f64 / plan.reps.max(1) as f64;
        width_ms[w - 1] = median(&mut ms);
    }

    // Real decode steps (the first one, which re-lays out for width 1, is a warm-up).
    let mut tok = rng.random_range(0..vocab);
    engine.decode_step(tok).context("decode warm-up")?;
    let h0 = h2d(&engine.kv().stats());
    let t = Instant::now();
    let mut issue_s = 0.0;
    for _ in 0..plan.decode_tokens {
        tok = rng.random_range(0..vocab);
        engine.decode_step(tok).context("decode step")?;
        issue_s += engine.last_forward_host_seconds();
    }
    engine.backend().synchronize()?;
    let decode_s = t.elapsed().as_secs_f64();
    sample(engine);
    let kv = engine.kv().stats();
    let decode_bytes = h2d(&kv).saturating_sub(h0) as f64 / plan.decode_tokens.max(1) as f64;
    let step_s = decode_s / plan.decode_tokens.max(1) as f64;

    let weight_bytes = engine.weight_bytes() as u64;
    let common = BenchRow {
        context: ctx,
        history_tokens: history,
        prefill_tok_per_s: prefill_tps,
        step_ms_by_width: width_ms.clone(),
        resident_pages: kv.resident_pages.clone(),
        ring_slots: kv.ring_slots,
        pool_pages: kv.pool_pages,
        weight_bytes,
        peak_arena_bytes: kv.peak_arena.total as u64,
        peak_device_bytes: weight_bytes + engine.engine_config().arena_bytes,
        peak_device_measured_bytes: measured_peak,
        ..base.clone()
    };
    let mut rows = Vec::new();
    for &n in &plan.draft_ns {
        let mut r = common.clone();
        r.spec_draft_n_max = n;
        if n == 0 {
            r.status = "ok".into();
            r.decode_tok_per_s = Some(plan.decode_tokens as f64 / decode_s);
            r.step_ms = Some(step_s * 1e3);
            r.step_issue_ms = Some(issue_s / plan.decode_tokens.max(1) as f64 * 1e3);
            r.h2d_bytes_per_step = decode_bytes;
        } else {
            r.status = "projection".into();
            r.note = "MTP: measured verify step of width n+1; tok/s are PROJECTIONS at assumed \
                      acceptance (random weights make acceptance meaningless; draft-head cost \
                      excluded)"
                .into();
            r.step_ms = width_ms[n];
            r.h2d_bytes_per_step = width_h2d[n];
            r.project(&plan.acceptance);
        }
        r.h2d_gbps = match r.step_ms {
            Some(ms) if ms > 0.0 => r.h2d_bytes_per_step / (ms / 1e3) / 1e9,
            _ => 0.0,
        };
        rows.push(r);
    }
    Ok(rows)
}
