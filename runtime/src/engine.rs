//! [`Engine`]: loading with admission first, sessions, chunked prefill, the decode loop and
//! logits, all through the streaming KV manager.

use crate::chat::{ChatMessage, TextCodec};
use crate::error::{Result, RuntimeError};
use crate::phase::{admit, ArenaPlanInput, Phase, PhaseArena, PhaseLayout, WorkspaceDims};
use crate::policy::PolicyConfig;
use crate::sampling::{Sampler, SamplingParams};
use crate::speculative::{SpecConfig, SpecStats};
use crate::stats::EngineStats;
use crate::streaming_kv::{StreamingKv, StreamingKvConfig};
use kvstream_memory_contracts::backend::Capabilities;
use kvstream_memory_contracts::error::CapabilityError;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::{ModelBackend, Position3};
use kvstream_model_qwen::{
    AttentionPhase, LoadOptions, LoadReport, LogitRows, ModelError, QwenConfig, QwenModel,
    RecurrentState, WeightPolicy,
};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;

#[path = "synthetic.rs"]
mod synthetic;
pub use synthetic::TimedStep;

/// Default ring depth while streaming (see [`EngineConfig::stream_ring_bytes`]).
pub const DEFAULT_STREAM_RING_BYTES: u64 = 128 << 20;

/// How the engine is set up. Build with [`EngineConfig::new`] and adjust fields.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Directory with `config.json`, `*.safetensors` and optionally `tokenizer.json`,
    /// `tokenizer_config.json`, `chat_template.jinja`.
    pub model_dir: PathBuf,
    /// Context size in tokens (the host history capacity). At most the model's
    /// `max_position_embeddings`.
    pub ctx_size: usize,
    /// K element type of the KV cache.
    pub k_type: KvType,
    /// V element type of the KV cache.
    pub v_type: KvType,
    /// Bytes of the device arena (KV pool + workspace + scratch); see [`crate::parse_size`].
    pub arena_bytes: u64,
    /// Tokens per KV page (a power of two; default 256).
    pub page_tokens: usize,
    /// Tokens per prefill step (default 256).
    pub prefill_chunk: usize,
    /// Minimum ring slots of the pool (default 1). Larger values force streaming (tests).
    pub min_ring_slots: usize,
    /// Ring depth the policy aims for while layers stream (default [`DEFAULT_STREAM_RING_BYTES`],
    /// capped at an eighth of the pool; 0 = only `min_ring_slots`). Measured on the H200 at
    /// 256 Ki tokens: a 16 MB ring idles the link between streamed layers (44 GB/s), 136 MB
    /// keeps it at 52 GB/s (docs/benchmarks.md).
    pub stream_ring_bytes: u64,
    /// Resident pages a streamed layer keeps at least (default 1; 0 streams whole layers).
    pub min_resident_pages: usize,
    /// Caps the KV pool at this many pages whatever the arena holds (sweeps, tests that force
    /// streaming). `None`: the pool takes the rest of the arena.
    pub max_pool_pages: Option<usize>,
    /// Checkpoint the recurrent state before every step so that a failed step can be retried
    /// (default true; one device copy of the GDN state per step).
    pub checkpoint_steps: bool,
    /// Speculative decoding with the model's MTP head (`--spec-type draft-mtp`). `Some` loads
    /// the MTP weights and gives its attention layer a place in the pool; a model without an
    /// MTP head is a capability error at load, before any weight is read. Default `None`.
    pub spec: Option<SpecConfig>,
    /// Device formats of the weights (`--weights`, `--weights-head`): decoder linears, and the
    /// head (`lm_head` + MTP). Default: every tensor as stored in the checkpoint. Quantized
    /// formats are converted at load time (or loaded as saved by `kvstream quantize`).
    pub weights: WeightPolicy,
}

impl EngineConfig {
    /// Defaults: ctx 4096, f16/f16, 1 GiB arena, 256-token pages, 256-token prefill chunks.
    pub fn new(model_dir: impl Into<PathBuf>) -> Self {
        Self {
            model_dir: model_dir.into(),
            ctx_size: 4096,
            k_type: KvType::F16,
            v_type: KvType::F16,
            arena_bytes: 1 << 30,
            page_tokens: 256,
            prefill_chunk: 256,
            min_ring_slots: 1,
            stream_ring_bytes: DEFAULT_STREAM_RING_BYTES,
            min_resident_pages: 1,
            max_pool_pages: None,
            checkpoint_steps: true,
            spec: None,
            weights: WeightPolicy::as_stored(),
        }
    }
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Prompt {
    /// Raw text, tokenized as is (no template, no BOS).
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
    /// Chat messages, rendered with the model's chat template plus the generation prompt.
    Chat(Vec<ChatMessage>),
}

/// One generate call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    /// Tokens to generate at most.
    pub n_predict: usize,
    /// Sampling (temperature 0 = greedy).
    pub sampling: SamplingParams,
    /// Stop at the model's EOS ids (default true).
    pub stop_at_eos: bool,
    /// Prompt cache: when the prompt extends the engine's current session (e.g. the next turn
    /// of a conversation), reuse the host KV history and a recurrent-state checkpoint at the
    /// shared prefix instead of re-prefilling it (see [`crate::prompt_cache`]). Also keeps a
    /// checkpoint at the end of this prompt for the next request. Default false.
    #[serde(default)]
    pub reuse_prefix: bool,
}

impl GenerateRequest {
    /// Greedy request of `n_predict` tokens that stops at EOS.
    pub fn new(prompt: Prompt, n_predict: usize) -> Self {
        Self {
            prompt,
            n_predict,
            sampling: SamplingParams::default(),
            stop_at_eos: true,
            reuse_prefix: false,
        }
    }
}

/// The callback's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// One generated token, as handed to the callback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEvent<'a> {
    /// Index among the generated tokens.
    pub index: usize,
    /// The token id.
    pub token: u32,
    /// Newly completed text (may be empty while a multi-byte character is incomplete, or when
    /// there is no tokenizer).
    pub text: &'a str,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// `n_predict` tokens were generated.
    Length,
    /// An EOS id was generated (it is included in `tokens`).
    Eos,
    /// The callback returned [`Flow::Stop`].
    Callback,
    /// The context is full.
    ContextFull,
}

/// Result of a generate call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateResult {
    /// The prompt's token ids.
    pub prompt_tokens: Vec<u32>,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Generated text (special tokens skipped; empty without a tokenizer).
    pub text: String,
    /// Why it stopped.
    pub stop: StopReason,
    /// Prompt tokens taken from the prompt cache instead of being prefilled (0 without
    /// [`GenerateRequest::reuse_prefix`] or without a shared prefix).
    #[serde(default)]
    pub cached_tokens: usize,
    /// Stats of this call.
    pub stats: EngineStats,
}

/// The inference engine over one backend. One sequence at a time.
pub struct Engine<B: ModelBackend> {
    pub(crate) backend: B,
    pub(crate) cfg: EngineConfig,
    pub(crate) config: QwenConfig,
    pub(crate) model: QwenModel<B>,
    pub(crate) codec: Option<TextCodec>,
    pub(crate) kv: StreamingKv<B>,
    pub(crate) state: RecurrentState<B>,
    pub(crate) layouts: Vec<PhaseLayout>,
    pub(crate) stats: EngineStats,
    /// False after a failed step whose recurrent state could not be restored.
    pub(crate) session_ok: bool,
    /// With MTP: the target hidden row (post final norm) of the last processed position, whose
    /// MTP row waits for the next token.
    pub(crate) mtp_tail: Option<B::Tensor>,
    /// With MTP: speculative counters of the current call.
    pub(crate) spec_stats: SpecStats,
    /// With MTP: peak device bytes of the recurrent checkpoint stage.
    pub(crate) checkpoint_stage_peak: u64,
    /// Tokens the target has processed in this session (always `kv.committed_tokens()` long).
    pub(crate) session_tokens: Vec<u32>,
    /// Prompt cache: the recurrent state at the end of the last prompt prefill.
    pub(crate) prompt_cp: Option<crate::prompt_cache::PromptCheckpoint<B>>,
    /// Called after every prefill chunk with (tokens done, tokens total).
    pub(crate) prefill_progress: Option<PrefillProgress>,
    /// Images: vision tower, M-RoPE position map of the session, loan stats.
    pub(crate) mm: crate::multimodal::MultimodalState<B>,
    /// Host seconds the last step spent issuing its forward pass (the model's calls, before the
    /// KV step is finished and the logits are read back); on an asynchronous device the rest of
    /// the step is waiting for the device.
    pub(crate) last_forward_host_s: f64,
}

/// A prefill progress callback: `(tokens done, tokens total)` of the current prefill.
pub type PrefillProgress = Box<dyn FnMut(usize, usize) + Send>;

/// What one target forward leaves: the final-norm hidden rows and the requested logits rows.
pub(crate) struct StepOut<B: ModelBackend> {
    pub(crate) hidden: B::Tensor,
    pub(crate) logits: Option<Vec<f32>>,
}

impl<B: ModelBackend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("cfg", &self.cfg)
            .field("layouts", &self.layouts)
            .finish()
    }
}

/// Unwraps a KV error that travelled through the model's error type.
pub(crate) fn from_model(e: ModelError) -> RuntimeError {
    match e {
        ModelError::Kv(inner) => match inner.downcast::<RuntimeError>() {
            Ok(r) => *r,
            Err(other) => RuntimeError::Model(ModelError::Kv(other)),
        },
        e => RuntimeError::Model(e),
    }
}

/// Fails with a [`CapabilityError`] (operation `kv_cache_types`) if the backend cannot store
/// and attend over the K/V type pair.
pub fn check_kv_pair(caps: &Capabilities, k: KvType, v: KvType) -> Result<(), CapabilityError> {
    if caps.supports_kv_pair(k, v) {
        return Ok(());
    }
    Err(CapabilityError::new(
        caps.backend,
        "kv_cache_types",
        format!(
            "K/V type pair {k}/{v} is not supported by this backend (supported: {})",
            caps.kv_pairs
                .iter()
                .map(|(a, b)| format!("{a}/{b}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    ))
}

/// The admission input of a configuration (shared by [`Engine::load`] and [`check_admission`]).
fn plan_input<B: ModelBackend>(
    backend: &B,
    cfg: &EngineConfig,
    config: &QwenConfig,
) -> Result<ArenaPlanInput> {
    plan_input_checked(backend, cfg, config, true)
}

/// [`plan_input`]; `check_files` also checks that the checkpoint holds the MTP tensors.
fn plan_input_checked<B: ModelBackend>(
    backend: &B,
    cfg: &EngineConfig,
    config: &QwenConfig,
    check_files: bool,
) -> Result<ArenaPlanInput> {
    if cfg.ctx_size == 0 {
        return Err(RuntimeError::InvalidConfig("ctx_size must be > 0".into()));
    }
    if cfg.ctx_size > config.max_position_embeddings() {
        return Err(RuntimeError::ContextTooLarge {
            requested: cfg.ctx_size,
            limit: config.max_position_embeddings(),
        });
    }
    if cfg.prefill_chunk == 0 {
        return Err(RuntimeError::InvalidConfig(
            "prefill_chunk must be > 0".into(),
        ));
    }
    check_kv_pair(&backend.capabilities(), cfg.k_type, cfg.v_type)?;
    let geometry = PageGeometry::new(
        cfg.page_tokens,
        config.num_key_value_heads(),
        config.head_dim(),
        cfg.k_type,
        cfg.v_type,
    )?;
    if let Some(spec) = &cfg.spec {
        spec.validate()?;
        if check_files {
            crate::mtp::check_mtp_capability(backend, config, &cfg.model_dir)?;
        }
    }
    let layers = config.n_attention_layers() + usize::from(cfg.spec.is_some());
    let mut pol = PolicyConfig::new(layers, 0, geometry.pages_for(cfg.ctx_size));
    pol.min_ring_slots = cfg.min_ring_slots.max(1);
    pol.min_resident_pages = cfg.min_resident_pages;
    let arena_bytes = usize::try_from(cfg.arena_bytes)
        .map_err(|_| RuntimeError::InvalidConfig("arena_bytes overflows usize".into()))?;
    Ok(ArenaPlanInput {
        arena_bytes,
        geometry,
        layers,
        prefill_chunk: cfg.prefill_chunk.min(cfg.ctx_size),
        dims: WorkspaceDims {
            hidden: config.hidden_size(),
            intermediate: config.intermediate_size,
            vocab: config.vocab_size(),
            q_heads: config.num_attention_heads(),
            head_dim: config.head_dim(),
            recurrent_width: 2 * config.linear_conv_dim(),
        },
        min_pool_pages: pol.min_pool_pages(),
        max_pool_pages: cfg.max_pool_pages,
    })
}

/// The generated tokens of one call and the emission rules (text, callback, stop conditions).
pub(crate) struct Emitter {
    /// Prompt + generated tokens.
    pub(crate) history: Vec<u32>,
    pub(crate) generated: Vec<u32>,
    pub(crate) text: String,
    pub(crate) eos: Vec<u32>,
    pub(crate) n_predict: usize,
    pub(crate) stop_at_eos: bool,
}

impl Emitter {
    /// Emits `tok`: decodes the new text, calls `on_token`, and says whether generation stops
    /// here (EOS, callback, `n_predict`).
    pub(crate) fn push(
        &mut self,
        codec: Option<&TextCodec>,
        tok: u32,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<Option<StopReason>> {
        self.generated.push(tok);
        self.history.push(tok);
        let piece = match codec {
            Some(c) => {
                let full = c.decode(&self.generated, true)?;
                let new = full.get(self.text.len()..).unwrap_or("").to_string();
                if !full.ends_with('\u{fffd}') {
                    self.text = full;
                    new
                } else {
                    String::new()
                }
            }
            None => String::new(),
        };
        let flow = on_token(TokenEvent {
            index: self.generated.len() - 1,
            token: tok,
            text: &piece,
        });
        if self.stop_at_eos && self.eos.contains(&tok) {
            return Ok(Some(StopReason::Eos));
        }
        if flow == Flow::Stop {
            return Ok(Some(StopReason::Callback));
        }
        if self.generated.len() >= self.n_predict {
            return Ok(Some(StopReason::Length));
        }
        Ok(None)
    }

    /// Tokens still to generate.
    pub(crate) fn remaining(&self) -> usize {
        self.n_predict.saturating_sub(self.generated.len())
    }
}

/// The phases admission checks at start-up (plus `Verify { width: draft_n_max + 1 }` with
/// speculative decoding).
pub const ADMITTED_PHASES: [Phase; 2] = [Phase::Prefill, Phase::Decode { width: 1 }];

/// The phases a configuration needs.
pub(crate) fn admitted_phases(cfg: &EngineConfig) -> Vec<Phase> {
    let mut p = ADMITTED_PHASES.to_vec();
    if let Some(s) = &cfg.spec {
        p.push(Phase::Verify {
            width: s.draft_n_max + 1,
        });
    }
    p
}

/// Admission without loading anything but `config.json`: every phase's layout, or the typed
/// error (`ArenaTooSmall` naming the phase, required and missing bytes; `ContextTooLarge`;
/// a capability error for an unsupported K/V pair).
pub fn check_admission<B: ModelBackend>(
    backend: &B,
    cfg: &EngineConfig,
) -> Result<Vec<PhaseLayout>> {
    let config = QwenConfig::from_model_dir(&cfg.model_dir)?;
    let input = plan_input(backend, cfg, &config)?;
    admit(&input, &admitted_phases(cfg))
}

/// Admission from a model configuration alone (no file is read: `cfg.model_dir` is ignored and
/// the checkpoint's MTP tensors are not checked). Used to plan a model whose weights are not at
/// hand (`kvstream inspect --synthetic`, a directory holding only `config.json`).
pub fn check_admission_for_config<B: ModelBackend>(
    backend: &B,
    cfg: &EngineConfig,
    config: &QwenConfig,
) -> Result<Vec<PhaseLayout>> {
    let input = plan_input_checked(backend, cfg, config, false)?;
    admit(&input, &admitted_phases(cfg))
}

impl<B: ModelBackend> Engine<B> {
    /// Loads the engine. Order: config → admission of every phase (fails before any weight is
    /// read) → arena allocation → weights → tokenizer/template (optional) → pinned host history.
    pub fn load(backend: B, cfg: EngineConfig) -> Result<Self> {
        let _span = tracing::info_span!("engine_load", dir = %cfg.model_dir.display()).entered();
        let config = QwenConfig::from_model_dir(&cfg.model_dir)?;
        let dir = cfg.model_dir.clone();
        Self::load_parts(backend, cfg, config, |b, o| QwenModel::load(b, &dir, o))
    }

    /// [`Engine::load`] with the model configuration given and the model made by `make_model`
    /// (a checkpoint loader, or synthetic weights: see `Engine::load_synthetic`).
    pub(crate) fn load_parts(
        backend: B,
        cfg: EngineConfig,
        config: QwenConfig,
        make_model: impl FnOnce(&B, &LoadOptions) -> std::result::Result<QwenModel<B>, ModelError>,
    ) -> Result<Self> {
        let input = plan_input(&backend, &cfg, &config)?;
        let layouts = admit(&input, &admitted_phases(&cfg))?;
        let parent = backend.alloc_buffer(input.arena_bytes)?;
        let arena = PhaseArena::new(parent, input)?;
        let load_mtp = cfg.spec.is_some();
        let opts = LoadOptions {
            load_mtp,
            weights: cfg.weights,
            fuse_projections: None,
        };
        let model = make_model(&backend, &opts)?;
        let report = model.load_report();
        tracing::info!(
            quantized = report.quantized,
            kept = report.kept,
            fallback = report.fallback.len(),
            device_weight_bytes = report.device_weight_bytes,
            host_embedding_bytes = report.host_embedding_bytes,
            "weights loaded"
        );
        if load_mtp && !model.has_mtp() {
            return Err(RuntimeError::Protocol("the MTP head did not load".into()));
        }
        let codec = if cfg.model_dir.join("tokenizer.json").is_file() {
            Some(TextCodec::load(&cfg.model_dir)?)
        } else {
            None
        };
        let mut policy = PolicyConfig::new(input.layers, 0, input.geometry.pages_for(cfg.ctx_size));
        policy.min_ring_slots = cfg.min_ring_slots.max(1);
        policy.min_resident_pages = cfg.min_resident_pages;
        let kv_cfg = StreamingKvConfig {
            geometry: input.geometry,
            layers: input.layers,
            ctx_tokens: cfg.ctx_size,
            policy,
            mtp: load_mtp,
            stream_ring_bytes: cfg.stream_ring_bytes,
        };
        let kv = StreamingKv::new(&backend, kv_cfg, arena)?;
        let state = model.new_recurrent_state(&backend)?;
        Ok(Self {
            backend,
            cfg,
            config,
            model,
            codec,
            kv,
            state,
            layouts,
            stats: EngineStats::default(),
            session_ok: true,
            mtp_tail: None,
            spec_stats: SpecStats::default(),
            checkpoint_stage_peak: 0,
            session_tokens: Vec::new(),
            prompt_cp: None,
            prefill_progress: None,
            mm: Default::default(),
            last_forward_host_s: 0.0,
        })
    }

    /// Installs (or removes) a callback that sees the progress of every prefill, chunk by chunk
    /// (the CLI draws a progress bar with it). Long prefills are also logged with `tracing`.
    pub fn set_prefill_progress(&mut self, progress: Option<PrefillProgress>) {
        self.prefill_progress = progress;
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The engine configuration.
    pub fn engine_config(&self) -> &EngineConfig {
        &self.cfg
    }
    /// The model configuration.
    pub fn model_config(&self) -> &QwenConfig {
        &self.config
    }
    /// What the weight load did: tensors quantized / kept / fallen back, device weight bytes and
    /// the host bytes of the embedding table.
    pub fn load_report(&self) -> &LoadReport {
        self.model.load_report()
    }
    /// The device memory plan of this engine: the weights as loaded ([`LoadReport`]), the
    /// recurrent state copies, the arena and `opts.fixed_overhead`, with the verdict against
    /// `opts.budget`.
    pub fn memory_plan(
        &self,
        opts: &crate::memory_plan::PlanOptions,
    ) -> Result<crate::memory_plan::MemoryPlan> {
        let weights = crate::memory_plan::WeightRows::loaded(self.load_report(), &self.cfg.weights);
        crate::memory_plan::plan_memory(&self.config, &self.cfg, &weights, opts)
    }
    /// Admitted phase layouts (computed at load).
    pub fn phase_layouts(&self) -> &[PhaseLayout] {
        &self.layouts
    }
    /// The tokenizer and chat template, if the model directory has them.
    pub fn codec(&self) -> Option<&TextCodec> {
        self.codec.as_ref()
    }
    /// The KV manager (host history, layout, counters).
    pub fn kv(&self) -> &StreamingKv<B> {
        &self.kv
    }
    /// Stats of the last `generate` / `logits` call.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats.clone();
        s.kv = self.kv.stats();
        s.spec = self.spec_report();
        s.finish();
        s
    }

    /// Drops the session (KV history and recurrent state).
    pub fn reset(&mut self) -> Result<()> {
        self.kv.reset(&self.backend)?;
        self.state = self.model.new_recurrent_state(&self.backend)?;
        self.session_ok = true;
        self.mtp_tail = None;
        self.session_tokens.clear();
        self.prompt_cp = None;
        self.mm.positions.clear();
        Ok(())
    }

    /// Tokens in the current session (committed to the host history).
    pub fn session_len(&self) -> usize {
        self.kv.committed_tokens()
    }

    /// Starts a fresh session with `tokens` (prefilled in chunks) and returns the last row's
    /// logits `[V]`. Together with [`Engine::decode_step`] this is the step-by-step form of
    /// [`Engine::generate`].
    pub fn start_session(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        self.prefill(tokens, false)
    }

    /// Appends one token to the session (a decode step) and returns its logits `[V]`. If the step
    /// fails, the session is rolled back to before it (host history, KV and recurrent state), so
    /// the same call may be retried.
    pub fn decode_step(&mut self, token: u32) -> Result<Vec<f32>> {
        if !self.session_ok {
            return Err(RuntimeError::Protocol(
                "the session lost its recurrent state in a failed step; start a new session".into(),
            ));
        }
        if self.kv.committed_tokens() == 0 {
            return Err(RuntimeError::Protocol(
                "no session: call start_session first".into(),
            ));
        }
        self.check_tokens(&[token])?;
        if self.kv.committed_tokens() >= self.cfg.ctx_size {
            return Err(RuntimeError::PromptTooLong {
                prompt: self.kv.committed_tokens() + 1,
                ctx: self.cfg.ctx_size,
            });
        }
        self.kv
            .set_phase(&self.backend, Phase::Decode { width: 1 })?;
        self.step(&[token], AttentionPhase::Decode, LogitRows::Last)?
            .ok_or_else(|| RuntimeError::Protocol("decode step returned no logits".into()))
    }

    /// Host seconds the last step spent issuing its forward pass (see the field); with the
    /// step's wall time this tells a launch-bound step (issue time ≈ step time) from a
    /// device-bound one.
    pub fn last_forward_host_seconds(&self) -> f64 {
        self.last_forward_host_s
    }

    fn codec_or_err(&self) -> Result<&TextCodec> {
        self.codec.as_ref().ok_or_else(|| RuntimeError::File {
            what: "tokenizer",
            path: self.cfg.model_dir.join("tokenizer.json"),
            detail: "not found; pass token ids instead of text".into(),
        })
    }

    /// Token ids of a prompt.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        match prompt {
            Prompt::Tokens(t) => Ok(t.clone()),
            Prompt::Text(s) => self.codec_or_err()?.encode(s),
            Prompt::Chat(m) => self.codec_or_err()?.encode_chat(m, true),
        }
    }

    pub(crate) fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(RuntimeError::InvalidRequest("empty prompt".into()));
        }
        let vocab = self.config.vocab_size();
        if let Some((i, t)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(RuntimeError::InvalidRequest(format!(
                "token {t} at index {i} is outside the vocabulary of {vocab}"
            )));
        }
        if tokens.len() > self.cfg.ctx_size {
            return Err(RuntimeError::PromptTooLong {
                prompt: tokens.len(),
                ctx: self.cfg.ctx_size,
            });
        }
        Ok(())
    }

    /// One forward of `tokens` at positions following the committed history, as one KV step.
    fn step(
        &mut self,
        tokens: &[u32],
        phase: AttentionPhase,
        rows: LogitRows,
    ) -> Result<Option<Vec<f32>>> {
        Ok(self.step_full(tokens, phase, rows, None)?.logits)
    }

    /// [`Engine::step`] that also returns the hidden rows and, with `checkpoints`, pushes the
    /// recurrent state after every token (GDN runs token by token then).
    pub(crate) fn step_full(
        &mut self,
        tokens: &[u32],
        phase: AttentionPhase,
        rows: LogitRows,
        checkpoints: Option<&mut Vec<RecurrentState<B>>>,
    ) -> Result<StepOut<B>> {
        let p0 = self.kv.committed_tokens();
        let positions: Vec<Position3> = self.mm.positions.range(p0, tokens.len());
        let checkpoint = if self.cfg.checkpoint_steps {
            Some(self.state.checkpoint(&self.backend)?)
        } else {
            None
        };
        let restore = |this: &mut Self| {
            if let Some(cp) = &checkpoint {
                let _ = this.state.restore_from(&this.backend, cp);
            }
        };
        self.kv.begin_step(&self.backend, phase, tokens.len())?;
        let issued = std::time::Instant::now();
        let out = self.model.forward(
            &self.backend,
            tokens,
            &positions,
            phase,
            &mut self.state,
            &mut self.kv,
            rows,
            checkpoints,
        );
        self.last_forward_host_s = issued.elapsed().as_secs_f64();
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                // The KV manager already rolled back if the error was its own; make sure.
                self.kv.abort_step(&self.backend);
                restore(self);
                self.session_ok = checkpoint.is_some();
                return Err(from_model(e));
            }
        };
        if let Err(e) = self.kv.finish_step(&self.backend) {
            restore(self);
            self.session_ok = checkpoint.is_some();
            return Err(e);
        }
        self.session_tokens.extend_from_slice(tokens);
        let logits = out
            .logits
            .map(|l| self.backend.tensor_to_f32(&l).map_err(RuntimeError::from))
            .transpose()?;
        Ok(StepOut {
            hidden: out.hidden,
            logits,
        })
    }

    /// Prefills `tokens` into a fresh session in chunks; returns the logits rows requested.
    fn prefill(&mut self, tokens: &[u32], all_rows: bool) -> Result<Vec<f32>> {
        self.reset()?;
        self.prefill_from(tokens, 0, all_rows)
    }

    /// Prefills `tokens[start..]` after a session that already holds `tokens[..start]`.
    pub(crate) fn prefill_from(
        &mut self,
        tokens: &[u32],
        start: usize,
        all_rows: bool,
    ) -> Result<Vec<f32>> {
        if self.kv.committed_tokens() != start || start >= tokens.len() {
            return Err(RuntimeError::Protocol(format!(
                "prefill from {start} of {} tokens over a session of {}",
                tokens.len(),
                self.kv.committed_tokens()
            )));
        }
        self.kv.set_planned_tokens(tokens.len());
        self.kv.set_phase(&self.backend, Phase::Prefill)?;
        let chunk = self.cfg.prefill_chunk.max(1);
        let mut out = Vec::new();
        let tokens = &tokens[start..];
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, c) in tokens.chunks(chunk).enumerate() {
            let _span = tracing::debug_span!("prefill_chunk", i, len = c.len()).entered();
            let rows = if all_rows {
                LogitRows::All
            } else if i + 1 == n_chunks {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let step = self.step_full(c, AttentionPhase::Prefill, rows, None)?;
            if self.model.has_mtp() {
                self.mtp_prefill_chunk(c, &step.hidden, LogitRows::None)?;
            }
            if let Some(l) = step.logits {
                if all_rows {
                    out.extend(l);
                } else {
                    out = l;
                }
            }
            let done = (i * chunk + c.len()).min(tokens.len());
            if n_chunks > 1 {
                tracing::info!(done, total = tokens.len(), "prefill progress");
            }
            if let Some(cb) = self.prefill_progress.as_mut() {
                cb(done, tokens.len());
            }
        }
        Ok(out)
    }

    /// Logits `[T, V]` (row-major) of `tokens` in a fresh session, through the streaming path.
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        self.kv.reset_stats();
        self.stats = EngineStats::default();
        let t = Instant::now();
        let r = self.prefill(tokens, true);
        self.stats.prefill_tokens = tokens.len() as u64;
        self.stats.prefill_seconds = t.elapsed().as_secs_f64();
        r
    }

    /// Generates from `req.prompt` in a fresh session. `on_token` sees every generated token
    /// and may stop generation. On error the session is rolled back to its last committed step
    /// (the host history stays intact) and the engine remains usable.
    pub fn generate(
        &mut self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult> {
        let mut on_token = |ev: TokenEvent<'_>| on_token(ev);
        let mut sampler = Sampler::new(req.sampling)?;
        let prompt = self.tokenize(&req.prompt)?;
        self.check_tokens(&prompt)?;
        let em = self.begin_generate(req, &prompt);
        if req.n_predict == 0 {
            return Ok(self.result(prompt, em.generated, em.text, StopReason::Length, 0));
        }

        let t = Instant::now();
        let (cached, last) = if req.reuse_prefix {
            self.prefill_cached(&prompt)?
        } else {
            (0, self.prefill(&prompt, false)?)
        };
        self.stats.prefill_tokens = (prompt.len() - cached) as u64;
        self.stats.prefill_seconds = t.elapsed().as_secs_f64();
        self.decode_and_finish(req, prompt, em, last, cached, &mut sampler, &mut on_token)
    }

    /// The start of every generate call: fresh statistics and the emitter of `prompt`.
    pub(crate) fn begin_generate(&mut self, req: &GenerateRequest, prompt: &[u32]) -> Emitter {
        self.kv.reset_stats();
        self.stats = EngineStats::default();
        self.spec_stats = SpecStats::default();
        self.checkpoint_stage_peak = 0;
        Emitter {
            history: prompt.to_vec(),
            generated: Vec::new(),
            text: String::new(),
            eos: self.config.eos_token_ids().to_vec(),
            n_predict: req.n_predict,
            stop_at_eos: req.stop_at_eos,
        }
    }

    /// The end of every generate call after its prefill (`last`: the prompt's last logits row,
    /// `cached`: prompt tokens the prompt cache reused): decodes (plain or speculative), then
    /// fills the decode statistics and the result.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decode_and_finish(
        &mut self,
        req: &GenerateRequest,
        prompt: Vec<u32>,
        mut em: Emitter,
        last: Vec<f32>,
        cached: usize,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult> {
        let h2d_after_prefill = {
            let s = self.kv.stats();
            s.h2d_ring_bytes + s.h2d_refill_bytes
        };
        let t = Instant::now();
        self.kv
            .set_planned_tokens(prompt.len() + req.n_predict.saturating_sub(1));
        let stop = if self.cfg.spec.is_some() {
            self.decode_speculative(&mut em, last, sampler, on_token)?
        } else {
            self.decode_plain(&mut em, last, sampler, on_token)?
        };
        self.stats.decode_seconds = t.elapsed().as_secs_f64();
        let s = self.kv.stats();
        let h2d_decode = (s.h2d_ring_bytes + s.h2d_refill_bytes).saturating_sub(h2d_after_prefill);
        self.stats.h2d_bytes_per_token = if self.stats.decode_tokens > 0 {
            h2d_decode as f64 / self.stats.decode_tokens as f64
        } else {
            0.0
        };
        let mut text = em.text;
        if let Some(c) = &self.codec {
            text = c.decode(&em.generated, true)?;
        }
        Ok(self.result(prompt, em.generated, text, stop, cached))
    }

    /// The non-speculative decode loop: one token per step.
    pub(crate) fn decode_plain(
        &mut self,
        em: &mut Emitter,
        first_logits: Vec<f32>,
        sampler: &mut Sampler,
        on_token: &mut dyn FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<StopReason> {
        let mut logits = first_logits;
        self.kv
            .set_phase(&self.backend, Phase::Decode { width: 1 })?;
        loop {
            let tok = sampler.sample(&logits, &em.history)?;
            if let Some(stop) = em.push(self.codec.as_ref(), tok, on_token)? {
                return Ok(stop);
            }
            if self.kv.committed_tokens() >= self.cfg.ctx_size {
                return Ok(StopReason::ContextFull);
            }
            let _span = tracing::debug_span!("decode_step", n = em.generated.len()).entered();
            logits = self
                .step(&[tok], AttentionPhase::Decode, LogitRows::Last)?
                .ok_or_else(|| RuntimeError::Protocol("decode step returned no logits".into()))?;
            self.stats.decode_tokens += 1;
        }
    }

    pub(crate) fn result(
        &self,
        prompt: Vec<u32>,
        tokens: Vec<u32>,
        text: String,
        stop: StopReason,
        cached_tokens: usize,
    ) -> GenerateResult {
        GenerateResult {
            prompt_tokens: prompt,
            tokens,
            text,
            stop,
            cached_tokens,
            stats: self.stats(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unsupported_kv_pair_is_a_capability_error() {
        let caps = Capabilities {
            backend: "test",
            device: "none".into(),
            pinned_host: true,
            copy_engine: true,
            max_decode_width: 4,
            prefill_attention: true,
            kv_pairs: vec![(KvType::F16, KvType::F16), (KvType::Q8_0, KvType::Q4_0)],
            compute_ops: true,
            weight_dtypes: vec![],
            device_memory: None,
        };
        assert!(check_kv_pair(&caps, KvType::Q8_0, KvType::Q4_0).is_ok());
        let e = check_kv_pair(&caps, KvType::Q4_0, KvType::Q8_0).expect_err("unsupported");
        assert_eq!(e.operation, "kv_cache_types");
        assert!(e.detail.contains("q4_0/q8_0"), "{}", e.detail);
        let r: RuntimeError = e.into();
        assert!(matches!(r, RuntimeError::Capability(_)));
    }
}
