//! `kvstream serve` over raw HTTP on loopback: SSE framing, the 429 queue limit, cancellation on
//! disconnect, error shapes. (The official `openai` client is exercised by
//! tests/server/test_openai_client.py, run by .ci/run.)

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-gqa-f32")
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

fn start(queue: usize) -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let child = Command::new(env!("CARGO_BIN_EXE_kvstream"))
        .args(["serve", "--model"])
        .arg(fixture())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--queue", &queue.to_string()])
        .args([
            "--kv-arena",
            "8MiB",
            "--kv-page-tokens",
            "16",
            "--ctx-size",
            "4096",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn kvstream serve");
    let s = Server { child, port };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((status, _)) = request(s.port, "GET", "/health", "") {
            if status == 200 {
                break;
            }
        }
        assert!(Instant::now() < deadline, "server never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
    s
}

fn send(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(60)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    Ok(s)
}

fn request(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = send(port, method, path, body)?;
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

fn sse_data_lines(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

fn completion_text(s: &str) -> Option<serde_json::Value> {
    serde_json::from_str::<serde_json::Value>(s)
        .map(|v| v["choices"][0]["text"].clone())
        .ok()
}

#[test]
fn sse_framing_errors_queue_limit_and_cancellation() {
    let server = start(1);
    let port = server.port;

    // SSE framing: role chunk first, content chunks, a finish chunk, usage, then [DONE].
    let (status, body) = request(
        port,
        "POST",
        "/v1/chat/completions",
        r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":6,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}"#,
    )
    .expect("stream request");
    assert_eq!(status, 200);
    let data = sse_data_lines(&body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("chunk is JSON"))
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let usage = chunks.last().expect("usage chunk");
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    assert!(chunks
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));

    // Error shapes: 400 with an OpenAI error object naming the parameter.
    let (status, body) = request(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"a","max_tokens":-3}"#,
    )
    .expect("req");
    assert_eq!(status, 400);
    let v: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(v["error"]["param"], "max_tokens");
    let (status, _) = request(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"a","temperature":"hot"}"#,
    )
    .expect("req");
    assert_eq!(status, 400, "wrong type");
    let (status, _) = request(port, "GET", "/nope", "").expect("req");
    assert_eq!(status, 404);

    // Queue limit: one request running, one queued, the next gets 429.
    let long =
        r#"{"prompt":"a","max_tokens":3000,"temperature":0,"stream":true,"ignore_eos":true}"#;
    let running = send(port, "POST", "/v1/completions", long).expect("running");
    let mut first = String::new();
    let mut reader = BufReader::new(running.try_clone().expect("clone"));
    reader.read_line(&mut first).expect("status line");
    assert!(first.contains("200"), "{first}");
    // The status line comes as soon as the request is queued; its first SSE event only once the
    // engine runs it. Until then a second request would find the queue full (429).
    let mut line = String::new();
    while !line.starts_with("data:") {
        line.clear();
        let n = reader.read_line(&mut line).expect("first event");
        assert!(n > 0, "the running stream ended before its first event");
    }
    let queued = send(port, "POST", "/v1/completions", long).expect("queued");
    // Wait until the server has queued it (a fixed sleep flaked under heavy parallel load).
    let t = Instant::now();
    loop {
        let (_, metrics) = request(port, "GET", "/metrics", "").expect("metrics");
        if metrics.contains("kvstream_queue_depth 1") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "second request never queued: {metrics}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, body) = request(
        port,
        "POST",
        "/v1/completions",
        r#"{"prompt":"a","max_tokens":2}"#,
    )
    .expect("req");
    assert_eq!(status, 429, "{body}");
    let (_, metrics) = request(port, "GET", "/metrics", "").expect("metrics");
    assert!(metrics.contains("kvstream_rejected_total 1"), "{metrics}");

    // Cancellation: both long streams disconnect; the engine must become free quickly.
    drop(running);
    drop(queued);
    let t = Instant::now();
    let fresh = r#"{"prompt":"Once upon","max_tokens":5,"temperature":0}"#;
    // The queued request may still hold the queue slot until the worker notices its client is
    // gone (at its first token), so retry 429s like a client would.
    let (status, a) = loop {
        let (status, body) = request(port, "POST", "/v1/completions", fresh).expect("after cancel");
        if status != 429 || t.elapsed() > Duration::from_secs(30) {
            break (status, body);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status, 200, "{a}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "cancelled generations kept running"
    );
    let (_, b) = request(port, "POST", "/v1/completions", fresh).expect("again");
    assert_eq!(
        completion_text(&a),
        completion_text(&b),
        "the engine is back in a clean state"
    );
    let (status, _) = request(port, "GET", "/health", "").expect("health");
    assert_eq!(status, 200);
}
