//! `KvOps::kv_write` for the CPU backend: encode K/V rows in the geometry's formats and write
//! them into the pool at the given (range-checked) byte offsets.

use crate::{CpuBackend, CpuBuffer, CpuTensor};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::KvOps;
use kvstream_memory_contracts::transfer::check_range;
use rayon::prelude::*;

/// Encodes `n` rows of `row_values` f32 into `n` rows of `row_bytes` bytes.
fn encode_rows(
    ty: KvType,
    src: &[f32],
    row_values: usize,
    row_bytes: usize,
) -> Result<Vec<u8>, OpError> {
    let n = src.len() / row_values.max(1);
    let mut out = vec![0u8; n * row_bytes];
    out.par_chunks_mut(row_bytes)
        .zip(src.par_chunks(row_values))
        .try_for_each(|(o, x)| encode(ty, x, o))
        .map_err(|e| OpError::shape("kv_write", e.to_string()))?;
    Ok(out)
}

impl KvOps for CpuBackend {
    /// Checks every offset before writing anything, so a bad row leaves the pool untouched.
    fn kv_write(
        &self,
        k: &CpuTensor,
        v: &CpuTensor,
        geometry: &PageGeometry,
        pool: &CpuBuffer,
        rows: &[(usize, usize)],
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("cpu_kv_write", rows = rows.len()).entered();
        let rv = geometry.row_values();
        let n = rows.len();
        for (name, t) in [("k", k), ("v", v)] {
            if t.data.len() != n * rv {
                return Err(OpError::shape(
                    "kv_write",
                    format!(
                        "`{name}` has {} values, expected {n} rows × {rv}",
                        t.data.len()
                    ),
                ));
            }
        }
        let (kr, vr) = (geometry.k_row_bytes(), geometry.v_row_bytes());
        for &(ko, vo) in rows {
            check_range("kv pool", ko, kr, pool.0.len())?;
            check_range("kv pool", vo, vr, pool.0.len())?;
        }
        let kbytes = encode_rows(geometry.k_type(), &k.data, rv, kr)?;
        let vbytes = encode_rows(geometry.v_type(), &v.data, rv, vr)?;
        let dev = |e: kvstream_memory_contracts::error::HostError| OpError::Device {
            op: "kv_write",
            detail: e.to_string(),
        };
        for (i, &(ko, vo)) in rows.iter().enumerate() {
            pool.0
                .write(ko, &kbytes[i * kr..(i + 1) * kr])
                .map_err(dev)?;
            pool.0
                .write(vo, &vbytes[i * vr..(i + 1) * vr])
                .map_err(dev)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::error::TransferError;
    use kvstream_memory_contracts::transfer::DeviceMemory;

    #[test]
    fn rows_land_at_their_offsets_and_bad_inputs_are_typed_errors() {
        let b = CpuBackend::new();
        let g = PageGeometry::new(4, 1, 32, KvType::Q4_0, KvType::F16).expect("geometry");
        let pool = b.alloc_buffer(2 * g.page_bytes()).expect("pool");
        let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let v: Vec<f32> = (0..64).map(|i| (i as f32 * 0.11).cos()).collect();
        let kt = CpuTensor::new(k.clone(), vec![2, 32]);
        let vt = CpuTensor::new(v.clone(), vec![2, 32]);
        // Token 5 first, then token 2: order of rows is free.
        let rows = [
            (g.k_row_offset(0, 0, 5), g.v_row_offset(0, 0, 5)),
            (g.k_row_offset(0, 0, 2), g.v_row_offset(0, 0, 2)),
        ];
        b.kv_write(&kt, &vt, &g, &pool, &rows).expect("kv_write");
        let mut want = vec![0u8; g.k_row_bytes()];
        encode(KvType::Q4_0, &k[32..], &mut want).expect("encode");
        let mut got = vec![0u8; g.k_row_bytes()];
        pool.0.read(rows[1].0, &mut got).expect("read");
        assert_eq!(got, want);
        let bad = [rows[0], (rows[1].0, 2 * g.page_bytes())];
        assert!(matches!(
            b.kv_write(&kt, &vt, &g, &pool, &bad),
            Err(OpError::Transfer(TransferError::OutOfRange { .. }))
        ));
        assert!(matches!(
            b.kv_write(&kt, &vt, &g, &pool, &rows[..1]),
            Err(OpError::Shape { .. })
        ));
    }
}
