//! Helpers for the micro-benchmark example (`examples/cuda_bench.rs`).

use crate::launch::{args, dev};
use crate::{CudaBackend, CudaBuffer};
use cudarc::driver::LaunchConfig;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::transfer::check_range;

impl CudaBackend {
    /// Enqueues a vectorised read of the first `bytes` bytes of `buf` (a multiple of 16) on the
    /// compute stream: the HBM read roofline that GEMV and attention are compared with.
    pub fn bench_read(&self, buf: &CudaBuffer, bytes: usize) -> Result<(), OpError> {
        check_range("buffer", 0, bytes, buf.len)?;
        if bytes % 16 != 0 || buf.ptr() % 16 != 0 {
            return Err(OpError::shape("bench_read", "needs 16-byte multiples"));
        }
        let acc = self.alloc_bytes(4, "bench accumulator")?;
        self.ctx.bind_to_thread().map_err(dev("bench_read"))?;
        // SAFETY: `acc` holds 4 bytes; ordered on the compute stream.
        unsafe {
            cudarc::driver::result::memset_d8_async(acc.ptr(), 0, 4, self.compute.cu_stream())
        }
        .map_err(dev("bench_read"))?;
        let f = self.func("read_sum_f32")?;
        let (xp, n4, op) = (buf.ptr(), (bytes / 16) as u64, acc.ptr());
        let cfg = LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut a = args![&xp, &n4, &op];
        self.launch("bench_read", f, cfg, &mut a)
    }
}
