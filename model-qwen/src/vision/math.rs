//! Host f32 kernels of the vision tower: linear layers, LayerNorm, GELU. Row-parallel (rayon).

use rayon::prelude::*;

/// A strided row-major view: element (r, c) at `data[off + r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    pub(crate) data: &'a [f32],
    pub(crate) off: usize,
    pub(crate) rs: usize,
    pub(crate) cs: usize,
}

impl View<'_> {
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || self.off + (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m, n]` (row-major, row stride `dst_rs`) = `lhs[m, k] · rhs[k, n]` via the `gemm` crate.
pub(crate) fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: View<'_>,
    rhs: View<'_>,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Internal invariant (shapes are computed by the tower, never taken from input bytes).
    assert!(
        (m - 1) * dst_rs + n <= dst.len() && lhs.fits(m, k) && rhs.fits(k, n),
        "vision matmul views out of bounds"
    );
    let par = if parallel {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
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
            par,
        )
    }
}

/// `y[n, m] = x[n, k] · w[m, k]ᵀ + b[m]` (PyTorch `nn.Linear` layout).
pub(crate) fn linear(
    x: &[f32],
    n: usize,
    k: usize,
    w: &[f32],
    b: Option<&[f32]>,
    m: usize,
) -> Vec<f32> {
    let mut y = vec![0f32; n * m];
    let lhs = View {
        data: x,
        off: 0,
        rs: k,
        cs: 1,
    };
    let rhs = View {
        data: w,
        off: 0,
        rs: 1,
        cs: k,
    };
    matmul(n, m, k, &mut y, m, lhs, rhs, true);
    if let Some(b) = b {
        y.par_chunks_mut(m).for_each(|r| {
            for (v, bb) in r.iter_mut().zip(b) {
                *v += bb;
            }
        });
    }
    y
}

/// LayerNorm over rows of width `d` (biased variance, computed in f64 for stability).
pub(crate) fn layer_norm(x: &[f32], d: usize, w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut y = vec![0f32; x.len()];
    y.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(yr, xr)| {
            let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
            let var = xr
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / d as f64;
            let inv = 1.0 / (var + f64::from(eps)).sqrt();
            for i in 0..d {
                yr[i] = ((f64::from(xr[i]) - mean) * inv) as f32 * w[i] + b[i];
            }
        });
    y
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    let c = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// Exact GELU (`nn.GELU()`): `x·Φ(x)`.
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
}

/// erf(x) with |error| < 1.2e-7 (Numerical Recipes' Chebyshev erfc).
pub(crate) fn erf(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87
                                        + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    if x >= 0.0 {
        1.0 - r
    } else {
        r - 1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_and_gelu_reference_values() {
        // erf(0.5), erf(1), erf(-2) from tables.
        for (x, want) in [
            (0.5, 0.520_499_877_8),
            (1.0, 0.842_700_792_9),
            (-2.0, -0.995_322_265_0),
        ] {
            assert!((erf(x) - want).abs() < 2e-7, "erf({x}) = {}", erf(x));
        }
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!(gelu_erf(-8.0).abs() < 1e-6);
    }

    #[test]
    fn linear_and_layer_norm_match_naive() {
        let (n, k, m) = (3, 19, 5);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let w: Vec<f32> = (0..m * k)
            .map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.07)
            .collect();
        let b: Vec<f32> = (0..m).map(|i| i as f32 * 0.3 - 0.5).collect();
        let y = linear(&x, n, k, &w, Some(&b), m);
        for r in 0..n {
            for j in 0..m {
                let want: f32 = (0..k).map(|i| x[r * k + i] * w[j * k + i]).sum::<f32>() + b[j];
                assert!((y[r * m + j] - want).abs() < 1e-5);
            }
        }
        let g: Vec<f32> = (0..k).map(|i| 1.0 + i as f32 * 0.01).collect();
        let z = layer_norm(&x, k, &g, &vec![0.5; k], 1e-6);
        let row = &z[..k];
        let back: Vec<f32> = row.iter().zip(&g).map(|(v, g)| (v - 0.5) / g).collect();
        let mean: f32 = back.iter().sum::<f32>() / k as f32;
        let var: f32 = back.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / k as f32;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
            "{mean} {var}"
        );
    }
}
