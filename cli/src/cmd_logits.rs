//! `kvstream logits`: reference logits of a token sequence through the streaming path.

use crate::args::{parse_token_list, EngineArgs};
use crate::backend_select::{dispatch, OnBackend};
use anyhow::{bail, Context, Result};
use clap::Args;
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_runtime::engine::Engine;
use safetensors::tensor::{Dtype, TensorView};
use std::path::PathBuf;

/// Flags of `logits`.
#[derive(Debug, Clone, Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Token ids, e.g. `1,2,3`.
    #[arg(long)]
    pub tokens: String,
    /// Output safetensors file (tensor `logits`, f32 [T, vocab]).
    #[arg(long)]
    pub out: PathBuf,
    /// Also write `mtp_logits` (f32 [T-1, vocab]; row i from hidden i and token i+1).
    #[arg(long)]
    pub mtp: bool,
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

struct Run(LogitsArgs);

impl OnBackend for Run {
    type Output = ();
    fn run<B: ModelBackend>(self, backend: B) -> Result<()> {
        let args = self.0;
        let tokens = parse_token_list(&args.tokens)?;
        if tokens.is_empty() {
            bail!("--tokens is empty");
        }
        let mut cfg = args.engine.engine_config()?;
        if args.mtp && cfg.spec.is_none() {
            // Loading the MTP head is what speculative decoding does; one draft is enough.
            cfg.spec = Some(kvstream_runtime::speculative::SpecConfig { draft_n_max: 1 });
        }
        let mut engine = Engine::load(backend, cfg).context("loading the engine")?;
        let vocab = engine.model_config().vocab_size;
        let logits = engine.logits(&tokens).context("forward failed")?;
        let mut blobs = vec![(
            "logits".to_string(),
            vec![tokens.len(), vocab],
            f32_bytes(&logits),
        )];
        if args.mtp {
            let m = engine.mtp_logits(&tokens).context("MTP forward failed")?;
            blobs.push((
                "mtp_logits".to_string(),
                vec![tokens.len() - 1, vocab],
                f32_bytes(&m),
            ));
        }
        let views = blobs
            .iter()
            .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
            .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
        // Write to a temporary name first so a failure leaves nothing half-written.
        let tmp = args.out.with_extension("partial");
        safetensors::serialize_to_file(views, None, &tmp)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &args.out)
            .with_context(|| format!("moving {} to {}", tmp.display(), args.out.display()))?;
        if let Some(path) = &args.engine.stats_json {
            std::fs::write(path, engine.stats().to_json())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        eprintln!(
            "wrote {} ({} tokens × {vocab})",
            args.out.display(),
            tokens.len()
        );
        Ok(())
    }
}

/// Runs `logits`.
pub fn run(args: LogitsArgs) -> Result<()> {
    let (kind, dev) = (args.engine.backend, args.engine.device);
    dispatch(kind, dev, Run(args))
}
