//! The fix-up buffers of the stream-K decode GEMVs (`gemv_q4mmap*` in gemv_mma.cu, see
//! [`super::q4mmap`]; `gemv_sk_*` in linear.cu, see [`super::sk_plan`]): scratch slots for the
//! partial sums of work units shared by several warps, and one counter per unit.
//!
//! One holder per backend, shared by both kernels: they run on the compute stream one after the
//! other, and every launch leaves the counters zero (the last warp to finish a shared unit resets
//! its counter) and, under `SK_FLAGS`, every scratch value empty (0xffffffff), so a launch may use
//! what the previous one used. Both buffers only grow; a grown counter buffer is zeroed and a grown
//! scratch buffer filled with 0xff bytes on the compute stream before any kernel reads it.

use crate::launch::dev;
use crate::{CudaBackend, DeviceAlloc};
use cudarc::driver::result;
use kvstream_memory_contracts::error::OpError;
use std::sync::Arc;

/// Host mirror of `qp_start` (common.cuh): the first item of warp `w` of `warps` sharing `work`
/// items.
#[cfg(test)]
pub(crate) fn start(w: usize, warps: usize, work: usize) -> usize {
    w * work / warps
}

/// Host mirror of `qp_owner` (common.cuh): the warp whose range holds `item`.
#[cfg(test)]
pub(crate) fn owner(item: usize, warps: usize, work: usize) -> usize {
    ((item + 1) * warps - 1) / work
}

/// Scratch slots and per-unit counters, grown on demand.
#[derive(Debug, Default)]
pub(crate) struct StreamKBuffers {
    scratch: Option<Arc<DeviceAlloc>>,
    counters: Option<Arc<DeviceAlloc>>,
    /// The tile-owning q4 GEMV's split-range slots (`super::q4tiles`), every value 0xffffffff
    /// between launches; its own buffer, so its invariant never depends on the stream-K kernels'
    /// hand-off level.
    tiles_split: Option<Arc<DeviceAlloc>>,
}

impl CudaBackend {
    /// Scratch of at least `scratch_bytes` and zeroed u32 counters of at least `counter_bytes`
    /// (kept, and only grown, across calls).
    pub(crate) fn stream_k_buffers(
        &self,
        scratch_bytes: usize,
        counter_bytes: usize,
    ) -> Result<(Arc<DeviceAlloc>, Arc<DeviceAlloc>), OpError> {
        let mut b = self.stream_k.lock().unwrap_or_else(|e| e.into_inner());
        if b.scratch.as_ref().is_none_or(|s| s.len() < scratch_bytes) {
            // Every value SK_EMPTY (0xffffffff) for the fence-free hand-off (`SK_FLAGS`,
            // common.cuh: each launch leaves its values empty again); the fenced hand-off ignores it.
            b.scratch = Some(self.alloc_filled(scratch_bytes, 0xff, "stream-K GEMV scratch")?);
        }
        if b.counters.as_ref().is_none_or(|c| c.len() < counter_bytes) {
            b.counters = Some(self.alloc_filled(counter_bytes, 0, "stream-K GEMV counters")?);
        }
        match (&b.scratch, &b.counters) {
            (Some(s), Some(c)) => Ok((s.clone(), c.clone())),
            _ => Err(OpError::shape(
                "matmul",
                "stream-K GEMV buffers missing".to_string(),
            )),
        }
    }

    /// The tile-owning q4 GEMV's split scratch, at least `bytes`, every byte 0xff when new (kept,
    /// and only grown, across calls; each launch leaves it so).
    pub(crate) fn tiles_split_scratch(&self, bytes: usize) -> Result<Arc<DeviceAlloc>, OpError> {
        let mut b = self.stream_k.lock().unwrap_or_else(|e| e.into_inner());
        match &b.tiles_split {
            Some(s) if s.len() >= bytes => Ok(s.clone()),
            _ => {
                let s = self.alloc_filled(bytes, 0xff, "q4 tile GEMV split scratch")?;
                b.tiles_split = Some(s.clone());
                Ok(s)
            }
        }
    }

    /// A new allocation of at least `bytes` (4 or more), every byte `fill`, ordered on the compute
    /// stream before any kernel that reads it.
    fn alloc_filled(
        &self,
        bytes: usize,
        fill: u8,
        what: &str,
    ) -> Result<Arc<DeviceAlloc>, OpError> {
        let bytes = bytes.max(4);
        let a = self.alloc_owned(bytes, what)?;
        self.ctx.bind_to_thread().map_err(dev("fill"))?;
        // SAFETY: the allocation holds `bytes` bytes; the fill is ordered on the compute stream
        // before any kernel that reads them.
        unsafe { result::memset_d8_async(a.ptr(), fill, bytes, self.compute.cu_stream()) }
            .map_err(dev("fill"))?;
        Ok(a)
    }
}
