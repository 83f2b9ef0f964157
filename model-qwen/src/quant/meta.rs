//! The safetensors `__metadata__` entry of a quantized tensor: key = tensor name, value =
//! `FORMAT:[d0,d1,...]` (e.g. `q4_g128:[17408,5120]`), FORMAT = [`WeightDType::name`], dims =
//! the logical (unquantized) shape.

use kvstream_memory_contracts::backend::WeightDType;

/// The metadata value for a tensor of `dtype` and logical `dims`.
pub(crate) fn format_meta(dtype: WeightDType, dims: &[usize]) -> String {
    let d: Vec<String> = dims.iter().map(|x| x.to_string()).collect();
    format!("{}:[{}]", dtype.name(), d.join(","))
}

/// Parses a metadata value written by [`format_meta`]; the error says what is wrong.
pub(crate) fn parse_meta(s: &str) -> Result<(WeightDType, Vec<usize>), String> {
    let (fmt, dims) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}` is not FORMAT:[dims]"))?;
    let dtype =
        WeightDType::parse(fmt.trim()).ok_or_else(|| format!("unknown weight format `{fmt}`"))?;
    let inner = dims
        .trim()
        .strip_prefix('[')
        .and_then(|d| d.strip_suffix(']'))
        .ok_or_else(|| format!("dims `{dims}` are not [d0,d1,...]"))?;
    let dims = if inner.trim().is_empty() {
        Vec::new()
    } else {
        inner
            .split(',')
            .map(|d| {
                d.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("dim `{d}` is not a non-negative integer"))
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    Ok((dtype, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_rejects_garbage() {
        for dt in WeightDType::ALL {
            let s = format_meta(dt, &[17408, 5120]);
            assert_eq!(parse_meta(&s), Ok((dt, vec![17408, 5120])));
        }
        assert_eq!(format_meta(WeightDType::Q8_0, &[3, 64]), "q8_0:[3,64]");
        for bad in [
            "q4_g128",
            "q9:[1,2]",
            "q8_0:[1,x]",
            "q8_0:1,2",
            "q8_0:[-1,2]",
        ] {
            assert!(parse_meta(bad).is_err(), "{bad}");
        }
    }
}
