//! Where weights come from: a [`TensorSource`] is either a safetensors [`Checkpoint`] or
//! [`SyntheticWeights`], random values of the right shape generated in host memory and handed
//! straight to the backend (`LinearOps::load_weight` with [`WeightData::from_vec`]): benchmarks
//! with real geometries need no checkpoint on disk.

use crate::error::ModelError;
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
}

impl TensorSource for Checkpoint {
    fn contains(&self, name: &str) -> bool {
        Checkpoint::contains(self, name)
    }
    fn get(&self, name: &str, expected: &[usize]) -> Result<TensorRef, ModelError> {
        Checkpoint::get(self, name, expected)
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
                    Self::Matrix => u * 0.0346, // std 0.02
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyntheticWeights {
    /// Stored dtype of every weight.
    pub dtype: WeightDType,
    /// RNG seed.
    pub seed: u64,
}

/// FNV-1a of a name (a stable per-tensor seed).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Encodes f32 values in `dtype` (little endian).
pub fn encode_weights(dtype: WeightDType, x: &[f32]) -> Vec<u8> {
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
                    WeightDType::Bf16 => dst.copy_from_slice(&bf16::from_f32(val).to_le_bytes()),
                }
            }
        });
    out
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
        Ok(TensorRef {
            dtype: self.dtype,
            shape: expected.to_vec(),
            data: WeightData::from_vec(encode_weights(self.dtype, &vals)),
        })
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
