//! The `kvstream` binary.

mod args;
mod backend_select;
mod bench;
mod cmd_generate;
mod cmd_inspect;
mod cmd_logits;
mod cmd_quantize;
mod cmd_serve;
mod serve;
mod synth;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "kvstream",
    version,
    about = "Long-context LLM serving with host-resident KV streaming"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text (prefill + streamed decode) and print stats.
    Generate(cmd_generate::GenerateArgs),
    /// Write the logits of a token sequence to a safetensors file.
    Logits(cmd_logits::LogitsArgs),
    /// List a backend's capabilities; with --model, the model's KV footprint and arena plan.
    Inspect(cmd_inspect::InspectArgs),
    /// OpenAI-compatible HTTP server.
    Serve(cmd_serve::ServeArgs),
    /// Convert a model directory to quantized weights (q8_0, q4_g128, q4_nl_g128, fp8_e4m3) once.
    Quantize(cmd_quantize::QuantizeArgs),
    /// Benchmark sweep: contexts × MTP draft counts × KV arena sizes, with a roofline.
    Bench(bench::BenchArgs),
    /// Write a random-weight checkpoint with a real model geometry (HF naming, safetensors).
    Synth {
        /// Geometry preset: qwen3.8-27b, small-0.5b, tiny.
        #[arg(long, default_value = "tiny")]
        geometry: String,
        /// Output model directory.
        #[arg(long)]
        out: PathBuf,
        /// Stored dtype: bf16, f16, f32.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// RNG seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Largest shard in MiB.
        #[arg(long, default_value_t = 4096)]
        shard_mib: usize,
        /// Write only config.json (plan memory with `inspect --model` without the weights).
        #[arg(long)]
        config_only: bool,
    },
}

fn main() {
    init_tracing();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KVSTREAM_LOG").unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("warn,wgpu_hal=off,wgpu_core=off,naga=off")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Generate(a) => cmd_generate::run(a),
        Command::Logits(a) => cmd_logits::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Serve(a) => cmd_serve::run(a),
        Command::Quantize(a) => cmd_quantize::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Synth {
            geometry,
            out,
            dtype,
            seed,
            shard_mib,
            config_only,
        } => {
            let g = synth::Geometry::preset(&geometry)?;
            let dt = synth::SynthDType::parse(&dtype)?;
            if config_only {
                synth::write_config_only(&g, dt, &out)?;
                println!(
                    "wrote {}/config.json ({}, {} parameters, no weights)",
                    out.display(),
                    g.name,
                    g.parameters()
                );
                return Ok(());
            }
            synth::write_checkpoint(&g, dt, &out, seed, shard_mib << 20)?;
            println!(
                "wrote {} ({} parameters, {dtype}) to {}",
                g.name,
                g.parameters(),
                out.display()
            );
            Ok(())
        }
    }
}
