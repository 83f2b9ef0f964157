//! Images through the engine: preprocessing, the vision-tower **arena loan**, M-RoPE positions
//! and the multimodal prefill, followed by ordinary (plain or MTP-speculative) decoding.
//!
//! ## Flow of [`Engine::generate_multimodal`]
//! 1. The prompt's `<|image_pad|>` runs are checked against the images' grids
//!    ([`mrope_positions`]) before anything runs.
//! 2. **Loan check** for every image: `needed` = encode workspace ([`vision_workspace_bytes`])
//!    plus tower weights ([`vision_weight_bytes`], unless kept resident) against the arena
//!    size. An image that does not fit is [`RuntimeError::ImageTooLarge`] naming both numbers;
//!    nothing has changed yet, so the current session keeps its state (host history, device KV,
//!    recurrent state) and can continue.
//! 3. Per image, **the loan**: [`Phase::Vision`] is committed through the KV manager's phase
//!    transition: in-flight work is drained, the device KV mirrors are suspended (every resident
//!    page is marked stale; the host history stays the truth), the KV pool and text workspaces
//!    are released and one `vision` region of `needed` bytes is leased. The tower is loaded (or
//!    taken from residence), the image encoded, the tower dropped (or kept), the region returned
//!    by transitioning back to the text phase that was in force. Resident pages refill from the
//!    host on the next text step. The arena's use after each image is recorded
//!    ([`LoanRecord::arena_used_after`]) and equals the text-only level.
//! 4. **Prefill** in chunks of `prefill_chunk` tokens with the image rows replacing the
//!    `<|image_pad|>` embeddings in order (a chunk may split an image), at the M-RoPE positions of
//!    the whole prompt. KV rows stay dense append indices; only positions are 3-D.
//! 5. **Decode** continues at `next_position` on all three axes (the session's [`PositionMap`]
//!    shifts every later row by the prompt's `rope_delta`); the MTP head, when speculating, gets
//!    exactly the same positions as the target (row i at the target's position i).
//!
//! ## Prompt cache with images
//! With [`crate::GenerateRequest::reuse_prefix`] the text prompt cache ([`crate::prompt_cache`])
//! applies: the session records a cache key per row (`row_keys`: the token id for text, a
//! content-derived key above every vocabulary id for each image row), so a prefix matches only
//! where the same images (by a 64-bit hash of their preprocessed pixels) sit at the same rows.
//! Images wholly inside the reused prefix are not encoded again (no loan); one cut by the prefix
//! is encoded and its rows from the cut on are prefilled. A multimodal prefill with the cache
//! saves the prompt checkpoint after all but its last row, as the text path does; the server
//! turns the cache on for image requests too.
//!
//! ## Where the encoder runs
//! On the engine's backend ([`VisionTower::encode_with`], generic over
//! [`kvstream_model_qwen::VisionBackend`]): the CPU backend computes it on the host (the HF-checked
//! reference), the CUDA backend on the GPU (vision.cu). The tower's f32 weights are read from the
//! checkpoint into host memory, uploaded as backend weights ([`VisionTower::upload`]; the CPU
//! backend references the host bytes) and, unless kept resident, dropped with the host copy at
//! the end of the loan; every activation of the encoder is dropped before `encode_with` returns.
//! The loan is a real reservation of the device arena: the region is committed in the arena's
//! region map, the KV pool is released for its duration, and the encoder's bytes (weights held on
//! the backend + the workspace estimate for the image) are checked against it. The encoder's
//! tensors are the backend's own allocations (on CUDA stream-ordered allocations next to the
//! arena, freed when dropped), not sub-ranges of the region: the region is the budget they are
//! accounted against, so after each image the backend holds what it held in the text phase.
//!
//! ## Keeping the tower resident
//! [`VisionOptions::keep_weights_resident`]: the tower's weights stay loaded between images when
//! they fit `resident_budget_bytes` (no reload per image; the loan then only covers the
//! workspace). The resident weights are reported in [`VisionStats::resident_weight_bytes`].
//!
//! MTP after images: the MTP head's rows whose next token is an `<|image_pad|>` embed that
//! image row's vision embedding (as the target's input did, and as vLLM's multimodal MTP drafter
//! does), not the placeholder id; either way only draft quality depends on it, never the
//! verified output.

use crate::chat::expand_image_pads;
use crate::engine::{from_model, Engine, GenerateRequest, GenerateResult, StepOut};
use crate::engine::{Flow, StopReason, TokenEvent};
use crate::error::{Result, RuntimeError};
use crate::phase::{Phase, REGION_ALIGN};
use crate::sampling::Sampler;
use kvstream_memory_contracts::backend::Backend;
use kvstream_memory_contracts::ops::{ModelBackend, Position3};
use kvstream_model_qwen::vision::{preprocess, PreprocessedImage, PreprocessorConfig};
use kvstream_model_qwen::{
    mrope_positions, AttentionPhase, DeviceVisionWeights, ImageEmbeds, LogitRows, VisionConfig,
    VisionError, VisionTower,
};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::time::Instant;

/// How the vision tower is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VisionOptions {
    /// Keep the tower's weights loaded between images (no reload, loans cover only the
    /// workspace) when they fit `resident_budget_bytes`. Default false: weights are loaded into
    /// each loan and dropped with it.
    pub keep_weights_resident: bool,
    /// Largest weight footprint that may stay resident (default: unlimited).
    pub resident_budget_bytes: u64,
}

impl Default for VisionOptions {
    fn default() -> Self {
        Self {
            keep_weights_resident: false,
            resident_budget_bytes: u64::MAX,
        }
    }
}

/// One image's arena loan, as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoanRecord {
    /// Index of the image in its request.
    pub image: usize,
    /// Patch grid (t, h, w).
    pub grid_thw: [usize; 3],
    /// `<|image_pad|>` tokens (embedding rows) the image produced.
    pub tokens: usize,
    /// Bytes of the leased `vision` region.
    pub loan_bytes: usize,
    /// Of those, the tower weights (0 when resident).
    pub weight_bytes: usize,
    /// Of those, the encode workspace.
    pub workspace_bytes: usize,
    /// Arena bytes in use in the text phase before the loan (the text-only level).
    pub arena_used_text: usize,
    /// Arena bytes in use during the loan.
    pub arena_used_during: usize,
    /// Arena bytes in use after the region was returned (equals `arena_used_text`).
    pub arena_used_after: usize,
    /// The tower's weights were (re)loaded for this image.
    pub weights_loaded: bool,
    /// Seconds spent encoding.
    pub encode_seconds: f64,
    /// Bytes the backend itself carved out of the region at the peak of the encode (weights
    /// loaded for it + intermediates); 0 on backends whose tensors are not device memory (CPU).
    #[serde(default)]
    pub region_peak_bytes: usize,
}

/// Vision counters: cumulative totals and the loans of the last multimodal call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VisionStats {
    /// Images encoded since load.
    pub images: u64,
    /// Times the tower weights were loaded.
    pub weight_loads: u64,
    /// Images refused as too large for the arena.
    pub refused: u64,
    /// Bytes of tower weights kept resident outside the arena now (0 unless kept).
    pub resident_weight_bytes: u64,
    /// Largest loan so far.
    pub peak_loan_bytes: u64,
    /// The loans of the last multimodal call, in image order.
    pub loans: Vec<LoanRecord>,
}

/// M-RoPE positions of the session: the prompt's explicit 3-D positions, then text positions
/// shifted by the prompt's `rope_delta` (HF's `rope_deltas`). Empty = plain text positions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PositionMap {
    prompt: Vec<Position3>,
    delta: i64,
}

impl PositionMap {
    /// Positions of rows `[start, start + n)`.
    pub fn range(&self, start: usize, n: usize) -> Vec<Position3> {
        (start..start + n)
            .map(|i| match self.prompt.get(i) {
                Some(p) => *p,
                None => {
                    let p = (i as i64 + self.delta).clamp(0, i64::from(u32::MAX)) as u32;
                    [p; 3]
                }
            })
            .collect()
    }
    /// Back to plain text positions.
    pub fn clear(&mut self) {
        self.prompt.clear();
        self.delta = 0;
    }
    /// Installs a multimodal prompt's positions and its `rope_delta`.
    pub fn set(&mut self, prompt: Vec<Position3>, delta: i64) {
        self.prompt = prompt;
        self.delta = delta;
    }
    /// The shift of text positions after the prompt (≤ 0 with images).
    pub fn rope_delta(&self) -> i64 {
        self.delta
    }
}

/// The tower kept between images: host weights and their backend copy.
struct ResidentTower<B: Backend> {
    host: VisionTower,
    device: DeviceVisionWeights<B>,
}

/// The engine's multimodal state (lazily initialised on the first image).
pub struct MultimodalState<B: Backend> {
    vision: Option<(VisionConfig, PreprocessorConfig)>,
    tower: Option<ResidentTower<B>>,
    opts: VisionOptions,
    /// The session's position map (cleared by `Engine::reset`).
    pub(crate) positions: PositionMap,
    stats: VisionStats,
}

impl<B: Backend> Default for MultimodalState<B> {
    fn default() -> Self {
        Self {
            vision: None,
            tower: None,
            opts: VisionOptions::default(),
            positions: PositionMap::default(),
            stats: VisionStats::default(),
        }
    }
}

/// An encoder failure: a backend op error stays an op error, the rest are image errors.
fn vision_error(e: VisionError) -> RuntimeError {
    match e {
        VisionError::Op(op) => RuntimeError::Op(op),
        other => RuntimeError::Image(other),
    }
}

impl<B: Backend> std::fmt::Debug for MultimodalState<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultimodalState")
            .field("vision", &self.vision.is_some())
            .field("tower_resident", &self.tower.is_some())
            .field("opts", &self.opts)
            .finish()
    }
}

/// A decoded and preprocessed image, ready for [`Engine::generate_multimodal`].
#[derive(Debug, Clone)]
pub struct ImageInput {
    image: PreprocessedImage,
    tokens: usize,
    /// 64-bit hash of the preprocessed pixels and grid (the prompt cache's image identity).
    hash: u64,
}

impl ImageInput {
    fn new(image: PreprocessedImage, tokens: usize) -> Self {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        image.grid_thw.hash(&mut h);
        image.patch_dim.hash(&mut h);
        for v in &image.pixels {
            v.to_bits().hash(&mut h);
        }
        let hash = h.finish();
        Self {
            image,
            tokens,
            hash,
        }
    }
    /// The image's identity for the prompt cache: a 64-bit hash of its preprocessed pixels.
    pub fn content_hash(&self) -> u64 {
        self.hash
    }
    /// Patch grid (t, h, w).
    pub fn grid_thw(&self) -> [usize; 3] {
        self.image.grid_thw
    }
    /// `<|image_pad|>` tokens this image takes in the prompt (t·h·w / merge²).
    pub fn n_tokens(&self) -> usize {
        self.tokens
    }
    /// The preprocessed pixels.
    pub fn preprocessed(&self) -> &PreprocessedImage {
        &self.image
    }
}

/// f32 bytes of the tower's weights as computed from its configuration (equals
/// [`VisionTower::weight_bytes`] of the loaded tower).
pub fn vision_weight_bytes(c: &VisionConfig) -> usize {
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let mh = h * c.spatial_merge_size * c.spatial_merge_size;
    let block = 2 * (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (i * h + i) + (h * i + h);
    let floats = h * c.patch_dim()
        + h
        + c.num_position_embeddings * h
        + c.depth * block
        + 2 * h
        + (mh * mh + mh)
        + (c.out_hidden_size * mh + c.out_hidden_size);
    4 * floats
}

/// Query rows per attention score block (the tower's blocked attention).
const ATTN_QBLOCK: usize = 128;

/// Bytes a backend may round one allocation up to inside a lent region
/// ([`kvstream_memory_contracts::region_alloc::RegionAllocator`] on CUDA aligns to 256).
const ALLOC_GRANULE: usize = 256;

/// Upper estimate of the f32 bytes live while encoding an image of patch grid `grid`: the
/// patches, the residual stream and its temporaries, rotary tables, qkv, one block of
/// `min(128, frame)` query rows of attention scores over the frame for every head at once (the
/// encoder attends in query blocks, never a whole `frame × frame` matrix per head), the MLP
/// hidden, and the merger's buffers, plus the allocation granularity of a lent region.
/// Deterministic (independent of the thread count).
pub fn vision_workspace_bytes(c: &VisionConfig, grid: [usize; 3]) -> usize {
    let [t, gh, gw] = grid;
    let n = t * gh * gw;
    let frame = gh * gw;
    let h = c.hidden_size;
    let m2 = (c.spatial_merge_size * c.spatial_merge_size).max(1);
    let floats = n * c.patch_dim()
        + 4 * n * h
        + 2 * n * c.head_dim()
        + 3 * n * h
        + c.num_heads * ATTN_QBLOCK.min(frame) * frame
        + n * c.intermediate_size
        + n * h
        + 2 * (n / m2) * h * m2
        + (n / m2) * c.out_hidden_size;
    // Allocation granularity when the encoder runs inside the lent region: one granule for each
    // of the tower's tensors (12 per block + 10) and each intermediate live at once (≤ 16 per
    // block + 32).
    4 * floats + ALLOC_GRANULE * (28 * c.depth + 42)
}

/// True when a safetensors checkpoint in `dir` (sharded index or single/multiple files) names
/// `tensor`. Reads only the index or the files' headers.
fn checkpoint_has(dir: &Path, tensor: &str) -> bool {
    let index = dir.join("model.safetensors.index.json");
    if let Ok(text) = std::fs::read_to_string(&index) {
        return serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v.get("weight_map").map(|m| m.get(tensor).is_some()))
            .unwrap_or(false);
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let p = e.path();
        p.extension().is_some_and(|x| x == "safetensors") && header_has(&p, tensor)
    })
}

fn header_has(path: &Path, tensor: &str) -> bool {
    use std::io::Read;
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let mut len = [0u8; 8];
    if f.read_exact(&mut len).is_err() {
        return false;
    }
    let n = u64::from_le_bytes(len);
    if n > 256 << 20 {
        return false;
    }
    let mut header = vec![0u8; n as usize];
    if f.read_exact(&mut header).is_err() {
        return false;
    }
    serde_json::from_slice::<serde_json::Value>(&header)
        .ok()
        .is_some_and(|v| v.get(tensor).is_some())
}

fn aligned(x: usize) -> usize {
    x.next_multiple_of(REGION_ALIGN)
}

impl<B: ModelBackend> Engine<B> {
    /// Sets how the vision tower is kept ([`VisionOptions`]). Dropping residence frees the
    /// resident weights now.
    pub fn set_vision_options(&mut self, opts: VisionOptions) {
        self.mm.opts = opts;
        if !self.keep_resident() {
            self.mm.tower = None;
            self.mm.stats.resident_weight_bytes = 0;
        }
    }

    /// Vision counters (cumulative, and the loans of the last multimodal call).
    pub fn vision_stats(&self) -> &VisionStats {
        &self.mm.stats
    }

    /// The session's M-RoPE position map (empty for text-only sessions).
    pub fn position_map(&self) -> &PositionMap {
        &self.mm.positions
    }

    /// The vision and preprocessor configuration; [`RuntimeError::InvalidRequest`] when the
    /// model has no vision tower (`config.json` without `vision_config`).
    pub fn vision_config(&mut self) -> Result<&VisionConfig> {
        if self.mm.vision.is_none() {
            let dir = self.cfg.model_dir.clone();
            let path = dir.join("config.json");
            let text = std::fs::read_to_string(&path).map_err(|e| RuntimeError::File {
                what: "model config",
                path: path.clone(),
                detail: e.to_string(),
            })?;
            let root: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| RuntimeError::File {
                    what: "model config",
                    path: path.clone(),
                    detail: e.to_string(),
                })?;
            if root.get("vision_config").is_none() {
                return Err(RuntimeError::InvalidRequest(format!(
                    "this model has no vision tower ({} has no vision_config); send text only",
                    path.display()
                )));
            }
            // Text-only checkpoints of VL architectures keep `vision_config` but no weights.
            if !checkpoint_has(&dir, "model.visual.patch_embed.proj.weight") {
                return Err(RuntimeError::InvalidRequest(format!(
                    "this model has no vision tower (the checkpoint in {} has no model.visual.* \
                     weights); send text only",
                    dir.display()
                )));
            }
            if !dir.join("preprocessor_config.json").is_file() {
                return Err(RuntimeError::InvalidRequest(format!(
                    "this model has no vision tower ({} has no preprocessor_config.json); send \
                     text only",
                    dir.display()
                )));
            }
            let vc = VisionConfig::from_json_value(&root, &path)?;
            if vc.out_hidden_size != self.config.hidden_size() {
                return Err(RuntimeError::InvalidConfig(format!(
                    "vision out_hidden_size {} differs from the text hidden size {}",
                    vc.out_hidden_size,
                    self.config.hidden_size()
                )));
            }
            let pc = PreprocessorConfig::from_model_dir(&dir)?;
            pc.check_against(&vc)?;
            self.mm.vision = Some((vc, pc));
        }
        match &self.mm.vision {
            Some((vc, _)) => Ok(vc),
            None => Err(RuntimeError::Protocol("vision config vanished".into())),
        }
    }

    /// True when the model has a loadable vision configuration.
    pub fn has_vision(&mut self) -> bool {
        self.vision_config().is_ok()
    }

    /// Decodes (PNG, JPEG, WebP) and preprocesses image bytes with the model's
    /// `preprocessor_config.json`. Malformed or unsupported bytes are [`RuntimeError::Image`].
    pub fn preprocess_image(&mut self, bytes: &[u8]) -> Result<ImageInput> {
        let merge = self.vision_config()?.spatial_merge_size;
        let pc = match &self.mm.vision {
            Some((_, pc)) => pc,
            None => return Err(RuntimeError::Protocol("vision config vanished".into())),
        };
        let _span = tracing::debug_span!("image_preprocess", bytes = bytes.len()).entered();
        let image = preprocess(bytes, pc)?;
        let tokens = image.n_tokens(merge);
        Ok(ImageInput::new(image, tokens))
    }

    /// Token ids of chat `messages` whose contents hold one
    /// [`crate::chat::IMAGE_PLACEHOLDER`] per image (in order), with each `<|image_pad|>`
    /// expanded to the image's token count.
    pub fn chat_tokens_with_images(
        &mut self,
        messages: &[crate::chat::ChatMessage],
        images: &[ImageInput],
    ) -> Result<Vec<u32>> {
        let pad = self.vision_config()?.image_token_id;
        let ids = self.tokenize(&crate::Prompt::Chat(messages.to_vec()))?;
        let counts: Vec<usize> = images.iter().map(ImageInput::n_tokens).collect();
        expand_image_pads(&ids, pad, &counts)
    }

    fn keep_resident(&self) -> bool {
        let o = self.mm.opts;
        let weights = self
            .mm
            .vision
            .as_ref()
            .map_or(0, |(vc, _)| vision_weight_bytes(vc));
        o.keep_weights_resident && weights as u64 <= o.resident_budget_bytes
    }

    /// The loan each image needs (weights unless resident + workspace), or the typed error for
    /// the first image that cannot fit the arena. Changes nothing.
    fn plan_loans(&mut self, images: &[ImageInput]) -> Result<Vec<(usize, usize)>> {
        let vc = self.vision_config()?.clone();
        let weights = if self.keep_resident() {
            0
        } else {
            vision_weight_bytes(&vc)
        };
        let available = self.cfg.arena_bytes;
        let mut out = Vec::with_capacity(images.len());
        for (i, img) in images.iter().enumerate() {
            let ws = vision_workspace_bytes(&vc, img.grid_thw());
            let needed = aligned(weights + ws);
            if needed as u64 > available {
                self.mm.stats.refused += 1;
                return Err(RuntimeError::ImageTooLarge {
                    image: i,
                    needed: needed as u64,
                    available,
                });
            }
            out.push((weights, ws));
        }
        Ok(out)
    }

    /// Encodes `images` through arena loans (see the module docs); returns their embedding rows
    /// concatenated `[Σ tokens, hidden]`. On [`RuntimeError::ImageTooLarge`] nothing changed; on
    /// any other failure the text phase is resumed before the error is returned. Either way the
    /// session (host history, recurrent state) is untouched.
    pub fn encode_images(&mut self, images: &[ImageInput]) -> Result<Vec<f32>> {
        let plan = self.plan_loans(images)?;
        let _span = tracing::info_span!("vision_loans", images = images.len()).entered();
        // The text phase to return to (a fresh engine has none yet: lay out prefill first, so
        // that the text-only level is well defined).
        let text_phase = match self.kv.arena().phase() {
            Some(p @ (Phase::Prefill | Phase::Decode { .. } | Phase::Verify { .. })) => p,
            _ => Phase::Prefill,
        };
        self.kv.set_phase(&self.backend, text_phase)?;
        self.mm.stats.loans.clear();
        let mut rows = Vec::new();
        for (i, (img, (weights, ws))) in images.iter().zip(plan).enumerate() {
            let text_used = self.kv.arena().arena().used();
            let out = self.encode_on_loan(i, img, weights, ws, text_used);
            // Return the region and resume text whatever happened.
            let resumed = self.kv.set_phase(&self.backend, text_phase);
            let after = self.kv.arena().arena().used();
            if let Some(rec) = self.mm.stats.loans.last_mut() {
                rec.arena_used_after = after;
            }
            resumed?;
            rows.extend(out?);
        }
        Ok(rows)
    }

    /// [`Engine::encode_images`] of the images whose placeholder run (`runs`, one per image)
    /// reaches past row `from`: the others lie wholly in the reused prefix.
    fn encode_rows_after(
        &mut self,
        images: &[ImageInput],
        runs: &[std::ops::Range<usize>],
        from: usize,
    ) -> Result<Vec<f32>> {
        let needed: Vec<ImageInput> = images
            .iter()
            .zip(runs)
            .filter(|(_, r)| r.end > from)
            .map(|(img, _)| img.clone())
            .collect();
        self.encode_images(&needed)
    }

    fn encode_on_loan(
        &mut self,
        i: usize,
        img: &ImageInput,
        weights: usize,
        ws: usize,
        text_used: usize,
    ) -> Result<Vec<f32>> {
        let loan = aligned(weights + ws);
        let _span = tracing::debug_span!("vision_loan", image = i, loan).entered();
        // Drain → suspend the device KV mirrors (pages marked stale) → lease the region.
        self.kv
            .set_phase(&self.backend, Phase::Vision { bytes: loan })?;
        let during = self.kv.arena().arena().used();
        let (vc, dir) = match &self.mm.vision {
            Some((vc, _)) => (vc.clone(), self.cfg.model_dir.clone()),
            None => return Err(RuntimeError::Protocol("vision config vanished".into())),
        };
        // On backends whose tensors live in device memory the encoder's allocations are carved
        // out of the leased `vision` region itself (weights too, unless they stay resident:
        // resident weights outlive the loan, so they are allocated beside the arena).
        let (region_off, region_len) = self.kv.arena().vision_range()?;
        let keep = self.keep_resident();
        let mut tower: Option<ResidentTower<B>> = self.mm.tower.take();
        let loaded = tower.is_none();
        let mut host_only = None;
        if tower.is_none() {
            let host = VisionTower::load_with_config(&dir, vc).map_err(vision_error)?;
            if keep {
                let device = host.upload(&self.backend).map_err(vision_error)?;
                tower = Some(ResidentTower { host, device });
            } else {
                host_only = Some(host);
            }
        }
        let parent = self.kv.arena().parent();
        self.backend
            .begin_region_allocations(parent, region_off, region_len)?;
        let t = Instant::now();
        let run = (|| -> Result<Vec<f32>> {
            let uploaded;
            let (host, device) = match (&tower, &host_only) {
                (Some(r), _) => (&r.host, &r.device),
                (None, Some(h)) => {
                    uploaded = h.upload(&self.backend).map_err(vision_error)?;
                    (h, &uploaded)
                }
                (None, None) => {
                    return Err(RuntimeError::Protocol(
                        "no vision tower to encode with".into(),
                    ))
                }
            };
            // The encoder's bytes are accounted against the region: the weights held on the
            // backend inside the loan + the workspace estimate.
            let in_loan = if weights > 0 { host.weight_bytes() } else { 0 };
            if in_loan + ws > loan {
                return Err(RuntimeError::Protocol(format!(
                    "vision encoder needs {} bytes, the loan has {loan}",
                    in_loan + ws
                )));
            }
            host.encode_with(&self.backend, device, img.preprocessed())
                .map_err(vision_error)
        })();
        // Every allocation made inside the region has been dropped by now (the encoder's
        // intermediates inside `encode_with`, a non-resident tower at the end of `run`).
        let report = self.backend.end_region_allocations()?;
        if report.live_count > 0 {
            return Err(RuntimeError::Protocol(format!(
                "{} allocations outlived the vision loan (a bug: the region returns to the KV pool)",
                report.live_count
            )));
        }
        let rows = run?;
        let encode_seconds = t.elapsed().as_secs_f64();
        if loaded {
            self.mm.stats.weight_loads += 1;
        }
        match tower.take() {
            Some(t) if keep => {
                self.mm.stats.resident_weight_bytes = t.host.weight_bytes() as u64;
                self.mm.tower = Some(t);
            }
            _ => self.mm.stats.resident_weight_bytes = 0,
        }
        self.mm.stats.images += 1;
        self.mm.stats.peak_loan_bytes = self.mm.stats.peak_loan_bytes.max(loan as u64);
        self.mm.stats.loans.push(LoanRecord {
            image: i,
            grid_thw: img.grid_thw(),
            tokens: img.n_tokens(),
            loan_bytes: loan,
            weight_bytes: weights,
            workspace_bytes: ws,
            arena_used_text: text_used,
            arena_used_during: during,
            arena_used_after: 0,
            weights_loaded: loaded,
            encode_seconds,
            region_peak_bytes: report.peak_bytes,
        });
        Ok(rows)
    }

    /// Starts a fresh session with a multimodal prompt: `tokens` holds one run of
    /// `images[i].n_tokens()` `<|image_pad|>` tokens per image, in order. Encodes the images
    /// (arena loans), then prefills in chunks; returns the last row's logits `[V]`. Continue
    /// with [`Engine::decode_step`] (positions continue at the prompt's `next_position`).
    pub fn start_session_multimodal(
        &mut self,
        tokens: &[u32],
        images: &[ImageInput],
    ) -> Result<Vec<f32>> {
        self.check_tokens(tokens)?;
        let grids = self.check_image_runs(tokens, images)?;
        let pad = self.vision_config()?.image_token_id;
        let keys = row_keys(tokens, pad, images);
        let rows = self.encode_images(images)?;
        self.prefill_multimodal(tokens, &keys, &grids, &rows, 0, false)
    }

    /// Checks the prompt's placeholder runs against the images (before any work); returns the
    /// grids.
    fn check_image_runs(
        &mut self,
        tokens: &[u32],
        images: &[ImageInput],
    ) -> Result<Vec<[usize; 3]>> {
        let vc = self.vision_config()?.clone();
        let grids: Vec<[usize; 3]> = images.iter().map(ImageInput::grid_thw).collect();
        mrope_positions(tokens, &grids, &vc, 0)
            .map_err(|e| RuntimeError::InvalidRequest(format!("image placeholders: {e}")))?;
        Ok(grids)
    }

    /// Prefills `tokens` with the image rows at M-RoPE positions from row `start` on (rows
    /// before it are the session's, reused by the prompt cache; 0 starts a fresh session).
    /// `rows` holds the vision rows of the placeholders at or after `start`, in order. Saves the
    /// prompt checkpoint after all but the last row (when `checkpoint`), so the same images and
    /// text again reuse everything but the last row. The session's cache keys of image rows are
    /// [`row_keys`] (never a text token id), so a text-only prompt never matches them.
    fn prefill_multimodal(
        &mut self,
        tokens: &[u32],
        keys: &[u32],
        grids: &[[usize; 3]],
        rows: &[f32],
        start: usize,
        checkpoint: bool,
    ) -> Result<Vec<f32>> {
        let vc = self.vision_config()?.clone();
        let h = self.config.hidden_size();
        let pad = vc.image_token_id;
        let n_pad = tokens[start..].iter().filter(|&&t| t == pad).count();
        if rows.len() != n_pad * h || keys.len() != tokens.len() || start >= tokens.len() {
            return Err(RuntimeError::InvalidRequest(format!(
                "{n_pad} image tokens after row {start} of {} but {} embedding rows",
                tokens.len(),
                rows.len() / h.max(1)
            )));
        }
        let pos = mrope_positions(tokens, grids, &vc, 0)
            .map_err(|e| RuntimeError::InvalidRequest(format!("image placeholders: {e}")))?;
        if start == 0 {
            self.reset()?;
        }
        self.mm.positions.set(pos.positions, pos.rope_delta);
        self.kv.set_planned_tokens(tokens.len());
        self.kv.set_phase(&self.backend, Phase::Prefill)?;
        let body = tokens.len() - 1;
        let chunk = self.cfg.prefill_chunk.max(1);
        // Chunk boundaries: every `chunk` rows from `start`, and one at `body` when the
        // checkpoint is taken there.
        let mut bounds: Vec<usize> = (start..tokens.len()).step_by(chunk).collect();
        if checkpoint && body > start && !bounds.contains(&body) {
            bounds.push(body);
            bounds.sort_unstable();
        }
        bounds.push(tokens.len());
        let mut used_rows = 0usize;
        let mut last = Vec::new();
        for (i, w) in bounds.windows(2).enumerate() {
            let (lo, hi) = (w[0], w[1]);
            let c = &tokens[lo..hi];
            let _span = tracing::debug_span!("mm_prefill_chunk", i, len = c.len()).entered();
            let due = checkpoint && body > 0 && lo == body;
            if due && self.prompt_cp.as_ref().is_none_or(|cp| cp.pos != body) {
                self.save_prompt_checkpoint()?;
            }
            let k = c.iter().filter(|&&t| t == pad).count();
            let chunk_rows = &rows[used_rows * h..(used_rows + k) * h];
            used_rows += k;
            let want = if hi == tokens.len() {
                LogitRows::Last
            } else {
                LogitRows::None
            };
            let step = self.step_multimodal(c, pad, chunk_rows, want)?;
            // Image rows depend on pixels the token ids do not show: the session records their
            // cache keys instead.
            let n = self.session_tokens.len();
            self.session_tokens[n - c.len()..].copy_from_slice(&keys[lo..hi]);
            if self.model.has_mtp() {
                let image = ImageEmbeds {
                    token_id: pad,
                    rows: chunk_rows,
                };
                self.mtp_prefill_chunk_with(c, Some(image), &step.hidden, LogitRows::None)?;
            }
            if let Some(l) = step.logits {
                last = l;
            }
            if let Some(cb) = self.prefill_progress.as_mut() {
                cb(hi, tokens.len());
            }
        }
        if !checkpoint {
            self.prompt_cp = None;
        }
        Ok(last)
    }

    /// One prefill step with image rows (the multimodal twin of `Engine::step_full`).
    fn step_multimodal(
        &mut self,
        tokens: &[u32],
        pad: u32,
        rows: &[f32],
        want: LogitRows,
    ) -> Result<StepOut<B>> {
        let p0 = self.kv.committed_tokens();
        let positions = self.mm.positions.range(p0, tokens.len());
        let checkpoint = if self.cfg.checkpoint_steps {
            Some(self.state.checkpoint(&self.backend)?)
        } else {
            None
        };
        self.kv
            .begin_step(&self.backend, AttentionPhase::Prefill, tokens.len())?;
        let out = self.model.forward_multimodal(
            &self.backend,
            tokens,
            ImageEmbeds {
                token_id: pad,
                rows,
            },
            &positions,
            AttentionPhase::Prefill,
            &mut self.state,
            &mut self.kv,
            want,
        );
        let failed = match out {
            Ok(o) => match self.kv.finish_step(&self.backend) {
                Ok(()) => Ok(o),
                Err(e) => Err(e),
            },
            Err(e) => {
                self.kv.abort_step(&self.backend);
                Err(from_model(e))
            }
        };
        let out = match failed {
            Ok(o) => o,
            Err(e) => {
                if let Some(cp) = &checkpoint {
                    let _ = self.state.restore_from(&self.backend, cp);
                }
                self.session_ok = checkpoint.is_some();
                return Err(e);
            }
        };
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

    /// [`Engine::generate`] with images: `req.prompt` (tokens, or chat/text rendered and
    /// tokenized) must hold one run of `images[i].n_tokens()` `<|image_pad|>` tokens per image
    /// (see [`Engine::chat_tokens_with_images`]). Encodes the images through arena loans, then
    /// prefills and decodes in a fresh session (plain or MTP-speculative as configured).
    /// With `req.reuse_prefix` the prompt cache applies as for text ([`Engine::generate`]): image
    /// rows match by the image's content hash and row, so the same images (and text) again reuse
    /// the session's KV and recurrent state, and images wholly inside the reused prefix are not
    /// encoded again. Errors before the prefill
    /// ([`RuntimeError::ImageTooLarge`], [`RuntimeError::Image`], placeholder mismatches) leave
    /// the previous session as it was.
    pub fn generate_multimodal(
        &mut self,
        req: &GenerateRequest,
        images: &[ImageInput],
        mut on_token: impl FnMut(TokenEvent<'_>) -> Flow,
    ) -> Result<GenerateResult> {
        let mut on_token = |ev: TokenEvent<'_>| on_token(ev);
        let mut sampler = Sampler::new(req.sampling)?;
        let prompt = self.tokenize(&req.prompt)?;
        self.check_tokens(&prompt)?;
        let grids = self.check_image_runs(&prompt, images)?;
        let em = self.begin_generate(req, &prompt);
        let t = Instant::now();
        let pad = self.vision_config()?.image_token_id;
        let keys = row_keys(&prompt, pad, images);
        if req.n_predict == 0 {
            self.encode_images(images)?;
            return Ok(self.result(prompt, em.generated, em.text, StopReason::Length, 0));
        }
        // Encode before touching the session (an image error leaves it as it was), only the
        // images that reach past the reusable prefix, keeping their rows from there on.
        let reusable = if req.reuse_prefix {
            self.reusable_prefix(&keys)
        } else {
            0
        };
        let runs = image_runs(&prompt, pad, images);
        let mut encoded = self.encode_rows_after(images, &runs, reusable)?;
        let cached = if reusable > 0 {
            self.reuse_prefix(&keys)?
        } else {
            0
        };
        if cached != reusable {
            // The restore failed (the session was reset): encode what the prefix held too.
            encoded = self.encode_rows_after(images, &runs, cached)?;
        }
        let h = self.config.hidden_size();
        let mut rows = Vec::new();
        let mut at = 0usize;
        for r in runs.iter().filter(|r| r.end > cached) {
            let n = r.end - r.start;
            let skip = cached.saturating_sub(r.start).min(n);
            rows.extend_from_slice(&encoded[(at + skip) * h..(at + n) * h]);
            at += n;
        }
        let last =
            self.prefill_multimodal(&prompt, &keys, &grids, &rows, cached, req.reuse_prefix)?;
        self.stats.prefill_tokens = (prompt.len() - cached) as u64;
        self.stats.prefill_seconds = t.elapsed().as_secs_f64();
        self.decode_and_finish(req, prompt, em, last, cached, &mut sampler, &mut on_token)
    }
}

/// The row range of each image's placeholder run in `tokens` (images in order).
fn image_runs(tokens: &[u32], pad: u32, images: &[ImageInput]) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::with_capacity(images.len());
    let mut i = 0usize;
    for img in images {
        while i < tokens.len() && tokens[i] != pad {
            i += 1;
        }
        let end = (i + img.n_tokens()).min(tokens.len());
        out.push(i..end);
        i = end;
    }
    out
}

/// The prompt cache's key of every row: the token id for text, and for the placeholder rows of
/// image j, row r of its run: `0x8000_0000 | hash31(image j's content hash, r)` — above every
/// vocabulary id, so text never matches an image row, and two images match row by row only
/// when their content hashes (64-bit) agree.
pub(crate) fn row_keys(tokens: &[u32], pad: u32, images: &[ImageInput]) -> Vec<u32> {
    use std::hash::{Hash, Hasher};
    let mut keys = tokens.to_vec();
    for (img, run) in images.iter().zip(image_runs(tokens, pad, images)) {
        for (r, k) in keys[run].iter_mut().enumerate() {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (img.content_hash(), r).hash(&mut h);
            *k = 0x8000_0000 | (h.finish() as u32 & 0x7fff_ffff);
        }
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_map_continues_with_the_delta() {
        let mut m = PositionMap::default();
        assert_eq!(m.range(3, 2), vec![[3; 3], [4; 3]]);
        m.set(vec![[0; 3], [1, 1, 1], [1, 1, 2], [3; 3]], -1);
        assert_eq!(m.range(2, 4), vec![[1, 1, 2], [3; 3], [3; 3], [4; 3]]);
        m.clear();
        assert_eq!(m.range(5, 1), vec![[5; 3]]);
    }

    #[test]
    fn weight_bytes_from_config_match_the_loaded_tower() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-vl");
        let tower = VisionTower::load(&dir).expect("tower");
        assert_eq!(vision_weight_bytes(tower.config()), tower.weight_bytes());
        let small = vision_workspace_bytes(tower.config(), [1, 4, 4]);
        let big = vision_workspace_bytes(tower.config(), [1, 8, 16]);
        assert!(small > 0 && big > 4 * small, "{small} {big}");
    }
}
