//! The stub refuses every streaming and compute operation with a typed capability error naming
//! `wgpu`, the operation and why, and never panics. Runs on the real probe (no GPU here: the
//! adapter-less path) and on wgpu's Noop adapter (a device exists, so buffers are real).

use kvstream_backend_stub::{StubBackend, NO_ADAPTER};
use kvstream_memory_contracts::attention::{attention_begin, AttentionShape, StreamedAttention};
use kvstream_memory_contracts::backend::{Backend, WeightDType};
use kvstream_memory_contracts::error::{
    AttentionError, CapabilityError, HostError, OpError, TransferError,
};
use kvstream_memory_contracts::host::{
    HostBytes, HostKvStore, HostRange, PinnedBuffer, PinnedHost,
};
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::{LinearOps, ModelBackend, TensorOps, WeightData};
use kvstream_memory_contracts::report::{first_missing_capability, render_capability_table};
use kvstream_memory_contracts::transfer::{CopyEngine, DeviceMemory};
use std::sync::Arc;

const SUGGEST: &str = "use --backend cuda or --backend cpu";

fn check(e: &CapabilityError, operation: &str) {
    assert_eq!(e.backend, "wgpu", "{e}");
    assert_eq!(e.operation, operation, "{e}");
    assert!(e.detail.ends_with(SUGGEST), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("`wgpu`") && msg.contains(operation), "{msg}");
}

fn assert_model_backend<B: ModelBackend>(_: &B) {}

fn noop() -> StubBackend {
    StubBackend::noop().expect("wgpu's Noop adapter is always available")
}

/// The operations that need no device-side value as input, checked on `b`.
fn refuses_everything_reachable(b: &StubBackend) {
    assert_model_backend(b);
    let mem = Arc::new(HostBytes::new(4096).expect("host alloc"));
    match b.register_host(&mem) {
        Err(HostError::Capability(e)) => check(&e, "register_host"),
        other => panic!("register_host: {other:?}"),
    }
    match b.record_compute_fence() {
        Err(TransferError::Capability(e)) => check(&e, "record_compute_fence"),
        other => panic!("record_compute_fence: {other:?}"),
    }
    let shape = AttentionShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        width: 1,
        total: 9,
        scale: 0.125,
        k_type: KvType::Q8_0,
        v_type: KvType::F16,
    };
    match b.attn_state_new(&shape) {
        Err(AttentionError::Capability(e)) => check(&e, "streamed_attention"),
        other => panic!("attn_state_new: {other:?}"),
    }
    // The validating entry point refuses before reaching the backend: no K/V pair is supported.
    match attention_begin(b, shape) {
        Err(AttentionError::Capability(e)) => {
            assert_eq!((e.backend, e.operation), ("wgpu", "streamed_attention"));
            assert!(e.detail.contains("q8_0/f16"), "{e}");
        }
        other => panic!("attention_begin: {other:?}"),
    }
    let data: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 2.0).collect();
    for (name, r) in [
        ("tensor_from_f32", b.tensor_from_f32(&data, &[3, 4])),
        ("zeros", b.zeros(&[3, 4])),
    ] {
        match r {
            Err(OpError::Capability(e)) => check(&e, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
    match b.load_weight("w", WeightDType::F32, &[3, 4], WeightData::from_vec(bytes)) {
        Err(OpError::Capability(e)) => check(&e, "load_weight"),
        other => panic!("load_weight: {other:?}"),
    }
    // The host KV store cannot be built on the stub: registration is the first thing it needs.
    let g = PageGeometry::new(16, 2, 32, KvType::F16, KvType::F16).expect("geometry");
    match HostKvStore::new(b, g, 2, 64) {
        Err(HostError::Capability(e)) => check(&e, "register_host"),
        other => panic!("HostKvStore::new: {other:?}"),
    }
    match PinnedBuffer::new(b, 100) {
        Err(HostError::Capability(e)) => check(&e, "register_host"),
        other => panic!("PinnedBuffer::new: {other:?}"),
    }
}

#[test]
fn probe_refuses_every_reachable_operation() {
    refuses_everything_reachable(&StubBackend::probe());
}

#[test]
fn noop_device_refuses_every_reachable_operation() {
    refuses_everything_reachable(&noop());
}

#[test]
fn copy_engine_refuses_with_a_real_buffer() {
    let b = noop();
    let buf = b.alloc_buffer(256).expect("noop buffer");
    let host = HostRange {
        bytes: Arc::new(HostBytes::new(256).expect("host alloc")),
        offset: 0,
        len: 128,
    };
    match b.copy_h2d(&host, &buf, 0, &[]) {
        Err(TransferError::Capability(e)) => check(&e, "copy_h2d"),
        other => panic!("copy_h2d: {other:?}"),
    }
    match b.copy_d2h(&buf, 64, &host, &[]) {
        Err(TransferError::Capability(e)) => check(&e, "copy_d2h"),
        other => panic!("copy_d2h: {other:?}"),
    }
}

/// The (possibly wrapped) value of row `label` of a capability table, joined with spaces.
fn table_value(table: &str, label: &str) -> String {
    let mut parts = Vec::new();
    let mut inside = false;
    for line in table.lines() {
        let Some((l, v)) = line.split_once('|') else {
            continue;
        };
        match (l.trim(), inside) {
            (l, _) if l == label => {
                inside = true;
                parts.push(v.trim());
            }
            ("", true) => parts.push(v.trim()),
            _ if inside => break,
            _ => {}
        }
    }
    parts.join(" ")
}

fn capabilities_are_consistent(b: &StubBackend) {
    let caps = b.capabilities();
    assert_eq!(caps.backend, b.name());
    assert_eq!(caps.backend, "wgpu");
    assert!(!caps.pinned_host && !caps.copy_engine && !caps.compute_ops);
    assert!(!caps.prefill_attention && caps.max_decode_width == 0);
    assert!(caps.kv_pairs.is_empty() && caps.weight_dtypes.is_empty());
    // What is advertised agrees with what the operations do.
    for k in KvType::ALL {
        for v in KvType::ALL {
            assert!(!caps.supports_kv_pair(k, v));
        }
    }
    let first = first_missing_capability(&caps).expect("the stub cannot run a model");
    check(&first, "pinned_host");
    let e = b.check_model_support().expect_err("never supported");
    match b.adapter() {
        Some(a) => {
            assert!(caps.device.contains(&a.name), "{}", caps.device);
            assert!(caps.device.contains("max_buffer_size"), "{}", caps.device);
            assert_eq!(e, first);
        }
        None => {
            assert!(caps.device.contains("adapter"), "{}", caps.device);
            check(&e, "adapter");
        }
    }
    let table = render_capability_table(&caps);
    assert_eq!(
        table_value(&table, "device"),
        caps.device.replace('\n', " "),
        "{table}"
    );
    assert!(table.contains("no: first missing `pinned_host`"), "{table}");
}

#[test]
fn capabilities_advertise_nothing_the_stub_cannot_do() {
    capabilities_are_consistent(&StubBackend::probe());
    capabilities_are_consistent(&noop());
}

#[test]
fn new_agrees_with_probe() {
    let probe = StubBackend::probe();
    match (StubBackend::new(), probe.adapter()) {
        (Ok(b), Some(a)) => assert_eq!(b.adapter(), Some(a)),
        (Err(e), None) => {
            check(&e, "adapter");
            if probe.adapters().is_empty() {
                assert!(e.detail.starts_with(NO_ADAPTER), "{e}");
            }
        }
        (r, a) => panic!("new() = {r:?} but probe adapter = {a:?}"),
    }
}

#[test]
fn noop_adapter_is_reported_with_its_limits() {
    let b = noop();
    let a = b.adapter().expect("noop device");
    assert_eq!(a.api, "Noop");
    assert!(a.max_buffer_size > 0);
    assert!(b.adapters().iter().any(|x| x == a));
    // The Noop adapter is never what `probe` picks.
    assert!(StubBackend::probe()
        .adapters()
        .iter()
        .all(|x| x.api != "Noop"));
}
