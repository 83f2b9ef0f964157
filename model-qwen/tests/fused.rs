//! Fused projections (MLP gate/up, GDN in_proj_qkv/z, attention q/k/v as one weight each) give
//! the same logits as separate weights, BIT for bit on the CPU backend — prefill (GEMM path),
//! single-token decode (GEMV path), MTP head — with the same load report and weight bytes, for
//! every stored dtype (f32, bf16, public FP8, kvstream-saved q4) and quantize-at-load formats.

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::TensorOps;
use kvstream_model_qwen::{
    save_quantized, AttentionPhase, LoadOptions, LogitRows, QwenModel, ResidentKv,
    ResidentKvOptions, WeightPolicy,
};
use std::path::Path;

fn load_dir(
    b: &CpuBackend,
    dir: &Path,
    weights: WeightPolicy,
    fuse: bool,
) -> QwenModel<CpuBackend> {
    QwenModel::load(
        b,
        dir,
        &LoadOptions {
            load_mtp: true,
            weights,
            fuse_projections: Some(fuse),
        },
    )
    .expect("load")
}

/// Every logit a short session produces: prefill of 12 tokens (all rows), 5 greedy decode
/// steps (one row each), then the MTP head over the prefill's hidden rows.
fn session_logits(b: &CpuBackend, m: &QwenModel<CpuBackend>, ids: &[u32]) -> Vec<u32> {
    let c = m.config();
    let mut kv =
        ResidentKv::new(c, c.n_attention_layers() + 1, ResidentKvOptions::default()).expect("kv");
    let mut st = m.new_recurrent_state(b).expect("state");
    let n = 12.min(ids.len());
    let mut out = Vec::new();
    let o = m
        .forward(
            b,
            &ids[..n],
            &pos(0..n),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::All,
            None,
        )
        .expect("prefill");
    let hidden = b.rows(&o.hidden, 0, n - 1).expect("rows");
    let mut l = b.tensor_to_f32(&o.logits.expect("logits")).expect("dl");
    out.extend(bits(&l));
    for p in n..n + 5 {
        let v = c.vocab_size;
        let next = argmax(&l[l.len() - v..]);
        let o = m
            .forward(
                b,
                &[next],
                &pos(p..p + 1),
                AttentionPhase::Decode,
                &mut st,
                &mut kv,
                LogitRows::Last,
                None,
            )
            .expect("decode");
        l = b.tensor_to_f32(&o.logits.expect("logits")).expect("dl");
        out.extend(bits(&l));
    }
    // The MTP head's own attention layer, from position 0.
    let mut kv =
        ResidentKv::new(c, c.n_attention_layers() + 1, ResidentKvOptions::default()).expect("kv");
    let o = m
        .mtp_forward(
            b,
            &ids[1..n],
            &hidden,
            &pos(0..n - 1),
            &mut kv,
            LogitRows::All,
        )
        .expect("mtp");
    out.extend(bits(
        &b.tensor_to_f32(&o.logits.expect("mtp logits")).expect("dl"),
    ));
    out
}

/// Fused and separate loads of `dir` with `policy`: same report and bytes, every fusable pair
/// fused, logits bit-identical.
fn check(b: &CpuBackend, dir: &Path, ids: &[u32], policy: WeightPolicy) {
    let what = format!("{} {policy:?}", dir.display());
    let sep = load_dir(b, dir, policy, false);
    let fused = load_dir(b, dir, policy, true);
    assert_eq!(sep.fused_projections(), 0, "{what}");
    // One fused mixer projection and one MLP projection per layer, the GDN layers'
    // [in_proj_b; in_proj_a], plus the MTP layer's two.
    let c = fused.config();
    assert_eq!(
        fused.fused_projections(),
        2 * c.num_hidden_layers + c.n_linear_layers() + 2,
        "{what}"
    );
    assert_eq!(fused.load_report(), sep.load_report(), "{what}");
    assert_eq!(fused.weight_bytes(), sep.weight_bytes(), "{what}");
    assert_eq!(fused.mtp_weight_bytes(), sep.mtp_weight_bytes(), "{what}");
    let (a, f) = (session_logits(b, &sep, ids), session_logits(b, &fused, ids));
    assert!(!a.is_empty());
    assert!(a == f, "{what}: fused logits differ from separate ones");
}

fn ids(name: &str) -> Vec<u32> {
    Oracle::open(name).ids("ids")
}

#[test]
fn fused_projections_are_bit_identical_as_stored() {
    let b = CpuBackend::new();
    for name in [
        "tiny-gqa-f32",
        "tiny-mha-tied-bf16",
        "tiny-bare-text",
        "tiny-gqa-fp8",
        "kvstream-demo-tiny",
    ] {
        check(&b, &dir(name), &ids(name), WeightPolicy::as_stored());
    }
}

#[test]
fn fused_projections_are_bit_identical_quantized_at_load() {
    let b = CpuBackend::new();
    for name in ["tiny-gqa-f32", "kvstream-demo-tiny", "tiny-gqa-fp8"] {
        for fmt in [
            WeightDType::Q4G128,
            WeightDType::Q8_0,
            WeightDType::Q4NlG128,
            WeightDType::F8E4M3,
        ] {
            check(&b, &dir(name), &ids(name), WeightPolicy::new(fmt));
        }
    }
    // bf16 storage, hidden 64: every q4 linear falls back to q8_0 (both parts alike: fused,
    // both fallbacks reported); bf16 → f32 as a plain-format policy.
    let name = "tiny-mha-tied-bf16";
    check(
        &b,
        &dir(name),
        &ids(name),
        WeightPolicy::new(WeightDType::Q4G128),
    );
    check(
        &b,
        &dir(name),
        &ids(name),
        WeightPolicy::new(WeightDType::F32),
    );
}

#[test]
fn fused_projections_are_bit_identical_from_saved_quantized_checkpoints() {
    let b = CpuBackend::new();
    let name = "kvstream-demo-tiny";
    for fmt in [WeightDType::Q4G128, WeightDType::Q8_0] {
        let out = tmpdir(&format!("fused-{}", fmt.name()));
        save_quantized(&dir(name), &out, &WeightPolicy::new(fmt), true).expect("save");
        // Loaded as stored (blobs copied, never requantized) and requantized to another format.
        check(&b, &out, &ids(name), WeightPolicy::as_stored());
        check(&b, &out, &ids(name), WeightPolicy::new(WeightDType::Q8_0));
        // And the saved checkpoint equals quantize-at-load with fusion on.
        let direct = load_dir(&b, &dir(name), WeightPolicy::new(fmt), true);
        let saved = load_dir(&b, &out, WeightPolicy::as_stored(), true);
        assert!(session_logits(&b, &direct, &ids(name)) == session_logits(&b, &saved, &ids(name)));
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn synthetic_models_fuse_with_the_same_bytes_and_logits() {
    use kvstream_model_qwen::QwenConfig;
    let b = CpuBackend::new();
    let c = QwenConfig::from_model_dir(&dir("tiny-gqa-f32")).expect("config");
    let ids: Vec<u32> = (0..12).map(|i| (i * 37 % 500) as u32).collect();
    for fmt in [WeightDType::Bf16, WeightDType::Q4G128, WeightDType::Q8_0] {
        let m = |fuse| {
            let opts = LoadOptions {
                load_mtp: true,
                weights: WeightPolicy::as_stored(),
                fuse_projections: Some(fuse),
            };
            QwenModel::synthetic(&b, &c, fmt, 3, &opts).expect("synthetic")
        };
        let (sep, fused) = (m(false), m(true));
        assert_eq!(
            fused.fused_projections(),
            2 * c.num_hidden_layers + c.n_linear_layers() + 2,
            "{fmt}"
        );
        assert_eq!(fused.load_report(), sep.load_report(), "{fmt}");
        assert!(
            session_logits(&b, &sep, &ids) == session_logits(&b, &fused, &ids),
            "{fmt}"
        );
    }
}
