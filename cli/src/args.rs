//! Flags shared by several commands (llama.cpp vocabulary where it applies).

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use kvstream_memory_contracts::kv::format::KvType;
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
    /// Write stats as JSON to this file.
    #[arg(long)]
    pub stats_json: Option<PathBuf>,
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
    fn token_lists_parse_and_reject_garbage() {
        assert_eq!(parse_token_list("1, 2,3").ok(), Some(vec![1, 2, 3]));
        assert!(parse_token_list("1,x").is_err());
        assert!(parse_token_list("-1").is_err());
    }
}
