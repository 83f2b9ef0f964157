//! Typed errors of the vision path. Never a panic on user input (image bytes, configs).

use crate::error::ModelError;
use std::path::PathBuf;

/// Everything that can go wrong decoding, preprocessing or encoding an image.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    /// A file (config, preprocessor config, image) could not be read.
    #[error("cannot read `{path}`: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is not valid JSON.
    #[error("`{path}` is not valid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// A config key is missing, mistyped or inconsistent.
    #[error("`{path}`: key `{key}`: {detail}")]
    Config {
        path: PathBuf,
        key: String,
        detail: String,
    },
    /// The bytes are not an image in a supported format (PNG, JPEG, WebP).
    #[error("unsupported image format: {0}")]
    UnsupportedFormat(String),
    /// The bytes look like a supported format but do not decode.
    #[error("malformed image: {0}")]
    Decode(String),
    /// The image's size cannot be preprocessed (empty, or aspect ratio above 200).
    #[error("image of {width}×{height} pixels cannot be preprocessed: {detail}")]
    BadSize {
        width: usize,
        height: usize,
        detail: String,
    },
    /// The image exceeds the decoder limits (side or decoded bytes).
    #[error("image too large: {0}")]
    TooLarge(String),
    /// A caller passed inconsistent inputs (wrong pixel count, grid not matching the tower).
    #[error("invalid vision input: {0}")]
    Input(String),
    /// Loading `model.visual.*` weights failed.
    #[error(transparent)]
    Weights(#[from] ModelError),
    /// A backend op of the encoder failed (device error, out of memory, capability).
    #[error("vision encoder: {0}")]
    Op(#[from] kvstream_memory_contracts::error::OpError),
}
