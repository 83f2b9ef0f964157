//! Section A: capability reporting. Every backend, stubs included, must pass it.
//!
//! Guarantees: `capabilities()` is stable and self-consistent; anything a backend does not
//! advertise fails with a typed [`CapabilityError`] that names the backend and the operation
//! (never a panic, never a silent fallback); malformed requests are typed errors before any
//! backend code runs.

use crate::attention::{attention_begin, AttentionShape, StreamedAttention};
use crate::backend::{Backend, Capabilities, WeightDType};
use crate::error::{AttentionError, CapabilityError, HostError, OpError, TransferError};
use crate::host::{HostBytes, HostRange, PinnedHost};
use crate::kv::format::KvType;
use crate::ops::{LinearOps, ModelBackend, TensorOps, WeightData};
use crate::transfer::{CopyEngine, DeviceMemory};
use std::sync::Arc;

/// A small valid shape with the given types and width.
pub fn shape(k: KvType, v: KvType, width: usize) -> AttentionShape {
    AttentionShape {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 32,
        width,
        total: width + 40,
        scale: 32f32.sqrt().recip(),
        k_type: k,
        v_type: v,
    }
}

/// Asserts that `e` names `backend` and an operation, and returns it.
fn check_capability<'e>(
    e: &'e CapabilityError,
    backend: &str,
    context: &str,
) -> &'e CapabilityError {
    assert_eq!(
        e.backend, backend,
        "{context}: capability error names backend `{}`, expected `{backend}`",
        e.backend
    );
    assert!(
        !e.operation.is_empty() && !e.detail.is_empty(),
        "{context}: capability error must name the operation and say why: {e:?}"
    );
    e
}

/// `capabilities()` is stable, names this backend, lists distinct valid K/V pairs, and its flags
/// agree with each other.
pub fn capabilities_are_self_consistent<B: Backend>(b: &B) {
    let caps: Capabilities = b.capabilities();
    assert_eq!(caps, b.capabilities(), "capabilities() must be stable");
    assert_eq!(caps.backend, b.name(), "capabilities().backend != name()");
    assert!(!caps.backend.is_empty(), "backend name must not be empty");
    let all = Capabilities::all_kv_pairs();
    for (i, p) in caps.kv_pairs.iter().enumerate() {
        assert!(all.contains(p), "unknown K/V pair {p:?}");
        assert!(
            !caps.kv_pairs[..i].contains(p),
            "K/V pair {p:?} listed twice"
        );
        assert!(caps.supports_kv_pair(p.0, p.1));
    }
    for (k, v) in all {
        assert_eq!(
            caps.supports_kv_pair(k, v),
            caps.kv_pairs.contains(&(k, v)),
            "supports_kv_pair disagrees with kv_pairs for {k}/{v}"
        );
    }
    if !caps.kv_pairs.is_empty() {
        assert!(
            caps.max_decode_width >= 1,
            "a backend with attention must support decode width 1"
        );
    }
    if caps.copy_engine {
        assert!(
            caps.pinned_host,
            "an asynchronous copy engine needs pinned host memory"
        );
    }
    if caps.compute_ops {
        assert!(
            !caps.weight_dtypes.is_empty(),
            "compute ops without any weight dtype"
        );
    }
    for (i, d) in caps.weight_dtypes.iter().enumerate() {
        assert!(
            !caps.weight_dtypes[..i].contains(d),
            "weight dtype {d} listed twice"
        );
    }
}

/// Every K/V pair the backend does not list fails `attention_begin` with a capability error
/// naming the backend, `streamed_attention` and the pair; every listed pair starts.
pub fn unsupported_kv_pairs_are_capability_errors<B: StreamedAttention>(b: &B) {
    let caps = b.capabilities();
    for (k, v) in Capabilities::all_kv_pairs() {
        let r = attention_begin(b, shape(k, v, 1));
        if caps.supports_kv_pair(k, v) {
            assert!(r.is_ok(), "advertised pair {k}/{v} fails: {:?}", r.err());
            continue;
        }
        match r {
            Err(AttentionError::Capability(e)) => {
                let e = check_capability(&e, b.name(), &format!("pair {k}/{v}"));
                assert_eq!(e.operation, "streamed_attention");
                assert!(
                    e.detail.contains(&format!("{k}/{v}")),
                    "detail should name the pair {k}/{v}: {}",
                    e.detail
                );
            }
            other => panic!(
                "unsupported pair {k}/{v}: expected a capability error, got {:?}",
                other.err()
            ),
        }
    }
}

/// Widths `1..=max_decode_width` start; a wider request is a capability error unless the backend
/// advertises prefill attention.
pub fn unsupported_widths_are_capability_errors<B: StreamedAttention>(b: &B) {
    let caps = b.capabilities();
    let Some(&(k, v)) = caps.kv_pairs.first() else {
        // No attention at all: even width 1 must be a capability error.
        match attention_begin(b, shape(KvType::F32, KvType::F32, 1)) {
            Err(AttentionError::Capability(e)) => {
                check_capability(&e, b.name(), "no attention");
            }
            other => panic!("backend lists no K/V pairs but attention did not fail with a capability error: {:?}", other.err()),
        }
        return;
    };
    let max = caps.max_decode_width.min(64);
    for w in 1..=max {
        let r = attention_begin(b, shape(k, v, w));
        assert!(r.is_ok(), "advertised width {w} fails: {:?}", r.err());
    }
    let wide = caps.max_decode_width + 1;
    let r = attention_begin(b, shape(k, v, wide));
    if caps.prefill_attention {
        assert!(
            r.is_ok(),
            "prefill attention is advertised but width {wide} fails: {:?}",
            r.err()
        );
    } else {
        match r {
            Err(AttentionError::Capability(e)) => {
                check_capability(&e, b.name(), &format!("width {wide}"));
            }
            other => panic!(
                "width {wide} is not advertised: expected a capability error, got {:?}",
                other.err()
            ),
        }
    }
}

/// Bad GQA ratios and widths are typed errors, whatever the backend supports.
pub fn malformed_requests_are_typed_errors<B: StreamedAttention>(b: &B) {
    let (k, v) = b
        .capabilities()
        .kv_pairs
        .first()
        .copied()
        .unwrap_or((KvType::F32, KvType::F32));
    let base = shape(k, v, 1);
    for (q_heads, kv_heads) in [(3, 2), (4, 0), (2, 4)] {
        let r = attention_begin(
            b,
            AttentionShape {
                q_heads,
                kv_heads,
                ..base
            },
        );
        assert!(
            matches!(r, Err(AttentionError::Gqa { q_heads: q, kv_heads: kv }) if q == q_heads && kv == kv_heads),
            "GQA {q_heads}/{kv_heads}: expected AttentionError::Gqa, got {:?}",
            r.err()
        );
    }
    for (width, total) in [(0, 10), (11, 10)] {
        let r = attention_begin(
            b,
            AttentionShape {
                width,
                total,
                ..base
            },
        );
        assert!(
            matches!(r, Err(AttentionError::Width { .. })),
            "width {width} of {total}: expected AttentionError::Width, got {:?}",
            r.err()
        );
    }
}

/// With the full op surface: compute ops, weight dtypes, pinned host registration and the copy
/// engine fail with a capability error naming the backend when not advertised, and work when
/// advertised; buffer allocation works or says why.
pub fn unadvertised_ops_are_capability_errors<B: ModelBackend>(b: &B) {
    let caps = b.capabilities();
    let zeros = TensorOps::zeros(b, &[2, 3]);
    if caps.compute_ops {
        let t = zeros.unwrap_or_else(|e| panic!("compute ops advertised but zeros failed: {e}"));
        let back = TensorOps::tensor_to_f32(b, &t)
            .unwrap_or_else(|e| panic!("compute ops advertised but download failed: {e}"));
        assert_eq!(back.len(), 6);
    } else {
        match zeros {
            Err(OpError::Capability(e)) => {
                check_capability(&e, b.name(), "zeros without compute ops");
            }
            other => panic!(
                "compute ops not advertised: zeros should be a capability error, got {other:?}"
            ),
        }
    }
    for dtype in WeightDType::ALL {
        // K = 128 satisfies every format's K rule.
        let dims = [4usize, 128];
        let len = dtype
            .storage_bytes(&dims)
            .expect("4 × 128 is valid in every weight dtype");
        let bytes = vec![0x3cu8; len];
        let r = LinearOps::load_weight(
            b,
            "conformance.weight",
            dtype,
            &dims,
            WeightData::from_vec(bytes),
        );
        if caps.compute_ops && caps.weight_dtypes.contains(&dtype) {
            assert!(
                r.is_ok(),
                "advertised weight dtype {dtype} fails: {:?}",
                r.err()
            );
        } else {
            match r {
                Err(OpError::Capability(e)) => {
                    check_capability(&e, b.name(), &format!("weight dtype {dtype}"));
                }
                other => panic!("weight dtype {dtype} not advertised: expected a capability error, got {other:?}"),
            }
        }
    }
    // Memory: an allocation either works or says why (capability / out of memory), never panics.
    let buffer = match DeviceMemory::alloc_buffer(b, 4096) {
        Ok(buf) => Some(buf),
        Err(OpError::Capability(e)) => {
            check_capability(&e, b.name(), "alloc_buffer");
            None
        }
        Err(OpError::OutOfMemory { .. }) => None,
        Err(other) => panic!("alloc_buffer: expected success or a capability error, got {other}"),
    };
    // Pinned host: registration works iff advertised.
    let host = Arc::new(HostBytes::new(4096).expect("host allocation"));
    match (caps.pinned_host, PinnedHost::register_host(b, &host)) {
        (true, Ok(_)) => {}
        (true, Err(e)) => panic!("pinned host advertised but register_host failed: {e}"),
        (false, Err(HostError::Capability(e))) => {
            check_capability(&e, b.name(), "register_host");
        }
        (false, other) => panic!(
            "pinned host not advertised: register_host should be a capability error, got {:?}",
            other.err()
        ),
    }
    // Copy engine: fences and copies work iff advertised.
    let fence = CopyEngine::record_compute_fence(b);
    if caps.copy_engine {
        let f = fence.unwrap_or_else(|e| panic!("copy engine advertised but no fence: {e}"));
        CopyEngine::host_wait(b, &f).expect("a compute fence completes");
    } else {
        match fence {
            Err(TransferError::Capability(e)) => {
                check_capability(&e, b.name(), "record_compute_fence");
            }
            other => panic!(
                "copy engine not advertised: record_compute_fence should be a capability error, got {:?}",
                other.err()
            ),
        }
        if let Some(buf) = buffer {
            let src = HostRange {
                bytes: host,
                offset: 0,
                len: 64,
            };
            match CopyEngine::copy_h2d(b, &src, &buf, 0, &[]) {
                Err(TransferError::Capability(e)) => {
                    check_capability(&e, b.name(), "copy_h2d");
                }
                other => panic!(
                    "copy engine not advertised: copy_h2d should be a capability error, got {:?}",
                    other.err()
                ),
            }
        }
    }
}
