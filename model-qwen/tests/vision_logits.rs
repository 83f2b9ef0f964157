//! Multimodal logits against HF on `fixtures/tiny-vl/`: the prompt's `<|image_pad|>` embeddings
//! are replaced by our vision tower's output for images a and b (decoded from the PNGs), the text
//! model runs with our M-RoPE positions, and the greedy continuation decodes at
//! `next_position + i`.

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::ops::{SamplingOps, TensorOps};
use kvstream_model_qwen::rope_index::mrope_positions;
use kvstream_model_qwen::vision::{preprocess, PreprocessorConfig};
use kvstream_model_qwen::{
    AttentionPhase, ImageEmbeds, LoadOptions, LogitRows, ModelError, QwenModel, ResidentKv,
    ResidentKvOptions, VisionTower,
};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
        .join("tiny-vl")
}

fn tensor(bytes: &[u8], key: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
    let st = SafeTensors::deserialize(bytes).expect("oracle");
    let t = st.tensor(key).expect("oracle tensor");
    (t.dtype(), t.shape().to_vec(), t.data().to_vec())
}

fn f32s(bytes: &[u8], key: &str) -> Vec<f32> {
    let (d, _, b) = tensor(bytes, key);
    assert_eq!(d, Dtype::F32);
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn i64s(bytes: &[u8], key: &str) -> Vec<i64> {
    let (d, _, b) = tensor(bytes, key);
    assert_eq!(d, Dtype::I64);
    b.chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            i64::from_le_bytes(a)
        })
        .collect()
}

#[test]
fn multimodal_logits_and_greedy_continuation_match_hf() {
    let oracle = std::fs::read(dir().join("oracle.safetensors")).expect("oracle file");
    let b = CpuBackend::new();
    let model = QwenModel::load(&b, &dir(), &LoadOptions::default()).expect("load");
    let tower = VisionTower::load(&dir()).expect("tower");
    let pcfg = PreprocessorConfig::from_model_dir(&dir()).expect("preprocessor");
    let vc = tower.config().clone();

    let mut rows = Vec::new();
    let mut grids = Vec::new();
    for k in ["a", "b"] {
        let bytes = std::fs::read(dir().join(format!("img_{k}.png"))).expect("png");
        let p = preprocess(&bytes, &pcfg).expect("preprocess");
        rows.extend(tower.encode_on(&CpuBackend::new(), &p).expect("encode"));
        grids.push(p.grid_thw);
    }
    let tokens: Vec<u32> = i64s(&oracle, "ids").iter().map(|&t| t as u32).collect();
    let pos = mrope_positions(&tokens, &grids, &vc, 0).expect("positions");
    let c = model.config();
    let mut kv =
        ResidentKv::new(c, c.n_attention_layers(), ResidentKvOptions::default()).expect("kv");
    let mut st = model.new_recurrent_state(&b).expect("state");
    let img = ImageEmbeds {
        token_id: vc.image_token_id,
        rows: &rows,
    };

    // A wrong row count is a typed error, not a panic.
    let mut st2 = model.new_recurrent_state(&b).expect("state");
    let mut kv2 =
        ResidentKv::new(c, c.n_attention_layers(), ResidentKvOptions::default()).expect("kv");
    let short = ImageEmbeds {
        token_id: vc.image_token_id,
        rows: &rows[..rows.len() - 1],
    };
    assert!(matches!(
        model.forward_multimodal(
            &b,
            &tokens,
            short,
            &pos.positions,
            AttentionPhase::Prefill,
            &mut st2,
            &mut kv2,
            LogitRows::Last
        ),
        Err(ModelError::Input(_))
    ));

    let out = model
        .forward_multimodal(
            &b,
            &tokens,
            img,
            &pos.positions,
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::All,
        )
        .expect("forward");
    let got = b.tensor_to_f32(&out.logits.expect("logits")).expect("dl");
    let want = f32s(&oracle, "logits");
    let d = got
        .iter()
        .zip(&want)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "multimodal logits: max |Δ| = {d:.3e} over {} values",
        want.len()
    );
    assert_eq!(got.len(), want.len());
    assert!(d <= 1e-3, "max |Δlogit| {d}");

    // Greedy decode: positions continue at next_position on all three axes.
    let gen: Vec<u32> = i64s(&oracle, "gen").iter().map(|&t| t as u32).collect();
    let v = c.vocab_size;
    let last = b
        .rows(
            &b.tensor_from_f32(&got[got.len() - v..], &[1, v])
                .expect("up"),
            0,
            1,
        )
        .expect("row");
    let mut next = b.argmax_rows(&last).expect("argmax")[0];
    let mut out_tokens = vec![next];
    for i in 0..gen.len() - tokens.len() - 1 {
        let p = pos.next_position + i as u32;
        let o = model
            .forward(
                &b,
                &[next],
                &[[p; 3]],
                AttentionPhase::Decode,
                &mut st,
                &mut kv,
                LogitRows::Last,
                None,
            )
            .expect("decode");
        next = b.argmax_rows(&o.logits.expect("logits")).expect("argmax")[0];
        out_tokens.push(next);
    }
    assert_eq!(&out_tokens[..], &gen[tokens.len()..], "greedy continuation");
}
