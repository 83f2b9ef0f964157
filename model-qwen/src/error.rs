//! The model's typed errors.

use kvstream_memory_contracts::error::OpError;
use std::path::PathBuf;

/// Everything that can go wrong loading or running a Qwen model. Never a panic on user input.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("`{path}` is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("`{path}`: unknown model_type `{model_type}` (expected `qwen3_5` or `qwen3_5_text`)")]
    UnknownModelType { path: PathBuf, model_type: String },
    #[error("`{path}`: key `{key}`: {detail}")]
    Config {
        path: PathBuf,
        key: String,
        detail: String,
    },
    #[error("`{path}`: invalid safetensors: {detail}")]
    Safetensors { path: PathBuf, detail: String },
    #[error(
        "tensor `{name}` (expected shape {expected:?}) is missing from the checkpoint in `{dir}`"
    )]
    MissingTensor {
        name: String,
        expected: Vec<usize>,
        dir: PathBuf,
    },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor `{name}` has unsupported dtype {dtype} (expected F32, F16 or BF16)")]
    TensorDType { name: String, dtype: String },
    #[error("token id {token} at index {index} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error("invalid forward input: {0}")]
    Input(String),
    #[error("the model was loaded without an MTP head")]
    NoMtp,
    #[error(transparent)]
    Op(#[from] OpError),
    /// A tensor whose (quantized) bytes do not fit its format: the dims break the format's K
    /// rule, the byte length is wrong, or a conversion failed.
    #[error("tensor `{name}`: {source}")]
    WeightFormat {
        name: String,
        #[source]
        source: kvstream_memory_contracts::weight_format::WeightFormatError,
    },
    /// A quantized checkpoint's metadata entry for a tensor is missing or malformed.
    #[error("`{path}`: tensor `{name}`: bad quantization metadata: {detail}")]
    QuantMetadata {
        path: PathBuf,
        name: String,
        detail: String,
    },
    /// The scale tensor of an FP8 weight is missing or has the wrong shape/dtype.
    #[error("tensor `{name}`: scale tensor `{scale}`: {detail}")]
    ScaleTensor {
        name: String,
        scale: String,
        detail: String,
    },
    #[error("attention KV: {0}")]
    Kv(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl ModelError {
    pub(crate) fn config(
        path: &std::path::Path,
        key: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self::Config {
            path: path.to_path_buf(),
            key: key.into(),
            detail: detail.into(),
        }
    }
}
