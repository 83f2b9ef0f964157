//! CPU-specific properties of the reference streamed attention, beyond the conformance suite.

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::conformance::attention::{contiguous, mixed, AttentionCase};
use kvstream_memory_contracts::conformance::rng;
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::TensorOps;

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The same case with its dequantised values stored as F32 pages.
fn as_f32(case: &AttentionCase) -> AttentionCase {
    let g = case.geometry;
    let g32 = PageGeometry::new(
        g.tokens_per_page(),
        g.kv_heads(),
        g.head_dim(),
        KvType::F32,
        KvType::F32,
    )
    .expect("geometry");
    let rv = g32.row_values();
    let mut image = vec![0u8; g32.pages_for(case.shape.total) * g32.page_bytes()];
    for t in 0..case.shape.total {
        let (ko, vo) = (g32.k_row_offset(0, 0, t), g32.v_row_offset(0, 0, t));
        encode(
            KvType::F32,
            &case.k[t * rv..(t + 1) * rv],
            &mut image[ko..ko + rv * 4],
        )
        .expect("encode");
        encode(
            KvType::F32,
            &case.v[t * rv..(t + 1) * rv],
            &mut image[vo..vo + rv * 4],
        )
        .expect("encode");
    }
    let mut shape = case.shape;
    shape.k_type = KvType::F32;
    shape.v_type = KvType::F32;
    AttentionCase {
        shape,
        geometry: g32,
        image,
        ..case.clone()
    }
}

#[test]
fn quantised_pages_equal_attention_over_their_dequantised_values_bit_for_bit() {
    let b = CpuBackend::new();
    for (i, (k, v)) in [
        (KvType::Q8_0, KvType::Q4_0),
        (KvType::Q4_0, KvType::Q8_0),
        (KvType::Q8_0, KvType::Q8_0),
        (KvType::Bf16, KvType::Q4_0),
        (KvType::F16, KvType::F16),
    ]
    .into_iter()
    .enumerate()
    {
        for width in [1, 4, 37] {
            let mut r = rng(200 + i as u64 * 8 + width as u64);
            let case = AttentionCase::random(&mut r, k, v, width);
            let sh = case.shape;
            let q = b
                .tensor_from_f32(&case.q, &[width, sh.q_heads, sh.head_dim])
                .expect("q");
            let spans = case.random_spans(&mut r);
            let streamed = mixed(&b, &mut r, &case, &spans, &q, true);
            let dense = contiguous(&b, &as_f32(&case), &q);
            assert!(
                bits(&streamed) == bits(&dense),
                "{k}/{v} width {width}: streamed quantised != dense dequantised"
            );
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let b = CpuBackend::new();
    let mut r = rng(300);
    let case = AttentionCase::random(&mut r, KvType::Q8_0, KvType::F16, 37);
    let sh = case.shape;
    let q = b
        .tensor_from_f32(&case.q, &[sh.width, sh.q_heads, sh.head_dim])
        .expect("q");
    let spans = case.random_spans(&mut r);
    let run = |threads: usize, seed: u64| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool");
        pool.install(|| mixed(&b, &mut rng(seed), &case, &spans, &q, seed % 2 == 0))
    };
    let one = run(1, 1);
    for (threads, seed) in [(2, 2), (3, 3), (8, 4)] {
        assert!(
            bits(&run(threads, seed)) == bits(&one),
            "{threads} threads differ from 1 thread"
        );
    }
    // Decode width 1 takes the head-split path on many threads.
    let case1 = AttentionCase::random(&mut r, KvType::F32, KvType::Q4_0, 1);
    let q1 = b
        .tensor_from_f32(&case1.q, &[1, case1.shape.q_heads, case1.shape.head_dim])
        .expect("q");
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("pool")
            .install(|| contiguous(&b, &case1, &q1))
    };
    assert!(bits(&on(1)) == bits(&on(16)));
}

#[test]
fn a_query_never_sees_tokens_past_its_causal_limit() {
    let b = CpuBackend::new();
    let mut r = rng(400);
    let case = AttentionCase::random(&mut r, KvType::F32, KvType::F32, 3);
    let sh = case.shape;
    let q = b
        .tensor_from_f32(&case.q, &[3, sh.q_heads, sh.head_dim])
        .expect("q");
    let base = contiguous(&b, &case, &q);
    // Change the last token's V row: only the last query may change.
    let mut changed = case.clone();
    let t = sh.total - 1;
    let g = case.geometry;
    let vo = g.v_row_offset(0, 0, t);
    let rv = g.row_values();
    let new_v: Vec<f32> = (0..rv).map(|j| 5.0 + j as f32).collect();
    encode(KvType::F32, &new_v, &mut changed.image[vo..vo + rv * 4]).expect("encode");
    let out = contiguous(&b, &changed, &q);
    let per_query = sh.q_heads * sh.head_dim;
    assert_eq!(
        bits(&out[..2 * per_query]),
        bits(&base[..2 * per_query]),
        "queries 0 and 1 must not see the last token"
    );
    assert_ne!(
        bits(&out[2 * per_query..]),
        bits(&base[2 * per_query..]),
        "query 2 must see the last token"
    );
}
