//! `RecurrentOps`: causal conv1d with state and the gated delta rule (f32 state).
//!
//! `gated_delta_rule` normalises q/k (`gdn_qk_norm`) and computes β and g (`gdn_gates`), then runs
//! either the token recurrence (`gdn_recurrent`: `DeltaMode::Recurrent`, short calls, k_dim > 128,
//! or `KVSTREAM_GDN=recurrent`) or, for `DeltaMode::Chunked` calls of at least
//! [`GDN_CHUNK_MIN_TOKENS`](super::gdn_chunk::GDN_CHUNK_MIN_TOKENS) tokens, the chunked WY form of
//! [`super::gdn_chunk`] (chunks of min(chunk, 64) tokens). The two are equal in exact arithmetic.
//! The token recurrence runs as ONE launch (`gdn_recurrent_fused`: norms and gates inside, the
//! same arithmetic, bit-identical) unless `KVSTREAM_GDN_FUSED=0`.

use super::gdn_chunk::{self, Prepared};
use crate::launch::{args, grid1d};
use crate::types::elementwise_dtype_code;
use crate::{CudaBackend, CudaTensor, CudaWeight};
use cudarc::driver::LaunchConfig;
use kvstream_kernels::launch::{CONV_MAX_K, GDN_MAX_K_DIM};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{DeltaMode, DeltaShape, RecurrentOps};

fn expect_len(op: &'static str, name: &str, t: &CudaTensor, n: usize) -> Result<(), OpError> {
    if t.numel() != n {
        return Err(OpError::shape(
            op,
            format!(
                "{name} {:?} has {} elements, expected {n}",
                t.dims,
                t.numel()
            ),
        ));
    }
    Ok(())
}

impl RecurrentOps for CudaBackend {
    fn causal_conv1d(
        &self,
        x: &CudaTensor,
        w: &CudaWeight,
        state: &mut CudaTensor,
    ) -> Result<CudaTensor, OpError> {
        if w.dims.len() != 3 || w.dims[1] != 1 {
            return Err(OpError::shape(
                "causal_conv1d",
                format!("weight {:?} is not [C, 1, K]", w.dims),
            ));
        }
        let (c, k) = (w.dims[0], w.dims[2]);
        if k == 0 || k > CONV_MAX_K {
            return Err(OpError::shape(
                "causal_conv1d",
                format!("kernel length {k} is not in 1..={CONV_MAX_K}"),
            ));
        }
        if c == 0 || x.numel() % c != 0 {
            return Err(OpError::shape(
                "causal_conv1d",
                format!("x {:?} is not [T, {c}]", x.dims),
            ));
        }
        expect_len("causal_conv1d", "state", state, (k - 1) * c)?;
        let t = x.numel() / c;
        let out = self.tensor_uninit(&x.dims)?;
        if t == 0 {
            return Ok(out);
        }
        let f = self.func("causal_conv1d_f32")?;
        let (xp, wp, dt, sp, yp, t64, c64, k32) = (
            x.ptr(),
            w.ptr(),
            elementwise_dtype_code("causal_conv1d", w.dtype)?,
            state.ptr(),
            out.ptr(),
            t as u64,
            c as u64,
            k as i32,
        );
        let mut a = args![&xp, &wp, &dt, &sp, &yp, &t64, &c64, &k32];
        let cfg = LaunchConfig {
            grid_dim: (c.div_ceil(128) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("causal_conv1d", f, cfg, &mut a)?;
        Ok(out)
    }

    fn gated_delta_rule(
        &self,
        shape: &DeltaShape,
        q: &CudaTensor,
        k: &CudaTensor,
        v: &CudaTensor,
        a: &CudaTensor,
        b: &CudaTensor,
        a_log: &CudaWeight,
        dt_bias: &CudaWeight,
        state: &mut CudaTensor,
        mode: DeltaMode,
    ) -> Result<CudaTensor, OpError> {
        let op = "gated_delta_rule";
        let s = *shape;
        let _span = tracing::trace_span!("gated_delta_rule", t = s.tokens, ?mode).entered();
        if s.k_heads == 0 || s.v_heads % s.k_heads != 0 {
            return Err(OpError::shape(
                op,
                format!(
                    "v_heads {} is not a multiple of k_heads {}",
                    s.v_heads, s.k_heads
                ),
            ));
        }
        if s.k_dim == 0 || s.k_dim > GDN_MAX_K_DIM || s.v_dim == 0 {
            return Err(OpError::shape(
                op,
                format!(
                    "k_dim {} must be in 1..={GDN_MAX_K_DIM}, v_dim {} > 0",
                    s.k_dim, s.v_dim
                ),
            ));
        }
        if let DeltaMode::Chunked { chunk: 0 } = mode {
            return Err(OpError::shape(op, "chunk size 0"));
        }
        expect_len(op, "q", q, s.tokens * s.k_heads * s.k_dim)?;
        expect_len(op, "k", k, s.tokens * s.k_heads * s.k_dim)?;
        expect_len(op, "v", v, s.tokens * s.v_heads * s.v_dim)?;
        expect_len(op, "a", a, s.tokens * s.v_heads)?;
        expect_len(op, "b", b, s.tokens * s.v_heads)?;
        expect_len(op, "state", state, s.v_heads * s.k_dim * s.v_dim)?;
        if a_log.numel() != s.v_heads || dt_bias.numel() != s.v_heads {
            return Err(OpError::shape(
                op,
                "a_log and dt_bias must have v_heads values",
            ));
        }
        let out = self.tensor_uninit(&[s.tokens, s.v_heads, s.v_dim])?;
        if s.tokens == 0 {
            return Ok(out);
        }
        let chunk = gdn_chunk::chunk_for(&s, mode);
        if chunk.is_none() && self.gdn_fused() {
            let raw = RawDeltaInputs {
                q,
                k,
                v,
                a,
                b,
                a_log,
                dt_bias,
            };
            self.gdn_recurrent_fused(&s, &raw, state, &out)?;
            return Ok(out);
        }
        let rows = s.tokens * s.k_heads;
        let qn = self.tensor_uninit(&[rows, s.k_dim])?;
        let kn = self.tensor_uninit(&[rows, s.k_dim])?;
        let beta = self.tensor_uninit(&[s.tokens, s.v_heads])?;
        let g = self.tensor_uninit(&[s.tokens, s.v_heads])?;
        {
            let f = self.func("gdn_qk_norm")?;
            let (qp, kp, qnp, knp, r64, kd) = (
                q.ptr(),
                k.ptr(),
                qn.ptr(),
                kn.ptr(),
                rows as u64,
                s.k_dim as i32,
            );
            let mut ar = args![&qp, &kp, &qnp, &knp, &r64, &kd];
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("gdn_qk_norm", f, cfg, &mut ar)?;
        }
        {
            let f = self.func("gdn_gates")?;
            let (ap, bp, alp, dbp, dta, dtb, betap, gp, t64, hv) = (
                a.ptr(),
                b.ptr(),
                a_log.ptr(),
                dt_bias.ptr(),
                elementwise_dtype_code("gated_delta_rule", a_log.dtype)?,
                elementwise_dtype_code("gated_delta_rule", dt_bias.dtype)?,
                beta.ptr(),
                g.ptr(),
                s.tokens as u64,
                s.v_heads as i32,
            );
            let mut ar = args![&ap, &bp, &alp, &dbp, &dta, &dtb, &betap, &gp, &t64, &hv];
            self.launch("gdn_gates", f, grid1d(s.tokens * s.v_heads, 256), &mut ar)?;
        }
        if let Some(chunk) = chunk {
            let p = Prepared {
                qn: &qn,
                kn: &kn,
                v,
                beta: &beta,
                g: &g,
            };
            gdn_chunk::run(self, &s, &p, state, &out, chunk)?;
        } else {
            let f = self.func("gdn_recurrent")?;
            let (qnp, knp, vp, betap, gp, sp, op_, t64, hk, hv, kd, vd) = (
                qn.ptr(),
                kn.ptr(),
                v.ptr(),
                beta.ptr(),
                g.ptr(),
                state.ptr(),
                out.ptr(),
                s.tokens as u64,
                s.k_heads as i32,
                s.v_heads as i32,
                s.k_dim as i32,
                s.v_dim as i32,
            );
            let mut ar = args![&qnp, &knp, &vp, &betap, &gp, &sp, &op_, &t64, &hk, &hv, &kd, &vd];
            self.launch("gdn_recurrent", f, recurrent_cfg(&s), &mut ar)?;
        }
        Ok(out)
    }
}

/// The inputs of `gated_delta_rule` before the q/k norms and gates (what the fused kernel reads).
#[derive(Clone, Copy)]
struct RawDeltaInputs<'a> {
    q: &'a CudaTensor,
    k: &'a CudaTensor,
    v: &'a CudaTensor,
    a: &'a CudaTensor,
    b: &'a CudaTensor,
    a_log: &'a CudaWeight,
    dt_bias: &'a CudaWeight,
}

/// Environment switch for the fused decode recurrence (`0`: the three launches qk-norm, gates,
/// recurrence; for A/B runs). Default on.
pub const GDN_FUSED_ENV: &str = "KVSTREAM_GDN_FUSED";

/// Whether the environment leaves the fused decode recurrence on (unset: on).
pub(crate) fn gdn_fused_from_env() -> bool {
    std::env::var(GDN_FUSED_ENV).map_or(true, |v| v.trim() != "0")
}

/// Grid of the recurrence kernels: one block of 8 warps per (v head, 32 value columns).
fn recurrent_cfg(s: &DeltaShape) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (s.v_heads as u32, s.v_dim.div_ceil(32) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// Chooses the decode recurrence: one fused launch (default) or qk-norm, gates and
    /// recurrence as three (overrides `KVSTREAM_GDN_FUSED`; results are bit-identical).
    pub fn set_gdn_fused(&self, on: bool) {
        self.gdn_fused
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// The decode recurrence switch now ([`Self::set_gdn_fused`]).
    pub fn gdn_fused(&self) -> bool {
        self.gdn_fused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The per-token recurrence with the q/k L2 norms and the gates done in the same launch
    /// (`gdn_recurrent_fused`); shapes already checked by `gated_delta_rule`.
    fn gdn_recurrent_fused(
        &self,
        s: &DeltaShape,
        raw: &RawDeltaInputs<'_>,
        state: &mut CudaTensor,
        out: &CudaTensor,
    ) -> Result<(), OpError> {
        let RawDeltaInputs {
            q,
            k,
            v,
            a,
            b,
            a_log,
            dt_bias,
        } = *raw;
        let f = self.func("gdn_recurrent_fused")?;
        let (qp, kp, vp, bp, ap, alp, dbp) = (
            q.ptr(),
            k.ptr(),
            v.ptr(),
            b.ptr(),
            a.ptr(),
            a_log.ptr(),
            dt_bias.ptr(),
        );
        let dta = elementwise_dtype_code("gated_delta_rule", a_log.dtype)?;
        let dtb = elementwise_dtype_code("gated_delta_rule", dt_bias.dtype)?;
        let (sp, op_, t64, hk, hv, kd, vd) = (
            state.ptr(),
            out.ptr(),
            s.tokens as u64,
            s.k_heads as i32,
            s.v_heads as i32,
            s.k_dim as i32,
            s.v_dim as i32,
        );
        let mut ar = args![
            &qp, &kp, &vp, &bp, &ap, &alp, &dbp, &dta, &dtb, &sp, &op_, &t64, &hk, &hv, &kd, &vd
        ];
        self.launch("gdn_recurrent", f, recurrent_cfg(s), &mut ar)
    }
}
