//! Parsing of byte sizes such as `2240MiB`, `96KiB`, `1.5GiB` or plain `4096`.

use crate::error::RuntimeError;

/// Parses a byte size.
///
/// Accepted forms (case-insensitive suffix, optional spaces between number and suffix):
/// plain bytes (`4096`, `4096B`), binary units `K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`
/// (powers of 1024) and decimal units `KB`, `MB`, `GB`, `TB` (powers of 1000). The number may
/// have a fractional part (`1.5GiB`); the result is rounded down to whole bytes.
///
/// Returns [`RuntimeError::InvalidSize`] for empty input, an unknown suffix, a negative or
/// non-numeric value, or a value that overflows `u64`.
pub fn parse_size(text: &str) -> Result<u64, RuntimeError> {
    let invalid = |why: &str| RuntimeError::InvalidSize {
        input: text.to_string(),
        reason: why.to_string(),
    };
    let s = text.trim();
    if s.is_empty() {
        return Err(invalid("empty size"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    if num.is_empty() {
        return Err(invalid("expected a number before the unit"));
    }
    let mult: u64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(invalid(&format!(
                "unknown unit `{other}` (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
            )))
        }
    };
    if let Ok(whole) = num.parse::<u64>() {
        return whole
            .checked_mul(mult)
            .ok_or_else(|| invalid("size overflows 64 bits"));
    }
    let value: f64 = num.parse().map_err(|_| invalid("not a number"))?;
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(invalid("size overflows 64 bits"));
    }
    Ok(bytes.floor() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_plain_bytes() {
        assert_eq!(parse_size("2240MiB").ok(), Some(2240 * 1024 * 1024));
        assert_eq!(parse_size("96KiB").ok(), Some(96 * 1024));
        assert_eq!(parse_size("96k").ok(), Some(96 * 1024));
        assert_eq!(parse_size(" 4096 ").ok(), Some(4096));
        assert_eq!(parse_size("4096B").ok(), Some(4096));
        assert_eq!(parse_size("2 GiB").ok(), Some(2 << 30));
        assert_eq!(parse_size("3MB").ok(), Some(3_000_000));
        assert_eq!(parse_size("1.5KiB").ok(), Some(1536));
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        for bad in ["", "MiB", "12XB", "-5", "1.2.3K", "99999999999999999999TiB"] {
            assert!(
                matches!(parse_size(bad), Err(RuntimeError::InvalidSize { .. })),
                "{bad:?} should fail"
            );
        }
    }
}
