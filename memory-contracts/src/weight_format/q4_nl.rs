//! `q4_nl_g128`: the `q4_g128` byte layout with a non-uniform integer codebook.
//!
//! Code `u` (a nibble, low nibble = even k) decodes to `d · L[u]` with the f16 group scale `d`
//! and the fixed table [`Q4_NL_LEVELS`]: the 16 Lloyd–Max (MSE-optimal) levels of N(0, 1) times
//! 127 / 2.7326, rounded to integers (measured on branch `nf4-exp` as "lloyd-i8"). The levels are
//! integers with |L| ≤ 127, so `d · L[u]` is an exact f32 product (11 + 7 significant bits) and
//! the table is exact in int8 and bf16 (what the GPU's integer and bf16 tensor-core paths use).
//!
//! Quantizing a group of 128: a scale search over `d = amax / 127 · (0.55 + 0.01·i)`,
//! `i = 0..=65` (the squared error of nearest-level codes, summed in f64 in element order; the
//! table is symmetric, so negative scales give the same errors and are not searched), then
//! least-squares refinement `d = Σx·L / ΣL²` over the chosen codes, kept while the error drops
//! (at most 6 steps). An all-zero (or non-finite) group stores d = 0.

use half::f16;

/// The codebook: code `u` → `L[u]` (ascending, symmetric).
pub const Q4_NL_LEVELS_I8: [i8; 16] = [
    -127, -96, -75, -58, -44, -31, -18, -6, 6, 18, 31, 44, 58, 75, 96, 127,
];

/// [`Q4_NL_LEVELS_I8`] as f32.
pub const Q4_NL_LEVELS: [f32; 16] = [
    -127.0, -96.0, -75.0, -58.0, -44.0, -31.0, -18.0, -6.0, 6.0, 18.0, 31.0, 44.0, 58.0, 75.0,
    96.0, 127.0,
];

/// The largest |level|.
const LMAX: f32 = 127.0;

/// Decision thresholds: the midpoints of adjacent levels (exact in f32).
const MIDS: [f32; 15] = {
    let mut m = [0f32; 15];
    let mut i = 0;
    while i < 15 {
        m[i] = (Q4_NL_LEVELS[i] + Q4_NL_LEVELS[i + 1]) * 0.5;
        i += 1;
    }
    m
};

/// Scale candidates `amax / 127 · (0.55 + 0.01·i)`, `i = 0..=STEPS`.
const STEPS: i32 = 65;
/// Least-squares refinement steps after the search.
const REFINE: usize = 6;

/// The nearest level's code of `t` (ties to the lower level; NaN → 0).
#[inline]
pub fn nearest_code(t: f32) -> u8 {
    MIDS.partition_point(|&m| t > m) as u8
}

/// The value of code `u` (low 4 bits) at scale `d`.
#[inline]
pub fn decode(d: f32, u: u8) -> f32 {
    d * Q4_NL_LEVELS[usize::from(u & 0xF)]
}

/// Quantizes one group of 128 values: writes 64 packed code bytes (low nibble first) and returns
/// the f16 scale (module docs).
pub(crate) fn quantize_group(x: &[f32], codes: &mut [u8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs())) / LMAX;
    let zero = nearest_code(0.0);
    if amax == 0.0 || !amax.is_finite() {
        codes.fill(zero | (zero << 4));
        return f16::ZERO;
    }
    let code = |v: f32, d: f32| nearest_code(v / d);
    let err_of = |d: f32| -> f64 {
        x.iter()
            .map(|&v| {
                let e = f64::from(v) - f64::from(d * Q4_NL_LEVELS[usize::from(code(v, d))]);
                e * e
            })
            .sum()
    };
    let mut best: Option<(f64, f16)> = None;
    for i in 0..=STEPS {
        let d16 = f16::from_f32(amax * (0.55 + 0.01 * i as f32));
        if d16.to_f32() == 0.0 || !d16.to_f32().is_finite() {
            continue;
        }
        let err = err_of(d16.to_f32());
        if best.is_none_or(|(b, _)| err < b) {
            best = Some((err, d16));
        }
    }
    for _ in 0..REFINE {
        let Some((best_err, d16)) = best else { break };
        let d = d16.to_f32();
        let (mut sxl, mut sll) = (0f64, 0f64);
        for &v in x {
            let q = f64::from(Q4_NL_LEVELS[usize::from(code(v, d))]);
            sxl += f64::from(v) * q;
            sll += q * q;
        }
        if sll == 0.0 {
            break;
        }
        let cand = f16::from_f32((sxl / sll) as f32);
        if cand.to_f32() == 0.0 || !cand.to_f32().is_finite() {
            break;
        }
        let err = err_of(cand.to_f32());
        if err < best_err {
            best = Some((err, cand));
        } else {
            break;
        }
    }
    let Some((_, d16)) = best else {
        codes.fill(zero | (zero << 4));
        return f16::ZERO;
    };
    let d = d16.to_f32();
    for (c, pair) in codes.iter_mut().zip(x.chunks_exact(2)) {
        *c = code(pair[0], d) | (code(pair[1], d) << 4);
    }
    d16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_symmetric_ascending_and_exact() {
        for u in 0..16 {
            assert_eq!(Q4_NL_LEVELS[u], f32::from(Q4_NL_LEVELS_I8[u]));
            assert_eq!(Q4_NL_LEVELS[u], -Q4_NL_LEVELS[15 - u]);
            if u > 0 {
                assert!(Q4_NL_LEVELS[u] > Q4_NL_LEVELS[u - 1]);
            }
        }
    }

    #[test]
    fn nearest_code_is_the_linear_scan() {
        for i in -3000..=3000 {
            let t = i as f32 * 0.05;
            let mut u = 0u8;
            for j in 0..15 {
                if t > 0.5 * (Q4_NL_LEVELS[j] + Q4_NL_LEVELS[j + 1]) {
                    u = j as u8 + 1;
                }
            }
            assert_eq!(nearest_code(t), u, "t = {t}");
            let best = (0..16)
                .map(|c| (Q4_NL_LEVELS[c] - t).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((Q4_NL_LEVELS[usize::from(u)] - t).abs(), best, "t = {t}");
        }
        assert_eq!(nearest_code(f32::NAN), 0);
        assert_eq!(nearest_code(1e9), 15);
        assert_eq!(nearest_code(-1e9), 0);
    }
}
