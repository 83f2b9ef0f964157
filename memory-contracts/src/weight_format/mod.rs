//! Quantized weight formats (issue 10): byte layouts, sizes, quantize and dequantize.
//!
//! The formats apply to any weight viewed as `R = numel / K` rows of `K = last dim` values
//! (PyTorch `[out, in]` linear weights: `R = N`). One contiguous blob per tensor, the same on the
//! host, on the device and on disk; every multi-byte value is little-endian;
//! `align16(x) = (x + 15) / 16 * 16`.
//!
//! | dtype | codes at `[0, S)` | scales at `align16(S)` | value(r, k) |
//! |---|---|---|---|
//! | `q8_0` (K % 32 == 0) | i8, `S = R·K` | f16 `[R, K/32]` | `f32(scale[r][k/32]) · q` |
//! | `q4_g128` (K % 128 == 0) | nibbles, `S = R·K/2`, low nibble = even k, `q = u − 8` | f16 `[R, K/128]` | `f32(scale[r][k/128]) · q` |
//! | `fp8_e4m3` (any K) | OCP E4M3 bytes, `S = R·K` | f32 `[R, ceil(K/128)]` | `e4m3(q) · scale[r][k/128]` |
//! | `q4_nl_g128` (K % 128 == 0) | nibbles as `q4_g128`, code `u` | f16 `[R, K/128]` | `f32(scale[r][k/128]) · L[u]`, [`Q4_NL_LEVELS`] |
//!
//! Every value is computed with exactly one f32 multiply (for q8_0/q4_g128 the product is exact),
//! so any backend that decodes a code the same way gets bit-identical weights (`q4_nl_g128`'s
//! levels are integers with |L| ≤ 127, so its product is exact too).
//!
//! * [`codec`]: [`quantize`], [`dequantize_row`], [`dequantize`].
//! * [`e4m3`]: the FP8 E4M3 element codec.

pub mod codec;
pub mod e4m3;
pub mod q4_nl;

pub use codec::{dequantize, dequantize_row, quantize};
pub use e4m3::{e4m3_to_f32, f32_to_e4m3, E4M3_TABLE};
pub use q4_nl::{Q4_NL_LEVELS, Q4_NL_LEVELS_I8};

use crate::backend::WeightDType;
use crate::error::OpError;

/// Values per scale of `q8_0`.
pub const Q8_0_GROUP: usize = 32;
/// Values per scale of `q4_g128` and `fp8_e4m3`.
pub const G128: usize = 128;

/// A malformed request to the weight-format functions (never a panic).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WeightFormatError {
    /// The dims do not fit the format (K not a multiple of the group, no dims, overflow, a row
    /// index or output length that does not match).
    #[error("{dtype} weight of dims {dims:?}: {reason}")]
    Shape {
        dtype: WeightDType,
        dims: Vec<usize>,
        reason: String,
    },
    /// A byte or value buffer of the wrong length.
    #[error("{dtype}: expected {expected} bytes/values, got {got}")]
    Length {
        dtype: WeightDType,
        expected: usize,
        got: usize,
    },
    /// The operation does not exist for this dtype.
    #[error("{dtype}: {operation} is not supported")]
    Unsupported {
        dtype: WeightDType,
        operation: &'static str,
    },
}

impl From<WeightFormatError> for OpError {
    fn from(e: WeightFormatError) -> Self {
        match e {
            WeightFormatError::Unsupported { dtype, operation } => OpError::DType {
                op: operation,
                dtype: dtype.to_string(),
            },
            other => OpError::shape("weight_format", other.to_string()),
        }
    }
}

impl WeightDType {
    /// True for the block-quantized formats (`Q8_0`, `Q4G128`, `F8E4M3`, `Q4NlG128`).
    pub const fn is_quantized(self) -> bool {
        matches!(
            self,
            WeightDType::Q8_0 | WeightDType::Q4G128 | WeightDType::F8E4M3 | WeightDType::Q4NlG128
        )
    }

    /// True for the two 4-bit formats with the `q4_g128` byte layout (`Q4G128`, `Q4NlG128`):
    /// nibbles (low first) and one f16 scale per 128 values; only the code → value map differs.
    pub const fn is_q4(self) -> bool {
        matches!(self, WeightDType::Q4G128 | WeightDType::Q4NlG128)
    }

    /// Values of a row that share one scale: 1 for the element types, 32 for `q8_0`, 128 for
    /// `q4_g128` and `fp8_e4m3` (whose last group of a row may be partial).
    pub const fn group_len(self) -> usize {
        match self {
            WeightDType::F32 | WeightDType::F16 | WeightDType::Bf16 => 1,
            WeightDType::Q8_0 => Q8_0_GROUP,
            WeightDType::Q4G128 | WeightDType::F8E4M3 | WeightDType::Q4NlG128 => G128,
        }
    }

    /// What K (the last dim) must be a multiple of: 32 for `q8_0`, 128 for `q4_g128` and
    /// `q4_nl_g128`, else 1.
    pub const fn k_multiple(self) -> usize {
        match self {
            WeightDType::Q8_0 => Q8_0_GROUP,
            WeightDType::Q4G128 | WeightDType::Q4NlG128 => G128,
            _ => 1,
        }
    }

    /// Exact byte size of a tensor of `dims` in this dtype (codes, padding and scales for the
    /// quantized types). Errors when K breaks the format's rule, when a quantized tensor has no
    /// dims or K = 0, or when the size overflows `usize`.
    pub fn storage_bytes(self, dims: &[usize]) -> Result<usize, WeightFormatError> {
        quant_layout(self, dims).map(|l| l.total)
    }

    /// Bits per weight for large tensors: 32, 16, 16, 8.5, 4.125, 8.25, 4.125.
    pub fn bits_per_weight(self) -> f64 {
        match self {
            WeightDType::F32 => 32.0,
            WeightDType::F16 | WeightDType::Bf16 => 16.0,
            WeightDType::Q8_0 => 8.0 + 16.0 / 32.0,
            WeightDType::Q4G128 | WeightDType::Q4NlG128 => 4.0 + 16.0 / 128.0,
            WeightDType::F8E4M3 => 8.0 + 32.0 / 128.0,
        }
    }

    /// Parses a name: `f32`, `f16`, `bf16`, `q8_0`, `q4_g128` or `q4`, `fp8_e4m3` or `fp8`,
    /// `q4_nl_g128` or `q4_nl` (ASCII case-insensitive). `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s.to_ascii_lowercase().as_str() {
            "f32" => WeightDType::F32,
            "f16" => WeightDType::F16,
            "bf16" => WeightDType::Bf16,
            "q8_0" => WeightDType::Q8_0,
            "q4_g128" | "q4" => WeightDType::Q4G128,
            "fp8_e4m3" | "fp8" => WeightDType::F8E4M3,
            "q4_nl_g128" | "q4_nl" => WeightDType::Q4NlG128,
            _ => return None,
        })
    }
}

/// Where the parts of one tensor's blob lie.
///
/// For the element types `group == 1` and `scales_offset == total` (there are no scales).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantLayout {
    /// Rows `R` = product of all dims but the last (1 for a 1-D tensor).
    pub rows: usize,
    /// Values per row `K` = the last dim.
    pub k: usize,
    /// Values per scale ([`WeightDType::group_len`]).
    pub group: usize,
    /// Byte offset of the scale section (16-byte aligned for the quantized types).
    pub scales_offset: usize,
    /// Total bytes of the blob.
    pub total: usize,
}

impl QuantLayout {
    /// Scales per row (`ceil(K / group)`; 0 for the element types).
    pub fn groups_per_row(&self) -> usize {
        if self.scales_offset == self.total {
            0
        } else {
            self.k.div_ceil(self.group)
        }
    }
}

const fn align16(x: usize) -> Option<usize> {
    match x.checked_add(15) {
        Some(v) => Some(v / 16 * 16),
        None => None,
    }
}

/// The layout of a tensor of `dims` in `dtype`: validates the K rule and overflow.
///
/// Element types accept any dims (a scalar `[]` is one value, `rows = k = 1`); quantized types
/// need at least one dim and K ≥ 1.
pub fn quant_layout(dtype: WeightDType, dims: &[usize]) -> Result<QuantLayout, WeightFormatError> {
    let shape_err = |reason: String| WeightFormatError::Shape {
        dtype,
        dims: dims.to_vec(),
        reason,
    };
    let overflow = || shape_err("size overflows usize".into());
    let (rows_dims, k) = match dims.split_last() {
        Some((k, rest)) => (rest, *k),
        None if dtype.is_quantized() => {
            return Err(shape_err(
                "a quantized weight needs at least one dim".into(),
            ))
        }
        None => (&[][..], 1),
    };
    let rows = rows_dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(overflow)?;
    let numel = rows.checked_mul(k).ok_or_else(overflow)?;
    if dtype.is_quantized() {
        if k == 0 {
            return Err(shape_err("K (the last dim) must be > 0".into()));
        }
        if k % dtype.k_multiple() != 0 {
            return Err(shape_err(format!(
                "K = {k} is not a multiple of {}",
                dtype.k_multiple()
            )));
        }
    }
    let (codes, scale_bytes) = match dtype {
        WeightDType::F32 | WeightDType::F16 | WeightDType::Bf16 => {
            let total = numel.checked_mul(dtype.size()).ok_or_else(overflow)?;
            return Ok(QuantLayout {
                rows,
                k,
                group: 1,
                scales_offset: total,
                total,
            });
        }
        WeightDType::Q8_0 => (numel, 2 * (numel / Q8_0_GROUP)),
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => (numel / 2, 2 * (numel / G128)),
        WeightDType::F8E4M3 => {
            let per_row = k.div_ceil(G128);
            let n = rows.checked_mul(per_row).ok_or_else(overflow)?;
            (numel, n.checked_mul(4).ok_or_else(overflow)?)
        }
    };
    let scales_offset = align16(codes).ok_or_else(overflow)?;
    let total = scales_offset
        .checked_add(scale_bytes)
        .ok_or_else(overflow)?;
    Ok(QuantLayout {
        rows,
        k,
        group: dtype.group_len(),
        scales_offset,
        total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_follow_the_spec_formulas() {
        let (r, k) = (3usize, 256usize);
        let q8 = quant_layout(WeightDType::Q8_0, &[r, k]).expect("q8");
        assert_eq!((q8.rows, q8.k, q8.group), (r, k, 32));
        assert_eq!(q8.scales_offset, (r * k).div_ceil(16) * 16);
        assert_eq!(q8.total, q8.scales_offset + 2 * r * k / 32);
        assert_eq!(q8.groups_per_row(), k / 32);

        let q4 = quant_layout(WeightDType::Q4G128, &[r, k]).expect("q4");
        assert_eq!(q4.scales_offset, (r * k / 2).div_ceil(16) * 16);
        assert_eq!(q4.total, q4.scales_offset + 2 * r * k / 128);
        // q4_nl_g128 has exactly the q4_g128 layout.
        let nl = quant_layout(WeightDType::Q4NlG128, &[r, k]).expect("q4_nl");
        assert_eq!(nl, q4);

        // fp8 with a partial last group and rows·K not a multiple of 16.
        let (r, k) = (5usize, 131usize);
        let f8 = quant_layout(WeightDType::F8E4M3, &[r, k]).expect("fp8");
        assert_eq!(f8.scales_offset, (r * k).div_ceil(16) * 16);
        assert_ne!(f8.scales_offset, r * k);
        assert_eq!(f8.total, f8.scales_offset + 4 * r * 2);
        assert_eq!(f8.groups_per_row(), 2);

        // 3-D tensors are R = product of the leading dims rows.
        let l = quant_layout(WeightDType::Q8_0, &[2, 3, 64]).expect("3-D");
        assert_eq!((l.rows, l.k), (6, 64));

        for (dt, size) in [
            (WeightDType::F32, 4),
            (WeightDType::F16, 2),
            (WeightDType::Bf16, 2),
        ] {
            let l = quant_layout(dt, &[7, 9]).expect("plain");
            assert_eq!(l.total, 63 * size);
            assert_eq!(l.scales_offset, l.total);
            assert_eq!(l.groups_per_row(), 0);
            assert_eq!(dt.storage_bytes(&[]), Ok(size));
        }
    }

    #[test]
    fn k_rule_and_overflow_are_errors() {
        for (dt, bad_k) in [
            (WeightDType::Q8_0, 48),
            (WeightDType::Q8_0, 1),
            (WeightDType::Q4G128, 64),
            (WeightDType::Q4G128, 130),
            (WeightDType::Q4NlG128, 64),
            (WeightDType::Q4NlG128, 192 + 1),
        ] {
            let e = dt.storage_bytes(&[4, bad_k]).expect_err("bad K");
            assert!(
                matches!(&e, WeightFormatError::Shape { dtype, .. } if *dtype == dt),
                "{e}"
            );
            assert!(e.to_string().contains("multiple"), "{e}");
        }
        assert!(WeightDType::F8E4M3.storage_bytes(&[4, 7]).is_ok());
        for dt in [
            WeightDType::Q8_0,
            WeightDType::Q4G128,
            WeightDType::F8E4M3,
            WeightDType::Q4NlG128,
        ] {
            assert!(dt.storage_bytes(&[]).is_err());
            assert!(dt.storage_bytes(&[3, 0]).is_err());
            assert!(dt.storage_bytes(&[usize::MAX / 2, 256]).is_err());
        }
        assert!(WeightDType::F32
            .storage_bytes(&[usize::MAX / 2, 3])
            .is_err());
    }

    #[test]
    fn names_parse_back_and_bits_match_sizes() {
        for dt in WeightDType::ALL {
            assert_eq!(WeightDType::parse(dt.name()), Some(dt));
            assert_eq!(dt.to_string(), dt.name());
            // bits/weight is the asymptotic storage size.
            let (r, k) = (1024usize, 1024usize);
            let bytes = dt.storage_bytes(&[r, k]).expect("size");
            let bits = bytes as f64 * 8.0 / (r * k) as f64;
            assert!((bits - dt.bits_per_weight()).abs() < 1e-3, "{dt}: {bits}");
            assert_eq!(
                dt.is_quantized(),
                dt.group_len() > 1,
                "{dt}: quantized iff grouped"
            );
        }
        assert_eq!(WeightDType::parse("q4"), Some(WeightDType::Q4G128));
        assert_eq!(WeightDType::parse("FP8"), Some(WeightDType::F8E4M3));
        assert_eq!(WeightDType::parse("q4_nl"), Some(WeightDType::Q4NlG128));
        assert_eq!(
            WeightDType::parse("Q4_NL_G128"),
            Some(WeightDType::Q4NlG128)
        );
        assert!(WeightDType::Q4NlG128.is_q4() && WeightDType::Q4G128.is_q4());
        assert!(!WeightDType::Q8_0.is_q4());
        assert_eq!(WeightDType::parse("q4_0"), None);
    }
}
