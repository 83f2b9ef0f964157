//! Quality of quantized weights (issue 10): for each format (q8_0, q4_g128, fp8_e4m3,
//! q4_nl_g128) on the HF
//! fixtures and on the trained `models/kvstream-demo-tiny`, against the same model as stored:
//! max |Δlogit| and mean KL(stored ‖ quantized) over the positions of a fixed prompt, and
//! greedy agreement over 32 tokens. `cargo test -p kvstream-model-qwen --test quant_quality --
//! --nocapture` prints the numbers (docs/weights.md quotes them).

mod common;

use common::*;
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_model_qwen::WeightPolicy;

/// Mean-KL bounds: 8-bit formats and 4-bit.
const KL_8BIT: f64 = 0.005;
const KL_4BIT: f64 = 0.05;
const GREEDY: usize = 32;

/// `kl_8bit` / `kl_4bit`: the mean-KL bounds (KL_8BIT / KL_4BIT except where a random-weight
/// fixture is documented to exceed them: tiny-gqa-f32's q4_g128); `min_agree_*`: teacher-forced
/// greedy agreement floors (out of 32), set below the measured values of docs/weights.md
/// (`min_agree_nl` for q4_nl_g128, whose mean KL bound is KL_4BIT on every fixture).
fn quality(
    name: &str,
    prompt_key: &str,
    (kl_8bit, kl_4bit): (f64, f64),
    min_agree_8: usize,
    min_agree_4: usize,
    min_agree_nl: usize,
) {
    let b = CpuBackend::new();
    let oracle = Oracle::open(name);
    let ids: Vec<u32> = oracle.ids("ids").into_iter().take(64).collect();
    let prompt = oracle.ids(prompt_key);
    let reference = load(&b, name, WeightPolicy::as_stored());
    let v = reference.config().vocab_size;
    let ref_logits = logits_all(&b, &reference, &ids);
    let ref_seq = greedy(&b, &reference, &prompt, GREEDY);
    let ref_bytes = reference.weight_bytes();
    assert_eq!(reference.load_report().quantized, 0);
    assert!(reference.load_report().fallback.is_empty());
    for fmt in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ] {
        let m = load(&b, name, WeightPolicy::new(fmt));
        let r = m.load_report().clone();
        let got = logits_all(&b, &m, &ids);
        let d = max_diff(&got, &ref_logits);
        let kl = mean_kl(&ref_logits, &got, v);
        // Teacher-forced: the quantized model's argmax along the reference's greedy sequence.
        let tf = logits_all(&b, &m, &ref_seq[..ref_seq.len() - 1]);
        let agree = (prompt.len()..ref_seq.len())
            .filter(|&i| argmax(&tf[(i - 1) * v..i * v]) == ref_seq[i])
            .count();
        let free = greedy(&b, &m, &prompt, GREEDY);
        let prefix = (prompt.len()..ref_seq.len())
            .take_while(|&i| free[i] == ref_seq[i])
            .count();
        eprintln!(
            "QUANT {name} {fmt}: max|Δlogit| = {d:.3e}, mean KL = {kl:.3e}, greedy agreement \
             {agree}/{GREEDY} (teacher-forced), identical free-running prefix {prefix}/{GREEDY}; \
             {} quantized, {} kept, {} fallback; device weights {} B (as stored {ref_bytes} B)",
            r.quantized,
            r.kept,
            r.fallback.len(),
            m.weight_bytes()
        );
        assert!(r.quantized > 0, "{name} {fmt}: nothing quantized");
        assert!(
            d > 0.0,
            "{name} {fmt}: logits identical to the unquantized model"
        );
        assert!(m.weight_bytes() < ref_bytes, "{name} {fmt}: no bytes saved");
        assert_eq!(
            r.host_embedding_bytes,
            reference.load_report().host_embedding_bytes
        );
        let (kl_max, min_agree) = match fmt {
            WeightDType::Q4G128 => (kl_4bit, min_agree_4),
            WeightDType::Q4NlG128 => (KL_4BIT, min_agree_nl),
            _ => (kl_8bit, min_agree_8),
        };
        assert!(kl <= kl_max, "{name} {fmt}: mean KL {kl} > {kl_max}");
        assert!(
            agree >= min_agree,
            "{name} {fmt}: greedy agreement {agree}/{GREEDY} < {min_agree}"
        );
    }
}

#[test]
fn demo_tiny_quantized_quality() {
    quality(
        "kvstream-demo-tiny",
        "prompt0",
        (KL_8BIT, KL_4BIT),
        30,
        28,
        30,
    );
}

#[test]
fn tiny_gqa_f32_quantized_quality() {
    // Random N(0, 0.05) weights make this fixture very sensitive. Its q4_g128 mean KL is 0.055
    // (2.5e-4 on the trained demo model) although the total squared error of its q4 groups is
    // within 0.2 % of the exact optimum of the format (finer or exact scale searches move the KL by
    // ±2 % only); 43 % of it comes from layer 0's GDN in_proj_qkv alone. So q4_g128 gets 1.2×
    // the general bound here; the 8-bit formats and q4_nl_g128 (0.045) meet the general one
    // (docs/weights.md).
    quality(
        "tiny-gqa-f32",
        "gen_prompt",
        (KL_8BIT, 1.2 * KL_4BIT),
        22,
        8,
        8,
    );
}

#[test]
fn tiny_mha_tied_bf16_quantized_quality() {
    quality(
        "tiny-mha-tied-bf16",
        "gen_prompt",
        (KL_8BIT, KL_4BIT),
        24,
        24,
        24,
    );
}

#[test]
fn tiny_bare_text_quantized_quality() {
    quality(
        "tiny-bare-text",
        "gen_prompt",
        (KL_8BIT, KL_4BIT),
        20,
        14,
        18,
    );
}
