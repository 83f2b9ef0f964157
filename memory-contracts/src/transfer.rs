//! Device memory, the copy engine and its fences.
//!
//! Two queues exist: the *compute* queue (model ops, attention) and the *copy* queue (host→device
//! ring fills, device→host tail publication). Fences order them:
//!
//! | fence | recorded on | waited on by | prevents |
//! |---|---|---|---|
//! | producer | compute, after a KV write | copy, before publishing that row | publishing unwritten bytes |
//! | ready | copy, after a ring fill | compute, before attention reads the slot | reading an incomplete copy |
//! | consumed | compute, after the last reader of a slot | copy, before refilling the slot | overwriting a slot in use |
//!
//! A failed copy completes its fence with an error; whoever waits on it gets that error (the
//! step fails, the session stays usable, the host history is untouched).

use crate::backend::Backend;
use crate::error::{OpError, TransferError};
use crate::host::HostRange;

/// Allocation of and synchronous access to raw device buffers.
pub trait DeviceMemory: Backend {
    /// Allocates `bytes` bytes of device memory (contents unspecified).
    fn alloc_buffer(&self, bytes: usize) -> Result<Self::Buffer, OpError>;
    /// Synchronously writes `data` at `offset` (tests, small uploads). Waits for queued work.
    fn write_buffer(&self, buf: &Self::Buffer, offset: usize, data: &[u8]) -> Result<(), OpError>;
    /// Synchronously reads `out.len()` bytes at `offset`. Waits for queued work.
    fn read_buffer(&self, buf: &Self::Buffer, offset: usize, out: &mut [u8])
        -> Result<(), OpError>;
    /// Blocks until all queued compute and copy work has finished.
    fn synchronize(&self) -> Result<(), OpError>;
    /// Lends `[offset, offset + len)` of `parent` (an arena buffer) to this backend's allocator:
    /// until [`DeviceMemory::end_region_allocations`], every tensor and weight the backend
    /// allocates is carved out of that region (an [`crate::region_alloc::RegionAllocator`]), and
    /// a request that does not fit is [`OpError::OutOfMemory`] naming the region. Buffers from
    /// [`DeviceMemory::alloc_buffer`] never come from a loan. The arena loans of the runtime
    /// (the vision tower during an image encode) use it so that the encoder really runs inside
    /// the arena. Backends whose tensors do not live in the arena's memory (the CPU backend:
    /// host vectors) keep the default: nothing is redirected.
    fn begin_region_allocations(
        &self,
        parent: &Self::Buffer,
        offset: usize,
        len: usize,
    ) -> Result<(), OpError> {
        let _ = (parent, offset, len);
        Ok(())
    }
    /// Ends the loan begun by [`DeviceMemory::begin_region_allocations`] and reports its use.
    /// Every allocation made inside it must have been dropped before the region is reused:
    /// `live_count > 0` in the report is the caller's bug (the runtime turns it into an error).
    fn end_region_allocations(&self) -> Result<crate::region_alloc::RegionLoanReport, OpError> {
        Ok(crate::region_alloc::RegionLoanReport::default())
    }
}

/// The asynchronous copy engine.
pub trait CopyEngine: Backend {
    /// Enqueues a host→device copy of `src` into `dst[dst_offset..]` on the copy queue. The copy
    /// begins only after every fence in `wait_for` has completed. Returns the *ready* fence.
    fn copy_h2d(
        &self,
        src: &HostRange,
        dst: &Self::Buffer,
        dst_offset: usize,
        wait_for: &[Self::Fence],
    ) -> Result<Self::Fence, TransferError>;

    /// Enqueues a device→host copy of `dst.len` bytes from `src[src_offset..]` into `dst`
    /// (publication of new KV rows) after `wait_for` (the producer fence). Returns its fence.
    fn copy_d2h(
        &self,
        src: &Self::Buffer,
        src_offset: usize,
        dst: &HostRange,
        wait_for: &[Self::Fence],
    ) -> Result<Self::Fence, TransferError>;

    /// Records a fence on the compute queue that completes when all compute work enqueued so far
    /// has finished (a *consumed* or *producer* fence).
    fn record_compute_fence(&self) -> Result<Self::Fence, TransferError>;

    /// Makes later compute work wait for `fence` (a *ready* fence). Returns the copy's error if
    /// the fenced copy failed.
    fn compute_wait(&self, fence: &Self::Fence) -> Result<(), TransferError>;

    /// Blocks the calling thread until `fence` completes; returns its error if its work failed.
    fn host_wait(&self, fence: &Self::Fence) -> Result<(), TransferError>;
}

/// Checks that `[offset, offset + len)` lies inside `total` bytes (shared by every backend).
pub fn check_range(
    what: &'static str,
    offset: usize,
    len: usize,
    total: usize,
) -> Result<(), TransferError> {
    match offset.checked_add(len) {
        Some(end) if end <= total => Ok(()),
        _ => Err(TransferError::OutOfRange {
            what,
            offset,
            end: offset.saturating_add(len),
            len: total,
        }),
    }
}
