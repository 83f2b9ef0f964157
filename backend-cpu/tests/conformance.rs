//! The device-generic conformance suite, every section, on the CPU reference backend.

use kvstream_backend_cpu::CpuBackend;

kvstream_memory_contracts::conformance_tests!(all: CpuBackend::new());
