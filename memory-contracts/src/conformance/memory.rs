//! Section B: memory and streaming.
//!
//! Guarantees: device buffers carved by the arena keep each region's bytes; the pinned host store
//! round-trips encoded rows; the copy engine moves exactly the requested bytes, honours
//! `wait_for` fences and reports bad ranges as typed errors; host pages land in ring slots placed
//! out of order and new rows publish back to the host; `kv_write` equals
//! [`encode`] byte for byte and checks its offsets.

use super::{random_bytes, random_f32, rng};
use crate::arena::Arena;
use crate::backend::{DeviceBuffer, Fence};
use crate::error::{HostError, TransferError};
use crate::host::{HostKvStore, HostRange, PinnedBuffer, PinnedHost};
use crate::kv::format::{encode, KvType};
use crate::kv::geometry::PageGeometry;
use crate::ops::{KvOps, TensorOps};
use crate::transfer::{CopyEngine, DeviceMemory};
use rand::seq::SliceRandom;
use rand::Rng;
use std::sync::Arc;

fn read<B: DeviceMemory>(b: &B, buf: &B::Buffer, offset: usize, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    b.read_buffer(buf, offset, &mut out)
        .unwrap_or_else(|e| panic!("read_buffer({offset}, {n}): {e}"));
    out
}

fn host_read(bytes: &Arc<crate::host::HostBytes>, offset: usize, n: usize) -> Vec<u8> {
    let mut out = vec![0u8; n];
    bytes
        .read(offset, &mut out)
        .unwrap_or_else(|e| panic!("host read({offset}, {n}): {e}"));
    out
}

/// Encodes rows of `row_values` values each.
pub fn encode_rows(ty: KvType, values: &[f32], row_values: usize) -> Vec<u8> {
    let row_bytes = ty.bytes_for(row_values).expect("block multiple");
    let mut out = vec![0u8; values.len() / row_values * row_bytes];
    for (x, o) in values
        .chunks_exact(row_values)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        encode(ty, x, o).expect("encode");
    }
    out
}

/// One arena parent buffer: committed regions keep their own bytes, a re-layout that carries the
/// persistent regions keeps their contents, and out-of-range accesses are typed errors.
pub fn arena_buffers_write_and_read<B: DeviceMemory>(b: &B) {
    let mut r = rng(1);
    let cap = 3 * 4096 + 1000;
    let buf = b.alloc_buffer(cap).expect("alloc_buffer");
    assert_eq!(buf.len(), cap, "buffer length");
    let mut arena = Arena::new(cap);
    let mut s = arena.begin(false);
    s.reserve("weights", 5000, 256, true).expect("reserve");
    s.reserve("pool", 4096, 4096, true).expect("reserve");
    s.reserve("ring", 3000, 256, false).expect("reserve");
    arena.commit(s).expect("commit");
    let mut contents = Vec::new();
    for id in ["weights", "pool", "ring"] {
        let view = arena.view(id).expect("view");
        let data = random_bytes(&mut r, view.len);
        b.write_buffer(&buf, view.offset, &data).expect("write");
        contents.push((view, data));
    }
    for (view, data) in &contents {
        assert_eq!(
            &read(b, &buf, view.offset, view.len),
            data,
            "region `{}` lost its bytes",
            view.region
        );
    }
    // Phase change: keep the persistent regions, replace the ring by a scratch region.
    let mut s = arena.begin(true);
    s.reserve("scratch", 2500, 64, false).expect("reserve");
    arena.commit(s).expect("commit");
    let scratch = arena.view("scratch").expect("view");
    let data = random_bytes(&mut r, scratch.len);
    b.write_buffer(&buf, scratch.offset, &data).expect("write");
    assert_eq!(read(b, &buf, scratch.offset, scratch.len), data);
    for (view, data) in contents.iter().take(2) {
        arena.check_view(view).expect("persistent view survives");
        assert_eq!(&read(b, &buf, view.offset, view.len), data);
    }
    assert!(b.write_buffer(&buf, cap - 10, &[1; 11]).is_err());
    let mut one = [0u8; 1];
    assert!(b.read_buffer(&buf, cap, &mut one).is_err());
    assert!(b.read_buffer(&buf, usize::MAX, &mut one).is_err());
    b.synchronize().expect("synchronize");
}

/// The host KV store: rows round-trip for every K/V type, truncation and capacity are enforced
/// with typed errors, and page ranges address the rows the geometry says.
pub fn pinned_host_store_round_trip<B: PinnedHost>(b: &B) {
    let mut r = rng(2);
    for (k_type, v_type) in [
        (KvType::F32, KvType::F16),
        (KvType::Bf16, KvType::Q8_0),
        (KvType::Q4_0, KvType::Q4_0),
    ] {
        let g = PageGeometry::new(8, 2, 32, k_type, v_type).expect("geometry");
        let mut store = HostKvStore::new(b, g, 2, 20).expect("host store");
        assert!(store.pinned_bytes() >= 2 * g.pages_for(20) * g.page_bytes());
        let n = 13;
        let k = encode_rows(
            k_type,
            &random_f32(&mut r, n * g.row_values(), 2.0),
            g.row_values(),
        );
        let v = encode_rows(
            v_type,
            &random_f32(&mut r, n * g.row_values(), 2.0),
            g.row_values(),
        );
        let gen0 = store.generation();
        store.write_rows(1, 0, &k, &v).expect("write_rows");
        assert!(store.generation() > gen0);
        assert_eq!(store.len(1).ok(), Some(n));
        assert_eq!(store.len(0).ok(), Some(0));
        let (kr, vr) = (g.k_row_bytes(), g.v_row_bytes());
        let (mut kb, mut vb) = (vec![0u8; kr], vec![0u8; vr]);
        for t in 0..n {
            store.read_row(1, t, &mut kb, &mut vb).expect("read_row");
            assert_eq!(kb, k[t * kr..(t + 1) * kr], "{k_type}: K row {t}");
            assert_eq!(vb, v[t * vr..(t + 1) * vr], "{v_type}: V row {t}");
        }
        // Page ranges address the geometry's rows.
        let pr = store.page_range(1, 1, 1).expect("page_range");
        assert_eq!(pr.len, g.page_bytes());
        let t = 9; // page 1, row 1
        assert_eq!(
            host_read(&pr.bytes, pr.offset + g.k_row_offset(0, 8, t), kr),
            k[t * kr..(t + 1) * kr]
        );
        assert_eq!(
            host_read(&pr.bytes, pr.offset + g.v_row_offset(0, 8, t), vr),
            v[t * vr..(t + 1) * vr]
        );
        assert!(matches!(
            store.page_range(1, 2, 5),
            Err(HostError::Page { .. })
        ));
        // Truncate, capacity, layers.
        store.truncate(1, 5).expect("truncate");
        assert!(store.read_row(1, 5, &mut kb, &mut vb).is_err());
        store.read_row(1, 4, &mut kb, &mut vb).expect("row 4 kept");
        let (k2, v2) = ([&k[..], &k[..]].concat(), [&v[..], &v[..]].concat());
        assert!(
            matches!(
                store.write_rows(1, 5, &k2, &v2),
                Err(HostError::Full { .. })
            ),
            "{k_type}/{v_type}: writing past the capacity"
        );
        assert!(
            matches!(
                store.write_rows(1, 6, &k[..kr], &v[..vr]),
                Err(HostError::Full { .. })
            ),
            "{k_type}/{v_type}: leaving a gap after the last row"
        );
        store
            .write_rows(1, 5, &k, &v)
            .expect("append up to 18 of 20");
        assert_eq!(store.len(1).ok(), Some(18));
        assert!(matches!(
            store.write_rows(2, 0, &k[..kr], &v[..vr]),
            Err(HostError::Layer { .. })
        ));
        assert!(matches!(
            store.write_rows(0, 0, &k[..kr - 1], &v[..vr]),
            Err(HostError::RowBytes { .. })
        ));
    }
}

/// h2d and d2h move exactly the requested bytes; a copy that waits for another copy's fence sees
/// its bytes; compute fences complete; bad ranges are typed errors.
pub fn copy_engine_round_trip_with_fences<B: DeviceMemory + CopyEngine + PinnedHost>(b: &B) {
    let mut r = rng(3);
    let n = 3 * 4096 + 123;
    let src = PinnedBuffer::new(b, n).expect("pinned");
    let data = random_bytes(&mut r, n);
    src.bytes().write(0, &data).expect("host write");
    let dev = b.alloc_buffer(n + 512).expect("alloc");
    let whole = HostRange {
        bytes: Arc::clone(src.bytes()),
        offset: 0,
        len: n,
    };
    let ready = b.copy_h2d(&whole, &dev, 256, &[]).expect("copy_h2d");
    b.compute_wait(&ready).expect("compute_wait");
    assert!(ready.is_complete());
    assert_eq!(read(b, &dev, 256, n), data, "h2d bytes");
    assert_eq!(
        read(b, &dev, 0, 256),
        vec![0u8; 256],
        "h2d wrote before its range"
    );

    // h2d of the second half to offset 0, then d2h of it, chained only by the ready fence.
    let half = n / 2;
    let dst = PinnedBuffer::new(b, n).expect("pinned");
    let second = HostRange {
        bytes: Arc::clone(src.bytes()),
        offset: half,
        len: n - half,
    };
    let ready2 = b.copy_h2d(&second, &dev, 0, &[]).expect("copy_h2d");
    let out = HostRange {
        bytes: Arc::clone(dst.bytes()),
        offset: 100,
        len: n - half,
    };
    let published = b.copy_d2h(&dev, 0, &out, &[ready2]).expect("copy_d2h");
    b.host_wait(&published).expect("host_wait");
    assert_eq!(host_read(dst.bytes(), 100, n - half), data[half..]);
    assert_eq!(host_read(dst.bytes(), 0, 100), vec![0u8; 100]);

    let cf = b.record_compute_fence().expect("compute fence");
    b.host_wait(&cf).expect("compute fence completes");

    // Bad ranges: typed errors, nothing enqueued.
    let r1 = b.copy_h2d(&whole, &dev, 600, &[]);
    assert!(
        matches!(r1, Err(TransferError::OutOfRange { .. })),
        "h2d past the device buffer: {r1:?}"
    );
    let bad_host = HostRange {
        bytes: Arc::clone(src.bytes()),
        offset: n - 10,
        len: 11,
    };
    let r2 = b.copy_h2d(&bad_host, &dev, 0, &[]);
    assert!(
        matches!(r2, Err(TransferError::OutOfRange { .. })),
        "h2d past the host range: {r2:?}"
    );
    let r3 = b.copy_d2h(&dev, n + 512 - 10, &out, &[]);
    assert!(
        matches!(r3, Err(TransferError::OutOfRange { .. })),
        "d2h past the device buffer: {r3:?}"
    );
    b.synchronize().expect("synchronize");
}

/// Pages of the host history are copied into ring slots in a shuffled order (each copy after a
/// consumed fence) and land intact; a new row written on the device publishes back to the host
/// after a producer fence.
pub fn host_pages_stream_into_ring_slots_and_rows_publish_back<
    B: DeviceMemory + CopyEngine + PinnedHost,
>(
    b: &B,
) {
    let mut r = rng(4);
    let (k_type, v_type) = b
        .capabilities()
        .kv_pairs
        .iter()
        .copied()
        .find(|&(k, v)| k.is_quantized() && v.is_quantized())
        .unwrap_or((KvType::F16, KvType::F16));
    let g = PageGeometry::new(8, 2, 64, k_type, v_type).expect("geometry");
    let mut store = HostKvStore::new(b, g, 1, 64).expect("host store");
    let n = 29; // 3 full pages and a partial one
    let rv = g.row_values();
    let k = encode_rows(k_type, &random_f32(&mut r, n * rv, 3.0), rv);
    let v = encode_rows(v_type, &random_f32(&mut r, n * rv, 3.0), rv);
    store.write_rows(0, 0, &k, &v).expect("write_rows");
    let pages = g.pages_for(n);
    let pb = g.page_bytes();
    let pool = b.alloc_buffer((pages + 2) * pb).expect("alloc");
    let mut slots: Vec<usize> = (0..pages + 2).collect();
    slots.shuffle(&mut r);
    let mut fences = Vec::new();
    for (p, &slot) in slots.iter().enumerate().take(pages) {
        let consumed = b.record_compute_fence().expect("compute fence");
        let src = store.page_range(0, p, 1).expect("page_range");
        fences.push(
            b.copy_h2d(&src, &pool, slot * pb, &[consumed])
                .expect("copy_h2d"),
        );
    }
    for f in &fences {
        b.compute_wait(f).expect("ready");
    }
    for (p, &slot) in slots.iter().enumerate().take(pages) {
        let src = store.page_range(0, p, 1).expect("page_range");
        assert_eq!(
            read(b, &pool, slot * pb, pb),
            host_read(&src.bytes, src.offset, pb),
            "page {p} in slot {slot}"
        );
    }
    // Publication: token n is written on the device (in the tail page's slot) and copied back.
    let tail = slots[pages - 1] * pb;
    let t = n;
    let first = (pages - 1) * g.tokens_per_page();
    let (kr, vr) = (g.k_row_bytes(), g.v_row_bytes());
    let krow = encode_rows(k_type, &random_f32(&mut r, rv, 3.0), rv);
    let vrow = encode_rows(v_type, &random_f32(&mut r, rv, 3.0), rv);
    let (dk, dv) = (
        g.k_row_offset(tail, first, t),
        g.v_row_offset(tail, first, t),
    );
    b.write_buffer(&pool, dk, &krow).expect("write");
    b.write_buffer(&pool, dv, &vrow).expect("write");
    let producer = b.record_compute_fence().expect("producer");
    let (hk, hv) = store.row_offsets(t);
    let layer = Arc::clone(store.layer_bytes(0).expect("layer"));
    let fk = b
        .copy_d2h(
            &pool,
            dk,
            &HostRange {
                bytes: Arc::clone(&layer),
                offset: hk,
                len: kr,
            },
            std::slice::from_ref(&producer),
        )
        .expect("publish K");
    let fv = b
        .copy_d2h(
            &pool,
            dv,
            &HostRange {
                bytes: layer,
                offset: hv,
                len: vr,
            },
            &[producer],
        )
        .expect("publish V");
    b.host_wait(&fk).expect("K published");
    b.host_wait(&fv).expect("V published");
    store.commit_published(0, t, 1).expect("commit_published");
    let (mut kb, mut vb) = (vec![0u8; kr], vec![0u8; vr]);
    store.read_row(0, t, &mut kb, &mut vb).expect("read_row");
    assert_eq!(kb, krow, "published K row");
    assert_eq!(vb, vrow, "published V row");
    store
        .read_row(0, t - 1, &mut kb, &mut vb)
        .expect("read_row");
    assert_eq!(
        kb,
        k[(t - 1) * kr..t * kr],
        "row before the publication untouched"
    );
}

/// For every advertised K/V pair: `kv_write` puts exactly `encode`'s bytes at the given
/// (out-of-order) offsets and nothing elsewhere; bad offsets and shapes are typed errors that
/// leave the pool untouched.
pub fn kv_write_equals_encode<B: DeviceMemory + KvOps + TensorOps>(b: &B) {
    let mut r = rng(5);
    for (k_type, v_type) in b.capabilities().kv_pairs {
        let g = PageGeometry::new(8, 2, 64, k_type, v_type).expect("geometry");
        let pb = g.page_bytes();
        let pool_len = 3 * pb;
        let pool = b.alloc_buffer(pool_len).expect("alloc");
        let n = 5;
        let rv = g.row_values();
        let k = random_f32(&mut r, n * rv, 4.0);
        let v = random_f32(&mut r, n * rv, 4.0);
        // Distinct tokens of a 3-page run, in shuffled order.
        let mut tokens: Vec<usize> = (0..3 * g.tokens_per_page()).collect();
        tokens.shuffle(&mut r);
        tokens.truncate(n);
        let rows: Vec<(usize, usize)> = tokens
            .iter()
            .map(|&t| (g.k_row_offset(0, 0, t), g.v_row_offset(0, 0, t)))
            .collect();
        let kt = b.tensor_from_f32(&k, &[n, rv]).expect("tensor");
        let vt = b.tensor_from_f32(&v, &[n, rv]).expect("tensor");
        b.kv_write(&kt, &vt, &g, &pool, &rows).expect("kv_write");
        let ke = encode_rows(k_type, &k, rv);
        let ve = encode_rows(v_type, &v, rv);
        let (kr, vr) = (g.k_row_bytes(), g.v_row_bytes());
        let mut expected = vec![0u8; pool_len];
        for (i, &(ko, vo)) in rows.iter().enumerate() {
            expected[ko..ko + kr].copy_from_slice(&ke[i * kr..(i + 1) * kr]);
            expected[vo..vo + vr].copy_from_slice(&ve[i * vr..(i + 1) * vr]);
        }
        let got = read(b, &pool, 0, pool_len);
        assert!(
            got == expected,
            "{k_type}/{v_type}: kv_write bytes differ from encode"
        );
        // A bad offset anywhere: error, pool untouched.
        let mut bad = rows.clone();
        let i = r.random_range(0..n);
        bad[i].1 = pool_len - vr + 1;
        let k2 = b
            .tensor_from_f32(&random_f32(&mut r, n * rv, 1.0), &[n, rv])
            .expect("t");
        assert!(
            b.kv_write(&k2, &vt, &g, &pool, &bad).is_err(),
            "{k_type}/{v_type}: out-of-range row accepted"
        );
        assert!(
            b.kv_write(&kt, &vt, &g, &pool, &rows[..n - 1]).is_err(),
            "{k_type}/{v_type}: row count mismatch accepted"
        );
        assert!(
            read(b, &pool, 0, pool_len) == expected,
            "{k_type}/{v_type}: a failed kv_write changed the pool"
        );
    }
}
