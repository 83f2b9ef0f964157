//! The runtime's typed errors.

use kvstream_memory_contracts::error::{
    ArenaError, AttentionError, CapabilityError, FormatError, GeometryError, HostError, OpError,
    SpanError, TransferError,
};
use std::path::PathBuf;

/// Every error the runtime returns. No runtime path panics on user or caller input.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A size string such as `2240MiB` could not be parsed.
    #[error("invalid size `{input}`: {reason}")]
    InvalidSize { input: String, reason: String },

    /// The arena cannot hold the layout of `phase` (admission, checked before weights load).
    #[error("kv arena of {arena} bytes is too small for the {phase} phase: it needs {required} bytes ({missing} bytes missing)")]
    ArenaTooSmall {
        /// The phase whose layout does not fit (`prefill`, `decode`, ...).
        phase: String,
        /// Bytes that phase needs in the arena.
        required: u64,
        /// Bytes of the arena.
        arena: u64,
        /// `required - arena`.
        missing: u64,
    },

    /// The backend cannot do something the configuration asks for (e.g. a K/V type pair).
    #[error(transparent)]
    Capability(#[from] CapabilityError),

    /// The requested context exceeds what the model supports.
    #[error("ctx_size {requested} exceeds the model's max_position_embeddings {limit}")]
    ContextTooLarge { requested: usize, limit: usize },

    /// A prompt (plus what it must generate) does not fit the context.
    #[error("prompt of {prompt} tokens does not fit the context of {ctx} tokens")]
    PromptTooLong { prompt: usize, ctx: usize },

    /// A request is malformed (empty prompt, token id out of range, bad sampling value...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    /// The engine configuration is invalid.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    /// A required file is missing or unreadable.
    #[error("{what} `{}`: {detail}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },

    /// Tokenizer failure.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// Chat template failure.
    #[error("chat template: {0}")]
    Template(String),

    /// The model (config, weights or forward) failed.
    #[error("model: {0}")]
    Model(#[from] kvstream_model_qwen::ModelError),

    /// An image's vision loan (tower weights + encode workspace) does not fit the arena. Checked
    /// before anything changes: the session keeps its state.
    #[error("image {image} needs a vision loan of {needed} bytes but the arena has {available} bytes available; use a smaller image or a larger --kv-arena")]
    ImageTooLarge {
        /// Index of the image in the request.
        image: usize,
        /// Bytes of the loan (weights unless kept resident, plus the encode workspace).
        needed: u64,
        /// Bytes the arena can lend (the whole arena: the KV pool is suspended during a loan).
        available: u64,
    },

    /// An image could not be decoded or preprocessed, or the model has no vision tower.
    #[error("image: {0}")]
    Image(#[from] kvstream_model_qwen::VisionError),

    /// The placement policy could not produce a layout for the pool.
    #[error("placement: {0}")]
    Placement(String),

    /// The KV manager was used out of protocol (e.g. attend before begin_step).
    #[error("kv protocol: {0}")]
    Protocol(String),

    #[error(transparent)]
    Host(#[from] HostError),
    #[error(transparent)]
    Transfer(#[from] TransferError),
    #[error(transparent)]
    Attention(#[from] AttentionError),
    #[error(transparent)]
    Op(#[from] OpError),
    #[error(transparent)]
    Arena(#[from] ArenaError),
    #[error(transparent)]
    Span(#[from] SpanError),
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error(transparent)]
    Format(#[from] FormatError),
}

/// Short result alias.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
