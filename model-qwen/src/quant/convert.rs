//! Converting one tensor between stored formats at load time, in parallel over row blocks
//! (rayon), writing straight into the final blob: host memory holds the converted tensor plus
//! one f32 row block per thread, never a second full-precision copy.

use crate::error::ModelError;
use crate::weights::TensorRef;
use half::{bf16, f16};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::WeightData;
use kvstream_memory_contracts::weight_format::{
    dequantize_row, quant_layout, quantize, QuantLayout, WeightFormatError,
};
use rayon::prelude::*;

/// Values per row block handed to one rayon task.
const BLOCK_VALUES: usize = 1 << 16;

fn fmt_err(name: &str) -> impl Fn(WeightFormatError) -> ModelError + '_ {
    move |source| ModelError::WeightFormat {
        name: name.to_string(),
        source,
    }
}

/// Bytes of codes per row of a blob of `layout` in `dtype` (the element bytes for plain types).
pub(crate) fn code_bytes_per_row(dtype: WeightDType, k: usize) -> usize {
    match dtype {
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => k / 2,
        WeightDType::Q8_0 | WeightDType::F8E4M3 => k,
        plain => k * plain.size(),
    }
}

/// Scale bytes per row of a blob of `layout` (0 for plain types).
pub(crate) fn scale_bytes_per_row(layout: &QuantLayout) -> usize {
    (layout.total - layout.scales_offset)
        .checked_div(layout.rows)
        .unwrap_or(0)
}

/// Decodes rows `first..first + n` of a tensor (`dims`, `dtype`, whole blob `bytes`) into
/// `out` (`n · K` values). Plain types are decoded exactly (f16/bf16 → f32 is exact).
pub(crate) fn decode_rows(
    dtype: WeightDType,
    bytes: &[u8],
    dims: &[usize],
    first: usize,
    out: &mut [f32],
) -> Result<(), WeightFormatError> {
    let layout = quant_layout(dtype, dims)?;
    let k = layout.k;
    if k == 0 || out.len() % k != 0 || bytes.len() != layout.total {
        return Err(WeightFormatError::Length {
            dtype,
            expected: layout.total,
            got: bytes.len(),
        });
    }
    let n = out.len() / k;
    if first + n > layout.rows {
        return Err(WeightFormatError::Shape {
            dtype,
            dims: dims.to_vec(),
            reason: format!("rows {first}..{} out of {}", first + n, layout.rows),
        });
    }
    if dtype.is_quantized() {
        for (i, row) in out.chunks_exact_mut(k).enumerate() {
            dequantize_row(dtype, bytes, dims, first + i, row)?;
        }
        return Ok(());
    }
    let sz = dtype.size();
    let src = &bytes[first * k * sz..(first + n) * k * sz];
    for (o, c) in out.iter_mut().zip(src.chunks_exact(sz)) {
        *o = match dtype {
            WeightDType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
            WeightDType::Bf16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
            _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        };
    }
    Ok(())
}

/// Scale bytes of one row of `k` values in `dtype` (0 for plain types).
pub(crate) fn scale_bytes_of_row(dtype: WeightDType, k: usize) -> Result<usize, WeightFormatError> {
    let one = quant_layout(dtype, &[1, k])?;
    Ok(one.total - one.scales_offset)
}

/// The code section `[0, R·cb)` and the scale section `[scales_offset, total)` of a blob `out`
/// of `layout` (the scale section is empty for plain types).
pub(crate) fn sections<'b>(
    dtype: WeightDType,
    layout: &QuantLayout,
    out: &'b mut [u8],
) -> Result<(&'b mut [u8], &'b mut [u8]), WeightFormatError> {
    if out.len() != layout.total {
        return Err(WeightFormatError::Length {
            dtype,
            expected: layout.total,
            got: out.len(),
        });
    }
    let cb = code_bytes_per_row(dtype, layout.k);
    let (codes, scales) = out.split_at_mut(layout.scales_offset);
    Ok((&mut codes[..layout.rows * cb], scales))
}

/// Fills the blob `out` (layout `layout` of `dtype`) block by block in parallel: `fill(first_row,
/// rows, block_blob)` must return the blob of rows `first_row..first_row + rows` in the same
/// dtype (as `quantize` lays it out for dims `[rows, K]`), which is spliced into place.
pub(crate) fn fill_blocks(
    dtype: WeightDType,
    layout: &QuantLayout,
    out: &mut [u8],
    fill: impl Fn(usize, usize) -> Result<Vec<u8>, WeightFormatError> + Sync,
) -> Result<(), WeightFormatError> {
    let (codes, scales) = sections(dtype, layout, out)?;
    fill_sections(dtype, layout.k, codes, scales, fill)
}

/// [`fill_blocks`] into the two sections of a tensor of `codes.len() / cb` rows of `k` values:
/// `codes` (row-major codes or elements) and `scales` (row-major scales, empty for plain
/// types). They may be row ranges of a larger blob (a fused weight: rows concatenated).
pub(crate) fn fill_sections(
    dtype: WeightDType,
    k: usize,
    codes: &mut [u8],
    scales: &mut [u8],
    fill: impl Fn(usize, usize) -> Result<Vec<u8>, WeightFormatError> + Sync,
) -> Result<(), WeightFormatError> {
    let rb = (BLOCK_VALUES / k.max(1)).max(1);
    let cb = code_bytes_per_row(dtype, k);
    let sb = scale_bytes_of_row(dtype, k)?;
    let r = codes.len() / cb.max(1);
    if codes.len() != r * cb || scales.len() != r * sb {
        return Err(WeightFormatError::Length {
            dtype,
            expected: r * (cb + sb),
            got: codes.len() + scales.len(),
        });
    }
    let splice = |i: usize, codes: &mut [u8], scales: &mut [u8]| {
        let first = i * rb;
        let n = codes.len() / cb.max(1);
        let blob = fill(first, n)?;
        let bl = quant_layout(dtype, &[n, k])?;
        if blob.len() != bl.total {
            return Err(WeightFormatError::Length {
                dtype,
                expected: bl.total,
                got: blob.len(),
            });
        }
        codes.copy_from_slice(&blob[..n * cb]);
        scales.copy_from_slice(&blob[bl.scales_offset..bl.scales_offset + n * sb]);
        Ok(())
    };
    if sb == 0 || cb == 0 {
        codes
            .par_chunks_mut((rb * cb).max(1))
            .enumerate()
            .try_for_each(|(i, c)| splice(i, c, &mut []))
    } else {
        codes
            .par_chunks_mut(rb * cb)
            .zip(scales.par_chunks_mut(rb * sb))
            .enumerate()
            .try_for_each(|(i, (c, s))| splice(i, c, s))
    }
}

/// Writes `t` converted to `target` into `codes` / `scales`, the two sections of its rows in a
/// blob of `target` (see [`fill_sections`]): copied when `t` already has that dtype, else
/// decoded and quantized block by block (the same bytes as [`convert`]). Errors name `name`.
pub(crate) fn convert_into(
    name: &str,
    t: &TensorRef,
    target: WeightDType,
    codes: &mut [u8],
    scales: &mut [u8],
) -> Result<(), ModelError> {
    let layout = quant_layout(target, &t.shape).map_err(fmt_err(name))?;
    let k = layout.k;
    let cb = code_bytes_per_row(target, k);
    let sb = scale_bytes_of_row(target, k).map_err(fmt_err(name))?;
    if codes.len() != layout.rows * cb || scales.len() != layout.rows * sb {
        return Err(fmt_err(name)(WeightFormatError::Length {
            dtype: target,
            expected: layout.rows * (cb + sb),
            got: codes.len() + scales.len(),
        }));
    }
    let (src, dims, dt) = (t.data.bytes(), &t.shape, t.dtype);
    if dt == target {
        if src.len() != layout.total {
            return Err(fmt_err(name)(WeightFormatError::Length {
                dtype: target,
                expected: layout.total,
                got: src.len(),
            }));
        }
        codes.copy_from_slice(&src[..codes.len()]);
        let so = layout.scales_offset;
        scales.copy_from_slice(&src[so..so + scales.len()]);
        return Ok(());
    }
    let _s = tracing::debug_span!("quantize_tensor", name, from = %dt, to = %target).entered();
    fill_sections(target, k, codes, scales, |first, n| {
        let mut vals = vec![0f32; n * k];
        decode_rows(dt, src, dims, first, &mut vals)?;
        quantize(target, &vals, &[n, k])
    })
    .map_err(fmt_err(name))
}

/// `t` converted to `target` (a quantized format or a plain element type); `t` itself when it
/// already has that dtype. Errors name the tensor.
pub(crate) fn convert(
    name: &str,
    t: TensorRef,
    target: WeightDType,
) -> Result<TensorRef, ModelError> {
    if t.dtype == target {
        return Ok(t);
    }
    let _s = tracing::debug_span!("quantize_tensor", name, from = %t.dtype, to = %target).entered();
    let layout = quant_layout(target, &t.shape).map_err(fmt_err(name))?;
    let k = layout.k;
    let mut out = vec![0u8; layout.total];
    let (src, dims, dt) = (t.data.bytes(), &t.shape, t.dtype);
    fill_blocks(target, &layout, &mut out, |first, n| {
        let mut vals = vec![0f32; n * k];
        decode_rows(dt, src, dims, first, &mut vals)?;
        quantize(target, &vals, &[n, k])
    })
    .map_err(fmt_err(name))?;
    Ok(TensorRef {
        dtype: target,
        shape: t.shape,
        data: WeightData::from_vec(out),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::weight_format::dequantize;
    use rand::{Rng, SeedableRng};

    fn tensor(vals: &[f32], dims: &[usize]) -> TensorRef {
        TensorRef {
            dtype: WeightDType::F32,
            shape: dims.to_vec(),
            data: WeightData::from_vec(vals.iter().flat_map(|v| v.to_le_bytes()).collect()),
        }
    }

    /// Blocked parallel conversion equals one whole-tensor `quantize` byte for byte, for every
    /// format, with several row blocks and a row count that is not a multiple of 16.
    #[test]
    fn blocked_conversion_equals_whole_tensor_quantize() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        let (r, k) = (1037usize, 256usize);
        let vals: Vec<f32> = (0..r * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for dt in [
            WeightDType::Q8_0,
            WeightDType::Q4G128,
            WeightDType::F8E4M3,
            WeightDType::Bf16,
            WeightDType::Q4NlG128,
        ] {
            let got = convert("w", tensor(&vals, &[r, k]), dt).expect("convert");
            let want = quantize(dt, &vals, &[r, k]).expect("quantize");
            assert_eq!(got.data.bytes(), &want[..], "{dt}");
            assert_eq!(got.dtype, dt);
            // And back: a second conversion of a quantized tensor decodes it first.
            let back = convert("w", got, WeightDType::F32).expect("back");
            let deq = dequantize(dt, &want, &[r, k]).expect("deq");
            let bf: Vec<f32> = back
                .data
                .bytes()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(bf, deq, "{dt}");
        }
        let e = convert(
            "x.weight",
            tensor(&vals[..r * 100], &[r, 100]),
            WeightDType::Q4G128,
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(e.contains("x.weight"), "{e}");
    }

    /// The blob of two tensors' rows concatenated, built by writing each (converted, or copied
    /// when already in the target format) into its row range of the code and scale sections,
    /// equals the separate blobs section by section and decodes to their rows, for every
    /// stored dtype (plain and quantized) and every target: row-wise formats with per-row
    /// groups make fused loading exact without requantizing anything twice.
    #[test]
    fn rows_written_into_sections_equal_the_separate_blobs() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let k = 256usize;
        let rows = [96usize, 40];
        let vals: Vec<Vec<f32>> = rows
            .iter()
            .map(|r| (0..r * k).map(|_| rng.random_range(-1.0f32..1.0)).collect())
            .collect();
        let all = [
            WeightDType::F32,
            WeightDType::Bf16,
            WeightDType::F16,
            WeightDType::Q8_0,
            WeightDType::Q4G128,
            WeightDType::Q4NlG128,
            WeightDType::F8E4M3,
        ];
        for stored in all {
            let parts: Vec<TensorRef> = vals
                .iter()
                .zip(rows)
                .map(|(v, r)| convert("p", tensor(v, &[r, k]), stored).expect("stored"))
                .collect();
            for target in all {
                let what = format!("{stored} -> {target}");
                let sep: Vec<TensorRef> = parts
                    .iter()
                    .map(|t| convert("p", t.clone(), target).expect("separate"))
                    .collect();
                let fused_dims = [rows[0] + rows[1], k];
                let layout = quant_layout(target, &fused_dims).expect("layout");
                let mut blob = vec![0u8; layout.total];
                let (cb, sb) = (
                    code_bytes_per_row(target, k),
                    scale_bytes_of_row(target, k).expect("sb"),
                );
                {
                    let (mut codes, mut scales) = sections(target, &layout, &mut blob).expect("s");
                    for (t, r) in parts.iter().zip(rows) {
                        let (c, rc) = std::mem::take(&mut codes).split_at_mut(r * cb);
                        let (sc, rs) = std::mem::take(&mut scales).split_at_mut(r * sb);
                        convert_into("p", t, target, c, sc).expect("into");
                        (codes, scales) = (rc, rs);
                    }
                }
                let mut want_codes = Vec::new();
                let mut want_scales = Vec::new();
                for (t, r) in sep.iter().zip(rows) {
                    let l = quant_layout(target, &[r, k]).expect("l");
                    let b = t.data.bytes();
                    want_codes.extend_from_slice(&b[..r * cb]);
                    want_scales.extend_from_slice(&b[l.scales_offset..l.total]);
                }
                assert_eq!(&blob[..fused_dims[0] * cb], &want_codes[..], "{what}");
                assert_eq!(&blob[layout.scales_offset..], &want_scales[..], "{what}");
                assert!(blob[fused_dims[0] * cb..layout.scales_offset]
                    .iter()
                    .all(|b| *b == 0));
                let deq = dequantize(target, &blob, &fused_dims).expect("deq");
                let mut want = Vec::new();
                for (t, r) in sep.iter().zip(rows) {
                    want.extend(dequantize(target, t.data.bytes(), &[r, k]).expect("deq"));
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&deq), bits(&want), "{what}");
                if target == stored {
                    // Stored in the target format: copied, never requantized.
                    assert_eq!(
                        bits(&deq[..rows[0] * k]),
                        bits(&dequantize(target, parts[0].data.bytes(), &[rows[0], k]).expect("d"))
                    );
                }
            }
        }
    }
}
