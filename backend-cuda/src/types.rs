//! Device-side value types of the CUDA backend: allocations, buffers (with views), tensors,
//! weights, fences and host registrations.

use crate::alloc_cache::AllocCache;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use kvstream_memory_contracts::backend::{
    DeviceBuffer, DeviceTensor, DeviceWeight, Fence, WeightDType,
};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::host::HostBytes;
use kvstream_memory_contracts::region_alloc::RegionAllocator;
use std::sync::{Arc, Mutex};

/// One device allocation. The raw pointer is taken once; every access goes through kernels or
/// copies ordered by streams and fences (cudarc's own per-slice event tracking is disabled).
/// Either its own driver allocation or a range of a lent arena region
/// ([`DeviceMemory::begin_region_allocations`](kvstream_memory_contracts::transfer::DeviceMemory::begin_region_allocations)),
/// which it returns to the region's allocator when dropped.
#[derive(Debug)]
pub struct DeviceAlloc {
    backing: Backing,
    ptr: u64,
    len: usize,
}

#[derive(Debug)]
enum Backing {
    Owned(CudaSlice<u8>),
    Lent(LentRange),
    /// An allocation of a cached size class: back to the cache when dropped.
    Cached(Option<CudaSlice<u8>>, Arc<AllocCache>),
}

/// `[offset, offset + reserved)` of a lent region's allocator, keeping the arena alive.
#[derive(Debug)]
struct LentRange {
    _parent: Arc<DeviceAlloc>,
    pool: Arc<Mutex<RegionAllocator>>,
    offset: usize,
    bytes: usize,
}

impl Drop for LentRange {
    fn drop(&mut self) {
        // Later users of the range are ordered after every earlier kernel on the compute stream,
        // the only stream that touches tensors and weights.
        self.pool
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free(self.offset, self.bytes);
    }
}

impl DeviceAlloc {
    pub(crate) fn new(slice: CudaSlice<u8>, stream: &CudaStream, len: usize) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        Self {
            backing: Backing::Owned(slice),
            ptr,
            len,
        }
    }
    /// `len` usable bytes of `slice`, an allocation of one of `cache`'s size classes, which it
    /// returns to `cache` when dropped.
    pub(crate) fn cached(
        slice: CudaSlice<u8>,
        stream: &CudaStream,
        len: usize,
        cache: Arc<AllocCache>,
    ) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        Self {
            backing: Backing::Cached(Some(slice), cache),
            ptr,
            len,
        }
    }
    /// `len` usable bytes at `offset` of the lent region whose allocator is `pool` (the offset
    /// and `reserve` bytes as that allocator handed them out), `region_base` bytes into `parent`.
    pub(crate) fn lent(
        parent: Arc<DeviceAlloc>,
        region_base: usize,
        pool: Arc<Mutex<RegionAllocator>>,
        offset: usize,
        reserve: usize,
        len: usize,
    ) -> Self {
        let ptr = parent.ptr + (region_base + offset) as u64;
        Self {
            backing: Backing::Lent(LentRange {
                _parent: parent,
                pool,
                offset,
                bytes: reserve,
            }),
            ptr,
            len,
        }
    }
    /// Device address of byte 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// Usable length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Bytes actually allocated (at least 16 so that empty tensors still have an address).
    pub fn allocated(&self) -> usize {
        match &self.backing {
            Backing::Owned(s) => s.len(),
            Backing::Lent(r) => r.bytes,
            Backing::Cached(s, _) => s.as_ref().map_or(0, |s| s.len()),
        }
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        // cudarc frees an owned slice (cuMemFreeAsync on its stream) right after this body; make
        // sure the context is current on whichever thread drops the last reference.
        match &mut self.backing {
            Backing::Owned(s) => {
                let _ = s.stream().context().bind_to_thread();
            }
            Backing::Cached(slot, cache) => {
                if let Some(s) = slot.take() {
                    if let Some(s) = cache.give(s) {
                        // The cache is full: free it (cuMemFreeAsync on its stream).
                        let _ = s.stream().context().bind_to_thread();
                        drop(s);
                    }
                }
            }
            Backing::Lent(_) => {}
        }
    }
}

/// Raw device bytes: a whole allocation or a view `[offset, offset + len)` of one (the arena
/// parent and its regions share one allocation).
#[derive(Debug, Clone)]
pub struct CudaBuffer {
    pub(crate) alloc: Arc<DeviceAlloc>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl CudaBuffer {
    /// Device address of the view's byte 0.
    pub fn ptr(&self) -> u64 {
        self.alloc.ptr() + self.offset as u64
    }
    /// A view of `[offset, offset + len)` of this buffer, sharing its allocation; `None` if out
    /// of range.
    pub fn view(&self, offset: usize, len: usize) -> Option<CudaBuffer> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        Some(CudaBuffer {
            alloc: Arc::clone(&self.alloc),
            offset: self.offset + offset,
            len,
        })
    }
}

impl DeviceBuffer for CudaBuffer {
    fn len(&self) -> usize {
        self.len
    }
}

/// An f32 activation tensor, row-major: its own device allocation, or (`offset` > 0) a
/// contiguous view of another tensor's allocation (a one-row column split or a row range, see
/// `ops::tensor`). Tensors are values that ops never write in place, so a view can share the
/// bytes; only state tensors (`copy_into`'s destination, conv/SSM state) are written, and those
/// are never views.
#[derive(Debug)]
pub struct CudaTensor {
    pub(crate) alloc: Arc<DeviceAlloc>,
    /// Byte offset of element 0 inside `alloc` (a multiple of [`CudaTensor::VIEW_ALIGN`]).
    pub(crate) offset: usize,
    pub(crate) dims: Vec<usize>,
    /// The q4 GEMV x-prep bytes of these values, when the op that made them wrote them too
    /// (`ops::linear::prepared`); `None` for views and for tensors written after they were made.
    pub(crate) prepared: Option<crate::ops::linear::prepared::PreparedX>,
}

impl CudaTensor {
    /// Alignment of a view's first byte: every kernel's vector loads (at most 16 bytes) stay
    /// aligned as they are on a fresh allocation.
    pub const VIEW_ALIGN: usize = 16;

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.alloc.ptr() + self.offset as u64
    }

    /// True when this tensor shares its allocation at a non-zero offset (a view).
    pub fn is_view(&self) -> bool {
        self.offset != 0
    }

    /// True when the op that made these values also wrote the q4 GEMV x-prep bytes for them
    /// (the fused x prep, `KVSTREAM_Q4_FUSED_PREP`): a q4 GEMV reading this tensor runs no x prep.
    pub fn has_prepared_x(&self) -> bool {
        self.prepared.is_some()
    }

    /// A view of `numel(dims)` elements starting `elem` elements after this tensor's element 0,
    /// sharing the allocation; `None` when the start is not [`CudaTensor::VIEW_ALIGN`]-aligned or
    /// the range leaves the tensor.
    pub(crate) fn view(&self, elem: usize, dims: &[usize]) -> Option<CudaTensor> {
        let n: usize = dims.iter().product();
        let own: usize = self.dims.iter().product();
        let byte = elem.checked_mul(4)?;
        if elem.checked_add(n)? > own || (self.offset + byte) % Self::VIEW_ALIGN != 0 {
            return None;
        }
        Some(CudaTensor {
            alloc: Arc::clone(&self.alloc),
            offset: self.offset + byte,
            dims: dims.to_vec(),
            prepared: None,
        })
    }
}

impl DeviceTensor for CudaTensor {
    fn dims(&self) -> &[usize] {
        &self.dims
    }
}

/// A weight in its stored dtype on the device.
#[derive(Debug)]
pub struct CudaWeight {
    pub(crate) alloc: Arc<DeviceAlloc>,
    pub(crate) dims: Vec<usize>,
    pub(crate) dtype: WeightDType,
    pub(crate) name: String,
}

impl CudaWeight {
    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.alloc.ptr()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
    /// The name it was loaded under.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl DeviceWeight for CudaWeight {
    fn dims(&self) -> &[usize] {
        &self.dims
    }
    fn dtype(&self) -> WeightDType {
        self.dtype
    }
    fn device_bytes(&self) -> usize {
        self.alloc.len()
    }
}

/// Kernel code of a weight dtype: 0..=2 match `common.cuh` (`WT_F32`, `WT_F16`, `WT_BF16`, read
/// element-wise by `load_w`); 3..=6 are the quantized layouts of `linear.cu` (`WT_Q8_0`,
/// `WT_Q4G128`, `WT_F8E4M3`, `WT_Q4NL`), which only the linear kernels (`load_wq`, GEMV, GEMM, embedding)
/// understand: element-wise kernels must not be given a quantized weight.
pub(crate) fn dtype_code(d: WeightDType) -> i32 {
    match d {
        WeightDType::F32 => 0,
        WeightDType::F16 => 1,
        WeightDType::Bf16 => 2,
        WeightDType::Q8_0 => 3,
        WeightDType::Q4G128 => 4,
        WeightDType::F8E4M3 => 5,
        WeightDType::Q4NlG128 => 6,
    }
}

/// Kernel code of a weight read element-wise (norm weights, conv kernels, `A_log`, `dt_bias`):
/// a quantized weight there is a typed error instead of being misread by `load_w`.
pub(crate) fn elementwise_dtype_code(op: &'static str, d: WeightDType) -> Result<i32, OpError> {
    if d.is_quantized() {
        return Err(OpError::DType {
            op,
            dtype: format!("{d} (element-wise ops read f32/f16/bf16 weights only)"),
        });
    }
    Ok(dtype_code(d))
}

/// A CUDA event recorded on the compute or copy stream (ready / consumed / producer fence).
#[derive(Debug, Clone)]
pub struct CudaFence {
    pub(crate) event: Arc<CudaEvent>,
}

impl Fence for CudaFence {
    fn is_complete(&self) -> bool {
        self.event.is_complete()
    }
}

/// RAII page-locking of a host allocation (`cuMemHostRegister` with flags 0 or PORTABLE: cached,
/// NOT write-combined, so the CPU reads it at full speed). Dropping it unregisters; it keeps the
/// allocation alive until then.
#[derive(Debug)]
pub struct CudaHostRegistration {
    pub(crate) bytes: Arc<HostBytes>,
    pub(crate) ctx: Arc<cudarc::driver::CudaContext>,
}

impl CudaHostRegistration {
    /// Bytes page-locked.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

impl Drop for CudaHostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            tracing::warn!("cannot bind CUDA context to unregister host memory");
            return;
        }
        // SAFETY: the pointer was registered by `register_host` (which created this token) and
        // `self.bytes` keeps the allocation alive until after this call.
        let r = unsafe {
            cudarc::driver::sys::cuMemHostUnregister(self.bytes.as_ptr().cast::<std::ffi::c_void>())
        };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(?r, "cuMemHostUnregister failed");
        }
    }
}
