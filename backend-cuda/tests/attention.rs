//! Streamed attention on the GPU against the CPU backend for decode widths 1..=4 and a prefill
//! width, over every K/V format pair (16-token pages: the generic kernel), the tensor-core
//! Q8_0/Q4_0 decode kernel (64..256-token pages, head_dim 64/128/256, up to 32 query rows,
//! including the 27B geometry), plus resident == streamed bit for bit with several waves on both
//! kernels. Run on a GPU machine with `--ignored`.

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::attention::*;
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::TensorOps;
use kvstream_memory_contracts::transfer::DeviceMemory;
use kvstream_memory_contracts::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::gpu;

/// A contiguous page image of `total` tokens with random K/V.
fn image(g: &PageGeometry, total: usize, rng: &mut StdRng) -> Vec<u8> {
    let pages = g.pages_for(total);
    let mut img = vec![0u8; pages * g.page_bytes()];
    let rv = g.row_values();
    for t in 0..total {
        let k: Vec<f32> = (0..rv).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let v: Vec<f32> = (0..rv).map(|_| rng.random_range(-2.0f32..2.0)).collect();
        let ko = g.k_row_offset(0, 0, t);
        let vo = g.v_row_offset(0, 0, t);
        encode(g.k_type(), &k, &mut img[ko..ko + g.k_row_bytes()]).expect("encode k");
        encode(g.v_type(), &v, &mut img[vo..vo + g.v_row_bytes()]).expect("encode v");
    }
    img
}

/// Evaluates over `waves`, each a list of (first_page, pages) placed in a scrambled pool.
fn run<B: StreamedAttention + DeviceMemory + TensorOps>(
    b: &B,
    shape: AttentionShape,
    g: &PageGeometry,
    img: &[u8],
    q: &[f32],
    waves: &[Vec<(usize, usize)>],
) -> Vec<f32> {
    let qt = b
        .tensor_from_f32(q, &[shape.width, shape.q_heads, shape.head_dim])
        .expect("q");
    let pb = g.page_bytes();
    let tpp = g.tokens_per_page();
    let mut acc = attention_begin(b, shape).expect("begin");
    for wave in waves {
        // Place the wave's spans in reverse order inside a fresh pool with a one-page gap.
        let pages: usize = wave.iter().map(|w| w.1 + 1).sum();
        let mut pool = vec![0x7fu8; pages * pb];
        let mut spans = Vec::new();
        let mut cursor = pages;
        for &(first, n) in wave {
            cursor -= n + 1;
            pool[cursor * pb..(cursor + n) * pb]
                .copy_from_slice(&img[first * pb..(first + n) * pb]);
            let ft = first * tpp;
            let count = (n * tpp).min(shape.total - ft);
            spans.push(Span {
                source: SpanSource::Ring { first_slot: cursor },
                first_token: ft,
                count,
                offset: cursor * pb,
            });
        }
        let start = spans[0].first_token;
        let end = spans.last().map(|s| s.end_token()).unwrap_or(start);
        let plan = SpanPlan::new(*g, pool.len(), start, end, spans).expect("plan");
        let buf = b.alloc_buffer(pool.len()).expect("alloc");
        b.write_buffer(&buf, 0, &pool).expect("write");
        attention_accumulate(b, &mut acc, &qt, &buf, &plan).expect("accumulate");
    }
    let out = attention_finish(b, acc).expect("finish");
    b.tensor_to_f32(&out).expect("download")
}

fn shape(width: usize, total: usize, k: KvType, v: KvType) -> AttentionShape {
    AttentionShape {
        q_heads: 6,
        kv_heads: 2,
        head_dim: 64,
        width,
        total,
        scale: 0.125,
        k_type: k,
        v_type: v,
    }
}

/// A Q8_0 K / Q4_0 V shape of `group` query heads per KV head.
fn q8q4_shape(
    group: usize,
    kv_heads: usize,
    head_dim: usize,
    width: usize,
    total: usize,
) -> AttentionShape {
    AttentionShape {
        q_heads: group * kv_heads,
        kv_heads,
        head_dim,
        width,
        total,
        scale: 1.0 / (head_dim as f32).sqrt(),
        k_type: KvType::Q8_0,
        v_type: KvType::Q4_0,
    }
}

/// Largest absolute difference, after checking both sides are finite and not all zero.
fn worst_error(got: &[f32], want: &[f32], what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite output"
    );
    assert!(want.iter().any(|x| *x != 0.0), "{what}: all-zero reference");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
}

/// Waves covering `pages` (>= 2) pages in order, always at least two: no wave holds more than
/// half the pages. The first wave opens with one long span of a third of the pages (several chunks
/// of every split in one launch, so a split walks more than one chunk per launch); then come
/// random spans of 1..=9 pages, 1..=3 per wave. With splits owning interleaved 64-token chunks,
/// every wave boundary cuts through the chunk sequence of every split (each split's chunks lie in
/// both halves of the evaluation), so every split's state continues across launches.
fn random_waves(pages: usize, rng: &mut StdRng) -> Vec<Vec<(usize, usize)>> {
    assert!(pages >= 2, "{pages} pages cannot form two waves");
    let max_wave = pages / 2;
    let mut waves: Vec<Vec<(usize, usize)>> = Vec::new();
    let mut p = 0;
    while p < pages {
        let mut wave = Vec::new();
        let mut budget = max_wave;
        if p == 0 {
            let n = (pages / 3).clamp(1, budget);
            wave.push((0, n));
            p = n;
            budget -= n;
        }
        for _ in 0..rng.random_range(1..=3) {
            if p >= pages || budget == 0 {
                break;
            }
            let n = rng.random_range(1..=9usize).min(pages - p).min(budget);
            wave.push((p, n));
            p += n;
            budget -= n;
        }
        waves.push(wave);
    }
    waves
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_and_prefill_widths_match_cpu_for_every_format_pair() {
    let cpu = CpuBackend::new();
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(11);
    for k in KvType::ALL {
        for v in KvType::ALL {
            for width in [1usize, 2, 3, 4, 7] {
                let total = rng.random_range(300..700);
                let g = PageGeometry::new(16, 2, 64, k, v).expect("geometry");
                let img = image(&g, total, &mut rng);
                let sh = shape(width, total, k, v);
                let q: Vec<f32> = (0..sh.query_len())
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let pages = g.pages_for(total);
                let waves = vec![vec![(0, pages)]];
                let want = run(&cpu, sh, &g, &img, &q, &waves);
                let got = run(&gpu, sh, &g, &img, &q, &waves);
                assert!(
                    got.iter().all(|x| x.is_finite()),
                    "{k}/{v} width {width}: non-finite output"
                );
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(worst < 2e-5, "{k}/{v} width {width}: max err {worst}");
                assert!(want.iter().any(|x| *x != 0.0));
            }
        }
    }
    assert_eq!(gpu.name(), "cuda");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_equals_resident_bit_for_bit_across_waves() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(12);
    for (k, v) in [(KvType::Q8_0, KvType::Q4_0), (KvType::Bf16, KvType::F16)] {
        for width in [1usize, 4, 6] {
            let total = 2000 + rng.random_range(0..100);
            let g = PageGeometry::new(16, 2, 64, k, v).expect("geometry");
            let img = image(&g, total, &mut rng);
            let sh = shape(width, total, k, v);
            let q: Vec<f32> = (0..sh.query_len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let pages = g.pages_for(total);
            let resident = run(&gpu, sh, &g, &img, &q, &[vec![(0, pages)]]);
            // Random spans of 1..=9 pages, grouped into waves of 1..=3 spans.
            let waves = random_waves(pages, &mut rng);
            assert!(waves.len() > 2);
            assert!(
                resident.iter().all(|x| x.is_finite()),
                "resident output is not finite"
            );
            let streamed = run(&gpu, sh, &g, &img, &q, &waves);
            assert_eq!(
                streamed.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                resident.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{k}/{v} width {width}: streamed differs from resident"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_decode_kernel_matches_cpu_including_27b_geometry() {
    let cpu = CpuBackend::new();
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(13);
    // (tokens per page, group, kv heads, head_dim, widths, tokens): small heads at widths 1..=4,
    // 128-wide heads, and the 27B geometry (24 query heads, 4 KV heads × 256, 256-token pages).
    // Widths above 4 are prefill chunks: query tiles of 32 / group over grid z, each skipping the
    // chunks its causal mask hides (a tile can miss a split's first chunk entirely).
    let cases: [(usize, usize, usize, usize, &[usize], (usize, usize)); 6] = [
        (64, 3, 2, 64, &[1, 2, 3, 4], (300, 700)),
        (64, 8, 1, 128, &[1, 4], (500, 900)),
        (256, 6, 4, 256, &[1, 4], (2500, 3500)),
        (128, 6, 4, 256, &[2, 3], (1000, 1500)),
        (256, 6, 4, 256, &[5, 9, 256], (2500, 3500)),
        (64, 3, 2, 64, &[37, 300], (300, 700)),
    ];
    for (tpp, group, kv_heads, head_dim, widths, (lo, hi)) in cases {
        for &width in widths {
            let total = rng.random_range(lo..hi);
            let g = PageGeometry::new(tpp, kv_heads, head_dim, KvType::Q8_0, KvType::Q4_0)
                .expect("geometry");
            let sh = q8q4_shape(group, kv_heads, head_dim, width, total);
            assert!(
                gpu.attention_uses_fast_path(&sh, &g),
                "{sh:?} should take the fast path"
            );
            let img = image(&g, total, &mut rng);
            let q: Vec<f32> = (0..sh.query_len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let waves = vec![vec![(0, g.pages_for(total))]];
            let want = run(&cpu, sh, &g, &img, &q, &waves);
            let got = run(&gpu, sh, &g, &img, &q, &waves);
            let what = format!("tpp {tpp} group {group} d {head_dim} width {width} total {total}");
            let worst = worst_error(&got, &want, &what);
            assert!(worst < 2e-5, "{what}: max err {worst}");
        }
    }
    // Built with FA_TMA (tensor-map chunk copies, the default on sm_90+): the 256-dim cases must
    // have taken that path.
    let tma = kvstream_backend_cuda::compile::define_value("FA_TMA").is_none_or(|v| v != "0");
    if tma && gpu.arch_at_least(90) {
        assert!(
            gpu.attention_tensor_map_launches() > 0,
            "FA_TMA is set but no launch used tensor maps"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_decode_kernel_streamed_equals_resident_bit_for_bit() {
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(14);
    // 64- and 128-token pages; the splits' interleaved chunks fall into several waves and spans, so
    // states continue across launches (and across spans of one wave).
    for (tpp, group, kv_heads, head_dim) in [
        (64usize, 3usize, 2usize, 64usize),
        (64, 6, 2, 256),
        (128, 6, 4, 256),
    ] {
        for width in [1usize, 3, 4, 37] {
            let total = 2000 + rng.random_range(0..200);
            let g = PageGeometry::new(tpp, kv_heads, head_dim, KvType::Q8_0, KvType::Q4_0)
                .expect("geometry");
            let sh = q8q4_shape(group, kv_heads, head_dim, width, total);
            assert!(gpu.attention_uses_fast_path(&sh, &g));
            let img = image(&g, total, &mut rng);
            let q: Vec<f32> = (0..sh.query_len())
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let pages = g.pages_for(total);
            let resident = run(&gpu, sh, &g, &img, &q, &[vec![(0, pages)]]);
            assert!(resident.iter().all(|x| x.is_finite()));
            let waves = random_waves(pages, &mut rng);
            assert!(waves.len() > 1);
            let streamed = run(&gpu, sh, &g, &img, &q, &waves);
            assert_eq!(
                streamed.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                resident.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "tpp {tpp} d {head_dim} width {width}: streamed differs from resident"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_decode_verification_rows_equal_single_query_steps_bit_for_bit() {
    // MTP verification evaluates the width-4 row of query qi over the tokens a single-query
    // decode step at that position sees; greedy MTP equals greedy decoding only if the two are the
    // same bits. 27B geometry (6 query heads per KV head, 4 KV heads, head_dim 256, 256-token
    // pages), long enough that both shapes get the same splits.
    let gpu = gpu();
    let mut rng = StdRng::seed_from_u64(21);
    let (group, kv_heads, head_dim, width) = (6usize, 4usize, 256usize, 4usize);
    let total = 40_000 + rng.random_range(0..256);
    let g =
        PageGeometry::new(256, kv_heads, head_dim, KvType::Q8_0, KvType::Q4_0).expect("geometry");
    let sh = q8q4_shape(group, kv_heads, head_dim, width, total);
    assert!(gpu.attention_uses_fast_path(&sh, &g));
    let img = image(&g, total, &mut rng);
    let q: Vec<f32> = (0..sh.query_len())
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let pages = g.pages_for(total);
    let wide = run(&gpu, sh, &g, &img, &q, &[vec![(0, pages)]]);
    let row = sh.q_heads * head_dim;
    for qi in 0..width {
        let t1 = total - width + qi + 1;
        let s1 = q8q4_shape(group, kv_heads, head_dim, 1, t1);
        assert_eq!(gpu.attn_splits(&s1), gpu.attn_splits(&sh), "splits differ");
        let q1 = &q[qi * row..(qi + 1) * row];
        let one = run(&gpu, s1, &g, &img, q1, &[vec![(0, g.pages_for(t1))]]);
        assert!(one.iter().any(|x| *x != 0.0));
        assert_eq!(
            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            wide[qi * row..(qi + 1) * row]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            "query {qi}: verification row differs from the single-query step"
        );
    }
}
