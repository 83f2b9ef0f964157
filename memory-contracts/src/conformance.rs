//! The device-generic conformance suite (candle's `test_device!` idea): the same tests, run by
//! every backend through [`conformance_tests!`](crate::conformance_tests).
//!
//! Sections (a backend opts into the ones it implements):
//!
//! * [`capabilities`] (A) — `capabilities()` is self-consistent, and every attention request the
//!   backend does not advertise (K/V pair, query width) is a typed [`CapabilityError`] naming the
//!   backend and operation; malformed requests are typed errors. Needs only
//!   [`StreamedAttention`](crate::attention::StreamedAttention). Every backend passes it,
//!   including stubs.
//! * `capabilities_ops` (A′, in [`capabilities`]) — with the full
//!   [`ModelBackend`](crate::ops::ModelBackend): unadvertised compute ops and weight dtypes are
//!   capability errors, advertised ones work.
//! * [`memory`] (B) — arena buffers, the pinned host store, the copy engine with its fences, and
//!   `kv_write` encoding byte-for-byte equal to [`crate::kv::format::encode`].
//! * [`attention`] (C) — streamed attention over a plan mixing resident pages and ring slots,
//!   laid out out of order, in one wave and in several, equals the all-in-one-span evaluation bit
//!   for bit and the f64 reference over the dequantised K/V within 1e-4; order and completeness
//!   violations are typed errors.
//!
//! Functions panic (with a message naming the case) on a violation: they are test bodies.
//!
//! [`CapabilityError`]: crate::error::CapabilityError

pub mod attention;
pub mod capabilities;
pub mod memory;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A seeded generator (the suite is deterministic).
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ 0x6b76_7374_7265_616d)
}

/// `n` values, uniform in `(-amp, amp)` with per-value magnitudes spread over a decade; never all
/// zero.
pub fn random_f32(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let mag = 10f32.powf(rng.random_range(-1.0..0.0));
            let mut x = rng.random_range(-1.0f32..1.0) * amp * mag;
            if x == 0.0 {
                x = amp * 0.5;
            }
            x
        })
        .collect()
}

/// `n` random bytes in `1..=255` (never zero, so a missed write is visible).
pub fn random_bytes(rng: &mut StdRng, n: usize) -> Vec<u8> {
    (0..n).map(|_| rng.random_range(1..=255u8)).collect()
}

/// Runs the conformance suite for a backend: `conformance_tests!(sections: make_expr)`.
///
/// `sections` is a comma-separated list of `capabilities`, `capabilities_ops`, `memory`,
/// `attention`, or `all` (every section). `make_expr` builds a fresh backend and is evaluated
/// once per test; the generated test modules `use super::*`, so names imported by the calling
/// file resolve.
///
/// ```ignore
/// // backend-stub/tests/conformance.rs
/// kvstream_memory_contracts::conformance_tests!(capabilities: StubBackend::new());
/// // backend-cpu/tests/conformance.rs
/// kvstream_memory_contracts::conformance_tests!(all: CpuBackend::new());
/// ```
#[macro_export]
macro_rules! conformance_tests {
    ($($section:ident),+ : $make:expr) => {
        $( $crate::conformance_tests!(@section $section, $make); )+
    };
    (@section all, $make:expr) => {
        $crate::conformance_tests!(@section capabilities, $make);
        $crate::conformance_tests!(@section capabilities_ops, $make);
        $crate::conformance_tests!(@section memory, $make);
        $crate::conformance_tests!(@section attention, $make);
    };
    (@section capabilities, $make:expr) => {
        /// Conformance section A: capability reporting.
        mod conformance_a_capabilities {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance::capabilities as a;
            #[test]
            fn capabilities_are_self_consistent() {
                a::capabilities_are_self_consistent(&$make);
            }
            #[test]
            fn unsupported_kv_pairs_are_capability_errors() {
                a::unsupported_kv_pairs_are_capability_errors(&$make);
            }
            #[test]
            fn unsupported_widths_are_capability_errors() {
                a::unsupported_widths_are_capability_errors(&$make);
            }
            #[test]
            fn malformed_requests_are_typed_errors() {
                a::malformed_requests_are_typed_errors(&$make);
            }
        }
    };
    (@section capabilities_ops, $make:expr) => {
        /// Conformance section A′: capability reporting of the compute and memory ops.
        mod conformance_a_capabilities_ops {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance::capabilities as a;
            #[test]
            fn unadvertised_ops_are_capability_errors() {
                a::unadvertised_ops_are_capability_errors(&$make);
            }
        }
    };
    (@section memory, $make:expr) => {
        /// Conformance section B: memory and streaming.
        mod conformance_b_memory {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance::memory as m;
            #[test]
            fn arena_buffers_write_and_read() {
                m::arena_buffers_write_and_read(&$make);
            }
            #[test]
            fn pinned_host_store_round_trip() {
                m::pinned_host_store_round_trip(&$make);
            }
            #[test]
            fn copy_engine_round_trip_with_fences() {
                m::copy_engine_round_trip_with_fences(&$make);
            }
            #[test]
            fn host_pages_stream_into_ring_slots_and_rows_publish_back() {
                m::host_pages_stream_into_ring_slots_and_rows_publish_back(&$make);
            }
            #[test]
            fn kv_write_equals_encode() {
                m::kv_write_equals_encode(&$make);
            }
        }
    };
    (@section attention, $make:expr) => {
        /// Conformance section C: streamed attention.
        mod conformance_c_attention {
            #[allow(unused_imports)]
            use super::*;
            use $crate::conformance::attention as c;
            #[test]
            fn streamed_equals_contiguous_and_f64_reference() {
                c::streamed_equals_contiguous_and_f64_reference(&$make);
            }
            #[test]
            fn walk_order_and_completeness_are_enforced() {
                c::walk_order_and_completeness_are_enforced(&$make);
            }
        }
    };
}
