//! The chunked (WY) gated delta rule for long prefills (qwen-spec §3.6 "Chunked form").
//!
//! Two kernels per segment of at most [`GDN_SEGMENT`] tokens: `gdn_chunk_prep` (grid v heads ×
//! chunks, all chunks in parallel) builds each chunk's state-independent pieces — the cumulative
//! log-decay γ, T = (I + A)⁻¹ by forward substitution, W = T(β e^γ K), U = T(βV) and the masked
//! intra-chunk scores M — into head-major scratch; `gdn_chunk_scan` (grid v heads × 32-column
//! groups, the `[k_dim, 32]` state slice in shared memory) walks the chunks in order:
//! V' = U − W S, O = (e^γ Q) S + M V', S = e^{γ_last} S + (e^{γ_last−γ} K)ᵀ V'. Segments bound the
//! scratch (~125 MB for 48 v heads of 128 × 128) and carry the state through `state` itself.

use crate::launch::args;
use crate::{CudaBackend, CudaTensor};
use cudarc::driver::LaunchConfig;
use kvstream_kernels::launch::{GDN_CHUNK, GDN_CHUNK_MAX_K_DIM};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{DeltaMode, DeltaShape};
use std::sync::OnceLock;

/// Environment switch: `KVSTREAM_GDN=recurrent` forces the token recurrence for every call (A/B
/// measurements). `DeltaMode::Recurrent` forces it for one call.
pub const GDN_PATH_ENV: &str = "KVSTREAM_GDN";

/// Fewest tokens for which a `Chunked` call uses the chunked kernels.
pub const GDN_CHUNK_MIN_TOKENS: usize = 64;

/// Most tokens of one segment (scratch bound); rounded down to a multiple of the chunk.
const GDN_SEGMENT: usize = 2048;

fn force_recurrent() -> bool {
    static FORCE: OnceLock<bool> = OnceLock::new();
    *FORCE.get_or_init(|| std::env::var(GDN_PATH_ENV).is_ok_and(|v| v == "recurrent"))
}

/// The chunk size the chunked kernels use for this call, or `None` for the token recurrence.
pub(crate) fn chunk_for(s: &DeltaShape, mode: DeltaMode) -> Option<usize> {
    match mode {
        DeltaMode::Recurrent => None,
        DeltaMode::Chunked { chunk } => (chunk > 0
            && s.tokens >= GDN_CHUNK_MIN_TOKENS
            && s.k_dim <= GDN_CHUNK_MAX_K_DIM
            && !force_recurrent())
        .then(|| chunk.min(GDN_CHUNK)),
    }
}

/// The normalised and gated inputs of one call (`gdn_qk_norm` / `gdn_gates` outputs).
pub(crate) struct Prepared<'a> {
    pub qn: &'a CudaTensor,
    pub kn: &'a CudaTensor,
    pub v: &'a CudaTensor,
    pub beta: &'a CudaTensor,
    pub g: &'a CudaTensor,
}

/// Runs the chunked form over all `s.tokens` tokens with chunks of `chunk` (1..=GDN_CHUNK),
/// updating `state` and writing `out` `[T, v_heads, v_dim]`.
pub(crate) fn run(
    be: &CudaBackend,
    s: &DeltaShape,
    p: &Prepared<'_>,
    state: &mut CudaTensor,
    out: &CudaTensor,
    chunk: usize,
) -> Result<(), OpError> {
    if chunk == 0 || chunk > GDN_CHUNK || s.k_dim > GDN_CHUNK_MAX_K_DIM {
        return Err(OpError::shape(
            "gated_delta_rule",
            format!(
                "chunk {chunk} / k_dim {} outside the chunked kernels' limits",
                s.k_dim
            ),
        ));
    }
    let seg = (GDN_SEGMENT / chunk) * chunk;
    let cap = seg.min(s.tokens);
    let w = be.tensor_uninit(&[s.v_heads, cap, s.k_dim])?;
    let u = be.tensor_uninit(&[s.v_heads, cap, s.v_dim])?;
    let m = be.tensor_uninit(&[s.v_heads, cap, chunk])?;
    let gc = be.tensor_uninit(&[s.v_heads, cap])?;
    let prep = be.func("gdn_chunk_prep")?;
    let scan = be.func("gdn_chunk_scan")?;
    let (qn, kn, vp, bp, gp) = (p.qn.ptr(), p.kn.ptr(), p.v.ptr(), p.beta.ptr(), p.g.ptr());
    let (wp, up, mp, gcp, sp, op) = (w.ptr(), u.ptr(), m.ptr(), gc.ptr(), state.ptr(), out.ptr());
    let (hk, hv, kd, vd, c32) = (
        s.k_heads as i32,
        s.v_heads as i32,
        s.k_dim as i32,
        s.v_dim as i32,
        chunk as i32,
    );
    let mut t0 = 0usize;
    while t0 < s.tokens {
        let tn = seg.min(s.tokens - t0);
        let (t064, tn64) = (t0 as u64, tn as u64);
        let mut a = args![
            &qn, &kn, &vp, &bp, &gp, &wp, &up, &mp, &gcp, &t064, &tn64, &hk, &hv, &kd, &vd, &c32
        ];
        let cfg = LaunchConfig {
            grid_dim: (s.v_heads as u32, tn.div_ceil(chunk) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        be.launch("gdn_chunk_prep", prep, cfg, &mut a)?;
        let mut a =
            args![&qn, &kn, &wp, &up, &mp, &gcp, &sp, &op, &t064, &tn64, &hk, &hv, &kd, &vd, &c32];
        let cfg = LaunchConfig {
            grid_dim: (s.v_heads as u32, s.v_dim.div_ceil(32) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        be.launch("gdn_chunk_scan", scan, cfg, &mut a)?;
        t0 += tn;
    }
    Ok(())
}
