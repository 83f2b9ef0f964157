//! Allocation, upload and launch helpers shared by the ops.

use crate::{CudaBackend, CudaTensor, DeviceAlloc};
use cudarc::driver::{CudaFunction, DriverError, LaunchConfig};
use kvstream_memory_contracts::error::OpError;
use std::sync::Arc;

/// Maps a driver error of `op` to [`OpError::Device`].
pub(crate) fn dev(op: &'static str) -> impl Fn(DriverError) -> OpError {
    move |e| OpError::Device {
        op,
        detail: format!("{e:?}"),
    }
}

/// Lets `f` take `bytes` of dynamic shared memory (the opt-in beyond 48 KiB); callers pass sizes
/// checked against the device's opt-in limit. The driver's result on failure.
pub(crate) fn allow_dynamic_smem(
    f: &CudaFunction,
    bytes: usize,
) -> Result<(), cudarc::driver::sys::CUresult> {
    use cudarc::driver::sys;
    // SAFETY: sets a launch attribute of a loaded function; the value fits the device limit.
    let r = unsafe {
        sys::cuFuncSetAttribute(
            f.cu_function(),
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(r)
    }
}

/// A 1-D launch over `n` elements (grid-stride kernels; grid capped).
pub(crate) fn grid1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).clamp(1, 65_535 * 8) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaBackend {
    /// The loaded kernel `name` (admission guarantees every listed kernel exists).
    pub(crate) fn func(&self, name: &'static str) -> Result<&CudaFunction, OpError> {
        self.kernels.get(name).ok_or_else(|| {
            OpError::Capability(kvstream_memory_contracts::CapabilityError::new(
                "cuda",
                name,
                "kernel not loaded",
            ))
        })
    }

    /// Allocates `bytes` (uninitialised) for a tensor, weight or scratch value: from the lent
    /// arena region while one is lent ([`crate::lend`]), else on the compute stream.
    pub(crate) fn alloc_bytes(
        &self,
        bytes: usize,
        what: &str,
    ) -> Result<Arc<DeviceAlloc>, OpError> {
        if let Some(a) = self.alloc_lent(bytes, what)? {
            return Ok(a);
        }
        self.alloc_owned(bytes, what)
    }

    /// Allocates `bytes` (uninitialised) of its own on the compute stream, never from a loan.
    pub(crate) fn alloc_owned(
        &self,
        bytes: usize,
        what: &str,
    ) -> Result<Arc<DeviceAlloc>, OpError> {
        if let Some(cache) = &self.alloc_cache {
            if let Some(class) = crate::alloc_cache::size_class(bytes) {
                if let Some(s) = cache.take(class) {
                    return Ok(Arc::new(DeviceAlloc::cached(
                        s,
                        &self.compute,
                        bytes,
                        cache.clone(),
                    )));
                }
                self.ctx.bind_to_thread().map_err(dev("alloc"))?;
                // SAFETY: uninitialised; every caller writes it before reading it.
                let s = unsafe { self.compute.alloc::<u8>(class) }.map_err(|_| {
                    OpError::OutOfMemory {
                        what: what.to_string(),
                        bytes,
                    }
                })?;
                return Ok(Arc::new(DeviceAlloc::cached(
                    s,
                    &self.compute,
                    bytes,
                    cache.clone(),
                )));
            }
        }
        self.ctx.bind_to_thread().map_err(dev("alloc"))?;
        // Round up to 16 bytes so empty tensors have an address and vector loads stay in bounds.
        let n = bytes.max(16).next_multiple_of(16);
        // SAFETY: the memory is uninitialised; every caller writes it before reading it.
        let slice = unsafe { self.compute.alloc::<u8>(n) }.map_err(|_| OpError::OutOfMemory {
            what: what.to_string(),
            bytes,
        })?;
        Ok(Arc::new(DeviceAlloc::new(slice, &self.compute, bytes)))
    }

    /// An uninitialised f32 tensor of `dims`.
    pub(crate) fn tensor_uninit(&self, dims: &[usize]) -> Result<CudaTensor, OpError> {
        let n: usize = dims.iter().product();
        let alloc = self.alloc_bytes(n * 4, "tensor")?;
        Ok(CudaTensor {
            alloc,
            offset: 0,
            dims: dims.to_vec(),
            prepared: None,
        })
    }

    /// Uploads a small host slice (ids, positions, offsets) on the compute stream.
    pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        data: &[T],
        what: &str,
    ) -> Result<Arc<DeviceAlloc>, OpError> {
        let bytes = std::mem::size_of_val(data);
        let a = self.alloc_bytes(bytes, what)?;
        if bytes > 0 {
            // SAFETY: `a` has at least `bytes` bytes; the driver stages pageable memory before the
            // call returns, so `data` may be dropped afterwards.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(a.ptr(), data, self.compute.cu_stream())
            }
            .map_err(dev("upload"))?;
        }
        Ok(a)
    }

    /// Launches `f` on the compute stream with pre-built arguments.
    pub(crate) fn launch(
        &self,
        op: &'static str,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), OpError> {
        let _span = tracing::trace_span!("launch", op).entered();
        self.ctx.bind_to_thread().map_err(dev(op))?;
        // SAFETY: `args` points at live values whose types match the kernel's parameters (each
        // caller builds them next to the kernel's signature in kernels/src/cu).
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                cfg.grid_dim,
                cfg.block_dim,
                cfg.shared_mem_bytes,
                self.compute.cu_stream(),
                args,
            )
        }
        .map_err(dev(op))
    }

    /// Launches `f` like [`CudaBackend::launch`] but as a programmatic dependent launch: the
    /// kernel may start while the previous kernel on the stream is still running (once that one
    /// executes `griddepcontrol.launch_dependents`, or when it finishes), and must execute
    /// `griddepcontrol.wait` before it touches anything that kernel writes. Only for kernels built
    /// for it (the q4 tensor-core GEMVs after their x-prep kernel).
    pub(crate) fn launch_dependent(
        &self,
        op: &'static str,
        f: &CudaFunction,
        cfg: LaunchConfig,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), OpError> {
        use cudarc::driver::sys;
        let _span = tracing::trace_span!("launch_dependent", op).entered();
        self.ctx.bind_to_thread().map_err(dev(op))?;
        // SAFETY: an all-zero CUlaunchAttribute is a valid (ignored) attribute; id and value are
        // set below to the programmatic-serialization pair.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.compute.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as in `launch`; `config` and `attr` outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(dev(op))
    }
}

/// Builds a kernel argument array from references: `args![a, b, c]`.
macro_rules! args {
    ($($x:expr),* $(,)?) => {
        [$( ($x) as *const _ as *mut ::std::ffi::c_void ),*]
    };
}
pub(crate) use args;
