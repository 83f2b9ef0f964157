//! The shared conformance suite's capability-reporting sections (A and A′) for the stub, on the
//! real probe (on a machine without a GPU: the adapter-less backend) and on wgpu's Noop adapter
//! (a device exists, buffers are real). The stub advertises nothing it cannot do, so both pass;
//! the memory (B) and attention (C) sections are not run as sections: the stub has no pinned
//! host, copy engine or attention, and says so through capability errors (checked here by A and
//! A′). B's `arena_buffers_write_and_read`, which needs only `DeviceMemory`, does run on Noop.

#[allow(unused_imports)]
use kvstream_backend_stub::StubBackend;

mod probe {
    #[allow(unused_imports)]
    use super::*;
    kvstream_memory_contracts::conformance_tests!(capabilities, capabilities_ops: StubBackend::probe());
}

mod noop {
    #[allow(unused_imports)]
    use super::*;
    kvstream_memory_contracts::conformance_tests!(
        capabilities,
        capabilities_ops: StubBackend::noop().expect("wgpu's Noop adapter is always available")
    );
}

/// The one section-B test whose only bound is `DeviceMemory`: the stub's real buffers (on the
/// Noop adapter) keep every committed arena region's bytes across re-layouts.
#[test]
fn noop_device_memory_passes_arena_buffers_write_and_read() {
    let b = StubBackend::noop().expect("wgpu's Noop adapter is always available");
    kvstream_memory_contracts::conformance::memory::arena_buffers_write_and_read(&b);
}
