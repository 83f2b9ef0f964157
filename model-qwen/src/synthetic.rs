//! Where weights come from: a [`TensorSource`] is either a safetensors [`Checkpoint`] or
//! [`SyntheticWeights`], random values of the right shape generated in host memory and handed
//! straight to the backend (`LinearOps::load_weight` with [`WeightData::from_vec`]): benchmarks
//! with real geometries need no checkpoint on disk.

use crate::embedding::HostEmbedding;
use crate::error::ModelError;
use crate::quant::convert::{convert, convert_into};
use crate::quant::synth::{random_quantized, random_quantized_into};
use crate::weights::{Checkpoint, TensorRef};
use half::{bf16, f16};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::WeightData;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// A provider of named weight tensors (the model loader asks it for every tensor it needs).
pub trait TensorSource {
    /// True when the source holds `name` (used to pick the tensor-name prefix).
    fn contains(&self, name: &str) -> bool;
    /// The tensor `name`, which must have shape `expected`; errors name the tensor.
    fn get(&self, name: &str, expected: &[usize]) -> Result<TensorRef, ModelError>;
    /// The stored dtype of `name` (checked like [`TensorSource::get`]), ideally without
    /// touching its bytes.
    fn stored_dtype(&self, name: &str, expected: &[usize]) -> Result<WeightDType, ModelError> {
        Ok(self.get(name, expected)?.dtype)
    }
    /// The tensor converted to `target` (quantize-at-load; the tensor itself when it is stored
    /// as `target`). Default: [`TensorSource::get`] then a parallel blocked conversion.
    fn get_as(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
    ) -> Result<TensorRef, ModelError> {
        convert(name, self.get(name, expected)?, target)
    }
    /// The tensor converted to `target` and written into `codes` / `scales`, the code and
    /// scale sections of its rows inside a larger blob of `target` (a fused weight: rows of
    /// several tensors concatenated; see `quant::convert::fill_sections`). The bytes equal the
    /// sections of [`TensorSource::get_as`]'s blob. Default: [`TensorSource::get`] (in place
    /// for checkpoints) converted block by block straight into the sections.
    fn get_into(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), ModelError> {
        convert_into(name, &self.get(name, expected)?, target, codes, scales)
    }
    /// The embedding table `name` `[vocab, hidden]` as a host-side table.
    fn host_embedding(&self, name: &str, expected: &[usize]) -> Result<HostEmbedding, ModelError> {
        HostEmbedding::stored(name, self.get(name, expected)?)
    }
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }
    fn get(&self, name: &str, expected: &[usize]) -> Result<TensorRef, ModelError> {
        Checkpoint::get(self, name, expected)
    }
    fn stored_dtype(&self, name: &str, expected: &[usize]) -> Result<WeightDType, ModelError> {
        Checkpoint::stored_dtype(self, name, expected)
    }
    fn get_into(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), ModelError> {
        Checkpoint::get_into(self, name, expected, target, codes, scales)
    }
}

/// How a synthetic tensor is initialised (uniform noise with the centre and spread of its role).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyntheticInit {
    /// Linear weights: U(-a, a) with std 0.02.
    Matrix,
    /// Zero-centred RMSNorm weights: around 0.
    Norm,
    /// GDN gated norm weight: around 1.
    GatedNorm,
    /// Depthwise conv taps.
    Conv,
    /// `dt_bias`: around 1.
    DtBias,
    /// `A_log = ln U(1, 16)`.
    ALog,
}

impl SyntheticInit {
    /// Half-width of the uniform distribution of synthetic matrices (std 0.02).
    pub const MATRIX_AMAX: f32 = 0.0346;

    /// The role of a tensor, from its (HF) name.
    pub fn for_name(name: &str) -> Self {
        if name.ends_with("A_log") {
            Self::ALog
        } else if name.ends_with("dt_bias") {
            Self::DtBias
        } else if name.contains("conv1d") {
            Self::Conv
        } else if name.ends_with("linear_attn.norm.weight") {
            Self::GatedNorm
        } else if name.contains("norm") {
            Self::Norm
        } else {
            Self::Matrix
        }
    }

    /// Fills `out` deterministically from `seed` (parallel over 64 Ki-element chunks, each with
    /// its own seeded generator, so the result does not depend on the thread count).
    pub fn fill(self, out: &mut [f32], seed: u64) {
        const CHUNK: usize = 1 << 16;
        out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(
                seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            for x in c.iter_mut() {
                let u: f32 = rng.random_range(-1.0..1.0);
                *x = match self {
                    Self::Matrix => u * Self::MATRIX_AMAX,
                    Self::Norm => u * 0.17,
                    Self::GatedNorm => 1.0 + u * 0.17,
                    Self::Conv => u * 0.3,
                    Self::DtBias => 1.0 + u * 0.5,
                    Self::ALog => rng.random_range(1.0f32..16.0).ln(),
                };
            }
        });
    }
}

/// Random weights of any requested name and shape, in one stored dtype. Each tensor's values
/// depend only on the seed and the tensor's name.
///
/// A quantized `dtype` stores the tensors as bf16 ([`QwenModel::synthetic`] turns it into a
/// policy instead). Asked for a quantized format ([`TensorSource::get_as`]), matrices are
/// generated directly as random codes + scales of the same value scale, never as floats.
/// The embedding table is never materialised: [`TensorSource::host_embedding`] generates rows
/// on demand.
///
/// [`QwenModel::synthetic`]: crate::QwenModel::synthetic
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticWeights {
    /// Stored dtype of every weight.
    pub dtype: WeightDType,
    /// RNG seed.
    pub seed: u64,
}

/// FNV-1a of a name (a stable per-tensor seed).
pub(crate) fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Encodes f32 values in `dtype` (little endian). Quantized dtypes treat `x` as one row (its
/// length must fit the format's K rule).
pub fn encode_weights(
    dtype: WeightDType,
    x: &[f32],
) -> Result<Vec<u8>, kvstream_memory_contracts::weight_format::WeightFormatError> {
    if dtype.is_quantized() {
        return kvstream_memory_contracts::weight_format::quantize(dtype, x, &[x.len()]);
    }
    let mut out = vec![0u8; x.len() * dtype.size()];
    const CHUNK: usize = 1 << 16;
    let sz = dtype.size();
    out.par_chunks_mut(CHUNK * sz)
        .zip(x.par_chunks(CHUNK))
        .for_each(|(o, v)| {
            for (dst, &val) in o.chunks_exact_mut(sz).zip(v) {
                match dtype {
                    WeightDType::F32 => dst.copy_from_slice(&val.to_le_bytes()),
                    WeightDType::F16 => dst.copy_from_slice(&f16::from_f32(val).to_le_bytes()),
                    _ => dst.copy_from_slice(&bf16::from_f32(val).to_le_bytes()),
                }
            }
        });
    Ok(out)
}

impl SyntheticWeights {
    /// The plain dtype tensors are stored in.
    fn plain(&self) -> WeightDType {
        if self.dtype.is_quantized() {
            WeightDType::Bf16
        } else {
            self.dtype
        }
    }
}

impl TensorSource for SyntheticWeights {
    fn contains(&self, _name: &str) -> bool {
        true
    }
    fn get(&self, name: &str, expected: &[usize]) -> Result<TensorRef, ModelError> {
        let _span = tracing::trace_span!("synthetic_tensor", name).entered();
        let numel: usize = expected.iter().product();
        let mut vals = vec![0f32; numel];
        SyntheticInit::for_name(name).fill(&mut vals, self.seed ^ name_hash(name));
        let dtype = self.plain();
        let bytes = encode_weights(dtype, &vals).map_err(|source| ModelError::WeightFormat {
            name: name.to_string(),
            source,
        })?;
        Ok(TensorRef {
            dtype,
            shape: expected.to_vec(),
            data: WeightData::from_vec(bytes),
        })
    }
    fn stored_dtype(&self, _name: &str, _expected: &[usize]) -> Result<WeightDType, ModelError> {
        Ok(self.plain())
    }
    fn get_as(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
    ) -> Result<TensorRef, ModelError> {
        if target.is_quantized() && SyntheticInit::for_name(name) == SyntheticInit::Matrix {
            let _span = tracing::trace_span!("synthetic_quantized", name, %target).entered();
            let bytes = random_quantized(
                target,
                expected,
                self.seed ^ name_hash(name),
                SyntheticInit::MATRIX_AMAX,
            )
            .map_err(|source| ModelError::WeightFormat {
                name: name.to_string(),
                source,
            })?;
            return Ok(TensorRef {
                dtype: target,
                shape: expected.to_vec(),
                data: WeightData::from_vec(bytes),
            });
        }
        convert(name, self.get(name, expected)?, target)
    }
    fn get_into(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), ModelError> {
        if target.is_quantized() && SyntheticInit::for_name(name) == SyntheticInit::Matrix {
            let k = expected.last().copied().unwrap_or(1);
            return random_quantized_into(
                target,
                k,
                self.seed ^ name_hash(name),
                SyntheticInit::MATRIX_AMAX,
                codes,
                scales,
            )
            .map_err(|source| ModelError::WeightFormat {
                name: name.to_string(),
                source,
            });
        }
        convert_into(name, &self.get(name, expected)?, target, codes, scales)
    }
    fn host_embedding(&self, name: &str, expected: &[usize]) -> Result<HostEmbedding, ModelError> {
        match expected {
            [v, h] => Ok(HostEmbedding::synthetic(
                name,
                *v,
                *h,
                self.seed,
                self.plain(),
            )),
            _ => Err(ModelError::TensorShape {
                name: name.to_string(),
                got: expected.to_vec(),
                expected: vec![0, 0],
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_names() {
        assert_eq!(
            SyntheticInit::for_name("model.layers.0.linear_attn.A_log"),
            SyntheticInit::ALog
        );
        assert_eq!(
            SyntheticInit::for_name("model.layers.0.linear_attn.norm.weight"),
            SyntheticInit::GatedNorm
        );
        assert_eq!(
            SyntheticInit::for_name("model.layers.3.self_attn.q_norm.weight"),
            SyntheticInit::Norm
        );
        assert_eq!(
            SyntheticInit::for_name("model.layers.3.self_attn.q_proj.weight"),
            SyntheticInit::Matrix
        );
    }

    #[test]
    fn synthetic_tensors_are_deterministic_per_name_and_shaped() {
        let s = SyntheticWeights {
            dtype: WeightDType::Bf16,
            seed: 3,
        };
        let a = s.get("x.weight", &[8, 16]).expect("a");
        let b = s.get("x.weight", &[8, 16]).expect("b");
        let c = s.get("y.weight", &[8, 16]).expect("c");
        assert_eq!(a.data.len, 8 * 16 * 2);
        assert_eq!(a.data.bytes(), b.data.bytes());
        assert_ne!(a.data.bytes(), c.data.bytes());
        let vals: Vec<f32> = a
            .data
            .bytes()
            .chunks(2)
            .map(|p| bf16::from_le_bytes([p[0], p[1]]).to_f32())
            .collect();
        assert!(vals.iter().all(|v| v.abs() <= 0.035));
        assert!(vals.iter().filter(|v| **v != 0.0).count() > 100);
        let alog = s.get("l.A_log", &[64]).expect("alog");
        let v: Vec<f32> = alog
            .data
            .bytes()
            .chunks(2)
            .map(|p| bf16::from_le_bytes([p[0], p[1]]).to_f32())
            .collect();
        assert!(v.iter().all(|x| (0.0..=2.8).contains(x)), "{v:?}");
    }
}
