//! Images through the engine on `fixtures/tiny-vl/` (tiny random Qwen3.5 VL model, HF oracle):
//! greedy tokens of the 2-image prompt equal HF's greedy continuation with a resident and a
//! streaming arena, with and without MTP (an MTP head is grafted onto the fixture in a temp dir:
//! the fixture has none, and greedy speculative output must equal plain greedy whatever the
//! head's weights); arena use after each image returns to the text-only level; an image too
//! large for the arena is a typed error after which the session continues.

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_runtime::{
    Engine, EngineConfig, GenerateRequest, ImageInput, Prompt, RuntimeError, SpecConfig,
    VisionOptions,
};
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

fn vl_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-vl")
}

fn oracle_i64(key: &str) -> Vec<u32> {
    let bytes = std::fs::read(vl_dir().join("oracle.safetensors")).expect("oracle");
    let st = SafeTensors::deserialize(&bytes).expect("oracle");
    let t = st.tensor(key).expect("oracle tensor");
    assert_eq!(t.dtype(), Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u32::try_from(i64::from_le_bytes(a)).expect("id")
        })
        .collect()
}

/// F32 KV, 4-token pages, 8-token prefill chunks (images straddle chunk borders).
fn config(dir: &Path, streaming: bool, spec: Option<usize>) -> EngineConfig {
    let mut c = EngineConfig::new(dir);
    c.ctx_size = 128;
    c.k_type = KvType::F32;
    c.v_type = KvType::F32;
    c.page_tokens = 4;
    c.prefill_chunk = 8;
    c.arena_bytes = 4 << 20;
    if streaming {
        // One resident page per attention layer (+ MTP) and a 3-slot ring.
        c.min_ring_slots = 3;
        c.max_pool_pages = Some(1 + usize::from(spec.is_some()) + 3);
    }
    c.spec = spec.map(|draft_n_max| SpecConfig { draft_n_max });
    c
}

fn images(e: &mut Engine<CpuBackend>, names: &[&str]) -> Vec<ImageInput> {
    names
        .iter()
        .map(|n| {
            let bytes = std::fs::read(vl_dir().join(n)).expect("image file");
            e.preprocess_image(&bytes).expect("preprocess")
        })
        .collect()
}

fn greedy(n: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(Prompt::Tokens(oracle_i64("ids")), n);
    r.stop_at_eos = false;
    r
}

/// tiny-vl + an MTP head (layer 3's weights as its attention/MLP, a pseudo-random `fc`).
fn vl_with_mtp() -> PathBuf {
    // One directory per call: tests run in parallel and each removes its own.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("kvstream-vl-mtp-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("mkdir");
    for f in ["preprocessor_config.json", "generation_config.json"] {
        std::fs::copy(vl_dir().join(f), out.join(f)).expect("copy");
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(vl_dir().join("config.json")).expect("config"))
            .expect("json");
    cfg["text_config"]["mtp_num_hidden_layers"] = 1.into();
    cfg["text_config"]["mtp_use_dedicated_embeddings"] = false.into();
    std::fs::write(out.join("config.json"), cfg.to_string()).expect("write config");

    let bytes = std::fs::read(vl_dir().join("model.safetensors")).expect("weights");
    let st = SafeTensors::deserialize(&bytes).expect("weights");
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        if let Some(rest) = name.strip_prefix("model.language_model.layers.3.") {
            tensors.push((
                format!("mtp.layers.0.{rest}"),
                t.dtype(),
                t.shape().to_vec(),
                t.data().to_vec(),
            ));
        }
        tensors.push((name, t.dtype(), t.shape().to_vec(), t.data().to_vec()));
    }
    let h = 64usize;
    let f32s = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut s = 0x9e37_79b9_7f4a_7c15u64;
    let fc: Vec<f32> = (0..h * 2 * h)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.3
        })
        .collect();
    tensors.push(("mtp.fc.weight".into(), Dtype::F32, vec![h, 2 * h], f32s(fc)));
    for n in [
        "mtp.norm.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
    ] {
        // Qwen3.5 RMSNorm weights are offsets from 1.
        tensors.push((n.into(), Dtype::F32, vec![h], f32s(vec![0.05; h])));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors"))
        .expect("write weights");
    out
}

#[test]
fn two_image_greedy_matches_hf_resident_streaming_and_mtp() {
    let ids = oracle_i64("ids");
    let gen = oracle_i64("gen");
    let want = &gen[ids.len()..];
    let mtp_dir = vl_with_mtp();
    let cases: [(&Path, bool, Option<usize>); 5] = [
        (&vl_dir(), false, None),
        (&vl_dir(), true, None),
        (&mtp_dir, false, Some(2)),
        (&mtp_dir, true, Some(2)),
        (&mtp_dir, true, Some(4)),
    ];
    for (dir, streaming, spec) in cases {
        let label = format!("streaming={streaming} spec={spec:?}");
        let mut e = Engine::load(CpuBackend::new(), config(dir, streaming, spec)).expect("load");
        let imgs = images(&mut e, &["img_a.png", "img_b.png"]);
        assert_eq!(
            imgs.iter().map(ImageInput::n_tokens).sum::<usize>(),
            ids.iter().filter(|&&t| t == 250).count()
        );
        let r = e
            .generate_multimodal(&greedy(want.len()), &imgs, |_| {
                kvstream_runtime::Flow::Continue
            })
            .expect("generate");
        assert_eq!(r.tokens, want, "{label}: greedy continuation vs HF");
        assert!(
            e.position_map().rope_delta() < 0,
            "{label}: images shift text positions"
        );
        let s = r.stats;
        if streaming {
            assert!(s.kv.ring_pages > 0, "{label}: the tiny arena streams");
        }
        if spec.is_some() {
            let sp = s.spec.expect("spec report");
            assert!(sp.drafted > 0, "{label}: MTP drafted after the images");
        }
        // Arena use after each image returns to the text-only level.
        let v = e.vision_stats();
        assert_eq!(v.loans.len(), 2, "{label}");
        for l in &v.loans {
            assert!(l.arena_used_text > 0, "{label}: {l:?}");
            assert_eq!(l.arena_used_after, l.arena_used_text, "{label}: {l:?}");
            assert_eq!(l.arena_used_during, l.loan_bytes, "{label}: {l:?}");
            assert!(l.weight_bytes > 0 && l.weights_loaded, "{label}: {l:?}");
        }
    }
    let _ = std::fs::remove_dir_all(&mtp_dir);
}

#[test]
fn image_too_large_is_typed_and_the_session_continues() {
    let mut cfg = config(&vl_dir(), false, None);
    cfg.arena_bytes = 512 << 10;
    let mut e = Engine::load(CpuBackend::new(), cfg.clone()).expect("load");
    let mut reference = Engine::load(CpuBackend::new(), cfg).expect("load");
    let text: Vec<u32> = (0..11).map(|i| (i * 37 + 5) % 240).collect();
    e.start_session(&text).expect("session");
    reference.start_session(&text).expect("session");
    e.decode_step(17).expect("step");
    reference.decode_step(17).expect("step");

    let imgs = images(&mut e, &["img_a.png", "img_b.png"]);
    match e.generate_multimodal(&greedy(4), &imgs, |_| kvstream_runtime::Flow::Continue) {
        Err(RuntimeError::ImageTooLarge {
            image,
            needed,
            available,
        }) => {
            assert_eq!(image, 0);
            assert_eq!(available, 512 << 10);
            assert!(needed > available, "{needed} {available}");
            assert!(
                needed as usize
                    >= kvstream_runtime::vision_weight_bytes(e.vision_config().expect("vision"))
            );
        }
        other => panic!("expected ImageTooLarge, got {other:?}"),
    }
    assert_eq!(e.vision_stats().refused, 1);
    // The session is intact: the next step equals the reference's.
    assert_eq!(
        e.decode_step(99).expect("step after refusal"),
        reference.decode_step(99).expect("step")
    );
    // And a new text request works.
    let r = e
        .generate(
            &GenerateRequest::new(Prompt::Tokens(text.clone()), 3),
            |_| kvstream_runtime::Flow::Continue,
        )
        .expect("text request");
    assert!(!r.tokens.is_empty());

    // Keeping the weights resident takes them out of the loan: the same images now fit, and
    // the second request does not reload them.
    e.set_vision_options(VisionOptions {
        keep_weights_resident: true,
        ..VisionOptions::default()
    });
    let want = &oracle_i64("gen")[oracle_i64("ids").len()..][..4];
    for round in 0..2 {
        let r = e
            .generate_multimodal(&greedy(4), &imgs, |_| kvstream_runtime::Flow::Continue)
            .expect("fits with resident weights");
        assert_eq!(r.tokens, want, "round {round}");
        let v = e.vision_stats();
        assert_eq!(v.weight_loads, 1, "loaded once, kept");
        assert!(v.resident_weight_bytes > 0);
        for l in &v.loans {
            assert_eq!(l.weight_bytes, 0);
            assert_eq!(l.arena_used_after, l.arena_used_text);
        }
    }
}

#[test]
fn text_only_model_has_no_vision_and_bad_images_are_typed() {
    let tiny_text = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-gqa-f32");
    let mut c = EngineConfig::new(&tiny_text);
    c.ctx_size = 64;
    c.arena_bytes = 4 << 20;
    c.page_tokens = 16;
    let mut t = Engine::load(CpuBackend::new(), c).expect("load");
    let png = std::fs::read(vl_dir().join("img_a.png")).expect("png");
    assert!(!t.has_vision());
    assert!(matches!(
        t.preprocess_image(&png),
        Err(RuntimeError::InvalidRequest(_))
    ));

    let mut e = Engine::load(CpuBackend::new(), config(&vl_dir(), false, None)).expect("load");
    assert!(matches!(
        e.preprocess_image(b"definitely not an image"),
        Err(RuntimeError::Image(_))
    ));
    assert!(matches!(
        e.preprocess_image(&png[..png.len() / 2]),
        Err(RuntimeError::Image(_))
    ));
    // Placeholder runs that do not match the images are refused before any work.
    let imgs = images(&mut e, &["img_a.png"]);
    assert!(matches!(
        e.generate_multimodal(&greedy(2), &imgs, |_| kvstream_runtime::Flow::Continue),
        Err(RuntimeError::InvalidRequest(_))
    ));
    assert_eq!(e.vision_stats().images, 0);
}

fn oracle_f32(key: &str) -> Vec<f32> {
    let bytes = std::fs::read(vl_dir().join("oracle.safetensors")).expect("oracle");
    let st = SafeTensors::deserialize(&bytes).expect("oracle");
    let t = st.tensor(key).expect("oracle tensor");
    assert_eq!(t.dtype(), Dtype::F32);
    t.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Decode logits after the images, from a direct model run whose decode positions start at
/// `first` (the M-RoPE `next_position` is right; `ids.len()` is the text-only mistake).
fn reference_decode_logits(tokens: &[u32], first: u32, steps: &[u32]) -> Vec<Vec<f32>> {
    use kvstream_memory_contracts::ops::TensorOps;
    use kvstream_model_qwen::vision::{preprocess, PreprocessorConfig};
    use kvstream_model_qwen::{
        mrope_positions, AttentionPhase, ImageEmbeds, LoadOptions, LogitRows, QwenModel,
        ResidentKv, ResidentKvOptions, VisionTower,
    };
    let b = CpuBackend::new();
    let model = QwenModel::load(&b, &vl_dir(), &LoadOptions::default()).expect("model");
    let tower = VisionTower::load(&vl_dir()).expect("tower");
    let pcfg = PreprocessorConfig::from_model_dir(&vl_dir()).expect("preprocessor");
    let (mut rows, mut grids) = (Vec::new(), Vec::new());
    for f in ["img_a.png", "img_b.png"] {
        let p = preprocess(&std::fs::read(vl_dir().join(f)).expect("png"), &pcfg).expect("pre");
        rows.extend(tower.encode_on(&CpuBackend::new(), &p).expect("encode"));
        grids.push(p.grid_thw);
    }
    let pos = mrope_positions(tokens, &grids, tower.config(), 0).expect("positions");
    let c = model.config();
    let mut kv =
        ResidentKv::new(c, c.n_attention_layers(), ResidentKvOptions::default()).expect("kv");
    let mut st = model.new_recurrent_state(&b).expect("state");
    let img = ImageEmbeds {
        token_id: tower.config().image_token_id,
        rows: &rows,
    };
    model
        .forward_multimodal(
            &b,
            tokens,
            img,
            &pos.positions,
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::Last,
        )
        .expect("prefill");
    steps
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let p = first + i as u32;
            let o = model
                .forward(
                    &b,
                    &[t],
                    &[[p; 3]],
                    AttentionPhase::Decode,
                    &mut st,
                    &mut kv,
                    LogitRows::Last,
                    None,
                )
                .expect("decode");
            b.tensor_to_f32(&o.logits.expect("logits")).expect("dl")
        })
        .collect()
}

#[test]
fn multimodal_session_logits_match_hf_and_decode_continues_at_next_position() {
    let ids = oracle_i64("ids");
    let gen = oracle_i64("gen");
    let steps = &gen[ids.len()..ids.len() + 4];
    let mut e = Engine::load(CpuBackend::new(), config(&vl_dir(), true, None)).expect("load");
    let imgs = images(&mut e, &["img_a.png", "img_b.png"]);
    let last = e.start_session_multimodal(&ids, &imgs).expect("session");
    let hf = oracle_f32("logits");
    let v = last.len();
    let d = max_diff(&last, &hf[hf.len() - v..]);
    assert!(d <= 1e-3, "last prompt row vs HF: {d}");
    let got: Vec<Vec<f32>> = steps
        .iter()
        .map(|&t| e.decode_step(t).expect("decode"))
        .collect();
    let next = u32::try_from(ids.len() as i64 + e.position_map().rope_delta()).expect("pos");
    assert!(
        next < ids.len() as u32,
        "images advance positions by max(h, w)"
    );
    let right = reference_decode_logits(&ids, next, steps);
    let wrong = reference_decode_logits(&ids, ids.len() as u32, steps);
    let d_right = got
        .iter()
        .zip(&right)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f32::max);
    let d_wrong = got
        .iter()
        .zip(&wrong)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f32::max);
    assert!(d_right <= 1e-5, "decode at next_position: {d_right}");
    assert!(
        d_wrong > 10.0 * d_right.max(1e-6),
        "text-only positions must differ measurably ({d_wrong} vs {d_right})"
    );
}

/// The prompt cache with images (`reuse_prefix`): image rows match by content, not by the
/// placeholder id. The same image again reuses all but the last row and encodes nothing; an image
/// of the same size with other pixels is never mistaken for it; a follow-up turn continues at the
/// current point without re-encoding. Every output equals a fresh engine's.
#[test]
fn prompt_cache_matches_images_by_content() {
    let cfg = config(&vl_dir(), false, None);
    let mut e = Engine::load(CpuBackend::new(), cfg.clone()).expect("load");
    let pad = 250u32;
    let a = images(&mut e, &["img_a.png"]);
    let c = images(&mut e, &["img_c.png"]);
    assert_eq!(
        a[0].grid_thw(),
        c[0].grid_thw(),
        "img_c resizes to img_a's grid"
    );
    assert_ne!(a[0].content_hash(), c[0].content_hash());
    let text = |n: u32, seed: u32| -> Vec<u32> { (0..n).map(|i| (i * 31 + seed) % 240).collect() };
    let mut p = text(5, 3);
    p.extend(vec![pad; a[0].n_tokens()]);
    p.extend(text(4, 11));
    let req = |p: &[u32], reuse: bool| {
        let mut r = GenerateRequest::new(Prompt::Tokens(p.to_vec()), 6);
        r.stop_at_eos = false;
        r.reuse_prefix = reuse;
        r
    };
    let go = |e: &mut Engine<CpuBackend>, p: &[u32], imgs: &[ImageInput], reuse: bool| {
        e.generate_multimodal(&req(p, reuse), imgs, |_| kvstream_runtime::Flow::Continue)
            .expect("generate")
    };
    let fresh = |p: &[u32], imgs: &[ImageInput]| {
        let mut f = Engine::load(CpuBackend::new(), cfg.clone()).expect("load");
        go(&mut f, p, imgs, false).tokens
    };

    let r1 = go(&mut e, &p, &a, true);
    assert_eq!(r1.cached_tokens, 0);
    assert_eq!(r1.tokens, fresh(&p, &a));

    let r2 = go(&mut e, &p, &a, true);
    assert_eq!(
        r2.cached_tokens,
        p.len() - 1,
        "same image: all but the last row"
    );
    assert_eq!(r2.tokens, r1.tokens);
    assert!(e.vision_stats().loans.is_empty(), "nothing re-encoded");

    let r3 = go(&mut e, &p, &c, true);
    assert!(
        r3.cached_tokens <= 5,
        "stops before the image: {}",
        r3.cached_tokens
    );
    assert_eq!(
        e.vision_stats().loans.len(),
        1,
        "the other image is encoded"
    );
    assert_eq!(r3.tokens, fresh(&p, &c));

    let mut p4 = p.clone();
    p4.extend(&r3.tokens);
    p4.extend(text(3, 7));
    let r4 = go(&mut e, &p4, &c, true);
    assert!(
        r4.cached_tokens >= p.len(),
        "follow-up turn: {}",
        r4.cached_tokens
    );
    assert!(
        e.vision_stats().loans.is_empty(),
        "image inside the reused prefix"
    );
    assert_eq!(r4.tokens, fresh(&p4, &c));
}

/// With MTP the prompt checkpoint (recurrent state, MTP tail, MTP layer rows) is reused the same
/// way: the same images and text again skip all but the last row and decode the same tokens.
#[test]
fn prompt_cache_with_images_and_mtp() {
    let mtp_dir = vl_with_mtp();
    let mut e = Engine::load(CpuBackend::new(), config(&mtp_dir, true, Some(2))).expect("load");
    let imgs = images(&mut e, &["img_a.png", "img_b.png"]);
    let mut req = greedy(8);
    req.reuse_prefix = true;
    let run = |e: &mut Engine<CpuBackend>| {
        e.generate_multimodal(&req, &imgs, |_| kvstream_runtime::Flow::Continue)
            .expect("generate")
    };
    let first = run(&mut e);
    let again = run(&mut e);
    let n = oracle_i64("ids").len();
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(again.cached_tokens, n - 1);
    assert_eq!(again.tokens, first.tokens);
    assert!(e.vision_stats().loans.is_empty());
    let _ = std::fs::remove_dir_all(&mtp_dir);
}
