//! [`WeightPolicy`]: which stored format each class of weight gets at load time (quant-spec
//! "Model policy").

use kvstream_memory_contracts::backend::WeightDType;

/// Which weights are converted to which [`WeightDType`] when a model is loaded or saved.
///
/// * `format`: every 2-D linear weight of the decoder layers (attention q/k/v/o, GDN
///   `in_proj_qkv`, `in_proj_z`, `out_proj`, MLP gate/up/down). `None` = as stored.
/// * `head_format`: `lm_head` and the MTP head's linear weights. `None` = the default of
///   [`WeightPolicy::effective_head`].
///
/// Embeddings (kept on the host), norms, GDN `in_proj_a`/`in_proj_b`/`A_log`/`dt_bias`/`conv1d`
/// are always kept as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightPolicy {
    /// Format of the decoder-layer linear weights (`None` = as stored).
    pub format: Option<WeightDType>,
    /// Format of `lm_head` and the MTP linears (`None` = default, see `effective_head`).
    pub head_format: Option<WeightDType>,
}

impl WeightPolicy {
    /// Every tensor as stored in the checkpoint (today's behaviour).
    pub fn as_stored() -> Self {
        Self::default()
    }

    /// Decoder linears in `format`, the head by its default rule.
    pub fn new(format: WeightDType) -> Self {
        Self {
            format: Some(format),
            head_format: None,
        }
    }

    /// Overrides the head format (`--weights-head`).
    pub fn with_head(self, f: WeightDType) -> Self {
        Self {
            head_format: Some(f),
            ..self
        }
    }

    /// The format `lm_head` and the MTP linears get: the explicit `head_format`, else q8_0
    /// when `format` is a 4-bit format, else `None` (as stored).
    pub fn effective_head(&self) -> Option<WeightDType> {
        self.head_format.or(match self.format {
            Some(WeightDType::Q4G128 | WeightDType::Q4NlG128) => Some(WeightDType::Q8_0),
            _ => None,
        })
    }

    /// True when nothing is converted.
    pub fn is_as_stored(&self) -> bool {
        self.format.is_none() && self.effective_head().is_none()
    }
}
