//! The vision path against the HF fixture `fixtures/tiny-vl/` (scripts/gen_vision_fixture.py):
//! preprocessing (pixel_values), the vision tower (merger output), M-RoPE positions, and
//! malformed-image errors.
use kvstream_backend_cpu::CpuBackend;
use kvstream_model_qwen::rope_index::mrope_positions;
use kvstream_model_qwen::vision::{decode_image, preprocess, PreprocessorConfig, VisionConfig};
use kvstream_model_qwen::{VisionError, VisionTower};
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("fixtures")
        .join("tiny-vl")
}

struct Oracle {
    bytes: Vec<u8>,
}

impl Oracle {
    fn open() -> Self {
        Self {
            bytes: std::fs::read(dir().join("oracle.safetensors")).expect("oracle file"),
        }
    }
    fn f32(&self, key: &str) -> (Vec<usize>, Vec<f32>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle tensor");
        assert_eq!(t.dtype(), Dtype::F32);
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (t.shape().to_vec(), v)
    }
    fn i64(&self, key: &str) -> (Vec<usize>, Vec<i64>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("oracle");
        let t = st.tensor(key).expect("oracle tensor");
        assert_eq!(t.dtype(), Dtype::I64);
        let v = t
            .data()
            .chunks_exact(8)
            .map(|c| {
                let mut a = [0u8; 8];
                a.copy_from_slice(c);
                i64::from_le_bytes(a)
            })
            .collect();
        (t.shape().to_vec(), v)
    }
    fn grid(&self, k: &str) -> [usize; 3] {
        let (_, g) = self.i64(&format!("grid.{k}"));
        [g[0] as usize, g[1] as usize, g[2] as usize]
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn image(k: &str) -> Vec<u8> {
    std::fs::read(dir().join(format!("img_{k}.png"))).expect("image file")
}

const IMAGES: [&str; 4] = ["a", "b", "c", "d"];

#[test]
fn preprocessing_matches_hf_pixel_values() {
    let o = Oracle::open();
    let cfg = PreprocessorConfig::from_model_dir(&dir()).expect("preprocessor config");
    for k in IMAGES {
        let p = preprocess(&image(k), &cfg).expect("preprocess");
        let (shape, want) = o.f32(&format!("pix.{k}"));
        assert_eq!(p.grid_thw, o.grid(k), "image {k}");
        assert_eq!(shape, vec![p.n_patches(), p.patch_dim], "image {k}");
        let d = max_abs_diff(&p.pixels, &want);
        eprintln!("pixel_values {k}: grid {:?} max |diff| {d:.3e}", p.grid_thw);
        assert!(d <= 1e-5, "image {k}: max |diff| {d}");
    }
}

#[test]
fn vision_tower_matches_hf_embeddings() {
    let o = Oracle::open();
    let tower = VisionTower::load(&dir()).expect("tower");
    let cfg = PreprocessorConfig::from_model_dir(&dir()).expect("preprocessor config");
    cfg.check_against(tower.config())
        .expect("processor matches tower");
    let mut packed = Vec::new();
    for k in IMAGES {
        // From HF's own pixel_values, so the tower is checked independently of preprocessing.
        let (_, pix) = o.f32(&format!("pix.{k}"));
        let mut p = preprocess(&image(k), &cfg).expect("preprocess");
        p.pixels = pix;
        let got = tower.encode_on(&CpuBackend::new(), &p).expect("encode");
        let (shape, want) = o.f32(&format!("vis.{k}"));
        assert_eq!(shape, vec![p.n_tokens(2), tower.config().out_hidden_size]);
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = max_abs_diff(&got, &want);
        eprintln!("vision {k}: max |diff| {d:.3e} (max |ref| {scale:.2})");
        assert!(d <= 1e-3, "image {k}: max |diff| {d}");
        if k == "a" || k == "b" {
            packed.extend(got);
        }
    }
    let (_, want) = o.f32("vis_ab");
    let d = max_abs_diff(&packed, &want);
    assert!(d <= 1e-3, "packed a+b: max |diff| {d}");
}

#[test]
fn end_to_end_image_bytes_to_embeddings() {
    let o = Oracle::open();
    let tower = VisionTower::load(&dir()).expect("tower");
    let cfg = PreprocessorConfig::from_model_dir(&dir()).expect("preprocessor config");
    for k in ["c", "d"] {
        let p = preprocess(&image(k), &cfg).expect("preprocess");
        let got = tower.encode_on(&CpuBackend::new(), &p).expect("encode");
        let (_, want) = o.f32(&format!("vis.{k}"));
        let d = max_abs_diff(&got, &want);
        eprintln!("bytes→embeddings {k}: max |diff| {d:.3e}");
        assert!(d <= 1e-3, "image {k}: max |diff| {d}");
    }
}

#[test]
fn mrope_positions_match_hf_get_rope_index() {
    let o = Oracle::open();
    let vc = VisionConfig::from_model_dir(&dir()).expect("vision config");
    let (_, ids) = o.i64("ids");
    let tokens: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
    let grids = [o.grid("a"), o.grid("b")];
    let r = mrope_positions(&tokens, &grids, &vc, 0).expect("positions");
    let (shape, want) = o.i64("positions");
    assert_eq!(shape, vec![3, tokens.len()]);
    for (i, p) in r.positions.iter().enumerate() {
        for axis in 0..3 {
            assert_eq!(
                i64::from(p[axis]),
                want[axis * tokens.len() + i],
                "token {i} axis {axis}"
            );
        }
    }
    let (_, delta) = o.i64("rope_delta");
    assert_eq!(r.rope_delta, delta[0]);
    let max = want.iter().copied().max().unwrap_or(0);
    assert_eq!(i64::from(r.next_position), max + 1);
    assert!(r.rope_delta < 0, "images must compress positions");
}

#[test]
fn malformed_and_unsupported_images_are_typed_errors() {
    let cfg = PreprocessorConfig::from_model_dir(&dir()).expect("preprocessor config");
    let png = image("a");
    // Truncated PNG: the signature and header survive, the data does not.
    let cut = &png[..png.len() / 3];
    assert!(matches!(preprocess(cut, &cfg), Err(VisionError::Decode(_))));
    // Corrupted bytes in the middle of the compressed stream.
    let mut bad = png.clone();
    let mid = bad.len() / 2;
    for b in &mut bad[mid..mid + 64] {
        *b ^= 0x5a;
    }
    assert!(preprocess(&bad, &cfg).is_err());
    assert!(matches!(
        preprocess(b"BM\x00\x00 not really a bitmap", &cfg),
        Err(VisionError::UnsupportedFormat(_))
    ));
    assert!(matches!(
        preprocess(&[], &cfg),
        Err(VisionError::UnsupportedFormat(_))
    ));
}

#[test]
fn jpeg_and_webp_decode_like_pillow() {
    let o = Oracle::open();
    let st = SafeTensors::deserialize(&o.bytes).expect("oracle");
    // Lossless WebP must be exact; JPEG decoders (zune-jpeg vs libjpeg-turbo) may differ by a few
    // levels in the IDCT / chroma upsampling.
    for (k, f, tol) in [("f", "img_f.webp", 0u8), ("e", "img_e.jpg", 8u8)] {
        let bytes = std::fs::read(dir().join(f)).expect("image file");
        let img = decode_image(&bytes).expect("decode");
        let t = st.tensor(&format!("rgb.{k}")).expect("rgb");
        assert_eq!(t.dtype(), Dtype::U8);
        assert_eq!(t.shape(), &[img.height, img.width, 3], "{f}");
        let d = img
            .data
            .iter()
            .zip(t.data())
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap_or(0);
        let mean = img
            .data
            .iter()
            .zip(t.data())
            .map(|(a, b)| f64::from(a.abs_diff(*b)))
            .sum::<f64>()
            / img.data.len() as f64;
        eprintln!("{f}: max |diff| vs Pillow {d} levels, mean {mean:.3}");
        assert!(d <= tol, "{f}: {d} levels");
        // Generated images are never flat.
        let first = &img.data[..3];
        assert!(img.data.chunks(3).any(|p| p != first), "{f}");
    }
}
