//! Multimodal prefill: [`QwenModel::forward_multimodal`] runs the text model over token
//! embeddings in which every `<|image_pad|>` row is replaced, in order, by a vision-tower output
//! row (HF `masked_scatter`), with M-RoPE positions from [`crate::rope_index`].

use super::{ForwardOutput, LogitRows, QwenModel, GDN_CHUNK};
use crate::attention_kv::{AttentionKv, AttentionPhase};
use crate::error::ModelError;
use crate::layers::{GdnRun, Residual};
use crate::state::RecurrentState;
use kvstream_memory_contracts::ops::{DeltaMode, ModelBackend, Position3};

/// Vision embeddings to splice into a forward.
#[derive(Debug, Clone, Copy)]
pub struct ImageEmbeds<'a> {
    /// The placeholder token (`image_token_id`) whose embedding rows are replaced.
    pub token_id: u32,
    /// `[n_placeholders, hidden]` row-major: one row per placeholder token of this call, in
    /// order (for a chunked prefill, the rows of the placeholders inside the chunk).
    pub rows: &'a [f32],
}

impl<B: ModelBackend> QwenModel<B> {
    /// Like [`QwenModel::forward`] (without checkpoints), but the embedding rows of the
    /// placeholder tokens are the given vision rows. `positions` come from
    /// [`crate::rope_index::mrope_positions`]. The number of rows must equal the number of
    /// placeholder tokens in `tokens` (else [`ModelError::Input`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_multimodal<K: AttentionKv<B>>(
        &self,
        b: &B,
        tokens: &[u32],
        image: ImageEmbeds<'_>,
        positions: &[Position3],
        phase: AttentionPhase,
        state: &mut RecurrentState<B>,
        kv: &mut K,
        logits: LogitRows,
    ) -> Result<ForwardOutput<B>, ModelError> {
        let t = tokens.len();
        let _s = tracing::debug_span!("qwen_forward_multimodal", t, ?phase).entered();
        self.check_inputs(tokens, positions)?;
        if state.layers.len() != self.config.n_linear_layers() {
            return Err(ModelError::Input(format!(
                "recurrent state has {} layers, the model {} GDN layers",
                state.layers.len(),
                self.config.n_linear_layers()
            )));
        }
        let mut x = Residual::Sum(self.embed_with_images(b, tokens, &image)?);
        let mode = if t == 1 {
            DeltaMode::Recurrent
        } else {
            DeltaMode::Chunked { chunk: GDN_CHUNK }
        };
        for layer in &self.layers {
            x = layer.forward(
                b,
                &self.config,
                x,
                positions,
                phase,
                &mut state.layers,
                kv,
                Some(GdnRun::Whole(mode)),
            )?;
        }
        let (_, hidden) = x.into_norm(b, &self.norm, self.config.rms_norm_eps)?;
        let logits = self.logits(b, &hidden, logits)?;
        Ok(ForwardOutput { hidden, logits })
    }

    /// The input embeddings of `tokens` with every `image.token_id` row replaced, in order, by
    /// the next row of `image.rows` (host gather, one upload).
    fn embed_with_images(
        &self,
        b: &B,
        tokens: &[u32],
        image: &ImageEmbeds<'_>,
    ) -> Result<B::Tensor, ModelError> {
        let h = self.config.hidden_size;
        let n_pad = tokens.iter().filter(|&&x| x == image.token_id).count();
        if image.rows.len() != n_pad * h {
            return Err(ModelError::Input(format!(
                "{n_pad} image placeholder tokens need {} embedding values ({n_pad} × {h}), got {}",
                n_pad * h,
                image.rows.len()
            )));
        }
        let mut vals = self.embed.gather(tokens)?;
        let mut next = image.rows.chunks_exact(h);
        for (row, &tok) in vals.chunks_exact_mut(h).zip(tokens) {
            if tok == image.token_id {
                if let Some(src) = next.next() {
                    row.copy_from_slice(src);
                }
            }
        }
        Ok(b.tensor_from_f32(&vals, &[tokens.len(), h])?)
    }

    /// [`QwenModel::mtp_forward`] for rows whose next token is an image placeholder: those rows
    /// embed the image's vision rows (`image.rows`, one per placeholder of `next_tokens`, in
    /// order) instead of the `<|image_pad|>` id, as the target's own input did.
    pub fn mtp_forward_multimodal<K: AttentionKv<B>>(
        &self,
        b: &B,
        next_tokens: &[u32],
        image: ImageEmbeds<'_>,
        hidden: &B::Tensor,
        positions: &[Position3],
        kv: &mut K,
        logits: LogitRows,
    ) -> Result<ForwardOutput<B>, ModelError> {
        self.check_inputs(next_tokens, positions)?;
        let e = self.embed_with_images(b, next_tokens, &image)?;
        self.mtp_forward_embedded(b, e, hidden, positions, kv, logits)
    }
}
