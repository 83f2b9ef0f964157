//! Zero-copy typed views of weight bytes and the shared dot-product kernels.
//!
//! Every f32 dot product of the backend goes through [`dot`] with one fixed lane structure
//! (32 lanes, then a fixed pairwise reduction, then a sequential tail). bf16/f16 → f32 is exact,
//! so a dot over a bf16 row equals, bit for bit, the dot over the same row decoded to f32: the
//! GEMV and the tiled GEMM paths of `matmul` therefore give identical results.

use crate::CpuWeight;
use half::f16;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;

/// Lanes of the dot-product accumulators.
pub const LANES: usize = 32;

/// A typed, borrowed view of a weight's elements.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
}

impl WeightView<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(s) => s.len(),
            WeightView::Bf16(s) | WeightView::F16(s) => s.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decodes elements `[start, start + out.len())` to f32 (exact).
    pub fn decode(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            WeightView::F32(s) => out.copy_from_slice(&s[start..start + n]),
            WeightView::Bf16(s) => {
                for (o, b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = bf16_to_f32(*b);
                }
            }
            WeightView::F16(s) => {
                for (o, b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f16::from_bits(*b).to_f32();
                }
            }
        }
    }

    /// All elements as f32 (small weights: norms, biases, A_log).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.len()];
        self.decode(0, &mut v);
        v
    }

    /// `x · row` where `row` is elements `[start, start + x.len())`, with the [`dot`] lane structure.
    #[inline]
    pub fn dot_row(&self, x: &[f32], start: usize) -> f32 {
        let n = x.len();
        match self {
            WeightView::F32(s) => dot(x, &s[start..start + n]),
            WeightView::Bf16(s) => dot_bf16(x, &s[start..start + n]),
            WeightView::F16(s) => {
                let mut buf = [0f32; 256];
                let mut acc = [0f32; LANES];
                let mut tail = 0f32;
                // Decode in blocks of 256 (a multiple of LANES) so the lane order is that of `dot`.
                let full = n / LANES * LANES;
                let mut k = 0;
                while k < full {
                    let m = (full - k).min(256);
                    WeightView::F16(s).decode(start + k, &mut buf[..m]);
                    accumulate(&mut acc, &x[k..k + m], &buf[..m]);
                    k += m;
                }
                for i in full..n {
                    tail += x[i] * f16::from_bits(s[start + i]).to_f32();
                }
                reduce(&acc) + tail
            }
        }
    }
}

/// bf16 bits → f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// The typed view of a weight. Fails only for a hand-built weight whose bytes are misaligned or
/// of the wrong length (`load_weight` never makes one).
pub fn view(w: &CpuWeight) -> Result<WeightView<'_>, OpError> {
    let bytes = w.data.bytes();
    let numel: usize = w.dims.iter().product();
    if bytes.len() != numel * w.dtype.size() {
        return Err(OpError::shape(
            "weight",
            format!("{} bytes for {:?} {}", bytes.len(), w.dims, w.dtype.name()),
        ));
    }
    let bad = |_| OpError::DType {
        op: "weight",
        dtype: format!("{} (misaligned bytes)", w.dtype),
    };
    Ok(match w.dtype {
        WeightDType::F32 => WeightView::F32(bytemuck::try_cast_slice(bytes).map_err(bad)?),
        WeightDType::Bf16 => WeightView::Bf16(bytemuck::try_cast_slice(bytes).map_err(bad)?),
        WeightDType::F16 => WeightView::F16(bytemuck::try_cast_slice(bytes).map_err(bad)?),
    })
}

#[inline(always)]
fn accumulate(acc: &mut [f32; LANES], x: &[f32], w: &[f32]) {
    for (xs, ws) in x.chunks_exact(LANES).zip(w.chunks_exact(LANES)) {
        for i in 0..LANES {
            acc[i] += xs[i] * ws[i];
        }
    }
}

#[inline(always)]
fn reduce(acc: &[f32; LANES]) -> f32 {
    let mut a = *acc;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            a[i] += a[i + width];
        }
        width /= 2;
    }
    a[0]
}

/// True when the AVX2 kernels may run (detected once).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| std::arch::is_x86_feature_detected!("avx2"))
}

#[inline(always)]
fn dot_f32_impl(x: &[f32], w: &[f32]) -> f32 {
    let n = x.len().min(w.len());
    let full = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    accumulate(&mut acc, &x[..full], &w[..full]);
    let mut tail = 0f32;
    for i in full..n {
        tail += x[i] * w[i];
    }
    reduce(&acc) + tail
}

#[inline(always)]
fn dot_bf16_impl(x: &[f32], w: &[u16]) -> f32 {
    let n = x.len().min(w.len());
    let full = n / LANES * LANES;
    let mut acc = [0f32; LANES];
    for (xs, ws) in x[..full]
        .chunks_exact(LANES)
        .zip(w[..full].chunks_exact(LANES))
    {
        for i in 0..LANES {
            acc[i] += xs[i] * bf16_to_f32(ws[i]);
        }
    }
    let mut tail = 0f32;
    for i in full..n {
        tail += x[i] * bf16_to_f32(w[i]);
    }
    reduce(&acc) + tail
}

// The AVX2 builds compile the same scalar code with wider vectors. AVX2 without FMA keeps
// every lane's multiply and add separately rounded (Rust never contracts them), so the result
// is bit-identical to the baseline build: the dispatch cannot change any output.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
/// # Safety
/// The CPU must support AVX2.
unsafe fn dot_f32_avx2(x: &[f32], w: &[f32]) -> f32 {
    dot_f32_impl(x, w)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
/// # Safety
/// The CPU must support AVX2.
unsafe fn dot_bf16_avx2(x: &[f32], w: &[u16]) -> f32 {
    dot_bf16_impl(x, w)
}

/// f32 dot product with the backend's fixed accumulation order.
#[inline]
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 support was detected at run time.
        return unsafe { dot_f32_avx2(x, w) };
    }
    dot_f32_impl(x, w)
}

/// `x · w` for bf16 `w`, converting by bit shift in the inner loop; equals [`dot`] of the decoded row.
#[inline]
pub fn dot_bf16(x: &[f32], w: &[u16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 support was detected at run time.
        return unsafe { dot_bf16_avx2(x, w) };
    }
    dot_bf16_impl(x, w)
}

/// The baseline (non-AVX2) kernels, for tests that check the dispatch is bit-neutral.
#[cfg(test)]
pub(crate) fn dot_baseline(x: &[f32], w: &[f32]) -> f32 {
    dot_f32_impl(x, w)
}

/// As [`dot_baseline`] for bf16.
#[cfg(test)]
pub(crate) fn dot_bf16_baseline(x: &[f32], w: &[u16]) -> f32 {
    dot_bf16_impl(x, w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{weight, Rng};
    use crate::CpuBackend;

    #[test]
    fn typed_dots_equal_decoded_f32_dot_bit_for_bit() {
        let b = CpuBackend::new();
        let mut r = Rng::new(7);
        for n in [1usize, 15, 16, 17, 300, 1000] {
            let x = r.vec(n, 1.0);
            let vals = r.vec(n, 1.0);
            for dt in [WeightDType::F32, WeightDType::Bf16, WeightDType::F16] {
                let (w, held) = weight(&b, dt, &vals, &[n]);
                let v = view(&w).expect("view");
                let got = v.dot_row(&x, 0);
                assert_eq!(got.to_bits(), dot(&x, &held).to_bits(), "{dt} n={n}");
                let exact: f64 = x
                    .iter()
                    .zip(&held)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                assert!((f64::from(got) - exact).abs() < 1e-4 * (n as f64).sqrt());
                assert_eq!(v.to_vec(), held);
            }
        }
    }

    #[test]
    fn simd_dispatch_is_bit_identical_to_baseline() {
        let mut r = Rng::new(8);
        for n in [5usize, 64, 333, 4096] {
            let x = r.vec(n, 1.0);
            let w = r.vec(n, 1.0);
            let wb: Vec<u16> = w
                .iter()
                .map(|v| half::bf16::from_f32(*v).to_bits())
                .collect();
            assert_eq!(dot(&x, &w).to_bits(), dot_baseline(&x, &w).to_bits());
            assert_eq!(
                dot_bf16(&x, &wb).to_bits(),
                dot_bf16_baseline(&x, &wb).to_bits()
            );
        }
    }
}
