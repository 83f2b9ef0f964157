//! Prompt cache (issue 8): a follow-up request that extends the previous conversation reuses
//! the host KV history and a recurrent-state checkpoint, reports the cached tokens, and produces
//! exactly the tokens a fresh request would — plain and with MTP speculative decoding, with a
//! tiny arena that streams most pages.

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_runtime::{Engine, EngineConfig, Flow, GenerateRequest, Prompt, SpecConfig};

fn request(prompt: &[u32], n: usize, reuse: bool) -> GenerateRequest {
    let mut r = GenerateRequest::new(Prompt::Tokens(prompt.to_vec()), n);
    r.stop_at_eos = false;
    r.reuse_prefix = reuse;
    r
}

fn fresh(cfg: &EngineConfig, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut e = Engine::load(CpuBackend::new(), cfg.clone()).expect("engine");
    e.generate(&request(prompt, n, false), |_| Flow::Continue)
        .expect("generate")
        .tokens
}

fn tokens(seed: u64, n: usize, vocab: u32) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % u64::from(vocab)) as u32
        })
        .collect()
}

#[test]
fn follow_up_requests_reuse_the_prefix_and_match_fresh_requests() {
    for name in ["tiny-gqa-f32", "tiny-bare-text"] {
        for spec in [None, Some(2)] {
            let mut cfg = tiny_arena(name, KvType::F16, KvType::F16, 4, 8);
            cfg.max_pool_pages = Some(attention_layers(name) + 1 + 3);
            cfg.spec = spec.map(|draft_n_max| SpecConfig { draft_n_max });
            let mut e = Engine::load(CpuBackend::new(), cfg.clone()).expect("engine");
            let vocab = e.model_config().vocab_size() as u32;
            let p1 = tokens(1, 21, vocab);
            let out1 = e
                .generate(&request(&p1, 10, true), |_| Flow::Continue)
                .expect("gen 1");
            assert_eq!(out1.cached_tokens, 0);
            assert_eq!(
                out1.tokens,
                fresh(&cfg, &p1, 10),
                "{name} {spec:?}: first request"
            );

            // Next turn: previous prompt + answer + a new user message.
            let mut p2 = p1.clone();
            p2.extend_from_slice(&out1.tokens);
            p2.extend(tokens(2, 7, vocab));
            let out2 = e
                .generate(&request(&p2, 10, true), |_| Flow::Continue)
                .expect("gen 2");
            let want_cached = if spec.is_none() {
                p1.len() + out1.tokens.len() - 1 // the whole session: the current point
            } else {
                p1.len() - 1 // the prompt checkpoint
            };
            assert_eq!(out2.cached_tokens, want_cached, "{name} {spec:?}");
            assert_eq!(out2.stats.prefill_tokens as usize, p2.len() - want_cached);
            assert_eq!(
                out2.tokens,
                fresh(&cfg, &p2, 10),
                "{name} {spec:?}: cached follow-up"
            );

            // An edited last token: the checkpoint one token short of p2 is reused.
            let mut p3 = p2.clone();
            let last = p3.len() - 1;
            p3[last] = (p3[last] + 1) % vocab;
            let out3 = e
                .generate(&request(&p3, 8, true), |_| Flow::Continue)
                .expect("gen 3");
            assert_eq!(out3.cached_tokens, p2.len() - 1, "{name} {spec:?}: edit");
            assert_eq!(out3.tokens, fresh(&cfg, &p3, 8), "{name} {spec:?}: edit");
            // Regenerate from p3 (same prompt).
            let out4 = e
                .generate(&request(&p3, 8, true), |_| Flow::Continue)
                .expect("gen 4");
            assert_eq!(out4.cached_tokens, p3.len() - 1);
            assert_eq!(out4.tokens, out3.tokens, "{name} {spec:?}: regenerate");
            // A prompt diverging inside the first prompt: nothing reusable.
            let mut p4 = p1.clone();
            p4[5] = (p4[5] + 1) % vocab;
            let out6 = e
                .generate(&request(&p4, 8, true), |_| Flow::Continue)
                .expect("gen 6");
            assert_eq!(out6.cached_tokens, 0);
            assert_eq!(
                out6.tokens,
                fresh(&cfg, &p4, 8),
                "{name} {spec:?}: diverged"
            );
            // Without reuse the session is dropped.
            let out5 = e
                .generate(&request(&p3, 8, false), |_| Flow::Continue)
                .expect("gen 5");
            assert_eq!(out5.cached_tokens, 0);
            assert_eq!(out5.tokens, out3.tokens);
        }
    }
}
