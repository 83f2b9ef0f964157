//! Quantize and dequantize whole tensors or single rows (single-threaded reference code; the
//! model loader parallelises over rows, backends decode in their own kernels).

use super::e4m3::{e4m3_round, f32_to_e4m3, E4M3_MAX, E4M3_TABLE};
use super::q4_nl::{self, Q4_NL_LEVELS};
use super::{quant_layout, QuantLayout, WeightFormatError, G128, Q8_0_GROUP};
use crate::backend::WeightDType;
use half::{bf16, f16};

/// Encodes `values` (row-major, `dims`) as `dtype`: a plain little-endian encode for the element
/// types (f16/bf16 round to nearest even), the quantization rules of the module docs for the
/// quantized types. Deterministic: the same input always gives the same bytes.
pub fn quantize(
    dtype: WeightDType,
    values: &[f32],
    dims: &[usize],
) -> Result<Vec<u8>, WeightFormatError> {
    let l = quant_layout(dtype, dims)?;
    let numel = l.rows * l.k;
    if values.len() != numel {
        return Err(WeightFormatError::Length {
            dtype,
            expected: numel,
            got: values.len(),
        });
    }
    let _s =
        tracing::trace_span!("weight_format.quantize", %dtype, rows = l.rows, k = l.k).entered();
    let mut out = vec![0u8; l.total];
    match dtype {
        WeightDType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(values) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        WeightDType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        WeightDType::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        WeightDType::Q8_0 => {
            let (codes, scales) = out.split_at_mut(l.scales_offset);
            for (g, (x, c)) in values
                .chunks_exact(Q8_0_GROUP)
                .zip(codes.chunks_exact_mut(Q8_0_GROUP))
                .enumerate()
            {
                let d = quantize_q8_0_group(x, c);
                scales[2 * g..2 * g + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => {
            let group = if dtype == WeightDType::Q4G128 {
                quantize_q4_g128_group
            } else {
                q4_nl::quantize_group
            };
            let (codes, scales) = out.split_at_mut(l.scales_offset);
            for (g, (x, c)) in values
                .chunks_exact(G128)
                .zip(codes.chunks_exact_mut(G128 / 2))
                .enumerate()
            {
                let d = group(x, c);
                scales[2 * g..2 * g + 2].copy_from_slice(&d.to_le_bytes());
            }
        }
        WeightDType::F8E4M3 => {
            let (codes, scales) = out.split_at_mut(l.scales_offset);
            let per_row = l.k.div_ceil(G128);
            for (r, (xrow, crow)) in values
                .chunks_exact(l.k)
                .zip(codes[..numel].chunks_exact_mut(l.k))
                .enumerate()
            {
                for (g, (x, c)) in xrow.chunks(G128).zip(crow.chunks_mut(G128)).enumerate() {
                    let s = quantize_fp8_group(x, c);
                    let at = 4 * (r * per_row + g);
                    scales[at..at + 4].copy_from_slice(&s.to_le_bytes());
                }
            }
        }
    }
    Ok(out)
}

/// q8_0 group: d = f16(amax / 127); q = clamp(round_half_away(x / f32(d)), −127, 127); all q = 0
/// when d == 0. Returns d.
fn quantize_q8_0_group(x: &[f32], codes: &mut [u8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(amax / 127.0);
    let df = d.to_f32();
    for (c, v) in codes.iter_mut().zip(x) {
        *c = if df == 0.0 {
            0
        } else {
            ((v / df).round().clamp(-127.0, 127.0) as i8) as u8
        };
    }
    if df == 0.0 {
        f16::ZERO
    } else {
        d
    }
}

/// Candidate steps `i` of the q4_g128 scale search (`d0 · (1 + 0.03·i)`: 0.64·d0 ..= 1.18·d0;
/// Gaussian-like groups prefer clipping the largest value, hence the longer downward range).
/// q4_g128's code → level map: code u is the integer u − 8 (exact in f32).
const Q4_UNIFORM_LEVELS: [f32; 16] = [
    -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
];

const CANDIDATES: std::ops::RangeInclusive<i32> = -12..=6;
/// Least-squares refinement steps after the candidate search.
const REFINE_STEPS: usize = 2;

/// q4_g128 group: the candidate search of the module docs, then least-squares refinement. The
/// candidate scales are computed in f32 as `d0 · (1 + 0.03·i)`; the squared error of a candidate
/// is summed in f64 in element order. Returns the stored f16 scale.
fn quantize_q4_g128_group(x: &[f32], codes: &mut [u8]) -> f16 {
    let mut amax = 0f32;
    let mut m = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            m = v;
        }
    }
    let d0 = m / -8.0;
    if d0 == 0.0 || !d0.is_finite() {
        codes.fill(0x88);
        return f16::ZERO;
    }
    let q_of = |v: f32, d: f32| -> i8 {
        if d == 0.0 {
            0
        } else {
            (v / d).round().clamp(-8.0, 7.0) as i8
        }
    };
    let err_of = |d: f32| -> f64 {
        x.iter()
            .map(|&v| {
                let e = f64::from(v) - f64::from(d * f32::from(q_of(v, d)));
                e * e
            })
            .sum()
    };
    let mut best: Option<(f64, f16)> = None;
    for i in CANDIDATES {
        let d16 = f16::from_f32(d0 * (1.0 + 0.03 * i as f32));
        let err = err_of(d16.to_f32());
        if best.is_none_or(|(b, _)| err < b) {
            best = Some((err, d16));
        }
    }
    // Least-squares refinement: for fixed codes q the error is smallest at d = Σx·q / Σq²;
    // requantise with that scale and keep it only while the error drops.
    for _ in 0..REFINE_STEPS {
        let Some((best_err, d16)) = best else { break };
        let d = d16.to_f32();
        let (mut sxq, mut sqq) = (0f64, 0f64);
        for &v in x {
            let q = f64::from(q_of(v, d));
            sxq += f64::from(v) * q;
            sqq += q * q;
        }
        if sqq == 0.0 {
            break;
        }
        let cand = f16::from_f32((sxq / sqq) as f32);
        let err = err_of(cand.to_f32());
        if err < best_err {
            best = Some((err, cand));
        } else {
            break;
        }
    }
    let d16 = best.map_or(f16::ZERO, |(_, d)| d);
    let d = d16.to_f32();
    for (c, pair) in codes.iter_mut().zip(x.chunks_exact(2)) {
        let lo = (q_of(pair[0], d) + 8) as u8;
        let hi = (q_of(pair[1], d) + 8) as u8;
        *c = lo | (hi << 4);
    }
    d16
}

/// Candidate scales of the fp8 search: `s0 · (1 + i / FP8_CANDIDATES)` for `i` in
/// `0..FP8_CANDIDATES`, one octave above the plain `s0 = amax / 448` (E4M3 is a floating-point
/// grid, so the octave covers every alignment of the group's values with the 3-bit mantissa;
/// scales below `s0` would saturate the largest value and gained nothing on the fixtures).
const FP8_CANDIDATES: u16 = 32;
/// Least-squares refinement steps after the fp8 candidate search.
const FP8_REFINE_STEPS: usize = 3;

/// fp8 group: a search over the scales `s0 · (1 + i/32)` (`s0 = amax / 448`, `i = 0..32`) for the
/// smallest squared error (summed in f64, see [`fp8_error`]; the earliest candidate wins ties,
/// so `s0` unless another is strictly better), then least-squares refinement (`s = Σx·c / Σc²` for
/// the decoded codes `c`, kept only while the error drops and `s ≥ s0`, so nothing saturates).
/// q = e4m3(x / scale). Scale 1 and all q = 0 when amax == 0; the plain `s0` when the group
/// holds a NaN or an infinity. Returns the scale.
fn quantize_fp8_group(x: &[f32], codes: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let s0 = if amax == 0.0 { 1.0 } else { amax / E4M3_MAX };
    let scale = if amax > 0.0 && s0.is_finite() && s0 > 0.0 {
        search_fp8_scale(x, s0)
    } else {
        s0
    };
    for (c, v) in codes.iter_mut().zip(x) {
        *c = f32_to_e4m3(v / scale);
    }
    scale
}

/// Lanes of the fp8 error sums (a fixed summation order that vectorizes).
const LANES: usize = 8;

/// The squared error of encoding `x` (finite values) with `scale`, summed in f64 over
/// [`LANES`] lanes (lane `j` takes the elements `j mod LANES`, in order; then the lanes in
/// order), or `None` once a block's running total reaches `limit` (the terms are never
/// negative, so such a candidate cannot win).
fn fp8_error(x: &[f32], scale: f32, limit: f64) -> Option<f64> {
    let mut acc = [0f64; LANES];
    let add = |lane: &mut f64, v: f32| {
        let e = f64::from(v) - f64::from(e4m3_round(v / scale) * scale);
        *lane += e * e;
    };
    let blocks = x.chunks_exact(4 * LANES);
    let tail = blocks.remainder();
    for block in blocks {
        for part in block.chunks_exact(LANES) {
            for (lane, &v) in acc.iter_mut().zip(part) {
                add(lane, v);
            }
        }
        if acc.iter().sum::<f64>() >= limit {
            return None;
        }
    }
    for part in tail.chunks(LANES) {
        for (lane, &v) in acc.iter_mut().zip(part) {
            add(lane, v);
        }
    }
    let sum = acc.iter().sum::<f64>();
    (sum < limit).then_some(sum)
}

/// The fp8 scale search of [`quantize_fp8_group`] (`s0` finite and > 0).
fn search_fp8_scale(x: &[f32], s0: f32) -> f32 {
    if !x.iter().all(|v| v.is_finite()) {
        return s0;
    }
    let Some(mut best) = fp8_error(x, s0, f64::INFINITY) else {
        return s0;
    };
    let mut scale = s0;
    for i in 1..FP8_CANDIDATES {
        let s = s0 * (1.0 + f32::from(i) / f32::from(FP8_CANDIDATES));
        if let Some(e) = fp8_error(x, s, best) {
            (best, scale) = (e, s);
        }
    }
    for _ in 0..FP8_REFINE_STEPS {
        let (mut sxc, mut scc) = (0f64, 0f64);
        for &v in x {
            let c = f64::from(e4m3_round(v / scale));
            sxc += f64::from(v) * c;
            scc += c * c;
        }
        let s = (sxc / scc) as f32;
        if !(s.is_finite() && s >= s0) {
            break;
        }
        match fp8_error(x, s, best) {
            Some(e) => (best, scale) = (e, s),
            None => break,
        }
    }
    scale
}

fn check_bytes(
    dtype: WeightDType,
    bytes: &[u8],
    dims: &[usize],
) -> Result<QuantLayout, WeightFormatError> {
    let l = quant_layout(dtype, dims)?;
    if bytes.len() != l.total {
        return Err(WeightFormatError::Length {
            dtype,
            expected: l.total,
            got: bytes.len(),
        });
    }
    Ok(l)
}

/// Decodes row `row` (of `R = numel / K`) of a blob into `out` (`K` values): exactly the values
/// the format defines (one f32 multiply per value for the quantized types).
pub fn dequantize_row(
    dtype: WeightDType,
    bytes: &[u8],
    dims: &[usize],
    row: usize,
    out: &mut [f32],
) -> Result<(), WeightFormatError> {
    let l = check_bytes(dtype, bytes, dims)?;
    if row >= l.rows {
        return Err(WeightFormatError::Shape {
            dtype,
            dims: dims.to_vec(),
            reason: format!("row {row} >= {} rows", l.rows),
        });
    }
    if out.len() != l.k {
        return Err(WeightFormatError::Length {
            dtype,
            expected: l.k,
            got: out.len(),
        });
    }
    decode_row_unchecked(dtype, &l, bytes, row, out);
    Ok(())
}

/// Decodes every row of a blob (`R·K` values, row-major).
pub fn dequantize(
    dtype: WeightDType,
    bytes: &[u8],
    dims: &[usize],
) -> Result<Vec<f32>, WeightFormatError> {
    let l = check_bytes(dtype, bytes, dims)?;
    let _s =
        tracing::trace_span!("weight_format.dequantize", %dtype, rows = l.rows, k = l.k).entered();
    let mut out = vec![0f32; l.rows * l.k];
    if l.k > 0 {
        for (r, o) in out.chunks_exact_mut(l.k).enumerate() {
            decode_row_unchecked(dtype, &l, bytes, r, o);
        }
    }
    Ok(out)
}

/// The f16 scale at byte `at`.
#[inline(always)]
fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// Row decode with the layout already validated against `bytes` (`out.len() == K`,
/// `row < R`).
fn decode_row_unchecked(
    dtype: WeightDType,
    l: &QuantLayout,
    bytes: &[u8],
    row: usize,
    out: &mut [f32],
) {
    let k = l.k;
    match dtype {
        WeightDType::F32 => {
            for (o, b) in out.iter_mut().zip(bytes[row * k * 4..].chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightDType::F16 => {
            for (o, b) in out.iter_mut().zip(bytes[row * k * 2..].chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightDType::Bf16 => {
            for (o, b) in out.iter_mut().zip(bytes[row * k * 2..].chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightDType::Q8_0 => {
            let codes = &bytes[row * k..(row + 1) * k];
            let scales = l.scales_offset + 2 * row * (k / Q8_0_GROUP);
            for (g, (o, c)) in out
                .chunks_exact_mut(Q8_0_GROUP)
                .zip(codes.chunks_exact(Q8_0_GROUP))
                .enumerate()
            {
                let d = f16_at(bytes, scales + 2 * g);
                for (v, &q) in o.iter_mut().zip(c) {
                    *v = d * f32::from(q as i8);
                }
            }
        }
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => {
            // The two 4-bit formats share their bytes; only the code → level map differs.
            let levels = if dtype == WeightDType::Q4NlG128 {
                &Q4_NL_LEVELS
            } else {
                &Q4_UNIFORM_LEVELS
            };
            let codes = &bytes[row * k / 2..(row + 1) * k / 2];
            let scales = l.scales_offset + 2 * row * (k / G128);
            for (g, (o, c)) in out
                .chunks_exact_mut(G128)
                .zip(codes.chunks_exact(G128 / 2))
                .enumerate()
            {
                let d = f16_at(bytes, scales + 2 * g);
                for (pair, &b) in o.chunks_exact_mut(2).zip(c) {
                    pair[0] = d * levels[usize::from(b & 0xF)];
                    pair[1] = d * levels[usize::from(b >> 4)];
                }
            }
        }
        WeightDType::F8E4M3 => {
            let codes = &bytes[row * k..(row + 1) * k];
            let per_row = k.div_ceil(G128);
            for (g, (o, c)) in out.chunks_mut(G128).zip(codes.chunks(G128)).enumerate() {
                let at = l.scales_offset + 4 * (row * per_row + g);
                let s =
                    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
                for (v, &q) in o.iter_mut().zip(c) {
                    *v = E4M3_TABLE[q as usize] * s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Σ (a - b)² in f64, in element order.
    fn sq_err(a: &[f32], b: &[f32]) -> f64 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
            .sum()
    }
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    /// Random values in ±scale, never all zero, with a wide spread of magnitudes per group.
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let mag = 10f32.powf(r.random_range(-3.0..1.0));
                let v = r.random_range(-1.0f32..1.0) * mag;
                if v == 0.0 {
                    1e-3
                } else {
                    v
                }
            })
            .collect()
    }

    #[test]
    fn q8_0_error_is_at_most_half_a_step() {
        let (r, k) = (7usize, 96usize);
        let x = random(r * k, 1);
        let bytes = quantize(WeightDType::Q8_0, &x, &[r, k]).expect("q");
        let y = dequantize(WeightDType::Q8_0, &bytes, &[r, k]).expect("dq");
        let l = quant_layout(WeightDType::Q8_0, &[r, k]).expect("l");
        for (g, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
            let d = f16_at(&bytes, l.scales_offset + 2 * g);
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(d > 0.0 && (d - amax / 127.0).abs() <= amax / 127.0 * 1e-3);
            for (a, b) in xs.iter().zip(ys) {
                assert!(
                    (a - b).abs() <= d * 0.5 * (1.0 + 1e-5),
                    "group {g}: {a} vs {b}"
                );
            }
        }
        // Codes are the rounded ratios (half away from zero) and stay within ±127.
        assert!(bytes[..r * k].iter().all(|&c| c as i8 != -128));
    }

    #[test]
    fn q4_g128_error_never_exceeds_the_base_candidate() {
        let (r, k) = (6usize, 256usize);
        let x = random(r * k, 2);
        let bytes = quantize(WeightDType::Q4G128, &x, &[r, k]).expect("q");
        let y = dequantize(WeightDType::Q4G128, &bytes, &[r, k]).expect("dq");
        let mut improved = 0;
        for (xs, ys) in x.chunks(128).zip(y.chunks(128)) {
            // The GGML q4_0 base candidate, computed independently.
            let m = xs
                .iter()
                .copied()
                .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(m / -8.0).to_f32();
            let base: f64 = xs
                .iter()
                .map(|&v| {
                    let q = (v / d).round().clamp(-8.0, 7.0);
                    (f64::from(v) - f64::from(d * q)).powi(2)
                })
                .sum();
            let got = sq_err(xs, ys);
            assert!(got <= base, "{got} > base {base}");
            if got < base {
                improved += 1;
            }
            // Every value is within one step of its input.
            let step = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 8.0 * 1.2;
            assert!(xs.iter().zip(ys).all(|(a, b)| (a - b).abs() <= step));
        }
        assert!(improved > 0, "the candidate search never helped");
    }

    #[test]
    fn q4_g128_nibble_order_is_low_first() {
        let mut x = vec![0.5f32; 128];
        x[0] = -4.0; // m = -4 → d0 = 0.5, code 0 for x[0]
        x[1] = 3.5; // q = 7
        let bytes = quantize(WeightDType::Q4G128, &x, &[1, 128]).expect("q");
        let l = quant_layout(WeightDType::Q4G128, &[1, 128]).expect("l");
        let d = f16_at(&bytes, l.scales_offset);
        let q0 = (x[0] / d).round().clamp(-8.0, 7.0) as i32 + 8;
        let q1 = (x[1] / d).round().clamp(-8.0, 7.0) as i32 + 8;
        assert_eq!(i32::from(bytes[0] & 0xF), q0);
        assert_eq!(i32::from(bytes[0] >> 4), q1);
    }

    #[test]
    fn q4_nl_every_code_decodes_to_d_times_its_level() {
        // One row of 128 whose codes are 0..16 repeated, scale 0.25 (exact in f16).
        let l = quant_layout(WeightDType::Q4NlG128, &[1, 256]).expect("l");
        let mut bytes = vec![0u8; l.total];
        for (j, b) in bytes[..128].iter_mut().enumerate() {
            let lo = (2 * j % 16) as u8;
            *b = lo | ((lo + 1) << 4);
        }
        bytes[l.scales_offset..l.scales_offset + 2]
            .copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        bytes[l.scales_offset + 2..l.scales_offset + 4]
            .copy_from_slice(&f16::from_f32(-3.0).to_le_bytes());
        let y = dequantize(WeightDType::Q4NlG128, &bytes, &[1, 256]).expect("dq");
        for (e, v) in y.iter().enumerate() {
            let d = if e < 128 { 0.25 } else { -3.0 };
            let u = e % 16;
            assert_eq!(*v, d * Q4_NL_LEVELS[u], "element {e}");
            assert_eq!(*v, d * f32::from(super::super::Q4_NL_LEVELS_I8[u]));
        }
        // The quantizer's codes pick the nearest level at the stored scale.
        let x = random(4 * 128, 11);
        let q = quantize(WeightDType::Q4NlG128, &x, &[4, 128]).expect("q");
        let lq = quant_layout(WeightDType::Q4NlG128, &[4, 128]).expect("l");
        for (e, &v) in x.iter().enumerate() {
            let d = f16_at(&q, lq.scales_offset + 2 * (e / 128));
            let u = (q[e / 2] >> (4 * (e % 2))) & 0xF;
            assert_eq!(u, q4_nl::nearest_code(v / d), "element {e}");
        }
    }

    #[test]
    fn q4_nl_beats_uniform_q4_on_gaussian_like_groups() {
        // Sums of uniforms (≈ Gaussian): the Lloyd-Max levels have the smaller squared error.
        let mut r = rand::rngs::StdRng::seed_from_u64(9);
        let (rows, k) = (64usize, 256usize);
        let x: Vec<f32> = (0..rows * k)
            .map(|_| (0..6).map(|_| r.random_range(-1.0f32..1.0)).sum::<f32>() * 0.02)
            .collect();
        let err = |dt| {
            let b = quantize(dt, &x, &[rows, k]).expect("q");
            sq_err(&x, &dequantize(dt, &b, &[rows, k]).expect("dq"))
        };
        let (u, nl) = (err(WeightDType::Q4G128), err(WeightDType::Q4NlG128));
        assert!(nl < 0.95 * u, "q4_nl {nl} vs q4 {u}");
    }

    #[test]
    fn q4_nl_refinement_never_loses_to_the_plain_amax_scale() {
        let (r, k) = (6usize, 256usize);
        let x = random(r * k, 12);
        let bytes = quantize(WeightDType::Q4NlG128, &x, &[r, k]).expect("q");
        let y = dequantize(WeightDType::Q4NlG128, &bytes, &[r, k]).expect("dq");
        let mut improved = 0;
        for (xs, ys) in x.chunks(128).zip(y.chunks(128)) {
            // Nearest-level codes at d = amax / 127 (candidate i = 45), computed independently.
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = f16::from_f32(amax / 127.0 * (0.55 + 0.01 * 45.0f32)).to_f32();
            let base: f64 = xs
                .iter()
                .map(|&v| {
                    let best = Q4_NL_LEVELS
                        .iter()
                        .map(|l| d * l)
                        .min_by(|a, b| (a - v).abs().total_cmp(&(b - v).abs()))
                        .expect("16 levels");
                    (f64::from(v) - f64::from(best)).powi(2)
                })
                .sum();
            let got = sq_err(xs, ys);
            assert!(got <= base * (1.0 + 1e-9), "{got} > base {base}");
            improved += usize::from(got < base);
        }
        assert!(improved > 0, "the scale search never helped");
    }

    /// The stored f32 scales of an fp8 blob, row by row (`ceil(K/128)` per row).
    fn fp8_scales(bytes: &[u8], r: usize, k: usize) -> Vec<f32> {
        let l = quant_layout(WeightDType::F8E4M3, &[r, k]).expect("l");
        bytes[l.scales_offset..l.scales_offset + 4 * r * k.div_ceil(128)]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn fp8_relative_error_is_at_most_2_pow_minus_4() {
        let (r, k) = (5usize, 300usize); // partial last group of 44
        let x = random(r * k, 3);
        let bytes = quantize(WeightDType::F8E4M3, &x, &[r, k]).expect("q");
        let y = dequantize(WeightDType::F8E4M3, &bytes, &[r, k]).expect("dq");
        let scales = fp8_scales(&bytes, r, k);
        let groups = x
            .chunks(k)
            .zip(y.chunks(k))
            .flat_map(|(xr, yr)| xr.chunks(128).zip(yr.chunks(128)));
        for ((xs, ys), &scale) in groups.zip(&scales) {
            // The searched scale never saturates the largest value: at least amax / 448.
            let s0 = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
            assert!(scale >= s0 && scale <= 2.5 * s0, "{scale} vs {s0}");
            for (a, b) in xs.iter().zip(ys) {
                let err = f64::from((a - b).abs());
                // Normal E4M3 range: relative; subnormal range: half a 2^-9 step.
                let bound = if a.abs() / scale >= 2f32.powi(-6) {
                    f64::from(a.abs()) * 2f64.powi(-4)
                } else {
                    f64::from(scale) * 2f64.powi(-10)
                };
                assert!(err <= bound * (1.0 + 1e-5), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn fp8_error_never_exceeds_the_amax_scale() {
        let (r, k) = (6usize, 300usize);
        let x = random(r * k, 6);
        let bytes = quantize(WeightDType::F8E4M3, &x, &[r, k]).expect("q");
        let y = dequantize(WeightDType::F8E4M3, &bytes, &[r, k]).expect("dq");
        let (mut got_total, mut base_total, mut improved) = (0f64, 0f64, 0);
        let groups = x
            .chunks(k)
            .zip(y.chunks(k))
            .flat_map(|(xr, yr)| xr.chunks(128).zip(yr.chunks(128)));
        for (xs, ys) in groups {
            // The plain amax / 448 scale, computed independently.
            let s0 = xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
            let base: f64 = xs
                .iter()
                .map(|&v| {
                    let q = E4M3_TABLE[f32_to_e4m3(v / s0) as usize] * s0;
                    (f64::from(v) - f64::from(q)).powi(2)
                })
                .sum();
            let got = sq_err(xs, ys);
            assert!(got <= base, "{got} > base {base}");
            improved += usize::from(got < base);
            got_total += got;
            base_total += base;
        }
        assert!(improved > 0, "the scale search never helped");
        // On these groups the search removes a sizeable share of the squared error.
        assert!(got_total < 0.9 * base_total, "{got_total} vs {base_total}");
    }

    #[test]
    fn quantize_is_deterministic_and_keeps_special_groups() {
        let x = random(3 * 256, 7);
        for dt in WeightDType::ALL {
            let a = quantize(dt, &x, &[3, 256]).expect("q");
            assert_eq!(a, quantize(dt, &x, &[3, 256]).expect("q2"), "{dt}");
        }
        // fp8: a group holding a NaN or an infinity keeps the plain amax / 448 scale (as before
        // the search); the other groups are unaffected.
        let mut y = random(256, 8);
        y[3] = f32::NAN;
        y[200] = f32::INFINITY;
        let bytes = quantize(WeightDType::F8E4M3, &y, &[1, 256]).expect("q");
        let scales = fp8_scales(&bytes, 1, 256);
        let amax = y[..128].iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(scales[0], amax / 448.0);
        assert_eq!(scales[1], f32::INFINITY);
    }

    #[test]
    fn dequantize_row_matches_dequantize_and_checks_lengths() {
        let x = random(4 * 128, 4);
        for dt in WeightDType::ALL {
            let dims = [4usize, 128];
            let bytes = quantize(dt, &x, &dims).expect("q");
            assert_eq!(bytes.len(), dt.storage_bytes(&dims).expect("size"));
            let all = dequantize(dt, &bytes, &dims).expect("dq");
            let mut row = vec![0f32; 128];
            for r in 0..4 {
                dequantize_row(dt, &bytes, &dims, r, &mut row).expect("row");
                assert_eq!(row, all[r * 128..(r + 1) * 128], "{dt} row {r}");
            }
            assert!(matches!(
                dequantize_row(dt, &bytes, &dims, 4, &mut row),
                Err(WeightFormatError::Shape { .. })
            ));
            assert!(matches!(
                dequantize_row(dt, &bytes, &dims, 0, &mut row[..127]),
                Err(WeightFormatError::Length { .. })
            ));
            assert!(matches!(
                dequantize(dt, &bytes[1..], &dims),
                Err(WeightFormatError::Length { .. })
            ));
            assert!(matches!(
                quantize(dt, &x[1..], &dims),
                Err(WeightFormatError::Length { .. })
            ));
        }
        assert!(quantize(WeightDType::Q8_0, &x, &[16, 32]).is_ok());
        assert!(quantize(WeightDType::Q4G128, &x, &[8, 64]).is_err());
        assert!(quantize(WeightDType::Q4NlG128, &x, &[8, 64]).is_err());
    }

    #[test]
    fn zero_groups_quantize_to_zero() {
        let mut x = random(2 * 128, 5);
        x[..128].fill(0.0);
        for dt in [
            WeightDType::Q8_0,
            WeightDType::Q4G128,
            WeightDType::F8E4M3,
            WeightDType::Q4NlG128,
        ] {
            let bytes = quantize(dt, &x, &[2, 128]).expect("q");
            let y = dequantize(dt, &bytes, &[2, 128]).expect("dq");
            assert!(y[..128].iter().all(|v| *v == 0.0), "{dt}");
            assert!(y[128..].iter().any(|v| *v != 0.0), "{dt}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn round_trips_stay_within_format_bounds(
            seed in 0u64..1_000_000,
            rows in 1usize..4,
            groups in 1usize..3,
        ) {
            let k = 128 * groups;
            let x = random(rows * k, seed);
            for (dt, rel) in [
                (WeightDType::Q8_0, 1.0 / 254.0 + 1e-3),
                (WeightDType::Q4G128, 1.0 / 16.0),
                (WeightDType::F8E4M3, 1.0 / 16.0),
                // Lloyd-Max levels: the largest gap (127 − 96) / 2 = 15.5 of 127 at d = amax/127.
                (WeightDType::Q4NlG128, 15.5 / 127.0),
            ] {
                let bytes = quantize(dt, &x, &[rows, k]).expect("q");
                let y = dequantize(dt, &bytes, &[rows, k]).expect("dq");
                let g = dt.group_len();
                for (xs, ys) in x.chunks(g).zip(y.chunks(g)) {
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    if dt.is_q4() {
                        // The q4 search minimises the group's squared error and may clip an
                        // outlier to do so, so its bound is on the RMS: never worse than the
                        // base scale amax/8, whose error is at most half a step (amax/16).
                        let sse: f64 = xs
                            .iter()
                            .zip(ys)
                            .map(|(a, b)| f64::from(a - b).powi(2))
                            .sum();
                        let rms = (sse / xs.len() as f64).sqrt();
                        prop_assert!(
                            rms <= f64::from(rel * amax) * 1.01,
                            "{} rms {} vs amax {}", dt, rms, amax
                        );
                    } else {
                        // Per element: |err| ≤ rel · amax.
                        for (a, b) in xs.iter().zip(ys) {
                            prop_assert!(
                                (a - b).abs() <= rel * amax * 1.0001,
                                "{} {} vs {}", dt, a, b
                            );
                        }
                    }
                }
                // Quantizing the dequantized values reproduces them for q8_0 (the representable
                // values are fixed points of the rounding); fp8 searches its scale again, so
                // the values move by at most the format's bound.
                if !dt.is_q4() {
                    let again = quantize(dt, &y, &[rows, k]).expect("q2");
                    let y2 = dequantize(dt, &again, &[rows, k]).expect("dq2");
                    for (ys, y2s) in y.chunks(g).zip(y2.chunks(g)) {
                        let amax = ys.iter().fold(0f32, |m, v| m.max(v.abs()));
                        for (a, b) in ys.iter().zip(y2s) {
                            let bound = if dt == WeightDType::Q8_0 {
                                rel * a.abs().max(1e-30) + 1e-6
                            } else {
                                rel * amax * 1.0001
                            };
                            prop_assert!((a - b).abs() <= bound, "{} {} vs {}", dt, a, b);
                        }
                    }
                }
            }
        }
    }
}
