//! `kvstream serve` with images over raw HTTP on loopback: OpenAI `image_url` parts as data URLs
//! and local paths (one and several per message) return 200 with content; malformed base64,
//! non-image bytes, unsupported media types and http URLs are 400s after which the server
//! answers the next request; a model without a vision tower answers images with a 400.
//!
//! The model is `fixtures/tiny-vl` plus a word-level tokenizer and a chat template written here
//! (the fixture has no tokenizer; its vocabulary is 256 ids with the vision specials at
//! 248..=251).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures")
}

/// tiny-vl + tokenizer.json (WordLevel: `w{i}` ↔ id i) + a ChatML template.
fn model_dir() -> PathBuf {
    let out = std::env::temp_dir().join(format!("kvstream-serve-vl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).expect("mkdir");
    let src = fixtures().join("tiny-vl");
    for f in [
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(src.join(f), out.join(f)).expect("copy fixture file");
    }
    let special = [
        (0, "<|endoftext|>"),
        (246, "<|im_start|>"),
        (247, "<|im_end|>"),
        (248, "<|vision_start|>"),
        (249, "<|vision_end|>"),
        (250, "<|image_pad|>"),
        (251, "<|video_pad|>"),
    ];
    let added: Vec<serde_json::Value> = special
        .iter()
        .map(|(id, c)| {
            serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 1.into());
    for (w, id) in [("user", 2), ("assistant", 3), ("describe", 4), ("and", 5)] {
        vocab.insert(w.into(), id.into());
    }
    for id in (6..246).chain(252..256) {
        vocab.insert(format!("w{id}"), id.into());
    }
    // Added tokens keep their ids only when the model's vocabulary holds them too.
    for (id, c) in special {
        vocab.insert(c.into(), id.into());
    }
    let tok = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    std::fs::write(out.join("tokenizer.json"), tok.to_string()).expect("tokenizer");
    let tmpl = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    std::fs::write(
        out.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": tmpl, "eos_token": "<|endoftext|>"}).to_string(),
    )
    .expect("tokenizer config");
    out
}

struct Server {
    child: Child,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(model: &Path) -> Server {
    start_with(
        model,
        &[
            "--kv-arena",
            "8MiB",
            "--kv-page-tokens",
            "16",
            "--ctx-size",
            "256",
        ],
    )
}

fn start_with(model: &Path, engine_args: &[&str]) -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let child = Command::new(env!("CARGO_BIN_EXE_kvstream"))
        .args(["serve", "--model"])
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(engine_args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvstream serve");
    let s = Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, _)) = request(s.port, "GET", "/health", "") {
            break;
        }
        assert!(Instant::now() < deadline, "server never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
    s
}

fn request(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut raw = String::new();
    s.read_to_string(&mut raw)?;
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = raw
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

fn b64(b: &[u8]) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in b.chunks(3) {
        let v = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            s.push(if k <= c.len() {
                A[(v >> (18 - 6 * k) & 63) as usize] as char
            } else {
                '='
            });
        }
    }
    s
}

fn data_url(file: &str) -> String {
    let bytes = std::fs::read(fixtures().join("tiny-vl").join(file)).expect("image");
    let mime = match file.rsplit('.').next() {
        Some("jpg") => "image/jpeg",
        Some("webp") => "image/webp",
        _ => "image/png",
    };
    format!("data:{mime};base64,{}", b64(&bytes))
}

/// A chat body with `urls` as image parts around a text part.
fn chat(urls: &[String]) -> String {
    let mut parts: Vec<serde_json::Value> = urls
        .iter()
        .map(|u| serde_json::json!({"type": "image_url", "image_url": {"url": u}}))
        .collect();
    parts.push(serde_json::json!({"type": "text", "text": "describe"}));
    serde_json::json!({
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 5, "temperature": 0, "ignore_eos": true
    })
    .to_string()
}

fn ok_content(port: u16, body: &str) -> serde_json::Value {
    let (status, resp) = request(port, "POST", "/v1/chat/completions", body).expect("request");
    assert_eq!(status, 200, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).expect("json");
    let content = v["choices"][0]["message"]["content"]
        .as_str()
        .expect("content string");
    assert!(!content.is_empty(), "{resp}");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{resp}");
    v
}

fn bad_request(port: u16, body: &str, needle: &str) {
    let (status, resp) = request(port, "POST", "/v1/chat/completions", body).expect("request");
    assert_eq!(status, 400, "{resp}");
    let v: serde_json::Value = serde_json::from_str(&resp).expect("error json");
    let msg = v["error"]["message"].as_str().expect("message");
    assert!(
        msg.to_lowercase().contains(needle),
        "`{msg}` should mention `{needle}`"
    );
}

#[test]
fn image_requests_and_their_errors() {
    let dir = model_dir();
    let server = start(&dir);
    let port = server.port;

    // One image as a data URL: 200 with content; the prompt holds its 4 image tokens.
    let one = ok_content(port, &chat(&[data_url("img_a.png")]));
    let p1 = one["usage"]["prompt_tokens"].as_u64().expect("usage");
    // Two images in one message (a: 4 tokens, b: 6 tokens) and a local file path (JPEG).
    let two = ok_content(port, &chat(&[data_url("img_a.png"), data_url("img_b.png")]));
    let p2 = two["usage"]["prompt_tokens"].as_u64().expect("usage");
    assert_eq!(p2, p1 + 6 + 2, "image b adds 6 pads + start/end");
    let jpg = fixtures().join("tiny-vl/img_e.jpg");
    ok_content(port, &chat(&[format!("file://{}", jpg.display())]));
    ok_content(port, &chat(&[jpg.display().to_string()]));

    // Errors are 400s with OpenAI's shape, and the server answers the next request.
    bad_request(
        port,
        &chat(&["data:image/png;base64,iVBOR$$w0KGgo".into()]),
        "base64",
    );
    bad_request(
        port,
        &chat(&[format!(
            "data:image/png;base64,{}",
            b64(b"hello, not an image")
        )]),
        "image",
    );
    let png = std::fs::read(fixtures().join("tiny-vl/img_a.png")).expect("png");
    bad_request(
        port,
        &chat(&[format!(
            "data:image/png;base64,{}",
            b64(&png[..png.len() / 3])
        )]),
        "image",
    );
    bad_request(
        port,
        &chat(&["data:image/gif;base64,R0lGODlh".into()]),
        "unsupported",
    );
    bad_request(
        port,
        &chat(&["https://example.com/cat.png".into()]),
        "not fetched",
    );
    bad_request(port, &chat(&["/no/such/image.png".into()]), "cannot read");
    let again = ok_content(port, &chat(&[data_url("img_a.png")]));
    assert_eq!(
        again["choices"][0]["message"]["content"], one["choices"][0]["message"]["content"],
        "greedy output is reproducible after errors"
    );
    let (status, resp) = request(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"describe"}],"max_tokens":3,"ignore_eos":true}"#,
    )
    .expect("text request");
    assert_eq!(status, 200, "{resp}");
    drop(server);

    // An arena too small for the tower's loan: a 400 naming the bytes, then text still works;
    // with the weights kept resident the loan shrinks to the workspace and the image fits.
    let small = [
        "--kv-arena",
        "512KiB",
        "--kv-page-tokens",
        "16",
        "--prefill-chunk",
        "16",
        "--ctx-size",
        "256",
    ];
    let server = start_with(&dir, &small);
    bad_request(server.port, &chat(&[data_url("img_b.png")]), "arena");
    let (status, resp) = request(
        server.port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"describe"}],"max_tokens":3,"ignore_eos":true}"#,
    )
    .expect("text request");
    assert_eq!(status, 200, "{resp}");
    drop(server);
    let mut resident = small.to_vec();
    resident.push("--vision-keep-resident");
    let server = start_with(&dir, &resident);
    ok_content(server.port, &chat(&[data_url("img_b.png")]));
    // The worker refreshes the metrics right after the response.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, metrics) = request(server.port, "GET", "/metrics", "").expect("metrics");
        if metrics.contains("kvstream_vision_images_total 1") {
            assert!(metrics.contains("kvstream_vision_resident_weight_bytes "));
            assert!(!metrics.contains("kvstream_vision_resident_weight_bytes 0\n"));
            break;
        }
        assert!(Instant::now() < deadline, "{metrics}");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);

    // A model without a vision tower: images are a 400, text still works.
    let text_model = fixtures().join("tiny-gqa-f32");
    let server = start(&text_model);
    bad_request(
        server.port,
        &chat(&[data_url("img_a.png")]),
        "no vision tower",
    );
    let (status, resp) = request(
        server.port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}"#,
    )
    .expect("text request");
    assert_eq!(status, 200, "{resp}");
}
