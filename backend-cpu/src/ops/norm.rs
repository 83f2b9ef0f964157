//! `NormOps` for the CPU backend (f32 math; the mean of squares accumulated in f64).

use super::weights::view;
use super::{same_len, silu};
use crate::{CpuBackend, CpuTensor, CpuWeight};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::NormOps;
use rayon::prelude::*;

fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss: f64 = row.iter().map(|v| f64::from(*v) * f64::from(*v)).sum();
    let mean = (ss / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

fn check(op: &'static str, x: &CpuTensor, d: usize) -> Result<(), OpError> {
    if d == 0 || x.data.len() % d != 0 {
        return Err(OpError::shape(
            op,
            format!("{:?} is not a multiple of the weight length {d}", x.dims),
        ));
    }
    Ok(())
}

impl NormOps for CpuBackend {
    fn rms_norm(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        eps: f32,
        unit_offset: f32,
    ) -> Result<CpuTensor, OpError> {
        let wv: Vec<f32> = view(w)?.to_vec().iter().map(|v| v + unit_offset).collect();
        let d = wv.len();
        check("rms_norm", x, d)?;
        let mut out = vec![0f32; x.data.len()];
        out.par_chunks_mut(d)
            .zip(x.data.par_chunks(d))
            .with_min_len(16)
            .for_each(|(o, r)| {
                let s = inv_rms(r, eps);
                for ((o, v), g) in o.iter_mut().zip(r).zip(&wv) {
                    *o = v * s * g;
                }
            });
        Ok(CpuTensor::new(out, x.dims.clone()))
    }

    fn gated_rms_norm(
        &self,
        x: &CpuTensor,
        z: &CpuTensor,
        w: &CpuWeight,
        eps: f32,
    ) -> Result<CpuTensor, OpError> {
        let wv = view(w)?.to_vec();
        let d = wv.len();
        check("gated_rms_norm", x, d)?;
        same_len("gated_rms_norm", x, z)?;
        let mut out = vec![0f32; x.data.len()];
        out.par_chunks_mut(d)
            .zip(x.data.par_chunks(d).zip(z.data.par_chunks(d)))
            .with_min_len(16)
            .for_each(|(o, (r, zr))| {
                let s = inv_rms(r, eps);
                for (((o, v), g), zz) in o.iter_mut().zip(r).zip(&wv).zip(zr) {
                    *o = g * (v * s) * silu(*zz);
                }
            });
        Ok(CpuTensor::new(out, x.dims.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_abs_diff, tensor, weight, Rng};
    use kvstream_memory_contracts::backend::WeightDType;

    #[test]
    fn norms_match_f64_reference() {
        let b = CpuBackend::new();
        let mut r = Rng::new(11);
        let (rows, d) = (5, 24);
        let x = r.vec(rows * d, 2.0);
        let z = r.vec(rows * d, 3.0);
        let (w, held) = weight(&b, WeightDType::Bf16, &r.vec(d, 0.5), &[d]);
        let eps = 1e-6;
        let y = b
            .rms_norm(&tensor(x.clone(), &[rows, d]), &w, eps, 1.0)
            .expect("rms");
        let g = b
            .gated_rms_norm(
                &tensor(x.clone(), &[rows, d]),
                &tensor(z.clone(), &[rows, d]),
                &w,
                eps,
            )
            .expect("gated");
        let mut ry = vec![0f64; rows * d];
        let mut rg = vec![0f64; rows * d];
        for i in 0..rows {
            let row = &x[i * d..(i + 1) * d];
            let ms: f64 = row.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / d as f64;
            let s = 1.0 / (ms + f64::from(eps)).sqrt();
            for j in 0..d {
                let v = f64::from(row[j]) * s;
                ry[i * d + j] = v * (1.0 + f64::from(held[j]));
                let zz = f64::from(z[i * d + j]);
                rg[i * d + j] = v * f64::from(held[j]) * zz / (1.0 + (-zz).exp());
            }
        }
        assert!(max_abs_diff(&y.data, &ry) < 1e-5);
        assert!(max_abs_diff(&g.data, &rg) < 1e-5);
        assert!(b
            .rms_norm(&tensor(x[..7].to_vec(), &[7]), &w, eps, 1.0)
            .is_err());
    }
}
