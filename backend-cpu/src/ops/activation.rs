//! `ActivationOps` and `SamplingOps` for the CPU backend.

use super::{same_len, sigmoid, silu};
use crate::{CpuBackend, CpuTensor};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{ActivationOps, SamplingOps};
use rayon::prelude::*;

fn zip_map(
    op: &'static str,
    a: &CpuTensor,
    b: &CpuTensor,
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Result<CpuTensor, OpError> {
    same_len(op, a, b)?;
    let data = a
        .data
        .par_iter()
        .with_min_len(4096)
        .zip(b.data.par_iter())
        .map(|(x, y)| f(*x, *y))
        .collect();
    Ok(CpuTensor::new(data, a.dims.clone()))
}

impl ActivationOps for CpuBackend {
    fn swiglu(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor, OpError> {
        zip_map("swiglu", gate, up, |g, u| silu(g) * u)
    }

    fn sigmoid_gate(&self, x: &CpuTensor, gate: &CpuTensor) -> Result<CpuTensor, OpError> {
        zip_map("sigmoid_gate", x, gate, |v, g| v * sigmoid(g))
    }
}

impl SamplingOps for CpuBackend {
    fn argmax_rows(&self, logits: &CpuTensor) -> Result<Vec<u32>, OpError> {
        let v = match logits.dims.last() {
            Some(&v) if v > 0 && logits.data.len() % v == 0 => v,
            _ => {
                return Err(OpError::shape(
                    "argmax_rows",
                    format!("logits {:?} are not [T, V]", logits.dims),
                ))
            }
        };
        Ok(logits
            .data
            .par_chunks(v)
            .map(|row| {
                let mut best = 0usize;
                for (i, x) in row.iter().enumerate() {
                    // Strictly greater: the lowest index wins ties.
                    if *x > row[best] || (row[best].is_nan() && !x.is_nan()) {
                        best = i;
                    }
                }
                best as u32
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_abs_diff, tensor, Rng};

    #[test]
    fn activations_match_reference() {
        let b = CpuBackend::new();
        let mut r = Rng::new(41);
        let g = r.vec(50, 6.0);
        let u = r.vec(50, 2.0);
        let y = b
            .swiglu(&tensor(g.clone(), &[5, 10]), &tensor(u.clone(), &[5, 10]))
            .expect("swiglu");
        let s = b
            .sigmoid_gate(&tensor(u.clone(), &[50]), &tensor(g.clone(), &[50]))
            .expect("gate");
        let sig = |x: f32| 1.0 / (1.0 + (-f64::from(x)).exp());
        let ry: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| f64::from(*g) * sig(*g) * f64::from(*u))
            .collect();
        let rs: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| f64::from(*u) * sig(*g))
            .collect();
        assert!(max_abs_diff(&y.data, &ry) < 1e-5);
        assert!(max_abs_diff(&s.data, &rs) < 1e-5);
        assert!(b
            .swiglu(&tensor(g, &[50]), &tensor(u[..10].to_vec(), &[10]))
            .is_err());
    }

    #[test]
    fn argmax_picks_largest_and_lowest_index_on_ties() {
        let b = CpuBackend::new();
        let mut r = Rng::new(42);
        let mut x = r.vec(3 * 7, 1.0);
        x[4] = 5.0;
        x[7 + 1] = 3.0;
        x[7 + 6] = 3.0;
        x[14 + 6] = 9.0;
        let got = b.argmax_rows(&tensor(x, &[3, 7])).expect("argmax");
        assert_eq!(got, vec![4, 1, 6]);
    }
}
