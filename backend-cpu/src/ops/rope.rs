//! `PositionOps` for the CPU backend: partial, interleaved multimodal RoPE (NeoX half layout).
//!
//! Angles are computed as HF does, in f32: `angle = (pos as f32) · inv_freq`, and `cos`/`sin`
//! are evaluated in f64 from that f32 and rounded to f32 (a correctly rounded f32 cos/sin).

use crate::{CpuBackend, CpuTensor};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{Position3, PositionOps, RopeConfig};
use rayon::prelude::*;

/// cos/sin of every rotary frequency for one position.
fn angles(cfg: &RopeConfig, pos: &Position3) -> Vec<(f32, f32)> {
    (0..cfg.rotary_dim / 2)
        .map(|j| {
            let p = pos[cfg.axis_of(j)] as f32;
            let a = f64::from(p * cfg.inv_freq(j));
            (a.cos() as f32, a.sin() as f32)
        })
        .collect()
}

impl PositionOps for CpuBackend {
    fn rope(
        &self,
        x: &CpuTensor,
        heads: usize,
        head_dim: usize,
        positions: &[Position3],
        cfg: &RopeConfig,
    ) -> Result<CpuTensor, OpError> {
        let t = positions.len();
        if heads * head_dim * t != x.data.len() || t == 0 {
            return Err(OpError::shape(
                "rope",
                format!(
                    "{:?} is not [{t} positions, {heads} heads, {head_dim}]",
                    x.dims
                ),
            ));
        }
        if cfg.rotary_dim % 2 != 0
            || cfg.rotary_dim > head_dim
            || cfg.mrope_section.iter().sum::<usize>() != cfg.rotary_dim / 2
        {
            return Err(OpError::shape(
                "rope",
                format!("rope config {cfg:?} does not fit head_dim {head_dim}"),
            ));
        }
        let half = cfg.rotary_dim / 2;
        let mut out = x.data.clone();
        out.par_chunks_mut(heads * head_dim)
            .zip(positions.par_iter())
            .for_each(|(tok, pos)| {
                let cs = angles(cfg, pos);
                for h in tok.chunks_exact_mut(head_dim) {
                    for (j, &(c, s)) in cs.iter().enumerate() {
                        let (a, b) = (h[j], h[j + half]);
                        h[j] = a * c + (-b) * s;
                        h[j + half] = b * c + a * s;
                    }
                }
            });
        Ok(CpuTensor::new(out, x.dims.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_abs_diff, tensor, Rng};

    #[test]
    fn rope_matches_f64_reference_with_mrope_axes() {
        let b = CpuBackend::new();
        let mut r = Rng::new(9);
        let (heads, hd) = (3, 20);
        let cfg = RopeConfig {
            rotary_dim: 12,
            theta: 10_000.0,
            mrope_section: [2, 2, 2],
            interleaved: true,
        };
        let positions: Vec<Position3> = vec![[0, 0, 0], [5, 7, 9], [1000, 3, 40000]];
        let x = r.vec(positions.len() * heads * hd, 1.0);
        let y = b
            .rope(
                &tensor(x.clone(), &[3, heads, hd]),
                heads,
                hd,
                &positions,
                &cfg,
            )
            .expect("rope");
        let mut reference = vec![0f64; x.len()];
        for (t, pos) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = (t * heads + h) * hd;
                for d in 0..hd {
                    reference[base + d] = f64::from(x[base + d]);
                }
                for j in 0..6 {
                    let p = f64::from(pos[cfg.axis_of(j)]);
                    let inv = 1.0 / 10_000f64.powf(2.0 * j as f64 / 12.0);
                    let (c, s) = ((p * inv).cos(), (p * inv).sin());
                    let (a, bb) = (f64::from(x[base + j]), f64::from(x[base + j + 6]));
                    reference[base + j] = a * c - bb * s;
                    reference[base + j + 6] = bb * c + a * s;
                }
            }
        }
        // Position 40000 in f32 angles: the error is dominated by f32 rounding of the angle.
        assert!(max_abs_diff(&y.data, &reference) < 2e-3);
        let first2: Vec<f64> = reference[..2 * heads * hd].to_vec();
        assert!(max_abs_diff(&y.data[..2 * heads * hd], &first2) < 1e-5);
        // Dims past rotary_dim are untouched.
        assert_eq!(y.data[hd - 1], x[hd - 1]);
        assert!(b
            .rope(
                &tensor(x, &[3, heads, hd]),
                heads,
                hd,
                &positions[..2],
                &cfg
            )
            .is_err());
    }
}
