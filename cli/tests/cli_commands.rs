//! End-to-end tests of the `kvstream` binary on the fixtures: logits against HF, streaming
//! generation, speculative decoding, inspect, and clear errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kvstream(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvstream"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run kvstream")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn read_f32(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).expect("read safetensors");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let t = st.tensor(name).expect("tensor");
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (t.shape().to_vec(), v)
}

fn oracle_ids(n: usize) -> Vec<u32> {
    let bytes =
        std::fs::read(root().join("fixtures/tiny-gqa-f32/oracle.safetensors")).expect("oracle");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let t = st.tensor("ids").expect("ids");
    t.data()
        .chunks_exact(8)
        .take(n)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u32)
        .collect()
}

#[test]
fn logits_and_mtp_logits_match_hf_through_a_streaming_arena() {
    let dir = std::env::temp_dir().join(format!("kvstream-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let out = dir.join("logits.safetensors");
    let ids = oracle_ids(64);
    let list = ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let o = kvstream(&[
        "logits",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--tokens",
        &list,
        "--out",
        out.to_str().expect("utf8"),
        "--mtp",
        "--kv-page-tokens",
        "16",
        "--kv-max-pool-pages",
        "3",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (shape, got) = read_f32(&out, "logits");
    assert_eq!(shape, vec![64, 512]);
    let oracle = root().join("fixtures/tiny-gqa-f32/oracle.safetensors");
    let (_, want) = read_f32(&oracle, "logits");
    let max = got
        .iter()
        .zip(&want[..64 * 512])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(max < 1e-3, "max |Δlogit| = {max}");
    let (mshape, mgot) = read_f32(&out, "mtp_logits");
    assert_eq!(mshape, vec![63, 512]);
    let (_, mwant) = read_f32(&oracle, "mtp_logits");
    // Oracle row i of mtp_logits uses hidden i and token i+1 over the 320-token sequence; the
    // first 63 rows depend only on the first 64 tokens (causal).
    let mmax = mgot
        .iter()
        .zip(&mwant[..63 * 512])
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(mmax < 1e-3, "max |Δ mtp logit| = {mmax}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_inputs_exit_non_zero_with_clear_messages() {
    let o = kvstream(&[
        "logits",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--tokens",
        "1,99999",
        "--out",
        "/tmp/never.safetensors",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("99999"), "{}", stderr(&o));
    assert!(
        !Path::new("/tmp/never.safetensors").exists(),
        "nothing half-written"
    );

    let o = kvstream(&[
        "generate",
        "--model",
        "/nonexistent/model",
        "--prompt",
        "hi",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("/nonexistent/model"), "{}", stderr(&o));

    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--prompt",
        "hi",
        "--kv-arena",
        "4KiB",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing"), "{}", stderr(&o));

    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--prompt",
        "hi",
        "--ctx-size",
        "100000000",
    ]);
    assert!(!o.status.success());

    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--prompt",
        "hi",
        "--cache-type-k",
        "q5_1",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("q5_1"), "{}", stderr(&o));
}

fn generate_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "--model",
        "models/kvstream-demo-tiny",
        "--prompt",
        "Once upon a time",
        "--n-predict",
        "40",
        "--json",
        "--kv-page-tokens",
        "16",
    ];
    args.extend_from_slice(extra);
    let o = kvstream(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).expect("json output")
}

#[test]
fn streaming_and_speculative_generation_equal_the_resident_run() {
    let resident = generate_json(&[]);
    let streamed = generate_json(&["--kv-max-pool-pages", "3"]);
    let spec = generate_json(&[
        "--kv-max-pool-pages",
        "4",
        "--spec-type",
        "draft-mtp",
        "--spec-draft-n-max",
        "3",
    ]);
    assert_eq!(resident["tokens"], streamed["tokens"]);
    assert_eq!(resident["tokens"], spec["tokens"]);
    assert!(
        streamed["stats"]["kv"]["h2d_ring_bytes"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "ring traffic"
    );
    let text = resident["text"].as_str().unwrap_or("");
    assert!(
        text.split_whitespace().count() > 3,
        "demo model prints words: {text}"
    );
    let rate = spec["stats"]["spec"]["acceptance_rate"]
        .as_f64()
        .unwrap_or(0.0);
    assert!(rate >= 0.5, "MTP acceptance {rate}");
}

#[test]
fn inspect_lists_capabilities_and_the_arena_plan() {
    let o = kvstream(&[
        "inspect",
        "--backend",
        "cpu",
        "--model",
        "fixtures/tiny-gqa-f32",
        "--kv-arena",
        "16MiB",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("q8_0"), "{s}");
    assert!(s.contains("Prefill") && s.contains("Decode"), "{s}");
}

fn vl_oracle_ids(key: &str) -> Vec<u32> {
    let bytes = std::fs::read(root().join("fixtures/tiny-vl/oracle.safetensors")).expect("oracle");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    st.tensor(key)
        .expect("tensor")
        .data()
        .chunks_exact(8)
        .map(|c| {
            let v = i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
            u32::try_from(v).expect("id")
        })
        .collect()
}

/// `generate --image A --image B` on the tiny VL fixture: each `<|image_pad|>` of the prompt
/// stands for one image; the greedy continuation equals HF's. Images on a text-only model and
/// a prompt with the wrong number of placeholders are clear errors.
#[test]
fn generate_with_images_matches_the_hf_greedy_continuation() {
    let (ids, gen) = (vl_oracle_ids("ids"), vl_oracle_ids("gen"));
    let want = &gen[ids.len()..];
    let pad = 250u32; // image_token_id of the fixture
    let mut collapsed: Vec<u32> = Vec::new();
    for &t in &ids {
        if !(t == pad && collapsed.last() == Some(&pad)) {
            collapsed.push(t);
        }
    }
    assert_eq!(collapsed.iter().filter(|&&t| t == pad).count(), 2);
    let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    let prompt = list(&collapsed);
    let n = want.len().to_string();
    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-vl",
        "--prompt-tokens",
        &prompt,
        "--image",
        "fixtures/tiny-vl/img_a.png",
        "--image",
        "fixtures/tiny-vl/img_b.png",
        "--n-predict",
        &n,
        "--ignore-eos",
        "--json",
        "--kv-page-tokens",
        "16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let got: Vec<u32> = v["tokens"]
        .as_array()
        .expect("tokens")
        .iter()
        .map(|t| t.as_u64().expect("id") as u32)
        .collect();
    assert_eq!(got, want, "greedy continuation after two images vs HF");
    let prompt_tokens: Vec<u64> = v["prompt_tokens"]
        .as_array()
        .expect("prompt token ids")
        .iter()
        .filter_map(serde_json::Value::as_u64)
        .collect();
    assert_eq!(
        prompt_tokens,
        ids.iter().map(|&t| u64::from(t)).collect::<Vec<_>>(),
        "each placeholder expanded to its image's token count"
    );

    // One placeholder for two images: a clear error naming the rule.
    let one = list(&collapsed[..collapsed.iter().position(|&t| t == pad).expect("pad") + 1]);
    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-vl",
        "--prompt-tokens",
        &one,
        "--image",
        "fixtures/tiny-vl/img_a.png",
        "--image",
        "fixtures/tiny-vl/img_b.png",
        "--json",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("<|image_pad|>"), "{}", stderr(&o));
    // A text-only model.
    let o = kvstream(&[
        "generate",
        "--model",
        "fixtures/tiny-bare-text",
        "--prompt-tokens",
        "1,2,3",
        "--image",
        "fixtures/tiny-vl/img_a.png",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no vision tower"), "{}", stderr(&o));
}
