//! `kvstream generate`.

use crate::args::{parse_token_list, EngineArgs};
use crate::backend_select::{dispatch, OnBackend};
use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use kvstream_memory_contracts::ops::ModelBackend;
use kvstream_runtime::chat::{expand_image_pads, ChatMessage, ChatPart};
use kvstream_runtime::engine::{Engine, Flow, GenerateRequest, Prompt};
use kvstream_runtime::sampling::SamplingParams;
use kvstream_runtime::ImageInput;
use std::io::{IsTerminal, Write};

/// Flags of `generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt text (tokenized as is).
    #[arg(long, short = 'p', group = "input")]
    pub prompt: Option<String>,
    /// Prompt token ids, e.g. `1,2,3`.
    #[arg(long, group = "input")]
    pub prompt_tokens: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long, group = "input")]
    pub chat: Option<String>,
    /// An image file (PNG, JPEG, WebP) for a vision-language model; repeat for several. With
    /// --chat the images come before the text of the user message; with --prompt or
    /// --prompt-tokens each `<|image_pad|>` token of the prompt stands for one image, in order.
    #[arg(long = "image", value_name = "PATH")]
    pub images: Vec<std::path::PathBuf>,
    /// Tokens to generate.
    #[arg(long, short = 'n', default_value_t = 64)]
    pub n_predict: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Repeat penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Keep generating after EOS.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the generated token ids and text as JSON instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Print the stats (JSON) to stderr at the end.
    #[arg(long)]
    pub stats: bool,
}

impl GenerateArgs {
    fn request(&self) -> Result<GenerateRequest> {
        let prompt = match (&self.prompt, &self.prompt_tokens, &self.chat) {
            (Some(p), None, None) => Prompt::Text(p.clone()),
            (None, Some(t), None) => Prompt::Tokens(parse_token_list(t)?),
            (None, None, Some(c)) => Prompt::Chat(vec![ChatMessage::new("user", c.clone())]),
            _ => bail!("give exactly one of --prompt, --prompt-tokens, --chat"),
        };
        let mut req = GenerateRequest::new(prompt, self.n_predict);
        req.stop_at_eos = !self.ignore_eos;
        req.sampling = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            repeat_penalty: self.repeat_penalty,
            ..SamplingParams::default()
        };
        Ok(req)
    }
}

/// Decodes `--image` files and turns the prompt into tokens whose image placeholders are
/// expanded to each image's token count (no images: the request unchanged).
fn with_images<B: ModelBackend>(
    engine: &mut Engine<B>,
    mut req: GenerateRequest,
    args: &GenerateArgs,
) -> Result<(GenerateRequest, Vec<ImageInput>)> {
    if args.images.is_empty() {
        return Ok((req, Vec::new()));
    }
    if !engine.has_vision() {
        bail!(
            "--image: the model at {} has no vision tower (needs vision_config, model.visual.* \
             weights and preprocessor_config.json)",
            args.engine.model.display()
        );
    }
    let mut images = Vec::with_capacity(args.images.len());
    for path in &args.images {
        let bytes =
            std::fs::read(path).with_context(|| format!("--image: reading {}", path.display()))?;
        let img = engine
            .preprocess_image(&bytes)
            .with_context(|| format!("--image {}", path.display()))?;
        images.push(img);
    }
    let tokens = match &req.prompt {
        Prompt::Chat(msgs) => {
            let mut parts = vec![ChatPart::Image; images.len()];
            let text = msgs.iter().map(|m| m.content.as_str()).collect::<String>();
            parts.push(ChatPart::Text(text));
            engine.chat_tokens_with_images(&[ChatMessage::from_parts("user", &parts)], &images)?
        }
        prompt => {
            let ids = engine.tokenize(prompt)?;
            let pad = engine.vision_config()?.image_token_id;
            let counts: Vec<usize> = images.iter().map(ImageInput::n_tokens).collect();
            expand_image_pads(&ids, pad, &counts).with_context(|| {
                format!("--image: put one <|image_pad|> (id {pad}) in the prompt per image")
            })?
        }
    };
    req.prompt = Prompt::Tokens(tokens);
    Ok((req, images))
}

struct Run(GenerateArgs);

impl OnBackend for Run {
    type Output = ();
    fn run<B: ModelBackend>(self, backend: B) -> Result<()> {
        let args = self.0;
        let req = args.request()?;
        let cfg = args.engine.engine_config()?;
        let tty = std::io::stderr().is_terminal() && !args.json;
        let spinner = tty.then(|| {
            let pb = ProgressBar::new_spinner();
            pb.set_message(format!("loading {}", args.engine.model.display()));
            pb.enable_steady_tick(std::time::Duration::from_millis(100));
            pb
        });
        let loaded = Engine::load(backend, cfg);
        if let Some(pb) = spinner {
            pb.finish_and_clear();
        }
        let mut engine = loaded.context("loading the engine")?;
        let (req, images) = with_images(&mut engine, req, &args)?;
        if tty {
            let bar = ProgressBar::new(0);
            bar.set_style(
                ProgressStyle::with_template("prefill {bar:40} {pos}/{len} tokens ({per_sec})")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            engine.set_prefill_progress(Some(Box::new(move |done, total| {
                bar.set_length(total as u64);
                bar.set_position(done as u64);
                if done >= total {
                    bar.finish_and_clear();
                }
            })));
        }
        let json = args.json;
        let mut out = std::io::stdout();
        let on_token = |ev: kvstream_runtime::engine::TokenEvent<'_>| {
            if !json {
                let _ = out.write_all(ev.text.as_bytes());
                let _ = out.flush();
            }
            Flow::Continue
        };
        let result = if images.is_empty() {
            engine.generate(&req, on_token)
        } else {
            engine.generate_multimodal(&req, &images, on_token)
        }
        .context("generation failed")?;
        if json {
            let r = engine.load_report();
            let v = serde_json::json!({
                "weights": {
                    "policy": crate::args::describe_policy(&engine.engine_config().weights),
                    "device_bytes": r.device_weight_bytes,
                    "host_embedding_bytes": r.host_embedding_bytes,
                    "quantized": r.quantized,
                    "kept": r.kept,
                    "fallback": r.fallback.len(),
                },
                "prompt_tokens": result.prompt_tokens,
                "tokens": result.tokens,
                "text": result.text,
                "stop": format!("{:?}", result.stop),
                "stats": result.stats,
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            println!();
        }
        if args.stats {
            eprintln!("{}", result.stats.to_json());
        }
        if let Some(path) = &args.engine.stats_json {
            std::fs::write(path, result.stats.to_json())
                .with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(())
    }
}

/// Runs `generate`.
pub fn run(args: GenerateArgs) -> Result<()> {
    let (kind, dev) = (args.engine.backend, args.engine.device);
    dispatch(kind, dev, Run(args))
}
