//! The Qwen3.5/3.8 vision tower (`model.visual.*`, qwen-spec §6), computed on any backend with
//! `VisionOps` (f32 activations and weights).
//!
//! * [`config`]: `vision_config` of `config.json` ([`VisionConfig`]) and the image processor's
//!   `preprocessor_config.json` ([`PreprocessorConfig`]).
//! * [`preprocess`]: decode (PNG, JPEG, WebP), smart-resize to multiples of patch·merge with
//!   Pillow's exact bicubic resampler, normalise, duplicate to the temporal frames and patchify in
//!   HF's order → [`PreprocessedImage`].
//! * [`tower`]: [`VisionTower`] (patch embed, resampled learned positions, ViT blocks with 2-D
//!   rotary, the 2×2 merger). [`VisionTower::encode_on`] runs it on a backend (weights uploaded
//!   per call); [`VisionTower::upload`] + [`VisionTower::encode_with`] keep them uploaded.
//!
//! Multimodal M-RoPE positions live in [`crate::rope_index`].

pub mod config;
mod error;
pub mod preprocess;
mod resample;
pub mod tower;
mod weights;

pub use config::{PreprocessorConfig, Resample, VisionConfig};
pub use error::VisionError;
pub use preprocess::{decode_image, preprocess, preprocess_rgb, smart_resize, PreprocessedImage};
pub use tower::{DeviceVisionWeights, VisionBackend, VisionTower};
