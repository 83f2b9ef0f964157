//! `PinnedHost` for the CPU backend: registration is a no-op for the memory (host memory is
//! already what the "device" reads) but still tracks ownership, so tests and `kvstream inspect`
//! can see how many bytes are registered and double registrations are refused.

use crate::tensor::{CpuRegistration, RegistryState};
use crate::CpuBackend;
use kvstream_memory_contracts::error::HostError;
use kvstream_memory_contracts::host::{HostBytes, PinnedHost};
use std::sync::{Arc, Mutex};

/// The registry of live host registrations, shared with every [`CpuRegistration`].
#[derive(Debug, Default)]
pub(crate) struct HostRegistry(pub(crate) Arc<Mutex<RegistryState>>);

impl HostRegistry {
    /// Bytes covered by live registrations.
    pub(crate) fn bytes(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).bytes
    }
    /// Number of live registrations.
    pub(crate) fn count(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).live.len()
    }
}

impl PinnedHost for CpuBackend {
    /// Records the allocation as registered. Registering the same allocation twice while the
    /// first registration is alive is a [`HostError::Register`] (as with a real page-lock).
    fn register_host(&self, bytes: &Arc<HostBytes>) -> Result<CpuRegistration, HostError> {
        let addr = bytes.as_ptr() as usize;
        let len = bytes.len();
        let mut g = self.registry.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.live.contains_key(&addr) {
            return Err(HostError::Register(format!(
                "host allocation at {addr:#x} ({len} bytes) is already registered"
            )));
        }
        g.live.insert(addr, len);
        g.bytes += len;
        tracing::trace!(addr, len, total = g.bytes, "cpu host registration");
        Ok(CpuRegistration {
            bytes: len,
            addr,
            memory: Arc::clone(bytes),
            registry: Arc::clone(&self.registry.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::host::HostKvStore;
    use kvstream_memory_contracts::kv::format::KvType;
    use kvstream_memory_contracts::kv::geometry::PageGeometry;

    #[test]
    fn host_kv_store_registration_is_counted_and_released() {
        let b = CpuBackend::new();
        assert_eq!(b.registered_host_bytes(), 0);
        let g = PageGeometry::new(16, 2, 32, KvType::Q8_0, KvType::F16).expect("geometry");
        let store = HostKvStore::new(&b, g, 3, 40).expect("store");
        assert_eq!(b.registered_host_bytes(), store.pinned_bytes());
        assert!(store.pinned_bytes() >= 3 * g.pages_for(40) * g.page_bytes());
        assert_eq!(b.registered_host_allocations(), 3);
        let other = HostKvStore::new(&b, g, 1, 16).expect("store");
        assert_eq!(
            b.registered_host_bytes(),
            store.pinned_bytes() + other.pinned_bytes()
        );
        drop(store);
        assert_eq!(b.registered_host_bytes(), other.pinned_bytes());
        drop(other);
        assert_eq!(b.registered_host_bytes(), 0);
        assert_eq!(b.registered_host_allocations(), 0);
    }

    #[test]
    fn double_registration_is_refused_until_the_first_is_dropped() {
        let b = CpuBackend::new();
        let mem = Arc::new(HostBytes::new(5000).expect("alloc"));
        let r = b.register_host(&mem).expect("first");
        assert_eq!(r.bytes(), 5000);
        assert!(matches!(b.register_host(&mem), Err(HostError::Register(_))));
        drop(r);
        let r2 = b.register_host(&mem).expect("after release");
        assert_eq!(b.registered_host_bytes(), 5000);
        drop(r2);
        assert_eq!(b.registered_host_bytes(), 0);
    }
}
