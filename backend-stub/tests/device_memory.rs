//! The real-device paths of the stub (wgpu buffers, upload, readback) on wgpu's Noop adapter and,
//! where this machine has one, on the adapter `probe` picks; checked against a host shadow copy
//! with random unaligned writes and reads.

use kvstream_backend_stub::StubBackend;
use kvstream_memory_contracts::backend::DeviceBuffer;
use kvstream_memory_contracts::error::{OpError, TransferError};
use kvstream_memory_contracts::transfer::DeviceMemory;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn noop() -> StubBackend {
    StubBackend::noop().expect("wgpu's Noop adapter is always available")
}

#[test]
fn random_unaligned_writes_read_back_like_a_shadow_copy() {
    shadow_round_trip(&noop(), 0x5eed_57ab);
}

/// The same on the adapter `probe` picks, when this machine has one (a GPU, or a software
/// rasterizer such as llvmpipe): real driver buffers, not the Noop adapter's host memory.
#[test]
fn probe_device_round_trips_when_an_adapter_exists() {
    let b = StubBackend::probe();
    if b.adapter().is_some() {
        shadow_round_trip(&b, 0x0ada_97e5);
    } else {
        assert!(matches!(
            b.alloc_buffer(64),
            Err(OpError::Capability(e)) if e.operation == "alloc_buffer"
        ));
    }
}

fn shadow_round_trip(b: &StubBackend, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let len = 1021; // not a multiple of 4: the last word is partly outside the buffer's bytes
    let buf = b.alloc_buffer(len).expect("alloc");
    assert_eq!(buf.len(), len);
    let mut shadow = vec![0u8; len];
    let mut out = vec![0u8; len];
    b.read_buffer(&buf, 0, &mut out).expect("read zeroed");
    assert_eq!(out, shadow, "a new buffer reads as zeros");

    for _ in 0..40 {
        let off = rng.random_range(0..len);
        let n = rng.random_range(1..=(len - off).min(67));
        let data: Vec<u8> = (0..n).map(|_| rng.random_range(1..=255u8)).collect();
        b.write_buffer(&buf, off, &data).expect("write");
        shadow[off..off + n].copy_from_slice(&data);

        let roff = rng.random_range(0..len);
        let rn = rng.random_range(1..=(len - roff).min(97));
        let mut got = vec![0u8; rn];
        b.read_buffer(&buf, roff, &mut got).expect("read");
        assert_eq!(got, shadow[roff..roff + rn], "read [{roff}, +{rn})");
    }
    b.read_buffer(&buf, 0, &mut out).expect("read all");
    assert_eq!(out, shadow);
    b.synchronize().expect("synchronize");
}

#[test]
fn out_of_range_access_is_a_typed_error() {
    let b = noop();
    let buf = b.alloc_buffer(100).expect("alloc");
    let mut out = [0u8; 8];
    assert!(matches!(
        b.read_buffer(&buf, 96, &mut out),
        Err(OpError::Transfer(TransferError::OutOfRange {
            end: 104,
            len: 100,
            ..
        }))
    ));
    assert!(matches!(
        b.write_buffer(&buf, usize::MAX, &out),
        Err(OpError::Transfer(TransferError::OutOfRange { .. }))
    ));
    // Empty accesses at the end are fine.
    b.write_buffer(&buf, 100, &[]).expect("empty write");
    b.read_buffer(&buf, 100, &mut []).expect("empty read");
}

#[test]
fn allocation_beyond_the_adapter_limit_is_out_of_memory() {
    let max = 4096 + 64 * u64::from(std::process::id() % 16);
    let b = StubBackend::noop_with_max_buffer_size(max).expect("noop device");
    assert_eq!(b.adapter().map(|a| a.max_buffer_size), Some(max));
    let max_usize = usize::try_from(max).expect("small");
    let ok = b.alloc_buffer(max_usize).expect("exactly the limit fits");
    assert_eq!(ok.len(), max_usize);
    for too_big in [max_usize + 1, usize::MAX] {
        match b.alloc_buffer(too_big) {
            Err(OpError::OutOfMemory { bytes, what }) => {
                assert_eq!(bytes, too_big);
                assert!(what.contains(&max.to_string()), "{what}");
            }
            other => panic!("expected OutOfMemory for {too_big}, got {other:?}"),
        }
    }
}
