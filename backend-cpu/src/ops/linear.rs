//! `LinearOps` for the CPU backend: zero-copy weights, embedding gathers and `matmul`.
//!
//! `matmul` computes every output element as one [`WeightView::dot_row`] (the fixed-order dot of
//! `weights`), whatever the number of rows T:
//! * T ≤ [`GEMV_MAX_ROWS`]: a GEMV that streams the weight once, rows chunked over rayon tasks,
//!   converting bf16 → f32 by bit shifts inside the inner loop;
//! * larger T: blocks of weight rows are decoded to an f32 tile (bounded scratch,
//!   [`TILE_BYTES`]) and multiplied with the `gemm` crate, one block per rayon task.
//!
//! Every GEMV output element is the same fixed-order dot product whatever T ≤ 8 is, so a
//! 4-token verification equals 4 single-token steps bit for bit. The GEMM path (prefill) is
//! accurate to f32 rounding but not bit-identical to the GEMV.
//!
//! Quantized weights (`q8_0`, `q4_g128`, `fp8_e4m3`) are read in place: the GEMV decodes each
//! block of a weight row once into a stack buffer and accumulates all T inputs against it
//! ([`WeightView::dot_rows`]), so it equals the GEMV over the dequantized f32 weight bit for
//! bit; the GEMM path dequantizes row blocks into its f32 tile. `embedding` on a quantized table
//! dequantizes the requested rows.

use super::weights::{alignment, view, WeightView};
use crate::{CpuBackend, CpuTensor, CpuWeight};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{LinearOps, WeightData};
use rayon::prelude::*;
use std::sync::Arc;

/// Largest T served by the GEMV path.
pub const GEMV_MAX_ROWS: usize = 8;
/// Bytes of decoded f32 weight rows per task in the blocked path.
pub const TILE_BYTES: usize = 2 * 1024 * 1024;

/// Owned, 8-byte aligned bytes (used when a source tensor is not aligned to its element size).
struct AlignedBytes {
    words: Vec<u64>,
    len: usize,
}

impl AsRef<[u8]> for AlignedBytes {
    fn as_ref(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

fn rows_per_task(n: usize, row_bytes: usize) -> usize {
    // About 256 KiB of weights per task, and at least 4 tasks per thread when possible.
    let by_bytes = (256 * 1024 / row_bytes.max(1)).max(1);
    let by_threads = n.div_ceil(rayon::current_num_threads() * 4).max(1);
    by_bytes.min(by_threads).max(1)
}

/// `out[n·T + t] = x_t · w_n` for rows `n` of one task (transposed output block).
///
/// f32/bf16 rows are dotted in place per input; other dtypes decode each block of a row once
/// for all T inputs. Either way `out[n·T + t]` is the fixed-order dot of `x_t` and row n.
fn gemv_block(wv: &WeightView<'_>, x: &[f32], k: usize, t: usize, first: usize, out: &mut [f32]) {
    let in_place = matches!(wv, WeightView::F32(_) | WeightView::Bf16(_));
    for (i, o) in out.chunks_exact_mut(t).enumerate() {
        let start = (first + i) * k;
        if in_place {
            for (tt, v) in o.iter_mut().enumerate() {
                *v = wv.dot_row(&x[tt * k..(tt + 1) * k], start);
            }
        } else {
            wv.dot_rows(x, k, start, o);
        }
    }
}

/// `out[j·T + t] = x_t · w_{first+j}` for one block of weight rows, via the `gemm` crate on an
/// f32 tile decoded from the stored dtype (scratch bounded by [`TILE_BYTES`]).
fn gemm_block(wv: &WeightView<'_>, x: &[f32], k: usize, t: usize, first: usize, out: &mut [f32]) {
    let rows = out.len() / t;
    let mut tile = vec![0f32; rows * k];
    wv.decode(first * k, &mut tile);
    let (ki, ti) = (k as isize, t as isize);
    // SAFETY: every pointer/stride pair addresses only inside its slice: dst (t × rows) at
    // out[j·T + i] (out.len() = rows·T), lhs (t × k) at x[i·K + kk] (x.len() = T·K), rhs
    // (k × rows) at tile[j·K + kk] (tile.len() = rows·K). `read_dst = false`, so the
    // uninitialised-content rule of gemm does not apply; no other thread touches these slices.
    unsafe {
        gemm::gemm(
            t,
            rows,
            k,
            out.as_mut_ptr(),
            ti,
            1,
            false,
            x.as_ptr(),
            1,
            ki,
            tile.as_ptr(),
            ki,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
}

impl LinearOps for CpuBackend {
    fn prefetch_weight(&self, w: &CpuWeight) -> Result<(), OpError> {
        let _ = w;
        self.prefetch_hints
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    fn load_weight(
        &self,
        name: &str,
        dtype: WeightDType,
        dims: &[usize],
        data: WeightData,
    ) -> Result<CpuWeight, OpError> {
        let expected = dtype
            .storage_bytes(dims)
            .map_err(|e| OpError::shape("load_weight", format!("`{name}`: {e}")))?;
        if expected != data.len {
            return Err(OpError::shape(
                "load_weight",
                format!(
                    "`{name}`: {} bytes for {dims:?} {dtype} (expected {expected})",
                    data.len
                ),
            ));
        }
        let all: &[u8] = (*data.source).as_ref();
        if data
            .offset
            .checked_add(data.len)
            .is_none_or(|e| e > all.len())
        {
            return Err(OpError::shape(
                "load_weight",
                format!("`{name}`: byte range outside its source"),
            ));
        }
        let aligned = data.bytes().as_ptr() as usize % alignment(dtype) == 0;
        let data = if aligned {
            data
        } else {
            let mut words = vec![0u64; data.len.div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..data.len]
                .copy_from_slice(data.bytes());
            WeightData {
                source: Arc::new(AlignedBytes {
                    words,
                    len: data.len,
                }),
                offset: 0,
                len: data.len,
            }
        };
        Ok(CpuWeight {
            dtype,
            dims: dims.to_vec(),
            data,
        })
    }

    fn embedding(&self, table: &CpuWeight, ids: &[u32]) -> Result<CpuTensor, OpError> {
        let _s = tracing::trace_span!("cpu.embedding", n = ids.len()).entered();
        let [v, h] = table.dims[..] else {
            return Err(OpError::shape(
                "embedding",
                format!("table dims {:?} are not [V, H]", table.dims),
            ));
        };
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= v) {
            return Err(OpError::shape(
                "embedding",
                format!("token id {bad} >= vocabulary {v}"),
            ));
        }
        let wv = view(table)?;
        let mut data = vec![0f32; ids.len() * h];
        for (row, &id) in data.chunks_exact_mut(h.max(1)).zip(ids) {
            wv.decode(id as usize * h, row);
        }
        Ok(CpuTensor::new(data, vec![ids.len(), h]))
    }

    fn matmul(&self, x: &CpuTensor, w: &CpuWeight) -> Result<CpuTensor, OpError> {
        let [n, k] = w.dims[..] else {
            return Err(OpError::shape(
                "matmul",
                format!("weight dims {:?} are not [N, K]", w.dims),
            ));
        };
        if k == 0 || x.data.len() % k != 0 || x.dims.last() != Some(&k) {
            return Err(OpError::shape(
                "matmul",
                format!(
                    "x {:?} does not end in K = {k} (weight {:?})",
                    x.dims, w.dims
                ),
            ));
        }
        let t = x.data.len() / k;
        let _s = tracing::trace_span!("cpu.matmul", t, n, k).entered();
        let wv = view(w)?;
        if t == 0 || n == 0 {
            return Ok(CpuTensor::new(vec![], vec![t, n]));
        }
        // Output transposed ([N, T]) so each task owns a contiguous block.
        let mut out_t = vec![0f32; n * t];
        let xs = &x.data;
        if t <= GEMV_MAX_ROWS {
            let rpt = rows_per_task(n, w.data.len / n);
            out_t
                .par_chunks_mut(rpt * t)
                .enumerate()
                .for_each(|(i, o)| gemv_block(&wv, xs, k, t, i * rpt, o));
        } else {
            // Block size depends on K only, so results never depend on the thread count.
            let rpt = (TILE_BYTES / (4 * k)).clamp(16, 256);
            out_t
                .par_chunks_mut(rpt * t)
                .enumerate()
                .for_each(|(i, o)| gemm_block(&wv, xs, k, t, i * rpt, o));
        }
        let data = if t == 1 {
            out_t
        } else {
            let mut d = vec![0f32; n * t];
            d.par_chunks_mut(n).enumerate().for_each(|(tt, row)| {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = out_t[j * t + tt];
                }
            });
            d
        };
        Ok(CpuTensor::new(data, vec![t, n]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_abs_diff, tensor, weight, Rng};

    #[test]
    fn matmul_matches_f64_reference_for_all_dtypes_and_widths() {
        let b = CpuBackend::new();
        let mut r = Rng::new(3);
        let (n, k) = (37, 70);
        let vals = r.vec(n * k, 0.5);
        for dt in [WeightDType::F32, WeightDType::Bf16, WeightDType::F16] {
            let (w, held) = weight(&b, dt, &vals, &[n, k]);
            for t in [1usize, 3, 8, 9, 33] {
                let x = r.vec(t * k, 1.0);
                let y = b.matmul(&tensor(x.clone(), &[t, k]), &w).expect("matmul");
                assert_eq!(y.dims, vec![t, n]);
                let reference: Vec<f64> = (0..t * n)
                    .map(|i| {
                        let (tt, nn) = (i / n, i % n);
                        (0..k)
                            .map(|j| f64::from(x[tt * k + j]) * f64::from(held[nn * k + j]))
                            .sum()
                    })
                    .collect();
                assert!(max_abs_diff(&y.data, &reference) < 1e-5, "{dt} t={t}");
            }
        }
    }

    #[test]
    fn matmul_rows_are_bit_identical_whatever_t() {
        let b = CpuBackend::new();
        let mut r = Rng::new(4);
        let (n, k) = (50, 96);
        for dt in [WeightDType::Bf16, WeightDType::F32, WeightDType::F16] {
            let (w, _) = weight(&b, dt, &r.vec(n * k, 0.5), &[n, k]);
            let x = r.vec(8 * k, 1.0);
            let single: Vec<f32> = (0..8)
                .flat_map(|i| {
                    b.matmul(&tensor(x[i * k..(i + 1) * k].to_vec(), &[1, k]), &w)
                        .expect("gemv")
                        .data
                })
                .collect();
            for t in [2usize, 4, 8] {
                let part = b
                    .matmul(&tensor(x[..t * k].to_vec(), &[t, k]), &w)
                    .expect("gemv");
                let same = part
                    .data
                    .iter()
                    .zip(&single[..t * n])
                    .all(|(a, c)| a.to_bits() == c.to_bits());
                assert!(same, "{dt} t={t}");
            }
        }
    }

    #[test]
    fn embedding_gathers_rows_and_rejects_bad_ids() {
        let b = CpuBackend::new();
        let mut r = Rng::new(5);
        let (v, h) = (11, 6);
        let (w, held) = weight(&b, WeightDType::Bf16, &r.vec(v * h, 1.0), &[v, h]);
        let e = b.embedding(&w, &[3, 0, 10]).expect("embed");
        assert_eq!(&e.data[..h], &held[3 * h..4 * h]);
        assert_eq!(&e.data[2 * h..], &held[10 * h..]);
        assert!(b.embedding(&w, &[11]).is_err());
        assert!(b
            .load_weight(
                "x",
                WeightDType::F32,
                &[3],
                WeightData::from_vec(vec![0; 8])
            )
            .is_err());
    }

    const QUANT: [WeightDType; 4] = [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ];

    #[test]
    fn quantized_matmul_matches_the_dequantized_f32_matmul() {
        let b = CpuBackend::new();
        let mut r = Rng::new(31);
        for (dt, k) in [
            (WeightDType::Q8_0, 96usize),
            (WeightDType::Q4G128, 256),
            (WeightDType::F8E4M3, 200),
            (WeightDType::Q4NlG128, 256),
        ] {
            let n = 41;
            let (w, held) = weight(&b, dt, &r.vec(n * k, 0.5), &[n, k]);
            let (wf, _) = weight(&b, WeightDType::F32, &held, &[n, k]);
            for t in [1usize, 2, 8, 9, 40] {
                let x = r.vec(t * k, 1.0);
                let xt = tensor(x.clone(), &[t, k]);
                let y = b.matmul(&xt, &w).expect("quantized matmul");
                let yf = b.matmul(&xt, &wf).expect("f32 matmul");
                assert_eq!(y.dims, vec![t, n]);
                for (i, (a, c)) in y.data.iter().zip(&yf.data).enumerate() {
                    let (tt, nn) = (i / n, i % n);
                    let mag: f64 = (0..k)
                        .map(|j| f64::from(x[tt * k + j]).abs() * f64::from(held[nn * k + j]).abs())
                        .sum();
                    let err = f64::from((a - c).abs());
                    assert!(err <= 1e-4 * mag.max(1e-6), "{dt} t={t} [{i}]: {a} vs {c}");
                }
                if t <= GEMV_MAX_ROWS {
                    // The GEMV reads the same values in the same order: bit-identical.
                    assert!(
                        y.data
                            .iter()
                            .zip(&yf.data)
                            .all(|(a, c)| a.to_bits() == c.to_bits()),
                        "{dt} t={t}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_gemv_rows_are_bit_identical_for_t_1_to_8() {
        let b = CpuBackend::new();
        let mut r = Rng::new(32);
        for (dt, k) in [
            (WeightDType::Q8_0, 160usize),
            (WeightDType::Q4G128, 128),
            (WeightDType::F8E4M3, 150),
            (WeightDType::Q4NlG128, 128),
        ] {
            let n = 29;
            let (w, _) = weight(&b, dt, &r.vec(n * k, 0.5), &[n, k]);
            let x = r.vec(8 * k, 1.0);
            let single: Vec<u32> = (0..8)
                .flat_map(|i| {
                    b.matmul(&tensor(x[i * k..(i + 1) * k].to_vec(), &[1, k]), &w)
                        .expect("gemv")
                        .data
                })
                .map(f32::to_bits)
                .collect();
            for t in 1..=GEMV_MAX_ROWS {
                let part = b
                    .matmul(&tensor(x[..t * k].to_vec(), &[t, k]), &w)
                    .expect("gemv");
                let bits: Vec<u32> = part.data.iter().map(|v| v.to_bits()).collect();
                assert_eq!(bits, single[..t * n], "{dt} t={t}");
            }
        }
    }

    #[test]
    fn embedding_of_quantized_rows_equals_dequantize_row() {
        let b = CpuBackend::new();
        let mut r = Rng::new(33);
        let (v, h) = (9usize, 256usize);
        for dt in QUANT {
            let vals = r.vec(v * h, 1.0);
            let bytes =
                kvstream_memory_contracts::weight_format::quantize(dt, &vals, &[v, h]).expect("q");
            let table = b
                .load_weight("emb", dt, &[v, h], WeightData::from_vec(bytes.clone()))
                .expect("load");
            let ids = [7u32, 0, 8, 7];
            let e = b.embedding(&table, &ids).expect("embed");
            let mut row = vec![0f32; h];
            for (i, &id) in ids.iter().enumerate() {
                kvstream_memory_contracts::weight_format::dequantize_row(
                    dt,
                    &bytes,
                    &[v, h],
                    id as usize,
                    &mut row,
                )
                .expect("row");
                assert_eq!(e.data[i * h..(i + 1) * h], row[..], "{dt} id {id}");
            }
            assert!(b.embedding(&table, &[9]).is_err());
        }
    }

    #[test]
    fn quantized_weights_of_wrong_length_or_k_are_typed_errors() {
        let b = CpuBackend::new();
        for dt in QUANT {
            let dims = [4usize, 128];
            let len = dt.storage_bytes(&dims).expect("size");
            for bad in [len - 1, len + 1, 4 * 128 * 4] {
                let r = b.load_weight("w", dt, &dims, WeightData::from_vec(vec![0; bad]));
                assert!(
                    matches!(&r, Err(OpError::Shape { op: "load_weight", detail }) if detail.contains(&len.to_string())),
                    "{dt} {bad}: {r:?}"
                );
            }
            assert!(b
                .load_weight("w", dt, &dims, WeightData::from_vec(vec![0; len]))
                .is_ok());
        }
        // K = 100 is fine for fp8 only.
        let r = b.load_weight(
            "w",
            WeightDType::Q8_0,
            &[2, 100],
            WeightData::from_vec(vec![0; 400]),
        );
        assert!(matches!(r, Err(OpError::Shape { .. })), "{r:?}");
        let len = WeightDType::F8E4M3.storage_bytes(&[2, 100]).expect("size");
        assert!(b
            .load_weight(
                "w",
                WeightDType::F8E4M3,
                &[2, 100],
                WeightData::from_vec(vec![0; len])
            )
            .is_ok());
    }

    #[test]
    fn misaligned_quantized_sources_are_copied_and_read_correctly() {
        let b = CpuBackend::new();
        let vals = Rng::new(34).vec(2 * 128, 1.0);
        let dims = [2usize, 128];
        for dt in QUANT {
            let bytes =
                kvstream_memory_contracts::weight_format::quantize(dt, &vals, &dims).expect("q");
            let mut shifted = vec![0u8];
            shifted.extend_from_slice(&bytes);
            let src = WeightData::from_vec(shifted);
            let data = WeightData {
                source: src.source.clone(),
                offset: 1,
                len: bytes.len(),
            };
            let w = b.load_weight("m", dt, &dims, data).expect("load");
            let e = b.embedding(&w, &[1]).expect("embed");
            let want = kvstream_memory_contracts::weight_format::dequantize(dt, &bytes, &dims)
                .expect("dq");
            assert_eq!(e.data, want[128..], "{dt}");
        }
    }

    #[test]
    fn misaligned_sources_are_copied_and_read_correctly() {
        let b = CpuBackend::new();
        let vals = [1.5f32, -2.25, 3.0];
        let mut bytes = vec![0u8];
        bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
        let src = WeightData::from_vec(bytes);
        let data = WeightData {
            source: src.source.clone(),
            offset: 1,
            len: 12,
        };
        let w = b
            .load_weight("m", WeightDType::F32, &[1, 3], data)
            .expect("load");
        let y = b
            .matmul(&tensor(vec![1.0, 1.0, 1.0], &[1, 3]), &w)
            .expect("mm");
        assert_eq!(y.data, vec![2.25]);
    }
}
