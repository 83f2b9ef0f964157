//! Flags shared by several commands (llama.cpp vocabulary where it applies).

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_model_qwen::WeightPolicy;
use kvstream_runtime::engine::EngineConfig;
use std::path::PathBuf;

/// Which backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// The CPU reference backend (always built).
    Cpu,
    /// NVIDIA GPUs through CUDA (build with `--features cuda`).
    Cuda,
    /// The wgpu stub (build with `--features wgpu`): reports what it cannot do.
    Wgpu,
}

/// Model, memory and backend flags.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Context size in tokens (host KV history capacity); default: min(model limit, 4096).
    #[arg(long, short = 'c')]
    pub ctx_size: Option<usize>,
    /// K cache type: f32, f16, bf16, q8_0, q4_0.
    #[arg(long, default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type: f32, f16, bf16, q8_0, q4_0.
    #[arg(long, default_value = "f16")]
    pub cache_type_v: String,
    /// Device KV arena size (e.g. 2240MiB, 96KiB, 1GiB, or bytes).
    #[arg(long)]
    pub kv_arena: Option<String>,
    /// Device KV arena size in MiB (alias of --kv-arena).
    #[arg(long, conflicts_with = "kv_arena")]
    pub kv_stream_arena_mib: Option<u64>,
    /// Tokens per KV page (power of two).
    #[arg(long, default_value_t = 256)]
    pub kv_page_tokens: usize,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Speculative decoding: `draft-mtp` uses the model's MTP (NextN) head.
    #[arg(long, value_parser = ["none", "draft-mtp"], default_value = "none")]
    pub spec_type: String,
    /// Drafts per verification with --spec-type draft-mtp (1..=4).
    #[arg(long, default_value_t = 3)]
    pub spec_draft_n_max: usize,
    /// Cap the KV pool at this many pages (forces streaming; for sweeps and demos).
    #[arg(long)]
    pub kv_max_pool_pages: Option<usize>,
    /// Smallest ring (streaming slots shared by all layers); a deeper ring keeps the copy engine
    /// busy while layers without streamed pages compute, at the cost of more pages streamed.
    #[arg(long, default_value_t = 1)]
    pub kv_min_ring_slots: usize,
    /// Ring depth the placement policy aims for while layers stream (capped at an eighth of the
    /// pool; 0 disables). Deeper keeps PCIe busy between streamed layers.
    #[arg(long, default_value = "128MiB")]
    pub kv_stream_ring: String,
    /// Write stats as JSON to this file.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
    #[command(flatten)]
    pub weights: WeightArgs,
}

/// The accepted `--weights` / `--weights-head` values (in error messages and help).
pub const WEIGHT_FORMATS: &str =
    "bf16, f16, f32, q8_0, q4_g128 (q4), q4_nl_g128 (q4_nl), fp8_e4m3 (fp8)";

/// Parses a weight format name (`q4`, `q4_nl` and `fp8` are aliases of `q4_g128`, `q4_nl_g128`
/// and `fp8_e4m3`).
pub fn parse_weight_format(s: &str) -> std::result::Result<WeightDType, String> {
    let t = s.trim().to_ascii_lowercase();
    let alias = match t.as_str() {
        "bfloat16" => "bf16",
        "float16" => "f16",
        "float32" => "f32",
        other => other,
    };
    WeightDType::parse(alias)
        .ok_or_else(|| format!("unknown weight format `{s}`: expected one of {WEIGHT_FORMATS}"))
}

/// Device formats of the weights (`--weights`, `--weights-head`).
#[derive(Debug, Clone, Default, Args)]
pub struct WeightArgs {
    /// Device format of the decoder-layer linear weights: bf16, f16, f32, q8_0, q4_g128 (q4),
    /// q4_nl_g128 (q4_nl), fp8_e4m3 (fp8). Quantized formats are converted at load time (or loaded as saved by
    /// `kvstream quantize`). Default: as stored.
    #[arg(long, value_parser = parse_weight_format)]
    pub weights: Option<WeightDType>,
    /// Device format of lm_head and the MTP head (default: q8_0 with a 4-bit --weights,
    /// otherwise as stored).
    #[arg(long, value_parser = parse_weight_format)]
    pub weights_head: Option<WeightDType>,
}

impl WeightArgs {
    /// The policy these flags describe.
    pub fn policy(&self) -> WeightPolicy {
        WeightPolicy {
            format: self.weights,
            head_format: self.weights_head,
        }
    }
}

/// Human form of a policy: `q4_g128 (head q8_0)`, `as stored`.
pub fn describe_policy(p: &WeightPolicy) -> String {
    let name = |f: Option<WeightDType>| f.map_or("as stored", |d| d.name());
    match (p.format, p.effective_head()) {
        (None, None) => "as stored".into(),
        (f, h) if f == h => name(f).into(),
        (f, h) => format!("{} (head {})", name(f), name(h)),
    }
}

fn kv_type(s: &str, flag: &str) -> Result<KvType> {
    s.parse::<KvType>()
        .with_context(|| format!("{flag} `{s}`: expected one of f32, f16, bf16, q8_0, q4_0"))
}

impl EngineArgs {
    /// The engine configuration these flags describe.
    pub fn engine_config(&self) -> Result<EngineConfig> {
        let mut cfg = EngineConfig::new(&self.model);
        if let Some(c) = self.ctx_size {
            if c == 0 {
                bail!("--ctx-size must be > 0");
            }
            cfg.ctx_size = c;
        } else if let Ok(mc) = kvstream_model_qwen::QwenConfig::from_model_dir(&self.model) {
            cfg.ctx_size = mc.max_position_embeddings.min(4096);
        }
        cfg.k_type = kv_type(&self.cache_type_k, "--cache-type-k")?;
        cfg.v_type = kv_type(&self.cache_type_v, "--cache-type-v")?;
        if let Some(s) = &self.kv_arena {
            cfg.arena_bytes = kvstream_runtime::size::parse_size(s)
                .with_context(|| format!("--kv-arena `{s}`"))?;
        } else if let Some(m) = self.kv_stream_arena_mib {
            cfg.arena_bytes = m << 20;
        }
        if !self.kv_page_tokens.is_power_of_two() {
            bail!(
                "--kv-page-tokens {} must be a power of two (e.g. 16, 64, 256)",
                self.kv_page_tokens
            );
        }
        cfg.page_tokens = self.kv_page_tokens;
        if self.prefill_chunk == 0 {
            bail!("--prefill-chunk must be > 0");
        }
        cfg.prefill_chunk = self.prefill_chunk;
        cfg.max_pool_pages = self.kv_max_pool_pages;
        cfg.min_ring_slots = self.kv_min_ring_slots.max(1);
        cfg.stream_ring_bytes = kvstream_runtime::size::parse_size(&self.kv_stream_ring)
            .with_context(|| format!("--kv-stream-ring `{}`", self.kv_stream_ring))?;
        cfg.weights = self.weights.policy();
        if self.spec_type == "draft-mtp" {
            cfg.spec = Some(kvstream_runtime::speculative::SpecConfig {
                draft_n_max: self.spec_draft_n_max,
            });
        }
        Ok(cfg)
    }
}

/// Parses `1,2,3` into token ids.
pub fn parse_token_list(s: &str) -> Result<Vec<u32>> {
    s.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|p| !p.is_empty())
        .map(|p| {
            p.parse::<u32>()
                .with_context(|| format!("token id `{p}` is not a non-negative integer"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_formats_parse_with_aliases_and_bad_ones_name_the_choices() {
        for (s, want) in [
            ("bf16", WeightDType::Bf16),
            ("q8_0", WeightDType::Q8_0),
            ("q4_g128", WeightDType::Q4G128),
            ("q4", WeightDType::Q4G128),
            ("fp8_e4m3", WeightDType::F8E4M3),
            ("FP8", WeightDType::F8E4M3),
            ("q4_nl_g128", WeightDType::Q4NlG128),
            ("q4_nl", WeightDType::Q4NlG128),
        ] {
            assert_eq!(parse_weight_format(s), Ok(want), "{s}");
        }
        let e = parse_weight_format("q3_k").expect_err("q3_k");
        assert!(e.contains("q3_k") && e.contains("q4_g128") && e.contains("fp8_e4m3"));
        let p = WeightArgs {
            weights: Some(WeightDType::Q4G128),
            weights_head: None,
        };
        assert_eq!(describe_policy(&p.policy()), "q4_g128 (head q8_0)");
        let nl = WeightArgs {
            weights: Some(WeightDType::Q4NlG128),
            weights_head: None,
        };
        assert_eq!(describe_policy(&nl.policy()), "q4_nl_g128 (head q8_0)");
        assert!(e.contains("q4_nl_g128"));
        assert_eq!(
            describe_policy(&WeightArgs::default().policy()),
            "as stored"
        );
        let both = WeightArgs {
            weights: Some(WeightDType::Q8_0),
            weights_head: Some(WeightDType::Q8_0),
        };
        assert_eq!(describe_policy(&both.policy()), "q8_0");
    }

    #[test]
    fn token_lists_parse_and_reject_garbage() {
        assert_eq!(parse_token_list("1, 2,3").ok(), Some(vec![1, 2, 3]));
        assert!(parse_token_list("1,x").is_err());
        assert!(parse_token_list("-1").is_err());
    }
}
