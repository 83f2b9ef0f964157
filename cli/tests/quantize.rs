//! End-to-end tests of quantized weights in the `kvstream` binary: `quantize` then `generate`,
//! the `--weights` flag on loading commands, and the memory plan of `inspect` on a directory
//! that holds only the 27B `config.json`.

use std::path::PathBuf;
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

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tmp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("kvstream-q-{name}-{}", std::process::id()))
}

fn generate_tokens(model: &str, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "generate",
        "--model",
        model,
        "--prompt",
        "Once upon a time",
        "--n-predict",
        "24",
        "--ignore-eos",
        "--json",
        "--kv-page-tokens",
        "16",
    ];
    args.extend_from_slice(extra);
    let o = kvstream(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json output");
    assert!(
        v["weights"]["device_bytes"].as_u64().unwrap_or(0) > 0,
        "{v}"
    );
    if extra.contains(&"q4") {
        assert_eq!(v["weights"]["policy"], "q4_g128 (head q8_0)");
        assert!(v["weights"]["quantized"].as_u64().unwrap_or(0) > 0, "{v}");
    }
    v["tokens"].clone()
}

#[test]
fn quantized_directory_generates_what_quantize_at_load_generates() {
    let out = tmp("demo-q4");
    let out_s = out.to_str().expect("utf-8");
    let o = kvstream(&[
        "quantize",
        "--in",
        "models/kvstream-demo-tiny",
        "--out",
        out_s,
        "--weights",
        "q4_g128",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let report = stdout(&o);
    assert!(
        report.contains("quantized") && report.contains("kept"),
        "{report}"
    );
    assert!(report.contains("q4_g128 (head q8_0)"), "{report}");
    assert!(out.join("config.json").is_file() && out.join("tokenizer.json").is_file());
    let saved = generate_tokens(out_s, &[]);
    let at_load = generate_tokens("models/kvstream-demo-tiny", &["--weights", "q4"]);
    assert_eq!(saved.as_array().map(Vec::len), Some(24));
    assert_eq!(saved, at_load);
    // Asking again for the format the directory already holds changes nothing.
    let again = generate_tokens(out_s, &["--weights", "q4_g128", "--kv-max-pool-pages", "3"]);
    assert_eq!(saved, again);
    std::fs::remove_dir_all(&out).ok();
}

/// q4_nl_g128 end to end: `quantize` writes it (format name in config.json and in the tensor
/// metadata), the directory generates what quantize-at-load generates, and `inspect` plans the
/// same bytes as q4_g128.
#[test]
fn q4_nl_directory_generates_what_quantize_at_load_generates() {
    let out = tmp("demo-q4nl");
    let out_s = out.to_str().expect("utf-8");
    let o = kvstream(&[
        "quantize",
        "--in",
        "models/kvstream-demo-tiny",
        "--out",
        out_s,
        "--weights",
        "q4_nl_g128",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("q4_nl_g128 (head q8_0)"),
        "{}",
        stdout(&o)
    );
    let cfg = std::fs::read_to_string(out.join("config.json")).expect("config");
    assert!(cfg.contains("\"q4_nl_g128\""), "{cfg}");
    let st = std::fs::read(out.join("model.safetensors")).expect("weights");
    let head = String::from_utf8_lossy(&st[..st.len().min(1 << 16)]).into_owned();
    assert!(head.contains("q4_nl_g128:["), "metadata names the format");
    let saved = generate_tokens(out_s, &[]);
    let at_load = generate_tokens("models/kvstream-demo-tiny", &["--weights", "q4_nl"]);
    assert_eq!(saved.as_array().map(Vec::len), Some(24));
    assert_eq!(saved, at_load);
    std::fs::remove_dir_all(&out).ok();
    // The memory plan: the q4_g128 bytes.
    let plan = |w: &str| {
        let o = kvstream(&[
            "inspect",
            "--synthetic",
            "qwen3.8-27b",
            "--weights",
            w,
            "--kv-arena",
            "2240MiB",
            "--device-memory",
            "16GiB",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let (q4, nl) = (plan("q4_g128"), plan("q4_nl_g128"));
    assert!(nl.contains("fits in 16 GiB"), "{nl}");
    // The numbers of the plan table (the labels name the format).
    let bytes = |s: &str| {
        s.lines()
            .skip_while(|l| !l.starts_with("device memory plan"))
            .take_while(|l| !l.starts_with("verdict"))
            .map(|l| {
                l.replace("q4_nl_g128", "")
                    .replace("q4_g128", "")
                    .split(|c: char| !c.is_ascii_digit() && c != '.')
                    .filter(|t| !t.is_empty())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    assert!(bytes(&nl).len() > 5, "{nl}");
    assert_eq!(bytes(&nl), bytes(&q4));
}

#[test]
fn inspect_plans_the_27b_from_its_config_alone() {
    let dir = tmp("27b-config");
    let dir_s = dir.to_str().expect("utf-8");
    let o = kvstream(&[
        "synth",
        "--geometry",
        "qwen3.8-27b",
        "--config-only",
        "--out",
        dir_s,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let files: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(files, vec![std::ffi::OsString::from("config.json")]);
    let plan = |model: &[&str], weights: &str| {
        let mut args = vec!["inspect"];
        args.extend_from_slice(model);
        args.extend_from_slice(&[
            "--weights",
            weights,
            "--kv-arena",
            "2240MiB",
            "--device-memory",
            "16GiB",
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q4_0",
        ]);
        let o = kvstream(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let q4 = plan(&["--model", dir_s], "q4_g128");
    assert!(q4.contains("fits in 16 GiB"), "{q4}");
    let head = q4
        .lines()
        .find(|l| l.contains("weights: lm_head"))
        .unwrap_or("");
    assert!(head.contains("q8_0"), "{q4}");
    assert!(q4.contains("Decode"), "arena plan too: {q4}");
    let bf16 = plan(&["--model", dir_s], "bf16");
    assert!(bf16.contains("does not fit in 16 GiB: short by"), "{bf16}");
    // The named geometry gives the same plan without any directory.
    let synth = plan(&["--synthetic", "qwen3.8-27b"], "q4");
    let table = |s: &str| {
        s.lines()
            .skip_while(|l| !l.starts_with("device memory plan"))
            .take_while(|l| !l.starts_with("verdict"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert!(table(&q4).len() > 5, "{q4}");
    assert_eq!(table(&q4), table(&synth));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_weight_formats_are_clear_errors() {
    for cmd in [
        vec![
            "generate",
            "--model",
            "models/kvstream-demo-tiny",
            "--prompt",
            "hi",
        ],
        vec!["inspect", "--synthetic", "tiny"],
        vec!["bench", "--synthetic", "tiny"],
    ] {
        let mut args = cmd.clone();
        args.extend_from_slice(&["--weights", "q3_k"]);
        let o = kvstream(&args);
        assert!(!o.status.success(), "{cmd:?}");
        let e = stderr(&o);
        assert!(
            e.contains("q3_k") && e.contains("q4_g128") && e.contains("fp8_e4m3"),
            "{cmd:?}: {e}"
        );
    }
    let o = kvstream(&[
        "quantize",
        "--in",
        "models/kvstream-demo-tiny",
        "--out",
        "/tmp/kvstream-never-written",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--weights"), "{}", stderr(&o));
    assert!(!std::path::Path::new("/tmp/kvstream-never-written").exists());
}
