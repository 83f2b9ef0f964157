//! Arena loans on the CUDA backend: while a region of an arena buffer is lent
//! ([`DeviceMemory::begin_region_allocations`]), tensors, weights and scratch values are ranges of
//! that region (a [`RegionAllocator`] over it) instead of driver allocations, so an image encode
//! really runs inside the arena's bytes; the arena parent buffers themselves
//! ([`DeviceMemory::alloc_buffer`]) are never lent.

use crate::types::DeviceAlloc;
use crate::{CudaBackend, CudaBuffer};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::region_alloc::{RegionAllocator, RegionLoanReport};
use std::sync::{Arc, Mutex};

/// Alignment of every lent range (arena regions are 256-byte aligned).
const LEND_ALIGN: usize = 256;

/// Environment variable: `0` turns the redirect off (a loan is then accounting only, the CPU
/// backend's behaviour, and the encoder's tensors are allocations beside the arena); `1` or unset
/// keeps [`LEND_DEFAULT`].
pub const LEND_ENV: &str = "KVSTREAM_CUDA_LEND";

/// Whether loans redirect allocations when [`LEND_ENV`] is unset: on (qualified on the H200 in
/// session 4: the lend suite, the vision suite and the engine's image check with the redirect on,
/// memcheck clean; docs/benchmarks.md).
pub const LEND_DEFAULT: bool = true;

pub(crate) fn lend_from_env() -> bool {
    match std::env::var(LEND_ENV) {
        Ok(v) => v.trim() != "0",
        Err(_) => LEND_DEFAULT,
    }
}

/// The region lent now.
#[derive(Debug)]
pub(crate) struct Lend {
    parent: Arc<DeviceAlloc>,
    /// Byte offset of the region inside `parent`.
    base: usize,
    pool: Arc<Mutex<RegionAllocator>>,
}

impl CudaBackend {
    fn lend_slot(&self) -> std::sync::MutexGuard<'_, Option<Lend>> {
        self.lend.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `bytes` from the lent region, `Ok(None)` when none is lent, out of memory when it is full.
    pub(crate) fn alloc_lent(
        &self,
        bytes: usize,
        what: &str,
    ) -> Result<Option<Arc<DeviceAlloc>>, OpError> {
        let slot = self.lend_slot();
        let Some(l) = slot.as_ref() else {
            return Ok(None);
        };
        let mut pool = l.pool.lock().unwrap_or_else(|e| e.into_inner());
        let reserve = pool
            .reserved_size(bytes.max(16))
            .ok_or_else(|| OpError::OutOfMemory {
                what: what.to_string(),
                bytes,
            })?;
        let Some(offset) = pool.alloc(reserve) else {
            return Err(OpError::OutOfMemory {
                what: format!(
                    "{what} inside the lent arena region ({} bytes, {} in use, largest free {}); \
                     raise --kv-arena or keep images smaller",
                    pool.len(),
                    pool.live_bytes(),
                    pool.largest_free()
                ),
                bytes,
            });
        };
        drop(pool);
        Ok(Some(Arc::new(DeviceAlloc::lent(
            Arc::clone(&l.parent),
            l.base,
            Arc::clone(&l.pool),
            offset,
            reserve,
            bytes,
        ))))
    }

    /// Chooses whether region loans redirect allocations (overrides `KVSTREAM_CUDA_LEND`).
    pub fn set_region_lending(&self, on: bool) {
        self.lend_enabled
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn begin_lend(
        &self,
        parent: &CudaBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), OpError> {
        if !self.lend_enabled.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        let end = offset.checked_add(len).filter(|&e| e <= parent.len);
        if end.is_none() {
            return Err(OpError::shape(
                "begin_region_allocations",
                format!(
                    "region [{offset}, +{len}) lies outside the {}-byte buffer",
                    parent.len
                ),
            ));
        }
        let base = parent.offset + offset;
        if (parent.alloc.ptr() + base as u64) % LEND_ALIGN as u64 != 0 {
            return Err(OpError::shape(
                "begin_region_allocations",
                format!("region at offset {offset} is not {LEND_ALIGN}-byte aligned"),
            ));
        }
        let mut slot = self.lend_slot();
        if slot.is_some() {
            return Err(OpError::shape(
                "begin_region_allocations",
                "a region is already lent; end that loan first".to_string(),
            ));
        }
        *slot = Some(Lend {
            parent: Arc::clone(&parent.alloc),
            base,
            pool: Arc::new(Mutex::new(RegionAllocator::new(len, LEND_ALIGN))),
        });
        tracing::debug!(offset, len, "arena region lent to the allocator");
        Ok(())
    }

    pub(crate) fn end_lend(&self) -> RegionLoanReport {
        let Some(l) = self.lend_slot().take() else {
            return RegionLoanReport::default();
        };
        let pool = l.pool.lock().unwrap_or_else(|e| e.into_inner());
        let report = RegionLoanReport {
            region_bytes: pool.len(),
            peak_bytes: pool.peak_bytes(),
            live_count: pool.live_count(),
        };
        tracing::debug!(?report, "arena region loan ended");
        report
    }
}
