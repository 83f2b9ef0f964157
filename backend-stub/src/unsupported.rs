//! Every streaming and compute contract, implemented as a typed refusal.
//!
//! Constructors of stub tensors, weights, fences and registrations return a
//! [`CapabilityError`](kvstream_memory_contracts::CapabilityError) (wrapped in the trait's own
//! error enum through its `Capability` variant). Methods that receive one of those uninhabited
//! values are `match *x {}`: the compiler proves them unreachable, so there is no fallback path.
//! The operation named in each error is the trait method's name, except `attn_state_new`, which
//! reports `streamed_attention` like the contracts' own capability check in `attention_begin`.

use crate::backend::{unsupported, StubBackend};
use crate::never::{StubFence, StubHostRegistration, StubTensor, StubWeight};
use crate::StubBuffer;
use kvstream_memory_contracts::attention::{AttentionShape, StreamedAttention};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::{AttentionError, HostError, OpError, TransferError};
use kvstream_memory_contracts::host::{HostBytes, HostRange, PinnedHost};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::SpanPlan;
use kvstream_memory_contracts::ops::{
    ActivationOps, DeltaMode, DeltaShape, Gelu, KvOps, LinearOps, NormOps, Position3, PositionOps,
    RecurrentOps, RopeConfig, SamplingOps, TensorOps, VisionAttentionShape, VisionOps, WeightData,
};
use kvstream_memory_contracts::transfer::CopyEngine;
use std::sync::Arc;

/// Why pinned-host registration is missing.
pub const WHY_PINNED: &str =
    "the wgpu stub cannot page-lock host memory (WebGPU exposes no host-registration API)";
/// Why the copy engine and fences are missing.
pub const WHY_COPY: &str =
    "the wgpu stub has no asynchronous copy engine and no ready/consumed/producer fences";
/// Why streamed attention is missing.
pub const WHY_ATTENTION: &str = "the wgpu stub has no streamed-attention kernels";
/// Why compute ops are missing.
pub const WHY_OPS: &str = "the wgpu stub has no compute kernels (no WGSL shaders yet)";

fn op(operation: &'static str) -> OpError {
    OpError::Capability(unsupported(operation, WHY_OPS))
}

impl PinnedHost for StubBackend {
    /// Always a capability error (operation `register_host`).
    fn register_host(&self, _bytes: &Arc<HostBytes>) -> Result<StubHostRegistration, HostError> {
        Err(HostError::Capability(unsupported(
            "register_host",
            WHY_PINNED,
        )))
    }
}

impl CopyEngine for StubBackend {
    /// Always a capability error (operation `copy_h2d`).
    fn copy_h2d(
        &self,
        _src: &HostRange,
        _dst: &StubBuffer,
        _dst_offset: usize,
        _wait_for: &[StubFence],
    ) -> Result<StubFence, TransferError> {
        Err(TransferError::Capability(unsupported("copy_h2d", WHY_COPY)))
    }

    /// Always a capability error (operation `copy_d2h`).
    fn copy_d2h(
        &self,
        _src: &StubBuffer,
        _src_offset: usize,
        _dst: &HostRange,
        _wait_for: &[StubFence],
    ) -> Result<StubFence, TransferError> {
        Err(TransferError::Capability(unsupported("copy_d2h", WHY_COPY)))
    }

    /// Always a capability error (operation `record_compute_fence`).
    fn record_compute_fence(&self) -> Result<StubFence, TransferError> {
        Err(TransferError::Capability(unsupported(
            "record_compute_fence",
            WHY_COPY,
        )))
    }

    fn compute_wait(&self, fence: &StubFence) -> Result<(), TransferError> {
        match *fence {}
    }

    fn host_wait(&self, fence: &StubFence) -> Result<(), TransferError> {
        match *fence {}
    }
}

impl StreamedAttention for StubBackend {
    /// Always a capability error (operation `streamed_attention`).
    fn attn_state_new(&self, _shape: &AttentionShape) -> Result<StubTensor, AttentionError> {
        Err(AttentionError::Capability(unsupported(
            "streamed_attention",
            WHY_ATTENTION,
        )))
    }

    fn attn_accumulate_unchecked(
        &self,
        _shape: &AttentionShape,
        q: &StubTensor,
        _pool: &StubBuffer,
        _plan: &SpanPlan,
        _state: &mut StubTensor,
    ) -> Result<(), AttentionError> {
        match *q {}
    }

    fn attn_finish_unchecked(
        &self,
        _shape: &AttentionShape,
        state: &StubTensor,
    ) -> Result<StubTensor, AttentionError> {
        match *state {}
    }
}

impl KvOps for StubBackend {
    fn kv_write(
        &self,
        k: &StubTensor,
        _v: &StubTensor,
        _geometry: &PageGeometry,
        _pool: &StubBuffer,
        _rows: &[(usize, usize)],
    ) -> Result<(), OpError> {
        // Unreachable: KV rows come from tensors, and the stub cannot make one.
        match *k {}
    }
}

impl TensorOps for StubBackend {
    /// Always a capability error (operation `tensor_from_f32`).
    fn tensor_from_f32(&self, _data: &[f32], _dims: &[usize]) -> Result<StubTensor, OpError> {
        Err(op("tensor_from_f32"))
    }
    fn tensor_to_f32(&self, t: &StubTensor) -> Result<Vec<f32>, OpError> {
        match *t {}
    }
    /// Always a capability error (operation `zeros`).
    fn zeros(&self, _dims: &[usize]) -> Result<StubTensor, OpError> {
        Err(op("zeros"))
    }
    fn copy_tensor(&self, src: &StubTensor) -> Result<StubTensor, OpError> {
        match *src {}
    }
    fn copy_into(&self, _dst: &mut StubTensor, src: &StubTensor) -> Result<(), OpError> {
        match *src {}
    }
    fn reshape(&self, t: StubTensor, _dims: &[usize]) -> Result<StubTensor, OpError> {
        match t {}
    }
    fn add(&self, a: &StubTensor, _b: &StubTensor) -> Result<StubTensor, OpError> {
        match *a {}
    }
    fn concat_cols(&self, a: &StubTensor, _b: &StubTensor) -> Result<StubTensor, OpError> {
        match *a {}
    }
    fn split_cols(
        &self,
        x: &StubTensor,
        _groups: usize,
        _sizes: &[usize],
    ) -> Result<Vec<StubTensor>, OpError> {
        match *x {}
    }
    fn rows(&self, x: &StubTensor, _first: usize, _n: usize) -> Result<StubTensor, OpError> {
        match *x {}
    }
}

impl LinearOps for StubBackend {
    /// Always a capability error (operation `load_weight`).
    fn load_weight(
        &self,
        _name: &str,
        _dtype: WeightDType,
        _dims: &[usize],
        _data: WeightData,
    ) -> Result<StubWeight, OpError> {
        Err(op("load_weight"))
    }
    fn embedding(&self, table: &StubWeight, _ids: &[u32]) -> Result<StubTensor, OpError> {
        match *table {}
    }
    fn matmul(&self, x: &StubTensor, _w: &StubWeight) -> Result<StubTensor, OpError> {
        match *x {}
    }
}

impl NormOps for StubBackend {
    fn rms_norm(
        &self,
        x: &StubTensor,
        _w: &StubWeight,
        _eps: f32,
        _unit_offset: f32,
    ) -> Result<StubTensor, OpError> {
        match *x {}
    }
    fn gated_rms_norm(
        &self,
        x: &StubTensor,
        _z: &StubTensor,
        _w: &StubWeight,
        _eps: f32,
    ) -> Result<StubTensor, OpError> {
        match *x {}
    }
}

impl PositionOps for StubBackend {
    fn rope(
        &self,
        x: &StubTensor,
        _heads: usize,
        _head_dim: usize,
        _positions: &[Position3],
        _cfg: &RopeConfig,
    ) -> Result<StubTensor, OpError> {
        match *x {}
    }
}

impl RecurrentOps for StubBackend {
    fn causal_conv1d(
        &self,
        x: &StubTensor,
        _w: &StubWeight,
        _state: &mut StubTensor,
    ) -> Result<StubTensor, OpError> {
        match *x {}
    }
    fn gated_delta_rule(
        &self,
        _shape: &DeltaShape,
        q: &StubTensor,
        _k: &StubTensor,
        _v: &StubTensor,
        _a: &StubTensor,
        _b: &StubTensor,
        _a_log: &StubWeight,
        _dt_bias: &StubWeight,
        _state: &mut StubTensor,
        _mode: DeltaMode,
    ) -> Result<StubTensor, OpError> {
        match *q {}
    }
}

impl ActivationOps for StubBackend {
    fn swiglu(&self, gate: &StubTensor, _up: &StubTensor) -> Result<StubTensor, OpError> {
        match *gate {}
    }
    fn sigmoid_gate(&self, x: &StubTensor, _gate: &StubTensor) -> Result<StubTensor, OpError> {
        match *x {}
    }
}

impl SamplingOps for StubBackend {
    fn argmax_rows(&self, logits: &StubTensor) -> Result<Vec<u32>, OpError> {
        match *logits {}
    }
}

impl VisionOps for StubBackend {
    fn add_bias(&self, x: &StubTensor, _b: &StubWeight) -> Result<StubTensor, OpError> {
        match *x {}
    }
    fn layer_norm(
        &self,
        x: &StubTensor,
        _w: &StubWeight,
        _b: &StubWeight,
        _eps: f32,
    ) -> Result<StubTensor, OpError> {
        match *x {}
    }
    fn gelu(&self, x: &StubTensor, _kind: Gelu) -> Result<StubTensor, OpError> {
        match *x {}
    }
    fn vision_attention(
        &self,
        qkv: &StubTensor,
        _cos: &StubTensor,
        _sin: &StubTensor,
        _shape: &VisionAttentionShape,
    ) -> Result<StubTensor, OpError> {
        match *qkv {}
    }
}
