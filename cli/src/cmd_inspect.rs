//! `kvstream inspect`: what a backend can do, and what a model needs.

use crate::args::{BackendKind, EngineArgs};
use crate::backend_select::{capabilities, dispatch, model_support, OnBackend};
use anyhow::Result;
use clap::Args;
use kvstream_memory_contracts::kv::geometry::{KvFootprint, PageGeometry};
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_memory_contracts::report::render_capability_table;
use kvstream_model_qwen::QwenConfig;
use kvstream_runtime::engine::check_admission;
use std::path::PathBuf;

/// Flags of `inspect`.
#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// Backend whose capabilities to list.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Model directory: also print its geometry, KV footprint and the arena plan per phase.
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Memory flags for the arena plan (used with --model).
    #[arg(long, default_value = "f16")]
    pub cache_type_k: String,
    #[arg(long, default_value = "f16")]
    pub cache_type_v: String,
    #[arg(long)]
    pub kv_arena: Option<String>,
    #[arg(long)]
    pub ctx_size: Option<usize>,
    #[arg(long, default_value_t = 256)]
    pub kv_page_tokens: usize,
}

struct Plan(EngineArgs);

impl OnBackend for Plan {
    type Output = ();
    fn run<B: ModelBackend>(self, backend: B) -> Result<()> {
        let cfg = self.0.engine_config()?;
        let layouts = check_admission(&backend, &cfg)?;
        println!(
            "\narena plan: {} bytes arena, ctx {} tokens, K {} / V {}, {}-token pages",
            cfg.arena_bytes, cfg.ctx_size, cfg.k_type, cfg.v_type, cfg.page_tokens
        );
        println!(
            "{:<14} {:>14} {:>10} {:>14} {:>14} {:>14}",
            "phase", "pool bytes", "pages", "workspace", "scratch", "required"
        );
        for l in layouts {
            println!(
                "{:<14} {:>14} {:>10} {:>14} {:>14} {:>14}",
                format!("{:?}", l.phase),
                l.pool_bytes,
                l.pool_pages,
                l.workspace_bytes,
                l.scratch_bytes,
                l.required_bytes
            );
        }
        Ok(())
    }
}

/// Runs `inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    let caps = capabilities(args.backend, args.device)?;
    println!("{}", render_capability_table(&caps));
    model_support(args.backend, &caps)?;
    let Some(dir) = &args.model else {
        return Ok(());
    };
    let cfg = QwenConfig::from_model_dir(dir)?;
    let kt = args.cache_type_k.parse()?;
    let vt = args.cache_type_v.parse()?;
    let geometry = PageGeometry::new(
        args.kv_page_tokens,
        cfg.num_key_value_heads,
        cfg.head_dim,
        kt,
        vt,
    )?;
    let fp = KvFootprint {
        geometry,
        layers: cfg.n_attention_layers(),
    };
    println!("model: {}", dir.display());
    println!(
        "  hidden {}, {} layers ({} full attention), vocab {}, heads {}/{} x {}, max positions {}",
        cfg.hidden_size,
        cfg.layer_types.len(),
        cfg.n_attention_layers(),
        cfg.vocab_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.max_position_embeddings
    );
    println!(
        "  KV: {} bytes/token over {} layers; {} bytes at the full context of {} tokens",
        fp.bytes_per_token(),
        fp.layers,
        fp.bytes_for_context(cfg.max_position_embeddings),
        cfg.max_position_embeddings
    );
    let engine = EngineArgs {
        model: dir.clone(),
        backend: args.backend,
        device: args.device,
        ctx_size: args.ctx_size,
        cache_type_k: args.cache_type_k.clone(),
        cache_type_v: args.cache_type_v.clone(),
        kv_arena: args.kv_arena.clone(),
        kv_stream_arena_mib: None,
        kv_page_tokens: args.kv_page_tokens,
        prefill_chunk: 256,
        kv_max_pool_pages: None,
        spec_type: "none".into(),
        spec_draft_n_max: 3,
        stats_json: None,
    };
    dispatch(args.backend, args.device, Plan(engine))
}
