//! Prefill GEMM (more than `GEMV_MAX_T` rows): y[T, N] = x[T, K] · w[N, K]ᵀ, f32 out.
//!
//! * cuBLAS ([`PrefillGemm::Cublas`]): `cublasGemmEx`, compute 32F, default algorithm (tensor
//!   cores) on **split bf16 operands**, so the result keeps f32-class accuracy (the CUDA backend
//!   must match the CPU's greedy tokens): x = xh + xl (`f32_to_bf16x2_rows`, 16 significant bits).
//!   bf16 weights are exact as stored: y = w·xh + w·xl (2 GEMMs). f16 and quantized weights are
//!   dequantised (`dequant_rows_bf16x2`: the exact value split into wh + wl) into a bounded
//!   scratch, [`DEQUANT_SCRATCH_BYTES`], one tile of rows at a time: y = wh·xh + wh·xl + wl·xh
//!   (3 GEMMs; the dropped wl·xl is below 2^-16 of each product). f32 weights run an f32 GEMM
//!   (f32 x, no TF32). Each product's relative error is ≤ about 2^-15, against 2^-8 for plain
//!   bf16 operands; the cost is 2-3 tensor-core GEMMs, still far below the SIMT kernel's time.
//! * SIMT (`gemm_f32out`): the fallback, exact dequantised weights and f32 FMA.
//!
//! Column-major view for cuBLAS: y row-major [T, N] is C column-major [N, T] (ldc = N) =
//! op(A) · B with A = w as column-major [K, N] (lda = K, op T) and B = x as column-major [K, T]
//! (ldb = K, op N). A tile of weight rows n0..n0+r writes C's rows n0.. (pointer y + n0, ldc = N).
//!
//! Scratch (x hi/lo, the dequantised tile) is stream-ordered temporaries of the compute stream
//! (freed in stream order when this call returns, like every other temporary of the backend).

use crate::blas::{BlasHandle, PrefillGemm};
use crate::launch::{args, dev, grid1d};
use crate::types::dtype_code;
use crate::{CudaBackend, CudaTensor, CudaWeight};
use cudarc::cublas::{result as blas, sys};
use cudarc::driver::LaunchConfig;
use kvstream_kernels::launch::GEMM_TILE;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Most bytes of dequantised weight rows held at once (one tile: its hi and lo bf16 halves).
pub const DEQUANT_SCRATCH_BYTES: usize = 64 << 20;
/// Most weight rows per dequantised tile.
const TILE_MAX_ROWS: usize = 4096;
/// Tile rows are a multiple of this (keeps `y + n0` 256-byte aligned).
const TILE_ROW_GRANULE: usize = 64;

/// Rows per dequantised tile for a weight of `n` rows of `k` values: as many as fit (hi and lo,
/// 4 bytes per value) in [`DEQUANT_SCRATCH_BYTES`] (at least one granule), at most [`TILE_MAX_ROWS`] and `n`.
pub(crate) fn tile_rows(n: usize, k: usize) -> usize {
    let fit = DEQUANT_SCRATCH_BYTES / (4 * k.max(1));
    let granules = (fit / TILE_ROW_GRANULE).max(1);
    (granules * TILE_ROW_GRANULE).min(TILE_MAX_ROWS).min(n)
}

/// The shape of one prefill GEMM.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gemm {
    pub(super) t: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) soff: u64,
}

fn blas_err(e: blas::CublasError) -> OpError {
    OpError::Device {
        op: "gemm",
        detail: format!("cuBLAS: {e}"),
    }
}

impl CudaBackend {
    /// y = x · wᵀ for more than `GEMV_MAX_T` rows, on the chosen path (see the module docs).
    pub(super) fn gemm_prefill(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        y: &CudaTensor,
        g: Gemm,
    ) -> Result<(), OpError> {
        let fits_i32 = [g.t, g.n, g.k].iter().all(|&d| i32::try_from(d).is_ok());
        if fits_i32 && self.prefill_gemm() == PrefillGemm::Cublas {
            if let Some(b) = self.blas() {
                match self.gemm_cublas(b, x, w, y, g) {
                    Ok(()) => return Ok(()),
                    // The SIMT kernel writes every output, so a partly written y is fine.
                    Err(e) => self.blas.warn_once(&format!(
                        "cuBLAS GEMM failed ({e}); this call runs on the SIMT kernel"
                    )),
                }
            }
        }
        self.gemm_simt(x, w, y, g)
    }

    fn gemm_simt(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        y: &CudaTensor,
        g: Gemm,
    ) -> Result<(), OpError> {
        let Gemm { t, n, k, soff } = g;
        if t.div_ceil(GEMM_TILE) > 65_535 {
            return Err(OpError::shape("matmul", format!("{t} rows is too many")));
        }
        let f = self.func("gemm_f32out")?;
        let (xp, wp, dt, yp) = (x.ptr(), w.ptr(), dtype_code(w.dtype), y.ptr());
        let (t64, k64, n64) = (t as u64, k as u64, n as u64);
        let cfg = LaunchConfig {
            grid_dim: (
                n.div_ceil(GEMM_TILE) as u32,
                t.div_ceil(GEMM_TILE) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = args![&xp, &wp, &dt, &yp, &t64, &k64, &n64, &soff];
        self.launch("gemm", f, cfg, &mut a)
    }

    fn gemm_cublas(
        &self,
        b: &Mutex<BlasHandle>,
        x: &CudaTensor,
        w: &CudaWeight,
        y: &CudaTensor,
        g: Gemm,
    ) -> Result<(), OpError> {
        let Gemm { t, n, k, soff } = g;
        let blas = b.lock().unwrap_or_else(|e| e.into_inner());
        let h = blas.raw();
        self.ctx.bind_to_thread().map_err(dev("gemm"))?;
        let call = CublasCall { h, t, k, ldc: n };
        match w.dtype {
            WeightDType::F32 => call.run(
                n,
                w.ptr(),
                x.ptr(),
                y.ptr(),
                sys::cudaDataType::CUDA_R_32F,
                0.0,
            ),
            WeightDType::Bf16 => {
                // w exact in bf16: y = w·xh + w·xl.
                let (xh, xl) = self.x_to_bf16x2(x, t * k)?;
                let bf = sys::cudaDataType::CUDA_R_16BF;
                call.run(n, w.ptr(), xh.ptr(), y.ptr(), bf, 0.0)?;
                call.run(n, w.ptr(), xl.ptr(), y.ptr(), bf, 1.0)
            }
            _ => {
                // y = wh·xh + wh·xl + wl·xh (the dropped wl·xl is below 2^-16 of each product).
                let (xh, xl) = self.x_to_bf16x2(x, t * k)?;
                let rows = tile_rows(n, k);
                let wh = self.alloc_bytes(rows * k * 2, "gemm weight tile hi")?;
                let wl = self.alloc_bytes(rows * k * 2, "gemm weight tile lo")?;
                let f = self.func("dequant_rows_bf16x2")?;
                let (wp, dt, k64) = (w.ptr(), dtype_code(w.dtype), k as u64);
                let (hp, lp) = (wh.ptr(), wl.ptr());
                let bf = sys::cudaDataType::CUDA_R_16BF;
                for n0 in (0..n).step_by(rows) {
                    let r = rows.min(n - n0);
                    let (row0, r64) = (n0 as u64, r as u64);
                    let cfg = LaunchConfig {
                        grid_dim: (k.div_ceil(256).min(1024) as u32, r.min(65_535) as u32, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut a = args![&wp, &dt, &row0, &r64, &k64, &soff, &hp, &lp];
                    self.launch("gemm dequant", f, cfg, &mut a)?;
                    let yp = y.ptr() + 4 * row0;
                    call.run(r, hp, xh.ptr(), yp, bf, 0.0)?;
                    call.run(r, hp, xl.ptr(), yp, bf, 1.0)?;
                    call.run(r, lp, xh.ptr(), yp, bf, 1.0)?;
                }
                Ok(())
            }
        }
    }

    /// x (f32, `len` values) split into bf16 hi and lo temporaries of the compute stream
    /// (`f32_to_bf16x2_rows`: hi + lo carries 16 significant bits of x).
    fn x_to_bf16x2(
        &self,
        x: &CudaTensor,
        len: usize,
    ) -> Result<(Arc<crate::DeviceAlloc>, Arc<crate::DeviceAlloc>), OpError> {
        let hi = self.alloc_bytes(len * 2, "gemm x hi")?;
        let lo = self.alloc_bytes(len * 2, "gemm x lo")?;
        let f = self.func("f32_to_bf16x2_rows")?;
        let (xp, hp, lp, n64) = (x.ptr(), hi.ptr(), lo.ptr(), len as u64);
        let mut a = args![&xp, &hp, &lp, &n64];
        self.launch("gemm convert", f, grid1d(len, 256), &mut a)?;
        Ok((hi, lo))
    }
}

/// One `cublasGemmEx` of a prefill: T columns of x, K deep, output leading dimension `ldc` = N.
struct CublasCall {
    h: sys::cublasHandle_t,
    t: usize,
    k: usize,
    ldc: usize,
}

impl CublasCall {
    /// C[rows, T] (column-major, at `y`, leading dimension `ldc`) = A[K, rows]ᵀ · B[K, T] +
    /// beta · C, with A and B of type `ty` and C f32.
    fn run(
        &self,
        rows: usize,
        a: u64,
        b: u64,
        y: u64,
        ty: sys::cudaDataType,
        beta: f32,
    ) -> Result<(), OpError> {
        let dim = |v: usize| {
            i32::try_from(v).map_err(|_| OpError::shape("matmul", format!("{v} is too large")))
        };
        let (m, n, k, ldc) = (dim(rows)?, dim(self.t)?, dim(self.k)?, dim(self.ldc)?);
        let alpha = 1.0f32;
        // SAFETY: `a` holds `rows` rows of K values of `ty`, `b` T rows of K values of `ty`, `y`
        // T rows of `ldc` f32 of which this call writes `rows` from its pointer on (the caller
        // offsets it by whole rows of the weight, so rows + offset <= ldc); all are live device
        // allocations ordered on the compute stream the handle is bound to; alpha and beta are
        // host scalars (the handle's default pointer mode).
        unsafe {
            blas::gemm_ex(
                self.h,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                (&alpha as *const f32).cast::<c_void>(),
                a as *const c_void,
                ty,
                k,
                b as *const c_void,
                ty,
                k,
                (&beta as *const f32).cast::<c_void>(),
                y as *mut c_void,
                sys::cudaDataType::CUDA_R_32F,
                ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(blas_err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_are_bounded_aligned_and_cover_n() {
        for (n, k) in [
            (96, 128),
            (4100, 640),
            (17408, 5120),
            (5120, 17408),
            (3, 1 << 22),
        ] {
            let r = tile_rows(n, k);
            assert!(r >= 1 && r <= n, "{n}x{k}: {r}");
            assert!(r <= TILE_MAX_ROWS);
            assert!(r == n || r % TILE_ROW_GRANULE == 0, "{n}x{k}: {r}");
            assert!(
                r * k * 4 <= DEQUANT_SCRATCH_BYTES || r <= TILE_ROW_GRANULE,
                "{n}x{k}: {r}"
            );
        }
        assert_eq!(tile_rows(4100, 640), 4096, "N = 4100 crosses a tile");
        assert_eq!(tile_rows(17408, 5120), 3264);
        assert_eq!(tile_rows(5120, 17408), 960);
    }
}
