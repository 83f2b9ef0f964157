//! The device-generic conformance suite of memory-contracts, run on the GPU.
//! Run on a GPU machine with `--ignored`.

use kvstream_memory_contracts::conformance::{attention as c, capabilities as a, memory as b};

mod common;
use common::gpu;

macro_rules! gpu_test {
    ($name:ident, $path:path) => {
        #[test]
        #[ignore = "needs a CUDA GPU"]
        fn $name() {
            $path(&gpu());
        }
    };
}

gpu_test!(
    capabilities_are_self_consistent,
    a::capabilities_are_self_consistent
);
gpu_test!(
    unsupported_kv_pairs_are_capability_errors,
    a::unsupported_kv_pairs_are_capability_errors
);
gpu_test!(
    unsupported_widths_are_capability_errors,
    a::unsupported_widths_are_capability_errors
);
gpu_test!(
    malformed_requests_are_typed_errors,
    a::malformed_requests_are_typed_errors
);
gpu_test!(
    unadvertised_ops_are_capability_errors,
    a::unadvertised_ops_are_capability_errors
);
gpu_test!(
    arena_buffers_write_and_read,
    b::arena_buffers_write_and_read
);
gpu_test!(
    pinned_host_store_round_trip,
    b::pinned_host_store_round_trip
);
gpu_test!(
    copy_engine_round_trip_with_fences,
    b::copy_engine_round_trip_with_fences
);
gpu_test!(
    host_pages_stream_into_ring_slots_and_rows_publish_back,
    b::host_pages_stream_into_ring_slots_and_rows_publish_back
);
gpu_test!(kv_write_equals_encode, b::kv_write_equals_encode);
gpu_test!(
    streamed_equals_contiguous_and_f64_reference,
    c::streamed_equals_contiguous_and_f64_reference
);
gpu_test!(
    walk_order_and_completeness_are_enforced,
    c::walk_order_and_completeness_are_enforced
);
