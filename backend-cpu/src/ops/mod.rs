//! The CPU compute ops: every trait of `memory_contracts::ops` except `KvOps`, multithreaded with
//! rayon, reading bf16/f16/f32 weights in place (no upcast copy of the model).
//!
//! * [`weights`]: zero-copy typed views of weight bytes and bf16/f16 → f32 row decoding.
//! * [`tensor`]: `TensorOps` (creation, copies, reshapes, splits).
//! * [`linear`]: `LinearOps` (weights, embedding, the GEMV/GEMM `matmul`).
//! * [`norm`]: `NormOps`.  * [`rope`]: `PositionOps`.  * [`recurrent`]: `RecurrentOps`.
//! * [`activation`]: `ActivationOps` and `SamplingOps`.
//! * [`vision`]: `VisionOps` (bias, LayerNorm, GELU, the ViT attention).

pub(crate) mod activation;
pub(crate) mod linear;
pub(crate) mod norm;
pub(crate) mod recurrent;
pub(crate) mod rope;
pub(crate) mod tensor;
pub(crate) mod vision;
pub mod weights;

#[cfg(test)]
pub(crate) mod testutil;

use crate::CpuTensor;
use kvstream_memory_contracts::error::OpError;

/// Checks that two tensors have the same number of elements.
pub(crate) fn same_len(op: &'static str, a: &CpuTensor, b: &CpuTensor) -> Result<(), OpError> {
    if a.data.len() != b.data.len() {
        return Err(OpError::shape(
            op,
            format!(
                "element counts differ: {:?} ({}) vs {:?} ({})",
                a.dims,
                a.data.len(),
                b.dims,
                b.data.len()
            ),
        ));
    }
    Ok(())
}

/// `silu(x) = x · sigmoid(x)` in f32, as torch computes it (`x / (1 + exp(-x))`).
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `sigmoid(x)` in f32.
#[inline]
pub(crate) fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's `softplus` (beta 1, threshold 20): `x` when `x > 20`, else `log1p(exp(x))`.
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}
