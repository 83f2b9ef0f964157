//! `NormOps`, `PositionOps`, `ActivationOps` and `SamplingOps`.

use crate::launch::{args, dev, grid1d};
use crate::ops::linear::prepared::{prep_args, PreparedX};
use crate::types::elementwise_dtype_code;
use crate::{CudaBackend, CudaTensor, CudaWeight};
use cudarc::driver::{result, LaunchConfig};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{
    ActivationOps, NormOps, Position3, PositionOps, RopeConfig, SamplingOps,
};

/// Rows of `x` for a 1-D weight of `d = w.numel()` values (norms, biases): `(rows, d)`.
pub(super) fn norm_rows(
    op: &'static str,
    x: &CudaTensor,
    w: &CudaWeight,
) -> Result<(usize, usize), OpError> {
    let d = w.numel();
    if d == 0 || x.numel() % d != 0 {
        return Err(OpError::shape(
            op,
            format!("x {:?} is not a multiple of the weight length {d}", x.dims),
        ));
    }
    Ok((x.numel() / d, d))
}

/// Environment switch: `1` runs the RMSNorms of rows of 4,096 values or more (the model's hidden
/// size) with 512 threads per row instead of 256 (`0`: 256 everywhere). A function of `d` only,
/// never of the row count, so a row's result does not depend on how many rows are normed with it
/// (MTP verification relies on that). Unset: [`WIDE_NORM_DEFAULT`]. With the fused x prep a warp
/// of a single-row norm prepares its 128-groups one after another: 512 threads halve that chain
/// (27B q4_g128 decode on an H100, session 16: −4.8% at 8 Ki, −5.1% at 32 Ki, docs/benchmarks.md).
/// 1,024 threads would not launch (the kernels use ~90 registers).
pub const WIDE_NORM_ENV: &str = "KVSTREAM_NORM_WIDE";

/// Whether [`WIDE_NORM_ENV`] is on when unset.
pub const WIDE_NORM_DEFAULT: bool = true;

/// Threads per block of `rms_norm_f32` / `add_rms_norm_f32` for rows of `d` values.
fn norm_threads(d: usize) -> u32 {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let wide = *WIDE.get_or_init(|| {
        std::env::var(WIDE_NORM_ENV).map_or(WIDE_NORM_DEFAULT, |v| v.trim() != "0")
    });
    norm_threads_for(d, wide)
}

fn norm_threads_for(d: usize, wide: bool) -> u32 {
    if wide && d >= 4096 {
        512
    } else {
        256
    }
}

/// One block per row: RMSNorm rows of `d` values.
fn norm_cfg(rows: usize, d: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (norm_threads(d), 1, 1),
        shared_mem_bytes: 0,
    }
}

fn row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Environment switch: `1` launches the RMSNorms, SwiGLU and sigmoid gate that write a q4 GEMV's
/// prepared x (the fused x prep) as programmatic dependents of the kernel before them (`0`:
/// normally). As dependents they are launched while that kernel (a q4 GEMV) drains, and wait in
/// `griddepcontrol.wait` for its completion before they read, so their launch latency hides
/// behind its tail. Unset: [`PRODUCER_PDL_DEFAULT`] (on: 27B q4_g128 decode on an H100, session
/// 17, -2.6 to -3.0% per step at 8 Ki and 32 Ki with and without MTP-3, see docs/benchmarks.md).
pub const PRODUCER_PDL_ENV: &str = "KVSTREAM_PDL_PRODUCERS";

/// Whether [`PRODUCER_PDL_ENV`] is on when unset.
pub const PRODUCER_PDL_DEFAULT: bool = true;

fn producer_pdl() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var(PRODUCER_PDL_ENV).map_or(PRODUCER_PDL_DEFAULT, |v| v.trim() != "0")
    })
}

impl CudaBackend {
    /// Launches a kernel that starts with `griddepcontrol.wait` (norm.cu, elementwise.cu): as a
    /// programmatic dependent when it writes a prepared x and [`PRODUCER_PDL_ENV`] allows.
    fn launch_producer(
        &self,
        op: &'static str,
        f: &cudarc::driver::CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
        prepares: bool,
    ) -> Result<(), OpError> {
        if prepares && producer_pdl() {
            self.launch_dependent(op, f, cfg, args)
        } else {
            self.launch(op, f, cfg, args)
        }
    }

    /// The fused x prep for a norm output `out` with rows of `d`, when it should carry one: the
    /// kernels prepare whole 128-groups from their vector path, so `d % 128 == 0` and every
    /// pointer the kernel streams (`ptrs`) 16-byte aligned.
    fn norm_prep(
        &self,
        d: usize,
        ptrs: &[&CudaTensor],
        out: &CudaTensor,
    ) -> Result<Option<PreparedX>, OpError> {
        if d % 128 != 0 || ptrs.iter().any(|t| t.ptr() % 16 != 0) {
            return Ok(None);
        }
        self.prepare_output(out)
    }

    /// SwiGLU / sigmoid gate: the plain binary kernel, or its `_prep` form writing the fused x
    /// prep too when the output should carry one (`numel % 128 == 0`, 16-byte aligned inputs).
    fn gate_op(
        &self,
        kernels: (&'static str, &'static str),
        op: &'static str,
        a: &CudaTensor,
        b: &CudaTensor,
    ) -> Result<CudaTensor, OpError> {
        super::same_len(op, a, b)?;
        let n = a.numel();
        if n == 0 || n % 128 != 0 || a.ptr() % 16 != 0 || b.ptr() % 16 != 0 {
            return self.binary(kernels.0, op, a, b);
        }
        let mut out = self.tensor_uninit(&a.dims)?;
        let Some(prep) = self.prepare_output(&out)? else {
            return self.binary(kernels.0, op, a, b);
        };
        let f = self.func(kernels.1)?;
        let (pa, pb, py, n64) = (a.ptr(), b.ptr(), out.ptr(), n as u64);
        let (xf, pc) = prep_args(Some(&prep));
        let mut args = args![&pa, &pb, &py, &n64, &xf, &pc];
        // One warp per 128-group, 8 warps per block.
        let cfg = LaunchConfig {
            grid_dim: ((n / 128).div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_producer(op, f, cfg, &mut args, true)?;
        out.prepared = Some(prep);
        Ok(out)
    }
}

impl NormOps for CudaBackend {
    fn rms_norm(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        unit_offset: f32,
    ) -> Result<CudaTensor, OpError> {
        let (rows, d) = norm_rows("rms_norm", x, w)?;
        let mut out = self.tensor_uninit(&x.dims)?;
        if rows == 0 {
            return Ok(out);
        }
        let prep = self.norm_prep(d, &[x, &out], &out)?;
        let f = self.func("rms_norm_f32")?;
        let (xp, wp, dt, d64, yp) = (
            x.ptr(),
            w.ptr(),
            elementwise_dtype_code("rms_norm", w.dtype)?,
            d as u64,
            out.ptr(),
        );
        let (xf, pc) = prep_args(prep.as_ref());
        let mut a = args![&xp, &wp, &dt, &d64, &eps, &unit_offset, &yp, &xf, &pc];
        self.launch_producer("rms_norm", f, norm_cfg(rows, d), &mut a, prep.is_some())?;
        out.prepared = prep;
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        a: &CudaTensor,
        b: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
        unit_offset: f32,
    ) -> Result<(CudaTensor, CudaTensor), OpError> {
        super::same_len("add_rms_norm", a, b)?;
        let (rows, d) = norm_rows("add_rms_norm", a, w)?;
        let h = self.tensor_uninit(&a.dims)?;
        let mut y = self.tensor_uninit(&a.dims)?;
        if rows == 0 {
            return Ok((h, y));
        }
        let prep = self.norm_prep(d, &[a, b, &h, &y], &y)?;
        let f = self.func("add_rms_norm_f32")?;
        let (ap, bp, wp, dt, d64, hp, yp) = (
            a.ptr(),
            b.ptr(),
            w.ptr(),
            elementwise_dtype_code("add_rms_norm", w.dtype)?,
            d as u64,
            h.ptr(),
            y.ptr(),
        );
        let (xf, pc) = prep_args(prep.as_ref());
        let mut args = args![
            &ap,
            &bp,
            &wp,
            &dt,
            &d64,
            &eps,
            &unit_offset,
            &hp,
            &yp,
            &xf,
            &pc
        ];
        self.launch_producer(
            "add_rms_norm",
            f,
            norm_cfg(rows, d),
            &mut args,
            prep.is_some(),
        )?;
        y.prepared = prep;
        Ok((h, y))
    }

    fn gated_rms_norm(
        &self,
        x: &CudaTensor,
        z: &CudaTensor,
        w: &CudaWeight,
        eps: f32,
    ) -> Result<CudaTensor, OpError> {
        let (rows, d) = norm_rows("gated_rms_norm", x, w)?;
        super::same_len("gated_rms_norm", x, z)?;
        let mut out = self.tensor_uninit(&x.dims)?;
        if rows == 0 {
            return Ok(out);
        }
        let prep = self.norm_prep(d, &[&out], &out)?;
        let f = self.func("gated_rms_norm_f32")?;
        let (xp, zp, wp, dt, d64, yp) = (
            x.ptr(),
            z.ptr(),
            w.ptr(),
            elementwise_dtype_code("gated_rms_norm", w.dtype)?,
            d as u64,
            out.ptr(),
        );
        let (xf, pc) = prep_args(prep.as_ref());
        let mut a = args![&xp, &zp, &wp, &dt, &d64, &eps, &yp, &xf, &pc];
        self.launch_producer("gated_rms_norm", f, row_cfg(rows), &mut a, prep.is_some())?;
        out.prepared = prep;
        Ok(out)
    }
}

impl PositionOps for CudaBackend {
    fn rope(
        &self,
        x: &CudaTensor,
        heads: usize,
        head_dim: usize,
        positions: &[Position3],
        cfg: &RopeConfig,
    ) -> Result<CudaTensor, OpError> {
        let t = positions.len();
        if x.numel() != t * heads * head_dim {
            return Err(OpError::shape(
                "rope",
                format!("x {:?} is not [{t}, {heads}, {head_dim}]", x.dims),
            ));
        }
        if cfg.rotary_dim % 2 != 0 || cfg.rotary_dim > head_dim {
            return Err(OpError::shape(
                "rope",
                format!("rotary_dim {} vs head_dim {head_dim}", cfg.rotary_dim),
            ));
        }
        let out = self.tensor_uninit(&x.dims)?;
        if x.numel() == 0 {
            return Ok(out);
        }
        let half = cfg.rotary_dim / 2;
        let axis: Vec<i32> = (0..half.max(1)).map(|j| cfg.axis_of(j) as i32).collect();
        let inv: Vec<f32> = (0..half.max(1)).map(|j| cfg.inv_freq(j)).collect();
        let pos: Vec<u32> = positions.iter().flat_map(|p| p.iter().copied()).collect();
        let (pd, ad, id) = (
            self.upload(&pos, "positions")?,
            self.upload(&axis, "rope axes")?,
            self.upload(&inv, "inv_freq")?,
        );
        let f = self.func("rope_f32")?;
        let (xp, yp, t64, h, hd, rd, pp, ap, ip) = (
            x.ptr(),
            out.ptr(),
            t as u64,
            heads as i32,
            head_dim as i32,
            cfg.rotary_dim as i32,
            pd.ptr(),
            ad.ptr(),
            id.ptr(),
        );
        let mut a = args![&xp, &yp, &t64, &h, &hd, &rd, &pp, &ap, &ip];
        self.launch("rope", f, grid1d(x.numel(), 256), &mut a)?;
        Ok(out)
    }
}

impl ActivationOps for CudaBackend {
    fn swiglu(&self, gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor, OpError> {
        self.gate_op(("swiglu_f32", "swiglu_prep_f32"), "swiglu", gate, up)
    }

    fn sigmoid_gate(&self, x: &CudaTensor, gate: &CudaTensor) -> Result<CudaTensor, OpError> {
        self.gate_op(
            ("sigmoid_gate_f32", "sigmoid_gate_prep_f32"),
            "sigmoid_gate",
            x,
            gate,
        )
    }
}

impl SamplingOps for CudaBackend {
    fn argmax_rows(&self, logits: &CudaTensor) -> Result<Vec<u32>, OpError> {
        let v = super::last_dim(logits);
        if v == 0 || logits.numel() % v != 0 {
            return Err(OpError::shape(
                "argmax_rows",
                format!("logits {:?} have no columns", logits.dims),
            ));
        }
        let rows = logits.numel() / v;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let outd = self.alloc_bytes(rows * 4, "argmax")?;
        let f = self.func("argmax_rows_f32")?;
        let (lp, c, op) = (logits.ptr(), v as u64, outd.ptr());
        let mut a = args![&lp, &c, &op];
        self.launch("argmax_rows", f, row_cfg(rows), &mut a)?;
        let mut out = vec![0u32; rows];
        // SAFETY: `outd` holds `rows` u32 values written by the kernel (ordered before this copy
        // on the compute stream); `out` outlives the synchronisation.
        unsafe { result::memcpy_dtoh_async(&mut out, outd.ptr(), self.compute.cu_stream()) }
            .map_err(dev("argmax_rows"))?;
        self.compute.synchronize().map_err(dev("argmax_rows"))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::norm_threads_for;

    #[test]
    fn wide_norm_rows_depend_on_the_row_length_only() {
        assert_eq!(norm_threads_for(5120, true), 512);
        assert_eq!(norm_threads_for(4096, true), 512);
        assert_eq!(norm_threads_for(4095, true), 256);
        assert_eq!(norm_threads_for(128, true), 256);
        for d in [128, 4096, 5120, 8192] {
            assert_eq!(norm_threads_for(d, false), 256, "d={d}");
        }
    }
}
