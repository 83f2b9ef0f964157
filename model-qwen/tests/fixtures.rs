//! The model against the HF transformers fixtures in `fixtures/` (see fixtures/README.md):
//! full-sequence logits, prefill + recurrent decode, MTP logits, greedy generation, and the
//! bit-exactness of checkpointed multi-token verification.

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::ops::{Position3, SamplingOps, TensorOps};
use kvstream_model_qwen::{
    AttentionKv, AttentionPhase, ImageEmbeds, LoadOptions, LogitRows, QwenModel, RecurrentState,
    ResidentKv, ResidentKvOptions,
};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
        .join(name)
}

struct Oracle {
    bytes: Vec<u8>,
}

impl Oracle {
    fn open(name: &str) -> Self {
        let bytes = std::fs::read(dir(name).join("oracle.safetensors")).expect("oracle file");
        Self { bytes }
    }
    fn f32(&self, key: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle tensor");
        assert_eq!(t.dtype(), Dtype::F32);
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    }
    fn ids(&self, key: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle ids");
        assert_eq!(t.dtype(), Dtype::I64);
        t.data()
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u32::try_from(i64::from_le_bytes(a)).expect("id fits u32")
            })
            .collect()
    }
}

struct Setup {
    b: CpuBackend,
    model: QwenModel<CpuBackend>,
    oracle: Oracle,
}

fn setup(name: &str) -> Setup {
    let b = CpuBackend::new();
    let model = QwenModel::load(
        &b,
        &dir(name),
        &LoadOptions {
            load_mtp: true,
            ..Default::default()
        },
    )
    .expect("load");
    assert!(model.has_mtp());
    Setup {
        b,
        model,
        oracle: Oracle::open(name),
    }
}

fn pos(range: std::ops::Range<usize>) -> Vec<Position3> {
    range.map(|p| [p as u32; 3]).collect()
}

impl Setup {
    fn kv(&self) -> ResidentKv<CpuBackend> {
        let c = self.model.config();
        ResidentKv::new(c, c.n_attention_layers() + 1, ResidentKvOptions::default()).expect("kv")
    }
    fn state(&self) -> RecurrentState<CpuBackend> {
        self.model.new_recurrent_state(&self.b).expect("state")
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

const TOL: f32 = 1e-3;

fn full_forward(name: &str) {
    let s = setup(name);
    let ids = s.oracle.ids("ids");
    let (_, want) = s.oracle.f32("logits");
    let (mut st, mut kv) = (s.state(), s.kv());
    let out = s
        .model
        .forward(
            &s.b,
            &ids,
            &pos(0..ids.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::All,
            None,
        )
        .expect("forward");
    let got = s.b.tensor_to_f32(&out.logits.expect("logits")).expect("dl");
    let d = max_diff(&got, &want);
    eprintln!("{name}: full forward max |Δlogit| = {d:e}");
    assert!(d <= TOL, "{name}: {d}");
    // The final-norm hidden state matches HF's hidden.{L} as well.
    let (_, hid) = s
        .oracle
        .f32(&format!("hidden.{}", s.model.config().num_hidden_layers));
    let gh = s.b.tensor_to_f32(&out.hidden).expect("dl");
    assert!(max_diff(&gh, &hid) <= TOL);
}

fn incremental(name: &str) {
    let s = setup(name);
    let ids = s.oracle.ids("ids");
    let (_, want) = s.oracle.f32("logits_incremental");
    let v = s.model.config().vocab_size;
    let (mut st, mut kv) = (s.state(), s.kv());
    let hints = s.b.prefetch_hints();
    let pre = s
        .model
        .forward(
            &s.b,
            &ids[..200],
            &pos(0..200),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::All,
            None,
        )
        .expect("prefill");
    // Prefetch hints (`LinearOps::prefetch_weight`): none for a prefill, every layer's output
    // projection once per decode step.
    assert_eq!(
        s.b.prefetch_hints(),
        hints,
        "{name}: a prefill names no weight"
    );
    let mut got = s.b.tensor_to_f32(&pre.logits.expect("logits")).expect("dl");
    for t in 200..ids.len() {
        let o = s
            .model
            .forward(
                &s.b,
                &ids[t..t + 1],
                &pos(t..t + 1),
                AttentionPhase::Decode,
                &mut st,
                &mut kv,
                LogitRows::Last,
                None,
            )
            .expect("decode");
        got.extend(s.b.tensor_to_f32(&o.logits.expect("logits")).expect("dl"));
    }
    assert_eq!(got.len(), ids.len() * v);
    let layers = s.model.config().num_hidden_layers;
    assert_eq!(
        s.b.prefetch_hints() - hints,
        ((ids.len() - 200) * layers) as u64,
        "{name}: one hint per layer and decode step"
    );
    let d = max_diff(&got, &want);
    eprintln!("{name}: prefill 200 + 120 decode max |Δlogit| = {d:e}");
    assert!(d <= TOL, "{name}: {d}");
}

fn mtp(name: &str) {
    let s = setup(name);
    let ids = s.oracle.ids("ids");
    let (shape, want) = s.oracle.f32("mtp_logits");
    let n = shape[1];
    let (mut st, mut kv) = (s.state(), s.kv());
    let out = s
        .model
        .forward(
            &s.b,
            &ids,
            &pos(0..ids.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::None,
            None,
        )
        .expect("forward");
    let hidden = s.b.rows(&out.hidden, 0, n).expect("rows");
    let m = s
        .model
        .mtp_forward(
            &s.b,
            &ids[1..=n],
            &hidden,
            &pos(0..n),
            &mut kv,
            LogitRows::All,
        )
        .expect("mtp");
    let got = s.b.tensor_to_f32(&m.logits.expect("logits")).expect("dl");
    let d = max_diff(&got, &want);
    eprintln!("{name}: mtp max |Δlogit| = {d:e}");
    assert!(d <= TOL, "{name}: {d}");
    assert_eq!(kv.len(s.model.config().n_attention_layers()), n);
}

/// `mtp_forward_multimodal`: rows whose next token is the "placeholder" embed the given rows.
/// With the placeholder's own table rows it is bit-identical to `mtp_forward`; with other rows
/// the logits change.
fn mtp_image_rows(name: &str) {
    let s = setup(name);
    let ids = s.oracle.ids("ids");
    let n = 24.min(ids.len() - 1);
    let next = &ids[1..=n];
    let placeholder = next[n / 2];
    let k = next.iter().filter(|&&t| t == placeholder).count();
    let own = s
        .model
        .embedding()
        .gather(&vec![placeholder; k])
        .expect("rows");
    let other: Vec<f32> = own.iter().map(|v| -0.5 * v + 0.01).collect();
    // The target's prefill of ids[..n]: its hidden rows and KV (a fresh pair per call).
    let prefill = || {
        let (mut st, mut kv) = (s.state(), s.kv());
        let out = s
            .model
            .forward(
                &s.b,
                &ids[..n],
                &pos(0..n),
                AttentionPhase::Prefill,
                &mut st,
                &mut kv,
                LogitRows::None,
                None,
            )
            .expect("forward");
        (out.hidden, kv)
    };
    let run = |rows: Option<&[f32]>| {
        let (hidden, mut kv) = prefill();
        let m = match rows {
            None => s
                .model
                .mtp_forward(&s.b, next, &hidden, &pos(0..n), &mut kv, LogitRows::All),
            Some(rows) => s.model.mtp_forward_multimodal(
                &s.b,
                next,
                ImageEmbeds {
                    token_id: placeholder,
                    rows,
                },
                &hidden,
                &pos(0..n),
                &mut kv,
                LogitRows::All,
            ),
        }
        .expect("mtp");
        s.b.tensor_to_f32(&m.logits.expect("logits")).expect("dl")
    };
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let plain = run(None);
    assert_eq!(bits(&run(Some(&own))), bits(&plain), "{name}: own rows");
    let changed = run(Some(&other));
    assert!(max_diff(&changed, &plain) > 1e-4, "{name}: rows ignored");
    // A wrong row count is a typed error, not a panic.
    let (hidden, mut kv) = prefill();
    let bad = ImageEmbeds {
        token_id: placeholder,
        rows: &own[1..],
    };
    assert!(s
        .model
        .mtp_forward_multimodal(
            &s.b,
            next,
            bad,
            &hidden,
            &pos(0..n),
            &mut kv,
            LogitRows::All
        )
        .is_err());
}

fn generate(name: &str) {
    let s = setup(name);
    let prompt = s.oracle.ids("gen_prompt");
    let want = s.oracle.ids("gen_out");
    let (mut st, mut kv) = (s.state(), s.kv());
    let mut seq = prompt.clone();
    let mut o = s
        .model
        .forward(
            &s.b,
            &prompt,
            &pos(0..prompt.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::Last,
            None,
        )
        .expect("prefill");
    while seq.len() < want.len() {
        let next = s.b.argmax_rows(&o.logits.expect("logits")).expect("argmax")[0];
        seq.push(next);
        let p = seq.len() - 1;
        o = s
            .model
            .forward(
                &s.b,
                &[next],
                &pos(p..p + 1),
                AttentionPhase::Decode,
                &mut st,
                &mut kv,
                LogitRows::Last,
                None,
            )
            .expect("decode");
    }
    assert_eq!(seq, want, "{name}: greedy generation differs from HF");
}

/// A 4-token verification with checkpoints equals 4 single-token steps bit for bit.
fn verify_bits(name: &str) {
    let s = setup(name);
    let ids = s.oracle.ids("ids");
    let prefill = |st: &mut RecurrentState<CpuBackend>, kv: &mut ResidentKv<CpuBackend>| {
        s.model
            .forward(
                &s.b,
                &ids[..30],
                &pos(0..30),
                AttentionPhase::Prefill,
                st,
                kv,
                LogitRows::None,
                None,
            )
            .expect("prefill");
    };
    let (mut st_a, mut kv_a) = (s.state(), s.kv());
    let (mut st_b, mut kv_b) = (s.state(), s.kv());
    prefill(&mut st_a, &mut kv_a);
    prefill(&mut st_b, &mut kv_b);
    let mut cps = Vec::new();
    let a = s
        .model
        .forward(
            &s.b,
            &ids[30..34],
            &pos(30..34),
            AttentionPhase::Verify,
            &mut st_a,
            &mut kv_a,
            LogitRows::All,
            Some(&mut cps),
        )
        .expect("verify");
    assert_eq!(cps.len(), 4);
    let la = s.b.tensor_to_f32(&a.logits.expect("logits")).expect("dl");
    let v = s.model.config().vocab_size;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for i in 0..4 {
        let t = 30 + i;
        let o = s
            .model
            .forward(
                &s.b,
                &ids[t..t + 1],
                &pos(t..t + 1),
                AttentionPhase::Decode,
                &mut st_b,
                &mut kv_b,
                LogitRows::Last,
                None,
            )
            .expect("decode");
        let lb = s.b.tensor_to_f32(&o.logits.expect("logits")).expect("dl");
        assert_eq!(
            bits(&la[i * v..(i + 1) * v]),
            bits(&lb),
            "{name}: logits row {i}"
        );
        for (ca, cb) in cps[i].layers.iter().zip(&st_b.layers) {
            assert_eq!(
                bits(&ca.conv.data),
                bits(&cb.conv.data),
                "{name}: conv state {i}"
            );
            assert_eq!(
                bits(&ca.ssm.data),
                bits(&cb.ssm.data),
                "{name}: ssm state {i}"
            );
        }
    }
    for (ca, cb) in st_a.layers.iter().zip(&st_b.layers) {
        assert_eq!(bits(&ca.ssm.data), bits(&cb.ssm.data));
    }
    // Rolling back to checkpoint 1 and re-running token 32 reproduces row 2.
    st_a.restore_from(&s.b, &cps[1]).expect("restore");
    kv_a.truncate(32);
    let o = s
        .model
        .forward(
            &s.b,
            &ids[32..33],
            &pos(32..33),
            AttentionPhase::Decode,
            &mut st_a,
            &mut kv_a,
            LogitRows::Last,
            None,
        )
        .expect("redo");
    let lr = s.b.tensor_to_f32(&o.logits.expect("logits")).expect("dl");
    assert_eq!(bits(&la[2 * v..3 * v]), bits(&lr));
}

macro_rules! fixture_tests {
    ($m:ident, $name:literal) => {
        mod $m {
            #[test]
            fn full_forward_matches_hf() {
                super::full_forward($name);
            }
            #[test]
            fn prefill_then_decode_matches_hf() {
                super::incremental($name);
            }
            #[test]
            fn mtp_logits_match_hf() {
                super::mtp($name);
            }
            #[test]
            fn mtp_image_rows_replace_placeholder_embeddings() {
                super::mtp_image_rows($name);
            }
            #[test]
            fn greedy_generation_matches_hf() {
                super::generate($name);
            }
            #[test]
            fn checkpointed_verify_equals_single_steps_bitwise() {
                super::verify_bits($name);
            }
        }
    };
}

fixture_tests!(tiny_gqa_f32, "tiny-gqa-f32");
fixture_tests!(tiny_mha_tied_bf16, "tiny-mha-tied-bf16");
fixture_tests!(tiny_bare_text, "tiny-bare-text");

#[test]
fn bad_token_ids_are_typed_errors() {
    let s = setup("tiny-bare-text");
    let v = s.model.config().vocab_size as u32;
    let (mut st, mut kv) = (s.state(), s.kv());
    let r = s.model.forward(
        &s.b,
        &[1, v],
        &pos(0..2),
        AttentionPhase::Prefill,
        &mut st,
        &mut kv,
        LogitRows::Last,
        None,
    );
    assert!(
        matches!(r, Err(kvstream_model_qwen::ModelError::TokenOutOfRange { token, index: 1, .. }) if token == v)
    );
    let r = s.model.forward(
        &s.b,
        &[1],
        &pos(0..2),
        AttentionPhase::Prefill,
        &mut st,
        &mut kv,
        LogitRows::Last,
        None,
    );
    assert!(r.is_err());
}

#[test]
fn missing_tensor_error_names_it() {
    let src = dir("tiny-bare-text");
    let tmp = std::env::temp_dir().join(format!("kvq-missing-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).expect("mkdir");
    std::fs::copy(src.join("config.json"), tmp.join("config.json")).expect("cp");
    // A checkpoint with only the embedding.
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("st");
    let e = st.tensor("model.embed_tokens.weight").expect("embed");
    safetensors::serialize_to_file(
        vec![("model.embed_tokens.weight".to_string(), e)],
        None,
        &tmp.join("model.safetensors"),
    )
    .expect("write");
    let b = CpuBackend::new();
    let err = QwenModel::load(&b, &tmp, &LoadOptions::default())
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.contains("model.norm.weight") && err.contains("[64]"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// KV types other than F32 go through the same path: bf16 and Q8_0/Q4_0 pages stay close to
/// HF (they are lossy, so the bound is loose), and differ from the f32 result.
#[test]
fn lossy_kv_types_stay_close_to_hf() {
    use kvstream_memory_contracts::kv::format::KvType;
    let s = setup("tiny-gqa-f32");
    let ids = s.oracle.ids("ids");
    let (_, want) = s.oracle.f32("logits");
    let c = s.model.config();
    for (k_type, v_type, tol) in [
        (KvType::Bf16, KvType::Bf16, 2e-2f32),
        (KvType::Q8_0, KvType::Q4_0, 2e-1),
    ] {
        let opts = ResidentKvOptions {
            k_type,
            v_type,
            tokens_per_page: 16,
        };
        let mut kv = ResidentKv::new(c, c.n_attention_layers(), opts).expect("kv");
        let mut st = s.state();
        let out = s
            .model
            .forward(
                &s.b,
                &ids,
                &pos(0..ids.len()),
                AttentionPhase::Prefill,
                &mut st,
                &mut kv,
                LogitRows::All,
                None,
            )
            .expect("forward");
        let got = s.b.tensor_to_f32(&out.logits.expect("logits")).expect("dl");
        let d = max_diff(&got, &want);
        eprintln!("KV {k_type}/{v_type}: max |Δlogit| = {d:e}");
        assert!(d <= tol && d > 1e-5, "KV {k_type}/{v_type}: {d}");
    }
}
