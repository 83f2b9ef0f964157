//! Fused projections: linears that read the same input (MLP gate/up, GDN `in_proj_qkv`/
//! `in_proj_z`, attention q/k/v) loaded as ONE weight with their rows concatenated, so a decode
//! step runs one larger GEMV instead of several small ones; the output is split back with
//! `split_cols`. Every output element is still the dot product of one stored row with the
//! input, so on the CPU backend the results are bit-identical to separate weights.
//!
//! The fused blob is the separate blobs' code sections one after the other, then (16-byte
//! aligned) their scale sections one after the other: every format of
//! `memory_contracts::weight_format` lays codes and scales out row by row, so this is exactly
//! the blob of the concatenated rows. Each part is converted (or copied, or generated) straight
//! into its row range, so host memory holds the fused blob and nothing else of that size.
//! Parts whose formats differ, or whose fused blob would not have exactly the separate blobs'
//! bytes (an fp8 code section that is not a multiple of 16 bytes), stay separate.
//!
//! `KVSTREAM_FUSE_PROJ=0` (or `LoadOptions::fuse_projections = Some(false)`) turns it off.

use crate::error::ModelError;
use crate::layers::Loader;
use crate::quant::convert::{code_bytes_per_row, scale_bytes_of_row};
use crate::quant::role::{decide, Decision, Role};
use kvstream_memory_contracts::backend::{DeviceWeight, WeightDType};
use kvstream_memory_contracts::ops::{ModelBackend, WeightData};
use kvstream_memory_contracts::weight_format::quant_layout;

/// Environment switch: `KVSTREAM_FUSE_PROJ=0` (also `off`, `false`) loads every projection
/// separately; anything else, or unset, fuses.
pub const FUSE_ENV: &str = "KVSTREAM_FUSE_PROJ";

/// Whether projections are fused: `explicit` when set, else [`FUSE_ENV`] (default on).
pub(crate) fn fuse_enabled(explicit: Option<bool>) -> bool {
    explicit.unwrap_or_else(|| env_value_enables(std::env::var(FUSE_ENV).ok().as_deref()))
}

/// The meaning of a [`FUSE_ENV`] value: off for `0`, `off`, `false` (any case), else on.
fn env_value_enables(v: Option<&str>) -> bool {
    !v.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "off" | "false"
        )
    })
}

/// Linears applied to the same input: one fused weight, or the separate weights.
pub(crate) enum Proj<B: ModelBackend> {
    /// One weight `[Σ rows, K]`; `sizes` are the parts' rows (output columns) in order.
    Fused { w: B::Weight, sizes: Vec<usize> },
    /// One weight per part.
    Separate(Vec<B::Weight>),
}

impl<B: ModelBackend> Proj<B> {
    /// `x · wᵢᵀ` for every part, in order (`[T, rowsᵢ]` each).
    pub fn forward(&self, b: &B, x: &B::Tensor) -> Result<Vec<B::Tensor>, ModelError> {
        match self {
            Proj::Fused { w, sizes } => {
                let y = b.matmul(x, w)?;
                Ok(b.split_cols(&y, 1, sizes)?)
            }
            Proj::Separate(ws) => ws
                .iter()
                .map(|w| b.matmul(x, w).map_err(ModelError::from))
                .collect(),
        }
    }

    /// The outputs as a fixed-size array (the caller knows how many parts it loaded).
    pub fn forward_n<const N: usize>(
        &self,
        b: &B,
        x: &B::Tensor,
    ) -> Result<[B::Tensor; N], ModelError> {
        let v = self.forward(b, x)?;
        let n = v.len();
        v.try_into()
            .map_err(|_| ModelError::Input(format!("projection gave {n} outputs, expected {N}")))
    }
}

/// The dims of the fused weight of `parts` (`[rows, K]` each) in `dtype`, when fusing gives
/// exactly the separate blobs' bytes: same K, 2-D, every part's code section (but the last) a
/// multiple of 16 bytes (so no padding moves), and the total equal to the sum of the parts.
pub(crate) fn fused_dims(dtype: WeightDType, parts: &[&[usize]]) -> Option<[usize; 2]> {
    let k = match parts.first()? {
        [_, k] => *k,
        _ => return None,
    };
    let mut rows = 0usize;
    let mut sum = 0usize;
    for (i, p) in parts.iter().enumerate() {
        let [r, pk] = p[..] else { return None };
        if pk != k {
            return None;
        }
        let l = quant_layout(dtype, p).ok()?;
        let last = i + 1 == parts.len();
        if !last && dtype.is_quantized() && (r * code_bytes_per_row(dtype, k)) % 16 != 0 {
            return None;
        }
        rows = rows.checked_add(r)?;
        sum = sum.checked_add(l.total)?;
    }
    let fused = quant_layout(dtype, &[rows, k]).ok()?;
    (fused.total == sum).then_some([rows, k])
}

impl<B: ModelBackend> Loader<'_, B> {
    /// The linears `parts` (name, `[rows, K]`) of the current role ([`Loader::linear_role`]),
    /// applied to the same input: fused into one weight when enabled and possible (same
    /// format for every part, see [`fused_dims`]), else loaded one by one. The report records
    /// each part as if loaded separately (same counts, bytes and fallbacks).
    pub fn linears(&mut self, parts: &[(String, Vec<usize>)]) -> Result<Proj<B>, ModelError> {
        self.linears_as(parts, self.linear_role)
    }

    /// [`Loader::linears`] with the formats of `role` (e.g. [`Role::Kept`] for the GDN
    /// `in_proj_b`/`in_proj_a` pair, which stays as stored).
    pub fn linears_as(
        &mut self,
        parts: &[(String, Vec<usize>)],
        role: Role,
    ) -> Result<Proj<B>, ModelError> {
        let separate = |l: &mut Self| -> Result<Proj<B>, ModelError> {
            parts
                .iter()
                .map(|(n, s)| l.load(n, s, role))
                .collect::<Result<Vec<_>, _>>()
                .map(Proj::Separate)
        };
        if !self.fuse || parts.len() < 2 {
            return separate(self);
        }
        let mut decisions: Vec<Decision> = Vec::with_capacity(parts.len());
        for (n, s) in parts {
            let stored = self.ck.stored_dtype(n, s)?;
            decisions.push(decide(role, stored, s, &self.policy));
        }
        let dtype = decisions[0].dtype;
        let shapes: Vec<&[usize]> = parts.iter().map(|(_, s)| s.as_slice()).collect();
        let dims = match fused_dims(dtype, &shapes) {
            Some(d) if decisions.iter().all(|d| d.dtype == dtype) => d,
            _ => {
                tracing::debug!(first = %parts[0].0, "projections not fusable: kept separate");
                return separate(self);
            }
        };
        let k = dims[1];
        let layout = quant_layout(dtype, &dims).map_err(|source| ModelError::WeightFormat {
            name: parts[0].0.clone(),
            source,
        })?;
        let cb = code_bytes_per_row(dtype, k);
        let sb = scale_bytes_of_row(dtype, k).map_err(|source| ModelError::WeightFormat {
            name: parts[0].0.clone(),
            source,
        })?;
        let mut out = vec![0u8; layout.total];
        {
            let (codes, scales) = out.split_at_mut(layout.scales_offset);
            let (mut codes, mut scales) = (&mut codes[..dims[0] * cb], scales);
            for ((n, s), d) in parts.iter().zip(&decisions) {
                if d.fallback {
                    tracing::debug!(name = %n, to = %d.dtype, "format does not fit K: fallback");
                    self.report.fallback.push((n.clone(), d.dtype));
                }
                let (c, rest_c) = std::mem::take(&mut codes).split_at_mut(s[0] * cb);
                let (sc, rest_s) = std::mem::take(&mut scales).split_at_mut(s[0] * sb);
                self.ck.get_into(n, s, dtype, c, sc)?;
                (codes, scales) = (rest_c, rest_s);
            }
        }
        let name = parts
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join("+");
        let w = self
            .b
            .load_weight(&name, dtype, &dims, WeightData::from_vec(out))?;
        debug_assert_eq!(w.device_bytes(), layout.total);
        for (_, s) in parts {
            let bytes = quant_layout(dtype, s).map_or(0, |l| l.total);
            self.report.record(dtype, bytes);
        }
        self.fused += 1;
        Ok(Proj::Fused {
            w,
            sizes: parts.iter().map(|(_, s)| s[0]).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use WeightDType::*;

    #[test]
    fn fused_dims_keep_the_bytes_of_the_parts() {
        let mlp: [&[usize]; 2] = [&[96, 256], &[96, 256]];
        for dt in [F32, Bf16, F16, Q8_0, Q4G128, Q4NlG128, F8E4M3] {
            assert_eq!(fused_dims(dt, &mlp), Some([192, 256]), "{dt}");
        }
        // Different K, not 2-D, or a K the format refuses: not fused.
        assert_eq!(fused_dims(Bf16, &[&[4, 64], &[4, 128]]), None);
        assert_eq!(fused_dims(Bf16, &[&[4, 64, 2], &[4, 64, 2]]), None);
        assert_eq!(fused_dims(Q4G128, &[&[4, 64], &[4, 64]]), None);
        // fp8 with a code section that is not a multiple of 16 bytes: padding would move.
        assert_eq!(fused_dims(F8E4M3, &[&[3, 100], &[5, 100]]), None);
        assert_eq!(fused_dims(F8E4M3, &[&[4, 100], &[5, 100]]), Some([9, 100]));
        assert_eq!(fused_dims(Bf16, &[&[3, 7], &[5, 7], &[1, 7]]), Some([9, 7]));
    }

    #[test]
    fn the_switch_defaults_to_on() {
        assert!(fuse_enabled(Some(true)));
        assert!(!fuse_enabled(Some(false)));
        assert!(env_value_enables(None));
        assert!(env_value_enables(Some("1")));
        assert!(env_value_enables(Some("on")));
        for off in ["0", "off", "FALSE", " 0 "] {
            assert!(!env_value_enables(Some(off)), "{off}");
        }
    }

    /// Synthetic sources write each part's rows exactly as `get_as` lays them out (random
    /// quantized codes are generated per part, seeded by the part's name).
    #[test]
    fn synthetic_parts_written_into_sections_equal_get_as() {
        use crate::synthetic::{SyntheticWeights, TensorSource};
        let src = SyntheticWeights {
            dtype: Bf16,
            seed: 5,
        };
        let names = ["l.mlp.gate_proj.weight", "l.mlp.up_proj.weight"];
        let (r, k) = (300usize, 256usize);
        for dt in [Bf16, F32, Q8_0, Q4G128, Q4NlG128, F8E4M3] {
            let l = quant_layout(dt, &[2 * r, k]).expect("layout");
            let mut blob = vec![0u8; l.total];
            let (cb, sb) = (
                code_bytes_per_row(dt, k),
                scale_bytes_of_row(dt, k).expect("sb"),
            );
            let (codes, scales) = blob.split_at_mut(l.scales_offset);
            let (c0, c1) = codes[..2 * r * cb].split_at_mut(r * cb);
            let (s0, s1) = scales.split_at_mut(r * sb);
            src.get_into(names[0], &[r, k], dt, c0, s0).expect("a");
            src.get_into(names[1], &[r, k], dt, c1, s1).expect("b");
            let one = quant_layout(dt, &[r, k]).expect("one");
            for (i, n) in names.iter().enumerate() {
                let t = src.get_as(n, &[r, k], dt).expect("get_as");
                let b = t.data.bytes();
                assert_eq!(&blob[i * r * cb..(i + 1) * r * cb], &b[..r * cb], "{dt}");
                let so = l.scales_offset + i * r * sb;
                assert_eq!(&blob[so..so + r * sb], &b[one.scales_offset..], "{dt}");
            }
        }
    }
}
