//! q4_nl_g128 on the device: the code relabeling of the upload and the host mirror of the
//! kernels' table lookup (`q4nl_lookup4` in `kernels/src/cu/common.cuh`).
//!
//! The device copy of a q4_nl_g128 blob is the host blob with every code `u` replaced by
//! `c = swap23(u)` (bits 2 and 3 exchanged; an involution) and the scales unchanged. With that
//! labeling the codes `c` and `c + 8` index levels of the same sign, which is what lets two
//! sign-replicating byte permutes and one XOR turn 4 codes into their 4 int8 levels (see
//! [`lookup4`]). Device weights are never read back, so the relabeling is invisible outside the
//! kernels.

/// `u` with bits 2 and 3 exchanged (low 4 bits; an involution).
pub(crate) const fn swap23(u: u8) -> u8 {
    let u = u & 0xF;
    (u & 0b0011) | ((u & 0b0100) << 1) | ((u & 0b1000) >> 1)
}

/// The byte map that relabels both nibbles of a code byte.
const RELABEL: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = swap23(b as u8) | (swap23((b >> 4) as u8) << 4);
        b += 1;
    }
    t
};

/// The device bytes of a q4_nl_g128 blob: the codes (`[0, codes)`) relabeled, the rest (padding
/// and scales) copied.
pub(crate) fn relabel_blob(bytes: &[u8], codes: usize) -> Vec<u8> {
    let codes = codes.min(bytes.len());
    let mut out = Vec::with_capacity(bytes.len());
    out.extend(bytes[..codes].iter().map(|&b| RELABEL[usize::from(b)]));
    out.extend_from_slice(&bytes[codes..]);
    out
}

/// The table words of `common.cuh` (`Q4NL_T0..3`).
#[cfg(test)]
const TABLE: [u32; 4] = [0xC6B5_A081, 0x2C1F_1206, 0x0511_1E2B, 0x7F60_4B3A];

/// PTX `prmt.b32 d, a, b, c` in its default mode: byte i of d is byte `c[4i+2..4i]` of the 8-byte
/// value {b, a} (a = bytes 0..3), or, when selector bit `4i+3` is set, that byte's sign bit
/// replicated.
#[cfg(test)]
fn prmt(a: u32, b: u32, c: u32) -> u32 {
    let pool = (u64::from(b) << 32) | u64::from(a);
    let mut d = 0u32;
    for i in 0..4 {
        let s = (c >> (4 * i)) & 0xF;
        let byte = ((pool >> (8 * (s & 7))) & 0xFF) as u32;
        let v = if s & 8 != 0 {
            if byte & 0x80 != 0 {
                0xFF
            } else {
                0
            }
        } else {
            byte
        };
        d |= v << (8 * i);
    }
    d
}

/// Host mirror of `q4nl_lookup4`.
#[cfg(test)]
pub(crate) fn lookup4(sel: u32) -> u32 {
    prmt(TABLE[0], TABLE[1], sel) ^ prmt(TABLE[2], TABLE[3], sel ^ 0x8888)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::weight_format::Q4_NL_LEVELS_I8;

    /// Every relabeled code looks up its level, in every selector position and mixed with any
    /// other codes, and the kernels hold the same table words.
    #[test]
    fn lookup_of_relabeled_codes_gives_the_levels() {
        for u in 0..16u8 {
            assert_eq!(swap23(swap23(u)), u);
            let c = u32::from(swap23(u));
            for pos in 0..4 {
                for other in 0..16u32 {
                    let mut sel = 0u32;
                    for p in 0..4 {
                        sel |= (if p == pos { c } else { other }) << (4 * p);
                    }
                    let got = (lookup4(sel) >> (8 * pos)) as u8 as i8;
                    assert_eq!(got, Q4_NL_LEVELS_I8[usize::from(u)], "u {u} pos {pos}");
                }
            }
            // The upper 16 selector bits are ignored (the kernels pass whole code words).
            assert_eq!(lookup4(c | 0xABCD_0000) & 0xFF, lookup4(c) & 0xFF);
        }
        let src = kvstream_kernels::COMMON;
        for (name, v) in ["Q4NL_T0", "Q4NL_T1", "Q4NL_T2", "Q4NL_T3"]
            .iter()
            .zip(TABLE)
        {
            assert!(
                src.contains(&format!("#define {name} 0x{v:08X}u")),
                "{name} differs from common.cuh"
            );
        }
    }

    #[test]
    fn relabeling_touches_only_the_codes() {
        let bytes: Vec<u8> = (0..=255u8).chain([1, 2, 3]).collect();
        let out = relabel_blob(&bytes, 256);
        assert_eq!(&out[256..], &bytes[256..]);
        for (b, o) in bytes[..256].iter().zip(&out) {
            assert_eq!(o & 0xF, swap23(b & 0xF));
            assert_eq!(o >> 4, swap23(b >> 4));
        }
        assert_eq!(relabel_blob(&out, 256), bytes);
    }
}
