//! `kvstream serve`: the OpenAI-compatible server over the engine.

use crate::args::EngineArgs;
use crate::backend_select::{dispatch, OnBackend};
use crate::serve::api::{ApiError, GenParams};
use crate::serve::routes::AppState;
use crate::serve::worker::{self, Detokenizer, Generator, Outcome};
use anyhow::{Context, Result};
use clap::Args;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_runtime::chat::{ChatMessage, TextCodec};
use kvstream_runtime::engine::{Engine, Flow, GenerateRequest, Prompt, StopReason};
use kvstream_runtime::sampling::SamplingParams;
use kvstream_runtime::{ImageInput, RuntimeError, VisionOptions};
use std::sync::Arc;

/// Flags of `serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind.
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests that may wait for the engine; more get 429.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Model name reported by /v1/models (default: the model directory's name).
    #[arg(long)]
    pub model_alias: Option<String>,
    /// Keep the vision tower's weights loaded between images (no reload per image; each arena
    /// loan then covers only the encode workspace).
    #[arg(long)]
    pub vision_keep_resident: bool,
}

/// The generate request of a prompt and validated parameters (no prompt cache).
fn request(prompt: &[u32], params: &GenParams) -> GenerateRequest {
    let mut req = GenerateRequest::new(Prompt::Tokens(prompt.to_vec()), params.max_tokens);
    req.stop_at_eos = !params.ignore_eos;
    req.sampling = SamplingParams {
        temperature: params.temperature,
        top_k: params.top_k,
        top_p: params.top_p,
        min_p: params.min_p,
        seed: params.seed.unwrap_or(0),
        repeat_penalty: params.repeat_penalty,
        presence_penalty: params.presence_penalty,
        frequency_penalty: params.frequency_penalty,
        ..SamplingParams::default()
    };
    req
}

/// HTTP status of an engine error on an image request: what the client sent (image bytes,
/// formats, sizes, placeholders, prompt length) is a 400; engine failures are 500s.
fn api_error(e: RuntimeError) -> ApiError {
    match e {
        RuntimeError::ImageTooLarge { .. }
        | RuntimeError::Image(_)
        | RuntimeError::InvalidRequest(_)
        | RuntimeError::PromptTooLong { .. }
        | RuntimeError::Tokenizer(_)
        | RuntimeError::Template(_) => ApiError::invalid(e.to_string(), Some("messages")),
        e => ApiError {
            status: 500,
            message: e.to_string(),
            kind: "server_error",
            param: None,
        },
    }
}

/// The engine behind the server.
struct EngineGenerator<B: ModelBackend> {
    engine: Engine<B>,
    codec: Arc<TextCodec>,
    model_id: String,
    requests: u64,
    prompt_tokens: u64,
    completion_tokens: u64,
}

impl<B: ModelBackend> Generator for EngineGenerator<B> {
    fn model_id(&self) -> String {
        self.model_id.clone()
    }
    fn context_size(&self) -> usize {
        self.engine.engine_config().ctx_size
    }
    fn render_chat(&self, messages: &[(String, String)]) -> Result<Vec<u32>, String> {
        let msgs: Vec<ChatMessage> = messages
            .iter()
            .map(|(r, c)| ChatMessage::new(r.clone(), c.clone()))
            .collect();
        self.codec
            .encode_chat(&msgs, true)
            .map_err(|e| e.to_string())
    }
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, String> {
        self.codec.encode(text).map_err(|e| e.to_string())
    }
    fn detokenizer(&self) -> Detokenizer {
        let codec = Arc::clone(&self.codec);
        Arc::new(move |ids: &[u32]| codec.decode(ids, true).map_err(|e| e.to_string()))
    }
    fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Outcome, String> {
        let mut req = request(prompt, params);
        req.reuse_prefix = true;
        let r = self
            .engine
            .generate(&req, |ev| {
                if on_token(ev.token) {
                    Flow::Continue
                } else {
                    Flow::Stop
                }
            })
            .map_err(|e| e.to_string())?;
        self.requests += 1;
        self.prompt_tokens += prompt.len() as u64;
        self.completion_tokens += r.tokens.len() as u64;
        Ok(Outcome {
            completion_tokens: r.tokens,
            cached_tokens: r.cached_tokens,
            hit_eos: r.stop == StopReason::Eos,
        })
    }
    fn prepare_image(&mut self, bytes: &[u8]) -> Result<ImageInput, ApiError> {
        self.engine.preprocess_image(bytes).map_err(api_error)
    }
    fn render_chat_with_images(
        &mut self,
        messages: &[(String, String)],
        images: &[ImageInput],
    ) -> Result<Vec<u32>, ApiError> {
        let msgs: Vec<ChatMessage> = messages
            .iter()
            .map(|(r, c)| ChatMessage::new(r.clone(), c.clone()))
            .collect();
        self.engine
            .chat_tokens_with_images(&msgs, images)
            .map_err(api_error)
    }
    fn generate_with_images(
        &mut self,
        prompt: &[u32],
        images: &[ImageInput],
        params: &GenParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Outcome, ApiError> {
        let mut req = request(prompt, params);
        // Image rows match by content, so a follow-up turn about the same images reuses them.
        req.reuse_prefix = true;
        let r = self
            .engine
            .generate_multimodal(&req, images, |ev| {
                if on_token(ev.token) {
                    Flow::Continue
                } else {
                    Flow::Stop
                }
            })
            .map_err(api_error)?;
        self.requests += 1;
        self.prompt_tokens += prompt.len() as u64;
        self.completion_tokens += r.tokens.len() as u64;
        Ok(Outcome {
            completion_tokens: r.tokens,
            cached_tokens: 0,
            hit_eos: r.stop == StopReason::Eos,
        })
    }
    fn metrics_text(&self) -> String {
        let s = self.engine.stats();
        let resident: usize = s.kv.resident_pages.iter().sum();
        let mut out = String::new();
        let mut g = |name: &str, help: &str, kind: &str, v: f64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        g(
            "kvstream_prefill_tokens_per_second",
            "Prefill throughput of the last request.",
            "gauge",
            s.prefill_tok_per_s,
        );
        g(
            "kvstream_decode_tokens_per_second",
            "Decode throughput of the last request.",
            "gauge",
            s.decode_tok_per_s,
        );
        g(
            "kvstream_kv_h2d_bytes",
            "KV bytes streamed host to device (last request).",
            "gauge",
            (s.kv.h2d_ring_bytes + s.kv.h2d_refill_bytes) as f64,
        );
        g(
            "kvstream_kv_resident_pages",
            "Resident KV pages over all layers.",
            "gauge",
            resident as f64,
        );
        g(
            "kvstream_kv_ring_slots",
            "Ring slots of the KV pool.",
            "gauge",
            s.kv.ring_slots as f64,
        );
        g(
            "kvstream_kv_pool_pages",
            "Pages of the KV pool.",
            "gauge",
            s.kv.pool_pages as f64,
        );
        g(
            "kvstream_arena_bytes",
            "Bytes of the device arena.",
            "gauge",
            self.engine.engine_config().arena_bytes as f64,
        );
        g(
            "kvstream_prompt_tokens_total",
            "Prompt tokens served.",
            "counter",
            self.prompt_tokens as f64,
        );
        g(
            "kvstream_completion_tokens_total",
            "Completion tokens served.",
            "counter",
            self.completion_tokens as f64,
        );
        g(
            "kvstream_engine_requests_total",
            "Requests the engine completed.",
            "counter",
            self.requests as f64,
        );
        let v = self.engine.vision_stats();
        g(
            "kvstream_vision_images_total",
            "Images encoded (each in an arena loan).",
            "counter",
            v.images as f64,
        );
        g(
            "kvstream_vision_refused_total",
            "Images refused as too large for the arena.",
            "counter",
            v.refused as f64,
        );
        g(
            "kvstream_vision_peak_loan_bytes",
            "Largest arena loan to the vision tower.",
            "gauge",
            v.peak_loan_bytes as f64,
        );
        g(
            "kvstream_vision_resident_weight_bytes",
            "Vision tower weights kept resident outside the arena.",
            "gauge",
            v.resident_weight_bytes as f64,
        );
        if let Some(l) = v.loans.last() {
            g(
                "kvstream_arena_used_after_image_bytes",
                "Arena bytes in use after the last image's loan was returned.",
                "gauge",
                l.arena_used_after as f64,
            );
            g(
                "kvstream_arena_used_text_bytes",
                "Arena bytes in use in the text phase before the last image's loan.",
                "gauge",
                l.arena_used_text as f64,
            );
        }
        out
    }
}

struct Run(ServeArgs);

impl OnBackend for Run {
    type Output = ();
    fn run<B: ModelBackend>(self, backend: B) -> Result<()> {
        let args = self.0;
        let cfg = args.engine.engine_config()?;
        let dir = args.engine.model.clone();
        let vision_keep_resident = args.vision_keep_resident;
        let model_id = args.model_alias.clone().unwrap_or_else(|| {
            dir.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "kvstream".into())
        });
        // The engine is built on the worker thread; the backend value moves there.
        let handle = worker::spawn(
            move || {
                let codec = Arc::new(TextCodec::load(&dir).map_err(|e| e.to_string())?);
                let mut engine = Engine::load(backend, cfg).map_err(|e| e.to_string())?;
                engine.set_vision_options(VisionOptions {
                    keep_weights_resident: vision_keep_resident,
                    ..VisionOptions::default()
                });
                Ok(EngineGenerator {
                    engine,
                    codec,
                    model_id,
                    requests: 0,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                })
            },
            args.queue,
        );
        let addr = format!("{}:{}", args.host, args.port);
        crate::serve::serve_blocking(
            AppState {
                worker: handle,
                default_max_tokens: args.default_max_tokens,
            },
            &addr,
        )
        .context("serve")
    }
}

/// Runs `serve`.
pub fn run(args: ServeArgs) -> Result<()> {
    let (kind, dev) = (args.engine.backend, args.engine.device);
    dispatch(kind, dev, Run(args))
}
