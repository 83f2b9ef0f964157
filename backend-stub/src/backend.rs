//! [`StubBackend`]: construction, the [`Backend`] associated types and honest capabilities.

use crate::adapter::{discover, AdapterSummary, Discovery, Gpu, InstanceKind};
use crate::never::{StubFence, StubHostRegistration, StubTensor, StubWeight};
use crate::StubBuffer;
use kvstream_memory_contracts::backend::{Backend, Capabilities};
use kvstream_memory_contracts::error::CapabilityError;
use kvstream_memory_contracts::report::{fallback_suggestion, first_missing_capability};

/// The backend's name in capability errors and `--backend`.
pub const BACKEND: &str = "wgpu";

/// The device text when no adapter exists.
pub const NO_ADAPTER: &str = "no wgpu adapter found on this machine";

/// A capability error of this backend: `"<why>; use --backend cuda or --backend cpu"`.
pub fn unsupported(operation: &'static str, why: &str) -> CapabilityError {
    CapabilityError::new(
        BACKEND,
        operation,
        format!("{why}; {}", fallback_suggestion(BACKEND)),
    )
}

/// The wgpu stub backend.
///
/// Real: adapter enumeration, adapter name / API / limits in [`Backend::capabilities`], and
/// [`DeviceMemory`](kvstream_memory_contracts::transfer::DeviceMemory) (real `wgpu::Buffer`s,
/// synchronous upload and readback) when a device could be opened. Everything a streamed model
/// run needs beyond that (pinned host, copy engine, fences, streamed attention, KV writes, compute
/// ops) returns a [`CapabilityError`] naming `wgpu`, the operation and why; its tensor, weight,
/// fence and registration types are uninhabited (see [`crate::never`]).
#[derive(Debug)]
pub struct StubBackend {
    adapters: Vec<AdapterSummary>,
    pub(crate) gpu: Option<Gpu>,
    device_error: Option<String>,
}

impl StubBackend {
    /// Enumerates native adapters and opens a device on the best one. Fails with a
    /// [`CapabilityError`] (operation `adapter`) when there is none ("no wgpu adapter found on
    /// this machine") or when the adapter refuses a device.
    pub fn new() -> Result<Self, CapabilityError> {
        let b = Self::probe();
        b.require_device()?;
        Ok(b)
    }

    /// Like [`StubBackend::new`] but never fails: without an adapter the backend still exists,
    /// reports its capabilities (device: "no wgpu adapter found on this machine") and returns
    /// capability errors from every operation, `alloc_buffer` included. For `kvstream inspect`.
    pub fn probe() -> Self {
        Self::from_discovery(discover(InstanceKind::Native))
    }

    /// A backend on wgpu's Noop adapter: host memory, no GPU, never chosen by [`probe`](Self::probe).
    /// Runs the real-device code paths (buffer allocation, upload, readback) where no GPU exists,
    /// e.g. in CI. Fails like [`new`](Self::new) if wgpu cannot open the Noop device.
    pub fn noop() -> Result<Self, CapabilityError> {
        let b = Self::from_discovery(discover(InstanceKind::Noop {
            max_buffer_size: None,
        }));
        b.require_device()?;
        Ok(b)
    }

    /// [`noop`](Self::noop) with the adapter's `max_buffer_size` limit set to `bytes`, to
    /// exercise the limit checks of a small adapter.
    pub fn noop_with_max_buffer_size(bytes: u64) -> Result<Self, CapabilityError> {
        let b = Self::from_discovery(discover(InstanceKind::Noop {
            max_buffer_size: Some(bytes),
        }));
        b.require_device()?;
        Ok(b)
    }

    fn from_discovery(d: Discovery) -> Self {
        Self {
            adapters: d.adapters,
            gpu: d.gpu,
            device_error: d.device_error,
        }
    }

    /// Every adapter wgpu enumerated, best first (may be non-empty even without a device).
    pub fn adapters(&self) -> &[AdapterSummary] {
        &self.adapters
    }

    /// The adapter a device was opened on, if any.
    pub fn adapter(&self) -> Option<&AdapterSummary> {
        self.gpu.as_ref().map(|g| &g.summary)
    }

    /// `Ok` if a device is open, else the capability error saying why not.
    pub fn require_device(&self) -> Result<(), CapabilityError> {
        if self.gpu.is_some() {
            return Ok(());
        }
        let why = match &self.device_error {
            Some(e) => e.clone(),
            None => NO_ADAPTER.to_string(),
        };
        Err(unsupported("adapter", &why))
    }

    /// Whether this backend can run a model: the missing adapter first, then the first missing
    /// capability of [`first_missing_capability`]. For the stub this is always an error; the
    /// CLI prints it and exits non-zero.
    pub fn check_model_support(&self) -> Result<(), CapabilityError> {
        self.require_device()?;
        match first_missing_capability(&self.capabilities()) {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    pub(crate) fn gpu(&self, operation: &'static str) -> Result<&Gpu, CapabilityError> {
        match &self.gpu {
            Some(g) => Ok(g),
            None => Err(unsupported(
                operation,
                self.device_error.as_deref().unwrap_or(NO_ADAPTER),
            )),
        }
    }
}

impl Backend for StubBackend {
    type Buffer = StubBuffer;
    type Tensor = StubTensor;
    type Weight = StubWeight;
    type Fence = StubFence;
    type HostRegistration = StubHostRegistration;

    fn name(&self) -> &'static str {
        BACKEND
    }

    /// The adapter's identity and limits; no streaming capability of any kind.
    fn capabilities(&self) -> Capabilities {
        let device = match (&self.gpu, &self.device_error) {
            (Some(g), _) => g.summary.to_string(),
            (None, Some(e)) => e.clone(),
            (None, None) => NO_ADAPTER.to_string(),
        };
        Capabilities {
            backend: BACKEND,
            device,
            pinned_host: false,
            copy_engine: false,
            max_decode_width: 0,
            prefill_attention: false,
            kv_pairs: Vec::new(),
            compute_ops: false,
            weight_dtypes: Vec::new(),
            // wgpu exposes no device-memory size, only per-buffer limits.
            device_memory: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::error::OpError;
    use kvstream_memory_contracts::transfer::DeviceMemory;

    fn adapterless(device_error: Option<String>) -> StubBackend {
        StubBackend::from_discovery(Discovery {
            adapters: Vec::new(),
            gpu: None,
            device_error,
        })
    }

    #[test]
    fn no_adapter_is_a_capability_error_not_a_panic() {
        let b = adapterless(None);
        let e = b.require_device().expect_err("no device");
        assert_eq!((e.backend, e.operation), ("wgpu", "adapter"));
        assert!(e.detail.starts_with(NO_ADAPTER), "{}", e.detail);
        assert!(e.detail.ends_with("use --backend cuda or --backend cpu"));
        assert_eq!(b.check_model_support(), Err(e));
        assert!(b.adapter().is_none());
        assert_eq!(b.capabilities().device, NO_ADAPTER);
    }

    #[test]
    fn refused_device_names_the_adapter_everywhere() {
        let why = format!("adapter `gpu{}` refused a device: lost", std::process::id());
        let b = adapterless(Some(why.clone()));
        assert_eq!(b.capabilities().device, why);
        let e = b.require_device().expect_err("no device");
        assert!(e.detail.starts_with(&why), "{}", e.detail);
        match b.alloc_buffer(64) {
            Err(OpError::Capability(c)) => {
                assert_eq!(c.operation, "alloc_buffer");
                assert!(c.detail.starts_with(&why), "{}", c.detail);
            }
            other => panic!("expected a capability error, got {other:?}"),
        }
    }

    #[test]
    fn adapterless_memory_ops_refuse_but_synchronize_succeeds() {
        let b = adapterless(None);
        for bytes in [0usize, 1, 4096] {
            match b.alloc_buffer(bytes) {
                Err(OpError::Capability(c)) => {
                    assert_eq!((c.backend, c.operation), ("wgpu", "alloc_buffer"));
                    assert!(c.detail.contains(NO_ADAPTER));
                }
                other => panic!("expected a capability error, got {other:?}"),
            }
        }
        assert_eq!(b.synchronize(), Ok(()));
    }
}
