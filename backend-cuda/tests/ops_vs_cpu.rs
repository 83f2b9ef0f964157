//! Every compute op on the GPU against the CPU reference backend, on fresh random inputs (never
//! all zeros), within dtype tolerances. Run on a GPU machine with `--ignored`.

use half::{bf16, f16};
use kvstream_backend_cpu::CpuBackend;
use kvstream_backend_cuda::CudaBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::transfer::DeviceMemory;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn gpu() -> CudaBackend {
    match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("this test needs a CUDA GPU: {e}"),
    }
}

fn rnd(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let x = rng.random_range(-amp..amp);
            if x == 0.0 {
                amp * 0.25
            } else {
                x
            }
        })
        .collect()
}

fn weight_bytes(vals: &[f32], dt: WeightDType) -> Vec<u8> {
    match dt {
        WeightDType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightDType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        WeightDType::Bf16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect(),
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
        let bytes = weight_bytes(vals, dt);
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn matmul_gemv_and_gemm_match_cpu_for_every_dtype() {
    let p = Pair::new();
    let mut rng = StdRng::seed_from_u64(1);
    for dt in [WeightDType::Bf16, WeightDType::F16, WeightDType::F32] {
        for &(t, k, n) in &[
            (1, 256, 96),
            (3, 200, 70),
            (8, 512, 33),
            (9, 64, 64),
            (70, 136, 130),
        ] {
            let x = rnd(&mut rng, t * k, 1.0);
            let w = rnd(&mut rng, n * k, 0.5);
            let (xc, xg) = p.t(&x, &[t, k]);
            let (wc, wg) = p.w(&w, &[n, k], dt);
            let yc = p.cpu.matmul(&xc, &wc).expect("cpu matmul");
            let yg = p.gpu.matmul(&xg, &wg).expect("gpu matmul");
            let (g, c) = p.get(&yc, &yg);
            close(
                &format!("matmul {dt} t={t} k={k} n={n}"),
                &g,
                &c,
                1e-4 * (k as f32).sqrt(),
                1e-4,
            );
        }
    }
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
        }
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
    let (g, cpu) = p.get(
        &p.cpu.rows(&ac, 2, 3).expect("cpu"),
        &p.gpu.rows(&ag, 2, 3).expect("gpu"),
    );
    assert_eq!(g, cpu, "rows is exact");
    assert!(p.gpu.rows(&ag, 5, 3).is_err());
    // argmax, with a planted tie (lowest index wins).
    let mut logits = rnd(&mut rng, 4 * 1000, 3.0);
    logits[1000 + 10] = 9.0;
    logits[1000 + 700] = 9.0;
    let (lc, lg) = p.t(&logits, &[4, 1000]);
    let want = p.cpu.argmax_rows(&lc).expect("cpu");
    assert_eq!(p.gpu.argmax_rows(&lg).expect("gpu"), want);
    assert_eq!(want[1], 10);
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
    // Gated delta rule: recurrent and chunked CPU modes against the GPU.
    let s = DeltaShape {
        tokens: 9,
        k_heads: 2,
        v_heads: 4,
        k_dim: 64,
        v_dim: 48,
    };
    for mode in [DeltaMode::Recurrent, DeltaMode::Chunked { chunk: 4 }] {
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
