//! Test helpers: a seeded generator of non-zero random data and tensor/weight builders.

use crate::{CpuBackend, CpuTensor, CpuWeight};
use half::{bf16, f16};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::{LinearOps, WeightData};
use kvstream_memory_contracts::weight_format::{dequantize, quantize};

/// A small xorshift generator (deterministic, no dependency).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in [-1, 1).
    pub(crate) fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub(crate) fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next_f32() * scale).collect()
    }
}

pub(crate) fn tensor(data: Vec<f32>, dims: &[usize]) -> CpuTensor {
    CpuTensor::new(data, dims.to_vec())
}

/// A weight of `dtype` from f32 values (rounded or quantized to the dtype); returns it and the
/// values it holds (for quantized dtypes: the contract's `dequantize` of its bytes).
pub(crate) fn weight(
    b: &CpuBackend,
    dtype: WeightDType,
    values: &[f32],
    dims: &[usize],
) -> (CpuWeight, Vec<f32>) {
    let (bytes, held): (Vec<u8>, Vec<f32>) = match dtype {
        WeightDType::F32 => (
            values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            values.to_vec(),
        ),
        WeightDType::Bf16 => (
            values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect(),
        ),
        WeightDType::F16 => (
            values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            values.iter().map(|v| f16::from_f32(*v).to_f32()).collect(),
        ),
        WeightDType::Q8_0 | WeightDType::Q4G128 | WeightDType::F8E4M3 | WeightDType::Q4NlG128 => {
            let bytes = quantize(dtype, values, dims).expect("quantizable test weight");
            let held = dequantize(dtype, &bytes, dims).expect("dequantize");
            (bytes, held)
        }
    };
    let w = b
        .load_weight("test", dtype, dims, WeightData::from_vec(bytes))
        .expect("valid test weight");
    (w, held)
}

pub(crate) fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - y).abs())
        .fold(0.0, f64::max)
}
