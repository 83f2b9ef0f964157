//! The compute surface a model forward needs, split by area.
//!
//! Every op takes and returns f32 activation tensors (`B::Tensor`, row-major) and reads weights in
//! their stored dtype (`B::Weight`). Shapes are given explicitly where the op needs them; an op
//! that gets inconsistent shapes returns [`OpError::Shape`], never panics. The CPU backend is the
//! reference implementation of every op; other backends must match it within dtype tolerances.
//!
//! [`ModelBackend`] is the sum of all of them plus the memory contracts: what `model-qwen` and
//! `runtime` are generic over.

use crate::attention::StreamedAttention;
use crate::backend::{Backend, WeightDType};
use crate::error::OpError;
use crate::host::PinnedHost;
use crate::kv::geometry::PageGeometry;
use crate::transfer::{CopyEngine, DeviceMemory};
use std::sync::Arc;

/// Host bytes of a stored weight (often a memory-mapped safetensors file). Backends either keep
/// a reference (CPU: zero copy) or upload the bytes (GPU).
#[derive(Clone)]
pub struct WeightData {
    /// The backing bytes (e.g. an `Arc<Mmap>`), shared.
    pub source: Arc<dyn AsRef<[u8]> + Send + Sync>,
    /// Offset of the tensor's first byte inside `source`.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl std::fmt::Debug for WeightData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightData")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl WeightData {
    /// Owned bytes (tests, synthetic weights).
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            source: Arc::new(bytes),
            offset: 0,
            len,
        }
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        let all: &[u8] = (*self.source).as_ref();
        &all[self.offset..self.offset + self.len]
    }
}

/// Tensor creation, transfer and layout ops.
pub trait TensorOps: Backend {
    /// Uploads `data` as a tensor of `dims` (product must equal `data.len()`).
    fn tensor_from_f32(&self, data: &[f32], dims: &[usize]) -> Result<Self::Tensor, OpError>;
    /// Downloads a tensor (synchronises).
    fn tensor_to_f32(&self, t: &Self::Tensor) -> Result<Vec<f32>, OpError>;
    /// A zero tensor.
    fn zeros(&self, dims: &[usize]) -> Result<Self::Tensor, OpError>;
    /// A copy of `src` (recurrent-state checkpoints).
    fn copy_tensor(&self, src: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// Copies `src` into `dst` (same element count).
    fn copy_into(&self, dst: &mut Self::Tensor, src: &Self::Tensor) -> Result<(), OpError>;
    /// Same data, new dims (same element count).
    fn reshape(&self, t: Self::Tensor, dims: &[usize]) -> Result<Self::Tensor, OpError>;
    /// Element-wise `a + b` (same element count); result has `a`'s dims.
    fn add(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// `[T, A]` ++ `[T, B]` → `[T, A + B]` (MTP's concat of embedding and hidden).
    fn concat_cols(&self, a: &Self::Tensor, b: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// Views `x` `[T, groups · Σsizes]` as `[T, groups, Σsizes]` and returns, for each size `s_i`,
    /// the slice `[T, groups · s_i]` (per-head query/gate split of `q_proj`; q/k/v split of GDN).
    fn split_cols(
        &self,
        x: &Self::Tensor,
        groups: usize,
        sizes: &[usize],
    ) -> Result<Vec<Self::Tensor>, OpError>;
    /// Rows `[first, first + n)` of `x` `[T, C]` → `[n, C]`.
    fn rows(&self, x: &Self::Tensor, first: usize, n: usize) -> Result<Self::Tensor, OpError>;
}

/// Weight upload, embedding and matrix products.
pub trait LinearOps: Backend {
    /// Makes a weight of `dtype` and `dims` from host bytes (`data.len` must match).
    fn load_weight(
        &self,
        name: &str,
        dtype: WeightDType,
        dims: &[usize],
        data: WeightData,
    ) -> Result<Self::Weight, OpError>;
    /// Gathers rows of `table` `[V, H]` → `[ids.len(), H]`. Ids must be `< V`.
    fn embedding(&self, table: &Self::Weight, ids: &[u32]) -> Result<Self::Tensor, OpError>;
    /// `x` `[T, K]` times `wᵀ` (`w` is `[N, K]`) → `[T, N]`, accumulated in f32.
    fn matmul(&self, x: &Self::Tensor, w: &Self::Weight) -> Result<Self::Tensor, OpError>;
    /// A hint that a `matmul` on `w` follows soon: the backend may start moving `w`'s bytes toward
    /// its compute units (a GPU: into its L2 cache while the small kernels before that matmul
    /// leave memory idle). Never changes a result; the default does nothing.
    fn prefetch_weight(&self, w: &Self::Weight) -> Result<(), OpError> {
        let _ = w;
        Ok(())
    }
}

/// Normalisations.
pub trait NormOps: Backend {
    /// RMSNorm over the last `d = w.len()` values of each row of `x` (any element count that is a
    /// multiple of d): `y = x · rsqrt(mean(x²) + eps) · (w + unit_offset)`. Qwen's zero-centred
    /// norm uses `unit_offset = 1.0`.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        unit_offset: f32,
    ) -> Result<Self::Tensor, OpError>;
    /// The residual add and the RMSNorm that follows it, in one pass: `h = a + b` (same element
    /// count, `a`'s dims) and `y = rms_norm(h, w, eps, unit_offset)`; returns `(h, y)`, each
    /// bit-identical to [`TensorOps::add`] then [`NormOps::rms_norm`] on the same backend. The
    /// default does exactly that; a backend may fuse the two (one launch instead of two).
    fn add_rms_norm(
        &self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        unit_offset: f32,
    ) -> Result<(Self::Tensor, Self::Tensor), OpError>
    where
        Self: TensorOps,
    {
        let h = self.add(a, b)?;
        let y = self.rms_norm(&h, w, eps, unit_offset)?;
        Ok((h, y))
    }
    /// Gated RMSNorm of the GDN output: per row of `d = w.len()`,
    /// `y = x · rsqrt(mean(x²) + eps) · w · silu(z)`.
    fn gated_rms_norm(
        &self,
        x: &Self::Tensor,
        z: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, OpError>;
}

/// Rotary position configuration (partial, multimodal).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Rotated dims at the start of each head (NeoX half layout over these dims).
    pub rotary_dim: usize,
    /// Base θ.
    pub theta: f32,
    /// M-RoPE sections (t, h, w) in frequencies; they sum to `rotary_dim / 2`.
    pub mrope_section: [usize; 3],
    /// Interleaved assignment (Qwen3.5): frequency j takes h if j%3==1 (j < 3·s_h), w if j%3==2
    /// (j < 3·s_w), else t. Not interleaved: contiguous sections t, h, w.
    pub interleaved: bool,
}

impl RopeConfig {
    /// The axis (0 = t, 1 = h, 2 = w) frequency `j` takes its position from.
    pub fn axis_of(&self, j: usize) -> usize {
        if self.interleaved {
            if j % 3 == 1 && j < 3 * self.mrope_section[1] {
                1
            } else if j % 3 == 2 && j < 3 * self.mrope_section[2] {
                2
            } else {
                0
            }
        } else if j < self.mrope_section[0] {
            0
        } else if j < self.mrope_section[0] + self.mrope_section[1] {
            1
        } else {
            2
        }
    }

    /// Inverse frequency j (f32, as HF computes it).
    pub fn inv_freq(&self, j: usize) -> f32 {
        let exponent = (2 * j) as f32 / self.rotary_dim as f32;
        1.0 / self.theta.powf(exponent)
    }
}

/// A (t, h, w) M-RoPE position. Text tokens have t = h = w.
pub type Position3 = [u32; 3];

/// Rotary embeddings.
pub trait PositionOps: Backend {
    /// Applies partial (M-)RoPE to `x` `[T, heads, head_dim]` with one position per token.
    fn rope(
        &self,
        x: &Self::Tensor,
        heads: usize,
        head_dim: usize,
        positions: &[Position3],
        cfg: &RopeConfig,
    ) -> Result<Self::Tensor, OpError>;
}

/// How the gated delta rule is evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeltaMode {
    /// Token-by-token recurrence (decode).
    Recurrent,
    /// The chunked (WY) form with chunks of `chunk` tokens (prefill, multi-token).
    Chunked { chunk: usize },
}

/// Shapes of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaShape {
    pub tokens: usize,
    /// q/k heads.
    pub k_heads: usize,
    /// v heads (a multiple of k_heads; v head h uses k head h / (v_heads / k_heads)).
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
}

/// Recurrent (Gated DeltaNet) ops. States are f32.
pub trait RecurrentOps: Backend {
    /// Causal depthwise conv over `x` `[T, C]` with kernel `w` `[C, 1, K]` and state `[K-1, C]`
    /// (oldest row first, pre-conv inputs), followed by SiLU; updates the state to the last K-1
    /// inputs.
    fn causal_conv1d(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        state: &mut Self::Tensor,
    ) -> Result<Self::Tensor, OpError>;

    /// The gated delta rule (qwen-spec §3.6 steps 4–6): l2-normalises q and k (eps 1e-6), scales
    /// q by 1/sqrt(k_dim), β = sigmoid(b), g = −exp(a_log)·softplus(a + dt_bias), and runs the
    /// recurrence on `state` `[v_heads, k_dim, v_dim]`. q, k: `[T, k_heads, k_dim]`; v:
    /// `[T, v_heads, v_dim]`; a, b: `[T, v_heads]`. Returns o `[T, v_heads, v_dim]`.
    fn gated_delta_rule(
        &self,
        shape: &DeltaShape,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        a_log: &Self::Weight,
        dt_bias: &Self::Weight,
        state: &mut Self::Tensor,
        mode: DeltaMode,
    ) -> Result<Self::Tensor, OpError>;
}

/// Element-wise activations.
pub trait ActivationOps: Backend {
    /// `silu(gate) ⊙ up`.
    fn swiglu(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor, OpError>;
    /// `x ⊙ sigmoid(gate)` (the attention output gate).
    fn sigmoid_gate(&self, x: &Self::Tensor, gate: &Self::Tensor) -> Result<Self::Tensor, OpError>;
}

/// Which GELU a vision MLP uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gelu {
    /// `gelu_pytorch_tanh`: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
    Tanh,
    /// Exact `nn.GELU()`: `x·Φ(x) = 0.5·x·(1 + erf(x/√2))`.
    Erf,
}

/// Layout of the vision tower's attention input (see [`VisionOps::vision_attention`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VisionAttentionShape {
    /// Tokens (patches) of the image: a whole number of frames.
    pub tokens: usize,
    /// Patches per frame: tokens attend to (all) tokens of their own frame only.
    pub frame: usize,
    /// Attention heads.
    pub heads: usize,
    /// Dims per head (even).
    pub head_dim: usize,
}

/// The few ops of a ViT encoder (the Qwen3.5/3.8 vision tower) the text ops lack. Weights passed
/// here (`b`, `w`) are 1-D f32/f16/bf16 weights.
pub trait VisionOps: Backend {
    /// `x [T, N] + b [N]` broadcast over the rows (the bias of a linear layer).
    fn add_bias(&self, x: &Self::Tensor, b: &Self::Weight) -> Result<Self::Tensor, OpError>;
    /// LayerNorm over rows of `d = w.len()` (biased variance):
    /// `y = (x − mean) / sqrt(var + eps) · w + b`.
    fn layer_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        b: &Self::Weight,
        eps: f32,
    ) -> Result<Self::Tensor, OpError>;
    /// Element-wise GELU.
    fn gelu(&self, x: &Self::Tensor, kind: Gelu) -> Result<Self::Tensor, OpError>;
    /// The ViT attention: `qkv` is `[T, 3·heads·head_dim]` (q | k | v, head-major inside each);
    /// `cos`, `sin` are `[frame, head_dim]` (row `i % frame` for token i). Rotary
    /// (`rotate_half` over the full head: `x·cos + rotate_half(x)·sin`) is applied to q and k,
    /// then bidirectional softmax attention (scale `1/sqrt(head_dim)`) runs inside each frame of
    /// `frame` consecutive tokens. Returns `[T, heads·head_dim]`, head-major.
    fn vision_attention(
        &self,
        qkv: &Self::Tensor,
        cos: &Self::Tensor,
        sin: &Self::Tensor,
        shape: &VisionAttentionShape,
    ) -> Result<Self::Tensor, OpError>;
}

impl VisionAttentionShape {
    /// Checks the shape and the element counts of `qkv`, `cos` and `sin` (`op` names the caller
    /// in the error).
    pub fn check(
        &self,
        op: &'static str,
        qkv: usize,
        cos: usize,
        sin: usize,
    ) -> Result<(), OpError> {
        let s = self;
        let h = s.heads * s.head_dim;
        if s.frame == 0 || s.tokens % s.frame != 0 || s.head_dim % 2 != 0 {
            return Err(OpError::shape(
                op,
                format!("{s:?}: tokens must be a whole number of non-empty frames, head_dim even"),
            ));
        }
        if qkv != s.tokens * 3 * h || cos != s.frame * s.head_dim || sin != cos {
            return Err(OpError::shape(
                op,
                format!(
                    "{s:?}: qkv has {qkv} values (want {}), cos {cos} / sin {sin} (want {})",
                    s.tokens * 3 * h,
                    s.frame * s.head_dim
                ),
            ));
        }
        Ok(())
    }
}

/// KV row writes into device pages.
pub trait KvOps: Backend {
    /// Encodes `k` and `v` (`[n, kv_heads · head_dim]` each) in the geometry's K/V types and
    /// writes token i's rows at byte offsets `rows[i] = (k_offset, v_offset)` of `pool`.
    fn kv_write(
        &self,
        k: &Self::Tensor,
        v: &Self::Tensor,
        geometry: &PageGeometry,
        pool: &Self::Buffer,
        rows: &[(usize, usize)],
    ) -> Result<(), OpError>;
}

/// Token selection on the device.
pub trait SamplingOps: Backend {
    /// Index of the largest value of each row of `logits` `[T, V]` (lowest index on ties).
    fn argmax_rows(&self, logits: &Self::Tensor) -> Result<Vec<u32>, OpError>;
}

/// Everything a model forward and the streaming runtime need from a backend.
pub trait ModelBackend:
    Backend
    + TensorOps
    + LinearOps
    + NormOps
    + PositionOps
    + RecurrentOps
    + ActivationOps
    + KvOps
    + SamplingOps
    + VisionOps
    + StreamedAttention
    + CopyEngine
    + DeviceMemory
    + PinnedHost
{
}

impl<B> ModelBackend for B where
    B: Backend
        + TensorOps
        + LinearOps
        + NormOps
        + PositionOps
        + RecurrentOps
        + ActivationOps
        + KvOps
        + SamplingOps
        + VisionOps
        + StreamedAttention
        + CopyEngine
        + DeviceMemory
        + PinnedHost
{
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_mrope_axes_match_hf() {
        // Qwen3.8: sections [11, 11, 10] over 32 frequencies.
        let cfg = RopeConfig {
            rotary_dim: 64,
            theta: 1e7,
            mrope_section: [11, 11, 10],
            interleaved: true,
        };
        let h: Vec<usize> = (0..32).filter(|&j| cfg.axis_of(j) == 1).collect();
        let w: Vec<usize> = (0..32).filter(|&j| cfg.axis_of(j) == 2).collect();
        assert_eq!(h, (1..32).step_by(3).collect::<Vec<_>>());
        assert_eq!(w, (2..30).step_by(3).collect::<Vec<_>>());
        assert_eq!((0..32).filter(|&j| cfg.axis_of(j) == 0).count(), 11);
        let plain = RopeConfig {
            interleaved: false,
            ..cfg.clone()
        };
        assert_eq!(plain.axis_of(10), 0);
        assert_eq!(plain.axis_of(11), 1);
        assert_eq!(plain.axis_of(22), 2);
        assert!((cfg.inv_freq(0) - 1.0).abs() < 1e-12);
    }
}
