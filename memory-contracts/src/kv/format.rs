//! KV element formats: F32, F16, BF16, Q8_0 and Q4_0 (byte-compatible with GGML's blocks).
//!
//! * Q8_0: blocks of 32 values, an f16 scale `d` then 32 × i8; value = q·d (34 bytes).
//! * Q4_0: blocks of 32 values, an f16 scale `d` then 16 bytes of nibbles; byte j holds value j in
//!   its low nibble and value j+16 in its high nibble; value = (q − 8)·d (18 bytes).

use crate::error::FormatError;
use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

/// Values per quantisation block of Q8_0 and Q4_0.
pub const QK: usize = 32;

/// An element format of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

impl KvType {
    /// Every format, in a stable order.
    pub const ALL: [KvType; 5] = [
        KvType::F32,
        KvType::F16,
        KvType::Bf16,
        KvType::Q8_0,
        KvType::Q4_0,
    ];

    /// Values per block (1 for plain floats).
    pub const fn block_values(self) -> usize {
        match self {
            KvType::F32 | KvType::F16 | KvType::Bf16 => 1,
            KvType::Q8_0 | KvType::Q4_0 => QK,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            KvType::F32 => 4,
            KvType::F16 | KvType::Bf16 => 2,
            KvType::Q8_0 => 2 + QK,
            KvType::Q4_0 => 2 + QK / 2,
        }
    }

    /// True for the block-quantised formats.
    pub const fn is_quantized(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }

    /// Bytes needed to store `values` values; error if `values` is not a block multiple.
    pub fn bytes_for(self, values: usize) -> Result<usize, FormatError> {
        let block = self.block_values();
        if values % block != 0 {
            return Err(FormatError::NotBlockMultiple {
                ty: self,
                block,
                len: values,
            });
        }
        Ok(values / block * self.block_bytes())
    }

    /// The llama.cpp-style name (`q8_0`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Bf16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }
}

impl fmt::Display for KvType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = FormatError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "bf16" => Ok(KvType::Bf16),
            "q8_0" => Ok(KvType::Q8_0),
            "q4_0" => Ok(KvType::Q4_0),
            _ => Err(FormatError::UnknownType(s.to_string())),
        }
    }
}

fn check(ty: KvType, values: usize, bytes: usize) -> Result<(), FormatError> {
    let expected = ty.bytes_for(values)?;
    if expected != bytes {
        return Err(FormatError::BufferSize {
            ty,
            values,
            expected,
            actual: bytes,
        });
    }
    Ok(())
}

/// Encodes `src` into `dst` in format `ty`. `dst` must be exactly `ty.bytes_for(src.len())` long.
pub fn encode(ty: KvType, src: &[f32], dst: &mut [u8]) -> Result<(), FormatError> {
    check(ty, src.len(), dst.len())?;
    match ty {
        KvType::F32 => {
            for (v, out) in src.iter().zip(dst.chunks_exact_mut(4)) {
                out.copy_from_slice(&v.to_le_bytes());
            }
        }
        KvType::F16 => {
            for (v, out) in src.iter().zip(dst.chunks_exact_mut(2)) {
                out.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        KvType::Bf16 => {
            for (v, out) in src.iter().zip(dst.chunks_exact_mut(2)) {
                out.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        KvType::Q8_0 => {
            for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(2 + QK)) {
                encode_q8_0_block(x, out);
            }
        }
        KvType::Q4_0 => {
            for (x, out) in src.chunks_exact(QK).zip(dst.chunks_exact_mut(2 + QK / 2)) {
                encode_q4_0_block(x, out);
            }
        }
    }
    Ok(())
}

/// Decodes `src` (format `ty`) into `dst`. `src` must be exactly `ty.bytes_for(dst.len())` long.
pub fn decode(ty: KvType, src: &[u8], dst: &mut [f32]) -> Result<(), FormatError> {
    check(ty, dst.len(), src.len())?;
    decode_unchecked(ty, src, dst);
    Ok(())
}

/// Decode without the length check; lengths must already agree (used on hot paths after a
/// validated geometry). Extra bytes or values are ignored.
pub fn decode_unchecked(ty: KvType, src: &[u8], dst: &mut [f32]) {
    match ty {
        KvType::F32 => {
            for (out, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *out = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        KvType::F16 => {
            for (out, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *out = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvType::Bf16 => {
            for (out, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *out = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        KvType::Q8_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(2 + QK)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for (o, q) in out.iter_mut().zip(&b[2..]) {
                    *o = f32::from(*q as i8) * d;
                }
            }
        }
        KvType::Q4_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(src.chunks_exact(2 + QK / 2)) {
                let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                for j in 0..QK / 2 {
                    let q = b[2 + j];
                    out[j] = (f32::from(q & 0x0f) - 8.0) * d;
                    out[j + QK / 2] = (f32::from(q >> 4) - 8.0) * d;
                }
            }
        }
    }
}

fn encode_q8_0_block(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        *o = ((v * id).round() as i8) as u8;
    }
}

fn encode_q4_0_block(x: &[f32], out: &mut [u8]) {
    // GGML's reference: the value of largest magnitude, keeping its sign, maps to -8.
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..QK / 2 {
        let x0 = x[j] * id;
        let x1 = x[QK / 2 + j] * id;
        let q0 = ((x0 + 8.5) as i8).min(15) as u8;
        let q1 = ((x1 + 8.5) as i8).min(15) as u8;
        out[2 + j] = q0 | (q1 << 4);
    }
}

/// Largest absolute round-trip error `encode`→`decode` may introduce on a block whose largest
/// magnitude is `amax` (per value for floats: pass the value's own magnitude).
pub fn error_bound(ty: KvType, amax: f32) -> f32 {
    match ty {
        KvType::F32 => 0.0,
        KvType::F16 => amax * 2f32.powi(-11) + 6.0e-8,
        KvType::Bf16 => amax * 2f32.powi(-8),
        // half a step of d = amax/127, plus the f16 rounding of d times the largest |q|.
        KvType::Q8_0 => amax / 127.0 * 0.5 + amax * 2f32.powi(-11) * 1.01 + 1e-12,
        // values opposite in sign to the extreme can clamp at q = 15: up to one step d = amax/8.
        KvType::Q4_0 => amax / 8.0 + amax * 2f32.powi(-10) + 1e-12,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let scale = 10f32.powf(rng.random_range(-2.0..2.0));
                rng.random_range(-1.0..1.0f32) * scale
            })
            .collect()
    }

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(KvType::Q8_0.block_bytes(), 34);
        assert_eq!(KvType::Q4_0.block_bytes(), 18);
        assert_eq!(KvType::Q8_0.bytes_for(256).ok(), Some(272));
        assert_eq!(KvType::Q4_0.bytes_for(256).ok(), Some(144));
        assert!(KvType::Q4_0.bytes_for(33).is_err());
    }

    #[test]
    fn round_trip_within_bounds_on_random_data() {
        for ty in KvType::ALL {
            for seed in 0..20 {
                let x = random(256, seed);
                let mut bytes = vec![0u8; ty.bytes_for(x.len()).expect("block multiple")];
                encode(ty, &x, &mut bytes).expect("encode");
                let mut y = vec![0f32; x.len()];
                decode(ty, &bytes, &mut y).expect("decode");
                for b in 0..x.len() / ty.block_values().max(QK) {
                    let blk = &x[b * QK..(b + 1) * QK];
                    let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for j in b * QK..(b + 1) * QK {
                        let bound = if ty.is_quantized() {
                            error_bound(ty, amax)
                        } else {
                            error_bound(ty, x[j].abs())
                        };
                        assert!(
                            (x[j] - y[j]).abs() <= bound,
                            "{ty}: x={} y={} bound={bound}",
                            x[j],
                            y[j]
                        );
                    }
                }
                if ty == KvType::F32 {
                    assert_eq!(x, y);
                }
            }
        }
    }

    #[test]
    fn q4_0_layout_is_ggml() {
        // Value j sits in the low nibble of byte j, value j+16 in the high nibble.
        let mut x = [0f32; 32];
        x[0] = -8.0; // the extreme: d = -8 / -8 = 1, q = 0
        x[16] = 7.0; // q = 15
        x[1] = 1.0; // q = 9
        let mut b = [0u8; 18];
        encode(KvType::Q4_0, &x, &mut b).expect("encode");
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        assert_eq!(b[2] & 0x0f, 0);
        assert_eq!(b[2] >> 4, 15);
        assert_eq!(b[3] & 0x0f, 9);
        let mut y = [0f32; 32];
        decode(KvType::Q4_0, &b, &mut y).expect("decode");
        assert_eq!(y[0], -8.0);
        assert_eq!(y[16], 7.0);
        assert_eq!(y[1], 1.0);
    }

    #[test]
    fn q8_0_layout_is_ggml() {
        let mut x = [0.5f32; 32];
        x[3] = -127.0;
        let mut b = [0u8; 34];
        encode(KvType::Q8_0, &x, &mut b).expect("encode");
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        assert_eq!(b[2 + 3] as i8, -127);
        assert_eq!(b[2] as i8, 1); // 0.5 rounds away from zero
    }

    #[test]
    fn wrong_sizes_are_errors_not_panics() {
        let x = random(64, 1);
        let mut small = vec![0u8; 10];
        assert!(matches!(
            encode(KvType::Q8_0, &x, &mut small),
            Err(FormatError::BufferSize { .. })
        ));
        assert!(matches!(
            encode(KvType::Q8_0, &x[..33], &mut small),
            Err(FormatError::NotBlockMultiple { .. })
        ));
        assert!("q5_1".parse::<KvType>().is_err());
        assert_eq!("Q8_0".parse::<KvType>().ok(), Some(KvType::Q8_0));
    }
}
