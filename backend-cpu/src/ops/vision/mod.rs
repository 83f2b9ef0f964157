//! `VisionOps` for the CPU backend: bias add, LayerNorm (statistics in f64), GELU (tanh and exact,
//! evaluated in f64) and the ViT attention of [`attention`].

mod attention;

use super::weights::view;
use crate::{CpuBackend, CpuTensor, CpuWeight};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{Gelu, VisionAttentionShape, VisionOps};
use rayon::prelude::*;

/// The f32 values of a 1-D weight whose length must divide `x`'s element count.
fn row_weight(op: &'static str, x: &CpuTensor, w: &CpuWeight) -> Result<Vec<f32>, OpError> {
    let wv = view(w)?.to_vec();
    if wv.is_empty() || x.data.len() % wv.len() != 0 {
        return Err(OpError::shape(
            op,
            format!(
                "{:?} is not a multiple of the weight length {}",
                x.dims,
                wv.len()
            ),
        ));
    }
    Ok(wv)
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    let c = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())) as f32
}

/// Exact GELU (`nn.GELU()`): `x·Φ(x)`.
pub fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))) as f32
}

/// erf(x) with |error| < 1.2e-7 (Numerical Recipes' Chebyshev erfc).
pub fn erf(x: f64) -> f64 {
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

impl VisionOps for CpuBackend {
    fn add_bias(&self, x: &CpuTensor, b: &CpuWeight) -> Result<CpuTensor, OpError> {
        let bv = row_weight("add_bias", x, b)?;
        let mut out = x.data.clone();
        out.par_chunks_mut(bv.len()).with_min_len(16).for_each(|r| {
            for (v, bb) in r.iter_mut().zip(&bv) {
                *v += bb;
            }
        });
        Ok(CpuTensor::new(out, x.dims.clone()))
    }

    fn layer_norm(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        b: &CpuWeight,
        eps: f32,
    ) -> Result<CpuTensor, OpError> {
        let wv = row_weight("layer_norm", x, w)?;
        let bv = view(b)?.to_vec();
        let d = wv.len();
        if bv.len() != d {
            return Err(OpError::shape(
                "layer_norm",
                format!("weight has {d} values, bias {}", bv.len()),
            ));
        }
        let mut y = vec![0f32; x.data.len()];
        y.par_chunks_mut(d)
            .zip(x.data.par_chunks(d))
            .with_min_len(16)
            .for_each(|(yr, xr)| {
                let mean = xr.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
                let var = xr
                    .iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
                    / d as f64;
                let inv = 1.0 / (var + f64::from(eps)).sqrt();
                for i in 0..d {
                    yr[i] = ((f64::from(xr[i]) - mean) * inv) as f32 * wv[i] + bv[i];
                }
            });
        Ok(CpuTensor::new(y, x.dims.clone()))
    }

    fn gelu(&self, x: &CpuTensor, kind: Gelu) -> Result<CpuTensor, OpError> {
        let f: fn(f32) -> f32 = match kind {
            Gelu::Tanh => gelu_tanh,
            Gelu::Erf => gelu_erf,
        };
        let data = x
            .data
            .par_iter()
            .with_min_len(4096)
            .map(|v| f(*v))
            .collect();
        Ok(CpuTensor::new(data, x.dims.clone()))
    }

    fn vision_attention(
        &self,
        qkv: &CpuTensor,
        cos: &CpuTensor,
        sin: &CpuTensor,
        shape: &VisionAttentionShape,
    ) -> Result<CpuTensor, OpError> {
        shape.check(
            "vision_attention",
            qkv.data.len(),
            cos.data.len(),
            sin.data.len(),
        )?;
        let _s = tracing::trace_span!("cpu.vision_attention", n = shape.tokens).entered();
        let mut rotated = qkv.data.clone();
        attention::rotary(&mut rotated, &cos.data, &sin.data, shape);
        let out = attention::attention(&rotated, shape);
        Ok(CpuTensor::new(
            out,
            vec![shape.tokens, shape.heads * shape.head_dim],
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{tensor, Rng};
    use kvstream_memory_contracts::backend::WeightDType;
    use kvstream_memory_contracts::ops::{LinearOps, WeightData};

    fn w32(b: &CpuBackend, v: &[f32]) -> CpuWeight {
        let bytes: Vec<u8> = v.iter().flat_map(|f| f.to_le_bytes()).collect();
        b.load_weight(
            "w",
            WeightDType::F32,
            &[v.len()],
            WeightData::from_vec(bytes),
        )
        .expect("weight")
    }

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
        let b = CpuBackend::new();
        let y = b
            .gelu(&tensor(vec![1.0, -8.0], &[2]), Gelu::Erf)
            .expect("gelu");
        assert_eq!(y.data, vec![gelu_erf(1.0), gelu_erf(-8.0)]);
    }

    #[test]
    fn bias_and_layer_norm_match_naive() {
        let b = CpuBackend::new();
        let (n, k) = (3, 19);
        let x: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
            .collect();
        let bias: Vec<f32> = (0..k).map(|i| i as f32 * 0.3 - 0.5).collect();
        let y = b
            .add_bias(&tensor(x.clone(), &[n, k]), &w32(&b, &bias))
            .expect("bias");
        for (i, v) in y.data.iter().enumerate() {
            assert_eq!(*v, x[i] + bias[i % k]);
        }
        let g: Vec<f32> = (0..k).map(|i| 1.0 + i as f32 * 0.01).collect();
        let z = b
            .layer_norm(
                &tensor(x, &[n, k]),
                &w32(&b, &g),
                &w32(&b, &[0.5; 19]),
                1e-6,
            )
            .expect("ln");
        let back: Vec<f32> = z.data[..k]
            .iter()
            .zip(&g)
            .map(|(v, g)| (v - 0.5) / g)
            .collect();
        let mean: f32 = back.iter().sum::<f32>() / k as f32;
        let var: f32 = back.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / k as f32;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
            "{mean} {var}"
        );
        let bad = b.add_bias(&tensor(vec![0.0; 7], &[7]), &w32(&b, &[1.0, 2.0]));
        assert!(matches!(bad, Err(OpError::Shape { .. })));
    }

    #[test]
    fn attention_with_identity_rotary_is_plain_attention_and_checks_shapes() {
        let b = CpuBackend::new();
        let mut r = Rng::new(7);
        let s = VisionAttentionShape {
            tokens: 8,
            frame: 4,
            heads: 2,
            head_dim: 4,
        };
        let qkv = tensor(r.vec(8 * 3 * 8, 1.0), &[8, 24]);
        let cos = tensor(vec![1.0; 16], &[4, 4]);
        let sin = tensor(vec![0.0; 16], &[4, 4]);
        let y = b.vision_attention(&qkv, &cos, &sin, &s).expect("attn");
        assert_eq!(y.dims, vec![8, 8]);
        assert_eq!(y.data, attention::attention(&qkv.data, &s));
        // Rotating by 90° (cos 0, sin 1) maps x to rotate_half(x).
        let mut rq = qkv.data.clone();
        attention::rotary(&mut rq, &[0.0; 16], &[1.0; 16], &s);
        assert_eq!(rq[0], -qkv.data[2]);
        assert_eq!(rq[2], qkv.data[0]);
        assert_eq!(rq[16], qkv.data[16], "v is not rotated");
        let bad = VisionAttentionShape { frame: 3, ..s };
        assert!(b.vision_attention(&qkv, &cos, &sin, &bad).is_err());
    }
}
