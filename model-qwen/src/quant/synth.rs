//! Random quantized weights generated directly as codes + scales (synthetic models with a
//! quantized policy): no f32 copy of the tensor is ever made, so a synthetic 27B model in
//! q4_g128 costs the host only its 4.1-bit blobs.

use super::convert::{code_bytes_per_row, fill_sections, scale_bytes_per_row, sections};
use half::f16;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::weight_format::{f32_to_e4m3, quant_layout, WeightFormatError};
use rand::{Rng, RngCore, SeedableRng};

/// A random blob of `dtype` (quantized) and `dims` whose values are spread over about
/// `[-amax, amax]` (uniform symmetric codes, scales `amax / qmax` jittered by ±25 % per group), depending
/// only on `seed`. `amax` = 0.0346 gives the std 0.02 of the synthetic f32 matrices.
pub(crate) fn random_quantized(
    dtype: WeightDType,
    dims: &[usize],
    seed: u64,
    amax: f32,
) -> Result<Vec<u8>, WeightFormatError> {
    if !dtype.is_quantized() {
        return Err(WeightFormatError::Unsupported {
            dtype,
            operation: "random quantized weights",
        });
    }
    let layout = quant_layout(dtype, dims)?;
    let mut out = vec![0u8; layout.total];
    let (codes, scales) = sections(dtype, &layout, &mut out)?;
    random_quantized_into(dtype, layout.k, seed, amax, codes, scales)?;
    Ok(out)
}

/// [`random_quantized`] written into the code and scale sections of a tensor's rows (see
/// `convert::fill_sections`): the same bytes as the sections of the whole blob, so a fused
/// weight made of such row ranges equals the separate tensors row for row.
pub(crate) fn random_quantized_into(
    dtype: WeightDType,
    k: usize,
    seed: u64,
    amax: f32,
    codes: &mut [u8],
    scales: &mut [u8],
) -> Result<(), WeightFormatError> {
    if !dtype.is_quantized() {
        return Err(WeightFormatError::Unsupported {
            dtype,
            operation: "random quantized weights",
        });
    }
    // FP8 codes: 256 evenly spaced values in (-448, 448), encoded once.
    let fp8: Vec<u8> = (0..256)
        .map(|i| f32_to_e4m3(((i as f32 + 0.5) / 128.0 - 1.0) * 448.0))
        .collect();
    fill_sections(dtype, k, codes, scales, |first, n| {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(
            seed ^ (first as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        let bl = quant_layout(dtype, &[n, k])?;
        let mut blob = vec![0u8; bl.total];
        let cb = code_bytes_per_row(dtype, k) * n;
        rng.fill_bytes(&mut blob[..cb]);
        match dtype {
            WeightDType::Q8_0 => blob[..cb]
                .iter_mut()
                .for_each(|b| *b = (*b as i8).max(-127) as u8),
            WeightDType::F8E4M3 => blob[..cb].iter_mut().for_each(|b| *b = fp8[*b as usize]),
            // Every nibble is a level of the symmetric table (|L| ≤ 127).
            WeightDType::Q4NlG128 => {}
            // Nibble 0 (q = -8) becomes 8 (q = 0): q is symmetric around 0.
            _ => blob[..cb].iter_mut().for_each(|b| {
                let fix = |u: u8| if u == 0 { 8 } else { u };
                *b = fix(*b & 15) | (fix(*b >> 4) << 4);
            }),
        }
        let qmax = match dtype {
            WeightDType::Q8_0 => 127.0,
            WeightDType::Q4G128 => 8.0,
            WeightDType::Q4NlG128 => 127.0,
            _ => 448.0,
        };
        let scales = &mut blob[bl.scales_offset..bl.scales_offset + n * scale_bytes_per_row(&bl)];
        let step = if dtype == WeightDType::F8E4M3 { 4 } else { 2 };
        for s in scales.chunks_exact_mut(step) {
            let d = amax / qmax * rng.random_range(0.75f32..1.25);
            if step == 4 {
                s.copy_from_slice(&d.to_le_bytes());
            } else {
                s.copy_from_slice(&f16::from_f32(d).to_le_bytes());
            }
        }
        Ok(blob)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::weight_format::dequantize;

    #[test]
    fn random_blobs_have_the_synthetic_value_scale_and_are_deterministic() {
        for dt in [
            WeightDType::Q8_0,
            WeightDType::Q4G128,
            WeightDType::F8E4M3,
            WeightDType::Q4NlG128,
        ] {
            let dims = [300usize, 256];
            let a = random_quantized(dt, &dims, 9, 0.0346).expect("a");
            let b = random_quantized(dt, &dims, 9, 0.0346).expect("b");
            let c = random_quantized(dt, &dims, 10, 0.0346).expect("c");
            assert_eq!(a, b);
            assert_ne!(a, c);
            assert_eq!(a.len(), dt.storage_bytes(&dims).expect("size"));
            let v = dequantize(dt, &a, &dims).expect("deq");
            let n = v.len() as f64;
            let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n;
            let std = (v
                .iter()
                .map(|x| (f64::from(*x) - mean).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
            assert!(v.iter().all(|x| x.is_finite()), "{dt}");
            assert!(mean.abs() < 2e-3, "{dt}: mean {mean}");
            assert!((0.014..0.026).contains(&std), "{dt}: std {std}");
            assert!(amax <= 0.0346 * 1.26 && amax > 0.02, "{dt}: amax {amax}");
        }
        assert!(random_quantized(WeightDType::Bf16, &[2, 32], 1, 1.0).is_err());
    }
}
