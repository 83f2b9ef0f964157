//! The compute ops on the device (every trait of `memory_contracts::ops`).
//!
//! * [`tensor`]: `TensorOps`.  * [`linear`]: `LinearOps` (GEMV for ≤ 8 rows, tiled GEMM above).
//! * [`pointwise`]: `NormOps`, `PositionOps`, `ActivationOps`, `SamplingOps`.
//! * [`recurrent`]: `RecurrentOps` (long prefills through [`gdn_chunk`]).  * [`kv`]: `KvOps`.
//! * [`vision`]: `VisionOps` (the ViT tower's bias, LayerNorm, GELU and attention).

mod gdn_chunk;
pub use gdn_chunk::{GDN_CHUNK_MIN_TOKENS, GDN_PATH_ENV};
mod kv;
pub(crate) use kv::kv_code;
pub(crate) mod linear;
mod pointwise;
mod prefetch;
pub(crate) use prefetch::L2Prefetch;
pub use prefetch::L2_PREFETCH_ENV;
mod recurrent;
pub(crate) use recurrent::gdn_fused_from_env;
pub use recurrent::GDN_FUSED_ENV;
mod tensor;
mod vision;

use crate::CudaTensor;
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;

/// Checks that two tensors have the same number of elements.
pub(crate) fn same_len(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<(), OpError> {
    if a.numel() != b.numel() {
        return Err(OpError::shape(
            op,
            format!(
                "element counts differ: {:?} ({}) vs {:?} ({})",
                a.dims,
                a.numel(),
                b.dims,
                b.numel()
            ),
        ));
    }
    Ok(())
}

/// The last dimension of a tensor (1 for scalars).
pub(crate) fn last_dim(t: &CudaTensor) -> usize {
    t.dims.last().copied().unwrap_or(1)
}
