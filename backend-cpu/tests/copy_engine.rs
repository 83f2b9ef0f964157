//! The CPU copy engine's fences are real: compute waits for *ready*, copies wait for *consumed*,
//! failures surface through fences without touching memory, the queue is FIFO, and dropping the
//! backend shuts the worker down without hanging.

use kvstream_backend_cpu::{CpuBackend, CpuBuffer, CpuFence};
use kvstream_memory_contracts::attention::{
    attention_accumulate, attention_begin, attention_finish,
};
use kvstream_memory_contracts::backend::Fence;
use kvstream_memory_contracts::conformance::attention::{contiguous, AttentionCase};
use kvstream_memory_contracts::conformance::{random_bytes, rng};
use kvstream_memory_contracts::error::TransferError;
use kvstream_memory_contracts::host::{HostRange, PinnedBuffer};
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::TensorOps;
use kvstream_memory_contracts::transfer::{CopyEngine, DeviceMemory};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Raw bytes of a buffer, without draining the copy queue (`read_buffer` would wait).
fn peek(buf: &CpuBuffer, offset: usize, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    buf.0.read(offset, &mut out).expect("peek");
    out
}

fn pinned_with(b: &CpuBackend, data: &[u8]) -> PinnedBuffer<CpuBackend> {
    let p = PinnedBuffer::new(b, data.len()).expect("pinned");
    p.bytes().write(0, data).expect("host write");
    p
}

fn range(p: &PinnedBuffer<CpuBackend>, offset: usize, len: usize) -> HostRange {
    HostRange {
        bytes: Arc::clone(p.bytes()),
        offset,
        len,
    }
}

#[test]
fn attention_waits_for_a_slow_ring_fill() {
    let b = CpuBackend::new();
    let mut r = rng(11);
    let case = AttentionCase::random(&mut r, KvType::Q8_0, KvType::Bf16, 3);
    let sh = case.shape;
    let q = b
        .tensor_from_f32(&case.q, &[sh.width, sh.q_heads, sh.head_dim])
        .expect("q");
    let expected = contiguous(&b, &case, &q);

    // The whole history sits in host memory; it is streamed into ring slot 2 of a pool.
    let host = pinned_with(&b, &case.image);
    let pb = case.geometry.page_bytes();
    let slot = 2;
    let pool = b.alloc_buffer((slot + case.pages()) * pb).expect("pool");
    b.set_copy_delay(Duration::from_millis(300));
    let t0 = Instant::now();
    let ready = b
        .copy_h2d(&range(&host, 0, case.image.len()), &pool, slot * pb, &[])
        .expect("copy_h2d");
    assert!(!ready.is_complete(), "the delayed copy cannot be done yet");
    assert!(
        peek(&pool, slot * pb, case.image.len())
            .iter()
            .all(|&x| x == 0),
        "the slot must still be empty before the copy lands"
    );
    b.compute_wait(&ready).expect("ready");
    assert!(
        t0.elapsed() >= Duration::from_millis(250),
        "compute_wait returned before the delayed copy ran ({:?})",
        t0.elapsed()
    );
    b.set_copy_delay(Duration::ZERO);

    let plan = SpanPlan::new(
        case.geometry,
        (slot + case.pages()) * pb,
        0,
        sh.total,
        vec![Span {
            source: SpanSource::Ring { first_slot: slot },
            first_token: 0,
            count: sh.total,
            offset: slot * pb,
        }],
    )
    .expect("plan");
    let mut acc = attention_begin(&b, sh).expect("begin");
    attention_accumulate(&b, &mut acc, &q, &pool, &plan).expect("accumulate");
    let out = attention_finish(&b, acc).expect("finish");
    assert_eq!(
        out.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        expected.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "attention after the ready fence must read the copied pages"
    );
}

#[test]
fn a_copy_waits_for_its_consumed_fence() {
    let b = CpuBackend::new();
    let mut r = rng(12);
    let data = random_bytes(&mut r, 8192);
    let host = pinned_with(&b, &data);
    let slot = b.alloc_buffer(8192).expect("slot");
    let consumed = CpuFence::pending();
    let ready = b
        .copy_h2d(
            &range(&host, 0, 8192),
            &slot,
            0,
            std::slice::from_ref(&consumed),
        )
        .expect("copy_h2d");
    std::thread::sleep(Duration::from_millis(150));
    assert!(!ready.is_complete(), "copy ran before its consumed fence");
    assert!(
        peek(&slot, 0, 8192).iter().all(|&x| x == 0),
        "bytes were written before the consumed fence was signalled"
    );
    consumed.signal(Ok(()));
    b.host_wait(&ready).expect("ready");
    assert_eq!(peek(&slot, 0, 8192), data);
}

#[test]
fn an_injected_failure_surfaces_and_leaves_the_destination_untouched() {
    let b = CpuBackend::new();
    let mut r = rng(13);
    let before = random_bytes(&mut r, 4096);
    let data = random_bytes(&mut r, 4096);
    let host = pinned_with(&b, &data);
    let slot = b.alloc_buffer(4096).expect("slot");
    b.write_buffer(&slot, 0, &before).expect("write");

    b.inject_copy_failures(1);
    let ready = b
        .copy_h2d(&range(&host, 0, 4096), &slot, 0, &[])
        .expect("enqueue");
    // A copy waiting for the failed one fails too, without writing.
    let dependent = b
        .copy_h2d(
            &range(&host, 0, 4096),
            &slot,
            0,
            std::slice::from_ref(&ready),
        )
        .expect("enqueue");
    let e = b.compute_wait(&ready);
    assert!(
        matches!(e, Err(TransferError::CopyFailed(_))),
        "injected failure: {e:?}"
    );
    let e = b.host_wait(&dependent);
    assert!(
        matches!(e, Err(TransferError::CopyFailed(_))),
        "dependent copy: {e:?}"
    );
    let mut now = vec![0u8; 4096];
    b.read_buffer(&slot, 0, &mut now).expect("read");
    assert_eq!(now, before, "a failed copy changed the destination");

    // The engine stays usable: the next copy succeeds.
    let ok = b
        .copy_h2d(&range(&host, 0, 4096), &slot, 0, &[])
        .expect("enqueue");
    b.compute_wait(&ok).expect("retry succeeds");
    b.read_buffer(&slot, 0, &mut now).expect("read");
    assert_eq!(now, data);
}

#[test]
fn a_publication_then_a_fill_of_the_same_host_bytes_run_in_fifo_order() {
    let b = CpuBackend::new();
    let mut r = rng(14);
    let old = random_bytes(&mut r, 4096);
    let new = random_bytes(&mut r, 4096);
    let host = pinned_with(&b, &old);
    let dev = b.alloc_buffer(2 * 4096).expect("dev");
    b.write_buffer(&dev, 0, &new).expect("write");
    // The publication is slow; the fill of the same host bytes has no fence, only queue order.
    b.set_copy_delay(Duration::from_millis(100));
    let published = b
        .copy_d2h(&dev, 0, &range(&host, 0, 4096), &[])
        .expect("d2h");
    let refilled = b
        .copy_h2d(&range(&host, 0, 4096), &dev, 4096, &[])
        .expect("h2d");
    b.host_wait(&refilled).expect("h2d");
    assert!(
        published.is_complete(),
        "FIFO: the earlier copy finished first"
    );
    b.set_copy_delay(Duration::ZERO);
    let mut got = vec![0u8; 4096];
    b.read_buffer(&dev, 4096, &mut got).expect("read");
    assert_eq!(got, new, "the fill must see the published bytes");
}

#[test]
fn synchronize_drains_the_queue() {
    let b = CpuBackend::new();
    let mut r = rng(15);
    let data = random_bytes(&mut r, 3000);
    let host = pinned_with(&b, &data);
    let dev = b.alloc_buffer(3000 * 4).expect("dev");
    b.set_copy_delay(Duration::from_millis(20));
    let fences: Vec<_> = (0..4)
        .map(|i| {
            b.copy_h2d(&range(&host, 0, 3000), &dev, i * 3000, &[])
                .expect("h2d")
        })
        .collect();
    b.synchronize().expect("synchronize");
    assert!(fences.iter().all(|f| f.is_complete()));
    assert_eq!(b.completed_copies(), 4);
    for i in 0..4 {
        assert_eq!(peek(&dev, i * 3000, 3000), data);
    }
}

#[test]
fn dropping_the_backend_joins_the_worker_without_hanging() {
    let (tx, rx) = std::sync::mpsc::channel();
    let blocked = std::thread::spawn(move || {
        let b = CpuBackend::new();
        let host = PinnedBuffer::new(&b, 64).expect("pinned");
        let dev = b.alloc_buffer(64).expect("dev");
        let never = CpuFence::pending();
        let stuck = b
            .copy_h2d(&range(&host, 0, 64), &dev, 0, &[never])
            .expect("enqueue");
        drop(host);
        drop(b);
        let _ = tx.send(stuck.try_result());
    });
    let result = rx
        .recv_timeout(Duration::from_secs(5))
        .expect("dropping the backend hung");
    assert!(
        matches!(result, Some(Err(_))),
        "a copy still waiting at shutdown must fail, got {result:?}"
    );
    blocked.join().expect("thread");
}
