//! Device memory, pinned host registration and the copy engine (copy stream + event fences).

use crate::launch::dev;
use crate::{CudaBackend, CudaBuffer, CudaFence, CudaHostRegistration, InFlight};
use cudarc::driver::{result, sys};
use kvstream_memory_contracts::error::{HostError, OpError, TransferError};
use kvstream_memory_contracts::host::{HostBytes, HostRange, PinnedHost};
use kvstream_memory_contracts::region_alloc::RegionLoanReport;
use kvstream_memory_contracts::transfer::{check_range, CopyEngine, DeviceMemory};
use std::sync::Arc;

fn terr(e: cudarc::driver::DriverError) -> TransferError {
    TransferError::CopyFailed(format!("{e:?}"))
}

impl CudaBackend {
    /// Drops in-flight records whose fences completed (their host memory may then be freed).
    fn prune_inflight(&self) {
        let mut v = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|f| !f.fence.event.is_complete());
    }

    fn record_on(&self, stream: &cudarc::driver::CudaStream) -> Result<CudaFence, TransferError> {
        let event = self.ctx.new_event(None).map_err(terr)?;
        event.record(stream).map_err(terr)?;
        Ok(CudaFence {
            event: Arc::new(event),
        })
    }

    fn copy_waits(&self, wait_for: &[CudaFence]) -> Result<(), TransferError> {
        for f in wait_for {
            self.copy.wait(&f.event).map_err(terr)?;
        }
        Ok(())
    }
}

impl DeviceMemory for CudaBackend {
    fn alloc_buffer(&self, bytes: usize) -> Result<CudaBuffer, OpError> {
        let _span = tracing::debug_span!("alloc_buffer", bytes).entered();
        let alloc = self.alloc_owned(bytes, "buffer")?;
        // Zeroed (the contract leaves contents unspecified; zero makes stray reads visible and
        // matches the CPU backend). One memset per buffer: buffers are long-lived (the arena).
        self.ctx.bind_to_thread().map_err(dev("alloc_buffer"))?;
        // SAFETY: the allocation holds at least `bytes` bytes; ordered on the compute stream.
        unsafe { result::memset_d8_async(alloc.ptr(), 0, bytes.max(1), self.compute.cu_stream()) }
            .map_err(dev("alloc_buffer"))?;
        Ok(CudaBuffer {
            alloc,
            offset: 0,
            len: bytes,
        })
    }

    fn write_buffer(&self, buf: &CudaBuffer, offset: usize, data: &[u8]) -> Result<(), OpError> {
        check_range("buffer", offset, data.len(), buf.len)?;
        self.synchronize()?;
        if data.is_empty() {
            return Ok(());
        }
        // On the compute stream, then wait: a plain cuMemcpyHtoD from pageable memory may return
        // before its DMA lands, and our streams do not synchronise with the legacy stream.
        // SAFETY: range checked against the view; `data` outlives the synchronisation below.
        unsafe {
            result::memcpy_htod_async(buf.ptr() + offset as u64, data, self.compute.cu_stream())
        }
        .map_err(dev("write_buffer"))?;
        self.compute.synchronize().map_err(dev("write_buffer"))
    }

    fn read_buffer(&self, buf: &CudaBuffer, offset: usize, out: &mut [u8]) -> Result<(), OpError> {
        check_range("buffer", offset, out.len(), buf.len)?;
        self.synchronize()?;
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: range checked against the view; `out` outlives the synchronisation below.
        unsafe {
            result::memcpy_dtoh_async(out, buf.ptr() + offset as u64, self.compute.cu_stream())
        }
        .map_err(dev("read_buffer"))?;
        self.compute.synchronize().map_err(dev("read_buffer"))
    }

    fn synchronize(&self) -> Result<(), OpError> {
        let _span = tracing::debug_span!("synchronize").entered();
        self.ctx.bind_to_thread().map_err(dev("synchronize"))?;
        self.compute.synchronize().map_err(dev("synchronize"))?;
        self.copy.synchronize().map_err(dev("synchronize"))?;
        self.prune_inflight();
        Ok(())
    }

    fn begin_region_allocations(
        &self,
        parent: &CudaBuffer,
        offset: usize,
        len: usize,
    ) -> Result<(), OpError> {
        self.begin_lend(parent, offset, len)
    }

    fn end_region_allocations(&self) -> Result<RegionLoanReport, OpError> {
        Ok(self.end_lend())
    }
}

impl PinnedHost for CudaBackend {
    fn register_host(&self, bytes: &Arc<HostBytes>) -> Result<CudaHostRegistration, HostError> {
        let _span = tracing::debug_span!("register_host", bytes = bytes.len()).entered();
        self.ctx
            .bind_to_thread()
            .map_err(|e| HostError::Register(format!("{e:?}")))?;
        // HostBytes rounds its allocation up to whole 4 KiB pages: register the whole pages.
        let len = bytes
            .len()
            .max(1)
            .next_multiple_of(kvstream_memory_contracts::host::HOST_ALIGN);
        // SAFETY: the allocation is page-aligned, at least `len` bytes long and kept alive by the
        // returned token until it unregisters. Flags: PORTABLE only (cached, not write-combined).
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                bytes.as_ptr().cast::<std::ffi::c_void>(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(HostError::Register(format!(
                "cuMemHostRegister of {len} bytes failed: {r:?}"
            )));
        }
        Ok(CudaHostRegistration {
            bytes: Arc::clone(bytes),
            ctx: Arc::clone(&self.ctx),
        })
    }
}

impl CopyEngine for CudaBackend {
    fn copy_h2d(
        &self,
        src: &HostRange,
        dst: &CudaBuffer,
        dst_offset: usize,
        wait_for: &[CudaFence],
    ) -> Result<CudaFence, TransferError> {
        let _span = tracing::debug_span!("copy_h2d", bytes = src.len).entered();
        check_range("host range", src.offset, src.len, src.bytes.len())?;
        check_range("device buffer", dst_offset, src.len, dst.len)?;
        self.ctx.bind_to_thread().map_err(terr)?;
        self.prune_inflight();
        self.copy_waits(wait_for)?;
        if src.len > 0 {
            // One request for the whole contiguous range (the caller batches contiguous pages
            // into requests of 4 MiB or more).
            // SAFETY: both ranges were checked; the in-flight record below keeps the host memory
            // and the device allocation alive until the copy's event completes.
            let r = unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst.ptr() + dst_offset as u64,
                    src.bytes
                        .as_ptr()
                        .add(src.offset)
                        .cast::<std::ffi::c_void>(),
                    src.len,
                    self.copy.cu_stream(),
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::CopyFailed(format!(
                    "cuMemcpyHtoDAsync: {r:?}"
                )));
            }
        }
        let fence = self.record_on(&self.copy)?;
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(InFlight {
                fence: fence.clone(),
                _host: Arc::clone(&src.bytes),
                _device: Arc::clone(&dst.alloc),
            });
        Ok(fence)
    }

    fn copy_d2h(
        &self,
        src: &CudaBuffer,
        src_offset: usize,
        dst: &HostRange,
        wait_for: &[CudaFence],
    ) -> Result<CudaFence, TransferError> {
        let _span = tracing::debug_span!("copy_d2h", bytes = dst.len).entered();
        check_range("device buffer", src_offset, dst.len, src.len)?;
        check_range("host range", dst.offset, dst.len, dst.bytes.len())?;
        self.ctx.bind_to_thread().map_err(terr)?;
        self.prune_inflight();
        // Tail publication: on the copy stream, after the producer fence only, so compute never
        // blocks on it.
        self.copy_waits(wait_for)?;
        if dst.len > 0 {
            // SAFETY: both ranges were checked; the in-flight record keeps both sides alive; the
            // host bytes are written only by this copy until its fence completes (caller's rule).
            let r = unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.bytes
                        .as_ptr()
                        .add(dst.offset)
                        .cast::<std::ffi::c_void>(),
                    src.ptr() + src_offset as u64,
                    dst.len,
                    self.copy.cu_stream(),
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(TransferError::CopyFailed(format!(
                    "cuMemcpyDtoHAsync: {r:?}"
                )));
            }
        }
        let fence = self.record_on(&self.copy)?;
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(InFlight {
                fence: fence.clone(),
                _host: Arc::clone(&dst.bytes),
                _device: Arc::clone(&src.alloc),
            });
        Ok(fence)
    }

    fn record_compute_fence(&self) -> Result<CudaFence, TransferError> {
        self.ctx.bind_to_thread().map_err(terr)?;
        self.record_on(&self.compute)
    }

    fn compute_wait(&self, fence: &CudaFence) -> Result<(), TransferError> {
        self.ctx.bind_to_thread().map_err(terr)?;
        self.compute
            .wait(&fence.event)
            .map_err(|e| TransferError::Fence(format!("{e:?}")))
    }

    fn host_wait(&self, fence: &CudaFence) -> Result<(), TransferError> {
        let _span = tracing::debug_span!("host_wait").entered();
        self.ctx.bind_to_thread().map_err(terr)?;
        fence
            .event
            .synchronize()
            .map_err(|e| TransferError::Fence(format!("{e:?}")))?;
        self.prune_inflight();
        Ok(())
    }
}
