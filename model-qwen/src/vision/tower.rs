//! [`VisionTower`]: the Qwen3.5/3.8 ViT (qwen-spec §6) on any backend with [`VisionOps`], matching HF's
//! `Qwen3_5VisionModel` (patch embed → + bilinearly resampled learned positions → ViT blocks
//! with 2-D rotary and bidirectional per-frame attention → LayerNorm + 2×2 merger MLP).

use super::config::{VisionAct, VisionConfig};
use super::error::VisionError;
use super::preprocess::PreprocessedImage;
use super::weights::VisualTensors;
use kvstream_memory_contracts::backend::{Backend, DeviceWeight, WeightDType};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{
    Gelu, LinearOps, TensorOps, VisionAttentionShape, VisionOps, WeightData,
};
use rayon::prelude::*;
use std::path::Path;

const LN_EPS: f32 = 1e-6;

/// Everything a backend needs to run the tower.
pub trait VisionBackend: TensorOps + LinearOps + VisionOps {}
impl<B: TensorOps + LinearOps + VisionOps> VisionBackend for B {}

/// A weight with its bias (linear layers, LayerNorms).
struct Pair<W> {
    w: W,
    b: W,
}

struct Block<W> {
    norm1: Pair<W>,
    norm2: Pair<W>,
    qkv: Pair<W>,
    proj: Pair<W>,
    fc1: Pair<W>,
    fc2: Pair<W>,
}

/// The tower's matrices and vectors, as host f32 bytes or as one backend's weights.
struct Layers<W> {
    patch: Pair<W>,
    blocks: Vec<Block<W>>,
    merger_norm: Pair<W>,
    merger_fc1: Pair<W>,
    merger_fc2: Pair<W>,
}

impl<W> Layers<W> {
    fn pairs(&self) -> impl Iterator<Item = &Pair<W>> {
        [&self.patch]
            .into_iter()
            .chain(
                self.blocks
                    .iter()
                    .flat_map(|b| [&b.norm1, &b.norm2, &b.qkv, &b.proj, &b.fc1, &b.fc2]),
            )
            .chain([&self.merger_norm, &self.merger_fc1, &self.merger_fc2])
    }

    fn try_map<V, E>(&self, mut f: impl FnMut(&W) -> Result<V, E>) -> Result<Layers<V>, E> {
        let mut pair = |p: &Pair<W>| -> Result<Pair<V>, E> {
            Ok(Pair {
                w: f(&p.w)?,
                b: f(&p.b)?,
            })
        };
        Ok(Layers {
            patch: pair(&self.patch)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| {
                    Ok(Block {
                        norm1: pair(&b.norm1)?,
                        norm2: pair(&b.norm2)?,
                        qkv: pair(&b.qkv)?,
                        proj: pair(&b.proj)?,
                        fc1: pair(&b.fc1)?,
                        fc2: pair(&b.fc2)?,
                    })
                })
                .collect::<Result<Vec<_>, E>>()?,
            merger_norm: pair(&self.merger_norm)?,
            merger_fc1: pair(&self.merger_fc1)?,
            merger_fc2: pair(&self.merger_fc2)?,
        })
    }
}

/// A host f32 tensor, held as bytes a backend can take without conversion.
struct HostParam {
    name: String,
    dims: Vec<usize>,
    data: WeightData,
}

/// The vision tower with its weights in host memory (f32). It computes on a backend
/// ([`VisionTower::encode_on`]): the weights are uploaded as backend weights
/// ([`VisionTower::upload`]) and dropped after the image unless the caller keeps them.
pub struct VisionTower {
    config: VisionConfig,
    pos_embed: Vec<f32>,
    layers: Layers<HostParam>,
}

/// The tower's weights on one backend ([`VisionTower::upload`]); dropping them frees them.
pub struct DeviceVisionWeights<B: Backend> {
    layers: Layers<B::Weight>,
}

impl<B: Backend> DeviceVisionWeights<B> {
    /// Bytes the weights occupy on the backend.
    pub fn device_bytes(&self) -> usize {
        self.layers
            .pairs()
            .map(|p| p.w.device_bytes() + p.b.device_bytes())
            .sum()
    }
}

impl<B: Backend> std::fmt::Debug for DeviceVisionWeights<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceVisionWeights")
            .field("device_bytes", &self.device_bytes())
            .finish()
    }
}

impl std::fmt::Debug for VisionTower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VisionTower")
            .field("config", &self.config)
            .field("weight_bytes", &self.weight_bytes())
            .finish()
    }
}

impl VisionTower {
    /// Loads `dir/config.json`'s `vision_config` and the `model.visual.*` tensors of `dir`.
    /// Every missing or mis-shaped tensor is a typed error naming it.
    pub fn load(dir: &Path) -> Result<Self, VisionError> {
        let config = VisionConfig::from_model_dir(dir)?;
        Self::load_with_config(dir, config)
    }

    /// Loads the `model.visual.*` tensors of `dir` for an already parsed `config`.
    pub fn load_with_config(dir: &Path, config: VisionConfig) -> Result<Self, VisionError> {
        let _s = tracing::debug_span!("vision_load", depth = config.depth).entered();
        let t = VisualTensors::open(dir)?;
        let c = &config;
        let (h, i, m) = (c.hidden_size, c.intermediate_size, c.spatial_merge_size);
        let mh = h * m * m;
        let param =
            |name: String, shape: &[usize], dims: &[usize]| -> Result<HostParam, VisionError> {
                let v = t.f32(&name, shape)?;
                let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
                Ok(HostParam {
                    name,
                    dims: dims.to_vec(),
                    data: WeightData::from_vec(bytes),
                })
            };
        let wb = |name: &str, shape: &[usize]| -> Result<Pair<HostParam>, VisionError> {
            Ok(Pair {
                w: param(format!("model.visual.{name}.weight"), shape, shape)?,
                b: param(
                    format!("model.visual.{name}.bias"),
                    &shape[..1],
                    &shape[..1],
                )?,
            })
        };
        let patch_shape = [
            h,
            c.in_channels,
            c.temporal_patch_size,
            c.patch_size,
            c.patch_size,
        ];
        let patch = Pair {
            w: param(
                "model.visual.patch_embed.proj.weight".into(),
                &patch_shape,
                &[h, c.patch_dim()],
            )?,
            b: param("model.visual.patch_embed.proj.bias".into(), &[h], &[h])?,
        };
        let pos_embed = t.f32(
            "model.visual.pos_embed.weight",
            &[c.num_position_embeddings, h],
        )?;
        let blocks = (0..c.depth)
            .map(|n| {
                let p = format!("blocks.{n}");
                Ok(Block {
                    norm1: wb(&format!("{p}.norm1"), &[h])?,
                    norm2: wb(&format!("{p}.norm2"), &[h])?,
                    qkv: wb(&format!("{p}.attn.qkv"), &[3 * h, h])?,
                    proj: wb(&format!("{p}.attn.proj"), &[h, h])?,
                    fc1: wb(&format!("{p}.mlp.linear_fc1"), &[i, h])?,
                    fc2: wb(&format!("{p}.mlp.linear_fc2"), &[h, i])?,
                })
            })
            .collect::<Result<Vec<_>, VisionError>>()?;
        let layers = Layers {
            patch,
            blocks,
            merger_norm: wb("merger.norm", &[h])?,
            merger_fc1: wb("merger.linear_fc1", &[mh, mh])?,
            merger_fc2: wb("merger.linear_fc2", &[c.out_hidden_size, mh])?,
        };
        Ok(Self {
            pos_embed,
            layers,
            config,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Bytes of the weights as held here (f32).
    pub fn weight_bytes(&self) -> usize {
        let params: usize = self
            .layers
            .pairs()
            .map(|p| p.w.data.len + p.b.data.len)
            .sum();
        params + 4 * self.pos_embed.len()
    }

    /// Makes the tower's matrices and vectors backend weights (f32; the CPU backend references
    /// the host bytes, a GPU uploads them). The learned position table stays on the host (it is
    /// resampled there per image).
    pub fn upload<B: LinearOps>(&self, backend: &B) -> Result<DeviceVisionWeights<B>, VisionError> {
        let _s = tracing::debug_span!("vision_upload", bytes = self.weight_bytes()).entered();
        let layers = self
            .layers
            .try_map(|p| backend.load_weight(&p.name, WeightDType::F32, &p.dims, p.data.clone()))?;
        Ok(DeviceVisionWeights { layers })
    }

    /// Encodes one image on `backend`: uploads the weights, encodes
    /// ([`VisionTower::encode_with`]) and frees them again.
    pub fn encode_on<B: VisionBackend>(
        &self,
        backend: &B,
        img: &PreprocessedImage,
    ) -> Result<Vec<f32>, VisionError> {
        let weights = self.upload(backend)?;
        self.encode_with(backend, &weights, img)
    }

    /// Encodes one preprocessed image (or video clip) on `backend` with weights from
    /// [`VisionTower::upload`]: `[n_tokens, out_hidden_size]` row-major, one row per
    /// `<|image_pad|>` token in order (n_tokens = t·h·w / merge²). Every intermediate tensor is
    /// dropped before this returns.
    ///
    /// Guarantees, on the CPU backend, HF `Qwen3_5VisionModel(...).pooler_output` for this image
    /// alone (f32 rounding level; images never attend to each other, so encoding them one by one
    /// equals HF's packed batch); other backends match the CPU backend within their tolerances.
    /// Inconsistent input (patch size, grid, pixel count) is a [`VisionError::Input`].
    pub fn encode_with<B: VisionBackend>(
        &self,
        backend: &B,
        weights: &DeviceVisionWeights<B>,
        img: &PreprocessedImage,
    ) -> Result<Vec<f32>, VisionError> {
        let c = &self.config;
        let [t, gh, gw] = img.grid_thw;
        let m = c.spatial_merge_size;
        let n = t * gh * gw;
        if img.patch_dim != c.patch_dim()
            || n == 0
            || gh % m != 0
            || gw % m != 0
            || img.pixels.len() != n * c.patch_dim()
        {
            return Err(VisionError::Input(format!(
                "image grid {:?} with patch_dim {} and {} values does not fit the tower (patch_dim {}, merge {m})",
                img.grid_thw,
                img.patch_dim,
                img.pixels.len(),
                c.patch_dim()
            )));
        }
        let _s = tracing::debug_span!("vision_encode", t, gh, gw).entered();
        let b = backend;
        let w = &weights.layers;
        let (h, hd) = (c.hidden_size, c.head_dim());
        let frame = gh * gw;
        let px = b.tensor_from_f32(&img.pixels, &[n, c.patch_dim()])?;
        let x = linear(b, &px, &w.patch)?;
        drop(px);
        let (rows, cols) = block_order_coords(gh, gw, m);
        let pos = self.resampled_positions(&rows, &cols, gh, gw);
        let pos: Vec<f32> = pos.iter().copied().cycle().take(n * h).collect();
        let mut x = b.add(&x, &b.tensor_from_f32(&pos, &[n, h])?)?;
        let (cos, sin) = self.rotary(&rows, &cols);
        let cos = b.tensor_from_f32(&cos, &[frame, hd])?;
        let sin = b.tensor_from_f32(&sin, &[frame, hd])?;
        let shape = VisionAttentionShape {
            tokens: n,
            frame,
            heads: c.num_heads,
            head_dim: hd,
        };
        let act = match c.hidden_act {
            VisionAct::GeluTanh => Gelu::Tanh,
            VisionAct::GeluErf => Gelu::Erf,
        };
        for blk in &w.blocks {
            let y = b.layer_norm(&x, &blk.norm1.w, &blk.norm1.b, LN_EPS)?;
            let qkv = linear(b, &y, &blk.qkv)?;
            let attn = b.vision_attention(&qkv, &cos, &sin, &shape)?;
            x = b.add(&x, &linear(b, &attn, &blk.proj)?)?;
            let y = b.layer_norm(&x, &blk.norm2.w, &blk.norm2.b, LN_EPS)?;
            let f = b.gelu(&linear(b, &y, &blk.fc1)?, act)?;
            x = b.add(&x, &linear(b, &f, &blk.fc2)?)?;
        }
        // Merger: LayerNorm per patch, m² consecutive patches concatenated, fc1, exact GELU, fc2.
        let y = b.layer_norm(&x, &w.merger_norm.w, &w.merger_norm.b, LN_EPS)?;
        let y = b.reshape(y, &[n / (m * m), h * m * m])?;
        let z = b.gelu(&linear(b, &y, &w.merger_fc1)?, Gelu::Erf)?;
        let out = linear(b, &z, &w.merger_fc2)?;
        Ok(b.tensor_to_f32(&out)?)
    }

    /// The learned `side×side` table resampled (bilinear, align_corners) to the patch grid, one
    /// row per patch of a frame in block order.
    fn resampled_positions(
        &self,
        rows: &[usize],
        cols: &[usize],
        gh: usize,
        gw: usize,
    ) -> Vec<f32> {
        let h = self.config.hidden_size;
        let side = self.config.pos_side();
        let taps = |idx: usize, size: usize| -> [(usize, f32); 2] {
            let src = idx as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let fl = src.floor();
            let mut out = [(0usize, 0f32); 2];
            for (o, slot) in out.iter_mut().enumerate() {
                let tap = (fl as usize + o).min(side - 1);
                let w = (1.0 - (src - fl - o as f32).abs()).max(0.0);
                *slot = (tap, w);
            }
            out
        };
        let mut pos = vec![0f32; rows.len() * h];
        pos.par_chunks_mut(h)
            .zip(rows.par_iter().zip(cols.par_iter()))
            .for_each(|(pr, (&r, &c))| {
                for (th, wh) in taps(r, gh) {
                    for (tw, ww) in taps(c, gw) {
                        let wgt = wh * ww;
                        let e = &self.pos_embed[(th * side + tw) * h..(th * side + tw + 1) * h];
                        for (p, v) in pr.iter_mut().zip(e) {
                            *p += v * wgt;
                        }
                    }
                }
            });
        pos
    }

    /// Per patch (block order): cos/sin over the full head, `[row freqs | col freqs]` twice.
    fn rotary(&self, rows: &[usize], cols: &[usize]) -> (Vec<f32>, Vec<f32>) {
        let hd = self.config.head_dim();
        let spatial = hd / 2;
        let inv: Vec<f32> = (0..spatial / 2)
            .map(|j| 1.0 / self.config.rope_theta.powf((2 * j) as f32 / spatial as f32))
            .collect();
        let mut cos = vec![0f32; rows.len() * hd];
        let mut sin = vec![0f32; rows.len() * hd];
        for (i, (&r, &c)) in rows.iter().zip(cols).enumerate() {
            for d in 0..hd {
                let q = d % spatial;
                let f = if q < inv.len() {
                    r as f32 * inv[q]
                } else {
                    c as f32 * inv[q - inv.len()]
                };
                cos[i * hd + d] = f.cos();
                sin[i * hd + d] = f.sin();
            }
        }
        (cos, sin)
    }
}

/// `x · wᵀ + b` (PyTorch `nn.Linear`).
fn linear<B: VisionBackend>(
    b: &B,
    x: &B::Tensor,
    p: &Pair<B::Weight>,
) -> Result<B::Tensor, OpError> {
    b.add_bias(&b.matmul(x, &p.w)?, &p.b)
}

/// (row, col) of each patch of one frame in the processor's order: merge blocks row-major, and
/// inside a block row-major.
fn block_order_coords(gh: usize, gw: usize, m: usize) -> (Vec<usize>, Vec<usize>) {
    let mut rows = Vec::with_capacity(gh * gw);
    let mut cols = Vec::with_capacity(gh * gw);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for ih in 0..m {
                for iw in 0..m {
                    rows.push(bh * m + ih);
                    cols.push(bw * m + iw);
                }
            }
        }
    }
    (rows, cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_order_matches_hf_reshape() {
        let (r, c) = block_order_coords(4, 6, 2);
        assert_eq!(&r[..8], &[0, 0, 1, 1, 0, 0, 1, 1]);
        assert_eq!(&c[..8], &[0, 1, 0, 1, 2, 3, 2, 3]);
        assert_eq!((r[23], c[23]), (3, 5));
    }
}
