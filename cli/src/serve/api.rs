//! OpenAI wire types (the subset kvstream serves) and request validation.

use super::images::{parse_image_url, ImageRef};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

/// A content part of a chat message.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        text: String,
    },
    /// `{"url": "data:image/png;base64,..."}` (or the URL as a bare string).
    ImageUrl {
        image_url: Value,
    },
    #[serde(other)]
    Other,
}

/// Chat message content: a string or parts.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<StopSpec>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// llama.cpp extension: keep generating after EOS.
    pub ignore_eos: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Accepted for compatibility; one model is served.
    #[serde(default)]
    #[allow(dead_code)]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `prompt`: a string, a list with one string, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Accepted for compatibility; one model is served.
    #[serde(default)]
    #[allow(dead_code)]
    pub model: Option<String>,
    pub prompt: PromptSpec,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Validated generation parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repeat_penalty: f32,
    pub stream: bool,
    pub include_usage: bool,
    pub ignore_eos: bool,
}

/// A 4xx error in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            param,
        }
    }
    pub fn body(&self) -> Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": Value::Null,
            }
        })
    }
}

impl SamplingFields {
    /// Checks ranges and unsupported options; `default_max` applies when no limit is given.
    pub fn validate(&self, default_max: usize) -> Result<GenParams, ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    format!(
                        "n = {n} is not supported: kvstream runs one sequence at a time; use n = 1"
                    ),
                    Some("n"),
                ));
            }
        }
        let max = self.max_completion_tokens.or(self.max_tokens);
        let max_tokens = match max {
            None => default_max,
            Some(m) if m <= 0 => {
                return Err(ApiError::invalid(
                    format!("max_tokens must be > 0, got {m}"),
                    Some("max_tokens"),
                ))
            }
            Some(m) => m as usize,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature must be in [0, 2], got {temperature}"),
                Some("temperature"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                format!("top_p must be in (0, 1], got {top_p}"),
                Some("top_p"),
            ));
        }
        let top_k = match self.top_k {
            None => 0,
            Some(k) if k < 0 => {
                return Err(ApiError::invalid(
                    format!("top_k must be >= 0, got {k}"),
                    Some("top_k"),
                ))
            }
            Some(k) => k as usize,
        };
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid(
                format!("min_p must be in [0, 1], got {min_p}"),
                Some("min_p"),
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(v) = v {
                if !(-2.0..=2.0).contains(&v) {
                    return Err(ApiError::invalid(
                        format!("{name} must be in [-2, 2], got {v}"),
                        None,
                    ));
                }
            }
        }
        let repeat_penalty = self.repeat_penalty.unwrap_or(1.0);
        if repeat_penalty <= 0.0 {
            return Err(ApiError::invalid(
                "repeat_penalty must be > 0",
                Some("repeat_penalty"),
            ));
        }
        let stop = self
            .stop
            .clone()
            .map(StopSpec::into_vec)
            .unwrap_or_default();
        if stop.len() > 4 || stop.iter().any(|s| s.is_empty()) {
            return Err(ApiError::invalid(
                "stop: at most 4 non-empty strings",
                Some("stop"),
            ));
        }
        Ok(GenParams {
            max_tokens,
            temperature,
            top_p,
            top_k,
            min_p,
            seed: self.seed,
            stop,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repeat_penalty,
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// The chat messages of a request as (role, content) pairs, each image part rendered as
/// [`kvstream_runtime::IMAGE_PLACEHOLDER`], and the images in order.
pub type ChatInput = (Vec<(String, String)>, Vec<ImageRef>);

fn image_url_of(v: &Value) -> Result<&str, ApiError> {
    match v {
        Value::String(s) => Ok(s),
        Value::Object(o) => o.get("url").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                "image_url must be {\"url\": \"data:image/...;base64,...\"} or a string",
                Some("messages"),
            )
        }),
        _ => Err(ApiError::invalid(
            "image_url must be an object with a `url` string",
            Some("messages"),
        )),
    }
}

impl ChatRequest {
    /// (role, content) pairs and the images of `image_url` parts (several per message allowed;
    /// see [`ChatInput`]). Remote URLs and malformed data URLs are 400s here.
    pub fn messages_and_images(&self) -> Result<ChatInput, ApiError> {
        let mut images = Vec::new();
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages must not be empty",
                Some("messages"),
            ));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for m in &self.messages {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer" | "tool"
            ) {
                return Err(ApiError::invalid(
                    format!("unknown role `{}`", m.role),
                    Some("messages"),
                ));
            }
            let text = match &m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match p {
                            ContentPart::Text { text } => s.push_str(text),
                            ContentPart::ImageUrl { image_url } => {
                                images.push(parse_image_url(image_url_of(image_url)?)?);
                                s.push_str(kvstream_runtime::IMAGE_PLACEHOLDER);
                            }
                            ContentPart::Other => {
                                return Err(ApiError::invalid(
                                    "unsupported content part type",
                                    Some("messages"),
                                ))
                            }
                        }
                    }
                    s
                }
            };
            out.push((m.role.clone(), text));
        }
        Ok((out, images))
    }
}

/// `usage` of a response.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedDetails,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct CachedDetails {
    pub cached_tokens: usize,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize, cached: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: CachedDetails {
                cached_tokens: cached,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(json: &str) -> Result<SamplingFields, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn validation_rejects_bad_values_with_named_params() {
        let e = fields(r#"{"max_tokens": 0}"#)
            .expect("parse")
            .validate(16)
            .err();
        assert_eq!(e.map(|e| e.param), Some(Some("max_tokens")));
        let e = fields(r#"{"n": 2}"#).expect("parse").validate(16).err();
        assert_eq!(e.map(|e| e.param), Some(Some("n")));
        let e = fields(r#"{"temperature": 3.5}"#)
            .expect("parse")
            .validate(16)
            .err();
        assert_eq!(e.map(|e| e.param), Some(Some("temperature")));
        assert!(
            fields(r#"{"max_tokens": "ten"}"#).is_err(),
            "wrong type is a parse error"
        );
        let p = fields(r#"{"max_tokens": 5, "stop": "x", "temperature": 0}"#)
            .expect("parse")
            .validate(16)
            .expect("valid");
        assert_eq!(p.max_tokens, 5);
        assert_eq!(p.stop, vec!["x".to_string()]);
        assert_eq!(p.temperature, 0.0);
    }

    #[test]
    fn image_parts_become_placeholders_in_order() {
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw=="}},{"type":"text","text":"and"},{"type":"image_url","image_url":"/tmp/x.png"}]}]}"#,
        )
        .expect("parse");
        let (msgs, imgs) = r.messages_and_images().expect("valid");
        let ph = kvstream_runtime::IMAGE_PLACEHOLDER;
        assert_eq!(msgs, vec![("user".into(), format!("{ph}and{ph}"))]);
        assert_eq!(
            imgs,
            vec![
                ImageRef::Data(vec![0x89, b'P', b'N', b'G']),
                ImageRef::File("/tmp/x.png".into())
            ]
        );
        let r: ChatRequest = serde_json::from_str(
            r#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:,"}}]}]}"#,
        )
        .expect("parse");
        assert!(r.messages_and_images().is_err(), "not base64");
        let r: ChatRequest =
            serde_json::from_str(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
                .expect("parse");
        assert_eq!(
            r.messages_and_images().ok(),
            Some((vec![("user".into(), "hi".into())], vec![]))
        );
    }
}
