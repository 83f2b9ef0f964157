//! Every compute op on the GPU against the CPU reference backend, on fresh random inputs (never
//! all zeros), within dtype tolerances. Run on a GPU machine with `--ignored`.

use half::f16;
use kvstream_backend_cpu::CpuBackend;
use kvstream_backend_cuda::{CudaBackend, CudaWeight, PrefillGemm, Q4Gemv, Q4Tiles, GEMM_ENV};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::transfer::DeviceMemory;
use kvstream_memory_contracts::{dequantize, quantize, DeviceTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{assert_rows_independent_of_width, gpu, rnd};

fn weight_bytes(vals: &[f32], dims: &[usize], dt: WeightDType) -> Vec<u8> {
    match quantize(dt, vals, dims) {
        Ok(b) => b,
        Err(e) => panic!("quantize {dt} {dims:?}: {e}"),
    }
}

/// |a - b| <= atol + rtol * |b| element-wise, with a helpful message.
fn close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let mut worst = (0usize, 0f32);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            err <= atol + rtol * w.abs() && g.is_finite(),
            "{what}: element {i}: gpu {g} cpu {w} (err {err})"
        );
        if err > worst.1 {
            worst = (i, err);
        }
    }
    assert!(
        want.iter().any(|v| *v != 0.0),
        "{what}: reference is all zeros, the test cannot fail"
    );
    eprintln!("{what}: max abs err {:.3e} at {}", worst.1, worst.0);
}

struct Pair {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

impl Pair {
    fn new() -> Self {
        Self {
            cpu: CpuBackend::new(),
            gpu: gpu(),
        }
    }
    fn t(
        &self,
        data: &[f32],
        dims: &[usize],
    ) -> (
        <CpuBackend as kvstream_memory_contracts::Backend>::Tensor,
        <CudaBackend as kvstream_memory_contracts::Backend>::Tensor,
    ) {
        (
            self.cpu.tensor_from_f32(data, dims).expect("cpu tensor"),
            self.gpu.tensor_from_f32(data, dims).expect("gpu tensor"),
        )
    }
    fn w(
        &self,
        vals: &[f32],
        dims: &[usize],
        dt: WeightDType,
    ) -> (
        <CpuBackend as kvstream_memory_contracts::Backend>::Weight,
        <CudaBackend as kvstream_memory_contracts::Backend>::Weight,
    ) {
        let bytes = weight_bytes(vals, dims, dt);
        (
            self.cpu
                .load_weight("w", dt, dims, WeightData::from_vec(bytes.clone()))
                .expect("cpu weight"),
            self.gpu
                .load_weight("w", dt, dims, WeightData::from_vec(bytes))
                .expect("gpu weight"),
        )
    }
    fn get(
        &self,
        c: &<CpuBackend as kvstream_memory_contracts::Backend>::Tensor,
        g: &<CudaBackend as kvstream_memory_contracts::Backend>::Tensor,
    ) -> (Vec<f32>, Vec<f32>) {
        (
            self.gpu.tensor_to_f32(g).expect("gpu download"),
            self.cpu.tensor_to_f32(c).expect("cpu download"),
        )
    }
}

/// Random values with a heavy spike near zero (r^4 for a third of them), so quantized formats see
/// tiny codes and fp8 sees subnormals; never exactly zero.
fn heavy(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let r: f32 = rng.random_range(0.01f32..1.0);
            let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
            let m = if i % 3 == 0 { r * r * r * r } else { r };
            s * amp * m
        })
        .collect()
}

fn deq(dt: WeightDType, bytes: &[u8], dims: &[usize]) -> Vec<f32> {
    match dequantize(dt, bytes, dims) {
        Ok(v) => v,
        Err(e) => panic!("dequantize {dt} {dims:?}: {e}"),
    }
}

/// Shapes `(n, k)` valid for `dt`: K not a multiple of 256, a split-K GEMV shape (few long rows),
/// and for the element types / fp8 ragged K that takes the scalar GEMV path.
fn shapes_for(dt: WeightDType) -> Vec<(usize, usize)> {
    let mut s = vec![(70, 384), (33, 1152), (7, 4096), (130, 640)];
    match dt {
        // K % 1024 == 0 with one warp per row: the coalesced-x q4 instances ((7, 4096) splits).
        WeightDType::Q4G128 | WeightDType::Q4NlG128 => s.push((70, 2048)),
        WeightDType::Q8_0 => s.push((70, 96)),
        _ => {
            s.push((70, 200));
            s.push((37, 203));
        }
    }
    s
}

/// Every dtype, GEMV widths 1..=8 and GEMM widths 9 and 33, against the CPU backend, within 1e-4
/// of Σ|w·x| per output (the scale of the f32 rounding of any summation order).
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_gemv_and_gemm_match_cpu_for_every_dtype() {
    let p = Pair::new();
    // The 1e-4 bound is the SIMT GEMM's (f32 x); the cuBLAS path has its own test below.
    p.gpu.set_prefill_gemm(PrefillGemm::Simt).expect("simt");
    let mut rng = StdRng::seed_from_u64(1);
    for dt in WeightDType::ALL {
        for (n, k) in shapes_for(dt) {
            let mut w = heavy(&mut rng, n * k, 0.5);
            // One all-zero row (zero scales in the quantized formats).
            w[k..2 * k].iter_mut().for_each(|v| *v = 0.0);
            let bytes = weight_bytes(&w, &[n, k], dt);
            let wd = deq(dt, &bytes, &[n, k]);
            let (wc, wg) = p.w(&w, &[n, k], dt);
            for t in [1usize, 2, 3, 4, 5, 8, 9, 33] {
                let x = rnd(&mut rng, t * k, 1.0);
                let (xc, xg) = p.t(&x, &[t, k]);
                let yc = p.cpu.matmul(&xc, &wc).expect("cpu matmul");
                let yg = p.gpu.matmul(&xg, &wg).expect("gpu matmul");
                let (g, c) = p.get(&yc, &yg);
                let what = format!("matmul {dt} t={t} n={n} k={k}");
                check_gemm(&what, &g, &c, &x, &wd, t, n, k, f32_bound);
            }
        }
    }
}

/// Per-output bound of the cuBLAS prefill GEMM (split bf16 operands, f32 accumulation): x and the
/// dequantised w each carry 16 significant bits as hi + lo (relative error ≤ 2^-16 each; the
/// dropped wl·xl term ≤ 2^-18), so each product is within ~2^-15; the two f32 summations (cuBLAS
/// and the CPU's, in different orders) add ≤ K·2^-24 each (K ≤ 640 here: ≤ 2^-14.6).
/// 2^-12 · Σ|x·w| covers both with a factor ~2 to spare, + 1e-6 for all-tiny rows.
fn bf16_gemm_bound(scale: f32) -> f32 {
    scale / 4096.0 + 1e-6
}

/// Per-output bound of the f32-x paths (SIMT GEMV/GEMM, tensor-core q4 GEMV): 1e-4 · Σ|x·w|.
fn f32_bound(scale: f32) -> f32 {
    1e-4 * scale + 1e-30
}

/// Every output `g[t][n]` within `bound(Σ_k |x[t][k] · w[n][k]|)` of the CPU's `c[t][n]` (w
/// dequantised), finite, and the reference not all zero.
#[allow(clippy::too_many_arguments)]
fn check_gemm(
    what: &str,
    g: &[f32],
    c: &[f32],
    x: &[f32],
    wd: &[f32],
    t: usize,
    n: usize,
    k: usize,
    bound: fn(f32) -> f32,
) {
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
                gv.is_finite() && err <= bound(scale),
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

/// The cuBLAS prefill GEMM (T > 8) against the CPU backend for every weight dtype, within the bf16
/// bound above; N = 4100 spans two dequantised tiles (4096 rows each) for f16 and the quantized
/// formats. Requires libcublas on the loader path (scripts/gpu-test.sh sets LD_LIBRARY_PATH).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cublas_prefill_gemm_matches_cpu_for_every_dtype() {
    let p = Pair::new();
    p.gpu
        .set_prefill_gemm(PrefillGemm::Cublas)
        .expect("cuBLAS must load on the GPU machine (LD_LIBRARY_PATH, see scripts/gpu-test.sh)");
    let mut rng = StdRng::seed_from_u64(21);
    for dt in WeightDType::ALL {
        for k in [128usize, 640] {
            for n in [96usize, 4100] {
                let w = heavy(&mut rng, n * k, 0.5);
                let bytes = weight_bytes(&w, &[n, k], dt);
                let wd = deq(dt, &bytes, &[n, k]);
                let (wc, wg) = p.w(&w, &[n, k], dt);
                for t in [9usize, 33, 200] {
                    let x = rnd(&mut rng, t * k, 1.0);
                    let (xc, xg) = p.t(&x, &[t, k]);
                    let yc = p.cpu.matmul(&xc, &wc).expect("cpu matmul");
                    let yg = p.gpu.matmul(&xg, &wg).expect("gpu matmul");
                    let (g, c) = p.get(&yc, &yg);
                    let what = format!("cublas gemm {dt} t={t} n={n} k={k}");
                    check_gemm(&what, &g, &c, &x, &wd, t, n, k, bf16_gemm_bound);
                }
            }
        }
    }
}

/// `set_prefill_gemm` really switches kernels: SIMT (what `KVSTREAM_GEMM=simt` selects) meets the
/// f32 bound 1e-4 · Σ|x·w| on bf16 weights, cuBLAS differs from it in some bits yet meets the bf16
/// bound, and SIMT again repeats its first result bit for bit. A backend created with
/// `KVSTREAM_GEMM=simt` starts on SIMT.
#[test]
#[ignore = "needs a CUDA GPU"]
fn prefill_gemm_switch_selects_the_kernel() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(22);
    let (t, n, k) = (33usize, 96usize, 640usize);
    let dt = WeightDType::Bf16;
    let w = heavy(&mut rng, n * k, 0.5);
    let wd = deq(dt, &weight_bytes(&w, &[n, k], dt), &[n, k]);
    let (wc, wg) = p.w(&w, &[n, k], dt);
    let x = rnd(&mut rng, t * k, 1.0);
    let (xc, xg) = p.t(&x, &[t, k]);
    let yc = p.cpu.matmul(&xc, &wc).expect("cpu matmul");
    let run = |path: PrefillGemm| {
        p.gpu.set_prefill_gemm(path).expect("path");
        assert_eq!(p.gpu.prefill_gemm(), path);
        let yg = p.gpu.matmul(&xg, &wg).expect("gpu matmul");
        p.get(&yc, &yg)
    };
    let (simt, c) = run(PrefillGemm::Simt);
    for (i, (g, r)) in simt.iter().zip(&c).enumerate() {
        let (ti, ni) = (i / n, i % n);
        let scale: f32 = (0..k)
            .map(|kk| (x[ti * k + kk] * wd[ni * k + kk]).abs())
            .sum();
        assert!(
            (g - r).abs() <= 1e-4 * scale,
            "simt ({ti}, {ni}): {g} vs {r}"
        );
    }
    let (cublas, _) = run(PrefillGemm::Cublas);
    check_gemm(
        "switch cublas",
        &cublas,
        &c,
        &x,
        &wd,
        t,
        n,
        k,
        bf16_gemm_bound,
    );
    assert!(
        simt.iter()
            .zip(&cublas)
            .any(|(a, b)| a.to_bits() != b.to_bits()),
        "cuBLAS and SIMT gave identical bits: the switch did not change the kernel"
    );
    let (again, _) = run(PrefillGemm::Simt);
    assert!(
        simt.iter()
            .zip(&again)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "SIMT is not repeatable"
    );
    std::env::set_var(GEMM_ENV, "simt");
    let forced = gpu();
    std::env::remove_var(GEMM_ENV);
    assert_eq!(forced.prefill_gemm(), PrefillGemm::Simt);
}

/// Raw blobs covering every code of each quantized format (fp8: every non-NaN byte, incl.
/// subnormals; q8: every int8; q4: every nibble) with f16 scales incl. subnormal and negative ones.
fn all_codes_blob(dt: WeightDType, n: usize, k: usize, rng: &mut StdRng) -> Vec<u8> {
    let l = kvstream_memory_contracts::quant_layout(dt, &[n, k]).expect("layout");
    let mut b = vec![0u8; l.total];
    let code_bytes = if dt.is_q4() { n * k / 2 } else { n * k };
    let fp8_codes: Vec<u8> = (0u8..=255).filter(|c| *c & 0x7f != 0x7f).collect();
    for (i, v) in b[..code_bytes].iter_mut().enumerate() {
        *v = match dt {
            WeightDType::F8E4M3 => fp8_codes[(i * 7 + i / 251) % fp8_codes.len()],
            _ => (i * 13 + i / 256) as u8,
        };
    }
    let groups = n * l.groups_per_row();
    for g in 0..groups {
        let at = l.scales_offset;
        match dt {
            WeightDType::F8E4M3 => {
                let s: f32 = match g % 5 {
                    0 => 1e-3,
                    1 => 3.7e-7,
                    _ => rng.random_range(0.01f32..4.0),
                };
                b[at + 4 * g..at + 4 * g + 4].copy_from_slice(&s.to_le_bytes());
            }
            _ => {
                let s = match g % 5 {
                    0 => f16::from_bits(0x0003), // subnormal
                    1 => f16::from_f32(-0.0123),
                    _ => f16::from_f32(rng.random_range(0.001f32..0.5)),
                };
                b[at + 2 * g..at + 2 * g + 2].copy_from_slice(&s.to_le_bytes());
            }
        }
    }
    b
}

/// The dequantised weight values the kernels use are exactly the contract's: one-hot activations
/// make each output a single product (w · 1 plus exact zeros), through the GEMV (8 rows at a time)
/// and the GEMM (the identity as x, T = K).
#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_decodes_every_code_exactly() {
    let p = Pair::new();
    // Exactness is the SIMT GEMM's (the cuBLAS path rounds weights to bf16).
    p.gpu.set_prefill_gemm(PrefillGemm::Simt).expect("simt");
    let mut rng = StdRng::seed_from_u64(11);
    let n = 24usize;
    // K = 1024 also covers the coalesced-x q4 instances (K % 1024 == 0).
    for (dt, k) in [
        (WeightDType::Q8_0, 256usize),
        (WeightDType::Q4G128, 256),
        (WeightDType::Q4G128, 1024),
        (WeightDType::F8E4M3, 256),
        (WeightDType::Q4NlG128, 256),
        (WeightDType::Q4NlG128, 1024),
    ] {
        let blob = all_codes_blob(dt, n, k, &mut rng);
        let want = deq(dt, &blob, &[n, k]);
        assert!(want.iter().all(|v| v.is_finite()));
        let wg = p
            .gpu
            .load_weight("w", dt, &[n, k], WeightData::from_vec(blob))
            .expect("gpu weight");
        let check = |y: &[f32], rows: &[usize], path: &str| {
            for (ti, &kk) in rows.iter().enumerate() {
                for ni in 0..n {
                    let (g, w) = (y[ti * n + ni], want[ni * k + kk]);
                    assert!(g == w, "{dt} {path}: w[{ni}][{kk}]: gpu {g:e} want {w:e}");
                }
            }
        };
        for k0 in (0..k).step_by(8) {
            let rows: Vec<usize> = (k0..k0 + 8).collect();
            let mut x = vec![0f32; 8 * k];
            for (ti, &kk) in rows.iter().enumerate() {
                x[ti * k + kk] = 1.0;
            }
            let xg = p.gpu.tensor_from_f32(&x, &[8, k]).expect("x");
            let y = p
                .gpu
                .tensor_to_f32(&p.gpu.matmul(&xg, &wg).expect("gemv"))
                .expect("y");
            check(&y, &rows, "gemv");
        }
        let mut eye = vec![0f32; k * k];
        for i in 0..k {
            eye[i * k + i] = 1.0;
        }
        let xg = p.gpu.tensor_from_f32(&eye, &[k, k]).expect("x");
        let y = p
            .gpu
            .tensor_to_f32(&p.gpu.matmul(&xg, &wg).expect("gemm"))
            .expect("y");
        let rows: Vec<usize> = (0..k).collect();
        check(&y, &rows, "gemm");
    }
}

/// The cuBLAS path's dequantised tile holds exactly the contract's value split into hi + lo bf16
/// (nearest even each): with the identity as x (exact in bf16, lo = 0, T = K) each output is
/// wh + wl, computed exactly in f32.
#[test]
#[ignore = "needs a CUDA GPU"]
fn cublas_gemm_decodes_every_code_to_its_split_bf16_value() {
    let p = Pair::new();
    p.gpu
        .set_prefill_gemm(PrefillGemm::Cublas)
        .expect("cuBLAS must load on the GPU machine (LD_LIBRARY_PATH, see scripts/gpu-test.sh)");
    let mut rng = StdRng::seed_from_u64(12);
    let (n, k) = (24usize, 256usize);
    let mut eye = vec![0f32; k * k];
    for i in 0..k {
        eye[i * k + i] = 1.0;
    }
    let xg = p.gpu.tensor_from_f32(&eye, &[k, k]).expect("x");
    for dt in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ] {
        let blob = all_codes_blob(dt, n, k, &mut rng);
        let want = deq(dt, &blob, &[n, k]);
        let wg = p
            .gpu
            .load_weight("w", dt, &[n, k], WeightData::from_vec(blob))
            .expect("gpu weight");
        let y = p
            .gpu
            .tensor_to_f32(&p.gpu.matmul(&xg, &wg).expect("gemm"))
            .expect("y");
        for kk in 0..k {
            for ni in 0..n {
                let g = y[kk * n + ni];
                let v = want[ni * k + kk];
                let hi = half::bf16::from_f32(v).to_f32();
                let w = hi + half::bf16::from_f32(v - hi).to_f32();
                assert!(g == w, "{dt} cublas: w[{ni}][{kk}]: gpu {g:e} want {w:e}");
                assert!(
                    (g - v).abs() <= v.abs() * 2f32.powi(-16),
                    "{dt}: {g:e} vs {v:e}"
                );
            }
        }
    }
}

/// Row t of a T-row GEMV is bit-identical for every T in 1..=8 (MTP verification relies on it),
/// for every dtype, on the split-K, plain and scalar paths.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gemv_rows_are_bit_identical_for_every_width() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(12);
    for dt in WeightDType::ALL {
        for (n, k) in shapes_for(dt) {
            let w = heavy(&mut rng, n * k, 0.5);
            let (_, wg) = p.w(&w, &[n, k], dt);
            let x = rnd(&mut rng, 8 * k, 1.0);
            let run = |rows: &[f32], t: usize| -> Vec<f32> {
                let xg = p.gpu.tensor_from_f32(rows, &[t, k]).expect("x");
                let y = p.gpu.matmul(&xg, &wg).expect("gemv");
                p.gpu.tensor_to_f32(&y).expect("y")
            };
            let full = run(&x, 8);
            assert_rows_independent_of_width(&format!("{dt} [{n}x{k}]"), n, k, &x, &full, run);
        }
    }
}

/// `n` activations spanning 1e-6 .. 1e5 in magnitude, random signs.
fn wide_range_x(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mag = 10f32.powi((i % 12) as i32 - 6);
            let s = if rng.random_bool(0.5) { -1.0 } else { 1.0 };
            s * mag * rng.random_range(0.5f32..1.0)
        })
        .collect()
}

/// One q4 GEMV case of `[n, k]`: heavy-tailed weights on the GPU, their dequantised values, a
/// wide-range x of 8 rows and the CPU product `x · wᵀ` (computed once, for every path checked).
fn q4_case(
    p: &Pair,
    rng: &mut StdRng,
    dt: WeightDType,
    n: usize,
    k: usize,
) -> (CudaWeight, Vec<f32>, Vec<f32>, Vec<f32>) {
    let w = heavy(rng, n * k, 0.5);
    let wd = deq(dt, &weight_bytes(&w, &[n, k], dt), &[n, k]);
    let (wc, wg) = p.w(&w, &[n, k], dt);
    let x = wide_range_x(rng, 8 * k);
    let xc = p.cpu.tensor_from_f32(&x, &[8, k]).expect("x cpu");
    let c = p
        .cpu
        .tensor_to_f32(&p.cpu.matmul(&xc, &wc).expect("cpu"))
        .expect("y cpu");
    (wg, wd, x, c)
}

/// The GPU GEMV of 8 rows `x` by `wg` within the f32-x bound of the CPU's `c` (`wd`: the
/// dequantised weight), and every row of a T-row call bit-identical to the same row alone.
#[allow(clippy::too_many_arguments)]
fn check_gemv_rows(
    p: &Pair,
    what: &str,
    wg: &CudaWeight,
    x: &[f32],
    c: &[f32],
    wd: &[f32],
    n: usize,
    k: usize,
) {
    let run = |rows: &[f32], t: usize| -> Vec<f32> {
        let xg = p.gpu.tensor_from_f32(rows, &[t, k]).expect("x");
        let y = p.gpu.matmul(&xg, wg).expect("gemv");
        p.gpu.tensor_to_f32(&y).expect("y")
    };
    let full = run(x, 8);
    check_gemm(what, &full, c, x, wd, 8, n, k, f32_bound);
    assert_rows_independent_of_width(what, n, k, x, &full, run);
}

/// Every q4_g128 and q4_nl_g128 decode GEMV path (SIMT, the persistent tensor-core kernels with x
/// staged in shared memory for small T·K and read from global memory else, and the default Auto):
/// within 1e-4 of Σ|w·x| of
/// the CPU per output on activations spanning 1e-6 .. 1e5 in magnitude (the split-bf16 x keeps f32
/// range), every row of a T-row call bit-identical to the same row alone, on row counts that are
/// and are not multiples of the 16-row tiles and on 1-, 2- and 4-tile blocks.
#[test]
#[ignore = "needs a CUDA GPU"]
fn q4_gemv_paths_match_cpu_for_wide_range_activations() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(21);
    let cases = [(7, 4096), (33, 1152), (70, 2048), (300, 5120), (4133, 256)];
    for (dt, (n, k)) in [WeightDType::Q4G128, WeightDType::Q4NlG128]
        .into_iter()
        .flat_map(|dt| cases.into_iter().map(move |c| (dt, c)))
    {
        let (wg, wd, x, c) = q4_case(&p, &mut rng, dt, n, k);
        for path in [
            Q4Gemv::Simt,
            Q4Gemv::MmaPersistent,
            Q4Gemv::Int8,
            Q4Gemv::Int8Cols,
            Q4Gemv::Auto,
        ] {
            p.gpu.set_q4_gemv(path);
            let what = format!("{dt} {path:?} [{n}x{k}]");
            check_gemv_rows(&p, &what, &wg, &x, &c, &wd, n, k);
        }
    }
    p.gpu.set_q4_gemv(Q4Gemv::Auto);
}

/// The tile-owning q4 GEMV (`gemv_q4i8t*` / `gemv_q4nli8t*`, `CudaBackend::set_q4_tiles`):
/// within 1e-4 of Σ|w·x| of the CPU on wide-range activations, every row of a T-row call
/// bit-identical to the same row alone, on a partial last tile (7 rows), blocks of one tile (70
/// rows), the 27B out projection (5120×6144: 2–3 tiles per block, all in flight) and the 27B
/// qkv+z and MLP gate+up shapes (16384×5120, 34816×5120: 7–8 and 16–17 tiles per block through
/// 2–4 ring slots, so every slot is refilled several times and its barriers change parity), and
/// K = 17408 in half-tile stages (sixteen row copies each; a partial last tile at 1001 rows, the
/// 27B down projection at 5120), x staged (T ≤ 2) and read through L1 (T = 8 at K = 6144); each
/// with whole tiles per block and with split ranges (`set_q4_tiles_split`: a boundary tile's two
/// parts added by the later block, in `QT_SHARE=1` builds). The stream-K kernel on the same weight
/// stays within the same bound.
#[test]
#[ignore = "needs a CUDA GPU"]
fn q4_tile_kernel_matches_cpu_and_is_width_independent() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(34);
    let cases = [
        (7, 4096),
        (70, 2048),
        (5120, 6144),
        (16384, 5120),
        (34816, 5120),
        (1001, 17408),
        (5120, 17408),
    ];
    for (dt, (n, k)) in [WeightDType::Q4G128, WeightDType::Q4NlG128]
        .into_iter()
        .flat_map(|dt| cases.into_iter().map(move |c| (dt, c)))
    {
        let (wg, wd, x, c) = q4_case(&p, &mut rng, dt, n, k);
        p.gpu.set_q4_gemv(Q4Gemv::Auto);
        for (tiles, split) in [
            (Q4Tiles::On, false),
            (Q4Tiles::On, true),
            (Q4Tiles::Off, false),
        ] {
            p.gpu.set_q4_tiles(tiles);
            p.gpu.set_q4_tiles_split(split);
            let what = format!("{dt} tiles {tiles:?} split {split} [{n}x{k}]");
            check_gemv_rows(&p, &what, &wg, &x, &c, &wd, n, k);
        }
    }
    p.gpu.set_q4_tiles(Q4Tiles::Off);
    p.gpu.set_q4_tiles_split(false);
}

/// Embedding rows of quantized tables: exactly the CPU's (and the contract's) dequantised rows.
#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_of_quantized_tables_matches_cpu() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(13);
    for dt in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ] {
        let hs: &[usize] = if dt == WeightDType::F8E4M3 {
            &[256, 200]
        } else {
            &[256, 384]
        };
        for &h in hs {
            let v = 50;
            let table = heavy(&mut rng, v * h, 1.0);
            let want_all = deq(dt, &weight_bytes(&table, &[v, h], dt), &[v, h]);
            let (tc, tg) = p.w(&table, &[v, h], dt);
            let ids: Vec<u32> = (0..9).map(|_| rng.random_range(0..v as u32)).collect();
            let (g, c) = p.get(
                &p.cpu.embedding(&tc, &ids).expect("cpu"),
                &p.gpu.embedding(&tg, &ids).expect("gpu"),
            );
            assert_eq!(g, c, "embedding {dt} h={h} must equal the CPU");
            for (i, id) in ids.iter().enumerate() {
                let row = &want_all[*id as usize * h..(*id as usize + 1) * h];
                assert_eq!(&g[i * h..(i + 1) * h], row, "embedding {dt} h={h} id {id}");
            }
            assert!(p.gpu.embedding(&tg, &[v as u32]).is_err());
        }
    }
}

/// A quantized weight whose byte length does not match its layout is refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn load_weight_checks_quantized_lengths() {
    let b = gpu();
    for dt in [
        WeightDType::Q8_0,
        WeightDType::Q4G128,
        WeightDType::F8E4M3,
        WeightDType::Q4NlG128,
    ] {
        let need = dt.storage_bytes(&[4, 256]).expect("bytes");
        assert!(b
            .load_weight("w", dt, &[4, 256], WeightData::from_vec(vec![1u8; need]))
            .is_ok());
        assert!(b
            .load_weight(
                "w",
                dt,
                &[4, 256],
                WeightData::from_vec(vec![1u8; need - 1])
            )
            .is_err());
    }
    // K not a multiple of the group.
    assert!(b
        .load_weight(
            "w",
            WeightDType::Q4G128,
            &[4, 96],
            WeightData::from_vec(vec![0u8; 4096])
        )
        .is_err());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_norms_rope_activations_match_cpu() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(2);
    let (v, h, t) = (50, 96, 5);
    for dt in [WeightDType::Bf16, WeightDType::F16, WeightDType::F32] {
        let table = rnd(&mut rng, v * h, 1.0);
        let (tc, tg) = p.w(&table, &[v, h], dt);
        let ids: Vec<u32> = (0..t).map(|_| rng.random_range(0..v as u32)).collect();
        let (g, c) = p.get(
            &p.cpu.embedding(&tc, &ids).expect("cpu"),
            &p.gpu.embedding(&tg, &ids).expect("gpu"),
        );
        assert_eq!(g, c, "embedding {dt} must be exact");
        assert!(p.gpu.embedding(&tg, &[v as u32]).is_err());

        let x = rnd(&mut rng, t * h, 2.0);
        let z = rnd(&mut rng, t * h, 2.0);
        let wn = rnd(&mut rng, h, 0.5);
        let (xc, xg) = p.t(&x, &[t, h]);
        let (zc, zg) = p.t(&z, &[t, h]);
        let (wc, wg) = p.w(&wn, &[h], dt);
        for off in [0.0, 1.0] {
            let (g, c) = p.get(
                &p.cpu.rms_norm(&xc, &wc, 1e-6, off).expect("cpu"),
                &p.gpu.rms_norm(&xg, &wg, 1e-6, off).expect("gpu"),
            );
            close(&format!("rms_norm {dt} offset {off}"), &g, &c, 1e-5, 1e-5);
            // The fused residual add + norm: both outputs bit-identical to the two launches on
            // the GPU, and close to the CPU's.
            let (hg, yg) = p.gpu.add_rms_norm(&xg, &zg, &wg, 1e-6, off).expect("gpu");
            let sum = p.gpu.add(&xg, &zg).expect("gpu");
            let two = p.gpu.rms_norm(&sum, &wg, 1e-6, off).expect("gpu");
            let (hc, yc) = p.cpu.add_rms_norm(&xc, &zc, &wc, 1e-6, off).expect("cpu");
            let (h1, h0) = p.get(&hc, &hg);
            assert_eq!(
                h1,
                p.gpu.tensor_to_f32(&sum).expect("dl"),
                "add_rms_norm h {dt}"
            );
            assert_eq!(h0, h1, "add_rms_norm h {dt} vs cpu");
            let (y1, y0) = p.get(&yc, &yg);
            assert_eq!(
                y1,
                p.gpu.tensor_to_f32(&two).expect("dl"),
                "add_rms_norm y {dt}"
            );
            close(
                &format!("add_rms_norm {dt} offset {off}"),
                &y1,
                &y0,
                1e-5,
                1e-5,
            );
        }
        let short = p.gpu.tensor_from_f32(&x[..h], &[1, h]).expect("gpu");
        assert!(p.gpu.add_rms_norm(&xg, &short, &wg, 1e-6, 1.0).is_err());
        let (g, c) = p.get(
            &p.cpu.gated_rms_norm(&xc, &zc, &wc, 1e-6).expect("cpu"),
            &p.gpu.gated_rms_norm(&xg, &zg, &wg, 1e-6).expect("gpu"),
        );
        close(&format!("gated_rms_norm {dt}"), &g, &c, 1e-5, 1e-5);
    }
    // Activations and layout ops.
    let (t, c) = (7, 300);
    let a = rnd(&mut rng, t * c, 6.0);
    let b = rnd(&mut rng, t * c, 6.0);
    let (ac, ag) = p.t(&a, &[t, c]);
    let (bc, bg) = p.t(&b, &[t, c]);
    let (g, cpu) = p.get(
        &p.cpu.swiglu(&ac, &bc).expect("cpu"),
        &p.gpu.swiglu(&ag, &bg).expect("gpu"),
    );
    close("swiglu", &g, &cpu, 1e-6, 1e-5);
    let (g, cpu) = p.get(
        &p.cpu.sigmoid_gate(&ac, &bc).expect("cpu"),
        &p.gpu.sigmoid_gate(&ag, &bg).expect("gpu"),
    );
    close("sigmoid_gate", &g, &cpu, 1e-6, 1e-5);
    let (g, cpu) = p.get(
        &p.cpu.add(&ac, &bc).expect("cpu"),
        &p.gpu.add(&ag, &bg).expect("gpu"),
    );
    assert_eq!(g, cpu, "add is exact");
    let (g, cpu) = p.get(
        &p.cpu.concat_cols(&ac, &bc).expect("cpu"),
        &p.gpu.concat_cols(&ag, &bg).expect("gpu"),
    );
    assert_eq!(g, cpu, "concat_cols is exact");
    let sc = p.cpu.split_cols(&ac, 3, &[60, 30, 10]).expect("cpu");
    let sg = p.gpu.split_cols(&ag, 3, &[60, 30, 10]).expect("gpu");
    for (c1, g1) in sc.iter().zip(&sg) {
        let (g, cpu) = p.get(c1, g1);
        assert_eq!(g, cpu, "split_cols is exact");
    }
    // Multi-row splits run four parts per launch: six parts (two launches), one of them empty.
    let many = rnd(&mut rng, 4 * 2 * 50, 1.0);
    let (mc, mg) = p.t(&many, &[4, 100]);
    let parts = [7, 0, 13, 11, 4, 15];
    let sc = p.cpu.split_cols(&mc, 2, &parts).expect("cpu");
    let sg = p.gpu.split_cols(&mg, 2, &parts).expect("gpu");
    assert_eq!(sg.len(), parts.len());
    for (i, (c1, g1)) in sc.iter().zip(&sg).enumerate() {
        assert_eq!(
            DeviceTensor::dims(g1),
            DeviceTensor::dims(c1),
            "part {i} shape"
        );
        let (g, cpu) = p.get(c1, g1);
        assert_eq!(g, cpu, "six-part split_cols, part {i}");
    }
    let (g, cpu) = p.get(
        &p.cpu.rows(&ac, 2, 3).expect("cpu"),
        &p.gpu.rows(&ag, 2, 3).expect("gpu"),
    );
    assert_eq!(g, cpu, "rows is exact");
    assert!(p.gpu.rows(&ag, 5, 3).is_err());
    // One-row splits and row ranges are views when aligned (a decode step's fused projections):
    // equal to the CPU's copies, consumable by other ops, and never a copy_into destination.
    let one = rnd(&mut rng, 100 + 13 + 19, 1.0);
    let (oc, og) = p.t(&one, &[1, 132]);
    let sc = p.cpu.split_cols(&oc, 1, &[100, 13, 19]).expect("cpu");
    let sg = p.gpu.split_cols(&og, 1, &[100, 13, 19]).expect("gpu");
    assert!(
        !sg[0].is_view() && sg[1].is_view(),
        "aligned parts are views"
    );
    assert!(
        !sg[2].is_view(),
        "a part at a 16-byte-unaligned offset is copied"
    );
    for (c1, g1) in sc.iter().zip(&sg) {
        let (g, cpu) = p.get(c1, g1);
        assert_eq!(g, cpu, "one-row split_cols is exact");
    }
    let (g, cpu) = p.get(
        &p.cpu.add(&sc[1], &sc[1]).expect("cpu"),
        &p.gpu.add(&sg[1], &sg[1]).expect("gpu"),
    );
    assert_eq!(g, cpu, "a view feeds a kernel");
    let rv = p.gpu.rows(&ag, 2, 3).expect("gpu");
    assert!(rv.is_view());
    let mut dst = p.gpu.rows(&ag, 4, 1).expect("gpu");
    let src = p.gpu.rows(&ag, 0, 1).expect("gpu");
    assert!(
        p.gpu.copy_into(&mut dst, &src).is_err(),
        "a view is not written in place"
    );
    // argmax, with a planted tie (lowest index wins).
    let mut logits = rnd(&mut rng, 4 * 1000, 3.0);
    logits[1000 + 10] = 9.0;
    logits[1000 + 700] = 9.0;
    let (lc, lg) = p.t(&logits, &[4, 1000]);
    let want = p.cpu.argmax_rows(&lc).expect("cpu");
    assert_eq!(p.gpu.argmax_rows(&lg).expect("gpu"), want);
    assert_eq!(want[1], 10);
}

/// RMSNorm rows of the 27B hidden size (5,120 values: the rows `KVSTREAM_NORM_WIDE` gives 512
/// threads) and of 8,192 against the CPU, and each row of a T = 4 call bit for bit equal to the
/// same row normed alone (the row's result must not depend on the width: MTP verification).
#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norms_of_hidden_size_rows_match_cpu_and_do_not_depend_on_width() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(22);
    for d in [5120usize, 8192] {
        let t = 4;
        let x = rnd(&mut rng, t * d, 3.0);
        let z = rnd(&mut rng, t * d, 3.0);
        let (xc, xg) = p.t(&x, &[t, d]);
        let (zc, zg) = p.t(&z, &[t, d]);
        let (wc, wg) = p.w(&rnd(&mut rng, d, 0.5), &[d], WeightDType::Bf16);
        let (g, c) = p.get(
            &p.cpu.rms_norm(&xc, &wc, 1e-6, 1.0).expect("cpu"),
            &p.gpu.rms_norm(&xg, &wg, 1e-6, 1.0).expect("gpu"),
        );
        close(&format!("rms_norm d={d}"), &g, &c, 1e-5, 1e-5);
        let (hg, yg) = p.gpu.add_rms_norm(&xg, &zg, &wg, 1e-6, 1.0).expect("gpu");
        let (hc, yc) = p.cpu.add_rms_norm(&xc, &zc, &wc, 1e-6, 1.0).expect("cpu");
        let (y_all, y_cpu) = p.get(&yc, &yg);
        close(&format!("add_rms_norm d={d}"), &y_all, &y_cpu, 1e-5, 1e-5);
        let (h_all, h_cpu) = p.get(&hc, &hg);
        assert_eq!(h_all, h_cpu, "add_rms_norm h d={d} is exact");
        for r in 0..t {
            let row = |v: &[f32]| v[r * d..(r + 1) * d].to_vec();
            let (xr, zr) = (row(&x), row(&z));
            let xg1 = p.gpu.tensor_from_f32(&xr, &[1, d]).expect("x row");
            let zg1 = p.gpu.tensor_from_f32(&zr, &[1, d]).expect("z row");
            let one = p.gpu.rms_norm(&xg1, &wg, 1e-6, 1.0).expect("gpu row");
            let one = p.gpu.tensor_to_f32(&one).expect("dl");
            assert_eq!(bits(&one), bits(&row(&g)), "rms_norm d={d} row {r} alone");
            let (_, y1) = p
                .gpu
                .add_rms_norm(&xg1, &zg1, &wg, 1e-6, 1.0)
                .expect("gpu row");
            let y1 = p.gpu.tensor_to_f32(&y1).expect("dl");
            assert_eq!(
                bits(&y1),
                bits(&row(&y_all)),
                "add_rms_norm d={d} row {r} alone"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rope_and_mrope_match_cpu() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(3);
    let (t, heads, hd) = (6, 3, 64);
    for (interleaved, rotary) in [(true, 32), (false, 64), (true, 16)] {
        let cfg = RopeConfig {
            rotary_dim: rotary,
            theta: 1e7,
            mrope_section: [rotary / 2 - 2 * (rotary / 6), rotary / 6, rotary / 6],
            interleaved,
        };
        let pos: Vec<Position3> = (0..t)
            .map(|_| {
                [
                    rng.random_range(0..5000),
                    rng.random_range(0..5000),
                    rng.random_range(0..5000),
                ]
            })
            .collect();
        let x = rnd(&mut rng, t * heads * hd, 1.0);
        let (xc, xg) = p.t(&x, &[t, heads, hd]);
        let (g, c) = p.get(
            &p.cpu.rope(&xc, heads, hd, &pos, &cfg).expect("cpu"),
            &p.gpu.rope(&xg, heads, hd, &pos, &cfg).expect("gpu"),
        );
        close(
            &format!("rope rotary {rotary} interleaved {interleaved}"),
            &g,
            &c,
            2e-4,
            1e-4,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn conv1d_and_gated_delta_rule_match_cpu() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(4);
    // conv1d with a non-zero incoming state, two calls in a row.
    let (c, k) = (96, 4);
    let w = rnd(&mut rng, c * k, 0.5);
    let (wc, wg) = p.w(&w, &[c, 1, k], WeightDType::Bf16);
    let st = rnd(&mut rng, (k - 1) * c, 1.0);
    let (mut sc, mut sg) = p.t(&st, &[k - 1, c]);
    for t in [5, 1] {
        let x = rnd(&mut rng, t * c, 1.0);
        let (xc, xg) = p.t(&x, &[t, c]);
        let (g, cpu) = p.get(
            &p.cpu.causal_conv1d(&xc, &wc, &mut sc).expect("cpu"),
            &p.gpu.causal_conv1d(&xg, &wg, &mut sg).expect("gpu"),
        );
        close(&format!("conv1d t={t}"), &g, &cpu, 1e-5, 1e-5);
        let (g, cpu) = p.get(&sc, &sg);
        assert_eq!(g, cpu, "conv state");
    }
    // Gated delta rule: recurrent and chunked CPU modes against the GPU; 70 tokens reach the
    // chunked GPU kernels (so the sanitizer runs of this suite cover them; gdn_chunked.rs has the
    // thorough tests).
    for (tokens, mode) in [
        (9, DeltaMode::Recurrent),
        (9, DeltaMode::Chunked { chunk: 4 }),
        (70, DeltaMode::Chunked { chunk: 64 }),
    ] {
        let s = DeltaShape {
            tokens,
            k_heads: 2,
            v_heads: 4,
            k_dim: 64,
            v_dim: 48,
        };
        let q = rnd(&mut rng, s.tokens * s.k_heads * s.k_dim, 1.0);
        let kk = rnd(&mut rng, s.tokens * s.k_heads * s.k_dim, 1.0);
        let v = rnd(&mut rng, s.tokens * s.v_heads * s.v_dim, 1.0);
        let a = rnd(&mut rng, s.tokens * s.v_heads, 2.0);
        let b = rnd(&mut rng, s.tokens * s.v_heads, 2.0);
        let alog = rnd(&mut rng, s.v_heads, 1.0);
        let dtb = rnd(&mut rng, s.v_heads, 1.0);
        let st0 = rnd(&mut rng, s.v_heads * s.k_dim * s.v_dim, 0.3);
        let (qc, qg) = p.t(&q, &[s.tokens, s.k_heads, s.k_dim]);
        let (kc, kg) = p.t(&kk, &[s.tokens, s.k_heads, s.k_dim]);
        let (vc, vg) = p.t(&v, &[s.tokens, s.v_heads, s.v_dim]);
        let (ac, ag) = p.t(&a, &[s.tokens, s.v_heads]);
        let (bc, bg) = p.t(&b, &[s.tokens, s.v_heads]);
        let (alc, alg) = p.w(&alog, &[s.v_heads], WeightDType::F32);
        let (dc, dg) = p.w(&dtb, &[s.v_heads], WeightDType::Bf16);
        let (mut sc, mut sg) = p.t(&st0, &[s.v_heads, s.k_dim, s.v_dim]);
        let oc = p
            .cpu
            .gated_delta_rule(&s, &qc, &kc, &vc, &ac, &bc, &alc, &dc, &mut sc, mode)
            .expect("cpu");
        let og = p
            .gpu
            .gated_delta_rule(&s, &qg, &kg, &vg, &ag, &bg, &alg, &dg, &mut sg, mode)
            .expect("gpu");
        let (g, cpu) = p.get(&oc, &og);
        close(
            &format!("gated_delta_rule {mode:?} output"),
            &g,
            &cpu,
            1e-4,
            1e-3,
        );
        let (g, cpu) = p.get(&sc, &sg);
        close(
            &format!("gated_delta_rule {mode:?} state"),
            &g,
            &cpu,
            1e-4,
            1e-3,
        );
    }
}

/// The fused decode recurrence (`gdn_recurrent_fused`: q/k norms and gates in the same launch)
/// against the three launches it replaces: outputs and states bit for bit, widths 1 and 4 (MTP
/// verification), the 27B head geometry and a ragged one, a gate input past softplus' linear
/// branch; and against the CPU.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_decode_recurrence_is_bit_identical_to_three_launches() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(41);
    for (k_heads, v_heads, k_dim, v_dim) in [(2, 6, 128, 128), (2, 4, 64, 48)] {
        for tokens in [1, 4] {
            let s = DeltaShape {
                tokens,
                k_heads,
                v_heads,
                k_dim,
                v_dim,
            };
            let q = rnd(&mut rng, tokens * k_heads * k_dim, 1.0);
            let kk = rnd(&mut rng, tokens * k_heads * k_dim, 1.0);
            let v = rnd(&mut rng, tokens * v_heads * v_dim, 1.0);
            let mut a = rnd(&mut rng, tokens * v_heads, 2.0);
            a[0] = 30.0;
            let b = rnd(&mut rng, tokens * v_heads, 2.0);
            let alog = rnd(&mut rng, v_heads, 1.0);
            let dtb = rnd(&mut rng, v_heads, 1.0);
            let st0 = rnd(&mut rng, v_heads * k_dim * v_dim, 0.3);
            let (qc, qg) = p.t(&q, &[tokens, k_heads, k_dim]);
            let (kc, kg) = p.t(&kk, &[tokens, k_heads, k_dim]);
            let (vc, vg) = p.t(&v, &[tokens, v_heads, v_dim]);
            let (ac, ag) = p.t(&a, &[tokens, v_heads]);
            let (bc, bg) = p.t(&b, &[tokens, v_heads]);
            let (alc, alg) = p.w(&alog, &[v_heads], WeightDType::F32);
            let (dc, dg) = p.w(&dtb, &[v_heads], WeightDType::Bf16);
            let run = |fused: bool| {
                p.gpu.set_gdn_fused(fused);
                let mut st = p
                    .gpu
                    .tensor_from_f32(&st0, &[v_heads, k_dim, v_dim])
                    .expect("st");
                let o = p
                    .gpu
                    .gated_delta_rule(
                        &s,
                        &qg,
                        &kg,
                        &vg,
                        &ag,
                        &bg,
                        &alg,
                        &dg,
                        &mut st,
                        DeltaMode::Recurrent,
                    )
                    .expect("gpu");
                (
                    p.gpu.tensor_to_f32(&o).expect("o"),
                    p.gpu.tensor_to_f32(&st).expect("state"),
                )
            };
            let (o3, s3) = run(false);
            let (o1, s1) = run(true);
            let what = format!("[{k_heads}x{v_heads}x{k_dim}x{v_dim}] t={tokens}");
            assert_eq!(bits(&o1), bits(&o3), "{what}: output");
            assert_eq!(bits(&s1), bits(&s3), "{what}: state");
            let (mut sc, _) = p.t(&st0, &[v_heads, k_dim, v_dim]);
            let oc = p
                .cpu
                .gated_delta_rule(
                    &s,
                    &qc,
                    &kc,
                    &vc,
                    &ac,
                    &bc,
                    &alc,
                    &dc,
                    &mut sc,
                    DeltaMode::Recurrent,
                )
                .expect("cpu");
            let c = p.cpu.tensor_to_f32(&oc).expect("cpu o");
            close(&format!("fused recurrence {what}"), &o1, &c, 1e-4, 1e-3);
        }
    }
    p.gpu.set_gdn_fused(true);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kv_write_bytes_equal_cpu_for_every_format() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(5);
    for kt in KvType::ALL {
        for vt in KvType::ALL {
            let g = PageGeometry::new(16, 2, 64, kt, vt).expect("geometry");
            let n = 20;
            let k = rnd(&mut rng, n * g.row_values(), 3.0);
            let v = rnd(&mut rng, n * g.row_values(), 3.0);
            let (kc, kg) = p.t(&k, &[n, g.row_values()]);
            let (vc, vg) = p.t(&v, &[n, g.row_values()]);
            let bytes = g.page_bytes() * 2;
            let rows: Vec<(usize, usize)> = (0..n)
                .map(|t| (g.k_row_offset(0, 0, t), g.v_row_offset(0, 0, t)))
                .collect();
            let pc = p.cpu.alloc_buffer(bytes).expect("cpu buf");
            let pg = p.gpu.alloc_buffer(bytes).expect("gpu buf");
            let fill = vec![0xa5u8; bytes];
            p.cpu.write_buffer(&pc, 0, &fill).expect("cpu fill");
            p.gpu.write_buffer(&pg, 0, &fill).expect("gpu fill");
            p.cpu
                .kv_write(&kc, &vc, &g, &pc, &rows)
                .expect("cpu kv_write");
            p.gpu
                .kv_write(&kg, &vg, &g, &pg, &rows)
                .expect("gpu kv_write");
            let mut oc = vec![0u8; bytes];
            let mut og = vec![0u8; bytes];
            p.cpu.read_buffer(&pc, 0, &mut oc).expect("cpu read");
            p.gpu.read_buffer(&pg, 0, &mut og).expect("gpu read");
            assert!(oc != fill, "{kt}/{vt}: nothing written");
            assert_eq!(og, oc, "{kt}/{vt}: page bytes differ");
        }
    }
}

/// The bit patterns of `v` (exact comparison, NaN-safe).
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}
