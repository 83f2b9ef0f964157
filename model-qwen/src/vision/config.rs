//! Vision settings: `vision_config` (+ the wrapper's special token ids) of `config.json`, and
//! the image processor's `preprocessor_config.json`. Missing keys take HF's defaults; every
//! present-but-wrong key is a [`VisionError::Config`] naming the key and the file.

use super::error::VisionError;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Activation of the ViT blocks' MLP (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionAct {
    /// `gelu_pytorch_tanh` / `gelu_new` / `gelu_fast`: the tanh approximation.
    GeluTanh,
    /// `gelu`: exact (erf).
    GeluErf,
}

/// The vision tower's shape (`config.json` → `vision_config`) and the multimodal token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// ViT blocks.
    pub depth: usize,
    /// ViT width.
    pub hidden_size: usize,
    /// Attention heads (divides `hidden_size`; head size must be a multiple of 4).
    pub num_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// MLP activation.
    pub hidden_act: VisionAct,
    /// Input channels (3).
    pub in_channels: usize,
    /// Spatial patch side.
    pub patch_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Merger block side (2 → 2×2 patches per LLM token).
    pub spatial_merge_size: usize,
    /// Merger output width (= the text model's hidden size).
    pub out_hidden_size: usize,
    /// Rows of the learned position table (a perfect square).
    pub num_position_embeddings: usize,
    /// θ of the 2-D vision rotary.
    pub rope_theta: f32,
    /// `<|image_pad|>`.
    pub image_token_id: u32,
    /// `<|video_pad|>`.
    pub video_token_id: u32,
    /// `<|vision_start|>`.
    pub vision_start_token_id: u32,
    /// `<|vision_end|>`.
    pub vision_end_token_id: u32,
}

pub(crate) struct Obj<'a> {
    pub(crate) path: &'a Path,
    pub(crate) obj: &'a Map<String, Value>,
}

impl Obj<'_> {
    pub(crate) fn err(&self, key: &str, detail: impl Into<String>) -> VisionError {
        VisionError::Config {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            detail: detail.into(),
        }
    }
    fn get(&self, key: &str) -> Option<&Value> {
        match self.obj.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    pub(crate) fn usize_or(&self, key: &str, default: usize) -> Result<usize, VisionError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x > 0)
                .ok_or_else(|| self.err(key, format!("expected a positive integer, got {v}"))),
        }
    }
    pub(crate) fn f64_or(&self, key: &str, default: f64) -> Result<f64, VisionError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| self.err(key, format!("expected a number, got {v}"))),
        }
    }
    pub(crate) fn bool_or(&self, key: &str, default: bool) -> Result<bool, VisionError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(key, format!("expected true/false, got {v}"))),
        }
    }
    pub(crate) fn str_opt(&self, key: &str) -> Result<Option<&str>, VisionError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected a string, got {v}"))),
        }
    }
    pub(crate) fn obj_opt(&self, key: &str) -> Result<Option<Obj<'_>>, VisionError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(Obj {
                path: self.path,
                obj: o,
            })),
            Some(v) => Err(self.err(key, format!("expected an object, got {v}"))),
        }
    }
    pub(crate) fn f32x3_or(&self, key: &str, default: [f32; 3]) -> Result<[f32; 3], VisionError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Number(n)) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                Ok([x; 3])
            }
            Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                let v: Vec<f32> = a
                    .iter()
                    .filter_map(Value::as_f64)
                    .map(|x| x as f32)
                    .collect();
                Ok([v[0], v[1], v[2]])
            }
            Some(v) => Err(self.err(key, format!("expected 3 numbers, got {v}"))),
        }
    }
}

fn read_json(path: &Path) -> Result<Value, VisionError> {
    let text = std::fs::read_to_string(path).map_err(|source| VisionError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| VisionError::Json {
        path: path.to_path_buf(),
        source,
    })
}

impl VisionConfig {
    /// Reads `dir/config.json` (it must be the `qwen3_5` wrapper with a `vision_config`).
    pub fn from_model_dir(dir: &Path) -> Result<Self, VisionError> {
        let path = dir.join("config.json");
        let v = read_json(&path)?;
        Self::from_json_value(&v, &path)
    }

    /// Parses the wrapper config JSON; `path` is only used in error messages.
    pub fn from_json_value(root: &Value, path: &Path) -> Result<Self, VisionError> {
        let Value::Object(root) = root else {
            return Err(VisionError::Config {
                path: path.to_path_buf(),
                key: "<root>".into(),
                detail: "expected a JSON object".into(),
            });
        };
        let top = Obj { path, obj: root };
        let v = top
            .obj_opt("vision_config")?
            .ok_or_else(|| top.err("vision_config", "missing (not a vision-language config)"))?;
        let hidden_size = v.usize_or("hidden_size", 1152)?;
        let num_heads = v.usize_or("num_heads", 16)?;
        if hidden_size % num_heads != 0 || (hidden_size / num_heads) % 4 != 0 {
            return Err(v.err(
                "num_heads",
                format!("{num_heads} heads over width {hidden_size}: the head size must be an integer multiple of 4"),
            ));
        }
        let hidden_act = match v.str_opt("hidden_act")?.unwrap_or("gelu_pytorch_tanh") {
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => VisionAct::GeluTanh,
            "gelu" => VisionAct::GeluErf,
            o => return Err(v.err("hidden_act", format!("unsupported activation `{o}`"))),
        };
        let num_position_embeddings = v.usize_or("num_position_embeddings", 2304)?;
        let side = (num_position_embeddings as f64).sqrt().round() as usize;
        if side * side != num_position_embeddings {
            return Err(v.err(
                "num_position_embeddings",
                format!("{num_position_embeddings} is not a perfect square"),
            ));
        }
        if let Some(Value::Array(a)) = v.obj.get("deepstack_visual_indexes") {
            if !a.is_empty() {
                return Err(v.err(
                    "deepstack_visual_indexes",
                    "deepstack (Qwen3-VL) is not supported; Qwen3.5/3.8 have none",
                ));
            }
        }
        let rope_theta = match v.obj_opt("rope_parameters")? {
            Some(r) => r.f64_or("rope_theta", 10000.0)?,
            None => v.f64_or("rope_theta", 10000.0)?,
        } as f32;
        let id = |key: &str, default: usize| -> Result<u32, VisionError> {
            let x = top.usize_or(key, default)?;
            u32::try_from(x).map_err(|_| top.err(key, format!("{x} does not fit a token id")))
        };
        Ok(Self {
            depth: v.usize_or("depth", 27)?,
            hidden_size,
            num_heads,
            intermediate_size: v.usize_or("intermediate_size", 4304)?,
            hidden_act,
            in_channels: v.usize_or("in_channels", 3)?,
            patch_size: v.usize_or("patch_size", 16)?,
            temporal_patch_size: v.usize_or("temporal_patch_size", 2)?,
            spatial_merge_size: v.usize_or("spatial_merge_size", 2)?,
            out_hidden_size: v.usize_or("out_hidden_size", 3584)?,
            num_position_embeddings,
            rope_theta,
            image_token_id: id("image_token_id", 248056)?,
            video_token_id: id("video_token_id", 248057)?,
            vision_start_token_id: id("vision_start_token_id", 248053)?,
            vision_end_token_id: id("vision_end_token_id", 248054)?,
        })
    }

    /// Head size of the ViT attention.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
    /// Values per flattened patch: channels × temporal × patch².
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
    /// Side of the learned position grid.
    pub fn pos_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }
}

/// Resampling filter of the processor's resize (`resample`, PIL numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resample {
    /// `2`: bilinear (triangle filter, support 1).
    Bilinear,
    /// `3`: bicubic (Keys a = −0.5, support 2), the Qwen default.
    Bicubic,
}

/// The image processor settings (`preprocessor_config.json`, Qwen2-VL image processor).
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessorConfig {
    /// Spatial patch side.
    pub patch_size: usize,
    /// Frames per temporal patch (an image is repeated this many times).
    pub temporal_patch_size: usize,
    /// Merge block side; resized sides are multiples of `patch_size * merge_size`.
    pub merge_size: usize,
    /// Smallest allowed pixel count after resize (`size.shortest_edge` / `min_pixels`).
    pub min_pixels: usize,
    /// Largest allowed pixel count after resize (`size.longest_edge` / `max_pixels`).
    pub max_pixels: usize,
    /// Resize at all (`do_resize`).
    pub do_resize: bool,
    /// Resampling filter.
    pub resample: Resample,
    /// Multiply by `rescale_factor` (`do_rescale`).
    pub do_rescale: bool,
    /// Usually 1/255.
    pub rescale_factor: f32,
    /// Normalise with mean/std (`do_normalize`).
    pub do_normalize: bool,
    /// Per-channel mean (after rescale).
    pub image_mean: [f32; 3],
    /// Per-channel std (after rescale).
    pub image_std: [f32; 3],
}

impl Default for PreprocessorConfig {
    /// HF's `Qwen2VLImageProcessor` class defaults.
    fn default() -> Self {
        Self {
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            do_resize: true,
            resample: Resample::Bicubic,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: [0.481_454_66, 0.457_827_5, 0.408_210_73],
            image_std: [0.268_629_54, 0.261_302_6, 0.275_777_1],
        }
    }
}

impl PreprocessorConfig {
    /// Reads `dir/preprocessor_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, VisionError> {
        let path = dir.join("preprocessor_config.json");
        let v = read_json(&path)?;
        Self::from_json_value(&v, &path)
    }

    /// Parses the processor JSON; `path` is only used in error messages.
    pub fn from_json_value(root: &Value, path: &Path) -> Result<Self, VisionError> {
        let Value::Object(root) = root else {
            return Err(VisionError::Config {
                path: PathBuf::from(path),
                key: "<root>".into(),
                detail: "expected a JSON object".into(),
            });
        };
        let o = Obj { path, obj: root };
        let d = Self::default();
        let size = o.obj_opt("size")?;
        let (mut min_pixels, mut max_pixels) = (d.min_pixels, d.max_pixels);
        if let Some(s) = &size {
            min_pixels = s.usize_or("shortest_edge", min_pixels)?;
            max_pixels = s.usize_or("longest_edge", max_pixels)?;
        }
        min_pixels = o.usize_or("min_pixels", min_pixels)?;
        max_pixels = o.usize_or("max_pixels", max_pixels)?;
        if min_pixels > max_pixels {
            return Err(o.err(
                "size",
                format!("min pixels {min_pixels} > max pixels {max_pixels}"),
            ));
        }
        let resample = match o.usize_or("resample", 3)? {
            2 => Resample::Bilinear,
            3 => Resample::Bicubic,
            r => return Err(o.err("resample", format!("unsupported filter {r} (2 or 3)"))),
        };
        let image_std = o.f32x3_or("image_std", d.image_std)?;
        if image_std.iter().any(|s| !(s.is_finite() && *s != 0.0)) {
            return Err(o.err(
                "image_std",
                format!("{image_std:?} must be finite and non-zero"),
            ));
        }
        let cfg = Self {
            patch_size: o.usize_or("patch_size", d.patch_size)?,
            temporal_patch_size: o.usize_or("temporal_patch_size", d.temporal_patch_size)?,
            merge_size: o.usize_or("merge_size", d.merge_size)?,
            min_pixels,
            max_pixels,
            do_resize: o.bool_or("do_resize", true)?,
            resample,
            do_rescale: o.bool_or("do_rescale", true)?,
            rescale_factor: o.f64_or("rescale_factor", 1.0 / 255.0)? as f32,
            do_normalize: o.bool_or("do_normalize", true)?,
            image_mean: o.f32x3_or("image_mean", d.image_mean)?,
            image_std,
        };
        if o.bool_or("do_convert_rgb", true)? {
            Ok(cfg)
        } else {
            Err(o.err("do_convert_rgb", "only RGB input is supported"))
        }
    }

    /// The resize factor: resized sides are multiples of this.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Checks the processor agrees with the tower (patch, temporal patch, merge, channels).
    pub fn check_against(&self, v: &VisionConfig) -> Result<(), VisionError> {
        if self.patch_size != v.patch_size
            || self.temporal_patch_size != v.temporal_patch_size
            || self.merge_size != v.spatial_merge_size
            || v.in_channels != 3
        {
            return Err(VisionError::Input(format!(
                "processor patch {}/temporal {}/merge {} does not match the tower's {}/{}/{} (channels {})",
                self.patch_size,
                self.temporal_patch_size,
                self.merge_size,
                v.patch_size,
                v.temporal_patch_size,
                v.spatial_merge_size,
                v.in_channels
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("/m/x.json")
    }

    #[test]
    fn vision_config_defaults_and_errors() {
        let v = serde_json::json!({"vision_config": {"depth": 2, "hidden_size": 64, "num_heads": 4,
            "out_hidden_size": 64, "num_position_embeddings": 64}, "image_token_id": 250});
        let c = VisionConfig::from_json_value(&v, p()).expect("valid");
        assert_eq!((c.depth, c.head_dim(), c.pos_side()), (2, 16, 8));
        assert_eq!(c.image_token_id, 250);
        assert_eq!(c.vision_start_token_id, 248053);
        assert_eq!(c.patch_dim(), 3 * 2 * 16 * 16);
        for (bad, key) in [
            (
                serde_json::json!({"vision_config": {"num_position_embeddings": 60}}),
                "num_position_embeddings",
            ),
            (
                serde_json::json!({"vision_config": {"hidden_size": 64, "num_heads": 3}}),
                "num_heads",
            ),
            (
                serde_json::json!({"vision_config": {"hidden_act": "relu"}}),
                "hidden_act",
            ),
            (
                serde_json::json!({"vision_config": {"deepstack_visual_indexes": [1]}}),
                "deepstack_visual_indexes",
            ),
            (serde_json::json!({"text_config": {}}), "vision_config"),
        ] {
            match VisionConfig::from_json_value(&bad, p()) {
                Err(VisionError::Config { key: k, .. }) => assert_eq!(k, key),
                other => panic!("expected a Config error for {key}, got {other:?}"),
            }
        }
    }

    #[test]
    fn preprocessor_config_reads_size_and_overrides() {
        let v = serde_json::json!({"size": {"shortest_edge": 100, "longest_edge": 5000},
            "patch_size": 16, "image_mean": [0.5, 0.5, 0.5], "image_std": 0.25, "max_pixels": 6000});
        let c = PreprocessorConfig::from_json_value(&v, p()).expect("valid");
        assert_eq!((c.min_pixels, c.max_pixels, c.factor()), (100, 6000, 32));
        assert_eq!(c.image_std, [0.25; 3]);
        let bad = serde_json::json!({"resample": 1});
        assert!(matches!(
            PreprocessorConfig::from_json_value(&bad, p()),
            Err(VisionError::Config { .. })
        ));
        let bad = serde_json::json!({"image_std": [0.5, 0.0, 0.5]});
        assert!(matches!(
            PreprocessorConfig::from_json_value(&bad, p()),
            Err(VisionError::Config { .. })
        ));
    }
}
