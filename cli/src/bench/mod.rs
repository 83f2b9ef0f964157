//! `kvstream bench`: sweeps contexts × MTP draft counts × KV arena sizes on any backend and
//! reports prefill and decode tokens/s (separately), step times for query widths 1..=4, host →
//! device traffic, placement, device memory, MTP projections and a roofline computed from
//! ceilings measured in the same run. Writes `bench.csv`, `bench.jsonl` and `bench.svg`.
//!
//! `--synthetic GEOMETRY` creates random weights directly on the device (no disk);
//! `--fill synthetic` writes the KV history directly into the host store (decode at 256 Ki
//! without a 256 Ki prefill), `--fill prefill` prefills random tokens (and measures prefill).

mod ceilings;
mod output;
mod roofline;
mod row;
mod runner;
mod sweep;

use crate::args::BackendKind;
use crate::backend_select::{dispatch, OnBackend};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::format::KvType;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_model_qwen::{QwenConfig, WeightPolicy};
use roofline::Ceilings;
use row::BenchRow;
pub use runner::Fill;
use std::path::PathBuf;

/// Flags of `kvstream bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Model directory (config.json + safetensors). Alternative: --synthetic.
    #[arg(long, short = 'm', conflicts_with = "synthetic")]
    pub model: Option<PathBuf>,
    /// Random weights of a named geometry created directly in device memory: qwen3.8-27b,
    /// small-0.5b, tiny.
    #[arg(long)]
    pub synthetic: Option<String>,
    /// Stored dtype of synthetic weights: bf16, f16, f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Device weight formats (`--weights q4_g128`, `--weights-head q8_0`); synthetic quantized
    /// weights are generated directly as codes + scales.
    #[command(flatten)]
    pub weights: crate::args::WeightArgs,
    /// Backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendKind,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Contexts (history tokens before the measured steps), e.g. 8Ki,32Ki,256Ki.
    #[arg(long, default_value = "1Ki,4Ki")]
    pub contexts: String,
    /// MTP draft counts; 0 = plain decode, n > 0 = verify steps of width n + 1.
    #[arg(long, default_value = "0")]
    pub spec_draft_n_max: String,
    /// Device KV arena sizes, e.g. 1GiB,256MiB.
    #[arg(long, default_value = "256MiB")]
    pub kv_arena: String,
    /// Cap the KV pool at this many pages (forces streaming).
    #[arg(long)]
    pub kv_max_pool_pages: Option<usize>,
    /// Smallest ring in slots (see `generate --help`).
    #[arg(long, default_value_t = 1)]
    pub kv_min_ring_slots: usize,
    /// Ring depth while streaming (see `generate --help`).
    #[arg(long, default_value = "128MiB")]
    pub kv_stream_ring: String,
    /// How the history is made.
    #[arg(long, value_enum, default_value = "synthetic")]
    pub fill: Fill,
    /// K cache type.
    #[arg(long, default_value = "f16")]
    pub cache_type_k: String,
    /// V cache type.
    #[arg(long, default_value = "f16")]
    pub cache_type_v: String,
    /// Tokens per KV page.
    #[arg(long, default_value_t = 256)]
    pub kv_page_tokens: usize,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: usize,
    /// Timed decode steps per context.
    #[arg(long, default_value_t = 16)]
    pub decode_tokens: usize,
    /// Timed repetitions of each width-w step (the median counts).
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Assumed per-draft acceptance rates for MTP projections.
    #[arg(long, default_value = "0.6,0.8")]
    pub acceptance: String,
    /// MiB copied by the H2D ceiling probe.
    #[arg(long, default_value_t = 256)]
    pub h2d_probe_mib: usize,
    /// MiB per H2D probe request.
    #[arg(long, default_value_t = 16)]
    pub h2d_request_mib: usize,
    /// MiB of the weight the device-read ceiling probe streams.
    #[arg(long, default_value_t = 1024)]
    pub read_probe_mib: usize,
    /// RNG seed (weights, history, tokens).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output directory (bench.csv, bench.jsonl, bench.svg).
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// Everything a sweep needs, validated.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub model_dir: Option<PathBuf>,
    pub synthetic: Option<String>,
    pub synthetic_config: Option<QwenConfig>,
    pub weight_dtype: WeightDType,
    /// Device weight formats.
    pub weights: WeightPolicy,
    pub ctx_size: usize,
    pub k_type: KvType,
    pub v_type: KvType,
    pub page_tokens: usize,
    pub prefill_chunk: usize,
    pub max_pool_pages: Option<usize>,
    pub min_ring_slots: usize,
    pub stream_ring_bytes: u64,
    pub contexts: Vec<usize>,
    pub draft_ns: Vec<usize>,
    pub arenas: Vec<u64>,
    pub fill: Fill,
    pub decode_tokens: usize,
    pub reps: usize,
    pub seed: u64,
    pub acceptance: Vec<f64>,
    pub probes: ceilings::ProbeSizes,
    pub ceilings: Ceilings,
}

impl BenchPlan {
    /// `synthetic:<geometry>` or the model directory.
    pub fn model_label(&self) -> String {
        match (&self.synthetic, &self.model_dir) {
            (Some(g), _) => format!("synthetic:{g}"),
            (None, Some(d)) => d.display().to_string(),
            (None, None) => "?".into(),
        }
    }

    /// Validates `a` into a plan (ceilings still zero).
    pub fn from_args(a: &BenchArgs) -> Result<Self> {
        let (config, synthetic_config) = match (&a.synthetic, &a.model) {
            (Some(g), _) => {
                let c = crate::synth::preset_config(g)?;
                (c.clone(), Some(c))
            }
            (None, Some(d)) => (QwenConfig::from_model_dir(d)?, None),
            (None, None) => bail!("pass --model DIR or --synthetic GEOMETRY"),
        };
        let weight_dtype = match a.dtype.as_str() {
            "bf16" | "bfloat16" => WeightDType::Bf16,
            "f16" | "float16" => WeightDType::F16,
            "f32" | "float32" => WeightDType::F32,
            o => bail!("unknown --dtype `{o}`: expected bf16, f16 or f32"),
        };
        let contexts = sweep::parse_contexts(&a.contexts)?;
        let draft_ns = sweep::parse_draft_ns(&a.spec_draft_n_max)?;
        let arenas = sweep::parse_arenas(&a.kv_arena)?;
        let acceptance = sweep::parse_rates(&a.acceptance)?;
        if a.decode_tokens == 0 {
            bail!("--decode-tokens must be > 0");
        }
        let extra = a.decode_tokens + 8;
        let max_ctx = contexts.iter().copied().max().unwrap_or(1);
        let ctx_size = (max_ctx + extra).min(config.max_position_embeddings());
        if ctx_size <= extra {
            bail!("the model's context limit is too small for the measured steps");
        }
        Ok(Self {
            model_dir: a.model.clone(),
            synthetic: a.synthetic.clone(),
            synthetic_config,
            weight_dtype,
            weights: a.weights.policy(),
            ctx_size,
            k_type: a.cache_type_k.parse().context("--cache-type-k")?,
            v_type: a.cache_type_v.parse().context("--cache-type-v")?,
            page_tokens: a.kv_page_tokens,
            prefill_chunk: a.prefill_chunk,
            max_pool_pages: a.kv_max_pool_pages,
            min_ring_slots: a.kv_min_ring_slots.max(1),
            stream_ring_bytes: kvstream_runtime::size::parse_size(&a.kv_stream_ring)
                .with_context(|| format!("--kv-stream-ring `{}`", a.kv_stream_ring))?,
            contexts,
            draft_ns,
            arenas,
            fill: a.fill,
            decode_tokens: a.decode_tokens,
            reps: a.reps,
            seed: a.seed,
            acceptance,
            probes: ceilings::ProbeSizes {
                h2d_bytes: a.h2d_probe_mib << 20,
                h2d_request: a.h2d_request_mib << 20,
                read_bytes: a.read_probe_mib << 20,
                reps: 3,
            },
            ceilings: Ceilings {
                h2d_gbps: 0.0,
                hbm_gbps: 0.0,
            },
        })
    }
}

struct Probe<'a>(&'a ceilings::ProbeSizes);
impl OnBackend for Probe<'_> {
    type Output = Ceilings;
    fn run<B: ModelBackend>(self, backend: B) -> Result<Ceilings> {
        ceilings::measure(&backend, self.0)
    }
}

struct Arena<'a> {
    plan: &'a BenchPlan,
    arena: u64,
    bar: &'a ProgressBar,
}
impl OnBackend for Arena<'_> {
    type Output = Vec<BenchRow>;
    fn run<B: ModelBackend>(self, backend: B) -> Result<Vec<BenchRow>> {
        runner::run_arena(backend, self.plan, self.arena, self.bar)
    }
}

/// Runs the whole sweep and returns its rows (also written to `--out`).
pub fn sweep(a: &BenchArgs) -> Result<Vec<BenchRow>> {
    let mut plan = BenchPlan::from_args(a)?;
    plan.ceilings = dispatch(a.backend, a.device, Probe(&plan.probes)).context("ceilings")?;
    let total = (plan.arenas.len() * plan.contexts.len() * plan.draft_ns.len()) as u64;
    let bar = ProgressBar::new(total);
    if a.quiet {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for &arena in &plan.arenas {
        let r = dispatch(
            a.backend,
            a.device,
            Arena {
                plan: &plan,
                arena,
                bar: &bar,
            },
        )?;
        rows.extend(r);
    }
    bar.finish_and_clear();
    output::write_all(&a.out, &rows)?;
    Ok(rows)
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    v.map(|x| format!("{x:.prec$}"))
        .unwrap_or_else(|| "-".into())
}

/// `kvstream bench`.
pub fn run(a: BenchArgs) -> Result<()> {
    let rows = sweep(&a)?;
    if let Some(c) = rows.iter().find_map(|r| r.ceilings) {
        println!(
            "ceilings (measured): pinned H2D {:.2} GB/s, device read {:.2} GB/s",
            c.h2d_gbps, c.hbm_gbps
        );
    }
    println!(
        "{:>6} {:>9} {:>7} {:>2} {:>10} {:>10} {:>9} {:>29} {:>12} {:>8} {:>9} {:>6} {:>11}  weights / status",
        "arena",
        "context",
        "history",
        "n",
        "prefill/s",
        "decode/s",
        "step ms",
        "step ms w1/w2/w3/w4",
        "H2D B/step",
        "H2D GB/s",
        "res pages",
        "ring",
        "weight MiB"
    );
    for r in &rows {
        let w: Vec<String> = r.step_ms_by_width.iter().map(|x| fmt_opt(*x, 2)).collect();
        println!(
            "{:>6} {:>9} {:>7} {:>2} {:>10} {:>10} {:>9} {:>29} {:>12.0} {:>8.2} {:>9} {:>6} {:>11.1}  {} / {}{}",
            format!("{}M", r.arena_bytes >> 20),
            r.context,
            r.history_tokens,
            r.spec_draft_n_max,
            fmt_opt(r.prefill_tok_per_s, 1),
            fmt_opt(r.decode_tok_per_s, 2),
            fmt_opt(r.step_ms, 2),
            w.join("/"),
            r.h2d_bytes_per_step,
            r.h2d_gbps,
            r.resident_pages
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(","),
            r.ring_slots,
            r.weight_bytes as f64 / (1u64 << 20) as f64,
            r.weights,
            r.status,
            if r.note.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.note)
            },
        );
        for p in &r.projections {
            println!(
                "       PROJECTION n={} at acceptance {:.2}: {:.2} tokens/step -> {:.2} tok/s",
                r.spec_draft_n_max, p.acceptance, p.tokens_per_step, p.tok_per_s
            );
        }
    }
    println!(
        "roofline (min step = weight bytes / device-read GB/s + streamed KV bytes / H2D GB/s):"
    );
    for r in &rows {
        println!(
            "  arena {}M context {} n={}: measured {} ms{}, roofline {} ms, measured/roofline {}, peak device {} MiB (weights + arena){}",
            r.arena_bytes >> 20,
            r.context,
            r.spec_draft_n_max,
            fmt_opt(r.step_ms, 3),
            r.step_issue_ms
                .map(|m| format!(" (host issue {m:.3} ms)"))
                .unwrap_or_default(),
            fmt_opt(r.roofline_step_ms, 3),
            fmt_opt(r.measured_over_roofline, 2),
            r.peak_device_bytes >> 20,
            r.peak_device_measured_bytes
                .map(|b| format!(", {} MiB in use (driver)", b >> 20))
                .unwrap_or_default()
        );
    }
    println!("wrote {}/bench.{{csv,jsonl,svg}}", a.out.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    #[test]
    fn bench_weights_flag_quantizes_the_synthetic_model_and_labels_rows() {
        let run = |weights: &[&str]| {
            let out = std::env::temp_dir().join(format!(
                "kvstream-bench-w{}-{}",
                weights.len(),
                std::process::id()
            ));
            let mut argv = vec![
                "bench",
                "--synthetic",
                "tiny",
                "--contexts",
                "256",
                "--kv-arena",
                "32MiB",
                "--kv-page-tokens",
                "64",
                "--decode-tokens",
                "2",
                "--reps",
                "1",
                "--h2d-probe-mib",
                "1",
                "--h2d-request-mib",
                "1",
                "--read-probe-mib",
                "1",
                "--quiet",
                "--out",
                out.to_str().expect("utf-8 path"),
            ];
            argv.extend_from_slice(weights);
            let cli = Cli::try_parse_from(argv).expect("args");
            let rows = sweep(&cli.bench).expect("sweep");
            let csv = std::fs::read_to_string(out.join("bench.csv")).expect("csv");
            std::fs::remove_dir_all(&out).ok();
            (rows, csv)
        };
        let (plain, _) = run(&[]);
        let (q4, csv) = run(&["--weights", "q4"]);
        assert_eq!(plain[0].weights, "as stored");
        assert_eq!(q4[0].weights, "q4_g128 (head q8_0)");
        assert!(
            q4[0].decode_tok_per_s.is_some_and(|t| t > 0.0),
            "{:?}",
            q4[0]
        );
        // bf16 storage → ~4 bits for most weights: well under half the bytes.
        assert!(
            q4[0].weight_bytes * 2 < plain[0].weight_bytes,
            "{} vs {}",
            q4[0].weight_bytes,
            plain[0].weight_bytes
        );
        let header: Vec<&str> = csv.lines().next().unwrap_or("").split(',').collect();
        let col = header
            .iter()
            .position(|h| *h == "weights")
            .expect("weights column");
        let first = csv.lines().nth(1).unwrap_or("");
        assert!(first.contains("q4_g128 (head q8_0)"), "{first}");
        assert!(col > 0);
        let bad = Cli::try_parse_from(["bench", "--synthetic", "tiny", "--weights", "q5"]);
        assert!(bad.is_err_and(|e| e.to_string().contains("q4_g128")));
    }

    #[test]
    fn tiny_synthetic_bench_runs_end_to_end_on_cpu() {
        let out = std::env::temp_dir().join(format!("kvstream-bench-e2e-{}", std::process::id()));
        let cli = Cli::try_parse_from([
            "bench",
            "--synthetic",
            "tiny",
            "--contexts",
            "512,1Ki",
            "--spec-draft-n-max",
            "0,1",
            "--kv-arena",
            "64MiB",
            "--kv-max-pool-pages",
            "3",
            "--kv-page-tokens",
            "64",
            "--decode-tokens",
            "4",
            "--reps",
            "2",
            "--h2d-probe-mib",
            "4",
            "--h2d-request-mib",
            "1",
            "--read-probe-mib",
            "8",
            "--quiet",
            "--out",
            out.to_str().expect("utf-8 path"),
        ])
        .expect("args");
        let rows = sweep(&cli.bench).expect("sweep");
        assert_eq!(rows.len(), 4);
        for r in &rows {
            assert_ne!(r.status, "skipped", "{r:?}");
            assert!(
                r.step_ms_by_width
                    .iter()
                    .all(|w| w.is_some_and(|x| x > 0.0)),
                "{r:?}"
            );
            // 1 Ki tokens = 16 pages of 64 > a 3-page pool: the layer streams.
            assert!(r.ring_slots > 0, "{r:?}");
            assert!(r.h2d_bytes_per_step > 0.0, "{r:?}");
            assert!(r.roofline_step_ms.is_some_and(|m| m > 0.0), "{r:?}");
        }
        let plain: Vec<&BenchRow> = rows.iter().filter(|r| r.spec_draft_n_max == 0).collect();
        assert_eq!(plain.len(), 2);
        assert!(plain
            .iter()
            .all(|r| r.decode_tok_per_s.is_some_and(|t| t > 0.0)));
        // The host issue time is part of the step (the CPU backend computes while issuing).
        assert!(
            plain.iter().all(|r| r
                .step_issue_ms
                .is_some_and(|m| m > 0.0 && m <= r.step_ms.unwrap_or(0.0) * 1.01)),
            "{plain:?}"
        );
        let mtp = rows
            .iter()
            .find(|r| r.spec_draft_n_max == 1)
            .expect("mtp row");
        assert_eq!(mtp.status, "projection");
        assert_eq!(mtp.projections.len(), 2);
        assert!(mtp.decode_tok_per_s.is_none());
        // More history streams more bytes per step.
        assert!(
            plain[1].h2d_bytes_per_step > plain[0].h2d_bytes_per_step,
            "{plain:?}"
        );
        let csv = std::fs::read_to_string(out.join("bench.csv")).expect("csv");
        assert_eq!(csv.lines().count(), 5);
        assert!(out.join("bench.svg").is_file() && out.join("bench.jsonl").is_file());
        std::fs::remove_dir_all(&out).ok();
    }
}
