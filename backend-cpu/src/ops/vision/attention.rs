//! The ViT attention on the host: 2-D rotary on q and k, then bidirectional softmax attention per
//! frame in blocks of [`QBLOCK`] query rows (two `gemm` products per block), rayon over
//! (frame, head, block).

use kvstream_memory_contracts::ops::VisionAttentionShape;
use rayon::prelude::*;

/// Query rows per attention task (bounds the score scratch to `QBLOCK × frame` floats).
pub(crate) const QBLOCK: usize = 128;

/// A strided row-major view: element (r, c) at `data[off + r·rs + c·cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl View<'_> {
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || self.off + (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m, n]` (row-major, row stride `dst_rs`) = `lhs[m, k] · rhs[k, n]` via the `gemm` crate.
fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: View<'_>,
    rhs: View<'_>,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Internal invariant (shapes are checked by the op before any call).
    assert!(
        (m - 1) * dst_rs + n <= dst.len() && lhs.fits(m, k) && rhs.fits(k, n),
        "vision matmul views out of bounds"
    );
    // SAFETY: the assert above proves every (row, col) the three stride/pointer pairs address
    // lies inside its slice; `dst` is exclusively borrowed and `read_dst = false`, so its prior
    // contents are never read; the slices outlive the call.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            false,
            lhs.data.as_ptr().add(lhs.off),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr().add(rhs.off),
            rhs.cs as isize,
            rhs.rs as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Applies the rotary (`x·cos + rotate_half(x)·sin`, row `i % frame` of the tables) to the q and
/// k parts of every row of `qkv` in place.
pub(crate) fn rotary(qkv: &mut [f32], cos: &[f32], sin: &[f32], s: &VisionAttentionShape) {
    let (hd, heads) = (s.head_dim, s.heads);
    let h = heads * hd;
    let half = hd / 2;
    qkv.par_chunks_mut(3 * h).enumerate().for_each(|(i, row)| {
        let pi = i % s.frame;
        let (cs, sn) = (&cos[pi * hd..(pi + 1) * hd], &sin[pi * hd..(pi + 1) * hd]);
        let mut orig = vec![0f32; hd];
        for part in 0..2 {
            for head in 0..heads {
                let v = &mut row[part * h + head * hd..part * h + (head + 1) * hd];
                orig.copy_from_slice(v);
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
}

/// Bidirectional softmax attention within each frame: `qkv` is `[n, 3h]` (q | k | v, head-major
/// inside each, rotary already applied), the result `[n, h]` head-major.
pub(crate) fn attention(qkv: &[f32], s: &VisionAttentionShape) -> Vec<f32> {
    let (n, frame, heads, hd) = (s.tokens, s.frame, s.heads, s.head_dim);
    let h = heads * hd;
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
            let mut sc = vec![0f32; rows * frame];
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
            matmul(rows, frame, hd, &mut sc, frame, q, kt);
            for r in sc.chunks_mut(frame) {
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
                data: &sc,
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
            matmul(rows, hd, frame, &mut o, hd, p, v);
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
        let shape = VisionAttentionShape {
            tokens: n,
            frame,
            heads,
            head_dim: hd,
        };
        let got = attention(&qkv, &shape);
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
}
