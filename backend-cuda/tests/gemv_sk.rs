//! The stream-K decode GEMV (`gemv_sk_*`, `KVSTREAM_GEMV_SK`) against the CPU backend for every
//! dtype it serves, on shapes whose 8-row units are shared by several warps (odd N, N not a
//! multiple of 8, ragged last trips), plus T-independence (row t of a T-row call bit-identical to
//! a 1-row call), run-to-run determinism, and the fix-up counters left zero between launches (also
//! across the q4 tensor-core GEMV that shares them). Fresh random inputs, never zeros. Run on a
//! GPU machine with `--ignored`.

use kvstream_backend_cpu::CpuBackend;
use kvstream_backend_cuda::{CudaBackend, CudaWeight, GemvSk, Q4Gemv, STREAM_K_DTYPES};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::{dequantize, quantize};
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;
use common::{assert_rows_independent_of_width, gpu, rnd};

/// The dtypes with stream-K instances.
const SK_DTYPES: [WeightDType; 5] = STREAM_K_DTYPES;

/// Shapes `(n, k)` that run stream-K with shared units on a 132-SM H200 (at least one item per
/// warp of the 2,112, ≥ 3,150 items for every dtype): N even but not a multiple of 8, odd N, K
/// with a ragged last trip (12352 = 12288 + 64), few long rows, and the 27B MLP gate/up shape for
/// bf16 and q8_0.
///
/// `KVSTREAM_TEST_QUICK=1` (for compute-sanitizer, which runs ~100x slower) keeps only the odd-N,
/// ragged-K shape: it still shares units between warps and still runs a fix-up per unit.
fn shapes_for(dt: WeightDType) -> Vec<(usize, usize)> {
    if quick() {
        return vec![(1001, 12352)];
    }
    let mut s = vec![(1000, 16384), (1001, 12352), (203, 65536)];
    if matches!(dt, WeightDType::Bf16 | WeightDType::Q8_0) {
        s.push((17408, 5120));
    }
    s
}

/// Whether `KVSTREAM_TEST_QUICK=1` asks for the sanitizer-sized subset.
fn quick() -> bool {
    std::env::var("KVSTREAM_TEST_QUICK").is_ok_and(|v| v.trim() == "1")
}

struct Case {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

/// A weight on both backends and its dequantised values.
struct W {
    cpu: <CpuBackend as kvstream_memory_contracts::Backend>::Weight,
    gpu: CudaWeight,
    deq: Vec<f32>,
}

impl Case {
    fn new() -> Self {
        let gpu = gpu();
        gpu.set_gemv_sk(GemvSk::On);
        Self {
            cpu: CpuBackend::new(),
            gpu,
        }
    }

    fn weight(&self, rng: &mut StdRng, dt: WeightDType, n: usize, k: usize) -> W {
        let vals = rnd(rng, n * k, 0.5);
        let bytes = quantize(dt, &vals, &[n, k]).expect("quantize");
        let deq = dequantize(dt, &bytes, &[n, k]).expect("dequantize");
        let cpu = self
            .cpu
            .load_weight("w", dt, &[n, k], WeightData::from_vec(bytes.clone()))
            .expect("cpu weight");
        let gpu = self
            .gpu
            .load_weight("w", dt, &[n, k], WeightData::from_vec(bytes))
            .expect("gpu weight");
        W { cpu, gpu, deq }
    }

    /// The GPU matmul of `t` rows, after checking it runs the stream-K kernel.
    fn run(&self, w: &CudaWeight, x: &[f32], t: usize, k: usize) -> Vec<f32> {
        let kernel = self.gpu.matmul_kernel(w, t);
        assert!(
            kernel.starts_with("gemv_sk_"),
            "k={k} t={t}: runs {kernel}, not stream-K (too few SMs for this shape?)"
        );
        let xg = self.gpu.tensor_from_f32(x, &[t, k]).expect("x");
        let y = self.gpu.matmul(&xg, w).expect("gemv");
        self.gpu.tensor_to_f32(&y).expect("y")
    }

    fn cpu_matmul(&self, w: &W, x: &[f32], t: usize, k: usize) -> Vec<f32> {
        let xc = self.cpu.tensor_from_f32(x, &[t, k]).expect("x cpu");
        let y = self.cpu.matmul(&xc, &w.cpu).expect("cpu matmul");
        self.cpu.tensor_to_f32(&y).expect("y cpu")
    }
}

/// Every output within 1e-4 · Σ_k |x·w| of the CPU's (the f32 rounding of any summation order),
/// finite, and the reference not all zero.
#[allow(clippy::too_many_arguments)]
fn check(what: &str, g: &[f32], c: &[f32], x: &[f32], wd: &[f32], t: usize, n: usize, k: usize) {
    assert_eq!(g.len(), t * n, "{what}: length");
    let mut worst = 0f32;
    for ti in 0..t {
        let xr = &x[ti * k..(ti + 1) * k];
        for ni in 0..n {
            let wr = &wd[ni * k..(ni + 1) * k];
            let scale: f32 = xr.iter().zip(wr).map(|(a, b)| (a * b).abs()).sum();
            let (gv, cv) = (g[ti * n + ni], c[ti * n + ni]);
            let err = (gv - cv).abs();
            assert!(
                gv.is_finite() && err <= 1e-4 * scale + 1e-30,
                "{what}: ({ti}, {ni}): gpu {gv} cpu {cv} (err {err}, scale {scale})"
            );
            if scale > 0.0 {
                worst = worst.max(err / scale);
            }
        }
    }
    assert!(c.iter().any(|v| *v != 0.0), "{what}: all-zero reference");
    eprintln!("{what}: max err / sum|wx| {worst:.2e}");
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// Stream-K (forced on) against the CPU backend, T = 1, 3 and 8, every dtype it serves.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_k_gemv_matches_cpu_for_every_dtype() {
    let c = Case::new();
    let mut rng = StdRng::seed_from_u64(61);
    for dt in SK_DTYPES {
        for (n, k) in shapes_for(dt) {
            let w = c.weight(&mut rng, dt, n, k);
            for t in [1usize, 3, 8] {
                let x = rnd(&mut rng, t * k, 1.0);
                let g = c.run(&w.gpu, &x, t, k);
                let want = c.cpu_matmul(&w, &x, t, k);
                let what = format!("gemv_sk {dt} t={t} [{n}x{k}]");
                check(&what, &g, &want, &x, &w.deq, t, n, k);
            }
        }
    }
}

/// Row t of a T-row stream-K GEMV is bit-identical to the same row alone and to the same row of
/// an 8-row call, for every T in 1..=8 (MTP verification), and a repeated call gives the same bits
/// (the finishing warp varies with arrival order, the sum order does not).
#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_k_rows_are_bit_identical_for_every_width() {
    let c = Case::new();
    let mut rng = StdRng::seed_from_u64(62);
    for dt in SK_DTYPES {
        for (n, k) in shapes_for(dt) {
            let w = c.weight(&mut rng, dt, n, k);
            let x = rnd(&mut rng, 8 * k, 1.0);
            let full = c.run(&w.gpu, &x, 8, k);
            assert_eq!(
                bits(&c.run(&w.gpu, &x, 8, k)),
                bits(&full),
                "{dt} [{n}x{k}]: a repeated T=8 call differs"
            );
            let what = format!("{dt} [{n}x{k}]");
            assert_rows_independent_of_width(&what, n, k, &x, &full, |rows, t| {
                c.run(&w.gpu, rows, t, k)
            });
        }
    }
}

/// The fix-up counters are left zero by every launch: stream-K calls of different shapes
/// interleaved with the q4 tensor-core GEMV (which shares the buffers) repeat their first results
/// bit for bit, and the first results match the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_k_buffers_are_reusable_across_shapes_and_kernels() {
    let c = Case::new();
    c.gpu.set_q4_gemv(Q4Gemv::MmaPersistent);
    let mut rng = StdRng::seed_from_u64(63);
    let a = c.weight(&mut rng, WeightDType::Bf16, 1001, 12352);
    let b = c.weight(&mut rng, WeightDType::Q8_0, 17408, 5120);
    let q = c.weight(&mut rng, WeightDType::Q4G128, 17408, 5120);
    // (2048 rows: the q4_nl quantizer's 66-scale search is slow on one core.)
    let qn = c.weight(&mut rng, WeightDType::Q4NlG128, 2048, 5120);
    let (xa, xb) = (rnd(&mut rng, 3 * 12352, 1.0), rnd(&mut rng, 5120, 1.0));
    let ya = c.run(&a.gpu, &xa, 3, 12352);
    check(
        "bf16 [1001x12352] t=3",
        &ya,
        &c.cpu_matmul(&a, &xa, 3, 12352),
        &xa,
        &a.deq,
        3,
        1001,
        12352,
    );
    let yb = c.run(&b.gpu, &xb, 1, 5120);
    let q4 = |x: &[f32]| -> Vec<u32> {
        let xg = c.gpu.tensor_from_f32(x, &[1, 5120]).expect("x");
        let y = c.gpu.matmul(&xg, &q.gpu).expect("q4 gemv");
        bits(&c.gpu.tensor_to_f32(&y).expect("y"))
    };
    let yq = q4(&xb);
    // q4_nl_g128 on its split-bf16 and integer builds, which share the buffers too.
    let nl = |x: &[f32], path: Q4Gemv| -> Vec<u32> {
        c.gpu.set_q4_gemv(path);
        let xg = c.gpu.tensor_from_f32(x, &[1, 5120]).expect("x");
        let y = c.gpu.matmul(&xg, &qn.gpu).expect("q4_nl gemv");
        c.gpu.set_q4_gemv(Q4Gemv::MmaPersistent);
        bits(&c.gpu.tensor_to_f32(&y).expect("y"))
    };
    let (ynm, yni) = (nl(&xb, Q4Gemv::MmaPersistent), nl(&xb, Q4Gemv::Int8));
    let ync = nl(&xb, Q4Gemv::Int8Cols);
    for (y, path) in [(&ynm, "mmap"), (&yni, "i8"), (&ync, "i8c")] {
        let yf: Vec<f32> = y.iter().map(|b| f32::from_bits(*b)).collect();
        check(
            &format!("q4_nl {path} [2048x5120] t=1"),
            &yf,
            &c.cpu_matmul(&qn, &xb, 1, 5120),
            &xb,
            &qn.deq,
            1,
            2048,
            5120,
        );
    }
    for round in 0..3 {
        assert_eq!(
            nl(&xb, Q4Gemv::MmaPersistent),
            ynm,
            "round {round}: q4_nl mmap"
        );
        assert_eq!(nl(&xb, Q4Gemv::Int8), yni, "round {round}: q4_nl i8");
        assert_eq!(nl(&xb, Q4Gemv::Int8Cols), ync, "round {round}: q4_nl i8c");
        assert_eq!(
            bits(&c.run(&a.gpu, &xa, 3, 12352)),
            bits(&ya),
            "round {round}: a"
        );
        assert_eq!(q4(&xb), yq, "round {round}: q4");
        assert_eq!(
            bits(&c.run(&b.gpu, &xb, 1, 5120)),
            bits(&yb),
            "round {round}: b"
        );
    }
    c.gpu.set_q4_gemv(Q4Gemv::Auto);
}

/// The switch: `off` runs gemv_pipe, `on` stream-K, and the two agree within the f32 bound.
#[test]
#[ignore = "needs a CUDA GPU"]
fn stream_k_switch_selects_the_kernel() {
    let c = Case::new();
    let mut rng = StdRng::seed_from_u64(64);
    let (n, k) = (17408, 5120);
    let w = c.weight(&mut rng, WeightDType::Bf16, n, k);
    let x = rnd(&mut rng, 4 * k, 1.0);
    let on = c.run(&w.gpu, &x, 4, k);
    c.gpu.set_gemv_sk(GemvSk::Off);
    let kernel = c.gpu.matmul_kernel(&w.gpu, 4);
    assert_eq!(kernel, "gemv_bf16_t4");
    let xg = c.gpu.tensor_from_f32(&x, &[4, k]).expect("x");
    let off = c
        .gpu
        .tensor_to_f32(&c.gpu.matmul(&xg, &w.gpu).expect("gemv"))
        .expect("y");
    check("bf16 on vs off", &on, &off, &x, &w.deq, 4, n, k);
    c.gpu.set_gemv_sk(GemvSk::Auto);
    eprintln!("auto: {}", c.gpu.matmul_kernel(&w.gpu, 1));
    c.gpu.set_gemv_sk(GemvSk::Off);
}
