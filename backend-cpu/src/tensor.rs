//! The CPU backend's associated types.

use kvstream_memory_contracts::backend::{
    DeviceBuffer, DeviceTensor, DeviceWeight, Fence, WeightDType,
};
use kvstream_memory_contracts::host::HostBytes;
use kvstream_memory_contracts::ops::WeightData;
use std::sync::{Arc, Condvar, Mutex};

/// An f32 tensor in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuTensor {
    pub data: Vec<f32>,
    pub dims: Vec<usize>,
}

impl CpuTensor {
    /// A tensor from data and dims (caller guarantees the product matches).
    pub fn new(data: Vec<f32>, dims: Vec<usize>) -> Self {
        debug_assert_eq!(data.len(), dims.iter().product::<usize>());
        Self { data, dims }
    }
}

impl DeviceTensor for CpuTensor {
    fn dims(&self) -> &[usize] {
        &self.dims
    }
    fn numel(&self) -> usize {
        self.data.len()
    }
}

/// "Device" bytes: a shared host allocation with device-like access rules (see
/// [`HostBytes`]): concurrent accesses to the same bytes are ordered by fences.
#[derive(Debug, Clone)]
pub struct CpuBuffer(pub Arc<HostBytes>);

impl DeviceBuffer for CpuBuffer {
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// A weight in its stored dtype, referencing the (memory-mapped) source bytes: zero copy.
#[derive(Debug, Clone)]
pub struct CpuWeight {
    pub dtype: WeightDType,
    pub dims: Vec<usize>,
    pub data: WeightData,
}

impl DeviceWeight for CpuWeight {
    fn dims(&self) -> &[usize] {
        &self.dims
    }
    fn dtype(&self) -> WeightDType {
        self.dtype
    }
    fn device_bytes(&self) -> usize {
        self.data.len
    }
}

#[derive(Debug, Default)]
struct FenceState {
    /// None while pending; Some(Ok) when done; Some(Err) when the fenced work failed.
    done: Mutex<Option<Result<(), String>>>,
    cv: Condvar,
}

/// A fence: a latch that completes once, successfully or with an error.
#[derive(Debug, Clone, Default)]
pub struct CpuFence(Arc<FenceState>);

impl CpuFence {
    /// A pending fence.
    pub fn pending() -> Self {
        Self::default()
    }
    /// An already completed fence.
    pub fn completed() -> Self {
        let f = Self::default();
        f.signal(Ok(()));
        f
    }
    /// Completes the fence (first call wins).
    pub fn signal(&self, result: Result<(), String>) {
        let mut g = self.0.done.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_none() {
            *g = Some(result);
        }
        self.0.cv.notify_all();
    }
    /// A fence already completed with `error` (the fenced work failed).
    pub fn failed(error: impl Into<String>) -> Self {
        let f = Self::default();
        f.signal(Err(error.into()));
        f
    }
    /// Blocks until complete; returns the fenced work's result.
    pub fn wait(&self) -> Result<(), String> {
        let mut g = self.0.done.lock().unwrap_or_else(|e| e.into_inner());
        while g.is_none() {
            g = self.0.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        g.clone().unwrap_or(Ok(()))
    }
    /// Blocks for at most `timeout`; `None` if the fence is still pending then, else its result.
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> Option<Result<(), String>> {
        let g = self.0.done.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self
            .0
            .cv
            .wait_timeout_while(g, timeout, |d| d.is_none())
            .unwrap_or_else(|e| e.into_inner());
        g.clone()
    }
    /// The result if complete, without blocking.
    pub fn try_result(&self) -> Option<Result<(), String>> {
        self.0
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

impl Fence for CpuFence {
    fn is_complete(&self) -> bool {
        self.0
            .done
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// What the CPU backend's no-op host registration tracks: the live registrations by base
/// address and the bytes they cover.
#[derive(Debug, Default)]
pub(crate) struct RegistryState {
    /// Base address → length of every live registration.
    pub(crate) live: std::collections::HashMap<usize, usize>,
    /// Sum of the live registrations' lengths.
    pub(crate) bytes: usize,
}

/// Ownership record of a (no-op) host registration; unregisters on drop.
///
/// It keeps the registered allocation alive (like a real registration, which must be undone
/// before the memory is freed) and removes its entry from the backend's registry when dropped.
#[derive(Debug)]
pub struct CpuRegistration {
    pub(crate) bytes: usize,
    pub(crate) addr: usize,
    pub(crate) memory: Arc<HostBytes>,
    pub(crate) registry: Arc<Mutex<RegistryState>>,
}

impl CpuRegistration {
    /// Bytes this registration covers.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The registered allocation.
    pub fn memory(&self) -> &Arc<HostBytes> {
        &self.memory
    }
}

impl Drop for CpuRegistration {
    fn drop(&mut self) {
        let mut g = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        if g.live.remove(&self.addr).is_some() {
            g.bytes = g.bytes.saturating_sub(self.bytes);
        }
    }
}
