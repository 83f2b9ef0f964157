//! `kvstream inspect`: what a backend can do, and what a model needs (geometry, KV footprint,
//! the arena plan per phase and the device memory plan against a budget).

use crate::args::{describe_policy, BackendKind, EngineArgs, WeightArgs};
use crate::backend_select::{capabilities, dispatch, model_support, OnBackend};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvstream_memory_contracts::kv::geometry::{KvFootprint, PageGeometry};
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_memory_contracts::report::render_capability_table;
use kvstream_model_qwen::QwenConfig;
use kvstream_runtime::engine::{check_admission_for_config, EngineConfig};
use kvstream_runtime::memory_plan::{plan_from_config, PlanOptions, DEFAULT_FIXED_OVERHEAD_BYTES};
use kvstream_runtime::size::parse_size;
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
    /// Model directory (config.json is enough): also print its geometry, KV footprint, the
    /// arena plan per phase and the device memory plan.
    #[arg(long, short = 'm', conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// Plan a named geometry instead of a directory: qwen3.8-27b, small-0.5b, tiny.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Memory flags for the plans (used with --model or --synthetic).
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
    /// Plan speculative decoding: `draft-mtp` adds the MTP head and its state checkpoints.
    #[arg(long, value_parser = ["none", "draft-mtp"], default_value = "none")]
    pub spec_type: String,
    /// Drafts per verification with --spec-type draft-mtp (1..=4).
    #[arg(long, default_value_t = 3)]
    pub spec_draft_n_max: usize,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// Device memory budget for the verdict, e.g. 16GiB, 24GiB.
    #[arg(long)]
    pub device_memory: Option<String>,
    /// Fixed device overhead (CUDA context, modules, cuBLAS); default 512MiB (see the runtime's
    /// memory_plan docs: 594 MiB measured on an H200, ~460 MiB expected on a 16 GiB card).
    #[arg(long)]
    pub device_overhead: Option<String>,
    /// Also count the server's prompt-cache recurrent checkpoint.
    #[arg(long)]
    pub prompt_cache: bool,
}

struct Plan {
    cfg: EngineConfig,
    config: QwenConfig,
}

impl OnBackend for Plan {
    type Output = ();
    fn run<B: ModelBackend>(self, backend: B) -> Result<()> {
        let cfg = self.cfg;
        let layouts = check_admission_for_config(&backend, &cfg, &self.config)?;
        println!(
            "\narena plan: {} bytes arena, ctx {} tokens, K {} / V {}, {}-token pages",
            cfg.arena_bytes, cfg.ctx_size, cfg.k_type, cfg.v_type, cfg.page_tokens
        );
        println!(
            "{:<20} {:>14} {:>10} {:>14} {:>14} {:>14}",
            "phase", "pool bytes", "pages", "workspace", "scratch", "required"
        );
        for l in layouts {
            println!(
                "{:<20} {:>14} {:>10} {:>14} {:>14} {:>14}",
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

impl InspectArgs {
    /// The model configuration and a label (directory or `synthetic:<geometry>`), if asked for.
    fn model_config(&self) -> Result<Option<(QwenConfig, PathBuf)>> {
        match (&self.model, &self.synthetic) {
            (Some(dir), _) => Ok(Some((QwenConfig::from_model_dir(dir)?, dir.clone()))),
            (None, Some(g)) => Ok(Some((
                crate::synth::preset_config(g)?,
                PathBuf::from(format!("synthetic:{g}")),
            ))),
            (None, None) => Ok(None),
        }
    }

    fn engine_args(&self, dir: PathBuf) -> EngineArgs {
        EngineArgs {
            model: dir,
            backend: self.backend,
            device: self.device,
            ctx_size: self.ctx_size,
            cache_type_k: self.cache_type_k.clone(),
            cache_type_v: self.cache_type_v.clone(),
            kv_arena: self.kv_arena.clone(),
            kv_stream_arena_mib: None,
            kv_page_tokens: self.kv_page_tokens,
            prefill_chunk: 256,
            kv_max_pool_pages: None,
            kv_min_ring_slots: 1,
            kv_stream_ring: "128MiB".into(),
            spec_type: self.spec_type.clone(),
            spec_draft_n_max: self.spec_draft_n_max,
            stats_json: None,
            weights: self.weights.clone(),
        }
    }

    fn plan_options(&self) -> Result<PlanOptions> {
        let size = |s: &Option<String>, flag: &str| -> Result<Option<u64>> {
            s.as_deref()
                .map(|v| parse_size(v).with_context(|| format!("{flag} `{v}`")))
                .transpose()
        };
        let budget = size(&self.device_memory, "--device-memory")?;
        if budget == Some(0) {
            bail!("--device-memory must be > 0");
        }
        Ok(PlanOptions {
            fixed_overhead: size(&self.device_overhead, "--device-overhead")?
                .unwrap_or(DEFAULT_FIXED_OVERHEAD_BYTES),
            budget,
            prompt_cache: self.prompt_cache,
        })
    }
}

/// Runs `inspect`.
pub fn run(args: InspectArgs) -> Result<()> {
    let caps = capabilities(args.backend, args.device)?;
    println!("{}", render_capability_table(&caps));
    model_support(args.backend, &caps)?;
    let Some((cfg, dir)) = args.model_config()? else {
        return Ok(());
    };
    let opts = args.plan_options()?;
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
    let mut engine_cfg = args.engine_args(dir).engine_config()?;
    if args.ctx_size.is_none() {
        engine_cfg.ctx_size = cfg.max_position_embeddings.min(4096);
    }
    let plan = plan_from_config(&cfg, &engine_cfg, &opts)?;
    println!(
        "\nweights: {} (planned for a bf16 checkpoint; embeddings on the host)",
        describe_policy(&engine_cfg.weights)
    );
    print!("{}", plan.render());
    dispatch(
        args.backend,
        args.device,
        Plan {
            cfg: engine_cfg,
            config: cfg,
        },
    )
}
