//! Quantized checkpoints and byte plans (issue 10): `save_quantized` → load is bit-identical to
//! quantize-at-load; public FP8 checkpoints load and match HF on the dequantized weights; bad
//! scale tensors / metadata are typed errors naming the tensor; `plan_weight_bytes` matches the
//! 27B numbers of qwen-spec §7 and the bytes of synthetic models actually loaded.

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_model_qwen::{
    plan_weight_bytes, plan_weight_bytes_stored, save_quantized, LoadOptions, ModelError,
    QwenConfig, QwenModel, WeightPolicy,
};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

fn mtp_logits(b: &CpuBackend, m: &QwenModel<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    use kvstream_memory_contracts::ops::TensorOps;
    use kvstream_model_qwen::{AttentionPhase, LogitRows, ResidentKv, ResidentKvOptions};
    let c = m.config();
    let mut kv =
        ResidentKv::new(c, c.n_attention_layers() + 1, ResidentKvOptions::default()).expect("kv");
    let mut st = m.new_recurrent_state(b).expect("state");
    let n = ids.len() - 1;
    let out = m
        .forward(
            b,
            ids,
            &pos(0..ids.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::None,
            None,
        )
        .expect("forward");
    let hidden = b.rows(&out.hidden, 0, n).expect("rows");
    let o = m
        .mtp_forward(b, &ids[1..], &hidden, &pos(0..n), &mut kv, LogitRows::All)
        .expect("mtp");
    b.tensor_to_f32(&o.logits.expect("logits")).expect("dl")
}

/// Saving with a policy and loading the result as stored gives the same weights, bit for bit,
/// as quantizing at load time (main and MTP logits compared bitwise), with the same report.
fn save_roundtrip(name: &str, policy: WeightPolicy) {
    let b = CpuBackend::new();
    // One directory per (model, format): tests run in parallel.
    let fmt = policy.format.map_or("stored", |f| f.name());
    let out = tmpdir(&format!("save-{name}-{fmt}"));
    let saved = save_quantized(&dir(name), &out, &policy, true).expect("save");
    let ids: Vec<u32> = Oracle::open(name).ids("ids").into_iter().take(40).collect();
    let direct = load(&b, name, policy);
    let opts = |weights| LoadOptions {
        load_mtp: true,
        weights,
        ..LoadOptions::default()
    };
    let t0 = std::time::Instant::now();
    let stored = QwenModel::load(&b, &out, &opts(WeightPolicy::as_stored())).expect("load saved");
    let load_s = t0.elapsed().as_secs_f64();
    let again = QwenModel::load(&b, &out, &opts(policy)).expect("load saved with policy");
    let want = logits_all(&b, &direct, &ids);
    for m in [&stored, &again] {
        assert_eq!(
            bits(&logits_all(&b, m, &ids)),
            bits(&want),
            "{name}: main logits"
        );
        assert_eq!(
            bits(&mtp_logits(&b, m, &ids)),
            bits(&mtp_logits(&b, &direct, &ids)),
            "{name}: MTP logits"
        );
        let (r, d) = (m.load_report(), direct.load_report());
        assert_eq!(r.device_weight_bytes, d.device_weight_bytes, "{name}");
        assert_eq!(r.quantized, d.quantized, "{name}");
        assert_eq!(r.host_embedding_bytes, d.host_embedding_bytes, "{name}");
        assert!(r.fallback.is_empty() || r.fallback == d.fallback, "{name}");
    }
    assert_eq!(saved.device_weight_bytes, direct.weight_bytes(), "{name}");
    assert_eq!(saved.quantized, direct.load_report().quantized, "{name}");
    assert_eq!(saved.fallback, direct.load_report().fallback, "{name}");
    // The saved quantized tensors are single U8 tensors described by the metadata.
    let bytes = std::fs::read(out.join("model.safetensors")).expect("read");
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("header");
    let md = meta.metadata().clone().unwrap_or_default();
    let n_meta = md.keys().filter(|k| k.as_str() != "format").count();
    assert_eq!(
        n_meta, saved.quantized,
        "{name}: one metadata entry per quantized tensor"
    );
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("cfg"))
            .expect("json");
    let q = &cfg["quantization_config"];
    assert_eq!(q["quant_method"], "kvstream");
    assert_eq!(
        q["format"],
        policy
            .format
            .map_or("null".into(), |f| f.name().to_string())
            .as_str()
    );
    eprintln!(
        "SAVE {name} {:?}: {} quantized tensors, {} B on the device, saved dir loads in {load_s:.3} s",
        policy.format, saved.quantized, saved.device_weight_bytes
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn saved_q4_demo_equals_quantize_at_load_bitwise() {
    save_roundtrip("kvstream-demo-tiny", WeightPolicy::new(WeightDType::Q4G128));
}

#[test]
fn saved_q4_nl_demo_equals_quantize_at_load_bitwise() {
    save_roundtrip(
        "kvstream-demo-tiny",
        WeightPolicy::new(WeightDType::Q4NlG128),
    );
}

#[test]
fn saved_tied_and_fallback_models_equal_quantize_at_load_bitwise() {
    // Tied embeddings: the q8_0 head is written as its own `lm_head.weight`; hidden 64: every
    // q4_g128 decoder linear falls back to q8_0.
    save_roundtrip("tiny-mha-tied-bf16", WeightPolicy::new(WeightDType::Q4G128));
    save_roundtrip(
        "tiny-bare-text",
        WeightPolicy::new(WeightDType::F8E4M3).with_head(WeightDType::Bf16),
    );
}

#[test]
fn public_fp8_checkpoint_matches_hf_on_dequantized_weights() {
    let b = CpuBackend::new();
    let name = "tiny-gqa-fp8";
    let o = Oracle::open(name);
    let ids = o.ids("ids");
    let want = o.f32("logits");
    let m = load(&b, name, WeightPolicy::as_stored());
    let got = logits_all(&b, &m, &ids);
    let d = max_diff(&got, &want);
    let r = m.load_report();
    eprintln!(
        "FP8 {name}: max |Δlogit| vs HF on the dequantized weights = {d:e}; {} fp8 tensors",
        r.quantized
    );
    assert!(d <= 1e-4, "{d}");
    // 25 decoder linears + mtp.fc + 7 MTP layer linears are F8_E4M3 in the file.
    assert_eq!(r.quantized, 33);
    // The f32 model differs from HF's FP8 reference by far more than 1e-4 (the check bites).
    let f32m = load(&b, "tiny-gqa-f32", WeightPolicy::as_stored());
    assert!(max_diff(&logits_all(&b, &f32m, &ids), &want) > 1e-2);
    // Re-quantizing FP8 weights to q4_g128 at load works (from the dequantized values).
    let q4 = load(&b, name, WeightPolicy::new(WeightDType::Q4G128));
    let l4 = logits_all(&b, &q4, &ids);
    assert!(l4.iter().all(|x| x.is_finite()));
    assert!(q4.weight_bytes() < m.weight_bytes());
    // And saving the FP8 checkpoint as stored gives a kvstream dir with the same logits.
    let out = tmpdir("fp8-save");
    save_quantized(&dir(name), &out, &WeightPolicy::as_stored(), true).expect("save");
    let m2 = QwenModel::load(&b, &out, &LoadOptions::default()).expect("load");
    assert_eq!(bits(&logits_all(&b, &m2, &ids)), bits(&got));
    let _ = std::fs::remove_dir_all(&out);
}

/// Rewrites `src/model.safetensors` into `dst` through `edit(name, dtype, shape, bytes)`
/// (None drops the tensor) with `meta` as `__metadata__`, and copies config.json.
fn rewrite(
    src: &Path,
    dst: &Path,
    meta: Option<HashMap<String, String>>,
    edit: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    std::fs::create_dir_all(dst).expect("mkdir");
    std::fs::copy(src.join("config.json"), dst.join("config.json")).expect("cfg");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("st");
    let kept: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, t)| {
            edit(&n, t.dtype(), t.shape().to_vec(), t.data().to_vec()).map(|(d, s, b)| (n, d, s, b))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = kept
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, meta, &dst.join("model.safetensors")).expect("write");
}

fn load_err(d: &Path) -> ModelError {
    let b = CpuBackend::new();
    match QwenModel::load(&b, d, &LoadOptions::default()) {
        Ok(_) => panic!("loading {} should fail", d.display()),
        Err(e) => e,
    }
}

#[test]
fn bad_fp8_scales_are_typed_errors_naming_the_tensor() {
    let src = dir("tiny-gqa-fp8");
    let w = "model.language_model.layers.1.mlp.gate_proj.weight";
    let s = format!("{w}_scale_inv");
    let t = tmpdir("fp8-noscale");
    rewrite(&src, &t, None, |n, d, sh, b| (n != s).then_some((d, sh, b)));
    let e = load_err(&t);
    assert!(
        matches!(&e, ModelError::ScaleTensor { name, .. } if name == w),
        "{e}"
    );
    assert!(e.to_string().contains(w), "{e}");
    let t2 = tmpdir("fp8-badscale");
    rewrite(&src, &t2, None, |n, d, sh, b| {
        if n == s {
            Some((Dtype::F32, vec![3, 3], vec![0; 36]))
        } else {
            Some((d, sh, b))
        }
    });
    let e = load_err(&t2);
    assert!(
        matches!(&e, ModelError::ScaleTensor { name, scale, .. } if name == w && *scale == s),
        "{e}"
    );
    let t3 = tmpdir("fp8-badconfig");
    rewrite(&src, &t3, None, |_, d, sh, b| Some((d, sh, b)));
    let cfg = std::fs::read_to_string(t3.join("config.json")).expect("cfg");
    std::fs::write(
        t3.join("config.json"),
        cfg.replace("[\n      128,\n      128\n    ]", "[64, 64]"),
    )
    .expect("cfg");
    let e = load_err(&t3);
    assert!(
        matches!(&e, ModelError::Config { key, .. } if key.contains("weight_block_size")),
        "{e}"
    );
    for d in [t, t2, t3] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn malformed_quant_metadata_is_a_typed_error_naming_the_tensor() {
    let saved = tmpdir("meta-src");
    save_quantized(
        &dir("tiny-bare-text"),
        &saved,
        &WeightPolicy::new(WeightDType::Q8_0),
        false,
    )
    .expect("save");
    let bytes = std::fs::read(saved.join("model.safetensors")).expect("read");
    let (_, m) = SafeTensors::read_metadata(&bytes).expect("hdr");
    let meta = m.metadata().clone().expect("metadata");
    let w = "model.layers.2.mlp.up_proj.weight";
    let good = meta.get(w).expect("entry").clone();
    assert_eq!(good, "q8_0:[128,64]");
    let cases: Vec<(&str, Option<String>)> = vec![
        ("garbled", Some("q8_0:[128,x]".into())),
        ("unknown-format", Some("q3_k:[128,64]".into())),
        ("missing", None),
        ("wrong-dims", Some("q8_0:[64,128]".into())),
        ("wrong-format", Some("q4_g128:[128,128]".into())),
    ];
    for (tag, value) in cases {
        let mut md = meta.clone();
        match &value {
            Some(v) => md.insert(w.to_string(), v.clone()),
            None => md.remove(w),
        };
        let t = tmpdir(&format!("meta-{tag}"));
        rewrite(&saved, &t, Some(md), |_, d, sh, b| Some((d, sh, b)));
        let e = load_err(&t);
        let msg = e.to_string();
        assert!(msg.contains(w), "{tag}: {msg}");
        match tag {
            "wrong-dims" | "wrong-format" => assert!(
                matches!(
                    e,
                    ModelError::TensorShape { .. } | ModelError::Safetensors { .. }
                ),
                "{tag}: {e:?}"
            ),
            _ => assert!(
                matches!(e, ModelError::QuantMetadata { .. }),
                "{tag}: {e:?}"
            ),
        }
        let _ = std::fs::remove_dir_all(&t);
    }
    let _ = std::fs::remove_dir_all(&saved);
}

fn config(json: serde_json::Value) -> QwenConfig {
    QwenConfig::from_json_str(&json.to_string(), Path::new("/test/config.json")).expect("config")
}

fn geometry(hidden: usize, inter: usize, vocab: usize, layers: usize, tied: bool) -> QwenConfig {
    let (heads, kv, hd, lk, lv, ld) = if hidden >= 5120 {
        (24, 4, 256, 16, 48, 128)
    } else {
        (4, 2, 64, 2, 4, 64)
    };
    config(serde_json::json!({
        "model_type": "qwen3_5_text", "hidden_size": hidden, "vocab_size": vocab,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "linear_num_key_heads": lk,
        "linear_num_value_heads": lv, "linear_key_head_dim": ld, "linear_value_head_dim": ld,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "full_attention_interval": 4, "tie_word_embeddings": tied,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": if hd == 256 { [11, 11, 10] } else { [3, 3, 2] },
                            "mrope_interleaved": true},
        "eos_token_id": 1, "mtp_num_hidden_layers": 1, "output_gate_type": "swish"
    }))
}

/// The 27B plan reproduces qwen-spec §7 (as stored in bf16) and the q4_g128 arithmetic, and
/// fits a 16 GiB GPU with room for the arena.
#[test]
fn plan_for_27b_matches_spec_counts() {
    let c = geometry(5120, 17408, 248_320, 64, false);
    // qwen-spec §7 parameter counts.
    let (layers, embed, mtp) = (24_353_196_544u64, 1_271_398_400u64, 424_699_392u64);
    let p = plan_weight_bytes(&c, &WeightPolicy::as_stored(), true);
    assert_eq!(p.decoder_linear + p.small, 2 * layers + 2 * 5120);
    assert_eq!(p.head, 2 * embed);
    assert_eq!(p.host_embedding, 2 * embed);
    assert_eq!(p.mtp, 2 * mtp);
    // q4_g128: per-layer small tensors (spec §2 shapes) stay bf16.
    let small_gdn = 2 * 48 * 5120 + 10240 * 4 + 48 + 48 + 128 + 2 * 5120;
    let small_full = 2 * 256 + 2 * 5120;
    let small = 48 * small_gdn + 16 * small_full;
    let linear = layers - small;
    let q = plan_weight_bytes(&c, &WeightPolicy::new(WeightDType::Q4G128), true);
    assert_eq!(q.decoder_linear, linear / 64 * 33); // 4 bits + one f16 per 128
    assert_eq!(q.small, 2 * (small + 5120));
    assert_eq!(q.head, embed + embed / 16); // q8_0: 8 bits + one f16 per 32
    let mtp_norms = 3 * 5120 + small_full;
    assert_eq!(q.mtp, (mtp - mtp_norms) / 16 * 17 + 2 * mtp_norms);
    assert_eq!(q.host_embedding, 2 * embed);
    let gib = (1u64 << 30) as f64;
    eprintln!(
        "PLAN 27B q4_g128 (+q8_0 head): decoder {:.2} GiB, head {:.2} GiB, small {:.3} GiB, MTP \
         {:.3} GiB, device total {:.2} GiB (+MTP); host embedding {:.2} GiB; as stored {:.2} GiB",
        q.decoder_linear as f64 / gib,
        q.head as f64 / gib,
        q.small as f64 / gib,
        q.mtp as f64 / gib,
        q.device_total() as f64 / gib,
        q.host_embedding as f64 / gib,
        p.device_total() as f64 / gib
    );
    assert!(q.device_total() < 14 * (1 << 30));
    // q4_nl_g128 has the q4_g128 layout: the same bytes everywhere.
    let nl = plan_weight_bytes(&c, &WeightPolicy::new(WeightDType::Q4NlG128), true);
    assert_eq!(nl, q);
    let f8 = plan_weight_bytes(&c, &WeightPolicy::new(WeightDType::F8E4M3), false);
    assert_eq!(f8.mtp, 0);
    assert_eq!(f8.decoder_linear, linear + linear / 128 * 4);
}

/// For a small geometry the plan equals the bytes of synthetic models actually loaded, for
/// every policy, tied and untied, with fallbacks (K = 608 is not a multiple of 128).
#[test]
fn plan_matches_loaded_synthetic_models() {
    let b = CpuBackend::new();
    let policies = [
        WeightPolicy::as_stored(),
        WeightPolicy::new(WeightDType::Q8_0),
        WeightPolicy::new(WeightDType::Q4G128),
        WeightPolicy::new(WeightDType::F8E4M3),
        WeightPolicy::new(WeightDType::Q4G128).with_head(WeightDType::Bf16),
        WeightPolicy::new(WeightDType::Bf16),
        WeightPolicy::new(WeightDType::Q4NlG128),
    ];
    for tied in [false, true] {
        let c = geometry(256, 608, 1000, 4, tied);
        for stored in [WeightDType::Bf16, WeightDType::F32] {
            for policy in policies {
                for mtp in [false, true] {
                    let opts = LoadOptions {
                        load_mtp: mtp,
                        weights: policy,
                        ..LoadOptions::default()
                    };
                    let m = QwenModel::synthetic(&b, &c, stored, 7, &opts).expect("synthetic");
                    let p = plan_weight_bytes_stored(&c, &policy, mtp, stored);
                    let r = m.load_report();
                    let what = format!("tied {tied} {stored} {policy:?} mtp {mtp}");
                    assert_eq!(m.weight_bytes() as u64, p.device_total(), "{what}");
                    assert_eq!(r.device_weight_bytes as u64, p.device_total(), "{what}");
                    assert_eq!(m.mtp_weight_bytes() as u64, p.mtp, "{what}");
                    assert_eq!(r.host_embedding_bytes as u64, p.host_embedding, "{what}");
                    if policy.format.is_some_and(WeightDType::is_q4) {
                        let names: Vec<&str> = r.fallback.iter().map(|(n, _)| n.as_str()).collect();
                        assert_eq!(names.len(), 4, "{what}: {names:?}");
                        assert!(
                            names.iter().all(|n| n.ends_with("down_proj.weight")),
                            "{names:?}"
                        );
                        assert!(r.fallback.iter().all(|(_, d)| *d == WeightDType::Q8_0));
                    } else {
                        assert!(r.fallback.is_empty(), "{what}");
                    }
                }
            }
        }
    }
}

/// Synthetic quantized models run, are deterministic, and differ by seed.
#[test]
fn synthetic_quantized_models_run_deterministically() {
    let b = CpuBackend::new();
    let c = geometry(256, 640, 1000, 4, false);
    let ids: Vec<u32> = (0..20).map(|i| (i * 37 % 1000) as u32).collect();
    for fmt in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ] {
        let opts = LoadOptions {
            load_mtp: false,
            weights: WeightPolicy::new(fmt),
            ..LoadOptions::default()
        };
        let a = QwenModel::synthetic(&b, &c, WeightDType::Bf16, 3, &opts).expect("a");
        let a2 = QwenModel::synthetic(&b, &c, WeightDType::Bf16, 3, &opts).expect("a2");
        let z = QwenModel::synthetic(&b, &c, WeightDType::Bf16, 4, &opts).expect("z");
        let la = logits_all(&b, &a, &ids);
        assert!(la.iter().all(|x| x.is_finite()), "{fmt}");
        assert!(la.iter().any(|x| *x != 0.0), "{fmt}");
        assert_eq!(bits(&la), bits(&logits_all(&b, &a2, &ids)), "{fmt}");
        assert_ne!(bits(&la), bits(&logits_all(&b, &z, &ids)), "{fmt}");
        assert!(a.load_report().quantized > 0);
        // A quantized `dtype` means "bf16 storage + that policy".
        let q = QwenModel::synthetic(&b, &c, fmt, 3, &LoadOptions::default()).expect("q");
        assert_eq!(q.weight_bytes(), a.weight_bytes(), "{fmt}");
    }
}

/// `kvstream quantize` on a vision-language checkpoint keeps the vision tower: the saved
/// directory encodes images exactly like the source (tensors copied as stored).
#[test]
fn saved_quantized_vl_model_keeps_its_vision_tower() {
    use kvstream_model_qwen::vision::{preprocess, PreprocessorConfig, VisionTower};
    let src = dir("tiny-vl");
    let out = tmpdir("save-vl");
    save_quantized(&src, &out, &WeightPolicy::new(WeightDType::Q8_0), false).expect("save");
    let cfg = PreprocessorConfig::from_model_dir(&out).expect("preprocessor config copied");
    let img = std::fs::read(src.join("img_a.png")).expect("image");
    let p = preprocess(&img, &cfg).expect("preprocess");
    let want = VisionTower::load(&src)
        .expect("source tower")
        .encode_on(&CpuBackend::new(), &p)
        .expect("encode");
    let got = VisionTower::load(&out)
        .expect("saved tower")
        .encode_on(&CpuBackend::new(), &p)
        .expect("encode");
    assert!(!want.is_empty());
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    // The text model still loads from the saved directory, quantized.
    let b = CpuBackend::new();
    let m = QwenModel::load(&b, &out, &LoadOptions::default()).expect("load saved");
    assert!(m.load_report().quantized > 0);
    let _ = std::fs::remove_dir_all(&out);
}
