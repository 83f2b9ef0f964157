//! Injected copy failures (step fails, session stays usable, host history intact), phase
//! transitions, prefetch ordering under slow copies, and admission errors.

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_runtime::sampling::argmax;
use kvstream_runtime::{check_admission, Engine, Flow, GenerateRequest, Prompt, RuntimeError};
use std::time::Duration;

fn host_rows(e: &Engine<CpuBackend>) -> Vec<Vec<u8>> {
    let host = e.kv().host();
    let g = *host.geometry();
    let mut rows = Vec::new();
    for l in 0..host.layers() {
        for t in 0..host.len(l).expect("layer") {
            let mut k = vec![0u8; g.k_row_bytes()];
            let mut v = vec![0u8; g.v_row_bytes()];
            host.read_row(l, t, &mut k, &mut v).expect("row");
            k.extend(v);
            rows.push(k);
        }
    }
    rows
}

/// Greedy session driven step by step; returns (tokens, logits of every step).
fn run_steps(e: &mut Engine<CpuBackend>, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = vec![e.start_session(prompt).expect("prefill")];
    let mut toks = Vec::new();
    for _ in 0..n {
        let t = argmax(logits.last().expect("row")).expect("argmax") as u32;
        toks.push(t);
        logits.push(e.decode_step(t).expect("decode"));
    }
    (toks, logits)
}

fn check_failure_recovery(cfg_of: impl Fn() -> kvstream_runtime::EngineConfig) {
    let name = "tiny-gqa-f32";
    let prompt = oracle_ids(name, "gen_prompt");
    let mut clean = Engine::load(CpuBackend::new(), cfg_of()).expect("engine");
    let (toks, logits) = run_steps(&mut clean, &prompt, 10);
    let clean_rows = host_rows(&clean);

    let mut e = Engine::load(CpuBackend::new(), cfg_of()).expect("engine");
    let (t5, _) = run_steps(&mut e, &prompt, 5);
    assert_eq!(t5, toks[..5]);
    let before = e.session_len();
    e.backend().inject_copy_failures(1);
    let err = e
        .decode_step(toks[5])
        .expect_err("the injected copy failure fails the step");
    assert!(
        matches!(err, RuntimeError::Transfer(_) | RuntimeError::Attention(_)),
        "unexpected error {err:?}"
    );
    // Nothing of the failed step was committed; the committed rows equal the clean run's.
    assert_eq!(e.session_len(), before);
    let rows = host_rows(&e);
    let per_layer = before;
    let layers = e.kv().host().layers();
    for l in 0..layers {
        let clean_len = clean.kv().host().len(l).expect("len");
        for t in 0..per_layer {
            assert_eq!(
                rows[l * per_layer + t],
                clean_rows[l * clean_len + t],
                "layer {l} row {t}"
            );
        }
    }
    assert!(e.stats().kv.failed_steps >= 1);
    // The same step succeeds on retry and continues exactly like the clean run.
    for i in 5..10 {
        let l = e.decode_step(toks[i]).expect("retry works");
        assert!(
            bitwise_eq(&l, &logits[i + 1]),
            "step {i} differs after recovery"
        );
    }
    assert_eq!(host_rows(&e), clean_rows);
    // And a whole new generate works on the same engine.
    let mut req = GenerateRequest::new(Prompt::Tokens(prompt.clone()), 10);
    req.stop_at_eos = false;
    let out = e
        .generate(&req, |_| Flow::Continue)
        .expect("generate after failure");
    assert_eq!(out.tokens, toks);
}

#[test]
fn injected_copy_failure_in_ring_streaming_rolls_back_and_recovers() {
    check_failure_recovery(|| tiny_arena("tiny-gqa-f32", KvType::Q8_0, KvType::F16, 4, 8));
}

#[test]
fn injected_publication_failure_with_everything_resident_rolls_back_and_recovers() {
    check_failure_recovery(|| big_arena("tiny-gqa-f32", KvType::F16, KvType::Q4_0, 4, 8));
}

#[test]
fn slow_copies_cause_ready_misses_but_not_differences() {
    let name = "tiny-bare-text";
    let prompt = oracle_ids(name, "gen_prompt");
    let cfg = || tiny_arena(name, KvType::Bf16, KvType::Bf16, 4, 8);
    let mut fast = Engine::load(CpuBackend::new(), cfg()).expect("engine");
    let (toks, logits) = run_steps(&mut fast, &prompt, 6);
    let mut slow = Engine::load(CpuBackend::new(), cfg()).expect("engine");
    slow.backend().set_copy_delay(Duration::from_millis(2));
    let (t2, l2) = run_steps(&mut slow, &prompt, 6);
    assert_eq!(toks, t2);
    for (a, b) in logits.iter().zip(&l2) {
        assert!(bitwise_eq(a, b));
    }
    let s = slow.stats().kv;
    assert!(
        s.ready_misses > 0,
        "slow copies must be observed as ready misses: {s:?}"
    );
    assert!(s.ready_wait_seconds > 0.0);
}

#[test]
fn phase_transitions_regrow_the_pool_and_refill_from_host() {
    let name = "tiny-mha-tied-bf16";
    let mut cfg = big_arena(name, KvType::F16, KvType::F16, 4, 8);
    // An arena where prefill's workspace leaves a small pool and decode a larger one.
    let layouts = check_admission(&CpuBackend::new(), &cfg).expect("admits");
    let (pre, dec) = (layouts[0], layouts[1]);
    assert!(pre.workspace_bytes > dec.workspace_bytes);
    cfg.arena_bytes = pre.required_bytes as u64 + 6 * 4096;
    let mut e = Engine::load(CpuBackend::new(), cfg).expect("engine");
    let prompt = oracle_ids(name, "gen_prompt");
    let mut req = GenerateRequest::new(Prompt::Tokens(prompt), 12);
    req.stop_at_eos = false;
    let out = e.generate(&req, |_| Flow::Continue).expect("generate");
    let ls = e.phase_layouts();
    assert!(ls[1].pool_pages > ls[0].pool_pages, "{ls:?}");
    let kv = out.stats.kv;
    assert!(kv.phase_transitions >= 2);
    assert!(
        kv.h2d_refill_bytes > 0,
        "decode layout is refilled from host: {kv:?}"
    );
    assert!(kv.peak_arena.kv_pool >= ls[1].pool_bytes);
    assert!(kv.peak_arena.workspace >= ls[0].workspace_bytes);
}

#[test]
fn admission_and_request_errors_are_typed() {
    let name = "tiny-gqa-f32";
    let b = CpuBackend::new();
    let mut cfg = big_arena(name, KvType::Q8_0, KvType::Q4_0, 16, 64);
    let need = check_admission(&b, &cfg).expect("admits")[0].required_bytes as u64;
    cfg.arena_bytes = need - 1000;
    match Engine::load(CpuBackend::new(), cfg.clone()) {
        Err(RuntimeError::ArenaTooSmall {
            phase,
            required,
            missing,
            arena,
        }) => {
            assert_eq!(phase, "prefill");
            assert_eq!(required, need);
            assert_eq!(missing, 1000);
            assert_eq!(arena, need - 1000);
        }
        other => panic!("expected ArenaTooSmall, got {other:?}"),
    }
    // Admission fails before weights: a directory with only config.json gives the same error.
    let tmp = std::env::temp_dir().join(format!("kvstream-admission-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("tmp");
    std::fs::copy(dir(name).join("config.json"), tmp.join("config.json")).expect("copy");
    let mut only_cfg = cfg.clone();
    only_cfg.model_dir = tmp.clone();
    assert!(matches!(
        Engine::load(CpuBackend::new(), only_cfg.clone()),
        Err(RuntimeError::ArenaTooSmall { .. })
    ));
    only_cfg.arena_bytes = need;
    assert!(
        matches!(
            Engine::load(CpuBackend::new(), only_cfg),
            Err(RuntimeError::Model(_))
        ),
        "with enough arena the missing weights are the error"
    );
    let _ = std::fs::remove_dir_all(&tmp);

    let mut big_ctx = big_arena(name, KvType::F16, KvType::F16, 16, 64);
    big_ctx.ctx_size = 10_000_000;
    assert!(matches!(
        Engine::load(CpuBackend::new(), big_ctx),
        Err(RuntimeError::ContextTooLarge {
            requested: 10_000_000,
            ..
        })
    ));

    let mut small = big_arena(name, KvType::F16, KvType::F16, 4, 8);
    small.ctx_size = 16;
    let mut e = Engine::load(CpuBackend::new(), small).expect("engine");
    let long: Vec<u32> = (0..20).collect();
    let req = GenerateRequest::new(Prompt::Tokens(long), 4);
    assert!(matches!(
        e.generate(&req, |_| Flow::Continue),
        Err(RuntimeError::PromptTooLong {
            prompt: 20,
            ctx: 16
        })
    ));
    assert_eq!(e.session_len(), 0, "nothing half-written");
    let bad = GenerateRequest::new(Prompt::Tokens(vec![1, 100_000]), 4);
    assert!(matches!(
        e.generate(&bad, |_| Flow::Continue),
        Err(RuntimeError::InvalidRequest(_))
    ));
    // Generation that reaches the end of the context stops there.
    let mut req = GenerateRequest::new(Prompt::Tokens((0..12).collect()), 100);
    req.stop_at_eos = false;
    let out = e.generate(&req, |_| Flow::Continue).expect("generate");
    assert_eq!(out.stop, kvstream_runtime::StopReason::ContextFull);
    assert_eq!(e.session_len(), 16);
    // Text prompts need a tokenizer.
    let mut bare = Engine::load(
        CpuBackend::new(),
        big_arena("tiny-bare-text", KvType::F16, KvType::F16, 4, 8),
    )
    .expect("engine");
    assert!(matches!(
        bare.generate(&GenerateRequest::new(Prompt::Text("hi".into()), 2), |_| {
            Flow::Continue
        }),
        Err(RuntimeError::File { .. })
    ));
}
