//! Weight prefetch into L2 (`LinearOps::prefetch_weight`, `KVSTREAM_L2_PREFETCH`): a hint that
//! never changes a result. With the switch on, a GEMV after the prefetch of its weight equals the
//! GEMV alone bit for bit and one prefetch launch is counted; weights over half the L2, and every
//! weight with the switch off, launch nothing; a whole engine on a fixture names each layer's
//! output projection once per decode step and gives the same greedy tokens. Run on a GPU machine
//! with `--ignored`.

use kvstream_backend_cuda::{CudaBackend, CudaWeight};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::quantize;
use kvstream_runtime::{Engine, EngineConfig, GenerateRequest, Prompt};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::path::PathBuf;

mod common;
use common::{gpu, rnd};

fn weight(b: &CudaBackend, rng: &mut StdRng, dt: WeightDType, dims: &[usize]) -> CudaWeight {
    let n: usize = dims.iter().product();
    let bytes = quantize(dt, &rnd(rng, n, 0.5), dims).expect("quantize");
    b.load_weight("w", dt, dims, WeightData::from_vec(bytes))
        .expect("load")
}

fn bits(b: &CudaBackend, x: &kvstream_backend_cuda::CudaTensor, w: &CudaWeight) -> Vec<u32> {
    let y = b
        .tensor_to_f32(&b.matmul(x, w).expect("matmul"))
        .expect("download");
    assert!(y.iter().any(|v| *v != 0.0), "all-zero output");
    y.iter().map(|v| v.to_bits()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn prefetch_is_a_hint_that_changes_no_result() {
    let b = gpu();
    let mut rng = StdRng::seed_from_u64(5);
    for (dt, n, k) in [
        (WeightDType::Q4G128, 5120, 6144),
        (WeightDType::Q8_0, 1024, 4096),
        (WeightDType::Bf16, 777, 1024),
    ] {
        let w = weight(&b, &mut rng, dt, &[n, k]);
        for t in [1, 4] {
            let x = b
                .tensor_from_f32(&rnd(&mut rng, t * k, 1.0), &[t, k])
                .expect("x");
            b.set_l2_prefetch(false);
            let want = bits(&b, &x, &w);
            let before = b.l2_prefetch_launches();
            b.prefetch_weight(&w).expect("prefetch off");
            assert_eq!(b.l2_prefetch_launches(), before, "switch off: no launch");
            b.set_l2_prefetch(true);
            b.prefetch_weight(&w).expect("prefetch");
            assert_eq!(b.l2_prefetch_launches(), before + 1, "{dt} [{n}x{k}]");
            assert_eq!(bits(&b, &x, &w), want, "{dt} [{n}x{k}] t={t}");
        }
    }
    // 256 MB of bf16: over half of any L2, left alone.
    let big = weight(&b, &mut rng, WeightDType::Bf16, &[16384, 8192]);
    let before = b.l2_prefetch_launches();
    b.prefetch_weight(&big).expect("prefetch");
    assert_eq!(b.l2_prefetch_launches(), before);
    b.set_l2_prefetch(false);
}

fn greedy(b: CudaBackend, prefetch: bool) -> (Vec<u32>, u64) {
    b.set_l2_prefetch(prefetch);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-gqa-f32");
    let mut c = EngineConfig::new(&dir);
    c.ctx_size = 128;
    c.k_type = KvType::F32;
    c.v_type = KvType::F32;
    c.page_tokens = 4;
    c.arena_bytes = 4 << 20;
    let mut e = Engine::load(b, c).expect("load");
    let mut req = GenerateRequest::new(Prompt::Tokens(vec![5, 17, 33, 2, 90, 11, 7]), 16);
    req.stop_at_eos = false;
    let gen = e
        .generate(&req, |_| kvstream_runtime::Flow::Continue)
        .expect("generate");
    (gen.tokens, e.backend().l2_prefetch_launches())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn engine_names_each_output_projection_per_decode_step() {
    let (plain, none) = greedy(gpu(), false);
    let (fetched, launches) = greedy(gpu(), true);
    assert_eq!(none, 0);
    assert_eq!(
        fetched, plain,
        "greedy tokens must not depend on prefetching"
    );
    // 4 layers (3 GDN + 1 attention), one output projection each, per decode step (16 tokens:
    // at least 15 decode steps; the 7-token prompt's prefill names them too).
    assert!(launches >= 15 * 4, "{launches} prefetch launches");
}
