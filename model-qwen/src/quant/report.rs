//! [`LoadReport`]: what the loader did to each weight.

use kvstream_memory_contracts::backend::WeightDType;

/// What a load (or [`crate::save_quantized`]) did: how many tensors ended up quantized, which
/// fell back to another format, and where the bytes live.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Tensors placed on the device in a quantized format (converted at load time or loaded
    /// already quantized).
    pub quantized: usize,
    /// Tensors placed on the device in a plain element type (f32/f16/bf16).
    pub kept: usize,
    /// Tensors whose requested format did not fit their K (last dim), with the format they got
    /// instead (q8_0, or the stored dtype when K % 32 != 0).
    pub fallback: Vec<(String, WeightDType)>,
    /// Bytes of every device weight (the embedding table is not on the device).
    pub device_weight_bytes: usize,
    /// Bytes of the embedding table kept in host memory (in its stored dtype).
    pub host_embedding_bytes: usize,
}

impl LoadReport {
    /// Records one device tensor of final dtype `dtype` and `bytes` device bytes.
    pub(crate) fn record(&mut self, dtype: WeightDType, bytes: usize) {
        if dtype.is_quantized() {
            self.quantized += 1;
        } else {
            self.kept += 1;
        }
        self.device_weight_bytes += bytes;
    }
}
