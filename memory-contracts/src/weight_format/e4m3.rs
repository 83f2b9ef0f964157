//! OCP FP8 E4M3 ("e4m3fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
//! infinities, `0x7F`/`0xFF` = NaN, largest finite 448, subnormals `2^-6 · m/8`.

/// The f32 value of an E4M3 byte (exact; NaN for `0x7F`/`0xFF`).
pub const fn e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b as u32) >> 7) << 31;
    let e = ((b >> 3) & 0xF) as u32;
    let m = (b & 7) as u32;
    if e == 15 && m == 7 {
        return f32::from_bits(sign | 0x7FC0_0000);
    }
    if e == 0 {
        // Subnormal: m · 2^-9, exact in f32.
        let v = m as f32 * (1.0 / 512.0);
        return if sign != 0 { -v } else { v };
    }
    // Normal: rebias the exponent from 7 to 127 and widen the mantissa from 3 to 23 bits.
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_to_f32(i as u8);
        i += 1;
    }
    t
}

/// [`e4m3_to_f32`] of every byte, for table-lookup decoders.
pub static E4M3_TABLE: [f32; 256] = build_table();

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// The E4M3 byte nearest to `x`, ties to even mantissa; magnitudes beyond 448 (infinities
/// included) saturate to ±448; NaN maps to NaN (`0x7F`, or `0xFF` when the sign bit is set).
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range: the code is the number of 2^-9 steps (8 = the smallest normal).
        // Scaling by 512 is exact; round_ties_even implements round-to-nearest-even.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: exponent in [-6, 8]. Rebias into a (exp, 23-bit mantissa) integer and round the
    // mantissa to 3 bits, ties to even; a carry rolls into the exponent. a < 448 keeps the
    // result ≤ 0x7E.
    let abs_bits = a.to_bits();
    let e = (abs_bits >> 23) as i32 - 127 + 7;
    let combined = ((e as u32) << 23) | (abs_bits & 0x7F_FFFF);
    let lsb = (combined >> 20) & 1;
    let code = (combined + 0x7_FFFF + lsb) >> 20;
    sign | code.min(0x7E) as u8
}

/// `E4M3_TABLE[f32_to_e4m3(x)]` for finite `x` (the nearest E4M3 value, ties to even,
/// saturating at ±448; a zero may come back with the other sign), computed without branches so
/// the quantizer's error loops vectorize.
#[inline(always)]
pub(crate) fn e4m3_round(x: f32) -> f32 {
    // Subnormal range (|x| < 2^-6): the nearest multiple of 2^-9, ties to even: adding and
    // subtracting 1.5·2^23 rounds x·512 (|x·512| < 2^22 here) to an integer in the FPU's
    // round-to-nearest-even mode; the scalings by powers of two are exact.
    const MAGIC: f32 = 12_582_912.0;
    let sub = ((x * 512.0 + MAGIC) - MAGIC) * (1.0 / 512.0);
    // Normal range: round the 23-bit mantissa to 3 bits, ties to even, carrying into the
    // exponent (the sign bit is never reached for |x| < 2^127).
    let b = x.to_bits();
    let normal = f32::from_bits((b + 0x7_FFFF + ((b >> 20) & 1)) & 0xFFF0_0000);
    let r = if x.abs() < 1.0 / 64.0 { sub } else { normal };
    r.clamp(-E4M3_MAX, E4M3_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// An independent formula: (-1)^s · 2^(e-7) · (1 + m/8), or 2^-6 · m/8 when e == 0.
    fn reference(b: u8) -> f64 {
        let s = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((b >> 3) & 0xF);
        let m = f64::from(b & 7);
        if e == 15 && m == 7.0 {
            return f64::NAN;
        }
        if e == 0 {
            s * 2f64.powi(-6) * m / 8.0
        } else {
            s * 2f64.powi(e - 7) * (1.0 + m / 8.0)
        }
    }

    #[test]
    fn every_byte_decodes_to_the_ocp_value() {
        for b in 0..=255u8 {
            let want = reference(b);
            let got = e4m3_to_f32(b);
            assert_eq!(E4M3_TABLE[b as usize].to_bits(), got.to_bits());
            if want.is_nan() {
                assert!(got.is_nan(), "{b:#04x}");
            } else {
                assert_eq!(f64::from(got), want, "{b:#04x}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn every_finite_code_round_trips() {
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert_eq!(f32_to_e4m3(v) & 0x7F, 0x7F);
                continue;
            }
            let back = f32_to_e4m3(v);
            // +0 and -0 are distinct codes and both round-trip.
            assert_eq!(back, b, "{b:#04x} = {v}");
        }
        assert_eq!(f32_to_e4m3(1e9), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xFE);
    }

    /// Brute force: the finite code nearest to x, ties to the code with an even mantissa.
    fn nearest(x: f32) -> u8 {
        let x = f64::from(x).clamp(-448.0, 448.0);
        let mut best = 0u8;
        let mut best_err = f64::INFINITY;
        for b in 0..=255u8 {
            let v = reference(b);
            if v.is_nan() || (v == 0.0 && (b & 0x80 != 0) != x.is_sign_negative()) {
                continue;
            }
            let err = (v - x).abs();
            if err < best_err || (err == best_err && b & 1 == 0) {
                best = b;
                best_err = err;
            }
        }
        best
    }

    #[test]
    fn midpoints_round_to_even() {
        for b in 0..0x7Eu8 {
            let (lo, hi) = (reference(b), reference(b + 1));
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(f64::from(mid), (lo + hi) / 2.0, "midpoint exact in f32");
            let want = if b & 1 == 0 { b } else { b + 1 };
            assert_eq!(f32_to_e4m3(mid), want, "mid of {b:#04x}");
            assert_eq!(f32_to_e4m3(-mid), want | 0x80);
            assert_eq!(f32_to_e4m3(mid), nearest(mid));
        }
    }

    proptest! {
        #[test]
        fn f32_to_e4m3_is_the_nearest_code(x in -500f32..500f32, tiny in -0.02f32..0.02f32) {
            prop_assert_eq!(f32_to_e4m3(x), nearest(x));
            prop_assert_eq!(f32_to_e4m3(tiny), nearest(tiny));
        }
    }

    #[test]
    fn e4m3_round_is_the_decoded_nearest_code() {
        let check = |x: f32| {
            let want = E4M3_TABLE[f32_to_e4m3(x) as usize];
            let got = e4m3_round(x);
            assert!(
                got == want,
                "{x:e} ({:#x}): {got:e} vs {want:e}",
                x.to_bits()
            );
        };
        // Every code, every midpoint between neighbouring codes (ties) and its two f32
        // neighbours, both signs, and values past the saturation point.
        let mut pos: Vec<f32> = E4M3_TABLE[..0x7F].to_vec();
        pos.push(480.0);
        for w in pos.windows(2) {
            let mid = (w[0] + w[1]) / 2.0;
            for v in [
                w[0],
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                check(v);
                check(-v);
            }
        }
        for v in [448.0f32, 460.0, 464.0, 470.0, 500.0, 1e6, 1e30] {
            check(v);
            check(-v);
        }
        // A dense sweep of bit patterns from 2^-12 to 512.
        let (lo, hi) = (2f32.powi(-12).to_bits(), 512f32.to_bits());
        for bits in (lo..hi).step_by(331) {
            check(f32::from_bits(bits));
            check(-f32::from_bits(bits));
        }
    }
}
