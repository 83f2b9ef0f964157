//! [`QwenModel`]: loading and the hybrid forward pass, plus the MTP head (qwen-spec §3, §5).

use crate::attention_kv::{AttentionKv, AttentionPhase};
use crate::config::{LayerType, QwenConfig};
use crate::embedding::HostEmbedding;
use crate::error::ModelError;
use crate::layers::{GdnRun, Layer, Loader, Mixer, Residual};
use crate::quant::role::Role;
use crate::quant::{LoadReport, WeightPolicy};
use crate::state::{GdnState, RecurrentState};
use crate::weights::Checkpoint;
use kvstream_memory_contracts::backend::{Backend, DeviceTensor};
use kvstream_memory_contracts::ops::{DeltaMode, ModelBackend, Position3};
use std::path::Path;

mod multimodal;
pub use multimodal::ImageEmbeds;

/// Chunk length of the chunked GDN form used for multi-token calls.
pub const GDN_CHUNK: usize = 64;

/// Text positions `[p, p, p]` for `n` tokens starting at position `start`.
pub fn text_positions(start: usize, n: usize) -> Vec<Position3> {
    (start..start + n).map(|p| [p as u32; 3]).collect()
}

/// What to load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadOptions {
    /// Load the MTP head (`mtp.*`) when the config has one.
    pub load_mtp: bool,
    /// Formats of the weights on the device (default: as stored).
    pub weights: WeightPolicy,
    /// Load linears that share their input (MLP gate/up, GDN `in_proj_qkv`/`in_proj_z`,
    /// attention q/k/v) as one fused weight each: `None` (default) = on unless the environment
    /// says `KVSTREAM_FUSE_PROJ=0` ([`crate::FUSE_ENV`]). Results are the same on the CPU
    /// backend bit for bit, and so are the load report and the memory plan.
    pub fuse_projections: Option<bool>,
}

/// Which rows of the final hidden state get logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// No logits.
    None,
    /// Only the last row (`[1, V]`).
    Last,
    /// Every row (`[T, V]`).
    All,
}

/// Result of a forward.
#[derive(Debug)]
pub struct ForwardOutput<B: Backend> {
    /// `[T, H]` after the final norm (after `mtp.norm` for the MTP head).
    pub hidden: B::Tensor,
    /// Logits of the requested rows.
    pub logits: Option<B::Tensor>,
}

struct Mtp<B: ModelBackend> {
    fc: B::Weight,
    pre_fc_norm_embedding: B::Weight,
    pre_fc_norm_hidden: B::Weight,
    norm: B::Weight,
    layer: Layer<B>,
}

/// A loaded Qwen3.5/3.8 text model (with its optional MTP head).
///
/// The embedding table stays in host memory ([`HostEmbedding`]); `lm_head` is always a device
/// weight of its own (for tied models, a copy of the embedding in the head format).
pub struct QwenModel<B: ModelBackend> {
    config: QwenConfig,
    embed: HostEmbedding,
    norm: B::Weight,
    lm_head: B::Weight,
    layers: Vec<Layer<B>>,
    mtp: Option<Mtp<B>>,
    weight_bytes: usize,
    mtp_weight_bytes: usize,
    report: LoadReport,
    fused_projections: usize,
}

impl<B: ModelBackend> std::fmt::Debug for QwenModel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenModel")
            .field("layers", &self.layers.len())
            .field("mtp", &self.mtp.is_some())
            .field("weight_bytes", &self.weight_bytes)
            .finish()
    }
}

impl<B: ModelBackend> QwenModel<B> {
    /// Loads `dir` (config.json + safetensors, single or sharded). Every tensor is checked for
    /// presence and shape; errors name the tensor and the expected shape.
    pub fn load(backend: &B, dir: &Path, opts: &LoadOptions) -> Result<Self, ModelError> {
        let _s = tracing::info_span!("qwen_load", dir = %dir.display()).entered();
        let c = QwenConfig::from_model_dir(dir)?;
        crate::quant::fp8::check_quantization_config(dir)?;
        let ck = Checkpoint::open(dir)?;
        Self::from_source(backend, c, &ck, opts)
    }

    /// A model of geometry `config` with random weights of `dtype` generated in host memory and
    /// uploaded through `LinearOps::load_weight` (no file is read or written). The values depend
    /// only on `seed` and the tensor names; the MTP head is created when `opts.load_mtp` is set
    /// and the config has one.
    ///
    /// With a quantized `opts.weights` policy the quantized matrices are generated directly as
    /// random codes + scales (same value scale), never as floats. A quantized `dtype` means
    /// "bf16 storage, policy `WeightPolicy::new(dtype)`" unless `opts.weights.format` is set.
    /// The embedding rows are generated on the host on demand.
    pub fn synthetic(
        backend: &B,
        config: &QwenConfig,
        dtype: kvstream_memory_contracts::backend::WeightDType,
        seed: u64,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let _s = tracing::info_span!("qwen_synthetic", %dtype, seed).entered();
        let mut opts = *opts;
        if dtype.is_quantized() && opts.weights.format.is_none() {
            opts.weights.format = Some(dtype);
        }
        let src = crate::synthetic::SyntheticWeights { dtype, seed };
        Self::from_source(backend, config.clone(), &src, &opts)
    }

    /// Loads every tensor of `c` from `ck` (a checkpoint or synthetic weights).
    fn from_source(
        backend: &B,
        c: QwenConfig,
        ck: &dyn crate::synthetic::TensorSource,
        opts: &LoadOptions,
    ) -> Result<Self, ModelError> {
        let prefix = if ck.contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let mut l = Loader::new(backend, ck, opts.weights);
        l.fuse = crate::fused::fuse_enabled(opts.fuse_projections);
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed_name = format!("{prefix}embed_tokens.weight");
        let embed = ck.host_embedding(&embed_name, &[v, h])?;
        l.report.host_embedding_bytes = embed.host_bytes();
        let norm = l.get(&format!("{prefix}norm.weight"), &[h])?;
        // Tied models: the head is a device copy of the embedding (in the head format), unless
        // the checkpoint carries its own `lm_head.weight` (kvstream-quantized checkpoints).
        let head_name = if c.tie_word_embeddings && !ck.contains("lm_head.weight") {
            embed_name.as_str()
        } else {
            "lm_head.weight"
        };
        let lm_head = l.load(head_name, &[v, h], Role::Head)?;
        let (mut gi, mut ai) = (0, 0);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for (i, ty) in c.layer_types.iter().enumerate() {
            let full = *ty == LayerType::Full;
            let idx = if full { ai } else { gi };
            layers.push(Layer::load(
                &mut l,
                &format!("{prefix}layers.{i}."),
                &c,
                full,
                idx,
            )?);
            if full {
                ai += 1;
            } else {
                gi += 1;
            }
        }
        let before_mtp = l.report.device_weight_bytes;
        let mtp = if opts.load_mtp && c.mtp_num_hidden_layers > 0 {
            l.linear_role = Role::Head;
            Some(Mtp {
                fc: l.load("mtp.fc.weight", &[h, 2 * h], Role::Head)?,
                pre_fc_norm_embedding: l.get("mtp.pre_fc_norm_embedding.weight", &[h])?,
                pre_fc_norm_hidden: l.get("mtp.pre_fc_norm_hidden.weight", &[h])?,
                norm: l.get("mtp.norm.weight", &[h])?,
                layer: Layer::load(&mut l, "mtp.layers.0.", &c, true, c.n_attention_layers())?,
            })
        } else {
            None
        };
        let weight_bytes = l.report.device_weight_bytes;
        let mtp_weight_bytes = weight_bytes - before_mtp;
        tracing::info!(
            quantized = l.report.quantized,
            kept = l.report.kept,
            fallback = l.report.fallback.len(),
            fused = l.fused,
            device_bytes = weight_bytes,
            host_embedding_bytes = l.report.host_embedding_bytes,
            "weights loaded"
        );
        Ok(Self {
            config: c,
            embed,
            norm,
            lm_head,
            layers,
            mtp,
            weight_bytes,
            mtp_weight_bytes,
            report: l.report,
            fused_projections: l.fused,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &QwenConfig {
        &self.config
    }
    /// True when the MTP head is loaded.
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }
    /// Bytes of all device weights (as stored on the device; the host-resident embedding table
    /// is not included, see [`QwenModel::load_report`]).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// What the load did: quantized/kept counts, fallbacks, device and host bytes.
    pub fn load_report(&self) -> &LoadReport {
        &self.report
    }

    /// Fused projection weights (each replacing 2 or 3 linears; 0 with fusion off).
    pub fn fused_projections(&self) -> usize {
        self.fused_projections
    }

    /// The host-resident embedding table.
    pub fn embedding(&self) -> &HostEmbedding {
        &self.embed
    }

    /// Embeddings of `ids` (`[T, H]`, f32), gathered on the host and uploaded.
    fn embed_tokens(&self, b: &B, ids: &[u32]) -> Result<B::Tensor, ModelError> {
        let vals = self.embed.gather(ids)?;
        Ok(b.tensor_from_f32(&vals, &[ids.len(), self.config.hidden_size])?)
    }

    /// Bytes of the MTP head's weights (0 when it is not loaded); included in
    /// [`QwenModel::weight_bytes`].
    pub fn mtp_weight_bytes(&self) -> usize {
        self.mtp_weight_bytes
    }

    /// Zeroed recurrent state for one sequence.
    pub fn new_recurrent_state(&self, b: &B) -> Result<RecurrentState<B>, ModelError> {
        let c = &self.config;
        let layers = (0..c.n_linear_layers())
            .map(|_| {
                Ok(GdnState {
                    conv: b.zeros(&[c.linear_conv_kernel_dim - 1, c.linear_conv_dim()])?,
                    ssm: b.zeros(&[
                        c.linear_num_value_heads,
                        c.linear_key_head_dim,
                        c.linear_value_head_dim,
                    ])?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(RecurrentState { layers })
    }

    fn check_inputs(&self, tokens: &[u32], positions: &[Position3]) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens".into()));
        }
        if tokens.len() != positions.len() {
            return Err(ModelError::Input(format!(
                "{} tokens but {} positions",
                tokens.len(),
                positions.len()
            )));
        }
        let vocab = self.config.vocab_size;
        if let Some((index, &token)) = tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(ModelError::TokenOutOfRange {
                token,
                index,
                vocab,
            });
        }
        Ok(())
    }

    fn logits(
        &self,
        b: &B,
        hidden: &B::Tensor,
        rows: LogitRows,
    ) -> Result<Option<B::Tensor>, ModelError> {
        let head = &self.lm_head;
        let t = hidden.numel() / self.config.hidden_size;
        Ok(match rows {
            LogitRows::None => None,
            LogitRows::All => Some(b.matmul(hidden, head)?),
            LogitRows::Last => Some(b.matmul(&b.rows(hidden, t - 1, 1)?, head)?),
        })
    }

    /// The main model over `tokens` (one M-RoPE position per token; text: `[p, p, p]`).
    ///
    /// GDN layers use `Chunked { chunk: 64 }` when T > 1 and `Recurrent` when T == 1. With
    /// `checkpoints`, GDN layers run token by token (recurrent) and one full [`RecurrentState`]
    /// per token (the state after that token) is pushed onto the vector.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<K: AttentionKv<B>>(
        &self,
        b: &B,
        tokens: &[u32],
        positions: &[Position3],
        phase: AttentionPhase,
        state: &mut RecurrentState<B>,
        kv: &mut K,
        logits: LogitRows,
        checkpoints: Option<&mut Vec<RecurrentState<B>>>,
    ) -> Result<ForwardOutput<B>, ModelError> {
        let t = tokens.len();
        let _s = tracing::debug_span!("qwen_forward", t, ?phase).entered();
        self.check_inputs(tokens, positions)?;
        if state.layers.len() != self.config.n_linear_layers() {
            return Err(ModelError::Input(format!(
                "recurrent state has {} layers, the model {} GDN layers",
                state.layers.len(),
                self.config.n_linear_layers()
            )));
        }
        let mut cps = match &checkpoints {
            Some(_) => Some(
                (0..t)
                    .map(|_| state.checkpoint(b))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        let mode = if t == 1 {
            DeltaMode::Recurrent
        } else {
            DeltaMode::Chunked { chunk: GDN_CHUNK }
        };
        let mut x = Residual::Sum(self.embed_tokens(b, tokens)?);
        for layer in &self.layers {
            let run = match (&layer.mixer, cps.as_mut()) {
                (Mixer::Gdn(_, gdn_index), Some(cps)) => Some(GdnRun::Checkpointed {
                    gdn_index: *gdn_index,
                    cps,
                }),
                (Mixer::Gdn(..), None) => Some(GdnRun::Whole(mode)),
                (Mixer::Attn(..), _) => None,
            };
            x = layer.forward(
                b,
                &self.config,
                x,
                positions,
                phase,
                &mut state.layers,
                kv,
                run,
            )?;
        }
        if let (Some(out), Some(cps)) = (checkpoints, cps) {
            out.extend(cps);
        }
        let (_, hidden) = x.into_norm(b, &self.norm, self.config.rms_norm_eps)?;
        let logits = self.logits(b, &hidden, logits)?;
        Ok(ForwardOutput { hidden, logits })
    }

    /// The MTP head (qwen-spec §5): `hidden` `[T, H]` rows (post final norm, or the previous MTP
    /// output when chaining), `next_tokens[i]` = the token after hidden row i, `positions` of the
    /// hidden rows. Uses attention layer `n_attention_layers` of `kv`.
    pub fn mtp_forward<K: AttentionKv<B>>(
        &self,
        b: &B,
        next_tokens: &[u32],
        hidden: &B::Tensor,
        positions: &[Position3],
        kv: &mut K,
        logits: LogitRows,
    ) -> Result<ForwardOutput<B>, ModelError> {
        self.check_inputs(next_tokens, positions)?;
        let e = self.embed_tokens(b, next_tokens)?;
        self.mtp_forward_embedded(b, e, hidden, positions, kv, logits)
    }

    /// The MTP head on the next tokens' input embeddings `e` `[T, H]`.
    pub(crate) fn mtp_forward_embedded<K: AttentionKv<B>>(
        &self,
        b: &B,
        e: B::Tensor,
        hidden: &B::Tensor,
        positions: &[Position3],
        kv: &mut K,
        logits: LogitRows,
    ) -> Result<ForwardOutput<B>, ModelError> {
        let mtp = self.mtp.as_ref().ok_or(ModelError::NoMtp)?;
        let t = positions.len();
        let _s = tracing::debug_span!("mtp_forward", t).entered();
        let (h, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        if hidden.numel() != t * h || e.numel() != t * h {
            return Err(ModelError::Input(format!(
                "hidden {:?} / embeddings {:?} are not [{t}, {h}]",
                hidden.dims(),
                e.dims()
            )));
        }
        let e = b.rms_norm(&e, &mtp.pre_fc_norm_embedding, eps, 1.0)?;
        let hn = b.rms_norm(hidden, &mtp.pre_fc_norm_hidden, eps, 1.0)?;
        let hn = b.reshape(hn, &[t, h])?;
        let x = b.matmul(&b.concat_cols(&e, &hn)?, &mtp.fc)?;
        let x = mtp.layer.forward(
            b,
            &self.config,
            Residual::Sum(x),
            positions,
            AttentionPhase::Mtp,
            &mut [],
            kv,
            None,
        )?;
        let (_, out) = x.into_norm(b, &mtp.norm, eps)?;
        let logits = self.logits(b, &out, logits)?;
        Ok(ForwardOutput {
            hidden: out,
            logits,
        })
    }
}
