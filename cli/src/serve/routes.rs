//! HTTP routes: OpenAI-compatible completions, models, health and metrics.

use super::api::{ApiError, ChatRequest, CompletionRequest, GenParams, PromptSpec, SamplingFields};
use super::worker::{Event, Job, JobPrompt, WorkerHandle};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;

/// Server settings the routes need.
#[derive(Debug, Clone)]
pub struct AppState {
    pub worker: WorkerHandle,
    pub default_max_tokens: usize,
}

/// Largest request body (images travel inline as data URLs).
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Arc::new(state))
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, axum::Json(e.body())).into_response()
}

async fn not_found() -> Response {
    error_response(&ApiError {
        status: 404,
        message: "unknown route; see /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics".into(),
        kind: "invalid_request_error",
        param: None,
    })
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn request_id(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}-{:x}{:04x}",
        now(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// Sets the cancel flag when dropped before `disarm` (the client went away).
struct CancelOnDrop {
    cancel: Arc<AtomicBool>,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.cancel.store(true, Ordering::SeqCst);
        }
    }
}

fn submit(
    state: &AppState,
    prompt: JobPrompt,
    params: GenParams,
) -> Result<(mpsc::UnboundedReceiver<Event>, Arc<AtomicBool>), ApiError> {
    let shared = &state.worker.shared;
    if !shared.ready.load(Ordering::SeqCst) {
        let msg = match &*shared.load_error.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => format!("the model failed to load: {e}"),
            None => "the model is still loading; retry when /health returns 200".into(),
        };
        return Err(ApiError {
            status: 503,
            message: msg,
            kind: "server_error",
            param: None,
        });
    }
    let (tx, rx) = mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt,
        params,
        events: tx,
        cancel: Arc::clone(&cancel),
    };
    shared.queued.fetch_add(1, Ordering::SeqCst);
    if state.worker.jobs.try_send(job).is_err() {
        shared.queued.fetch_sub(1, Ordering::SeqCst);
        shared.rejected_total.fetch_add(1, Ordering::SeqCst);
        return Err(ApiError {
            status: 429,
            message: "the request queue is full; retry later".into(),
            kind: "rate_limit_exceeded",
            param: None,
        });
    }
    Ok((rx, cancel))
}

/// Parses a request body and validates its sampling fields (shared by both endpoints).
fn parse_validated<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: &Bytes,
    sampling: impl Fn(&T) -> &SamplingFields,
) -> Result<(T, GenParams), ApiError> {
    let req: T = parse(body)?;
    let params = sampling(&req).validate(state.default_max_tokens)?;
    Ok((req, params))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let (req, params) = match parse_validated(&state, &body, |r: &ChatRequest| &r.sampling) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let (messages, images) = match req.messages_and_images() {
        Ok(m) => m,
        Err(e) => return error_response(&e),
    };
    let prompt = if images.is_empty() {
        JobPrompt::Chat(messages)
    } else {
        JobPrompt::ChatImages { messages, images }
    };
    run(&state, Kind::Chat, prompt, params).await
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let (req, params) = match parse_validated(&state, &body, |r: &CompletionRequest| &r.sampling) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let prompt = match req.prompt {
        PromptSpec::Text(t) => JobPrompt::Text(t),
        PromptSpec::Texts(v) if v.len() == 1 => {
            JobPrompt::Text(v.into_iter().next().unwrap_or_default())
        }
        PromptSpec::Texts(_) => {
            return error_response(&ApiError::invalid(
                "exactly one prompt per request is supported",
                Some("prompt"),
            ))
        }
        PromptSpec::Tokens(t) => JobPrompt::Tokens(t),
    };
    run(&state, Kind::Completion, prompt, params).await
}

async fn run(state: &AppState, kind: Kind, prompt: JobPrompt, params: GenParams) -> Response {
    let stream = params.stream;
    let include_usage = params.include_usage;
    let (rx, cancel) = match submit(state, prompt, params) {
        Ok(x) => x,
        Err(e) => return error_response(&e),
    };
    let model = state
        .worker
        .shared
        .model_id
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let id = request_id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    if stream {
        stream_response(kind, rx, cancel, id, model, include_usage)
    } else {
        collect_response(kind, rx, cancel, id, model).await
    }
}

async fn collect_response(
    kind: Kind,
    mut rx: mpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    id: String,
    model: String,
) -> Response {
    let mut guard = CancelOnDrop {
        cancel,
        armed: true,
    };
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Delta(d) => text.push_str(&d),
            Event::Failed(e) => {
                guard.armed = false;
                return error_response(&e);
            }
            Event::Done { finish, usage } => {
                guard.armed = false;
                let choice = match kind {
                    Kind::Chat => {
                        json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish.as_str()})
                    }
                    Kind::Completion => {
                        json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish.as_str()})
                    }
                };
                let object = if kind == Kind::Chat {
                    "chat.completion"
                } else {
                    "text_completion"
                };
                return axum::Json(json!({
                    "id": id, "object": object, "created": now(), "model": model,
                    "choices": [choice], "usage": usage,
                }))
                .into_response();
            }
        }
    }
    guard.armed = false;
    error_response(&ApiError {
        status: 500,
        message: "the engine stopped before finishing the request".into(),
        kind: "server_error",
        param: None,
    })
}

fn chunk(
    kind: Kind,
    id: &str,
    model: &str,
    created: u64,
    delta: Option<&str>,
    role: bool,
    finish: Option<&str>,
) -> Value {
    match kind {
        Kind::Chat => {
            let mut d = serde_json::Map::new();
            if role {
                d.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta {
                d.insert("content".into(), json!(t));
            }
            json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": d, "logprobs": null, "finish_reason": finish}]})
        }
        Kind::Completion => {
            json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": finish}]})
        }
    }
}

fn stream_response(
    kind: Kind,
    rx: mpsc::UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    id: String,
    model: String,
    include_usage: bool,
) -> Response {
    let created = now();
    struct St {
        rx: mpsc::UnboundedReceiver<Event>,
        _guard: CancelOnDrop,
        first: bool,
        done: bool,
        pending: Vec<SseEvent>,
    }
    let st = St {
        rx,
        _guard: CancelOnDrop {
            cancel,
            armed: true,
        },
        first: kind == Kind::Chat,
        done: false,
        pending: Vec::new(),
    };
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let events = futures_util::stream::unfold(st, move |mut st| {
        let id = id.clone();
        let model = model.clone();
        async move {
            loop {
                if let Some(e) = st.pending.pop() {
                    return Some((Ok::<_, Infallible>(e), st));
                }
                if st.done {
                    return None;
                }
                if st.first {
                    st.first = false;
                    return Some((
                        Ok(data(chunk(
                            kind,
                            &id,
                            &model,
                            created,
                            Some(""),
                            true,
                            None,
                        ))),
                        st,
                    ));
                }
                match st.rx.recv().await {
                    Some(Event::Delta(d)) => {
                        return Some((
                            Ok(data(chunk(
                                kind,
                                &id,
                                &model,
                                created,
                                Some(&d),
                                false,
                                None,
                            ))),
                            st,
                        ));
                    }
                    Some(Event::Done { finish, usage }) => {
                        st.done = true;
                        st._guard.armed = false;
                        // Emitted in reverse order (pending is a stack).
                        st.pending.push(SseEvent::default().data("[DONE]"));
                        if include_usage {
                            st.pending.push(data(json!({"id": id, "object": if kind == Kind::Chat {"chat.completion.chunk"} else {"text_completion"}, "created": created, "model": model, "choices": [], "usage": usage})));
                        }
                        let fin = match kind {
                            Kind::Chat => chunk(
                                kind,
                                &id,
                                &model,
                                created,
                                None,
                                false,
                                Some(finish.as_str()),
                            ),
                            Kind::Completion => chunk(
                                kind,
                                &id,
                                &model,
                                created,
                                Some(""),
                                false,
                                Some(finish.as_str()),
                            ),
                        };
                        return Some((Ok(data(fin)), st));
                    }
                    Some(Event::Failed(e)) => {
                        st.done = true;
                        st._guard.armed = false;
                        st.pending.push(SseEvent::default().data("[DONE]"));
                        return Some((Ok(data(e.body())), st));
                    }
                    None => {
                        st.done = true;
                        continue;
                    }
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let model = state
        .worker
        .shared
        .model_id
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    axum::Json(json!({"object": "list", "data": [{"id": model, "object": "model", "created": now(), "owned_by": "kvstream"}]})).into_response()
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let shared = &state.worker.shared;
    if shared.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, axum::Json(json!({"status": "ok"}))).into_response()
    } else if let Some(e) = &*shared.load_error.lock().unwrap_or_else(|p| p.into_inner()) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "error", "error": e})),
        )
            .into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "loading"})),
        )
            .into_response()
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let s = &state.worker.shared;
    let mut out = String::new();
    out.push_str("# HELP kvstream_queue_depth Requests waiting for the engine.\n# TYPE kvstream_queue_depth gauge\n");
    out.push_str(&format!(
        "kvstream_queue_depth {}\n",
        s.queued.load(Ordering::SeqCst)
    ));
    out.push_str("# HELP kvstream_requests_total Requests the engine has run.\n# TYPE kvstream_requests_total counter\n");
    out.push_str(&format!(
        "kvstream_requests_total {}\n",
        s.requests_total.load(Ordering::SeqCst)
    ));
    out.push_str("# HELP kvstream_rejected_total Requests refused with 429.\n# TYPE kvstream_rejected_total counter\n");
    out.push_str(&format!(
        "kvstream_rejected_total {}\n",
        s.rejected_total.load(Ordering::SeqCst)
    ));
    out.push_str(
        "# HELP kvstream_ready 1 when the model is loaded.\n# TYPE kvstream_ready gauge\n",
    );
    out.push_str(&format!(
        "kvstream_ready {}\n",
        u8::from(s.ready.load(Ordering::SeqCst))
    ));
    out.push_str(&s.engine_metrics.lock().unwrap_or_else(|p| p.into_inner()));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
