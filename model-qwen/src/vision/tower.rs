//! [`VisionTower`]: the Qwen3.5/3.8 ViT (qwen-spec §6) on the host in f32, matching HF's
//! `Qwen3_5VisionModel` (patch embed → + bilinearly resampled learned positions → ViT blocks
//! with 2-D rotary and bidirectional per-frame attention → LayerNorm + 2×2 merger MLP).

use super::config::{VisionAct, VisionConfig};
use super::error::VisionError;
use super::math::{gelu_erf, gelu_tanh, layer_norm, linear, matmul, View};
use super::preprocess::PreprocessedImage;
use super::weights::VisualTensors;
use rayon::prelude::*;
use std::path::Path;

const LN_EPS: f32 = 1e-6;

struct Block {
    norm1: (Vec<f32>, Vec<f32>),
    norm2: (Vec<f32>, Vec<f32>),
    qkv: (Vec<f32>, Vec<f32>),
    proj: (Vec<f32>, Vec<f32>),
    fc1: (Vec<f32>, Vec<f32>),
    fc2: (Vec<f32>, Vec<f32>),
}

/// The vision tower with its weights in host memory (f32).
pub struct VisionTower {
    config: VisionConfig,
    patch: (Vec<f32>, Vec<f32>),
    pos_embed: Vec<f32>,
    blocks: Vec<Block>,
    merger_norm: (Vec<f32>, Vec<f32>),
    merger_fc1: (Vec<f32>, Vec<f32>),
    merger_fc2: (Vec<f32>, Vec<f32>),
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
        let wb = |name: &str, shape: &[usize]| -> Result<(Vec<f32>, Vec<f32>), VisionError> {
            Ok((
                t.f32(&format!("model.visual.{name}.weight"), shape)?,
                t.f32(&format!("model.visual.{name}.bias"), &shape[..1])?,
            ))
        };
        let patch = wb(
            "patch_embed.proj",
            &[
                h,
                c.in_channels,
                c.temporal_patch_size,
                c.patch_size,
                c.patch_size,
            ],
        )?;
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
        Ok(Self {
            patch,
            pos_embed,
            blocks,
            merger_norm: wb("merger.norm", &[h])?,
            merger_fc1: wb("merger.linear_fc1", &[mh, mh])?,
            merger_fc2: wb("merger.linear_fc2", &[c.out_hidden_size, mh])?,
            config,
        })
    }

    /// The tower's configuration.
    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// Bytes of the weights as held here (f32).
    pub fn weight_bytes(&self) -> usize {
        let pair = |p: &(Vec<f32>, Vec<f32>)| p.0.len() + p.1.len();
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| {
                pair(&b.norm1)
                    + pair(&b.norm2)
                    + pair(&b.qkv)
                    + pair(&b.proj)
                    + pair(&b.fc1)
                    + pair(&b.fc2)
            })
            .sum();
        4 * (pair(&self.patch)
            + self.pos_embed.len()
            + blocks
            + pair(&self.merger_norm)
            + pair(&self.merger_fc1)
            + pair(&self.merger_fc2))
    }

    /// Encodes one preprocessed image (or video clip): `[n_tokens, out_hidden_size]` row-major,
    /// one row per `<|image_pad|>` token in order (n_tokens = t·h·w / merge²).
    ///
    /// Guarantees HF `Qwen3_5VisionModel(...).pooler_output` for this image alone (f32 rounding
    /// level; images never attend to each other, so encoding them one by one equals HF's packed
    /// batch). Inconsistent input (patch size, grid, pixel count) is a [`VisionError::Input`].
    pub fn encode(&self, img: &PreprocessedImage) -> Result<Vec<f32>, VisionError> {
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
        let h = c.hidden_size;
        let mut x = linear(
            &img.pixels,
            n,
            c.patch_dim(),
            &self.patch.0,
            Some(&self.patch.1),
            h,
        );
        let (rows, cols) = block_order_coords(gh, gw, m);
        let pos = self.resampled_positions(&rows, &cols, gh, gw);
        for (xr, pr) in x.chunks_mut(h).zip(pos.chunks(h).cycle()) {
            for (a, b) in xr.iter_mut().zip(pr) {
                *a += b;
            }
        }
        let (cos, sin) = self.rotary(&rows, &cols);
        for blk in &self.blocks {
            x = self.block(blk, x, n, gh * gw, &cos, &sin);
        }
        // Merger: LayerNorm per patch, m² consecutive patches concatenated, fc1, exact GELU, fc2.
        let y = layer_norm(&x, h, &self.merger_norm.0, &self.merger_norm.1, LN_EPS);
        let mh = h * m * m;
        let mut z = linear(
            &y,
            n / (m * m),
            mh,
            &self.merger_fc1.0,
            Some(&self.merger_fc1.1),
            mh,
        );
        z.par_iter_mut().for_each(|v| *v = gelu_erf(*v));
        Ok(linear(
            &z,
            n / (m * m),
            mh,
            &self.merger_fc2.0,
            Some(&self.merger_fc2.1),
            c.out_hidden_size,
        ))
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

    fn block(
        &self,
        b: &Block,
        x: Vec<f32>,
        n: usize,
        frame: usize,
        cos: &[f32],
        sin: &[f32],
    ) -> Vec<f32> {
        let c = &self.config;
        let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim());
        let y = layer_norm(&x, h, &b.norm1.0, &b.norm1.1, LN_EPS);
        let mut qkv = linear(&y, n, h, &b.qkv.0, Some(&b.qkv.1), 3 * h);
        // Rotary on q and k (rotate_half over the full head).
        qkv.par_chunks_mut(3 * h).enumerate().for_each(|(i, row)| {
            let pi = i % frame;
            let (cs, sn) = (&cos[pi * hd..(pi + 1) * hd], &sin[pi * hd..(pi + 1) * hd]);
            for s in 0..2 {
                for head in 0..heads {
                    let v = &mut row[s * h + head * hd..s * h + (head + 1) * hd];
                    let half = hd / 2;
                    let orig: Vec<f32> = v.to_vec();
                    for d in 0..hd {
                        let rot = if d < half {
                            -orig[d + half]
                        } else {
                            orig[d - half]
                        };
                        v[d] = orig[d] * cs[d] + rot * sn[d];
                    }
                }
            }
        });
        let attn = attention(&qkv, n, frame, h, heads);
        let a = linear(&attn, n, h, &b.proj.0, Some(&b.proj.1), h);
        let mut x: Vec<f32> = x.iter().zip(&a).map(|(u, v)| u + v).collect();
        let y = layer_norm(&x, h, &b.norm2.0, &b.norm2.1, LN_EPS);
        let mut f = linear(&y, n, h, &b.fc1.0, Some(&b.fc1.1), c.intermediate_size);
        let act: fn(f32) -> f32 = match c.hidden_act {
            VisionAct::GeluTanh => gelu_tanh,
            VisionAct::GeluErf => gelu_erf,
        };
        f.par_iter_mut().for_each(|v| *v = act(*v));
        let g = linear(&f, n, c.intermediate_size, &b.fc2.0, Some(&b.fc2.1), h);
        for (u, v) in x.iter_mut().zip(&g) {
            *u += v;
        }
        x
    }
}

/// Query rows per attention task (bounds the score scratch to `QBLOCK × frame` floats).
const QBLOCK: usize = 128;

/// Bidirectional softmax attention within each frame of `frame` patches: `qkv` is `[n, 3h]`
/// (q | k | v, head-major inside each), the result `[n, h]` head-major.
fn attention(qkv: &[f32], n: usize, frame: usize, h: usize, heads: usize) -> Vec<f32> {
    let hd = h / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let blocks_per_frame = frame.div_ceil(QBLOCK);
    let tasks: Vec<(usize, usize, usize)> = (0..n / frame)
        .flat_map(|f| {
            (0..heads).flat_map(move |head| (0..blocks_per_frame).map(move |bi| (f, head, bi)))
        })
        .collect();
    let parts: Vec<(usize, usize, Vec<f32>)> = tasks
        .par_iter()
        .map(|&(f, head, bi)| {
            let f0 = f * frame;
            let q0 = f0 + bi * QBLOCK;
            let rows = QBLOCK.min(f0 + frame - q0);
            let mut s = vec![0f32; rows * frame];
            let q = View {
                data: qkv,
                off: q0 * 3 * h + head * hd,
                rs: 3 * h,
                cs: 1,
            };
            let kt = View {
                data: qkv,
                off: f0 * 3 * h + h + head * hd,
                rs: 1,
                cs: 3 * h,
            };
            matmul(rows, frame, hd, &mut s, frame, q, kt, false);
            for r in s.chunks_mut(frame) {
                let mx = r.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
                let mut sum = 0f32;
                for v in r.iter_mut() {
                    *v = (*v * scale - mx).exp();
                    sum += *v;
                }
                let inv = 1.0 / sum;
                for v in r.iter_mut() {
                    *v *= inv;
                }
            }
            let mut o = vec![0f32; rows * hd];
            let p = View {
                data: &s,
                off: 0,
                rs: frame,
                cs: 1,
            };
            let v = View {
                data: qkv,
                off: f0 * 3 * h + 2 * h + head * hd,
                rs: 3 * h,
                cs: 1,
            };
            matmul(rows, hd, frame, &mut o, hd, p, v, false);
            (q0, head, o)
        })
        .collect();
    let mut out = vec![0f32; n * h];
    for (q0, head, o) in parts {
        for (r, src) in o.chunks_exact(hd).enumerate() {
            let d = (q0 + r) * h + head * hd;
            out[d..d + hd].copy_from_slice(src);
        }
    }
    out
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
    fn blocked_attention_matches_naive_across_frames_and_blocks() {
        // 2 frames of 150 patches (two query blocks each), 3 heads × 8.
        let (frame, heads, hd) = (150, 3, 8);
        let (n, h) = (2 * frame, heads * hd);
        let qkv: Vec<f32> = (0..n * 3 * h)
            .map(|i| ((i * 2_654_435_761usize) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let got = attention(&qkv, n, frame, h, heads);
        let scale = 1.0 / (hd as f64).sqrt();
        let mut worst = 0f64;
        for i in 0..n {
            let f0 = (i / frame) * frame;
            for head in 0..heads {
                let q = &qkv[i * 3 * h + head * hd..][..hd];
                let s: Vec<f64> = (f0..f0 + frame)
                    .map(|j| {
                        let k = &qkv[j * 3 * h + h + head * hd..][..hd];
                        q.iter().zip(k).map(|(a, b)| f64::from(a * b)).sum::<f64>() * scale
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|v| (v - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let want: f64 = (0..frame)
                        .map(|j| {
                            e[j] / z * f64::from(qkv[(f0 + j) * 3 * h + 2 * h + head * hd + d])
                        })
                        .sum();
                    worst = worst.max((want - f64::from(got[i * h + head * hd + d])).abs());
                }
            }
        }
        assert!(worst < 1e-5, "max |diff| {worst}");
    }

    #[test]
    fn block_order_matches_hf_reshape() {
        let (r, c) = block_order_coords(4, 6, 2);
        assert_eq!(&r[..8], &[0, 0, 1, 1, 0, 0, 1, 1]);
        assert_eq!(&c[..8], &[0, 1, 0, 1, 2, 3, 2, 3]);
        assert_eq!((r[23], c[23]), (3, 5));
    }
}
