//! Zero-copy typed views of weight bytes and the shared dot-product kernels.
//!
//! Every f32 dot product of the backend goes through [`dot`] with one fixed lane structure
//! (32 lanes, then a fixed pairwise reduction, then a sequential tail). bf16/f16 → f32 is exact,
//! so a dot over a bf16 row equals, bit for bit, the dot over the same row decoded to f32: the
//! GEMV and the tiled GEMM paths of `matmul` therefore give identical results.
//!
//! Quantized weights (`q8_0`, `q4_g128`, `fp8_e4m3`, `q4_nl_g128`, layouts in
//! [`kvstream_memory_contracts::weight_format`]) are read in place too: [`WeightView::decode`]
//! produces exactly the values `dequantize` defines, and the dots over them decode blocks of
//! 256 values into a stack buffer and accumulate with the same lane structure (whole rows use
//! the fused kernels of the private `quant` module, same lanes), so a dot over a quantized row
//! equals [`dot`] over the dequantized row bit for bit.

mod quant;

use crate::CpuWeight;
use half::f16;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::weight_format::{
    quant_layout, E4M3_TABLE, G128, Q4_NL_LEVELS, Q8_0_GROUP,
};

/// Lanes of the dot-product accumulators.
pub const LANES: usize = 32;

/// A typed, borrowed view of a weight's elements.
#[derive(Debug, Clone, Copy)]
pub enum WeightView<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    F16(&'a [u16]),
    /// `q8_0`: rows of `k` i8 codes, f16 scale bits per 32 values (`scales[r·k/32 + g]`).
    Q8_0 {
        k: usize,
        codes: &'a [i8],
        scales: &'a [u16],
    },
    /// `q4_g128`: rows of `k/2` bytes (low nibble = even column, value `u − 8`), f16 scale bits
    /// per 128 values (`scales[r·k/128 + g]`).
    Q4G128 {
        k: usize,
        codes: &'a [u8],
        scales: &'a [u16],
    },
    /// `fp8_e4m3`: rows of `k` E4M3 codes, f32 scales per 128 values
    /// (`scales[r·ceil(k/128) + g]`).
    F8E4M3 {
        k: usize,
        codes: &'a [u8],
        scales: &'a [f32],
    },
    /// `q4_nl_g128`: the `q4_g128` layout, value `d · Q4_NL_LEVELS[u]`.
    Q4NlG128 {
        k: usize,
        codes: &'a [u8],
        scales: &'a [u16],
    },
}

impl WeightView<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            WeightView::F32(s) => s.len(),
            WeightView::Bf16(s) | WeightView::F16(s) => s.len(),
            WeightView::Q8_0 { codes, .. } => codes.len(),
            WeightView::Q4G128 { codes, .. } | WeightView::Q4NlG128 { codes, .. } => {
                codes.len() * 2
            }
            WeightView::F8E4M3 { codes, .. } => codes.len(),
        }
    }

    /// True for the quantized views.
    pub fn is_quantized(&self) -> bool {
        matches!(
            self,
            WeightView::Q8_0 { .. }
                | WeightView::Q4G128 { .. }
                | WeightView::F8E4M3 { .. }
                | WeightView::Q4NlG128 { .. }
        )
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decodes elements `[start, start + out.len())` (row-major over the whole tensor) to f32:
    /// exact for the element types, the format's values (as `dequantize`) for quantized ones.
    #[inline(always)]
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
            WeightView::Q8_0 { k, codes, scales } => {
                for_groups(*k, Q8_0_GROUP, start, out, |r, g, c0, o| {
                    let d = f16::from_bits(scales[r * (k / Q8_0_GROUP) + g]).to_f32();
                    let c = &codes[r * k + c0..r * k + c0 + o.len()];
                    for (v, &q) in o.iter_mut().zip(c) {
                        *v = d * f32::from(q);
                    }
                })
            }
            WeightView::Q4G128 { k, codes, scales } => {
                for_groups(*k, G128, start, out, |r, g, c0, o| {
                    let d = f16::from_bits(scales[r * (k / G128) + g]).to_f32();
                    let base = r * k + c0;
                    if base % 2 == 0 && o.len() % 2 == 0 {
                        let c = &codes[base / 2..(base + o.len()) / 2];
                        for (pair, &b) in o.chunks_exact_mut(2).zip(c) {
                            pair[0] = d * f32::from((b & 0xF) as i8 - 8);
                            pair[1] = d * f32::from((b >> 4) as i8 - 8);
                        }
                    } else {
                        for (j, v) in o.iter_mut().enumerate() {
                            let e = base + j;
                            let b = codes[e / 2] >> (4 * (e % 2));
                            *v = d * f32::from((b & 0xF) as i8 - 8);
                        }
                    }
                })
            }
            WeightView::F8E4M3 { k, codes, scales } => {
                let per_row = k.div_ceil(G128);
                for_groups(*k, G128, start, out, |r, g, c0, o| {
                    let s = scales[r * per_row + g];
                    let c = &codes[r * k + c0..r * k + c0 + o.len()];
                    for (v, &q) in o.iter_mut().zip(c) {
                        *v = E4M3_TABLE[q as usize] * s;
                    }
                })
            }
            WeightView::Q4NlG128 { k, codes, scales } => {
                for_groups(*k, G128, start, out, |r, g, c0, o| {
                    let d = f16::from_bits(scales[r * (k / G128) + g]).to_f32();
                    let base = r * k + c0;
                    for (j, v) in o.iter_mut().enumerate() {
                        let e = base + j;
                        let u = (codes[e / 2] >> (4 * (e % 2))) & 0xF;
                        *v = d * Q4_NL_LEVELS[usize::from(u)];
                    }
                })
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
            _ => {
                let mut out = [0f32];
                self.dot_rows(x, n, start, &mut out);
                out[0]
            }
        }
    }

    /// `out[t] = x_t · row` for `T = out.len()` ≤ [`MAX_MULTI`] inputs `x_t = xs[t·n..(t+1)·n]`
    /// and the row of elements `[start, start + n)`: decodes each block of the row once and
    /// accumulates every input with the [`dot`] lane structure, so `out[t]` equals
    /// `dot_row(x_t, start)` bit for bit whatever T is (and whatever the dtype).
    #[inline]
    pub fn dot_rows(&self, xs: &[f32], n: usize, start: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2_f16c() {
            // SAFETY: AVX2 and F16C support were detected at run time.
            return unsafe { quant::dot_rows_avx2(self, xs, n, start, out) };
        }
        quant::dot_rows_impl(self, xs, n, start, out)
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
    let layout = quant_layout(w.dtype, &w.dims)?;
    if bytes.len() != layout.total {
        return Err(OpError::shape(
            "weight",
            format!("{} bytes for {:?} {}", bytes.len(), w.dims, w.dtype.name()),
        ));
    }
    let numel = layout.rows * layout.k;
    let scales = &bytes[layout.scales_offset..];
    let bad = |_| OpError::DType {
        op: "weight",
        dtype: format!("{} (misaligned bytes)", w.dtype),
    };
    Ok(match w.dtype {
        WeightDType::F32 => WeightView::F32(bytemuck::try_cast_slice(bytes).map_err(bad)?),
        WeightDType::Bf16 => WeightView::Bf16(bytemuck::try_cast_slice(bytes).map_err(bad)?),
        WeightDType::F16 => WeightView::F16(bytemuck::try_cast_slice(bytes).map_err(bad)?),
        WeightDType::Q8_0 => WeightView::Q8_0 {
            k: layout.k,
            codes: bytemuck::cast_slice(&bytes[..numel]),
            scales: bytemuck::try_cast_slice(scales).map_err(bad)?,
        },
        WeightDType::Q4G128 => WeightView::Q4G128 {
            k: layout.k,
            codes: &bytes[..numel / 2],
            scales: bytemuck::try_cast_slice(scales).map_err(bad)?,
        },
        WeightDType::F8E4M3 => WeightView::F8E4M3 {
            k: layout.k,
            codes: &bytes[..numel],
            scales: bytemuck::try_cast_slice(scales).map_err(bad)?,
        },
        WeightDType::Q4NlG128 => WeightView::Q4NlG128 {
            k: layout.k,
            codes: &bytes[..numel / 2],
            scales: bytemuck::try_cast_slice(scales).map_err(bad)?,
        },
    })
}

/// Byte alignment the typed view of `dtype` needs (its widest element or scale).
pub fn alignment(dtype: WeightDType) -> usize {
    match dtype {
        WeightDType::F32 | WeightDType::F8E4M3 => 4,
        WeightDType::F16
        | WeightDType::Bf16
        | WeightDType::Q8_0
        | WeightDType::Q4G128
        | WeightDType::Q4NlG128 => 2,
    }
}

/// Most inputs [`WeightView::dot_rows`] takes at once.
pub const MAX_MULTI: usize = 8;

/// Splits elements `[start, start + out.len())` of a `[R, k]` tensor at row and scale-group
/// boundaries and calls `f(row, group, first column, out part)` for each piece, in order.
#[inline(always)]
fn for_groups(
    k: usize,
    group: usize,
    start: usize,
    out: &mut [f32],
    mut f: impl FnMut(usize, usize, usize, &mut [f32]),
) {
    let mut pos = start;
    let mut rest = out;
    while !rest.is_empty() {
        let (r, c) = (pos / k, pos % k);
        let g = c / group;
        let end = ((g + 1) * group).min(k);
        let m = (end - c).min(rest.len());
        let (part, tail) = rest.split_at_mut(m);
        f(r, g, c, part);
        rest = tail;
        pos += m;
    }
}

/// Blocks of 256 decoded values (a multiple of LANES, so the lane order is that of [`dot`]),
/// then the sequential tail. Any dtype, any element range.
#[inline(always)]
fn dot_rows_decoded(w: &WeightView<'_>, xs: &[f32], n: usize, start: usize, out: &mut [f32]) {
    let t = out.len().min(MAX_MULTI);
    let mut buf = [0f32; 256];
    let mut acc = [[0f32; LANES]; MAX_MULTI];
    let full = n / LANES * LANES;
    let mut k = 0;
    while k < full {
        let m = (full - k).min(256);
        w.decode(start + k, &mut buf[..m]);
        for (tt, a) in acc.iter_mut().enumerate().take(t) {
            accumulate(a, &xs[tt * n + k..tt * n + k + m], &buf[..m]);
        }
        k += m;
    }
    let tail_len = n - full;
    w.decode(start + full, &mut buf[..tail_len]);
    for (tt, o) in out.iter_mut().enumerate().take(t) {
        let mut tail = 0f32;
        for (i, v) in buf[..tail_len].iter().enumerate() {
            tail += xs[tt * n + full + i] * v;
        }
        *o = reduce(&acc[tt]) + tail;
    }
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

/// True when the AVX2 + F16C quantized kernels may run (detected once).
#[cfg(target_arch = "x86_64")]
fn has_avx2_f16c() -> bool {
    use std::sync::OnceLock;
    static F16C: OnceLock<bool> = OnceLock::new();
    has_avx2() && *F16C.get_or_init(|| std::arch::is_x86_feature_detected!("f16c"))
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

    const QUANT: [WeightDType; 4] = [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ];

    #[test]
    fn quantized_decode_equals_dequantize_at_any_offset() {
        let b = CpuBackend::new();
        let mut r = Rng::new(21);
        for (dt, k) in [
            (WeightDType::Q8_0, 96usize),
            (WeightDType::Q4G128, 256),
            (WeightDType::F8E4M3, 131),
            (WeightDType::Q4NlG128, 256),
        ] {
            let rows = 5;
            let (w, held) = weight(&b, dt, &r.vec(rows * k, 0.7), &[rows, k]);
            let v = view(&w).expect("view");
            assert!(v.is_quantized());
            assert_eq!(v.len(), rows * k);
            assert_eq!(v.to_vec(), held, "{dt} whole tensor");
            // Ranges that start mid-group, cross groups and rows, and have odd lengths.
            for (start, len) in [(0, k), (k + 1, 3), (31, 2 * k + 5), (3 * k - 7, 14), (1, 0)] {
                let mut out = vec![f32::NAN; len];
                v.decode(start, &mut out);
                assert_eq!(out, held[start..start + len], "{dt} [{start}, +{len})");
            }
        }
    }

    #[test]
    fn dot_rows_equal_dot_of_the_decoded_row_whatever_t() {
        let b = CpuBackend::new();
        let mut r = Rng::new(22);
        for (dt, k) in [
            (WeightDType::F16, 300usize),
            (WeightDType::Q8_0, 320),
            (WeightDType::Q4G128, 384),
            (WeightDType::F8E4M3, 301),
            (WeightDType::Q4NlG128, 384),
        ] {
            let (w, held) = weight(&b, dt, &r.vec(3 * k, 0.5), &[3, k]);
            let v = view(&w).expect("view");
            let xs = r.vec(MAX_MULTI * k, 1.0);
            for t in 1..=MAX_MULTI {
                let mut out = vec![0f32; t];
                v.dot_rows(&xs[..t * k], k, 2 * k, &mut out);
                let mut base = vec![0f32; t];
                quant::dot_rows_impl(&v, &xs[..t * k], k, 2 * k, &mut base);
                // The generic block-decoding path (used for partial rows) agrees too.
                let mut decoded = vec![0f32; t];
                dot_rows_decoded(&v, &xs[..t * k], k, 2 * k, &mut decoded);
                assert_eq!(
                    decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    base.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{dt} decoded t={t}"
                );
                for tt in 0..t {
                    let x = &xs[tt * k..(tt + 1) * k];
                    let want = dot(x, &held[2 * k..3 * k]);
                    assert_eq!(out[tt].to_bits(), want.to_bits(), "{dt} t={t}");
                    assert_eq!(base[tt].to_bits(), want.to_bits(), "{dt} baseline t={t}");
                    assert_eq!(v.dot_row(x, 2 * k).to_bits(), want.to_bits());
                }
            }
        }
    }

    #[test]
    fn quantized_views_reject_wrong_lengths() {
        let b = CpuBackend::new();
        for dt in QUANT {
            let (mut w, _) = weight(&b, dt, &Rng::new(23).vec(2 * 128, 1.0), &[2, 128]);
            w.dims = vec![2, 256];
            assert!(view(&w).is_err(), "{dt}");
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
