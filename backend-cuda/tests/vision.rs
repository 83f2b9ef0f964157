//! The vision tower on the GPU against the CPU reference backend: every `VisionOps` op on random
//! inputs, the whole tower on `fixtures/tiny-vl` (embeddings within 1e-2 · max|ref|), and the
//! multimodal engine (last-row logits and greedy tokens of the 2-image prompt, arena use back at
//! the text-only level after each image). Run on a GPU machine with `--ignored`.

use kvstream_backend_cpu::CpuBackend;
use kvstream_backend_cuda::CudaBackend;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::ops::*;
use kvstream_memory_contracts::Backend;
use kvstream_model_qwen::vision::{preprocess, PreprocessorConfig};
use kvstream_model_qwen::VisionTower;
use kvstream_runtime::{Engine, EngineConfig, GenerateRequest, ImageInput, Prompt};
use rand::rngs::StdRng;
use rand::SeedableRng;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

mod common;
use common::{gpu, rnd};

fn vl_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-vl")
}

/// max |got − want| ≤ tol · max |want|, reference not all zeros.
fn close_rel(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(
        scale > 0.0,
        "{what}: reference is all zeros, the test cannot fail"
    );
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        assert!(
            g.is_finite() && err <= tol * scale,
            "{what}: element {i}: gpu {g} cpu {w} (err {err}, scale {scale})"
        );
        worst = worst.max(err);
    }
    eprintln!("{what}: max abs err {worst:.3e} (max |ref| {scale:.3e})");
}

struct Both {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

type CT = <CpuBackend as Backend>::Tensor;
type GT = <CudaBackend as Backend>::Tensor;
type CW = <CpuBackend as Backend>::Weight;
type GW = <CudaBackend as Backend>::Weight;

impl Both {
    fn new() -> Self {
        Self {
            cpu: CpuBackend::new(),
            gpu: gpu(),
        }
    }
    fn t(&self, data: &[f32], dims: &[usize]) -> (CT, GT) {
        (
            self.cpu.tensor_from_f32(data, dims).expect("cpu tensor"),
            self.gpu.tensor_from_f32(data, dims).expect("gpu tensor"),
        )
    }
    fn w(&self, vals: &[f32], dt: WeightDType) -> (CW, GW) {
        let bytes: Vec<u8> = match dt {
            WeightDType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            WeightDType::Bf16 => vals
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            other => panic!("test weights are f32 or bf16, not {other}"),
        };
        let dims = [vals.len()];
        (
            self.cpu
                .load_weight("w", dt, &dims, WeightData::from_vec(bytes.clone()))
                .expect("cpu weight"),
            self.gpu
                .load_weight("w", dt, &dims, WeightData::from_vec(bytes))
                .expect("gpu weight"),
        )
    }
    fn get(&self, c: &CT, g: &GT) -> (Vec<f32>, Vec<f32>) {
        (
            self.gpu.tensor_to_f32(g).expect("gpu download"),
            self.cpu.tensor_to_f32(c).expect("cpu download"),
        )
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bias_layer_norm_and_gelu_match_cpu() {
    let p = Both::new();
    let mut rng = StdRng::seed_from_u64(11);
    for (rows, d, dt) in [
        (7, 64, WeightDType::F32),
        (33, 1152, WeightDType::F32),
        (5, 200, WeightDType::Bf16),
    ] {
        // An offset so LayerNorm's mean subtraction matters.
        let x: Vec<f32> = rnd(&mut rng, rows * d, 3.0)
            .iter()
            .map(|v| v + 1.5)
            .collect();
        let (cx, gx) = p.t(&x, &[rows, d]);
        let (cb, gb) = p.w(&rnd(&mut rng, d, 1.0), dt);
        let (cw, gw) = p.w(&rnd(&mut rng, d, 2.0), dt);
        let (g, c) = p.get(
            &p.cpu.add_bias(&cx, &cb).expect("cpu"),
            &p.gpu.add_bias(&gx, &gb).expect("gpu"),
        );
        close_rel(&format!("add_bias {rows}x{d} {dt}"), &g, &c, 1e-6);
        let (g, c) = p.get(
            &p.cpu.layer_norm(&cx, &cw, &cb, 1e-6).expect("cpu"),
            &p.gpu.layer_norm(&gx, &gw, &gb, 1e-6).expect("gpu"),
        );
        close_rel(&format!("layer_norm {rows}x{d} {dt}"), &g, &c, 1e-4);
        for kind in [Gelu::Tanh, Gelu::Erf] {
            let (g, c) = p.get(
                &p.cpu.gelu(&cx, kind).expect("cpu"),
                &p.gpu.gelu(&gx, kind).expect("gpu"),
            );
            close_rel(&format!("gelu {kind:?} {rows}x{d}"), &g, &c, 1e-5);
        }
    }
    // Shape errors are typed on the GPU too.
    let (_, gx) = p.t(&[1.0; 7], &[7]);
    let (_, gb) = p.w(&[1.0, 2.0], WeightDType::F32);
    assert!(matches!(
        p.gpu.add_bias(&gx, &gb),
        Err(OpError::Shape { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn vision_attention_matches_cpu_across_frames_head_dims_and_blocks() {
    let p = Both::new();
    let mut rng = StdRng::seed_from_u64(12);
    // (frames, frame, heads, head_dim): ragged warps, two CPU query blocks, head_dim 72 (Qwen3.5
    // ViT), 128 (the kernel's largest), 16.
    for (frames, frame, heads, hd) in [
        (1, 16, 2, 16),
        (2, 150, 3, 72),
        (1, 257, 4, 128),
        (3, 37, 16, 72),
    ] {
        let n = frames * frame;
        let h = heads * hd;
        let qkv = rnd(&mut rng, n * 3 * h, 1.5);
        // Rotary tables of real angles (positions up to 40, HF-like frequencies).
        let mut cos = vec![0f32; frame * hd];
        let mut sin = vec![0f32; frame * hd];
        for i in 0..frame {
            for d in 0..hd {
                let ang = (i % 41) as f32 * 10000f32.powf(-((d % (hd / 2)) as f32) / hd as f32);
                cos[i * hd + d] = ang.cos();
                sin[i * hd + d] = ang.sin();
            }
        }
        let shape = VisionAttentionShape {
            tokens: n,
            frame,
            heads,
            head_dim: hd,
        };
        let (cq, gq) = p.t(&qkv, &[n, 3 * h]);
        let (cc, gc) = p.t(&cos, &[frame, hd]);
        let (cs, gs) = p.t(&sin, &[frame, hd]);
        let (g, c) = p.get(
            &p.cpu.vision_attention(&cq, &cc, &cs, &shape).expect("cpu"),
            &p.gpu.vision_attention(&gq, &gc, &gs, &shape).expect("gpu"),
        );
        close_rel(&format!("vision_attention {shape:?}"), &g, &c, 1e-4);
    }
    let bad = VisionAttentionShape {
        tokens: 4,
        frame: 4,
        heads: 1,
        head_dim: 256,
    };
    let (_, gq) = p.t(&vec![0.5; 4 * 3 * 256], &[4, 768]);
    let (_, gc) = p.t(&vec![1.0; 4 * 256], &[4, 256]);
    assert!(matches!(
        p.gpu.vision_attention(&gq, &gc, &gc, &bad),
        Err(OpError::Shape { .. })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn tower_embeddings_match_cpu_on_tiny_vl() {
    let (cpu, gpu) = (CpuBackend::new(), gpu());
    let tower = VisionTower::load(&vl_dir()).expect("tower");
    let pcfg = PreprocessorConfig::from_model_dir(&vl_dir()).expect("preprocessor");
    for f in ["img_a.png", "img_b.png", "img_e.jpg"] {
        let bytes = std::fs::read(vl_dir().join(f)).expect("image");
        let img = preprocess(&bytes, &pcfg).expect("preprocess");
        let want = tower.encode_on(&cpu, &img).expect("cpu encode");
        let weights = tower.upload(&gpu).expect("upload");
        let got = tower.encode_with(&gpu, &weights, &img).expect("gpu encode");
        close_rel(&format!("tower {f} {:?}", img.grid_thw), &got, &want, 1e-2);
        // Bit-stable across calls with the same uploaded weights.
        let again = tower.encode_with(&gpu, &weights, &img).expect("gpu encode");
        assert_eq!(got, again, "{f}: GPU encode is not deterministic");
    }
}

fn oracle_ids() -> Vec<u32> {
    let bytes = std::fs::read(vl_dir().join("oracle.safetensors")).expect("oracle");
    let st = SafeTensors::deserialize(&bytes).expect("oracle");
    let t = st.tensor("ids").expect("oracle ids");
    assert_eq!(t.dtype(), Dtype::I64);
    t.data()
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u32::try_from(i64::from_le_bytes(a)).expect("id")
        })
        .collect()
}

fn config(dir: &Path) -> EngineConfig {
    let mut c = EngineConfig::new(dir);
    c.ctx_size = 128;
    c.k_type = KvType::F32;
    c.v_type = KvType::F32;
    c.page_tokens = 4;
    c.prefill_chunk = 8;
    c.arena_bytes = 4 << 20;
    c
}

fn images<B: ModelBackend>(e: &mut Engine<B>) -> Vec<ImageInput> {
    ["img_a.png", "img_b.png"]
        .iter()
        .map(|n| {
            let bytes = std::fs::read(vl_dir().join(n)).expect("image file");
            e.preprocess_image(&bytes).expect("preprocess")
        })
        .collect()
}

/// Last-row logits of the 2-image prompt, greedy tokens after it, and per-image arena levels.
fn run<B: ModelBackend>(b: B) -> (Vec<f32>, Vec<u32>, Vec<(usize, usize)>) {
    let ids = oracle_ids();
    let mut e = Engine::load(b, config(&vl_dir())).expect("load");
    let imgs = images(&mut e);
    let last = e.start_session_multimodal(&ids, &imgs).expect("session");
    let mut req = GenerateRequest::new(Prompt::Tokens(ids), 8);
    req.stop_at_eos = false;
    let gen = e
        .generate_multimodal(&req, &imgs, |_| kvstream_runtime::Flow::Continue)
        .expect("generate");
    let levels = e
        .vision_stats()
        .loans
        .iter()
        .map(|l| (l.arena_used_text, l.arena_used_after))
        .collect();
    (last, gen.tokens, levels)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn multimodal_engine_on_cuda_matches_cpu() {
    let (cl, ct, clev) = run(CpuBackend::new());
    let (gl, gt, glev) = run(gpu());
    close_rel("multimodal last-row logits", &gl, &cl, 1e-2);
    assert_eq!(gt, ct, "greedy tokens differ (cuda vs cpu)");
    assert_eq!(glev.len(), 2);
    for (text, after) in glev.iter().chain(&clev) {
        assert_eq!(
            text, after,
            "arena use after an image is not the text-only level"
        );
    }
}
