//! Streamed attention on the GPU against the CPU backend for decode widths 1..=4 and a prefill
//! width, over every K/V format pair, plus resident == streamed bit for bit with several waves.
//! Run on a GPU machine with `--ignored`.

use kvstream_backend_cpu::CpuBackend;
use kvstream_backend_cuda::CudaBackend;
use kvstream_memory_contracts::attention::*;
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::TensorOps;
use kvstream_memory_contracts::transfer::DeviceMemory;
use kvstream_memory_contracts::Backend;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("this test needs a CUDA GPU: {e}"),
    }
}

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
            let mut waves: Vec<Vec<(usize, usize)>> = Vec::new();
            let mut p = 0;
            while p < pages {
                let mut wave = Vec::new();
                for _ in 0..rng.random_range(1..=3) {
                    if p >= pages {
                        break;
                    }
                    let n = rng.random_range(1..=9usize).min(pages - p);
                    wave.push((p, n));
                    p += n;
                }
                waves.push(wave);
            }
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
