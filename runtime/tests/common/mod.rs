//! Shared helpers of the fixture tests (included with `mod common;`).
#![allow(dead_code)]

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::ops::{Position3, TensorOps};
use kvstream_model_qwen::{
    AttentionPhase, LoadOptions, LogitRows, QwenConfig, QwenModel, ResidentKv, ResidentKvOptions,
};
use kvstream_runtime::EngineConfig;
use std::path::PathBuf;

pub const FIXTURES: [&str; 3] = ["tiny-gqa-f32", "tiny-mha-tied-bf16", "tiny-bare-text"];

pub fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

/// An i64 tensor of the fixture's oracle as u32 ids.
pub fn oracle_ids(name: &str, key: &str) -> Vec<u32> {
    let bytes = std::fs::read(dir(name).join("oracle.safetensors")).expect("oracle file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
    let t = st.tensor(key).expect("tensor in oracle");
    t.data()
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            i64::from_le_bytes(a) as u32
        })
        .collect()
}

pub fn attention_layers(name: &str) -> usize {
    QwenConfig::from_model_dir(&dir(name))
        .expect("config")
        .n_attention_layers()
}

/// A configuration whose pool is one resident page per layer plus a 3-slot ring: almost every
/// page goes through the ring, in several waves that wrap around the ring.
pub fn tiny_arena(name: &str, k: KvType, v: KvType, page: usize, chunk: usize) -> EngineConfig {
    let mut c = EngineConfig::new(dir(name));
    c.ctx_size = 512;
    c.k_type = k;
    c.v_type = v;
    c.page_tokens = page;
    c.prefill_chunk = chunk;
    c.arena_bytes = 8 << 20;
    c.min_ring_slots = 3;
    c.min_resident_pages = 1;
    c.max_pool_pages = Some(attention_layers(name) + 3);
    c
}

/// A configuration where everything is resident.
pub fn big_arena(name: &str, k: KvType, v: KvType, page: usize, chunk: usize) -> EngineConfig {
    let mut c = tiny_arena(name, k, v, page, chunk);
    c.arena_bytes = 64 << 20;
    c.min_ring_slots = 1;
    c.max_pool_pages = None;
    c
}

fn positions(p0: usize, n: usize) -> Vec<Position3> {
    (p0..p0 + n)
        .map(|p| {
            let p = p as u32;
            [p, p, p]
        })
        .collect()
}

/// The all-resident reference (model-qwen's `ResidentKv`), same chunking as the engine.
pub struct Reference {
    pub b: CpuBackend,
    pub model: QwenModel<CpuBackend>,
    pub cfg: QwenConfig,
    pub opts: ResidentKvOptions,
}

impl Reference {
    pub fn new(name: &str, k: KvType, v: KvType, page: usize) -> Self {
        let b = CpuBackend::new();
        let cfg = QwenConfig::from_model_dir(&dir(name)).expect("config");
        let model = QwenModel::load(&b, &dir(name), &LoadOptions::default()).expect("model");
        Self {
            b,
            model,
            cfg,
            opts: ResidentKvOptions {
                k_type: k,
                v_type: v,
                tokens_per_page: page,
            },
        }
    }

    fn kv(&self) -> ResidentKv<CpuBackend> {
        ResidentKv::new(&self.cfg, self.cfg.n_attention_layers(), self.opts).expect("kv")
    }

    /// Logits of every token, prefilled in `chunk`-token steps.
    pub fn logits(&self, tokens: &[u32], chunk: usize) -> Vec<f32> {
        let mut kv = self.kv();
        let mut st = self.model.new_recurrent_state(&self.b).expect("state");
        let mut out = Vec::new();
        let mut p0 = 0;
        for c in tokens.chunks(chunk) {
            let o = self
                .model
                .forward(
                    &self.b,
                    c,
                    &positions(p0, c.len()),
                    AttentionPhase::Prefill,
                    &mut st,
                    &mut kv,
                    LogitRows::All,
                    None,
                )
                .expect("forward");
            out.extend(
                self.b
                    .tensor_to_f32(&o.logits.expect("logits"))
                    .expect("read"),
            );
            p0 += c.len();
        }
        out
    }

    /// Greedy generation of `n` tokens after a chunked prefill.
    pub fn greedy(&self, prompt: &[u32], chunk: usize, n: usize) -> Vec<u32> {
        let mut kv = self.kv();
        let mut st = self.model.new_recurrent_state(&self.b).expect("state");
        let mut p0 = 0;
        let mut last = Vec::new();
        for c in prompt.chunks(chunk) {
            let o = self
                .model
                .forward(
                    &self.b,
                    c,
                    &positions(p0, c.len()),
                    AttentionPhase::Prefill,
                    &mut st,
                    &mut kv,
                    LogitRows::Last,
                    None,
                )
                .expect("forward");
            last = self
                .b
                .tensor_to_f32(&o.logits.expect("logits"))
                .expect("read");
            p0 += c.len();
        }
        let mut out = Vec::new();
        for _ in 0..n {
            let tok = kvstream_runtime::sampling::argmax(&last).expect("row") as u32;
            out.push(tok);
            if out.len() == n {
                break;
            }
            let o = self
                .model
                .forward(
                    &self.b,
                    &[tok],
                    &positions(p0, 1),
                    AttentionPhase::Decode,
                    &mut st,
                    &mut kv,
                    LogitRows::Last,
                    None,
                )
                .expect("forward");
            last = self
                .b
                .tensor_to_f32(&o.logits.expect("logits"))
                .expect("read");
            p0 += 1;
        }
        out
    }
}

/// True if two f32 slices are bitwise equal; otherwise prints the first difference.
pub fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    if a.len() != b.len() {
        eprintln!("length {} vs {}", a.len(), b.len());
        return false;
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        if x.to_bits() != y.to_bits() {
            eprintln!("first difference at {i}: {x} vs {y}");
            return false;
        }
    }
    true
}
