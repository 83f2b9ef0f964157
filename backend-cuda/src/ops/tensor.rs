//! `TensorOps`: creation, transfer and layout ops.

use super::same_len;
use crate::launch::{args, dev, grid1d};
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::result;
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::TensorOps;
use kvstream_memory_contracts::transfer::DeviceMemory;
use std::sync::Arc;

impl CudaBackend {
    /// dst[r, dst_col0 + c] = src[r, src_col0 + c].
    #[allow(clippy::too_many_arguments)]
    /// `split_cols` of `x` = [t, groups × width] into fresh [t, groups × size] tensors: up to
    /// four parts per launch (`split_cols_f32`).
    fn split_cols_copied(
        &self,
        x: &CudaTensor,
        t: usize,
        groups: usize,
        width: usize,
        sizes: &[usize],
    ) -> Result<Vec<CudaTensor>, OpError> {
        let rows = t * groups;
        let outs = sizes
            .iter()
            .map(|&s| self.tensor_uninit(&[t, groups * s]))
            .collect::<Result<Vec<_>, _>>()?;
        let f = self.func("split_cols_f32")?;
        let mut col0 = 0usize;
        for (chunk, parts) in sizes.chunks(4).zip(outs.chunks(4)) {
            let span: usize = chunk.iter().sum();
            if span > 0 && rows > 0 {
                let mut d = [0u64; 4];
                let mut n = [0u64; 4];
                for (i, (&s, o)) in chunk.iter().zip(parts).enumerate() {
                    d[i] = o.ptr();
                    n[i] = s as u64;
                }
                let (sp, w64, r64, c64) = (x.ptr(), width as u64, rows as u64, col0 as u64);
                let mut a = args![
                    &sp, &w64, &r64, &c64, &d[0], &n[0], &d[1], &n[1], &d[2], &n[2], &d[3], &n[3]
                ];
                self.launch("split_cols", f, grid1d(rows * span, 256), &mut a)?;
            }
            col0 += span;
        }
        Ok(outs)
    }

    pub(crate) fn copy_cols(
        &self,
        src: &CudaTensor,
        src_stride: usize,
        src_col0: usize,
        dst: &CudaTensor,
        dst_stride: usize,
        dst_col0: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), OpError> {
        let n = rows * cols;
        if n == 0 {
            return Ok(());
        }
        let f = self.func("copy_cols_f32")?;
        let (s, d) = (src.ptr(), dst.ptr());
        let (ss, sc, ds, dc, r, c) = (
            src_stride as u64,
            src_col0 as u64,
            dst_stride as u64,
            dst_col0 as u64,
            rows as u64,
            cols as u64,
        );
        let mut a = args![&s, &ss, &sc, &d, &ds, &dc, &r, &c];
        self.launch("copy_cols", f, grid1d(n, 256), &mut a)
    }

    fn dtod(&self, dst: u64, src: u64, bytes: usize, op: &'static str) -> Result<(), OpError> {
        if bytes == 0 {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(dev(op))?;
        // SAFETY: callers pass ranges inside live allocations; ordered on the compute stream.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.compute.cu_stream()) }
            .map_err(dev(op))
    }
}

fn check_dims(op: &'static str, n: usize, dims: &[usize]) -> Result<(), OpError> {
    let p: usize = dims.iter().product();
    if p != n {
        return Err(OpError::shape(
            op,
            format!("dims {dims:?} hold {p} elements, data has {n}"),
        ));
    }
    Ok(())
}

impl TensorOps for CudaBackend {
    fn tensor_from_f32(&self, data: &[f32], dims: &[usize]) -> Result<CudaTensor, OpError> {
        check_dims("tensor_from_f32", data.len(), dims)?;
        let alloc = self.upload(data, "tensor")?;
        Ok(CudaTensor {
            alloc,
            offset: 0,
            dims: dims.to_vec(),
            prepared: None,
        })
    }

    fn tensor_to_f32(&self, t: &CudaTensor) -> Result<Vec<f32>, OpError> {
        let mut out = vec![0f32; t.numel()];
        self.ctx.bind_to_thread().map_err(dev("tensor_to_f32"))?;
        self.compute.synchronize().map_err(dev("tensor_to_f32"))?;
        if !out.is_empty() {
            // SAFETY: the tensor holds numel f32 values; `out` outlives the synchronisation.
            unsafe { result::memcpy_dtoh_async(&mut out, t.ptr(), self.compute.cu_stream()) }
                .map_err(dev("tensor_to_f32"))?;
            self.compute.synchronize().map_err(dev("tensor_to_f32"))?;
        }
        Ok(out)
    }

    fn zeros(&self, dims: &[usize]) -> Result<CudaTensor, OpError> {
        let t = self.tensor_uninit(dims)?;
        let n = t.numel();
        if n > 0 {
            self.ctx.bind_to_thread().map_err(dev("zeros"))?;
            // SAFETY: the allocation holds n * 4 bytes; ordered on the compute stream.
            unsafe { result::memset_d8_async(t.ptr(), 0, n * 4, self.compute.cu_stream()) }
                .map_err(dev("zeros"))?;
        }
        Ok(t)
    }

    fn copy_tensor(&self, src: &CudaTensor) -> Result<CudaTensor, OpError> {
        let t = self.tensor_uninit(&src.dims)?;
        self.dtod(t.ptr(), src.ptr(), src.numel() * 4, "copy_tensor")?;
        Ok(t)
    }

    fn copy_into(&self, dst: &mut CudaTensor, src: &CudaTensor) -> Result<(), OpError> {
        same_len("copy_into", dst, src)?;
        if Arc::strong_count(&dst.alloc) > 1 {
            // A view (or a tensor a view was taken of): writing would change the other one too.
            return Err(OpError::shape(
                "copy_into",
                format!(
                    "the destination {:?} shares its device allocation with a view; copy into a \
                     tensor of its own (copy_tensor)",
                    dst.dims
                ),
            ));
        }
        // New values: x-prep bytes made for the old ones no longer apply.
        dst.prepared = None;
        self.dtod(dst.ptr(), src.ptr(), src.numel() * 4, "copy_into")
    }

    fn reshape(&self, t: CudaTensor, dims: &[usize]) -> Result<CudaTensor, OpError> {
        check_dims("reshape", t.numel(), dims)?;
        Ok(CudaTensor {
            alloc: Arc::clone(&t.alloc),
            offset: t.offset,
            dims: dims.to_vec(),
            // Same values in the same order: the x-prep bytes (per 128 values) stay valid.
            prepared: t.prepared,
        })
    }

    fn add(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor, OpError> {
        same_len("add", a, b)?;
        self.binary("add_f32", "add", a, b)
    }

    fn concat_cols(&self, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor, OpError> {
        let (ca, cb) = (super::last_dim(a), super::last_dim(b));
        let (ta, tb) = (a.numel() / ca.max(1), b.numel() / cb.max(1));
        if ta != tb || a.numel() != ta * ca || b.numel() != tb * cb {
            return Err(OpError::shape(
                "concat_cols",
                format!("row counts differ: {:?} vs {:?}", a.dims, b.dims),
            ));
        }
        let out = self.tensor_uninit(&[ta, ca + cb])?;
        self.copy_cols(a, ca, 0, &out, ca + cb, 0, ta, ca)?;
        self.copy_cols(b, cb, 0, &out, ca + cb, ca, tb, cb)?;
        Ok(out)
    }

    fn split_cols(
        &self,
        x: &CudaTensor,
        groups: usize,
        sizes: &[usize],
    ) -> Result<Vec<CudaTensor>, OpError> {
        let width: usize = sizes.iter().sum();
        let c = super::last_dim(x);
        if groups == 0 || width == 0 || c != groups * width || x.numel() % c != 0 {
            return Err(OpError::shape(
                "split_cols",
                format!("{:?} is not [T, {groups} x {width}]", x.dims),
            ));
        }
        let t = x.numel() / c;
        if t * groups > 1 {
            return self.split_cols_copied(x, t, groups, width, sizes);
        }
        let mut outs = Vec::with_capacity(sizes.len());
        let mut col0 = 0;
        for &s in sizes {
            // One row and one group (a decode step's fused projection): each part is a
            // contiguous range of the row, so an aligned part is a view instead of a copy.
            let view = if t * groups == 1 {
                x.view(col0, &[1, s])
            } else {
                None
            };
            let out = match view {
                Some(v) => v,
                None => {
                    let out = self.tensor_uninit(&[t, groups * s])?;
                    self.copy_cols(x, width, col0, &out, s, 0, t * groups, s)?;
                    out
                }
            };
            col0 += s;
            outs.push(out);
        }
        Ok(outs)
    }

    fn rows(&self, x: &CudaTensor, first: usize, n: usize) -> Result<CudaTensor, OpError> {
        let c = super::last_dim(x);
        let t = x.numel().checked_div(c).unwrap_or(0);
        if first.checked_add(n).is_none_or(|e| e > t) {
            return Err(OpError::shape(
                "rows",
                format!(
                    "rows [{first}, {}) of {:?}",
                    first.saturating_add(n),
                    x.dims
                ),
            ));
        }
        // Rows are contiguous: an aligned range is a view of x.
        if let Some(v) = x.view(first * c, &[n, c]) {
            return Ok(v);
        }
        let out = self.tensor_uninit(&[n, c])?;
        self.dtod(
            out.ptr(),
            x.ptr() + (first * c * 4) as u64,
            n * c * 4,
            "rows",
        )?;
        Ok(out)
    }
}

impl CudaBackend {
    /// A two-input element-wise kernel `(a, b, y, n)`.
    pub(crate) fn binary(
        &self,
        kernel: &'static str,
        op: &'static str,
        a: &CudaTensor,
        b: &CudaTensor,
    ) -> Result<CudaTensor, OpError> {
        same_len(op, a, b)?;
        let out = self.tensor_uninit(&a.dims)?;
        let n = a.numel();
        if n == 0 {
            return Ok(out);
        }
        let f = self.func(kernel)?;
        let (pa, pb, py, n64) = (a.ptr(), b.ptr(), out.ptr(), n as u64);
        let mut args = args![&pa, &pb, &py, &n64];
        self.launch(op, f, grid1d(n, 256), &mut args)?;
        Ok(out)
    }

    /// Waits for the compute stream (tests and synchronous reads).
    pub fn sync_compute(&self) -> Result<(), OpError> {
        self.synchronize()
    }
}
