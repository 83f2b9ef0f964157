//! `kvstream synth`: random-weight checkpoints in the real Qwen3.5/3.8 naming and layout.
//!
//! We cannot download real weights, so loader tests, CPU runs and benchmarks use checkpoints
//! with the real geometry and random values. The output is a Hugging Face model directory:
//! `config.json` (wrapper form, `Qwen3_5ForConditionalGeneration`), and safetensors shards with a
//! `model.safetensors.index.json` when more than one shard is written. Tensors are produced
//! shard by shard, so host memory never holds more than one shard.

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

/// The shape of a Qwen3.5-family text model (+ MTP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub name: &'static str,
    pub hidden: usize,
    pub layers: usize,
    pub full_attention_interval: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub linear_k_heads: usize,
    pub linear_v_heads: usize,
    pub linear_k_dim: usize,
    pub linear_v_dim: usize,
    pub conv_kernel: usize,
    pub mtp_layers: usize,
    pub tie_embeddings: bool,
    pub max_positions: usize,
    pub mrope_section: [usize; 3],
}

impl Geometry {
    /// The named presets.
    pub fn preset(name: &str) -> Result<Self> {
        let g = match name {
            "qwen3.8-27b" => Geometry {
                name: "qwen3.8-27b",
                hidden: 5120,
                layers: 64,
                full_attention_interval: 4,
                intermediate: 17408,
                vocab: 248_320,
                heads: 24,
                kv_heads: 4,
                head_dim: 256,
                linear_k_heads: 16,
                linear_v_heads: 48,
                linear_k_dim: 128,
                linear_v_dim: 128,
                conv_kernel: 4,
                mtp_layers: 1,
                tie_embeddings: false,
                max_positions: 262_144,
                mrope_section: [11, 11, 10],
            },
            // ~0.5 B parameters: the CPU benchmark model.
            "small-0.5b" => Geometry {
                name: "small-0.5b",
                hidden: 1024,
                layers: 24,
                full_attention_interval: 4,
                intermediate: 3584,
                vocab: 32_768,
                heads: 8,
                kv_heads: 2,
                head_dim: 128,
                linear_k_heads: 8,
                linear_v_heads: 16,
                linear_k_dim: 64,
                linear_v_dim: 64,
                conv_kernel: 4,
                mtp_layers: 1,
                tie_embeddings: false,
                max_positions: 262_144,
                mrope_section: [6, 5, 5],
            },
            "tiny" => Geometry {
                name: "tiny",
                hidden: 128,
                layers: 4,
                full_attention_interval: 4,
                intermediate: 256,
                vocab: 512,
                heads: 6,
                kv_heads: 1,
                head_dim: 64,
                linear_k_heads: 2,
                linear_v_heads: 6,
                linear_k_dim: 32,
                linear_v_dim: 32,
                conv_kernel: 4,
                mtp_layers: 1,
                tie_embeddings: false,
                max_positions: 32_768,
                mrope_section: [3, 3, 2],
            },
            other => {
                bail!("unknown geometry `{other}`: expected one of qwen3.8-27b, small-0.5b, tiny")
            }
        };
        Ok(g)
    }

    fn is_full(&self, i: usize) -> bool {
        (i + 1) % self.full_attention_interval == 0
    }

    /// `config.json` in the wrapper form.
    pub fn config_json(&self, dtype: &str) -> serde_json::Value {
        let layer_types: Vec<&str> = (0..self.layers)
            .map(|i| {
                if self.is_full(i) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        json!({
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5",
            "tie_word_embeddings": self.tie_embeddings,
            "eos_token_id": [self.vocab - 1],
            "text_config": {
                "model_type": "qwen3_5_text",
                "hidden_size": self.hidden,
                "num_hidden_layers": self.layers,
                "layer_types": layer_types,
                "full_attention_interval": self.full_attention_interval,
                "intermediate_size": self.intermediate,
                "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads,
                "head_dim": self.head_dim,
                "attn_output_gate": true,
                "linear_num_key_heads": self.linear_k_heads,
                "linear_num_value_heads": self.linear_v_heads,
                "linear_key_head_dim": self.linear_k_dim,
                "linear_value_head_dim": self.linear_v_dim,
                "linear_conv_kernel_dim": self.conv_kernel,
                "hidden_act": "silu",
                "output_gate_type": "swish",
                "rms_norm_eps": 1e-6,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10_000_000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": self.mrope_section,
                    "mrope_interleaved": true
                },
                "partial_rotary_factor": 0.25,
                "max_position_embeddings": self.max_positions,
                "vocab_size": self.vocab,
                "tie_word_embeddings": self.tie_embeddings,
                "mtp_num_hidden_layers": self.mtp_layers,
                "mtp_use_dedicated_embeddings": false,
                "attention_bias": false,
                "eos_token_id": self.vocab - 1,
                "dtype": dtype
            }
        })
    }

    /// Every tensor (name, shape, kind) in checkpoint order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>, Init)> {
        let h = self.hidden;
        let mut v = Vec::new();
        let lm = "model.language_model";
        v.push((
            format!("{lm}.embed_tokens.weight"),
            vec![self.vocab, h],
            Init::Matrix,
        ));
        v.push((format!("{lm}.norm.weight"), vec![h], Init::Norm));
        if !self.tie_embeddings {
            v.push(("lm_head.weight".into(), vec![self.vocab, h], Init::Matrix));
        }
        for i in 0..self.layers {
            let p = format!("{lm}.layers.{i}");
            self.push_common(&mut v, &p);
            if self.is_full(i) {
                self.push_attention(&mut v, &format!("{p}.self_attn"));
            } else {
                let p = format!("{p}.linear_attn");
                let kd = self.linear_k_heads * self.linear_k_dim;
                let vd = self.linear_v_heads * self.linear_v_dim;
                let conv = 2 * kd + vd;
                v.push((
                    format!("{p}.in_proj_qkv.weight"),
                    vec![conv, h],
                    Init::Matrix,
                ));
                v.push((format!("{p}.in_proj_z.weight"), vec![vd, h], Init::Matrix));
                v.push((
                    format!("{p}.in_proj_b.weight"),
                    vec![self.linear_v_heads, h],
                    Init::Matrix,
                ));
                v.push((
                    format!("{p}.in_proj_a.weight"),
                    vec![self.linear_v_heads, h],
                    Init::Matrix,
                ));
                v.push((
                    format!("{p}.conv1d.weight"),
                    vec![conv, 1, self.conv_kernel],
                    Init::Conv,
                ));
                v.push((
                    format!("{p}.dt_bias"),
                    vec![self.linear_v_heads],
                    Init::DtBias,
                ));
                v.push((format!("{p}.A_log"), vec![self.linear_v_heads], Init::ALog));
                v.push((
                    format!("{p}.norm.weight"),
                    vec![self.linear_v_dim],
                    Init::GatedNorm,
                ));
                v.push((format!("{p}.out_proj.weight"), vec![h, vd], Init::Matrix));
            }
        }
        for m in 0..self.mtp_layers {
            if m == 0 {
                v.push(("mtp.fc.weight".into(), vec![h, 2 * h], Init::Matrix));
                v.push((
                    "mtp.pre_fc_norm_embedding.weight".into(),
                    vec![h],
                    Init::Norm,
                ));
                v.push(("mtp.pre_fc_norm_hidden.weight".into(), vec![h], Init::Norm));
                v.push(("mtp.norm.weight".into(), vec![h], Init::Norm));
            }
            let p = format!("mtp.layers.{m}");
            self.push_common(&mut v, &p);
            self.push_attention(&mut v, &format!("{p}.self_attn"));
        }
        v
    }

    fn push_common(&self, v: &mut Vec<(String, Vec<usize>, Init)>, p: &str) {
        let (h, f) = (self.hidden, self.intermediate);
        v.push((format!("{p}.input_layernorm.weight"), vec![h], Init::Norm));
        v.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Init::Norm,
        ));
        v.push((
            format!("{p}.mlp.gate_proj.weight"),
            vec![f, h],
            Init::Matrix,
        ));
        v.push((format!("{p}.mlp.up_proj.weight"), vec![f, h], Init::Matrix));
        v.push((
            format!("{p}.mlp.down_proj.weight"),
            vec![h, f],
            Init::Matrix,
        ));
    }

    fn push_attention(&self, v: &mut Vec<(String, Vec<usize>, Init)>, p: &str) {
        let h = self.hidden;
        let q = self.heads * self.head_dim;
        let kv = self.kv_heads * self.head_dim;
        v.push((format!("{p}.q_proj.weight"), vec![2 * q, h], Init::Matrix));
        v.push((format!("{p}.k_proj.weight"), vec![kv, h], Init::Matrix));
        v.push((format!("{p}.v_proj.weight"), vec![kv, h], Init::Matrix));
        v.push((format!("{p}.o_proj.weight"), vec![h, q], Init::Matrix));
        v.push((
            format!("{p}.q_norm.weight"),
            vec![self.head_dim],
            Init::Norm,
        ));
        v.push((
            format!("{p}.k_norm.weight"),
            vec![self.head_dim],
            Init::Norm,
        ));
    }

    /// Parameter count.
    pub fn parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s, _)| s.iter().product::<usize>() as u64)
            .sum()
    }
}

/// How a tensor is initialised (uniform noise with the right centre and spread).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Init {
    /// Linear weights: U(-a, a) with std 0.02.
    Matrix,
    /// Zero-centred RMSNorm weights: around 0.
    Norm,
    /// GDN gated norm weight: around 1.
    GatedNorm,
    /// Depthwise conv taps.
    Conv,
    /// `dt_bias`: around 1.
    DtBias,
    /// `A_log = ln U(1, 16)`.
    ALog,
}

fn fill(init: Init, out: &mut [f32], seed: u64) {
    const CHUNK: usize = 1 << 16;
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(i, c)| {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(
            seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
        );
        for x in c.iter_mut() {
            let u: f32 = rng.random_range(-1.0..1.0);
            *x = match init {
                Init::Matrix => u * 0.0346, // std 0.02
                Init::Norm => u * 0.17,     // std ~0.1
                Init::GatedNorm => 1.0 + u * 0.17,
                Init::Conv => u * 0.3,
                Init::DtBias => 1.0 + u * 0.5,
                Init::ALog => rng.random_range(1.0f32..16.0).ln(),
            };
        }
    });
}

/// The [`QwenConfig`] of the preset `name` (what `config.json` of `kvstream synth` parses to).
pub fn preset_config(name: &str) -> Result<kvstream_model_qwen::QwenConfig> {
    let geo = Geometry::preset(name)?;
    let json = geo.config_json("bfloat16").to_string();
    Ok(kvstream_model_qwen::QwenConfig::from_json_str(
        &json,
        Path::new(&format!("synthetic:{name}")),
    )?)
}

/// Writes only `config.json` of `geometry` into `out` (created if needed): enough for
/// `kvstream inspect --model` to plan memory without the weights.
pub fn write_config_only(geometry: &Geometry, dtype: SynthDType, out: &Path) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let cfg = geometry.config_json(dtype.hf_name());
    let path = out.join("config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&cfg)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Stored dtype of a synthetic checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthDType {
    F32,
    F16,
    Bf16,
}

impl SynthDType {
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "f32" | "float32" => Self::F32,
            "f16" | "float16" => Self::F16,
            "bf16" | "bfloat16" => Self::Bf16,
            o => bail!("unknown --dtype `{o}`: expected bf16, f16 or f32"),
        })
    }
    fn size(self) -> usize {
        if self == Self::F32 {
            4
        } else {
            2
        }
    }
    fn st(self) -> Dtype {
        match self {
            Self::F32 => Dtype::F32,
            Self::F16 => Dtype::F16,
            Self::Bf16 => Dtype::BF16,
        }
    }
    fn hf_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::F16 => "float16",
            Self::Bf16 => "bfloat16",
        }
    }
    fn encode(self, x: &[f32]) -> Vec<u8> {
        match self {
            Self::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Self::F16 => x
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            Self::Bf16 => x
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }
}

/// Writes a random checkpoint of `geometry` to `out`. Shards hold at most `shard_bytes`.
pub fn write_checkpoint(
    geometry: &Geometry,
    dtype: SynthDType,
    out: &Path,
    seed: u64,
    shard_bytes: usize,
) -> Result<()> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let tensors = geometry.tensors();
    // Plan shards.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut acc = 0usize;
    for (i, (_, shape, _)) in tensors.iter().enumerate() {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        if acc > 0 && acc + bytes > shard_bytes {
            shards.push(Vec::new());
            acc = 0;
        }
        acc += bytes;
        if let Some(last) = shards.last_mut() {
            last.push(i);
        }
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (si, members) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n)
        };
        let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for &ti in members {
            let (name, shape, init) = &tensors[ti];
            let mut vals = vec![0f32; shape.iter().product()];
            fill(*init, &mut vals, seed.wrapping_add(ti as u64 * 7919));
            let bytes = dtype.encode(&vals);
            total += bytes.len();
            weight_map.insert(name.clone(), file.clone());
            blobs.push((name.clone(), shape.clone(), bytes));
        }
        let views = blobs
            .iter()
            .map(|(n, s, b)| Ok((n.clone(), TensorView::new(dtype.st(), s.clone(), b)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(meta), &out.join(&file))
            .with_context(|| format!("writing {file}"))?;
        tracing::info!(shard = si + 1, of = n, file, "wrote shard");
    }
    if n > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        std::fs::write(
            out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    write_config_only(geometry, dtype, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen38_27b_parameter_count_matches_spec() {
        // qwen-spec §7: text model 26,895,998,464 + MTP 424,699,392.
        let g = Geometry::preset("qwen3.8-27b").expect("preset");
        assert_eq!(g.parameters(), 26_895_998_464 + 424_699_392);
        assert_eq!((0..64).filter(|&i| g.is_full(i)).count(), 16);
    }

    #[test]
    fn config_only_writes_just_a_parseable_config() {
        let g = Geometry::preset("qwen3.8-27b").expect("preset");
        let dir = std::env::temp_dir().join(format!("kvstream-cfgonly-{}", std::process::id()));
        write_config_only(&g, SynthDType::Bf16, &dir).expect("write");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .expect("dir")
            .filter_map(|e| e.ok().map(|e| e.file_name()))
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("config.json")]);
        let c = kvstream_model_qwen::QwenConfig::from_model_dir(&dir).expect("config");
        let mut want = preset_config("qwen3.8-27b").expect("preset");
        want.path = c.path.clone();
        assert_eq!(c, want);
        assert_eq!((c.hidden_size, c.n_attention_layers()), (5120, 16));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn sharded_tiny_checkpoint_round_trips() {
        let g = Geometry::preset("tiny").expect("preset");
        let dir = std::env::temp_dir().join(format!("kvstream-synth-{}", std::process::id()));
        write_checkpoint(&g, SynthDType::Bf16, &dir, 7, 512 * 1024).expect("write");
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("model.safetensors.index.json")).expect("index"),
        )
        .expect("json");
        let map = index["weight_map"].as_object().expect("map");
        assert_eq!(map.len(), g.tensors().len());
        let shard = map["lm_head.weight"].as_str().expect("file");
        let bytes = std::fs::read(dir.join(shard)).expect("shard");
        let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
        let t = st.tensor("lm_head.weight").expect("tensor");
        assert_eq!(t.shape(), &[512, 128]);
        assert_eq!(t.dtype(), Dtype::BF16);
        let nonzero = t.data().chunks(2).filter(|c| c != &[0, 0]).count();
        assert!(nonzero > 512 * 128 * 9 / 10);
        assert!(Geometry::preset("nope").is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
