//! `kvstream quantize`: converts a model directory to quantized device formats once, so that
//! later loads read the saved blobs instead of quantizing at every start.

use crate::args::{describe_policy, WeightArgs};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_model_qwen::{plan_weight_bytes_stored, save_quantized, QwenConfig, WeightPolicy};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Flags of `quantize`.
#[derive(Debug, Clone, Args)]
pub struct QuantizeArgs {
    /// Source model directory (config.json + safetensors).
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Output model directory (created; must differ from --in).
    #[arg(long)]
    pub out: PathBuf,
    #[command(flatten)]
    pub weights: WeightArgs,
    /// Leave the MTP head out of the output (it is written by default when the model has one).
    #[arg(long)]
    pub no_mtp: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// The stored dtype a config declares (`dtype` / `torch_dtype`, top level or `text_config`);
/// bf16 when it declares none.
fn declared_dtype(dir: &Path) -> WeightDType {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    let pick = |o: &serde_json::Value| {
        ["dtype", "torch_dtype"]
            .iter()
            .find_map(|k| o.get(*k).and_then(|x| x.as_str()).map(str::to_string))
    };
    let name = v
        .get("text_config")
        .and_then(pick)
        .or_else(|| pick(&v))
        .unwrap_or_default();
    match name.as_str() {
        "float32" | "f32" => WeightDType::F32,
        "float16" | "f16" => WeightDType::F16,
        _ => WeightDType::Bf16,
    }
}

/// The stored dtype of the source's decoder linears (layer 0's `mlp.gate_proj`), read from the
/// checkpoint index; the config's declared dtype when that fails or the tensor is quantized.
fn stored_dtype(dir: &Path, config: &QwenConfig) -> WeightDType {
    let shape = [config.intermediate_size, config.hidden_size];
    kvstream_model_qwen::weights::Checkpoint::open(dir)
        .ok()
        .and_then(|ck| {
            ["model.language_model.", "model."]
                .iter()
                .map(|p| format!("{p}layers.0.mlp.gate_proj.weight"))
                .find(|n| ck.contains(n))
                .and_then(|n| ck.stored_dtype(&n, &shape).ok())
        })
        .filter(|d| !d.is_quantized())
        .unwrap_or_else(|| declared_dtype(dir))
}

/// Bytes of `*.safetensors*` files (finished and partial) under `dir`.
fn written_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().contains(".safetensors"))
                .filter_map(|e| e.metadata().ok().map(|m| m.len()))
                .sum()
        })
        .unwrap_or(0)
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

/// Runs `quantize`.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let policy: WeightPolicy = args.weights.policy();
    if policy.format.is_none() && policy.head_format.is_none() {
        bail!(
            "--weights is required: one of {}",
            crate::args::WEIGHT_FORMATS
        );
    }
    let config = QwenConfig::from_model_dir(&args.input)
        .with_context(|| format!("reading the model in {}", args.input.display()))?;
    let load_mtp = !args.no_mtp && config.mtp_num_hidden_layers > 0;
    let stored = stored_dtype(&args.input, &config);
    let before = plan_weight_bytes_stored(&config, &WeightPolicy::as_stored(), load_mtp, stored);
    let planned = plan_weight_bytes_stored(&config, &policy, load_mtp, stored);
    let planned_total = planned.device_total() + planned.host_embedding;

    let bar = ProgressBar::new(planned_total.max(1));
    if args.quiet {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template(
            "quantize {bar:40} {bytes}/{total_bytes} ({bytes_per_sec}, {elapsed_precise}) {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(describe_policy(&policy));
    // save_quantized writes shard by shard; a watcher turns the bytes on disk into progress.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (bar, done, out) = (bar.clone(), done.clone(), args.out.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                bar.set_position(written_bytes(&out).min(bar.length().unwrap_or(u64::MAX)));
                std::thread::sleep(Duration::from_millis(200));
            }
        })
    };
    let result = save_quantized(&args.input, &args.out, &policy, load_mtp);
    done.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    bar.finish_and_clear();
    let report = result.with_context(|| {
        format!(
            "quantizing {} into {}",
            args.input.display(),
            args.out.display()
        )
    })?;

    let after = report.device_weight_bytes as u64 + report.host_embedding_bytes as u64;
    let before_total = before.device_total() + before.host_embedding;
    println!(
        "quantized {} -> {} ({}{})",
        args.input.display(),
        args.out.display(),
        describe_policy(&policy),
        if load_mtp { ", with the MTP head" } else { "" }
    );
    println!(
        "  tensors: {} quantized, {} kept as stored, {} fallback",
        report.quantized,
        report.kept,
        report.fallback.len()
    );
    for (name, dtype) in &report.fallback {
        println!("    fallback: {name} -> {dtype} (its K is not a multiple of the group)");
    }
    println!(
        "  device weights: {} -> {} ({stored} source)",
        mib(before.device_total()),
        mib(report.device_weight_bytes as u64)
    );
    println!(
        "  host embedding: {} -> {}",
        mib(before.host_embedding),
        mib(report.host_embedding_bytes as u64)
    );
    println!(
        "  total: {} -> {} ({:.2}x smaller); {} on disk",
        mib(before_total),
        mib(after),
        before_total as f64 / after.max(1) as f64,
        mib(written_bytes(&args.out))
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_dtype_reads_text_config_then_top_level() {
        let dir = std::env::temp_dir().join(format!("kvstream-qdtype-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cases = [
            (r#"{"text_config": {"dtype": "float32"}}"#, WeightDType::F32),
            (r#"{"torch_dtype": "float16"}"#, WeightDType::F16),
            (r#"{"text_config": {}}"#, WeightDType::Bf16),
        ];
        for (json, want) in cases {
            std::fs::write(dir.join("config.json"), json).expect("write");
            assert_eq!(declared_dtype(&dir), want, "{json}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn stored_dtype_comes_from_the_checkpoint() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        for (dir, want) in [
            ("fixtures/tiny-gqa-f32", WeightDType::F32),
            ("fixtures/tiny-mha-tied-bf16", WeightDType::Bf16),
        ] {
            let d = root.join(dir);
            let c = QwenConfig::from_model_dir(&d).expect("config");
            assert_eq!(stored_dtype(&d, &c), want, "{dir}");
        }
    }
}
