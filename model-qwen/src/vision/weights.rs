//! Reads the `model.visual.*` tensors of a checkpoint directory (single file or sharded) as f32,
//! through the same memory-mapped [`Checkpoint`] the text model uses (opened with the vision
//! tower included); only the tensors the tower asks for are converted.

use crate::error::ModelError;
use crate::weights::Checkpoint;
use kvstream_memory_contracts::weight_format::dequantize;

/// The `model.visual.*` tensors of a checkpoint directory.
pub(crate) struct VisualTensors {
    ck: Checkpoint,
}

impl VisualTensors {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`.
    pub(crate) fn open(dir: &std::path::Path) -> Result<Self, ModelError> {
        Ok(Self {
            ck: Checkpoint::open_including_vision(dir)?,
        })
    }

    /// Tensor `name` (shape must be `expected`) converted to f32 (from F32, F16, BF16, or a
    /// kvstream weight format).
    pub(crate) fn f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.ck.get(name, expected)?;
        dequantize(t.dtype, t.data.bytes(), &t.shape).map_err(|source| ModelError::WeightFormat {
            name: name.to_string(),
            source,
        })
    }
}
