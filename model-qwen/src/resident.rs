//! [`ResidentKv`]: an [`AttentionKv`] that keeps every page of every attention layer resident
//! in one device buffer per layer (tests and the `logits` reference path).
//!
//! Rows are written with `KvOps::kv_write` at page-geometry offsets; attention is one
//! `attention_begin` / `attention_accumulate` (a single span over all the layer's pages) /
//! `attention_finish`.

use crate::attention_kv::{AttentionKv, AttentionPhase};
use crate::config::QwenConfig;
use kvstream_memory_contracts::attention::{
    attention_accumulate, attention_begin, attention_finish, AttentionShape,
};
use kvstream_memory_contracts::backend::DeviceBuffer;
use kvstream_memory_contracts::error::{AttentionError, GeometryError, OpError, SpanError};
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::ModelBackend;

/// Errors of [`ResidentKv`].
#[derive(Debug, thiserror::Error)]
pub enum ResidentKvError {
    #[error("attention layer {layer} is out of range ({layers} layers)")]
    Layer { layer: usize, layers: usize },
    #[error("k/v/q shape: {0}")]
    Shape(String),
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error(transparent)]
    Span(#[from] SpanError),
    #[error(transparent)]
    Attention(#[from] AttentionError),
    #[error(transparent)]
    Op(#[from] OpError),
}

/// Options of a [`ResidentKv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResidentKvOptions {
    pub k_type: KvType,
    pub v_type: KvType,
    /// Tokens per page (a power of two).
    pub tokens_per_page: usize,
}

impl Default for ResidentKvOptions {
    fn default() -> Self {
        Self {
            k_type: KvType::F32,
            v_type: KvType::F32,
            tokens_per_page: 64,
        }
    }
}

struct LayerKv<B: ModelBackend> {
    buf: Option<B::Buffer>,
    pages: usize,
    len: usize,
}

/// All-resident KV pages, one growable buffer per attention layer.
pub struct ResidentKv<B: ModelBackend> {
    geometry: PageGeometry,
    q_heads: usize,
    scale: f32,
    layers: Vec<LayerKv<B>>,
}

impl<B: ModelBackend> std::fmt::Debug for ResidentKv<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResidentKv")
            .field("geometry", &self.geometry)
            .field("layers", &self.layers.len())
            .finish()
    }
}

impl<B: ModelBackend> ResidentKv<B> {
    /// Empty KV for `layers` attention layers of the model described by `cfg` (use
    /// `cfg.n_attention_layers() + 1` to include the MTP layer).
    pub fn new(
        cfg: &QwenConfig,
        layers: usize,
        opts: ResidentKvOptions,
    ) -> Result<Self, ResidentKvError> {
        let geometry = PageGeometry::new(
            opts.tokens_per_page,
            cfg.num_key_value_heads,
            cfg.head_dim,
            opts.k_type,
            opts.v_type,
        )?;
        Ok(Self {
            geometry,
            q_heads: cfg.num_attention_heads,
            scale: cfg.attention_scale(),
            layers: (0..layers)
                .map(|_| LayerKv {
                    buf: None,
                    pages: 0,
                    len: 0,
                })
                .collect(),
        })
    }

    /// The page geometry.
    pub fn geometry(&self) -> &PageGeometry {
        &self.geometry
    }

    /// Forgets tokens past `len` of every layer (speculative rollback). No-op for shorter layers.
    pub fn truncate(&mut self, len: usize) {
        for l in &mut self.layers {
            l.len = l.len.min(len);
        }
    }

    /// Forgets tokens past `len` of one layer.
    pub fn truncate_layer(&mut self, layer: usize, len: usize) -> Result<(), ResidentKvError> {
        let layers = self.layers.len();
        let l = self
            .layers
            .get_mut(layer)
            .ok_or(ResidentKvError::Layer { layer, layers })?;
        l.len = l.len.min(len);
        Ok(())
    }

    fn ensure_pages(&mut self, b: &B, layer: usize, tokens: usize) -> Result<(), ResidentKvError> {
        let need = self.geometry.pages_for(tokens);
        let pb = self.geometry.page_bytes();
        let l = &mut self.layers[layer];
        if need <= l.pages && l.buf.is_some() {
            return Ok(());
        }
        let pages = need.max(l.pages * 2).max(1);
        let new = b.alloc_buffer(pages * pb)?;
        if let Some(old) = &l.buf {
            let mut bytes = vec![0u8; old.len()];
            b.read_buffer(old, 0, &mut bytes)?;
            b.write_buffer(&new, 0, &bytes)?;
        }
        l.buf = Some(new);
        l.pages = pages;
        Ok(())
    }
}

impl<B: ModelBackend> AttentionKv<B> for ResidentKv<B> {
    type Error = ResidentKvError;

    fn append_and_attend(
        &mut self,
        backend: &B,
        layer: usize,
        _phase: AttentionPhase,
        q: &B::Tensor,
        k: &B::Tensor,
        v: &B::Tensor,
    ) -> Result<B::Tensor, ResidentKvError> {
        use kvstream_memory_contracts::backend::DeviceTensor;
        let layers = self.layers.len();
        if layer >= layers {
            return Err(ResidentKvError::Layer { layer, layers });
        }
        let rv = self.geometry.row_values();
        if rv == 0 || k.numel() % rv != 0 || k.numel() != v.numel() || k.numel() == 0 {
            return Err(ResidentKvError::Shape(format!(
                "k {:?} / v {:?} are not [T, {rv}]",
                k.dims(),
                v.dims()
            )));
        }
        let n = k.numel() / rv;
        let _s = tracing::trace_span!("resident_kv", layer, n).entered();
        let first = self.layers[layer].len;
        let total = first + n;
        self.ensure_pages(backend, layer, total)?;
        let g = self.geometry;
        let rows: Vec<(usize, usize)> = (first..total)
            .map(|t| (g.k_row_offset(0, 0, t), g.v_row_offset(0, 0, t)))
            .collect();
        let l = &mut self.layers[layer];
        let buf = l
            .buf
            .as_ref()
            .ok_or_else(|| ResidentKvError::Shape("no buffer".into()))?;
        backend.kv_write(k, v, &g, buf, &rows)?;
        l.len = total;
        let plan = SpanPlan::new(
            g,
            buf.len(),
            0,
            total,
            vec![Span {
                source: SpanSource::Resident {
                    layer,
                    first_page: 0,
                },
                first_token: 0,
                count: total,
                offset: 0,
            }],
        )?;
        let shape = AttentionShape {
            q_heads: self.q_heads,
            kv_heads: g.kv_heads(),
            head_dim: g.head_dim(),
            width: n,
            total,
            scale: self.scale,
            k_type: g.k_type(),
            v_type: g.v_type(),
        };
        let mut acc = attention_begin(backend, shape)?;
        attention_accumulate(backend, &mut acc, q, buf, &plan)?;
        Ok(attention_finish(backend, acc)?)
    }

    fn len(&self, layer: usize) -> usize {
        self.layers.get(layer).map_or(0, |l| l.len)
    }
}
