//! `config.json` of a Qwen3.5/3.8 model directory, in both forms HF writes:
//! the `qwen3_5` wrapper (`text_config` + `vision_config`) and the bare `qwen3_5_text` config.
//!
//! Every missing key, unknown value or inconsistent shape is a [`ModelError`] that names the key
//! and the file.

use crate::error::ModelError;
use kvstream_memory_contracts::ops::RopeConfig;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Kind of a decoder layer's mixer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`linear_attention`).
    Linear,
    /// Gated full attention (`full_attention`).
    Full,
}

/// Activation of the GDN gated RMSNorm gate (`output_gate_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateActivation {
    /// `swish` / `silu` (Qwen3.5, Qwen3.8).
    Silu,
    /// `sigmoid`.
    Sigmoid,
}

/// The text model's configuration (all fields validated for consistency).
#[derive(Debug, Clone, PartialEq)]
pub struct QwenConfig {
    /// The `config.json` it was read from.
    pub path: PathBuf,
    /// Top-level `model_type` (`qwen3_5` or `qwen3_5_text`).
    pub model_type: String,
    /// Residual width H.
    pub hidden_size: usize,
    /// Embedding / lm_head rows V.
    pub vocab_size: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Decoder layers (MTP not counted).
    pub num_hidden_layers: usize,
    /// One entry per decoder layer.
    pub layer_types: Vec<LayerType>,
    /// Full-attention query heads.
    pub num_attention_heads: usize,
    /// Full-attention KV heads (divides the query heads).
    pub num_key_value_heads: usize,
    /// Full-attention head size.
    pub head_dim: usize,
    /// GDN q/k heads.
    pub linear_num_key_heads: usize,
    /// GDN v heads (a multiple of the q/k heads).
    pub linear_num_value_heads: usize,
    /// GDN q/k head size.
    pub linear_key_head_dim: usize,
    /// GDN v head size.
    pub linear_value_head_dim: usize,
    /// GDN causal conv length K.
    pub linear_conv_kernel_dim: usize,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Fraction of head_dim that is rotated.
    pub partial_rotary_factor: f32,
    /// RoPE parameters (rotary dims, θ, M-RoPE sections).
    pub rope: RopeConfig,
    /// lm_head shares the embedding table (wrapper-level key wins).
    pub tie_word_embeddings: bool,
    /// MTP layers in the checkpoint (0 = none).
    pub mtp_num_hidden_layers: usize,
    /// End-of-sequence ids (wrapper-level value wins).
    pub eos_token_ids: Vec<u32>,
    /// Native context length.
    pub max_position_embeddings: usize,
    /// Gate activation of the GDN gated norm.
    pub output_gate_type: GateActivation,
}

struct Reader<'a> {
    path: &'a Path,
    obj: &'a Map<String, Value>,
}

impl Reader<'_> {
    fn err(&self, key: &str, detail: impl Into<String>) -> ModelError {
        ModelError::config(self.path, key, detail)
    }
    fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a non-negative integer, got {v}"))),
        }
    }
    fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)?.ok_or_else(|| self.err(key, "missing"))
    }
    fn positive(&self, key: &str) -> Result<usize, ModelError> {
        let v = self.usize(key)?;
        if v == 0 {
            return Err(self.err(key, "must be > 0"));
        }
        Ok(v)
    }
    fn opt_f64(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a number, got {v}"))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected true/false, got {v}"))),
        }
    }
    fn opt_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, got {v}"))),
        }
    }
    fn opt_obj(&self, key: &str) -> Result<Option<Reader<'_>>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => Ok(Some(Reader {
                path: self.path,
                obj: o,
            })),
            Some(v) => Err(self.err(key, format!("expected an object, got {v}"))),
        }
    }
    /// `eos_token_id`: an integer or a list of integers.
    fn opt_ids(&self, key: &str) -> Result<Option<Vec<u32>>, ModelError> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| self.err(key, format!("expected token ids, got {v}")))
        };
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a.iter().map(one).collect::<Result<_, _>>().map(Some),
            Some(v) => Ok(Some(vec![one(v)?])),
        }
    }
}

impl QwenConfig {
    /// Reads `dir/config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config JSON text; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, ModelError> {
        let root: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(root) = &root else {
            return Err(ModelError::config(path, "<root>", "expected a JSON object"));
        };
        let top = Reader { path, obj: root };
        let model_type = top
            .opt_str("model_type")?
            .ok_or_else(|| top.err("model_type", "missing"))?
            .to_string();
        let (text_cfg, wrapper) = match model_type.as_str() {
            "qwen3_5" => (
                top.opt_obj("text_config")?
                    .ok_or_else(|| top.err("text_config", "missing (model_type qwen3_5)"))?,
                Some(&top),
            ),
            "qwen3_5_text" => (Reader { path, obj: root }, None),
            other => {
                return Err(ModelError::UnknownModelType {
                    path: path.to_path_buf(),
                    model_type: other.to_string(),
                })
            }
        };
        Self::from_text(&text_cfg, wrapper, model_type)
    }

    fn from_text(
        t: &Reader<'_>,
        wrapper: Option<&Reader<'_>>,
        model_type: String,
    ) -> Result<Self, ModelError> {
        let hidden_size = t.positive("hidden_size")?;
        let vocab_size = t.positive("vocab_size")?;
        let intermediate_size = t.positive("intermediate_size")?;
        let num_hidden_layers = t.positive("num_hidden_layers")?;
        let num_attention_heads = t.positive("num_attention_heads")?;
        let num_key_value_heads = t.positive("num_key_value_heads")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(t.err(
                "num_key_value_heads",
                format!("{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        let head_dim = match t.opt_usize("head_dim")? {
            Some(0) => return Err(t.err("head_dim", "must be > 0")),
            Some(d) => d,
            None => hidden_size / num_attention_heads,
        };
        let linear_num_key_heads = t.positive("linear_num_key_heads")?;
        let linear_num_value_heads = t.positive("linear_num_value_heads")?;
        if linear_num_value_heads % linear_num_key_heads != 0 {
            return Err(t.err(
                "linear_num_value_heads",
                format!("{linear_num_value_heads} is not a multiple of linear_num_key_heads {linear_num_key_heads}"),
            ));
        }
        let linear_key_head_dim = t.positive("linear_key_head_dim")?;
        let linear_value_head_dim = t.positive("linear_value_head_dim")?;
        let linear_conv_kernel_dim = t.positive("linear_conv_kernel_dim")?;
        let rms_norm_eps = t.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32;
        let max_position_embeddings = t.positive("max_position_embeddings")?;

        let layer_types = match t.obj.get("layer_types") {
            Some(Value::Array(a)) => {
                let v = a
                    .iter()
                    .map(|e| match e.as_str() {
                        Some("linear_attention") => Ok(LayerType::Linear),
                        Some("full_attention") => Ok(LayerType::Full),
                        _ => Err(t.err(
                            "layer_types",
                            format!("unknown layer type {e} (expected linear_attention or full_attention)"),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if v.len() != num_hidden_layers {
                    return Err(t.err(
                        "layer_types",
                        format!(
                            "{} entries but num_hidden_layers is {num_hidden_layers}",
                            v.len()
                        ),
                    ));
                }
                v
            }
            None | Some(Value::Null) => {
                let interval = match t.opt_usize("full_attention_interval")? {
                    Some(0) => return Err(t.err("full_attention_interval", "must be > 0")),
                    Some(i) => i,
                    None => 4,
                };
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::Full
                        } else {
                            LayerType::Linear
                        }
                    })
                    .collect()
            }
            Some(v) => return Err(t.err("layer_types", format!("expected a list, got {v}"))),
        };

        // RoPE: rope_parameters (transformers 5), else rope_scaling + top-level rope_theta.
        let rp = t.opt_obj("rope_parameters")?;
        let rs = t.opt_obj("rope_scaling")?;
        let params = rp.as_ref().or(rs.as_ref());
        if let Some(p) = params {
            let ty = p.opt_str("rope_type")?.or(p.opt_str("type")?);
            if let Some(ty) = ty {
                if ty != "default" && ty != "mrope" {
                    return Err(p.err(
                        "rope_type",
                        format!("unsupported rope_type `{ty}` (only default/mrope)"),
                    ));
                }
            }
        }
        let theta = match params
            .map(|p| p.opt_f64("rope_theta"))
            .transpose()?
            .flatten()
        {
            Some(v) => v,
            None => t.opt_f64("rope_theta")?.ok_or_else(|| {
                t.err(
                    "rope_parameters.rope_theta",
                    "missing (no rope_parameters.rope_theta nor rope_theta)",
                )
            })?,
        };
        let partial_rotary_factor = match t.opt_f64("partial_rotary_factor")? {
            Some(f) => f,
            None => params
                .map(|p| p.opt_f64("partial_rotary_factor"))
                .transpose()?
                .flatten()
                .unwrap_or(0.25),
        } as f32;
        let rotary_dim = (head_dim as f32 * partial_rotary_factor) as usize;
        if rotary_dim == 0 || rotary_dim % 2 != 0 || rotary_dim > head_dim {
            return Err(t.err(
                "partial_rotary_factor",
                format!("{partial_rotary_factor} × head_dim {head_dim} = {rotary_dim} rotary dims (must be even, > 0, <= head_dim)"),
            ));
        }
        let mrope_section = match params.and_then(|p| p.obj.get("mrope_section")) {
            None | Some(Value::Null) => [rotary_dim / 2, 0, 0],
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(|x| x.as_u64().is_some()) => {
                let s: Vec<usize> = a
                    .iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as usize)
                    .collect();
                [s[0], s[1], s[2]]
            }
            Some(v) => return Err(t.err("mrope_section", format!("expected 3 integers, got {v}"))),
        };
        if mrope_section.iter().sum::<usize>() != rotary_dim / 2 {
            return Err(t.err(
                "mrope_section",
                format!(
                    "{mrope_section:?} must sum to rotary_dim / 2 = {}",
                    rotary_dim / 2
                ),
            ));
        }
        let interleaved = params
            .map(|p| p.opt_bool("mrope_interleaved"))
            .transpose()?
            .flatten()
            .unwrap_or(false);
        let rope = RopeConfig {
            rotary_dim,
            theta: theta as f32,
            mrope_section,
            interleaved,
        };

        let tie_word_embeddings = match wrapper
            .map(|w| w.opt_bool("tie_word_embeddings"))
            .transpose()?
            .flatten()
        {
            Some(b) => b,
            None => t.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        };
        let eos_token_ids = match wrapper
            .map(|w| w.opt_ids("eos_token_id"))
            .transpose()?
            .flatten()
        {
            Some(v) => v,
            None => t.opt_ids("eos_token_id")?.unwrap_or_default(),
        };
        let mtp_num_hidden_layers = t.opt_usize("mtp_num_hidden_layers")?.unwrap_or(0);
        let output_gate_type = match t.opt_str("output_gate_type")? {
            None | Some("swish") | Some("silu") => GateActivation::Silu,
            Some("sigmoid") => GateActivation::Sigmoid,
            Some(o) => {
                return Err(t.err(
                    "output_gate_type",
                    format!("unknown `{o}` (expected swish, silu or sigmoid)"),
                ))
            }
        };
        Ok(Self {
            path: t.path.to_path_buf(),
            model_type,
            hidden_size,
            vocab_size,
            intermediate_size,
            num_hidden_layers,
            layer_types,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            linear_num_key_heads,
            linear_num_value_heads,
            linear_key_head_dim,
            linear_value_head_dim,
            linear_conv_kernel_dim,
            rms_norm_eps,
            partial_rotary_factor,
            rope,
            tie_word_embeddings,
            mtp_num_hidden_layers,
            eos_token_ids,
            max_position_embeddings,
            output_gate_type,
        })
    }

    /// Number of full-attention layers (the MTP layer, if any, is attention layer this index).
    pub fn n_attention_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|t| **t == LayerType::Full)
            .count()
    }
    /// Number of Gated DeltaNet layers.
    pub fn n_linear_layers(&self) -> usize {
        self.num_hidden_layers - self.n_attention_layers()
    }
    pub fn hidden_size(&self) -> usize {
        self.hidden_size
    }
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
    pub fn num_attention_heads(&self) -> usize {
        self.num_attention_heads
    }
    pub fn num_key_value_heads(&self) -> usize {
        self.num_key_value_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }
    pub fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings
    }
    pub fn mtp_num_hidden_layers(&self) -> usize {
        self.mtp_num_hidden_layers
    }
    pub fn rope(&self) -> &RopeConfig {
        &self.rope
    }
    /// Channels of the GDN causal conv (q, k and v together).
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Softmax scale of full attention (1/sqrt(head_dim)).
    pub fn attention_scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BARE: &str = r#"{
        "model_type": "qwen3_5_text", "hidden_size": 64, "vocab_size": 256,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": true},
        "eos_token_id": 7, "mtp_num_hidden_layers": 1, "output_gate_type": "swish"
    }"#;

    fn parse(s: &str) -> Result<QwenConfig, ModelError> {
        QwenConfig::from_json_str(s, Path::new("/m/config.json"))
    }

    fn edit(f: impl FnOnce(&mut Map<String, Value>)) -> String {
        let mut v: Value = serde_json::from_str(BARE).expect("json");
        if let Value::Object(o) = &mut v {
            f(o);
        }
        v.to_string()
    }

    fn key_err(s: &str, key: &str) {
        match parse(s) {
            Err(ModelError::Config { key: k, path, .. }) => {
                assert_eq!(k, key);
                assert_eq!(path, Path::new("/m/config.json"));
                let msg = parse(s).err().map(|e| e.to_string()).unwrap_or_default();
                assert!(msg.contains(key) && msg.contains("/m/config.json"), "{msg}");
            }
            other => panic!("expected a Config error for `{key}`, got {other:?}"),
        }
    }

    #[test]
    fn bare_text_config_parses() {
        let c = parse(BARE).expect("valid");
        assert_eq!(c.n_attention_layers(), 1);
        assert_eq!(c.rope.rotary_dim, 8);
        assert_eq!(c.rope.mrope_section, [2, 1, 1]);
        assert!(c.rope.interleaved);
        assert_eq!(c.eos_token_ids, vec![7]);
        assert_eq!(c.linear_conv_dim(), 2 * 32 + 32);
        assert!(!c.tie_word_embeddings);
    }

    #[test]
    fn wrapper_config_takes_wrapper_eos_and_tie() {
        let text: Value = serde_json::from_str(BARE).expect("json");
        let w = serde_json::json!({
            "model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1},
            "eos_token_id": [9, 10], "tie_word_embeddings": true
        });
        let c = parse(&w.to_string()).expect("valid");
        assert_eq!(c.eos_token_ids, vec![9, 10]);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.model_type, "qwen3_5");
        let w2 = serde_json::json!({"model_type": "qwen3_5"});
        key_err(&w2.to_string(), "text_config");
    }

    #[test]
    fn interval_schedule_and_old_rope_forms() {
        let s = edit(|o| {
            o.remove("layer_types");
            o.insert("full_attention_interval".into(), 2.into());
            o.remove("rope_parameters");
            o.insert("rope_theta".into(), 10000.0.into());
            o.insert("partial_rotary_factor".into(), 0.5.into());
            o.insert(
                "rope_scaling".into(),
                serde_json::json!({"type": "mrope", "mrope_section": [4, 2, 2]}),
            );
        });
        let c = parse(&s).expect("valid");
        assert_eq!(
            c.layer_types,
            vec![
                LayerType::Linear,
                LayerType::Full,
                LayerType::Linear,
                LayerType::Full
            ]
        );
        assert_eq!(c.rope.theta, 10000.0);
        assert_eq!(c.rope.rotary_dim, 16);
        assert!(!c.rope.interleaved);
    }

    #[test]
    fn each_error_names_key_and_file() {
        key_err(
            &edit(|o| {
                o.remove("hidden_size");
            }),
            "hidden_size",
        );
        key_err(
            &edit(|o| {
                o.insert("num_key_value_heads".into(), 3.into());
            }),
            "num_key_value_heads",
        );
        key_err(
            &edit(|o| {
                o.insert("linear_num_value_heads".into(), 3.into());
            }),
            "linear_num_value_heads",
        );
        key_err(
            &edit(|o| {
                o.insert("layer_types".into(), serde_json::json!(["full_attention"]));
            }),
            "layer_types",
        );
        key_err(
            &edit(|o| {
                o.insert(
                    "layer_types".into(),
                    serde_json::json!(["x", "x", "x", "x"]),
                );
            }),
            "layer_types",
        );
        key_err(
            &edit(|o| {
                o.insert("vocab_size".into(), "big".into());
            }),
            "vocab_size",
        );
        key_err(
            &edit(|o| {
                o.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_theta": 1e4, "mrope_section": [1, 1, 1]}),
                );
            }),
            "mrope_section",
        );
        key_err(
            &edit(|o| {
                o.insert(
                    "rope_parameters".into(),
                    serde_json::json!({"rope_type": "yarn", "rope_theta": 1e4}),
                );
            }),
            "rope_type",
        );
        key_err(
            &edit(|o| {
                o.remove("rope_parameters");
            }),
            "rope_parameters.rope_theta",
        );
        key_err(
            &edit(|o| {
                o.insert("output_gate_type".into(), "relu".into());
            }),
            "output_gate_type",
        );
        key_err(
            &edit(|o| {
                o.insert("eos_token_id".into(), serde_json::json!(["a"]));
            }),
            "eos_token_id",
        );
        key_err(
            &edit(|o| {
                o.insert("partial_rotary_factor".into(), 0.01.into());
            }),
            "partial_rotary_factor",
        );
        assert!(matches!(
            parse(&edit(|o| {
                o.insert("model_type".into(), "llama".into());
            })),
            Err(ModelError::UnknownModelType { .. })
        ));
        assert!(matches!(parse("{"), Err(ModelError::Json { .. })));
        assert!(matches!(
            QwenConfig::from_model_dir(Path::new("/nonexistent-dir")),
            Err(ModelError::Io { .. })
        ));
    }
}
