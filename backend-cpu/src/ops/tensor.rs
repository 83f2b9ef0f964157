//! `TensorOps` for the CPU backend.

use super::same_len;
use crate::{CpuBackend, CpuTensor};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::TensorOps;
use rayon::prelude::*;

fn numel(dims: &[usize]) -> Result<usize, OpError> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| OpError::shape("tensor", format!("dims {dims:?} overflow")))
}

/// `[T, C]` view of a tensor: T = product of all dims but the last (1 for a 1-D tensor).
fn rows_cols(t: &CpuTensor) -> (usize, usize) {
    match t.dims.split_last() {
        Some((&c, rest)) if c > 0 => (rest.iter().product(), c),
        _ => (0, 0),
    }
}

impl TensorOps for CpuBackend {
    fn tensor_from_f32(&self, data: &[f32], dims: &[usize]) -> Result<CpuTensor, OpError> {
        if numel(dims)? != data.len() {
            return Err(OpError::shape(
                "tensor_from_f32",
                format!("{} values for dims {dims:?}", data.len()),
            ));
        }
        Ok(CpuTensor::new(data.to_vec(), dims.to_vec()))
    }

    fn tensor_to_f32(&self, t: &CpuTensor) -> Result<Vec<f32>, OpError> {
        Ok(t.data.clone())
    }

    fn zeros(&self, dims: &[usize]) -> Result<CpuTensor, OpError> {
        Ok(CpuTensor::new(vec![0.0; numel(dims)?], dims.to_vec()))
    }

    fn copy_tensor(&self, src: &CpuTensor) -> Result<CpuTensor, OpError> {
        Ok(src.clone())
    }

    fn copy_into(&self, dst: &mut CpuTensor, src: &CpuTensor) -> Result<(), OpError> {
        same_len("copy_into", dst, src)?;
        dst.data.copy_from_slice(&src.data);
        Ok(())
    }

    fn reshape(&self, t: CpuTensor, dims: &[usize]) -> Result<CpuTensor, OpError> {
        if numel(dims)? != t.data.len() {
            return Err(OpError::shape(
                "reshape",
                format!("cannot view {:?} as {dims:?}", t.dims),
            ));
        }
        Ok(CpuTensor {
            data: t.data,
            dims: dims.to_vec(),
        })
    }

    fn add(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, OpError> {
        same_len("add", a, b)?;
        let data = a
            .data
            .par_iter()
            .with_min_len(4096)
            .zip(b.data.par_iter())
            .map(|(x, y)| x + y)
            .collect();
        Ok(CpuTensor::new(data, a.dims.clone()))
    }

    fn concat_cols(&self, a: &CpuTensor, b: &CpuTensor) -> Result<CpuTensor, OpError> {
        let (ta, ca) = rows_cols(a);
        let (tb, cb) = rows_cols(b);
        if ta != tb || ta == 0 {
            return Err(OpError::shape(
                "concat_cols",
                format!(
                    "row counts differ or are zero: {:?} vs {:?}",
                    a.dims, b.dims
                ),
            ));
        }
        let mut data = Vec::with_capacity(ta * (ca + cb));
        for t in 0..ta {
            data.extend_from_slice(&a.data[t * ca..(t + 1) * ca]);
            data.extend_from_slice(&b.data[t * cb..(t + 1) * cb]);
        }
        Ok(CpuTensor::new(data, vec![ta, ca + cb]))
    }

    fn split_cols(
        &self,
        x: &CpuTensor,
        groups: usize,
        sizes: &[usize],
    ) -> Result<Vec<CpuTensor>, OpError> {
        let (t, c) = rows_cols(x);
        let per: usize = sizes.iter().sum();
        if groups == 0 || per == 0 || groups * per != c {
            return Err(OpError::shape(
                "split_cols",
                format!("{:?} is not [T, {groups} × {sizes:?}]", x.dims),
            ));
        }
        let mut outs: Vec<Vec<f32>> = sizes
            .iter()
            .map(|s| Vec::with_capacity(t * groups * s))
            .collect();
        for row in x.data.chunks_exact(c) {
            for g in row.chunks_exact(per) {
                let mut off = 0;
                for (o, &s) in outs.iter_mut().zip(sizes) {
                    o.extend_from_slice(&g[off..off + s]);
                    off += s;
                }
            }
        }
        Ok(outs
            .into_iter()
            .zip(sizes)
            .map(|(d, s)| CpuTensor::new(d, vec![t, groups * s]))
            .collect())
    }

    fn rows(&self, x: &CpuTensor, first: usize, n: usize) -> Result<CpuTensor, OpError> {
        let (t, c) = rows_cols(x);
        if first.checked_add(n).is_none_or(|e| e > t) {
            return Err(OpError::shape(
                "rows",
                format!("rows [{first}, {first}+{n}) of {:?}", x.dims),
            ));
        }
        Ok(CpuTensor::new(
            x.data[first * c..(first + n) * c].to_vec(),
            vec![n, c],
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{tensor, Rng};

    #[test]
    fn split_concat_rows_add_roundtrip() {
        let b = CpuBackend::new();
        let mut r = Rng::new(1);
        let (t, groups, sizes) = (3, 2, [4usize, 3, 5]);
        let c = groups * 12;
        let x = tensor(r.vec(t * c, 1.0), &[t, c]);
        let parts = b.split_cols(&x, groups, &sizes).expect("split");
        for (p, &s) in parts.iter().zip(&sizes) {
            assert_eq!(p.dims, vec![t, groups * s]);
        }
        // Element check against direct indexing.
        for row in 0..t {
            for g in 0..groups {
                for j in 0..5 {
                    assert_eq!(
                        parts[2].data[row * groups * 5 + g * 5 + j],
                        x.data[row * c + g * 12 + 7 + j]
                    );
                }
            }
        }
        let ab = b.concat_cols(&parts[0], &parts[1]).expect("concat");
        assert_eq!(ab.dims, vec![t, groups * 7]);
        assert_eq!(&ab.data[..groups * 4], &parts[0].data[..groups * 4]);
        let r1 = b.rows(&x, 1, 2).expect("rows");
        assert_eq!(r1.data, x.data[c..3 * c].to_vec());
        let s = b.add(&x, &x).expect("add");
        assert!(s.data.iter().zip(&x.data).all(|(a, b)| *a == 2.0 * b));
        assert!(b.split_cols(&x, 5, &sizes).is_err());
        assert!(b.rows(&x, 2, 2).is_err());
        assert!(b.reshape(x.clone(), &[5, 5]).is_err());
        assert!(b.tensor_from_f32(&[1.0, 2.0], &[3]).is_err());
        let mut z = b.zeros(&[t, c]).expect("zeros");
        b.copy_into(&mut z, &x).expect("copy");
        assert_eq!(z, x);
    }
}
