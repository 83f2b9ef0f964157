//! Image → [`PreprocessedImage`], exactly as HF's Qwen2-VL image processor (PIL backend) does
//! it for Qwen3.5/3.8: convert to RGB (transparency composited onto white), smart-resize to multiples of
//! patch·merge within [min, max] pixels (Pillow resampling, [`super::resample`]), rescale,
//! normalise with mean/std, repeat to `temporal_patch_size` frames, patchify with every
//! merge×merge block of patches as consecutive rows.

use super::config::PreprocessorConfig;
use super::error::VisionError;
use super::resample::resize_rgb8;
use image::ImageFormat;

/// A preprocessed image: flattened patches in HF's order plus its grid.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessedImage {
    /// `[n_patches, patch_dim]` row-major; `patch_dim` = 3 × temporal × patch².
    /// Row order: (block row, block col, row in block, col in block); within a row:
    /// (channel, frame, y, x).
    pub pixels: Vec<f32>,
    /// `(t, h, w)` in patches (t = 1 for an image).
    pub grid_thw: [usize; 3],
    /// Values per patch row.
    pub patch_dim: usize,
    /// Height and width after the resize, in pixels.
    pub resized_hw: [usize; 2],
}

impl PreprocessedImage {
    /// Number of patches (`t·h·w`).
    pub fn n_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }
    /// Number of LLM tokens (`<|image_pad|>`) after the `merge`×`merge` merger.
    pub fn n_tokens(&self, merge: usize) -> usize {
        self.n_patches() / (merge * merge).max(1)
    }
}

/// A decoded RGB8 image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    /// Width in pixels.
    pub width: usize,
    /// Height in pixels.
    pub height: usize,
    /// Interleaved RGB, row-major, `width·height·3` bytes.
    pub data: Vec<u8>,
}

/// Decodes PNG, JPEG or WebP bytes to RGB8 (transparency composited onto white as HF's
/// `convert_to_rgb` does, grey expanded, 16-bit narrowed).
/// Any other format, or bytes that do not decode, is a typed error.
pub fn decode_image(bytes: &[u8]) -> Result<RgbImage, VisionError> {
    let _s = tracing::debug_span!("vision_decode", bytes = bytes.len()).entered();
    let format = image::guess_format(bytes)
        .map_err(|e| VisionError::UnsupportedFormat(format!("unrecognised image bytes ({e})")))?;
    if !matches!(
        format,
        ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP
    ) {
        return Err(VisionError::UnsupportedFormat(format!(
            "{format:?} (supported: PNG, JPEG, WebP)"
        )));
    }
    let mut reader = image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    let mut limits = image::Limits::default();
    limits.max_image_width = Some(MAX_SIDE);
    limits.max_image_height = Some(MAX_SIDE);
    limits.max_alloc = Some(MAX_DECODE_BYTES);
    reader.limits(limits);
    let img = reader.decode().map_err(|e| match e {
        image::ImageError::Limits(l) => VisionError::TooLarge(format!(
            "{l} (limits: {MAX_SIDE} px per side, {MAX_DECODE_BYTES} bytes decoded)"
        )),
        e => VisionError::Decode(format!("{format:?}: {e}")),
    })?;
    let (width, height) = (img.width() as usize, img.height() as usize);
    let data = if img.color().has_alpha() {
        composite_on_white(&img.to_rgba8().into_raw())
    } else {
        img.to_rgb8().into_raw()
    };
    Ok(RgbImage {
        width,
        height,
        data,
    })
}

/// HF's `convert_to_rgb`: transparency is composited onto opaque white with Pillow's
/// `Image.alpha_composite` integer arithmetic (7-bit fixed point, rounding division by 255).
fn composite_on_white(rgba: &[u8]) -> Vec<u8> {
    const PREC: u32 = 7;
    let div255 = |a: u32| ((a >> 8) + a) >> 8;
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3);
    for px in rgba.chunks_exact(4) {
        let sa = u32::from(px[3]);
        if sa == 0 {
            out.extend_from_slice(&[255, 255, 255]);
            continue;
        }
        // Background alpha is 255: blend = 255·(255 − sa), outa255 = sa·255 + blend.
        let outa255 = sa * 255 + 255 * (255 - sa);
        let coef1 = sa * 255 * 255 * (1 << PREC) / outa255;
        let coef2 = 255 * (1 << PREC) - coef1;
        for &c in &px[..3] {
            let tmp = u32::from(c) * coef1 + 255 * coef2;
            out.push((div255(tmp + (0x80 << PREC)) >> PREC) as u8);
        }
    }
    out
}

/// Largest accepted image side in pixels (decoder limit; larger images are a typed error).
pub const MAX_SIDE: u32 = 16384;
/// Largest decoder allocation in bytes.
pub const MAX_DECODE_BYTES: u64 = 512 << 20;

fn py_round(x: f64) -> f64 {
    // Python's round(): half to even.
    x.round_ties_even()
}

/// HF `smart_resize`: the (height, width) after resizing, both multiples of `factor`, pixel count
/// within [`min_pixels`, `max_pixels`] where possible, aspect ratio kept as closely as possible.
/// Errors when a side is zero or the aspect ratio exceeds 200.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize), VisionError> {
    let bad = |detail: String| VisionError::BadSize {
        width,
        height,
        detail,
    };
    if height == 0 || width == 0 || factor == 0 {
        return Err(bad("empty image".into()));
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        return Err(bad(format!("aspect ratio {ratio:.1} is above 200")));
    }
    let mut h_bar = (py_round(h / f) * f) as usize;
    let mut w_bar = (py_round(w / f) * f) as usize;
    if h_bar * w_bar > max_pixels {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        h_bar = factor.max(((h / beta / f).floor() * f) as usize);
        w_bar = factor.max(((w / beta / f).floor() * f) as usize);
    } else if h_bar * w_bar < min_pixels {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = ((h * beta / f).ceil() * f) as usize;
        w_bar = ((w * beta / f).ceil() * f) as usize;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(bad(format!("resizes to {w_bar}×{h_bar}")));
    }
    Ok((h_bar, w_bar))
}

/// Decodes `bytes` and preprocesses the image ([`decode_image`] then [`preprocess_rgb`]).
pub fn preprocess(
    bytes: &[u8],
    cfg: &PreprocessorConfig,
) -> Result<PreprocessedImage, VisionError> {
    preprocess_rgb(&decode_image(bytes)?, cfg)
}

/// Preprocesses a decoded RGB image (resize, rescale, normalise, temporal repeat, patchify).
pub fn preprocess_rgb(
    img: &RgbImage,
    cfg: &PreprocessorConfig,
) -> Result<PreprocessedImage, VisionError> {
    let _s = tracing::debug_span!("vision_preprocess", w = img.width, h = img.height).entered();
    if img.data.len() != img.width * img.height * 3 {
        return Err(VisionError::Input(format!(
            "{} bytes for a {}×{} RGB image",
            img.data.len(),
            img.width,
            img.height
        )));
    }
    let factor = cfg.factor();
    let (rh, rw) = if cfg.do_resize {
        smart_resize(
            img.height,
            img.width,
            factor,
            cfg.min_pixels,
            cfg.max_pixels,
        )?
    } else {
        (img.height, img.width)
    };
    if rh % factor != 0 || rw % factor != 0 {
        return Err(VisionError::BadSize {
            width: img.width,
            height: img.height,
            detail: format!("not a multiple of {factor} and do_resize is false"),
        });
    }
    let rgb = if (rh, rw) == (img.height, img.width) {
        img.data.clone()
    } else {
        resize_rgb8(&img.data, img.width, img.height, rw, rh, cfg.resample)
    };
    // Rescale then normalise, per channel, into planar [3, rh, rw].
    let plane = rh * rw;
    let mut chw = vec![0f32; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        for c in 0..3 {
            let mut v = f32::from(px[c]);
            if cfg.do_rescale {
                v = (f64::from(px[c]) * f64::from(cfg.rescale_factor)) as f32;
            }
            if cfg.do_normalize {
                v = (v - cfg.image_mean[c]) / cfg.image_std[c];
            }
            chw[c * plane + i] = v;
        }
    }
    let (p, m, t) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gh, gw) = (rh / p, rw / p);
    let patch_dim = 3 * t * p * p;
    let mut pixels = Vec::with_capacity(gh * gw * patch_dim);
    for bh in 0..gh / m {
        for bw in 0..gw / m {
            for mh in 0..m {
                for mw in 0..m {
                    let (y0, x0) = ((bh * m + mh) * p, (bw * m + mw) * p);
                    for c in 0..3 {
                        for _ in 0..t {
                            for py in 0..p {
                                let row = c * plane + (y0 + py) * rw + x0;
                                pixels.extend_from_slice(&chw[row..row + p]);
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(PreprocessedImage {
        pixels,
        grid_thw: [1, gh, gw],
        patch_dim,
        resized_hw: [rh, rw],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_hf_branches() {
        // Rounding (Python's half-to-even: 48/32 = 1.5 → 2, 80/32 = 2.5 → 2).
        assert_eq!(smart_resize(48, 80, 32, 1, 1 << 30).ok(), Some((64, 64)));
        assert_eq!(smart_resize(50, 75, 32, 2048, 12288).ok(), Some((64, 64)));
        // Max branch: beta = sqrt(170·300/12288).
        assert_eq!(
            smart_resize(170, 300, 32, 2048, 12288).ok(),
            Some((64, 128))
        );
        // Min branch.
        assert_eq!(smart_resize(10, 10, 32, 4096, 1 << 20).ok(), Some((64, 64)));
        assert!(matches!(
            smart_resize(1, 300, 32, 1, 1 << 20),
            Err(VisionError::BadSize { .. })
        ));
        assert!(matches!(
            smart_resize(0, 3, 32, 1, 1 << 20),
            Err(VisionError::BadSize { .. })
        ));
    }

    #[test]
    fn patch_order_puts_merge_blocks_on_consecutive_rows() {
        // 64×64 image whose pixel value encodes its (row, col) patch; no resize, no normalise.
        let cfg = PreprocessorConfig {
            patch_size: 16,
            merge_size: 2,
            min_pixels: 1,
            max_pixels: 1 << 20,
            do_rescale: false,
            do_normalize: false,
            ..PreprocessorConfig::default()
        };
        let mut data = vec![0u8; 64 * 64 * 3];
        for y in 0..64 {
            for x in 0..64 {
                let v = ((y / 16) * 4 + x / 16) as u8;
                data[(y * 64 + x) * 3..(y * 64 + x) * 3 + 3].copy_from_slice(&[
                    v,
                    v + 100,
                    v + 200,
                ]);
            }
        }
        let img = RgbImage {
            width: 64,
            height: 64,
            data,
        };
        let p = preprocess_rgb(&img, &cfg).expect("preprocess");
        assert_eq!(p.grid_thw, [1, 4, 4]);
        assert_eq!(p.n_tokens(2), 4);
        let order: Vec<f32> = p.pixels.chunks(p.patch_dim).map(|r| r[0]).collect();
        let want: Vec<f32> = [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
            .iter()
            .map(|&v| v as f32)
            .collect();
        assert_eq!(order, want);
        // Channel-major within a row: the green plane starts after 2·16·16 values.
        let r = &p.pixels[..p.patch_dim];
        assert_eq!(r[2 * 256], 100.0);
        assert_eq!(r[4 * 256 + 5], 200.0);
    }

    #[test]
    fn garbage_and_other_formats_are_typed_errors() {
        assert!(matches!(
            decode_image(b"definitely not an image"),
            Err(VisionError::UnsupportedFormat(_))
        ));
        // A PNG signature followed by junk.
        let mut png = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];
        png.extend_from_slice(&[7u8; 40]);
        assert!(matches!(decode_image(&png), Err(VisionError::Decode(_))));
        // GIF is recognised but not accepted.
        assert!(matches!(
            decode_image(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;"),
            Err(VisionError::UnsupportedFormat(_))
        ));
        assert!(matches!(
            decode_image(&[]),
            Err(VisionError::UnsupportedFormat(_))
        ));
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut c = 0xffff_ffffu32;
        for &b in data {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xedb8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    #[test]
    fn decompression_bomb_header_is_too_large() {
        // A valid PNG signature + IHDR claiming 60000×60000 RGB, then nothing.
        let mut png = vec![0x89, b'P', b'N', b'G', 0x0d, 0x0a, 0x1a, 0x0a];
        let mut chunk = b"IHDR".to_vec();
        chunk.extend_from_slice(&60000u32.to_be_bytes());
        chunk.extend_from_slice(&60000u32.to_be_bytes());
        chunk.extend_from_slice(&[8, 2, 0, 0, 0]);
        png.extend_from_slice(&13u32.to_be_bytes());
        png.extend_from_slice(&chunk);
        png.extend_from_slice(&crc32(&chunk).to_be_bytes());
        match decode_image(&png) {
            Err(VisionError::TooLarge(detail)) => {
                assert!(detail.contains("16384"), "{detail}")
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
    }
}
