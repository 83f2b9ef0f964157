//! Streaming with a tiny arena (most pages through a 3-slot ring, multi-wave, wrapping) equals
//! the all-resident run bit for bit on the CPU backend: logits and greedy generation, for every
//! fixture and every KV type. And greedy generation equals HF's `generate`.

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_runtime::{ChatMessage, Engine, Flow, GenerateRequest, Prompt, StopReason};

#[test]
fn streamed_logits_equal_resident_for_every_fixture_and_kv_type() {
    for name in FIXTURES {
        let ids = oracle_ids(name, "ids");
        let tokens = &ids[..72];
        let layers = attention_layers(name);
        for kt in KvType::ALL {
            let vt = if kt == KvType::Q4_0 { KvType::Q8_0 } else { kt };
            for (k, v) in [(kt, kt), (kt, vt)] {
                let reference = Reference::new(name, k, v, 16).logits(tokens, 24);
                let mut e = Engine::load(CpuBackend::new(), tiny_arena(name, k, v, 16, 24))
                    .expect("engine loads");
                let got = e.logits(tokens).expect("streamed logits");
                assert!(
                    bitwise_eq(&got, &reference),
                    "{name} {k}/{v}: streamed logits differ from resident"
                );
                let s = e.stats();
                assert!(
                    s.kv.ring_pages > 0,
                    "{name} {k}/{v}: no ring traffic: {s:?}"
                );
                assert!(
                    s.kv.waves as usize > layers * 3,
                    "{name}: expected multi-wave layers, got {} waves",
                    s.kv.waves
                );
                assert!(s.kv.h2d_ring_bytes > 0);
                assert_eq!(
                    s.kv.layout_changes, 1,
                    "{name}: prefill planned for the whole prompt lays the pool out once"
                );
            }
        }
    }
}

#[test]
fn streamed_greedy_equals_resident_for_every_fixture_and_kv_type() {
    for name in FIXTURES {
        let prompt = oracle_ids(name, "gen_prompt");
        for k in KvType::ALL {
            let v = k;
            let n = 20;
            let reference = Reference::new(name, k, v, 4).greedy(&prompt, 8, n);
            let mut e = Engine::load(CpuBackend::new(), tiny_arena(name, k, v, 4, 8))
                .expect("engine loads");
            let mut req = GenerateRequest::new(Prompt::Tokens(prompt.clone()), n);
            req.stop_at_eos = false;
            let out = e.generate(&req, |_| Flow::Continue).expect("generate");
            assert_eq!(out.tokens, reference, "{name} {k}/{v}");
            assert_eq!(out.stop, StopReason::Length);
            assert!(out.stats.kv.ring_pages > 0);
            assert!(
                out.stats.h2d_bytes_per_token > 0.0,
                "decode streams through the ring: {:?}",
                out.stats
            );
        }
    }
}

#[test]
fn greedy_generate_matches_hf_generate() {
    for name in FIXTURES {
        let prompt = oracle_ids(name, "gen_prompt");
        let expected = oracle_ids(name, "gen_out");
        let mut e = Engine::load(
            CpuBackend::new(),
            tiny_arena(name, KvType::F32, KvType::F32, 8, 16),
        )
        .expect("engine loads");
        let mut req = GenerateRequest::new(
            Prompt::Tokens(prompt.clone()),
            expected.len() - prompt.len(),
        );
        req.stop_at_eos = false;
        let mut seen = Vec::new();
        let out = e
            .generate(&req, |ev| {
                seen.push(ev.token);
                Flow::Continue
            })
            .expect("generate");
        assert_eq!(out.tokens, expected[prompt.len()..], "{name}");
        assert_eq!(seen, out.tokens);
        let json = out.stats.to_json();
        let v: serde_json::Value = serde_json::from_str(&json).expect("stats are JSON");
        assert!(v["kv"]["ring_pages"].as_u64().unwrap_or(0) > 0);
        assert!(v["decode_tok_per_s"].as_f64().unwrap_or(0.0) > 0.0);
    }
}

#[test]
fn chat_generate_matches_hf() {
    let name = "tiny-gqa-f32";
    let expected_prompt = oracle_ids(name, "chat_prompt");
    let expected = oracle_ids(name, "chat_gen");
    let mut e = Engine::load(
        CpuBackend::new(),
        tiny_arena(name, KvType::F32, KvType::F32, 8, 16),
    )
    .expect("engine loads");
    let msgs = vec![ChatMessage::new(
        "user",
        "Tell me a short story about a cat and a boat.",
    )];
    let mut req = GenerateRequest::new(Prompt::Chat(msgs), expected.len() - expected_prompt.len());
    req.stop_at_eos = false;
    let mut text = String::new();
    let out = e
        .generate(&req, |ev| {
            text.push_str(ev.text);
            Flow::Continue
        })
        .expect("generate");
    assert_eq!(out.prompt_tokens, expected_prompt);
    assert_eq!(out.tokens, expected[expected_prompt.len()..]);
    assert_eq!(text, out.text);
    // A callback can stop early.
    let out = e
        .generate(&req, |ev| {
            if ev.index == 2 {
                Flow::Stop
            } else {
                Flow::Continue
            }
        })
        .expect("generate");
    assert_eq!(out.stop, StopReason::Callback);
    assert_eq!(out.tokens.len(), 3);
}

#[test]
fn concentrated_streaming_keeps_the_other_layer_resident() {
    // tiny-mha-tied-bf16 has two attention layers; 72 tokens = 5 pages of 16 per layer. A pool of
    // 9 pages cannot hold 2 × 5 + 3 ring slots, but one streamed layer is enough.
    let name = "tiny-mha-tied-bf16";
    let ids = oracle_ids(name, "ids");
    let tokens = &ids[..72];
    let (k, v) = (KvType::Q8_0, KvType::Bf16);
    let mut cfg = tiny_arena(name, k, v, 16, 24);
    cfg.max_pool_pages = Some(9);
    let reference = Reference::new(name, k, v, 16).logits(tokens, 24);
    let mut e = Engine::load(CpuBackend::new(), cfg).expect("engine loads");
    let got = e.logits(tokens).expect("streamed logits");
    assert!(bitwise_eq(&got, &reference));
    let s = e.stats().kv;
    assert_eq!(s.resident_pages.iter().sum::<usize>() + s.ring_slots, 9);
    let streamed = s.resident_pages.iter().filter(|&&r| r < 5).count();
    assert_eq!(
        streamed, 1,
        "only one layer streams: {:?}",
        s.resident_pages
    );
    assert!(s.ring_pages > 0);
}

#[test]
fn next_streamed_layer_is_prefetched_while_the_current_one_computes() {
    // Two streamed layers of 4 ring pages each and an 8-slot ring: the second layer's wave is
    // issued together with the first one's (lookahead bounded by free slots), so the ring is full
    // at its peak; results stay exact.
    let name = "tiny-mha-tied-bf16";
    let ids = oracle_ids(name, "ids");
    let tokens = &ids[..72];
    let (k, v) = (KvType::F16, KvType::Q4_0);
    let mut cfg = tiny_arena(name, k, v, 16, 72);
    cfg.min_ring_slots = 8;
    cfg.max_pool_pages = Some(10);
    let reference = Reference::new(name, k, v, 16).logits(tokens, 72);
    let mut e = Engine::load(CpuBackend::new(), cfg).expect("engine loads");
    let got = e.logits(tokens).expect("streamed logits");
    assert!(bitwise_eq(&got, &reference));
    let s = e.stats().kv;
    assert_eq!(s.resident_pages, vec![1, 1]);
    assert_eq!(s.ring_slots, 8);
    assert_eq!(s.waves, 2, "one wave per layer");
    assert!(
        (s.ring_occupancy - 1.0).abs() < 1e-12,
        "both layers' pages were in flight at once: {s:?}"
    );
}
