//! Public FP8 checkpoints mapped onto [`WeightDType::F8E4M3`] (quant-spec "fp8_e4m3").
//!
//! * Qwen/DeepSeek "fine-grained" FP8 (`quantization_config.quant_method == "fp8"`,
//!   `weight_block_size [128, 128]`): `x.weight` F8_E4M3 `[N, K]` + `x.weight_scale_inv` F32
//!   `[ceil(N/128), ceil(K/128)]`, value = q · scale_inv[n/128][k/128] → scale[r][g] =
//!   scale_inv[r/128][g].
//! * compressed-tensors (`x.weight_scale`): per channel `[N, 1]` / `[N]`, per tensor `[]` /
//!   `[1]` (replicated over the row's groups), or blocks `[ceil(N/128), ceil(K/128)]`.

use crate::error::ModelError;
use half::{bf16, f16};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::weight_format::quant_layout;
use serde_json::Value;
use std::path::Path;

/// A scale tensor as found in the checkpoint.
pub(crate) struct ScaleRef<'a> {
    pub name: &'a str,
    pub dtype: WeightDType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

/// The kvstream `fp8_e4m3` blob of an FP8 weight `name` of `dims` with codes `codes` and its
/// scale tensor. Errors name the weight and the scale tensor.
pub(crate) fn fp8_blob(
    name: &str,
    codes: &[u8],
    dims: &[usize],
    scale: &ScaleRef<'_>,
) -> Result<Vec<u8>, ModelError> {
    let layout =
        quant_layout(WeightDType::F8E4M3, dims).map_err(|source| ModelError::WeightFormat {
            name: name.to_string(),
            source,
        })?;
    let mut out = vec![0u8; layout.total];
    let (c, s) = out.split_at_mut(layout.scales_offset);
    fp8_blob_into(
        name,
        codes,
        dims,
        scale,
        &mut c[..layout.rows * layout.k],
        s,
    )?;
    Ok(out)
}

/// [`fp8_blob`] written into the code section `out_codes` (`R·K` bytes) and the scale section
/// `out_scales` (`R·ceil(K/128)` f32) of the weight's rows (a fused weight's row range).
pub(crate) fn fp8_blob_into(
    name: &str,
    codes: &[u8],
    dims: &[usize],
    scale: &ScaleRef<'_>,
    out_codes: &mut [u8],
    out_scales: &mut [u8],
) -> Result<(), ModelError> {
    let bad = |detail: String| ModelError::ScaleTensor {
        name: name.to_string(),
        scale: scale.name.to_string(),
        detail,
    };
    let layout =
        quant_layout(WeightDType::F8E4M3, dims).map_err(|source| ModelError::WeightFormat {
            name: name.to_string(),
            source,
        })?;
    let (rows, k) = (layout.rows, layout.k);
    let g = k.div_ceil(128);
    if codes.len() != rows * k || out_codes.len() != rows * k || out_scales.len() != rows * g * 4 {
        return Err(ModelError::WeightFormat {
            name: name.to_string(),
            source: kvstream_memory_contracts::weight_format::WeightFormatError::Length {
                dtype: WeightDType::F8E4M3,
                expected: rows * k,
                got: codes.len(),
            },
        });
    }
    let sz = match scale.dtype {
        WeightDType::F32 => 4,
        WeightDType::F16 | WeightDType::Bf16 => 2,
        other => return Err(bad(format!("dtype {other} (expected F32, F16 or BF16)"))),
    };
    let numel: usize = scale.shape.iter().product();
    if scale.bytes.len() != numel * sz {
        return Err(bad(format!(
            "{} bytes for shape {:?}",
            scale.bytes.len(),
            scale.shape
        )));
    }
    let val = |i: usize| -> f32 {
        let c = &scale.bytes[i * sz..(i + 1) * sz];
        match scale.dtype {
            WeightDType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            WeightDType::Bf16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        }
    };
    let block = [rows.div_ceil(128), g];
    // scale index for (row, group)
    let index: Box<dyn Fn(usize, usize) -> usize> = if scale.shape == block {
        Box::new(move |r, gi| (r / 128) * g + gi)
    } else if scale.shape == [rows, 1] || scale.shape == [rows] {
        Box::new(|r, _| r)
    } else if numel == 1 && scale.shape.len() <= 1 {
        Box::new(|_, _| 0)
    } else {
        return Err(bad(format!(
            "shape {:?}: expected blocks {block:?}, per channel [{rows}, 1] or per tensor [1]",
            scale.shape
        )));
    };
    out_codes.copy_from_slice(codes);
    for r in 0..rows {
        for gi in 0..g {
            let s = val(index(r, gi));
            if !s.is_finite() {
                return Err(bad(format!("non-finite scale {s} at row {r}, group {gi}")));
            }
            let at = 4 * (r * g + gi);
            out_scales[at..at + 4].copy_from_slice(&s.to_le_bytes());
        }
    }
    Ok(())
}

/// Checks `quantization_config` of `dir/config.json` (top level or `text_config`): absent,
/// `kvstream`, `fp8` with `weight_block_size` [128, 128] (or none) and `compressed-tensors` are
/// accepted; anything else is a [`ModelError::Config`] naming the key.
pub(crate) fn check_quantization_config(dir: &Path) -> Result<(), ModelError> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(()); // QwenConfig reported it already
    };
    let Ok(v) = serde_json::from_str::<Value>(&text) else {
        return Ok(());
    };
    for (at, q) in [
        ("quantization_config", v.get("quantization_config")),
        (
            "text_config.quantization_config",
            v.get("text_config")
                .and_then(|t| t.get("quantization_config")),
        ),
    ] {
        let Some(q) = q else { continue };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        match method {
            "kvstream" | "compressed-tensors" => {}
            "fp8" => {
                if let Some(b) = q.get("weight_block_size") {
                    if b != &serde_json::json!([128, 128]) {
                        return Err(ModelError::config(
                            &path,
                            format!("{at}.weight_block_size"),
                            format!("{b} (only [128, 128] blocks are supported)"),
                        ));
                    }
                }
            }
            other => {
                return Err(ModelError::config(
                    &path,
                    format!("{at}.quant_method"),
                    format!("`{other}` (supported: fp8, compressed-tensors, kvstream)"),
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::weight_format::{dequantize, f32_to_e4m3};

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// Block, per-channel and per-tensor scales give value = e4m3(q) · scale of the right
    /// (row, column) block; a wrong scale shape is a typed error naming both tensors.
    #[test]
    fn fp8_scale_forms_map_to_the_kvstream_layout() {
        let (n, k) = (200usize, 300usize);
        let codes: Vec<u8> = (0..n * k)
            .map(|i| f32_to_e4m3(((i * 37 % 101) as f32 - 50.0) / 7.0))
            .collect();
        let base = dequantize(
            WeightDType::F8E4M3,
            &fp8_blob(
                "w",
                &codes,
                &[n, k],
                &ScaleRef {
                    name: "s",
                    dtype: WeightDType::F32,
                    shape: &[1],
                    bytes: &f32s(&[1.0]),
                },
            )
            .expect("unit"),
            &[n, k],
        )
        .expect("deq");
        let blocks: Vec<f32> = (0..2 * 3).map(|i| 0.5 + i as f32).collect();
        let chan: Vec<f32> = (0..n).map(|i| 0.01 * (i + 1) as f32).collect();
        let cases: Vec<(Vec<usize>, Vec<f32>, Box<dyn Fn(usize, usize) -> f32>)> = vec![
            (
                vec![2, 3],
                blocks.clone(),
                Box::new(|r, c| blocks[(r / 128) * 3 + c / 128]),
            ),
            (vec![n, 1], chan.clone(), Box::new(|r, _| chan[r])),
            (vec![], vec![0.25], Box::new(|_, _| 0.25)),
        ];
        for (shape, s, want) in &cases {
            let blob = fp8_blob(
                "w",
                &codes,
                &[n, k],
                &ScaleRef {
                    name: "s",
                    dtype: WeightDType::F32,
                    shape,
                    bytes: &f32s(s),
                },
            )
            .expect("blob");
            let v = dequantize(WeightDType::F8E4M3, &blob, &[n, k]).expect("deq");
            for r in (0..n).step_by(7) {
                for c in (0..k).step_by(11) {
                    assert_eq!(
                        v[r * k + c],
                        base[r * k + c] * want(r, c),
                        "{shape:?} {r} {c}"
                    );
                }
            }
        }
        let e = fp8_blob(
            "m.weight",
            &codes,
            &[n, k],
            &ScaleRef {
                name: "m.weight_scale_inv",
                dtype: WeightDType::F32,
                shape: &[3, 3],
                bytes: &f32s(&[1.0; 9]),
            },
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(
            e.contains("m.weight") && e.contains("m.weight_scale_inv"),
            "{e}"
        );
    }
}
