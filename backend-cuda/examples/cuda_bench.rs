//! Micro-benchmarks of the CUDA backend on the GPU machine:
//!
//! * HBM read roofline (vectorised read of 4 GiB) and GEMV GB/s on bf16 weights (T = 1 and 4);
//! * H2D copy-engine GB/s from registered (pinned) host memory at 256 KiB, 4 MiB and 16 MiB
//!   requests;
//! * streamed attention decode (widths 1 and 4) over 64 Ki tokens of Q8_0 K / Q4_0 V in the 27B
//!   geometry (4 KV heads × 256, 24 query heads, 256-token pages).
//!
//! Usage: `cuda_bench [OUT_DIR]` (default `$OUT` or `.`); writes `cuda_bench.txt` there.

use kvstream_backend_cuda::CudaBackend;
use kvstream_memory_contracts::attention::{
    attention_accumulate, attention_begin, attention_finish, AttentionShape,
};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::host::{HostBytes, HostRange, PinnedHost};
use kvstream_memory_contracts::kv::format::{encode, KvType};
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::kv::span::{Span, SpanPlan, SpanSource};
use kvstream_memory_contracts::ops::{LinearOps, TensorOps, WeightData};
use kvstream_memory_contracts::transfer::{CopyEngine, DeviceMemory};
use rand::{Rng, SeedableRng};
use std::error::Error;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

fn time<F: FnMut() -> Result<(), Box<dyn Error>>>(
    b: &CudaBackend,
    iters: usize,
    mut f: F,
) -> Result<f64, Box<dyn Error>> {
    f()?;
    b.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    b.synchronize()?;
    Ok(t0.elapsed().as_secs_f64() / iters as f64)
}

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("OUT").ok())
        .unwrap_or_else(|| ".".into());
    let b = CudaBackend::new(0)?;
    let mut report = String::new();
    writeln!(
        report,
        "device: {}",
        kvstream_memory_contracts::Backend::capabilities(&b).device
    )?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);

    // HBM read roofline.
    let hbm_bytes = 4usize << 30;
    let big = b.alloc_buffer(hbm_bytes)?;
    let secs = time(&b, 10, || Ok(b.bench_read(&big, hbm_bytes)?))?;
    let hbm = hbm_bytes as f64 / secs / 1e9;
    writeln!(report, "hbm_read 4GiB: {:.3} ms, {hbm:.0} GB/s", secs * 1e3)?;
    drop(big);

    // GEMV on bf16 weights: 27B MLP up/gate shape [17408, 5120] and down [5120, 17408].
    for &(n, k) in &[(17408usize, 5120usize), (5120, 17408), (12288, 5120)] {
        let w: Vec<u8> = (0..n * k)
            .flat_map(|_| half::bf16::from_f32(rng.random_range(-0.05f32..0.05)).to_le_bytes())
            .collect();
        let wt = b.load_weight("w", WeightDType::Bf16, &[n, k], WeightData::from_vec(w))?;
        for t in [1usize, 4] {
            let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            let xt = b.tensor_from_f32(&x, &[t, k])?;
            let secs = time(&b, 50, || {
                b.matmul(&xt, &wt)?;
                Ok(())
            })?;
            let gbs = (n * k * 2) as f64 / secs / 1e9;
            writeln!(
                report,
                "gemv bf16 [{n}x{k}] T={t}: {:.1} us, {gbs:.0} GB/s ({:.0}% of HBM read)",
                secs * 1e6,
                100.0 * gbs / hbm
            )?;
        }
        // One prefill GEMM for reference.
        let t = 512;
        let x: Vec<f32> = (0..t * k).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let xt = b.tensor_from_f32(&x, &[t, k])?;
        let secs = time(&b, 5, || {
            b.matmul(&xt, &wt)?;
            Ok(())
        })?;
        writeln!(
            report,
            "gemm bf16 [{n}x{k}] T={t}: {:.2} ms, {:.1} TFLOP/s",
            secs * 1e3,
            2.0 * (t * n * k) as f64 / secs / 1e12
        )?;
    }

    // H2D from registered host memory.
    let h2d_bytes = 256usize << 20;
    let host = Arc::new(HostBytes::new(h2d_bytes)?);
    let reg_t0 = Instant::now();
    let reg = b.register_host(&host)?;
    writeln!(
        report,
        "host register 256MiB: {:.1} ms",
        reg_t0.elapsed().as_secs_f64() * 1e3
    )?;
    let dst = b.alloc_buffer(h2d_bytes)?;
    for req in [256usize << 10, 4 << 20, 16 << 20] {
        let secs = time(&b, 5, || {
            let mut last = None;
            for off in (0..h2d_bytes).step_by(req) {
                let src = HostRange {
                    bytes: Arc::clone(&host),
                    offset: off,
                    len: req,
                };
                last = Some(b.copy_h2d(&src, &dst, off, &[])?);
            }
            if let Some(f) = last {
                b.host_wait(&f)?;
            }
            Ok(())
        })?;
        writeln!(
            report,
            "h2d {} KiB requests: {:.1} GB/s",
            req >> 10,
            h2d_bytes as f64 / secs / 1e9
        )?;
    }
    drop(reg);

    // Streamed attention decode over 64 Ki tokens, Q8_0 K / Q4_0 V, 27B geometry.
    let g = PageGeometry::new(256, 4, 256, KvType::Q8_0, KvType::Q4_0)?;
    let total = 65_536usize;
    let pages = g.pages_for(total);
    let mut page = vec![0u8; g.page_bytes()];
    for t in 0..256 {
        let k: Vec<f32> = (0..g.row_values())
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let v: Vec<f32> = (0..g.row_values())
            .map(|_| rng.random_range(-2.0f32..2.0))
            .collect();
        let ko = g.k_row_offset(0, 0, t);
        let vo = g.v_row_offset(0, 0, t);
        encode(g.k_type(), &k, &mut page[ko..ko + g.k_row_bytes()])?;
        encode(g.v_type(), &v, &mut page[vo..vo + g.v_row_bytes()])?;
    }
    let pool_bytes = pages * g.page_bytes();
    let pool = b.alloc_buffer(pool_bytes)?;
    let image: Vec<u8> = page.iter().copied().cycle().take(pool_bytes).collect();
    b.write_buffer(&pool, 0, &image)?;
    let plan = SpanPlan::new(
        g,
        pool_bytes,
        0,
        total,
        vec![Span {
            source: SpanSource::Resident {
                layer: 0,
                first_page: 0,
            },
            first_token: 0,
            count: total,
            offset: 0,
        }],
    )?;
    for width in [1usize, 4] {
        let shape = AttentionShape {
            q_heads: 24,
            kv_heads: 4,
            head_dim: 256,
            width,
            total,
            scale: 1.0 / 16.0,
            k_type: KvType::Q8_0,
            v_type: KvType::Q4_0,
        };
        let q: Vec<f32> = (0..shape.query_len())
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let qt = b.tensor_from_f32(&q, &[width, 24, 256])?;
        let secs = time(&b, 10, || {
            let mut acc = attention_begin(&b, shape)?;
            attention_accumulate(&b, &mut acc, &qt, &pool, &plan)?;
            attention_finish(&b, acc)?;
            Ok(())
        })?;
        writeln!(
            report,
            "attention q8_0/q4_0 64Ki tokens width {width}: {:.3} ms, {:.0} GB/s of KV",
            secs * 1e3,
            pool_bytes as f64 / secs / 1e9
        )?;
    }

    print!("{report}");
    let path = std::path::Path::new(&out_dir).join("cuda_bench.txt");
    std::fs::write(&path, &report)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
