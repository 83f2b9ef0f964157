//! The engine thread: one sequence at a time, a bounded queue in front of it.
//!
//! HTTP handlers never touch the engine. They submit a [`Job`] through a bounded channel (a full
//! queue is a 429) and read [`Event`]s back. The worker owns the engine on a dedicated thread,
//! loads the model there (health is 503 until it is ready), and checks the job's cancel flag at
//! every token, so a client that disconnects stops its generation at the next token.

use super::api::{ApiError, GenParams, Usage};
use super::images::{load_image, ImageRef};
use super::text_stream::TextStream;
use kvstream_runtime::ImageInput;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length | Finish::Cancelled => "length",
        }
    }
}

/// What a finished generation reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub completion_tokens: Vec<u32>,
    pub cached_tokens: usize,
    pub hit_eos: bool,
}

/// Decodes token ids to text.
pub type Detokenizer = Arc<dyn Fn(&[u32]) -> Result<String, String> + Send + Sync>;

/// The engine as the server sees it.
pub trait Generator: 'static {
    fn model_id(&self) -> String;
    fn context_size(&self) -> usize;
    fn render_chat(&self, messages: &[(String, String)]) -> Result<Vec<u32>, String>;
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, String>;
    /// A detokeniser usable while `generate` borrows the engine.
    fn detokenizer(&self) -> Detokenizer;
    /// Generates up to `params.max_tokens` tokens after `prompt`; `on_token` returns false to
    /// stop. Must leave the engine in a clean state whatever happens.
    fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Outcome, String>;
    /// Prometheus text lines of the engine's counters.
    fn metrics_text(&self) -> String;
    /// Decodes and preprocesses one image. Default: the model takes no images (400).
    fn prepare_image(&mut self, _bytes: &[u8]) -> Result<ImageInput, ApiError> {
        Err(no_images())
    }
    /// Tokens of chat messages holding one image placeholder per image, each expanded to the
    /// image's token count. Default: the model takes no images (400).
    fn render_chat_with_images(
        &mut self,
        _messages: &[(String, String)],
        _images: &[ImageInput],
    ) -> Result<Vec<u32>, ApiError> {
        Err(no_images())
    }
    /// Like `generate` with the prompt's images (errors carry their HTTP status: 4xx for
    /// images that cannot be served, 500 for engine failures). Default: no images (400).
    fn generate_with_images(
        &mut self,
        _prompt: &[u32],
        _images: &[ImageInput],
        _params: &GenParams,
        _on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Outcome, ApiError> {
        Err(no_images())
    }
}

/// The 400 for an image sent to a model without a vision tower.
pub fn no_images() -> ApiError {
    ApiError::invalid(
        "this model has no vision tower: image inputs are not supported; send text only",
        Some("messages"),
    )
}

/// The prompt of a job.
#[derive(Debug, Clone)]
pub enum JobPrompt {
    Chat(Vec<(String, String)>),
    /// Chat messages whose contents hold one image placeholder per image, and the images.
    ChatImages {
        messages: Vec<(String, String)>,
        images: Vec<ImageRef>,
    },
    Text(String),
    Tokens(Vec<u32>),
}

/// Streamed back to the handler.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Delta(String),
    Done { finish: Finish, usage: Usage },
    Failed(ApiError),
}

/// A queued request.
#[derive(Debug)]
pub struct Job {
    pub prompt: JobPrompt,
    pub params: GenParams,
    pub events: mpsc::UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
}

/// State shared between the HTTP side and the worker.
#[derive(Debug, Default)]
pub struct Shared {
    pub ready: AtomicBool,
    pub load_error: Mutex<Option<String>>,
    pub queued: AtomicUsize,
    pub model_id: Mutex<String>,
    pub engine_metrics: Mutex<String>,
    pub requests_total: AtomicUsize,
    pub rejected_total: AtomicUsize,
}

/// Handle used by the HTTP side.
#[derive(Debug, Clone)]
pub struct WorkerHandle {
    pub jobs: mpsc::Sender<Job>,
    pub shared: Arc<Shared>,
}

/// Starts the engine thread. `load` runs on it; `queue` bounds waiting jobs.
pub fn spawn<G, F>(load: F, queue: usize) -> WorkerHandle
where
    G: Generator,
    F: FnOnce() -> Result<G, String> + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Job>(queue.max(1));
    let shared = Arc::new(Shared::default());
    let s = Arc::clone(&shared);
    std::thread::Builder::new()
        .name("kvstream-engine".into())
        .spawn(move || {
            let mut engine = match load() {
                Ok(e) => e,
                Err(e) => {
                    tracing::error!(error = %e, "model load failed");
                    *s.load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
            };
            *s.model_id.lock().unwrap_or_else(|p| p.into_inner()) = engine.model_id();
            *s.engine_metrics.lock().unwrap_or_else(|p| p.into_inner()) = engine.metrics_text();
            s.ready.store(true, Ordering::SeqCst);
            tracing::info!("model ready");
            while let Some(job) = rx.blocking_recv() {
                s.queued.fetch_sub(1, Ordering::SeqCst);
                run_job(&mut engine, job, &s);
                *s.engine_metrics.lock().unwrap_or_else(|p| p.into_inner()) = engine.metrics_text();
            }
        })
        .map(|_| ())
        .unwrap_or_else(|e| tracing::error!(error = %e, "cannot start engine thread"));
    WorkerHandle { jobs: tx, shared }
}

fn run_job<G: Generator>(engine: &mut G, job: Job, shared: &Shared) {
    let send = |e: Event| job.events.send(e).is_ok();
    if job.cancel.load(Ordering::SeqCst) {
        return;
    }
    let prepared = match &job.prompt {
        JobPrompt::Chat(m) => engine
            .render_chat(m)
            .map(|p| (p, Vec::new()))
            .map_err(|e| ApiError::invalid(e, None)),
        JobPrompt::ChatImages { messages, images } => prepare_images(engine, messages, images),
        JobPrompt::Text(t) => engine
            .tokenize(t)
            .map(|p| (p, Vec::new()))
            .map_err(|e| ApiError::invalid(e, None)),
        JobPrompt::Tokens(t) => Ok((t.clone(), Vec::new())),
    };
    let (prompt, images) = match prepared {
        Ok(p) => p,
        Err(e) => {
            send(Event::Failed(e));
            return;
        }
    };
    let ctx = engine.context_size();
    if prompt.is_empty() {
        send(Event::Failed(ApiError::invalid(
            "the prompt is empty",
            Some("prompt"),
        )));
        return;
    }
    if prompt.len() >= ctx {
        send(Event::Failed(ApiError::invalid(
            format!(
                "the prompt has {} tokens but the context holds {ctx}; shorten it or start the server with a larger --ctx-size",
                prompt.len()
            ),
            Some("messages"),
        )));
        return;
    }
    let mut params = job.params.clone();
    params.max_tokens = params.max_tokens.min(ctx - prompt.len());
    let detok = engine.detokenizer();
    let mut text = TextStream::new(params.stop.clone());
    let mut generated: Vec<u32> = Vec::new();
    let mut stopped_by_string = false;
    let mut on_token = |tok: u32| {
        if job.cancel.load(Ordering::SeqCst) {
            return false;
        }
        generated.push(tok);
        let Ok(decoded) = detok(&generated) else {
            return true;
        };
        let pushed = text.update(decoded);
        if !pushed.delta.is_empty() && !send(Event::Delta(pushed.delta)) {
            // The receiver is gone: the client disconnected.
            job.cancel.store(true, Ordering::SeqCst);
            return false;
        }
        if pushed.stopped {
            stopped_by_string = true;
            return false;
        }
        true
    };
    let result = if images.is_empty() {
        engine
            .generate(&prompt, &params, &mut on_token)
            .map_err(|e| ApiError {
                status: 500,
                message: e,
                kind: "server_error",
                param: None,
            })
    } else {
        engine.generate_with_images(&prompt, &images, &params, &mut on_token)
    };
    shared.requests_total.fetch_add(1, Ordering::SeqCst);
    match result {
        Ok(outcome) => {
            if !stopped_by_string {
                let rest = text.finish();
                if !rest.is_empty() {
                    send(Event::Delta(rest));
                }
            }
            let finish = if job.cancel.load(Ordering::SeqCst) {
                Finish::Cancelled
            } else if outcome.hit_eos || stopped_by_string {
                Finish::Stop
            } else {
                Finish::Length
            };
            send(Event::Done {
                finish,
                usage: Usage::new(
                    prompt.len(),
                    outcome.completion_tokens.len(),
                    outcome.cached_tokens,
                ),
            });
        }
        Err(e) => {
            send(Event::Failed(e));
        }
    }
}

/// Loads (files on this thread), decodes and preprocesses the images, then renders the chat
/// with each placeholder expanded. Every failure is a 4xx.
fn prepare_images<G: Generator>(
    engine: &mut G,
    messages: &[(String, String)],
    images: &[ImageRef],
) -> Result<(Vec<u32>, Vec<ImageInput>), ApiError> {
    let mut inputs = Vec::with_capacity(images.len());
    for (i, r) in images.iter().enumerate() {
        let bytes = load_image(r)?;
        let img = engine.prepare_image(&bytes).map_err(|mut e| {
            if e.status == 400 && images.len() > 1 {
                e.message = format!("image {i}: {}", e.message);
            }
            e
        })?;
        inputs.push(img);
    }
    let prompt = engine.render_chat_with_images(messages, &inputs)?;
    Ok((prompt, inputs))
}
