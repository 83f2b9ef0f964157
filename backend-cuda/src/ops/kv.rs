//! `KvOps`: quantise-and-write of K/V rows into device pages (F32, F16, BF16, Q8_0, Q4_0), bit-
//! identical to the CPU encoder of `memory_contracts::kv::format`.

use crate::launch::{args, grid1d};
use crate::{CudaBackend, CudaBuffer, CudaTensor};
use kvstream_memory_contracts::backend::DeviceTensor;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::KvOps;
use kvstream_memory_contracts::transfer::check_range;

/// Kernel code of a KV type (matches `common.cuh`).
pub(crate) fn kv_code(t: kvstream_memory_contracts::kv::format::KvType) -> i32 {
    use kvstream_memory_contracts::kv::format::KvType;
    match t {
        KvType::F32 => 0,
        KvType::F16 => 1,
        KvType::Bf16 => 2,
        KvType::Q8_0 => 3,
        KvType::Q4_0 => 4,
    }
}

impl KvOps for CudaBackend {
    fn kv_write(
        &self,
        k: &CudaTensor,
        v: &CudaTensor,
        geometry: &PageGeometry,
        pool: &CudaBuffer,
        rows: &[(usize, usize)],
    ) -> Result<(), OpError> {
        let n = rows.len();
        let rv = geometry.row_values();
        for (name, t) in [("k", k), ("v", v)] {
            if t.numel() != n * rv {
                return Err(OpError::shape(
                    "kv_write",
                    format!("{name} {:?} is not [{n}, {rv}]", t.dims),
                ));
            }
        }
        let mut flat = Vec::with_capacity(2 * n);
        for &(ko, vo) in rows {
            check_range("kv pool", ko, geometry.k_row_bytes(), pool.len)?;
            check_range("kv pool", vo, geometry.v_row_bytes(), pool.len)?;
            flat.push(ko as u64);
            flat.push(vo as u64);
        }
        if n == 0 {
            return Ok(());
        }
        let rows_dev = self.upload(&flat, "kv rows")?;
        let f = self.func("kv_write")?;
        let (kp, vp, pp, rp, n64, rv32) = (
            k.ptr(),
            v.ptr(),
            pool.ptr(),
            rows_dev.ptr(),
            n as u64,
            rv as i32,
        );
        let (kt, vt) = (kv_code(geometry.k_type()), kv_code(geometry.v_type()));
        let (kb, vb) = (
            geometry.k_type().block_bytes() as i32,
            geometry.v_type().block_bytes() as i32,
        );
        let mut a = args![&kp, &vp, &pp, &rp, &n64, &rv32, &kt, &vt, &kb, &vb];
        self.launch("kv_write", f, grid1d(n * 2 * rv.div_ceil(32), 128), &mut a)
    }
}
