//! [`HostEmbedding`]: the token-embedding table kept in HOST memory (issue 10). The device never
//! holds the `vocab × hidden` table: each forward gathers its rows on the host, in the stored
//! dtype (mmap'd checkpoint bytes, or rows generated on demand for synthetic models), decodes
//! them to f32 exactly as the backends' `embedding` op would, and uploads `[T, H]` with
//! `tensor_from_f32`.

use crate::error::ModelError;
use crate::quant::convert::decode_rows;
use crate::synthetic::{name_hash, SyntheticInit};
use crate::weights::TensorRef;
use half::{bf16, f16};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::weight_format::quant_layout;
use rand::{Rng, SeedableRng};

/// Where the rows come from.
#[derive(Debug, Clone)]
enum Rows {
    /// A checkpoint tensor (zero-copy mmap) or owned bytes.
    Stored(TensorRef),
    /// Synthetic rows: row r is generated from `seed` and r alone.
    Synthetic { seed: u64, dtype: WeightDType },
}

/// The embedding table `[vocab, hidden]`, on the host.
#[derive(Debug, Clone)]
pub struct HostEmbedding {
    name: String,
    vocab: usize,
    hidden: usize,
    rows: Rows,
}

impl HostEmbedding {
    /// A table over a stored tensor of shape `[vocab, hidden]` (any weight dtype).
    pub(crate) fn stored(name: &str, t: TensorRef) -> Result<Self, ModelError> {
        let [vocab, hidden] = t.shape[..] else {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: t.shape.clone(),
                expected: vec![0, 0],
            });
        };
        let layout =
            quant_layout(t.dtype, &t.shape).map_err(|source| ModelError::WeightFormat {
                name: name.to_string(),
                source,
            })?;
        if layout.total != t.data.len {
            return Err(ModelError::Input(format!(
                "embedding `{name}`: {} bytes, expected {}",
                t.data.len, layout.total
            )));
        }
        Ok(Self {
            name: name.to_string(),
            vocab,
            hidden,
            rows: Rows::Stored(t),
        })
    }

    /// Synthetic rows of `dtype` (values depend only on `seed`, the name and the row).
    pub(crate) fn synthetic(
        name: &str,
        vocab: usize,
        hidden: usize,
        seed: u64,
        dtype: WeightDType,
    ) -> Self {
        Self {
            name: name.to_string(),
            vocab,
            hidden,
            rows: Rows::Synthetic {
                seed: seed ^ name_hash(name),
                dtype,
            },
        }
    }

    /// Bytes the table occupies on the host (its stored size; synthetic rows are generated on
    /// demand and counted at their dtype's size as if stored).
    pub fn host_bytes(&self) -> usize {
        match &self.rows {
            Rows::Stored(t) => t.data.len,
            Rows::Synthetic { dtype, .. } => dtype
                .storage_bytes(&[self.vocab, self.hidden])
                .unwrap_or(self.vocab * self.hidden * dtype.size()),
        }
    }

    /// `[ids.len() · hidden]` f32 values: the rows of `ids` (each `< vocab`).
    pub fn gather(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let _s = tracing::trace_span!("host_embedding", n = ids.len()).entered();
        let h = self.hidden;
        let mut out = vec![0f32; ids.len() * h];
        for (row, &id) in out.chunks_exact_mut(h).zip(ids) {
            let id = id as usize;
            if id >= self.vocab {
                return Err(ModelError::TokenOutOfRange {
                    token: id as u32,
                    index: 0,
                    vocab: self.vocab,
                });
            }
            match &self.rows {
                Rows::Stored(t) => decode_rows(t.dtype, t.data.bytes(), &t.shape, id, row)
                    .map_err(|source| ModelError::WeightFormat {
                        name: self.name.clone(),
                        source,
                    })?,
                Rows::Synthetic { seed, dtype } => synthetic_row(*seed, *dtype, id, row),
            }
        }
        Ok(out)
    }
}

/// Row `r` of a synthetic matrix: U(-a, a) with std 0.02, rounded through `dtype`.
fn synthetic_row(seed: u64, dtype: WeightDType, r: usize, out: &mut [f32]) {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(
        seed ^ (r as u64 + 1).wrapping_mul(0xD1B5_4A32_D192_ED03),
    );
    let a = SyntheticInit::MATRIX_AMAX;
    for x in out.iter_mut() {
        let v = rng.random_range(-1.0f32..1.0) * a;
        *x = match dtype {
            WeightDType::F16 => f16::from_f32(v).to_f32(),
            WeightDType::F32 => v,
            _ => bf16::from_f32(v).to_f32(),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::ops::WeightData;

    #[test]
    fn gathers_stored_rows_exactly_and_synthetic_rows_deterministically() {
        let (v, h) = (10usize, 6usize);
        let vals: Vec<f32> = (0..v * h).map(|i| i as f32 * 0.37 - 3.0).collect();
        let bytes: Vec<u8> = vals
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
            .collect();
        let t = TensorRef {
            dtype: WeightDType::Bf16,
            shape: vec![v, h],
            data: WeightData::from_vec(bytes),
        };
        let e = HostEmbedding::stored("e", t).expect("table");
        assert_eq!(e.host_bytes(), v * h * 2);
        let got = e.gather(&[7, 2, 7]).expect("gather");
        for (i, id) in [7usize, 2, 7].iter().enumerate() {
            for j in 0..h {
                let want = bf16::from_f32(vals[id * h + j]).to_f32();
                assert_eq!(got[i * h + j], want);
            }
        }
        assert!(matches!(
            e.gather(&[10]),
            Err(ModelError::TokenOutOfRange { .. })
        ));
        let s = HostEmbedding::synthetic("e", 100, 64, 3, WeightDType::Bf16);
        let a = s.gather(&[5, 99]).expect("a");
        let b = s.gather(&[99]).expect("b");
        assert_eq!(&a[64..], &b[..]);
        assert_ne!(&a[..64], &a[64..]);
        assert!(a.iter().all(|x| x.abs() <= 0.035) && a.iter().any(|x| *x != 0.0));
    }
}
