//! Streamed attention on the device: fixed token-index splits, one kernel launch per span, one
//! final combine (see `kernels/src/cu/attention.cu`).

use crate::launch::args;
use crate::ops::kv_code;
use crate::{CudaBackend, CudaBuffer, CudaTensor};
use cudarc::driver::{sys, DeviceRepr, LaunchConfig};
use kvstream_kernels::launch::{ATT_QW, ATT_THREADS, ATT_TILE};
use kvstream_memory_contracts::attention::{AttentionShape, StreamedAttention};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::{AttentionError, CapabilityError, OpError};
use kvstream_memory_contracts::kv::span::SpanPlan;
use kvstream_memory_contracts::ops::TensorOps;

/// Most splits of one evaluation (enough blocks per head at 256 Ki tokens).
pub const MAX_SPLITS: usize = 128;

/// The fixed number of splits of an evaluation over `total` tokens: one per 128-token tile, at
/// most [`MAX_SPLITS`]. Depends on the shape only, never on the span layout.
pub fn n_splits(total: usize) -> usize {
    total.div_ceil(ATT_TILE).clamp(1, MAX_SPLITS)
}

/// Mirrors `struct AttnGeo` in attention.cu (repr(C), same field order and types).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnGeo {
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    width: i32,
    total: i32,
    scale: f32,
    k_type: i32,
    v_type: i32,
    tpp: i32,
    page_bytes: u64,
    k_row_bytes: u64,
    v_row_bytes: u64,
    k_head_bytes: u64,
    v_head_bytes: u64,
    v_plane_off: u64,
}

// SAFETY: plain-old-data with the C layout of the kernel's parameter struct.
unsafe impl DeviceRepr for AttnGeo {}

fn op_err(e: OpError) -> AttentionError {
    match e {
        OpError::Capability(c) => AttentionError::Capability(c),
        OpError::Attention(a) => a,
        OpError::Transfer(t) => AttentionError::Transfer(t),
        other => AttentionError::Transfer(
            kvstream_memory_contracts::error::TransferError::CopyFailed(other.to_string()),
        ),
    }
}

fn cap(detail: String) -> AttentionError {
    AttentionError::Capability(CapabilityError::new("cuda", "streamed_attention", detail))
}

/// Shared-memory bytes of one block for `rows` query rows and a unit of `unit` tokens.
fn smem_bytes(rows: usize, unit: usize, d: usize) -> usize {
    4 * (2 * rows * d + unit * (d + 1) + unit * d + rows * unit + 3 * rows)
}

impl CudaBackend {
    /// The token unit: the largest of 32, 16, 8, 4, 2, 1 dividing the page size whose shared
    /// memory fits; `None` if nothing fits.
    fn attn_unit(&self, shape: &AttentionShape, tpp: usize) -> Option<(usize, usize)> {
        let g = shape.q_heads / shape.kv_heads;
        let rows = g * ATT_QW.min(shape.width);
        [32usize, 16, 8, 4, 2, 1]
            .into_iter()
            .filter(|u| tpp % u == 0)
            .map(|u| (u, smem_bytes(rows, u, shape.head_dim)))
            .find(|&(_, b)| b <= self.max_smem_optin)
    }
}

impl StreamedAttention for CudaBackend {
    fn attn_state_new(&self, shape: &AttentionShape) -> Result<CudaTensor, AttentionError> {
        let s = n_splits(shape.total);
        let row = shape.head_dim + 2;
        let rows = shape.width * shape.q_heads;
        let mut host = vec![0f32; s * rows * row];
        for r in host.chunks_exact_mut(row) {
            r[0] = f32::NEG_INFINITY;
        }
        self.tensor_from_f32(&host, &[s, shape.width, shape.q_heads, row])
            .map_err(op_err)
    }

    fn attn_accumulate_unchecked(
        &self,
        shape: &AttentionShape,
        q: &CudaTensor,
        pool: &CudaBuffer,
        plan: &SpanPlan,
        state: &mut CudaTensor,
    ) -> Result<(), AttentionError> {
        let _span = tracing::trace_span!(
            "attn_accumulate",
            start = plan.start(),
            end = plan.end(),
            spans = plan.spans().len()
        )
        .entered();
        let g = plan.geometry();
        let splits = n_splits(shape.total);
        if state.numel() != splits * shape.state_len() {
            return Err(AttentionError::Shape {
                name: "state",
                got: state.numel(),
                expected: splits * shape.state_len(),
            });
        }
        if shape.total > i32::MAX as usize {
            return Err(cap(format!(
                "{} tokens exceed the kernel's i32 range",
                shape.total
            )));
        }
        let (unit, smem) = self.attn_unit(shape, g.tokens_per_page()).ok_or_else(|| {
            cap(format!(
                "{} query heads per KV head × head_dim {} need more shared memory than the device's {} bytes",
                shape.q_heads / shape.kv_heads,
                shape.head_dim,
                self.max_smem_optin
            ))
        })?;
        let f = self.func("attn_accumulate").map_err(op_err)?;
        // SAFETY: sets a launch attribute of a loaded function; the value fits the device limit.
        let r = unsafe {
            sys::cuFuncSetAttribute(
                f.cu_function(),
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(cap(format!(
                "cannot reserve {smem} bytes of shared memory: {r:?}"
            )));
        }
        let geo = AttnGeo {
            q_heads: shape.q_heads as i32,
            kv_heads: shape.kv_heads as i32,
            head_dim: shape.head_dim as i32,
            width: shape.width as i32,
            total: shape.total as i32,
            scale: shape.scale,
            k_type: kv_code(g.k_type()),
            v_type: kv_code(g.v_type()),
            tpp: g.tokens_per_page() as i32,
            page_bytes: g.page_bytes() as u64,
            k_row_bytes: g.k_row_bytes() as u64,
            v_row_bytes: g.v_row_bytes() as u64,
            k_head_bytes: g.k_head_bytes() as u64,
            v_head_bytes: g.v_head_bytes() as u64,
            v_plane_off: g.v_plane_offset() as u64,
        };
        let cfg = LaunchConfig {
            grid_dim: (
                shape.kv_heads as u32,
                splits as u32,
                shape.width.div_ceil(ATT_QW) as u32,
            ),
            block_dim: (ATT_THREADS as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (qp, pp, sp) = (q.ptr(), pool.ptr(), state.ptr());
        let (ns, u) = (splits as i32, unit as i32);
        for span in plan.spans() {
            let (off, first, count) = (
                span.offset as u64,
                span.first_token as i32,
                span.count as i32,
            );
            let mut a = args![&qp, &pp, &sp, &geo, &off, &first, &count, &ns, &u];
            self.launch("attn_accumulate", f, cfg, &mut a)
                .map_err(op_err)?;
        }
        Ok(())
    }

    fn attn_finish_unchecked(
        &self,
        shape: &AttentionShape,
        state: &CudaTensor,
    ) -> Result<CudaTensor, AttentionError> {
        let splits = n_splits(shape.total);
        if state.numel() != splits * shape.state_len() {
            return Err(AttentionError::Shape {
                name: "state",
                got: state.numel(),
                expected: splits * shape.state_len(),
            });
        }
        let out = self
            .tensor_uninit(&[shape.width, shape.q_heads * shape.head_dim])
            .map_err(op_err)?;
        let f = self.func("attn_finish").map_err(op_err)?;
        let (sp, op, ns, w, h, d) = (
            state.ptr(),
            out.ptr(),
            splits as i32,
            shape.width as i32,
            shape.q_heads as i32,
            shape.head_dim as i32,
        );
        let cfg = LaunchConfig {
            grid_dim: ((shape.width * shape.q_heads) as u32, 1, 1),
            block_dim: (
                shape.head_dim.clamp(32, 256).next_multiple_of(32) as u32,
                1,
                1,
            ),
            shared_mem_bytes: 0,
        };
        let mut a = args![&sp, &op, &ns, &w, &h, &d];
        self.launch("attn_finish", f, cfg, &mut a).map_err(op_err)?;
        Ok(out)
    }
}
