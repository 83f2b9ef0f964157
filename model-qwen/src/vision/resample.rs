//! Pillow's separable resampler (`Image.resize`, 8-bit path, `Resample.c`), reproduced exactly:
//! per-axis f64 filter coefficients (antialiased when shrinking), normalised, turned into 22-bit
//! fixed point, accumulated in integers with rounding, clipped to u8 after each pass; horizontal
//! pass first, then vertical. HF's Qwen2-VL image processor (PIL backend) resizes this way.

use super::config::Resample;

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn filter(kind: Resample, x: f64) -> f64 {
    let x = x.abs();
    match kind {
        Resample::Bilinear => {
            if x < 1.0 {
                1.0 - x
            } else {
                0.0
            }
        }
        Resample::Bicubic => {
            const A: f64 = -0.5;
            if x < 1.0 {
                ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
            } else if x < 2.0 {
                (((x - 5.0) * x + 8.0) * x - 4.0) * A
            } else {
                0.0
            }
        }
    }
}

fn support(kind: Resample) -> f64 {
    match kind {
        Resample::Bilinear => 1.0,
        Resample::Bicubic => 2.0,
    }
}

/// Per output index: first source index, tap count, fixed-point weights (`ksize` each).
struct Coeffs {
    ksize: usize,
    bounds: Vec<(usize, usize)>,
    kk: Vec<i32>,
}

fn precompute(in_size: usize, out_size: usize, kind: Resample) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = support(kind) * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut kk = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's `(int)` truncates toward zero; negative values are clamped to 0 right after.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64)
            .min(in_size as i64)
            .max(xmin as i64) as usize;
        let n = (xmax - xmin).min(ksize);
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate() {
            *kx = if x < n {
                filter(kind, (x as f64 + xmin as f64 - center + 0.5) * ss)
            } else {
                0.0
            };
            ww += *kx;
        }
        for (x, &w) in k.iter().enumerate() {
            let w = if ww != 0.0 { w / ww } else { w };
            let f = w * f64::from(1u32 << PRECISION_BITS);
            kk[xx * ksize + x] = if w < 0.0 {
                (-0.5 + f) as i32
            } else {
                (0.5 + f) as i32
            };
        }
        bounds.push((xmin, n));
    }
    Coeffs { ksize, bounds, kk }
}

fn clip8(ss: i64) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes an interleaved RGB8 image `src` (`w`×`h`) to `ow`×`oh` exactly like Pillow's
/// `Image.resize((ow, oh), resample)` on an RGB image. Same size → a copy.
pub(crate) fn resize_rgb8(
    src: &[u8],
    w: usize,
    h: usize,
    ow: usize,
    oh: usize,
    kind: Resample,
) -> Vec<u8> {
    let mut cur = src.to_vec();
    let mut cw = w;
    if ow != w {
        let c = precompute(w, ow, kind);
        let mut out = vec![0u8; ow * h * 3];
        for y in 0..h {
            let row = &cur[y * w * 3..(y + 1) * w * 3];
            for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
                let k = &c.kk[xx * c.ksize..xx * c.ksize + n];
                for ch in 0..3 {
                    let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                    for (x, &kx) in k.iter().enumerate() {
                        ss += i64::from(row[(xmin + x) * 3 + ch]) * i64::from(kx);
                    }
                    out[(y * ow + xx) * 3 + ch] = clip8(ss);
                }
            }
        }
        cur = out;
        cw = ow;
    }
    if oh != h {
        let c = precompute(h, oh, kind);
        let mut out = vec![0u8; cw * oh * 3];
        for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
            let k = &c.kk[yy * c.ksize..yy * c.ksize + n];
            for i in 0..cw * 3 {
                let mut ss: i64 = 1 << (PRECISION_BITS - 1);
                for (y, &ky) in k.iter().enumerate() {
                    ss += i64::from(cur[(ymin + y) * cw * 3 + i]) * i64::from(ky);
                }
                out[yy * cw * 3 + i] = clip8(ss);
            }
        }
        cur = out;
    }
    cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_image_stays_constant_and_identity_is_a_copy() {
        let src: Vec<u8> = (0..7 * 5).flat_map(|_| [10u8, 200, 77]).collect();
        for (ow, oh) in [(3, 9), (14, 2), (7, 5)] {
            for kind in [Resample::Bicubic, Resample::Bilinear] {
                let o = resize_rgb8(&src, 7, 5, ow, oh, kind);
                assert_eq!(o.len(), ow * oh * 3);
                assert!(o.chunks(3).all(|p| p == [10, 200, 77]), "{ow}x{oh}");
            }
        }
        let ramp: Vec<u8> = (0..6 * 4 * 3).map(|i| (i * 5 % 256) as u8).collect();
        assert_eq!(resize_rgb8(&ramp, 6, 4, 6, 4, Resample::Bicubic), ramp);
    }

    #[test]
    fn coefficients_sum_to_one_in_fixed_point() {
        for (i, o) in [(300, 128), (50, 64), (75, 64), (10, 3)] {
            let c = precompute(i, o, Resample::Bicubic);
            for xx in 0..o {
                let s: i64 = c.kk[xx * c.ksize..(xx + 1) * c.ksize]
                    .iter()
                    .map(|&k| i64::from(k))
                    .sum();
                assert!(
                    (s - (1 << PRECISION_BITS)).abs() <= c.ksize as i64,
                    "{i}->{o}: {s}"
                );
            }
        }
    }
}
