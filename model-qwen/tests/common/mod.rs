//! Shared helpers of the quantized-weight tests: model dirs, oracle reading, forwards.
#![allow(dead_code)]

use kvstream_backend_cpu::CpuBackend;
use kvstream_memory_contracts::ops::{Position3, TensorOps};
use kvstream_model_qwen::{
    AttentionPhase, LoadOptions, LogitRows, QwenModel, ResidentKv, ResidentKvOptions, WeightPolicy,
};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

/// `fixtures/NAME` or `models/NAME` under the workspace root.
pub fn dir(name: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let f = root.join("fixtures").join(name);
    if f.exists() {
        f
    } else {
        root.join("models").join(name)
    }
}

/// A fresh temporary directory.
pub fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvq-quant-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

/// An oracle.safetensors reader.
pub struct Oracle {
    bytes: Vec<u8>,
}

impl Oracle {
    pub fn open(name: &str) -> Self {
        let bytes = std::fs::read(dir(name).join("oracle.safetensors")).expect("oracle file");
        Self { bytes }
    }
    pub fn f32(&self, key: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle tensor");
        assert_eq!(t.dtype(), Dtype::F32);
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    pub fn ids(&self, key: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle ids");
        assert_eq!(t.dtype(), Dtype::I64);
        t.data()
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                u32::try_from(i64::from_le_bytes(a)).expect("id fits u32")
            })
            .collect()
    }
}

pub fn pos(range: std::ops::Range<usize>) -> Vec<Position3> {
    range.map(|p| [p as u32; 3]).collect()
}

pub fn load(b: &CpuBackend, name: &str, weights: WeightPolicy) -> QwenModel<CpuBackend> {
    QwenModel::load(
        b,
        &dir(name),
        &LoadOptions {
            load_mtp: true,
            weights,
            ..LoadOptions::default()
        },
    )
    .expect("load")
}

fn kv(m: &QwenModel<CpuBackend>) -> ResidentKv<CpuBackend> {
    let c = m.config();
    ResidentKv::new(c, c.n_attention_layers() + 1, ResidentKvOptions::default()).expect("kv")
}

/// Logits `[T, V]` of one prefill over `ids`.
pub fn logits_all(b: &CpuBackend, m: &QwenModel<CpuBackend>, ids: &[u32]) -> Vec<f32> {
    let mut st = m.new_recurrent_state(b).expect("state");
    let mut kv = kv(m);
    let out = m
        .forward(
            b,
            ids,
            &pos(0..ids.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::All,
            None,
        )
        .expect("forward");
    b.tensor_to_f32(&out.logits.expect("logits")).expect("dl")
}

/// `prompt` + `n` greedy tokens (prefill, then recurrent decode).
pub fn greedy(b: &CpuBackend, m: &QwenModel<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut st = m.new_recurrent_state(b).expect("state");
    let mut kv = kv(m);
    let mut seq = prompt.to_vec();
    let mut o = m
        .forward(
            b,
            prompt,
            &pos(0..prompt.len()),
            AttentionPhase::Prefill,
            &mut st,
            &mut kv,
            LogitRows::Last,
            None,
        )
        .expect("prefill");
    for _ in 0..n {
        let l = b.tensor_to_f32(&o.logits.expect("logits")).expect("dl");
        let next = argmax(&l);
        seq.push(next);
        let p = seq.len() - 1;
        o = m
            .forward(
                b,
                &[next],
                &pos(p..p + 1),
                AttentionPhase::Decode,
                &mut st,
                &mut kv,
                LogitRows::Last,
                None,
            )
            .expect("decode");
    }
    seq
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Mean over rows of KL(p ‖ q), p = softmax(reference row), q = softmax(test row).
pub fn mean_kl(reference: &[f32], test: &[f32], v: usize) -> f64 {
    let rows = reference.len() / v;
    let log_softmax = |x: &[f32]| -> Vec<f64> {
        let m = x.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
        let s: f64 = x.iter().map(|y| (*y as f64 - m).exp()).sum();
        x.iter().map(|y| *y as f64 - m - s.ln()).collect()
    };
    let mut total = 0.0;
    for r in 0..rows {
        let lp = log_softmax(&reference[r * v..(r + 1) * v]);
        let lq = log_softmax(&test[r * v..(r + 1) * v]);
        total += lp
            .iter()
            .zip(&lq)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
    }
    total / rows as f64
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|f| f.to_bits()).collect()
}
