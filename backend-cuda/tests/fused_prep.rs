//! The fused x prep (`KVSTREAM_Q4_FUSED_PREP`): the producers of a q4 decode GEMV's input (the
//! RMSNorms, the gated RMSNorm, SwiGLU, the sigmoid gate) write the GEMV's x-prep bytes beside
//! their output. With it on, every producer output and every q4 GEMV output must equal, bit for
//! bit, what the unfused path (x-prep launch before the GEMV) gives, for both 4-bit formats and
//! every decode width; widths above the GEMV's and shapes without whole 128-groups fall back.
//! Fresh random inputs, never zeros. Run on a GPU machine with `--ignored`.

use kvstream_backend_cuda::{CudaBackend, CudaTensor, CudaWeight, Q4Gemv};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::quantize;
use rand::rngs::StdRng;
use rand::SeedableRng;

mod common;
use common::{gpu, rnd};

const Q4: [WeightDType; 2] = [WeightDType::Q4G128, WeightDType::Q4NlG128];

fn weight(b: &CudaBackend, rng: &mut StdRng, dt: WeightDType, dims: &[usize]) -> CudaWeight {
    let n: usize = dims.iter().product();
    let vals = rnd(rng, n, 0.5);
    let bytes = quantize(dt, &vals, dims).expect("quantize");
    b.load_weight("w", dt, dims, WeightData::from_vec(bytes))
        .expect("load")
}

fn bits(b: &CudaBackend, t: &CudaTensor) -> Vec<u32> {
    let v = b.tensor_to_f32(t).expect("download");
    assert!(v.iter().any(|x| *x != 0.0), "all-zero output");
    v.iter().map(|f| f.to_bits()).collect()
}

/// The inputs of one producer call, uploaded.
struct Inputs {
    a: CudaTensor,
    b: CudaTensor,
    /// `a` as rows of 128 (the gated norm's per-head rows).
    a_heads: CudaTensor,
    b_heads: CudaTensor,
}

/// Every producer on `inp`, each output with the GEMV of `w` on it: `(name, producer bits, GEMV
/// bits, whether the output carried x-prep bytes, whether the GEMV ran an x-prep launch)`.
fn run_all(
    g: &CudaBackend,
    inp: &Inputs,
    norm_w: &CudaWeight,
    head_w: &CudaWeight,
    w: &CudaWeight,
    t: usize,
    k: usize,
) -> Vec<(&'static str, Vec<u32>, Vec<u32>, bool, bool)> {
    let gated = g
        .gated_rms_norm(&inp.a_heads, &inp.b_heads, head_w, 1e-6)
        .expect("gated_rms_norm");
    let gated = g.reshape(gated, &[t, k]).expect("reshape");
    let outs = [
        (
            "rms_norm",
            g.rms_norm(&inp.a, norm_w, 1e-6, 1.0).expect("rms"),
        ),
        (
            "add_rms_norm",
            g.add_rms_norm(&inp.a, &inp.b, norm_w, 1e-6, 1.0)
                .expect("add_rms")
                .1,
        ),
        ("gated_rms_norm", gated),
        ("swiglu", g.swiglu(&inp.a, &inp.b).expect("swiglu")),
        (
            "sigmoid_gate",
            g.sigmoid_gate(&inp.a, &inp.b).expect("sigmoid_gate"),
        ),
    ];
    outs.into_iter()
        .map(|(name, y)| {
            let before = g.q4_xprep_launches();
            let out = g.matmul(&y, w).expect("matmul");
            let launched = g.q4_xprep_launches() > before;
            (
                name,
                bits(g, &y),
                bits(g, &out),
                y.has_prepared_x(),
                launched,
            )
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_prep_is_bit_identical_to_the_x_prep_launch() {
    let mut rng = StdRng::seed_from_u64(1010);
    // K = 1024: 8 groups per row; N = 1000 and 264 (not multiples of the tile rows). One
    // backend per format: a backend prepares for the first 4-bit format it loads.
    for dt in Q4 {
        let g = gpu();
        g.set_q4_gemv(Q4Gemv::Auto);
        for (n, k) in [(1000usize, 1024usize), (264, 5120)] {
            let w = weight(&g, &mut rng, dt, &[n, k]);
            let norm_w = weight(&g, &mut rng, WeightDType::Bf16, &[k]);
            let head_w = weight(&g, &mut rng, WeightDType::F32, &[128]);
            for t in 1..=9usize {
                let a = rnd(&mut rng, t * k, 3.0);
                let b = rnd(&mut rng, t * k, 3.0);
                let up = |v: &[f32], dims: &[usize]| g.tensor_from_f32(v, dims).expect("up");
                let inp = Inputs {
                    a: up(&a, &[t, k]),
                    b: up(&b, &[t, k]),
                    a_heads: up(&a, &[t * k / 128, 128]),
                    b_heads: up(&b, &[t * k / 128, 128]),
                };
                g.set_fused_prep(true);
                let fused = run_all(&g, &inp, &norm_w, &head_w, &w, t, k);
                g.set_fused_prep(false);
                let plain = run_all(&g, &inp, &norm_w, &head_w, &w, t, k);
                for (f, p) in fused.iter().zip(&plain) {
                    let what = format!("{dt} {n}x{k} T={t} {}", f.0);
                    assert_eq!(f.1, p.1, "{what}: producer output differs");
                    assert_eq!(f.2, p.2, "{what}: GEMV output differs");
                    assert!(!p.3, "{what}: x-prep bytes with the fused prep off");
                    if t <= 8 {
                        // The GEMV reads the producer's bytes and runs no x prep of its own.
                        assert!(f.3 && !f.4, "{what}: fused: bytes {} x prep {}", f.3, f.4);
                        assert!(p.4, "{what}: unfused GEMV ran no x prep");
                    } else {
                        // Wider than a GEMV (the prefill GEMM reads f32 x): no bytes made.
                        assert!(!f.3, "{what}: x-prep bytes for a GEMM input");
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn outputs_without_whole_groups_or_a_q4_target_carry_no_prep() {
    let g = gpu();
    g.set_q4_gemv(Q4Gemv::Auto);
    g.set_fused_prep(true);
    let mut rng = StdRng::seed_from_u64(1011);
    let _w = weight(&g, &mut rng, WeightDType::Q4G128, &[256, 1024]);
    // 1000 values: not a whole number of K = 1024 rows.
    let x = g
        .tensor_from_f32(&rnd(&mut rng, 1000, 1.0), &[1, 1000])
        .expect("x");
    let nw = weight(&g, &mut rng, WeightDType::F32, &[1000]);
    assert!(!g
        .rms_norm(&x, &nw, 1e-6, 0.0)
        .expect("rms")
        .has_prepared_x());
    assert!(!g.swiglu(&x, &x).expect("swiglu").has_prepared_x());
    // A K = 1024 output, but the q4 path forced to one that reads another layout.
    let x = g
        .tensor_from_f32(&rnd(&mut rng, 1024, 1.0), &[1, 1024])
        .expect("x");
    assert!(g.swiglu(&x, &x).expect("swiglu").has_prepared_x());
    g.set_q4_gemv(Q4Gemv::Int8);
    assert!(!g.swiglu(&x, &x).expect("swiglu").has_prepared_x());
    g.set_q4_gemv(Q4Gemv::Auto);
    // A copy holds new values: its bytes are dropped.
    let y = g.swiglu(&x, &x).expect("swiglu");
    let mut dst = g.swiglu(&x, &x).expect("swiglu");
    assert!(dst.has_prepared_x());
    g.copy_into(&mut dst, &y).expect("copy");
    assert!(!dst.has_prepared_x());
}
