//! `LinearOps`: weight upload, embedding gather and matmul (GEMV for decode, own kernels; GEMM for
//! prefill: cuBLAS on tensor cores or the SIMT fallback, see [`gemm`]; own kernels reading f32/f16/bf16 and the quantized q8_0 / q4_g128 / fp8_e4m3 / q4_nl_g128 layouts
//! of `memory_contracts::weight_format`, dequantised in registers, f32 accumulation).
//!
//! The GEMV (≤ 8 rows) reads every weight byte once for all rows, streaming 16-byte chunks through
//! a per-warp cp.async ring in shared memory; row t of its result is bit-identical for every T in
//! 1..=8 (see [`plan`] and linear.cu).

mod gemm;
mod plan;
pub(crate) mod prepared;
pub(crate) mod q4mma;
pub(crate) mod q4mmap;
pub(crate) mod q4nl;
pub(crate) mod q4tiles;
pub(crate) mod sk_plan;
pub(crate) mod streamk;

use crate::launch::args;
use crate::types::dtype_code;
use crate::{CudaBackend, CudaTensor, CudaWeight};
use cudarc::driver::LaunchConfig;
use kvstream_kernels::launch::GEMV_MAX_T;
use kvstream_memory_contracts::backend::{DeviceTensor, WeightDType};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{LinearOps, WeightData};
use kvstream_memory_contracts::quant_layout;
use plan::{gemv_plan, GemvPlan, GV_WARPS, SCALAR_WARPS};
use sk_plan::GemvSk;
use std::sync::atomic::Ordering;

/// Byte offset of the scales of a quantized weight (0 for element dtypes, whose kernels ignore it).
fn scales_offset(op: &'static str, w: &CudaWeight) -> Result<u64, OpError> {
    if !w.dtype.is_quantized() {
        return Ok(0);
    }
    let layout = quant_layout(w.dtype, &w.dims)
        .map_err(|e| OpError::shape(op, format!("weight `{}`: {e}", w.name)))?;
    Ok(layout.scales_offset as u64)
}

impl LinearOps for CudaBackend {
    fn load_weight(
        &self,
        name: &str,
        dtype: WeightDType,
        dims: &[usize],
        data: WeightData,
    ) -> Result<CudaWeight, OpError> {
        let _span = tracing::debug_span!("load_weight", name, %dtype, bytes = data.len).entered();
        let expected = dtype
            .storage_bytes(dims)
            .map_err(|e| OpError::shape("load_weight", format!("`{name}`: {e}")))?;
        if expected != data.len {
            return Err(OpError::shape(
                "load_weight",
                format!(
                    "`{name}`: {dtype} {dims:?} needs {expected} bytes, got {}",
                    data.len
                ),
            ));
        }
        let src = (*data.source).as_ref();
        let bytes = src
            .get(data.offset..data.offset.saturating_add(data.len))
            .ok_or_else(|| {
                OpError::shape(
                    "load_weight",
                    format!("`{name}`: byte range outside its source"),
                )
            })?;
        self.fused_prep.register(dtype, dims);
        let alloc = if dtype == WeightDType::Q4NlG128 {
            // The kernels read relabeled codes (see `q4nl`); the codes are the first R·K/2 bytes.
            let codes = dims.iter().product::<usize>() / 2;
            self.upload(&q4nl::relabel_blob(bytes, codes), name)?
        } else {
            self.upload(bytes, name)?
        };
        Ok(CudaWeight {
            alloc,
            dims: dims.to_vec(),
            dtype,
            name: name.to_string(),
        })
    }

    fn embedding(&self, table: &CudaWeight, ids: &[u32]) -> Result<CudaTensor, OpError> {
        if table.dims.len() != 2 {
            return Err(OpError::shape(
                "embedding",
                format!("table {:?} is not [V, H]", table.dims),
            ));
        }
        let (v, h) = (table.dims[0], table.dims[1]);
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
            return Err(OpError::shape(
                "embedding",
                format!("id {bad} is not below the vocabulary size {v}"),
            ));
        }
        let out = self.tensor_uninit(&[ids.len(), h])?;
        if ids.is_empty() || h == 0 {
            return Ok(out);
        }
        let ids_dev = self.upload(ids, "ids")?;
        let cfg = LaunchConfig {
            grid_dim: (
                h.div_ceil(256).min(1024) as u32,
                ids.len().min(65_535) as u32,
                1,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (tp, dt, ip, n, hh, op) = (
            table.ptr(),
            dtype_code(table.dtype),
            ids_dev.ptr(),
            ids.len() as u64,
            h as u64,
            out.ptr(),
        );
        if table.dtype.is_quantized() {
            // Dequantises only the requested rows, to the CPU's exact values.
            let soff = scales_offset("embedding", table)?;
            let f = self.func("embedding_rows_q")?;
            let mut a = args![&tp, &dt, &ip, &n, &hh, &soff, &op];
            self.launch("embedding", f, cfg, &mut a)?;
        } else {
            let f = self.func("embedding_gather")?;
            let mut a = args![&tp, &dt, &ip, &n, &hh, &op];
            self.launch("embedding", f, cfg, &mut a)?;
        }
        Ok(out)
    }

    fn prefetch_weight(&self, w: &CudaWeight) -> Result<(), OpError> {
        self.prefetch_weight_l2(w)
    }

    fn matmul(&self, x: &CudaTensor, w: &CudaWeight) -> Result<CudaTensor, OpError> {
        if w.dims.len() != 2 {
            return Err(OpError::shape(
                "matmul",
                format!("weight `{}` {:?} is not [N, K]", w.name, w.dims),
            ));
        }
        let (n, k) = (w.dims[0], w.dims[1]);
        if k == 0 || x.numel() % k != 0 || super::last_dim(x) != k {
            return Err(OpError::shape(
                "matmul",
                format!(
                    "x {:?} does not end in K = {k} (weight `{}`)",
                    x.dims, w.name
                ),
            ));
        }
        let t = x.numel() / k;
        let _span = tracing::trace_span!("matmul", t, n, k, dtype = %w.dtype).entered();
        let out = self.tensor_uninit(&[t, n])?;
        if t == 0 || n == 0 {
            return Ok(out);
        }
        let soff = scales_offset("matmul", w)?;
        let (xp, wp, dt, yp) = (x.ptr(), w.ptr(), dtype_code(w.dtype), out.ptr());
        let (k64, n64) = (k as u64, n as u64);
        if t <= GEMV_MAX_T {
            if w.dtype.is_q4() {
                if let Some(kind) = q4mmap::MmapKind::for_weight(self.q4_gemv(), w.dtype) {
                    if let Some(plan) = self.q4_mmap_plan(kind, n, k, wp, soff) {
                        self.gemv_q4_mmap(plan, kind, x, wp, soff, &out, t, n, k)?;
                        return Ok(out);
                    }
                }
            }
            let t32 = t as i32;
            let too_big = || OpError::shape("matmul", format!("{n} output rows is too many"));
            let plan = gemv_plan(
                w.dtype,
                dt as usize,
                t,
                n,
                k,
                wp,
                self.sm_count,
                self.gemv_sk(),
            );
            match plan.ok_or_else(too_big)? {
                GemvPlan::Vector {
                    name,
                    split,
                    blocks,
                } => {
                    let f = self.func(name)?;
                    let split32 = split as i32;
                    let cfg = LaunchConfig {
                        grid_dim: (blocks, 1, 1),
                        block_dim: ((GV_WARPS * 32) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut a = args![&xp, &wp, &yp, &t32, &k64, &n64, &soff, &split32];
                    self.launch("gemv", f, cfg, &mut a)?;
                }
                GemvPlan::StreamK { name, split } => {
                    let (scratch, counters) =
                        self.stream_k_buffers(split.scratch_bytes(), split.counter_bytes())?;
                    let f = self.func(name)?;
                    let cfg = LaunchConfig {
                        grid_dim: (split.blocks, 1, 1),
                        block_dim: ((GV_WARPS * 32) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let (sp, cp) = (scratch.ptr(), counters.ptr());
                    let mut a = args![&xp, &wp, &yp, &t32, &k64, &n64, &soff, &sp, &cp];
                    self.launch("gemv", f, cfg, &mut a)?;
                }
                GemvPlan::Scalar { blocks } => {
                    let f = self.func("gemv_scalar")?;
                    let cfg = LaunchConfig {
                        grid_dim: (blocks, 1, 1),
                        block_dim: ((SCALAR_WARPS * 32) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut a = args![&xp, &wp, &dt, &yp, &t32, &k64, &n64, &soff];
                    self.launch("gemv", f, cfg, &mut a)?;
                }
            }
        } else {
            self.gemm_prefill(x, w, &out, gemm::Gemm { t, n, k, soff })?;
        }
        Ok(out)
    }
}

impl CudaBackend {
    /// The decode GEMV choice for element and 8-bit weights now ([`GemvSk`]).
    pub fn gemv_sk(&self) -> GemvSk {
        GemvSk::from_code(self.gemv_sk.load(Ordering::Relaxed))
    }

    /// Chooses the decode GEMV of element and 8-bit weights (overrides `KVSTREAM_GEMV_SK`).
    /// Choose before decoding a session: MTP verification rows equal single-step rows only under
    /// one choice (the two kernels sum in different orders).
    pub fn set_gemv_sk(&self, mode: GemvSk) {
        self.gemv_sk.store(mode.code(), Ordering::Relaxed);
    }

    /// The kernel a `t`-row matmul against `w` runs now (benchmarks and logs): a GEMV instance
    /// name, the family (`gemv_q4i8p`, `gemv_q4mmap`) of a q4 tensor-core path, or
    /// `gemm` (T > 8).
    pub fn matmul_kernel(&self, w: &CudaWeight, t: usize) -> &'static str {
        if w.dims.len() != 2 || t > GEMV_MAX_T {
            return "gemm";
        }
        let (n, k) = (w.dims[0], w.dims[1]);
        if w.dtype.is_q4() {
            if let Some(kind) = q4mmap::MmapKind::for_weight(self.q4_gemv(), w.dtype) {
                let soff = scales_offset("matmul", w).ok();
                let planned = soff
                    .and_then(|soff| self.q4_mmap_plan(kind, n, k, w.ptr(), soff))
                    .is_some();
                let tiles = soff
                    .and_then(|soff| self.q4_tiles_plan(kind, n, k, t, w.ptr(), soff))
                    .is_some();
                if planned && tiles {
                    return match kind {
                        q4mmap::MmapKind::Int8ColsNl => "gemv_q4nli8t",
                        _ => "gemv_q4i8t",
                    };
                }
                if planned {
                    return match kind {
                        q4mmap::MmapKind::SplitBf16 => "gemv_q4mmap",
                        q4mmap::MmapKind::Int8 => "gemv_q4i8p",
                        q4mmap::MmapKind::Int8Nl => "gemv_q4nli8p",
                        q4mmap::MmapKind::Int8Cols => "gemv_q4i8c",
                        q4mmap::MmapKind::Int8ColsNl => "gemv_q4nli8c",
                        q4mmap::MmapKind::SplitBf16Nl => "gemv_q4nlmmap",
                    };
                }
            }
        }
        let code = dtype_code(w.dtype) as usize;
        match gemv_plan(
            w.dtype,
            code,
            t,
            n,
            k,
            w.ptr(),
            self.sm_count,
            self.gemv_sk(),
        ) {
            Some(GemvPlan::Vector { name, .. } | GemvPlan::StreamK { name, .. }) => name,
            Some(GemvPlan::Scalar { .. }) => "gemv_scalar",
            None => "none",
        }
    }
}
