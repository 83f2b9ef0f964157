//! The fused GEMV kernels for whole quantized rows (`q8_0`, `q4_g128`, `fp8_e4m3`,
//! `q4_nl_g128`): each chunk
//! of 32 weights is decoded once, in registers, and multiplied with up to [`MAX_MULTI`] inputs.
//!
//! The lanes (32 per chunk, chunks from the row start), the separately rounded multiply and add
//! per lane, the pairwise reduction and the sequential tail are exactly those of [`dot`](super::dot), and a
//! decoded weight is the single f32 product `dequantize` defines, so every output equals `dot`
//! of its input and the dequantized row bit for bit, whatever T is and whichever of the scalar
//! and AVX2 builds runs.

use super::{
    dot_rows_decoded, reduce, WeightView, E4M3_TABLE, G128, LANES, MAX_MULTI, Q4_NL_LEVELS,
    Q8_0_GROUP,
};
use half::f16;

/// [`WeightView::dot_rows`]: the fused per-format kernels for a whole quantized row, else
/// `dot_rows_decoded`.
#[inline(always)]
pub(super) fn dot_rows_impl(
    w: &WeightView<'_>,
    xs: &[f32],
    n: usize,
    start: usize,
    out: &mut [f32],
) {
    match quant_row(w, xs, n, start, out.len()) {
        Some(QuantRow::Q8(r)) => fused_rows(xs, n, out, &r),
        Some(QuantRow::Q4(r)) => fused_rows(xs, n, out, &r),
        Some(QuantRow::F8(r)) => fused_rows(xs, n, out, &r),
        Some(QuantRow::Q4Nl(r)) => fused_rows(xs, n, out, &r),
        None => dot_rows_decoded(w, xs, n, start, out),
    }
}

/// A whole quantized row, sliced out of its view.
enum QuantRow<'a> {
    Q8(Q8Row<'a>),
    Q4(Q4Row<'a>),
    F8(F8Row<'a>),
    Q4Nl(Q4NlRow<'a>),
}

/// The row of elements `[start, start + n)` when it is one whole row of a quantized view and
/// `xs` holds `t ≤ MAX_MULTI` inputs of `n` values (the fused kernels' preconditions).
#[inline(always)]
fn quant_row<'a>(
    w: &WeightView<'a>,
    xs: &[f32],
    n: usize,
    start: usize,
    t: usize,
) -> Option<QuantRow<'a>> {
    let ok = |k: usize| n == k && k > 0 && start % k == 0 && t <= MAX_MULTI && xs.len() >= t * k;
    match *w {
        WeightView::Q8_0 { k, codes, scales } if ok(k) => {
            let (per_row, row) = (k / Q8_0_GROUP, start / k);
            Some(QuantRow::Q8(Q8Row {
                codes: codes.get(start..start + k)?,
                scales: scales.get(row * per_row..(row + 1) * per_row)?,
            }))
        }
        WeightView::Q4G128 { k, codes, scales } if ok(k) => {
            let (per_row, row) = (k / G128, start / k);
            Some(QuantRow::Q4(Q4Row {
                codes: codes.get(start / 2..(start + k) / 2)?,
                scales: scales.get(row * per_row..(row + 1) * per_row)?,
            }))
        }
        WeightView::Q4NlG128 { k, codes, scales } if ok(k) => {
            let (per_row, row) = (k / G128, start / k);
            Some(QuantRow::Q4Nl(Q4NlRow {
                codes: codes.get(start / 2..(start + k) / 2)?,
                scales: scales.get(row * per_row..(row + 1) * per_row)?,
            }))
        }
        WeightView::F8E4M3 { k, codes, scales } if ok(k) => {
            let (per_row, row) = (k.div_ceil(G128), start / k);
            Some(QuantRow::F8(F8Row {
                codes: codes.get(start..start + k)?,
                scales: scales.get(row * per_row..(row + 1) * per_row)?,
            }))
        }
        _ => None,
    }
}

/// One quantized row as chunks of [`LANES`] decoded weights (the fused GEMV kernels).
trait RowChunks {
    /// Writes the weights of columns `[c·LANES, (c+1)·LANES)`.
    fn chunk(&self, c: usize, w: &mut [f32; LANES]);
    /// The sequential dot of `x` with the row's last `K % LANES` weights.
    fn tail(&self, x: &[f32]) -> f32;
}

/// A `q8_0` row: K codes and K/32 f16 scales.
struct Q8Row<'a> {
    codes: &'a [i8],
    scales: &'a [u16],
}

impl RowChunks for Q8Row<'_> {
    #[inline(always)]
    fn chunk(&self, c: usize, w: &mut [f32; LANES]) {
        let d = f16::from_bits(self.scales[c]).to_f32();
        let q: &[i8; LANES] = lanes(&self.codes[c * LANES..]);
        for (v, &q) in w.iter_mut().zip(q) {
            *v = d * f32::from(q);
        }
    }
    #[inline(always)]
    fn tail(&self, _x: &[f32]) -> f32 {
        0.0
    }
}

/// A `q4_g128` row: K/2 nibble-pair bytes and K/128 f16 scales.
struct Q4Row<'a> {
    codes: &'a [u8],
    scales: &'a [u16],
}

impl RowChunks for Q4Row<'_> {
    #[inline(always)]
    fn chunk(&self, c: usize, w: &mut [f32; LANES]) {
        let d = f16::from_bits(self.scales[c / (G128 / LANES)]).to_f32();
        let q: &[u8; LANES / 2] = lanes(&self.codes[c * LANES / 2..]);
        for (pair, &b) in w.chunks_exact_mut(2).zip(q) {
            pair[0] = d * f32::from((b & 0xF) as i8 - 8);
            pair[1] = d * f32::from((b >> 4) as i8 - 8);
        }
    }
    #[inline(always)]
    fn tail(&self, _x: &[f32]) -> f32 {
        0.0
    }
}

/// A `q4_nl_g128` row: K/2 nibble-pair bytes and K/128 f16 scales.
struct Q4NlRow<'a> {
    codes: &'a [u8],
    scales: &'a [u16],
}

impl RowChunks for Q4NlRow<'_> {
    #[inline(always)]
    fn chunk(&self, c: usize, w: &mut [f32; LANES]) {
        let d = f16::from_bits(self.scales[c / (G128 / LANES)]).to_f32();
        let q: &[u8; LANES / 2] = lanes(&self.codes[c * LANES / 2..]);
        for (pair, &b) in w.chunks_exact_mut(2).zip(q) {
            pair[0] = d * Q4_NL_LEVELS[usize::from(b & 0xF)];
            pair[1] = d * Q4_NL_LEVELS[usize::from(b >> 4)];
        }
    }
    #[inline(always)]
    fn tail(&self, _x: &[f32]) -> f32 {
        0.0
    }
}

/// An `fp8_e4m3` row: K codes and ceil(K/128) f32 scales.
struct F8Row<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
}

impl RowChunks for F8Row<'_> {
    #[inline(always)]
    fn chunk(&self, c: usize, w: &mut [f32; LANES]) {
        let s = self.scales[c / (G128 / LANES)];
        let q: &[u8; LANES] = lanes(&self.codes[c * LANES..]);
        for (v, &q) in w.iter_mut().zip(q) {
            *v = E4M3_TABLE[q as usize] * s;
        }
    }
    #[inline(always)]
    fn tail(&self, x: &[f32]) -> f32 {
        let full = self.codes.len() / LANES * LANES;
        let s = self.scales[self.scales.len().saturating_sub(1)];
        let mut tail = 0f32;
        for (xv, &q) in x.iter().zip(&self.codes[full..]) {
            tail += xv * (E4M3_TABLE[q as usize] * s);
        }
        tail
    }
}

/// The first `N` elements of `s` as an array (one bounds check, so the loops over it vectorise).
#[inline(always)]
fn lanes<T, const N: usize>(s: &[T]) -> &[T; N] {
    match s.first_chunk() {
        Some(a) => a,
        None => panic!("lanes: slice shorter than its chunk (caller checked the row bounds)"),
    }
}

/// Calls [`fused_rows_t`] with T = `out.len()` (1..=[`MAX_MULTI`]) as a constant, so the
/// accumulators of small T stay in registers.
#[inline(always)]
fn fused_rows<R: RowChunks>(xs: &[f32], k: usize, out: &mut [f32], r: &R) {
    match out.len() {
        1 => fused_rows_t::<1, R>(xs, k, out, r),
        2 => fused_rows_t::<2, R>(xs, k, out, r),
        3 => fused_rows_t::<3, R>(xs, k, out, r),
        4 => fused_rows_t::<4, R>(xs, k, out, r),
        5 => fused_rows_t::<5, R>(xs, k, out, r),
        6 => fused_rows_t::<6, R>(xs, k, out, r),
        7 => fused_rows_t::<7, R>(xs, k, out, r),
        _ => fused_rows_t::<8, R>(xs, k, out, r),
    }
}

/// `out[t] = reduce(lanes of x_t · row) + tail(x_t)` over the `k / LANES` full chunks of a row
/// and its last `k % LANES` columns. Chunks are 32 columns from the row start: exactly the
/// lanes and the final sum of [`dot`](super::dot).
#[inline(always)]
fn fused_rows_t<const T: usize, R: RowChunks>(xs: &[f32], k: usize, out: &mut [f32], r: &R) {
    let mut acc = [[0f32; LANES]; T];
    let mut w = [0f32; LANES];
    let full = k / LANES * LANES;
    for c in 0..k / LANES {
        r.chunk(c, &mut w);
        for (t, a) in acc.iter_mut().enumerate() {
            let x: &[f32; LANES] = lanes(&xs[t * k + c * LANES..]);
            for i in 0..LANES {
                a[i] += x[i] * w[i];
            }
        }
    }
    for (t, (o, a)) in out.iter_mut().zip(&acc).enumerate() {
        *o = reduce(a) + r.tail(&xs[t * k + full..(t + 1) * k]);
    }
}
/// Calls the AVX2 kernel `simd::$f::<T>` with T = `out.len()` (1..=MAX_MULTI) as a constant,
/// so the accumulators of small T stay in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! by_t {
    ($f:ident, $xs:expr, $n:expr, $r:expr, $out:expr) => {
        match $out.len() {
            1 => simd::$f::<1>($xs, $n, $r, $out),
            2 => simd::$f::<2>($xs, $n, $r, $out),
            3 => simd::$f::<3>($xs, $n, $r, $out),
            4 => simd::$f::<4>($xs, $n, $r, $out),
            5 => simd::$f::<5>($xs, $n, $r, $out),
            6 => simd::$f::<6>($xs, $n, $r, $out),
            7 => simd::$f::<7>($xs, $n, $r, $out),
            _ => simd::$f::<8>($xs, $n, $r, $out),
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
/// # Safety
/// The CPU must support AVX2 and F16C.
pub(super) unsafe fn dot_rows_avx2(
    w: &WeightView<'_>,
    xs: &[f32],
    n: usize,
    start: usize,
    out: &mut [f32],
) {
    // SAFETY (all four arms): AVX2 is enabled here; `quant_row` checked that the row slices
    // are whole rows and that `xs` holds `out.len()` inputs of `n` values.
    match quant_row(w, xs, n, start, out.len()) {
        Some(QuantRow::Q8(r)) => unsafe { by_t!(q8_rows, xs, n, &r, out) },
        Some(QuantRow::Q4(r)) => unsafe { by_t!(q4_rows, xs, n, &r, out) },
        Some(QuantRow::F8(r)) => unsafe { by_t!(f8_rows, xs, n, &r, out) },
        Some(QuantRow::Q4Nl(r)) => unsafe { by_t!(q4nl_rows, xs, n, &r, out) },
        None => dot_rows_decoded(w, xs, n, start, out),
    }
}

/// AVX2 versions of the fused quantized-row kernels: the same lanes (32 = 4 × 8), the same
/// separately rounded multiplies and adds (no FMA) and the same final reduction as the scalar
/// [`fused_rows`], hence bit-identical results.
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::{reduce, F8Row, Q4NlRow, Q4Row, Q8Row, RowChunks, E4M3_TABLE, LANES};
    use kvstream_memory_contracts::weight_format::Q4_NL_LEVELS_I8;
    use std::arch::x86_64::*;

    /// The 32 weights of one chunk, 8 per register.
    type Chunk = [__m256; 4];

    // The helpers below are safe `#[target_feature]` functions: callable only from AVX2
    // contexts (the `fused!` kernels), where the compiler inlines them.

    /// f16 bits → f32 (exact, F16C) in all 8 lanes; no call, so no register spills.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn f16_splat(bits: u16) -> __m256 {
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
    }

    /// 8 signed bytes → 8 f32.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn i8x8(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn q8_chunk(r: &Q8Row<'_>, c: usize) -> Chunk {
        let d = f16_splat(r.scales[c]);
        let q = &r.codes[c * LANES..(c + 1) * LANES];
        // SAFETY: `q` has 32 bytes; the two unaligned 16-byte loads stay inside it.
        let (a, b) = unsafe {
            (
                _mm_loadu_si128(q.as_ptr().cast()),
                _mm_loadu_si128(q.as_ptr().add(16).cast()),
            )
        };
        [
            _mm256_mul_ps(d, i8x8(a)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(a))),
            _mm256_mul_ps(d, i8x8(b)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(b))),
        ]
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn q4_chunk(r: &Q4Row<'_>, c: usize) -> Chunk {
        let d = f16_splat(r.scales[c / 4]);
        let q = &r.codes[c * LANES / 2..(c + 1) * LANES / 2];
        // SAFETY: `q` has 16 bytes, the size of the load.
        let b = unsafe { _mm_loadu_si128(q.as_ptr().cast()) };
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        // Interleave so element 2j is the low nibble of byte j, then q = u − 8.
        let eight = _mm_set1_epi8(8);
        let v0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), eight);
        let v1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), eight);
        [
            _mm256_mul_ps(d, i8x8(v0)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(v0))),
            _mm256_mul_ps(d, i8x8(v1)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(v1))),
        ]
    }

    /// `q4_nl_g128`: the nibbles index the 16-byte int8 table with one byte shuffle, then
    /// `d · L[u]` as for q4_g128 (the i8 → f32 conversion is exact, so the product is the one
    /// `dequantize` computes).
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn q4nl_chunk(r: &Q4NlRow<'_>, c: usize) -> Chunk {
        let d = f16_splat(r.scales[c / 4]);
        let q = &r.codes[c * LANES / 2..(c + 1) * LANES / 2];
        // SAFETY: `q` has 16 bytes, the size of the load; the table is 16 bytes too.
        let (b, table) = unsafe {
            (
                _mm_loadu_si128(q.as_ptr().cast()),
                _mm_loadu_si128(Q4_NL_LEVELS_I8.as_ptr().cast()),
            )
        };
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(b, m);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(b), m);
        // Interleave so element 2j is the low nibble of byte j, then look the levels up.
        let v0 = _mm_shuffle_epi8(table, _mm_unpacklo_epi8(lo, hi));
        let v1 = _mm_shuffle_epi8(table, _mm_unpackhi_epi8(lo, hi));
        [
            _mm256_mul_ps(d, i8x8(v0)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(v0))),
            _mm256_mul_ps(d, i8x8(v1)),
            _mm256_mul_ps(d, i8x8(_mm_srli_si128::<8>(v1))),
        ]
    }

    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn f8_chunk(r: &F8Row<'_>, c: usize) -> Chunk {
        let s = _mm256_set1_ps(r.scales[c / 4]);
        let q = &r.codes[c * LANES..(c + 1) * LANES];
        let mut out = [_mm256_setzero_ps(); 4];
        for (j, o) in out.iter_mut().enumerate() {
            // SAFETY: bytes [8j, 8j + 8) of the 32-byte `q`; the gather indices are bytes
            // (< 256 = the table's length).
            unsafe {
                let idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(q.as_ptr().add(8 * j).cast()));
                let v = _mm256_i32gather_ps::<4>(E4M3_TABLE.as_ptr(), idx);
                *o = _mm256_mul_ps(v, s);
            }
        }
        out
    }

    /// `acc[t][j] += x_t[c·32 + 8j ..] · w[j]`, then the final reduction plus the row's tail.
    macro_rules! fused {
        ($name:ident, $row:ty, $chunk:ident) => {
            /// # Safety
            /// AVX2 and F16C must be available; `xs` must hold `T` inputs of `k` values,
            /// `out.len() == T` (≤ MAX_MULTI) and `r` a whole row of `k` values.
            #[target_feature(enable = "avx2,f16c")]
            pub(super) unsafe fn $name<const T: usize>(
                xs: &[f32],
                k: usize,
                r: &$row,
                out: &mut [f32],
            ) {
                let mut acc = [[_mm256_setzero_ps(); 4]; T];
                let chunks = k / LANES;
                for c in 0..chunks {
                    let w = $chunk(r, c);
                    for (tt, a) in acc.iter_mut().enumerate() {
                        let x = &xs[tt * k + c * LANES..tt * k + (c + 1) * LANES];
                        for (j, aj) in a.iter_mut().enumerate() {
                            // SAFETY: floats [8j, 8j + 8) of the 32-float slice `x`.
                            let xv = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * j)) };
                            *aj = _mm256_add_ps(*aj, _mm256_mul_ps(xv, w[j]));
                        }
                    }
                }
                let full = chunks * LANES;
                for (tt, o) in out.iter_mut().enumerate().take(T) {
                    let mut lanes = [0f32; LANES];
                    for (j, aj) in acc[tt].iter().enumerate() {
                        // SAFETY: floats [8j, 8j + 8) of the 32-float array.
                        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr().add(8 * j), *aj) };
                    }
                    *o = reduce(&lanes) + r.tail(&xs[tt * k + full..(tt + 1) * k]);
                }
            }
        };
    }

    fused!(q8_rows, Q8Row<'_>, q8_chunk);
    fused!(q4_rows, Q4Row<'_>, q4_chunk);
    fused!(f8_rows, F8Row<'_>, f8_chunk);
    fused!(q4nl_rows, Q4NlRow<'_>, q4nl_chunk);
}
