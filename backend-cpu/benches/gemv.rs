//! Memory bandwidth vs bf16 GEMV throughput of the CPU backend.
//!
//! * `mem_read_1GiB`: a rayon sum over a 1 GiB buffer of u64: this machine's read bandwidth.
//! * `gemv_bf16_1GiB`: `matmul` of one row with a 131072 × 4096 bf16 matrix (1 GiB, about a
//!   0.5 B-parameter model's worth of weights).
//!
//! * `gemv_q8_0_131072x4096` / `gemv_q4_g128_131072x4096`: the same matrix shape stored as
//!   `q8_0` (544 MiB) and `q4_g128` (264 MiB); throughput counts the quantized bytes read.
//! * `gemm_{bf16,q8_0}_T128_4096x4096_flop`: the prefill-shaped GEMM path (flop/s).
//!
//! All report bytes/s; the GEMV should reach at least half the measured bandwidth.
//! Run: `cargo bench -p kvstream-backend-cpu --bench gemv -- --quick`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::{LinearOps, TensorOps, WeightData};
use kvstream_memory_contracts::weight_format::quant_layout;
use rayon::prelude::*;
use std::hint::black_box;

const GIB: usize = 1 << 30;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("cpu");
    g.sample_size(10);

    let buf: Vec<u64> = (0..GIB / 8).map(|i| i as u64).collect();
    g.throughput(Throughput::Bytes(GIB as u64));
    g.bench_function("mem_read_1GiB", |b| {
        b.iter(|| {
            // Wrapping integer adds vectorise freely: this is bound by memory, not arithmetic.
            let s: u64 = buf
                .par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, b| a.wrapping_add(*b)))
                .reduce(|| 0, u64::wrapping_add);
            black_box(s)
        })
    });
    drop(buf);

    let (n, k) = (131_072usize, 4096usize);
    let bytes: Vec<u8> = (0..n * k)
        .flat_map(|i| (0x3f80u16 + (i % 127) as u16).to_le_bytes())
        .collect();
    let be = CpuBackend::new();
    let w = be
        .load_weight("w", WeightDType::Bf16, &[n, k], WeightData::from_vec(bytes))
        .expect("weight");
    let xv: Vec<f32> = (0..k).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let x = be.tensor_from_f32(&xv, &[1, k]).expect("x");
    g.throughput(Throughput::Bytes((n * k * 2) as u64));
    g.bench_function("gemv_bf16_1GiB", |b| {
        b.iter(|| black_box(be.matmul(&x, &w).expect("matmul")))
    });
    drop(w);

    // The same shape quantized: a synthetic blob (varied codes, scales ≈ 0.01) in each layout.
    for dtype in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::Q4NlG128,
    ] {
        let l = quant_layout(dtype, &[n, k]).expect("layout");
        let mut bytes: Vec<u8> = (0..l.total).map(|i| (i % 251) as u8).collect();
        for s in bytes[l.scales_offset..].chunks_exact_mut(2) {
            s.copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
        }
        let w = be
            .load_weight("wq", dtype, &[n, k], WeightData::from_vec(bytes))
            .expect("weight");
        g.throughput(Throughput::Bytes(l.total as u64));
        g.bench_function(format!("gemv_{dtype}_131072x4096"), |b| {
            b.iter(|| black_box(be.matmul(&x, &w).expect("matmul")))
        });
    }

    // Prefill-shaped matmul (GEMM path): T = 128 rows through a 4096 × 4096 bf16 weight.
    let (t, n, k) = (128usize, 4096usize, 4096usize);
    let bytes: Vec<u8> = (0..n * k)
        .flat_map(|i| (0x3f80u16 + (i % 127) as u16).to_le_bytes())
        .collect();
    let w = be
        .load_weight(
            "w2",
            WeightDType::Bf16,
            &[n, k],
            WeightData::from_vec(bytes),
        )
        .expect("weight");
    let xv: Vec<f32> = (0..t * k).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let x = be.tensor_from_f32(&xv, &[t, k]).expect("x");
    g.throughput(Throughput::Elements((2 * t * n * k) as u64));
    g.bench_function("gemm_bf16_T128_4096x4096_flop", |b| {
        b.iter(|| black_box(be.matmul(&x, &w).expect("matmul")))
    });
    // The same GEMM with a q8_0 weight (row blocks dequantized into the f32 tile).
    let l = quant_layout(WeightDType::Q8_0, &[n, k]).expect("layout");
    let mut bytes: Vec<u8> = (0..l.total).map(|i| (i % 251) as u8).collect();
    for s in bytes[l.scales_offset..].chunks_exact_mut(2) {
        s.copy_from_slice(&half::f16::from_f32(0.01).to_le_bytes());
    }
    let wq = be
        .load_weight(
            "w3",
            WeightDType::Q8_0,
            &[n, k],
            WeightData::from_vec(bytes),
        )
        .expect("weight");
    g.bench_function("gemm_q8_0_T128_4096x4096_flop", |b| {
        b.iter(|| black_box(be.matmul(&x, &wq).expect("matmul")))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
