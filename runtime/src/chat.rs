//! Tokenizer (`tokenizer.json` via the `tokenizers` crate) and chat template
//! (`tokenizer_config.json` / `chat_template.jinja` via `minijinja`).

use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// What an image content part renders to in a message (HF's Qwen chat template for
/// `{"type": "image"}`); the single `<|image_pad|>` is expanded to the image's token count by
/// [`expand_image_pads`] after tokenization (what HF's processor does in text).
pub const IMAGE_PLACEHOLDER: &str = "<|vision_start|><|image_pad|><|vision_end|>";

/// One content part of a multimodal message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatPart {
    /// Text, rendered as is.
    Text(String),
    /// An image, rendered as [`IMAGE_PLACEHOLDER`] (the images travel separately, in order).
    Image,
}

impl ChatMessage {
    /// A message from content parts: texts concatenated, each image as [`IMAGE_PLACEHOLDER`]
    /// (what HF's Qwen template renders for a content list).
    pub fn from_parts(role: impl Into<String>, parts: &[ChatPart]) -> Self {
        let mut content = String::new();
        for p in parts {
            match p {
                ChatPart::Text(t) => content.push_str(t),
                ChatPart::Image => content.push_str(IMAGE_PLACEHOLDER),
            }
        }
        Self::new(role, content)
    }
}

/// Replaces the i-th `pad` token of `tokens` by `counts[i]` pads (the merged grid t·h·w/4 of
/// image i). Fails with [`RuntimeError::InvalidRequest`] when the prompt holds a different
/// number of placeholders than there are images (e.g. a literal `<|image_pad|>` in user text).
pub fn expand_image_pads(tokens: &[u32], pad: u32, counts: &[usize]) -> Result<Vec<u32>> {
    let found = tokens.iter().filter(|&&t| t == pad).count();
    if found != counts.len() {
        return Err(RuntimeError::InvalidRequest(format!(
            "the prompt has {found} image placeholder(s) for {} image(s)",
            counts.len()
        )));
    }
    let mut out = Vec::with_capacity(tokens.len() + counts.iter().sum::<usize>());
    let mut next = counts.iter();
    for &t in tokens {
        if t == pad {
            let n = next.next().copied().unwrap_or(0);
            out.extend(std::iter::repeat_n(pad, n));
        } else {
            out.push(t);
        }
    }
    Ok(out)
}

/// The model's tokenizer and, if it has one, its chat template.
#[derive(Debug)]
pub struct TextCodec {
    tokenizer: tokenizers::Tokenizer,
    template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    dir: PathBuf,
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl TextCodec {
    /// Loads `dir/tokenizer.json` and the chat template: `dir/chat_template.jinja` if present,
    /// else `chat_template` of `dir/tokenizer_config.json` (a string, or a list of named
    /// templates of which `default` is taken). Fails with [`RuntimeError::File`] if
    /// `tokenizer.json` is missing.
    pub fn load(dir: &Path) -> Result<Self> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(RuntimeError::File {
                what: "tokenizer",
                path: tok_path,
                detail: "not found (the model directory has no tokenizer.json)".into(),
            });
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<serde_json::Value> = if cfg_path.is_file() {
            let text = std::fs::read_to_string(&cfg_path).map_err(|e| RuntimeError::File {
                what: "tokenizer config",
                path: cfg_path.clone(),
                detail: e.to_string(),
            })?;
            Some(serde_json::from_str(&text).map_err(|e| RuntimeError::File {
                what: "tokenizer config",
                path: cfg_path.clone(),
                detail: e.to_string(),
            })?)
        } else {
            None
        };
        let jinja = dir.join("chat_template.jinja");
        let template = if jinja.is_file() {
            Some(
                std::fs::read_to_string(&jinja).map_err(|e| RuntimeError::File {
                    what: "chat template",
                    path: jinja.clone(),
                    detail: e.to_string(),
                })?,
            )
        } else {
            cfg.as_ref()
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| match t {
                    serde_json::Value::String(s) => Some(s.clone()),
                    serde_json::Value::Array(list) => list
                        .iter()
                        .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                        .or_else(|| list.first())
                        .and_then(|e| e.get("template"))
                        .and_then(|s| s.as_str())
                        .map(str::to_string),
                    _ => None,
                })
        };
        Ok(Self {
            tokenizer,
            template,
            bos_token: token_string(cfg.as_ref().and_then(|c| c.get("bos_token"))),
            eos_token: token_string(cfg.as_ref().and_then(|c| c.get("eos_token"))),
            dir: dir.to_path_buf(),
        })
    }

    /// True if a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids of `text` (special tokens written in the text are recognised; no BOS is added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`; with `skip_special`, special tokens (e.g. `<|im_end|>`) are left out.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.tokenizer
            .decode(ids, skip_special)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    /// Renders `messages` with the chat template. Fails with [`RuntimeError::Template`] if there
    /// is no template or it does not render.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let Some(src) = &self.template else {
            return Err(RuntimeError::Template(format!(
                "no chat template in {} (neither chat_template.jinja nor tokenizer_config.json's chat_template)",
                self.dir.display()
            )));
        };
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", src)
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| RuntimeError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        })
        .map_err(|e| RuntimeError::Template(e.to_string()))
    }

    /// Token ids of the rendered chat.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode(&self.render_chat(messages, add_generation_prompt)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures")
            .join(name)
    }

    #[test]
    fn chat_prompt_matches_hf_text() {
        let dir = fixture("tiny-gqa-f32");
        let codec = TextCodec::load(&dir).expect("fixture has a tokenizer");
        assert!(codec.has_chat_template());
        let msgs = [ChatMessage::new(
            "user",
            "Tell me a short story about a cat and a boat.",
        )];
        let text = codec.render_chat(&msgs, true).expect("renders");
        assert_eq!(
            text,
            "<|im_start|>user\nTell me a short story about a cat and a boat.<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = codec.encode(&text).expect("encodes");
        assert_eq!(ids.first(), Some(&510));
        assert_eq!(codec.decode(&ids, false).expect("decodes"), text);
    }

    #[test]
    fn image_parts_render_placeholders_and_pads_expand_per_image() {
        let m = ChatMessage::from_parts(
            "user",
            &[
                ChatPart::Image,
                ChatPart::Text("compare".into()),
                ChatPart::Image,
            ],
        );
        assert_eq!(
            m.content,
            format!("{IMAGE_PLACEHOLDER}compare{IMAGE_PLACEHOLDER}")
        );
        // Token level: 7 = start, 9 = pad, 8 = end.
        let toks = [1, 7, 9, 8, 2, 7, 9, 8, 3];
        let out = expand_image_pads(&toks, 9, &[4, 6]).expect("expands");
        assert_eq!(out.len(), toks.len() + 3 + 5);
        assert_eq!(&out[..7], &[1, 7, 9, 9, 9, 9, 8]);
        assert_eq!(out.iter().filter(|&&t| t == 9).count(), 10);
        assert_eq!(out.last(), Some(&3));
        assert!(matches!(
            expand_image_pads(&toks, 9, &[4]),
            Err(RuntimeError::InvalidRequest(_))
        ));
    }

    #[test]
    fn missing_files_are_typed_errors() {
        match TextCodec::load(&fixture("tiny-bare-text")) {
            Err(RuntimeError::File { what, .. }) => assert_eq!(what, "tokenizer"),
            other => panic!("expected File error, got {other:?}"),
        }
    }
}
