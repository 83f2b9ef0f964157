//! Parsing of sweep lists: `8Ki,32Ki,256Ki` (token counts), `0,1,2,3`, `1GiB,256MiB`.

use anyhow::{bail, Context, Result};

/// Parses one token count: a plain number, or a number with a binary (`Ki`, `Mi`) or decimal
/// (`K`, `k`, `M`) suffix. `8Ki` = 8192, `4K` = 4000.
pub fn parse_count(s: &str) -> Result<usize> {
    let t = s.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix("Ki") {
        (n, 1usize << 10)
    } else if let Some(n) = t.strip_suffix("Mi") {
        (n, 1 << 20)
    } else if let Some(n) = t.strip_suffix(['K', 'k']) {
        (n, 1000)
    } else if let Some(n) = t.strip_suffix('M') {
        (n, 1_000_000)
    } else {
        (t, 1)
    };
    let v: usize = num
        .trim()
        .parse()
        .with_context(|| format!("invalid token count `{s}` (expected e.g. 8192, 8Ki, 4K)"))?;
    v.checked_mul(mult)
        .with_context(|| format!("token count `{s}` overflows"))
}

/// Parses a comma-separated list with `item`; empty items and empty lists are errors.
pub fn parse_list<T>(s: &str, what: &str, item: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    if parts.iter().any(|p| p.is_empty()) {
        bail!("empty item in the {what} list `{s}`");
    }
    parts
        .into_iter()
        .map(|p| item(p).with_context(|| format!("in the {what} list `{s}`")))
        .collect()
}

/// `--contexts`: token counts, each > 0.
pub fn parse_contexts(s: &str) -> Result<Vec<usize>> {
    parse_list(s, "context", |p| {
        let v = parse_count(p)?;
        if v == 0 {
            bail!("a context of 0 tokens");
        }
        Ok(v)
    })
}

/// `--spec-draft-n-max`: draft counts, each in 0..=3 (the verify width n + 1 is at most 4).
pub fn parse_draft_ns(s: &str) -> Result<Vec<usize>> {
    parse_list(s, "spec-draft-n-max", |p| {
        let v: usize = p
            .parse()
            .with_context(|| format!("invalid draft count `{p}`"))?;
        if v > 3 {
            bail!("draft count {v} > 3 (verify widths are 1..=4)");
        }
        Ok(v)
    })
}

/// `--kv-arena`: byte sizes (`2240MiB`, `1GiB`, plain bytes).
pub fn parse_arenas(s: &str) -> Result<Vec<u64>> {
    parse_list(s, "kv-arena", |p| Ok(kvstream_runtime::parse_size(p)?))
}

/// `--acceptance`: per-draft acceptance rates in [0, 1) used for MTP projections.
pub fn parse_rates(s: &str) -> Result<Vec<f64>> {
    parse_list(s, "acceptance", |p| {
        let v: f64 = p.parse().with_context(|| format!("invalid rate `{p}`"))?;
        if !(0.0..1.0).contains(&v) {
            bail!("acceptance rate {v} outside [0, 1)");
        }
        Ok(v)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contexts_parse_binary_and_decimal_suffixes() {
        assert_eq!(
            parse_contexts("8Ki,32Ki, 256Ki").expect("ok"),
            vec![8192, 32768, 262_144]
        );
        assert_eq!(
            parse_contexts("4K,1000,1Mi").expect("ok"),
            vec![4000, 1000, 1 << 20]
        );
        for bad in ["", "8Ki,,4Ki", "0", "x", "8Gi", "-1"] {
            assert!(parse_contexts(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn draft_ns_arenas_and_rates_validate() {
        assert_eq!(parse_draft_ns("0,1,2,3").expect("ok"), vec![0, 1, 2, 3]);
        assert!(parse_draft_ns("4").is_err());
        assert_eq!(
            parse_arenas("1GiB,96KiB").expect("ok"),
            vec![1 << 30, 96 << 10]
        );
        assert!(parse_arenas("lots").is_err());
        assert_eq!(parse_rates("0.5,0.8").expect("ok"), vec![0.5, 0.8]);
        assert!(parse_rates("1.0").is_err());
    }
}
