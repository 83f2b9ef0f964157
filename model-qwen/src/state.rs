//! Per-sequence recurrent (Gated DeltaNet) state: conv and SSM state of every GDN layer.

use crate::error::ModelError;
use kvstream_memory_contracts::backend::{Backend, DeviceTensor};
use kvstream_memory_contracts::ops::TensorOps;

/// One GDN layer's state.
#[derive(Debug)]
pub struct GdnState<B: Backend> {
    /// `[K-1, conv_dim]` pre-conv inputs, oldest row first.
    pub conv: B::Tensor,
    /// `[v_heads, k_dim, v_dim]` f32 recurrent state.
    pub ssm: B::Tensor,
}

/// The recurrent state of every GDN layer, in layer order.
#[derive(Debug)]
pub struct RecurrentState<B: Backend> {
    pub layers: Vec<GdnState<B>>,
}

impl<B: Backend + TensorOps> RecurrentState<B> {
    /// A deep copy (speculative checkpoints).
    pub fn checkpoint(&self, b: &B) -> Result<Self, ModelError> {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(GdnState {
                    conv: b.copy_tensor(&l.conv)?,
                    ssm: b.copy_tensor(&l.ssm)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        Ok(Self { layers })
    }

    /// Overwrites this state with `other` (same shapes).
    pub fn restore_from(&mut self, b: &B, other: &Self) -> Result<(), ModelError> {
        if self.layers.len() != other.layers.len() {
            return Err(ModelError::Input(format!(
                "restore_from: {} GDN layers vs {}",
                self.layers.len(),
                other.layers.len()
            )));
        }
        for (d, s) in self.layers.iter_mut().zip(&other.layers) {
            b.copy_into(&mut d.conv, &s.conv)?;
            b.copy_into(&mut d.ssm, &s.ssm)?;
        }
        Ok(())
    }
}

impl<B: Backend> RecurrentState<B> {
    /// Device bytes held (f32 tensors).
    pub fn device_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.conv.numel() + l.ssm.numel()) * 4)
            .sum()
    }
}
