//! Memory-mapped safetensors checkpoints: one `model.safetensors`, or shards listed by
//! `model.safetensors.index.json`. Tensors stay in their stored dtype (F32, F16, BF16) and are
//! referenced in place through [`WeightData`] (an `Arc` of the mmap), never copied here.
//!
//! Two quantized forms are read as well (see `docs/weights.md`):
//! * kvstream checkpoints ([`crate::save_quantized`]): a quantized tensor is ONE `U8` tensor
//!   holding the exact quant-spec blob, described by the file's `__metadata__` entry
//!   `name → "FORMAT:[dims]"` (e.g. `q4_g128:[17408,5120]`); returned zero-copy.
//! * public FP8 (`F8_E4M3` weights with a `weight_scale_inv` or `weight_scale` sibling):
//!   mapped onto [`WeightDType::F8E4M3`] (one copy of the codes plus f32 scales).

use crate::error::ModelError;
use crate::quant::convert::convert_into;
use crate::quant::fp8::{fp8_blob, fp8_blob_into, ScaleRef};
use crate::quant::meta::parse_meta;
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::ops::WeightData;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
    /// The file's `__metadata__` value for this tensor's name, if any.
    meta: Option<String>,
}

/// A tensor found in the checkpoint: dtype, shape and its bytes (zero copy).
#[derive(Debug, Clone)]
pub struct TensorRef {
    pub dtype: WeightDType,
    pub shape: Vec<usize>,
    pub data: WeightData,
}

/// Every tensor of a checkpoint directory, memory-mapped.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("files", &self.maps.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

fn map_file(path: &Path) -> Result<Mmap, ModelError> {
    let file = File::open(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the checkpoint file is opened read-only and must not be modified while mapped
    // (the usual contract of every safetensors loader); we never write through the map.
    unsafe { Mmap::map(&file) }.map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`.
    /// The vision tower's tensors (`model.visual.*`) are skipped (the vision loader reads them).
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        Self::open_with(dir, false)
    }

    /// As [`Checkpoint::open`], also indexing the vision tower's tensors (`kvstream quantize`
    /// copies them through unchanged).
    pub fn open_including_vision(dir: &Path) -> Result<Self, ModelError> {
        Self::open_with(dir, true)
    }

    /// Names and stored shapes of the tensors whose name starts with `prefix`, sorted by name.
    pub fn tensors_with_prefix(&self, prefix: &str) -> Vec<(String, Vec<usize>)> {
        let mut v: Vec<(String, Vec<usize>)> = self
            .entries
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(n, e)| (n.clone(), e.shape.clone()))
            .collect();
        v.sort();
        v
    }

    fn open_with(dir: &Path, include_vision: bool) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
                path: index.clone(),
                source,
            })?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|source| ModelError::Json {
                    path: index.clone(),
                    source,
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| {
                    ModelError::config(&index, "weight_map", "missing or not an object")
                })?;
            let mut names: Vec<String> = Vec::new();
            for (tensor, f) in map {
                let f = f.as_str().ok_or_else(|| {
                    ModelError::config(
                        &index,
                        format!("weight_map.{tensor}"),
                        "expected a file name",
                    )
                })?;
                if !names.iter().any(|n| n == f) {
                    names.push(f.to_string());
                }
            }
            names.sort();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        for (fi, path) in files.iter().enumerate() {
            let map = map_file(path)?;
            let bad = |detail: String| ModelError::Safetensors {
                path: path.clone(),
                detail,
            };
            let (header, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
            let base = 8 + header;
            let file_meta = meta.metadata().clone().unwrap_or_default();
            for (name, info) in meta.tensors() {
                if !include_vision && name.starts_with("model.visual.") {
                    continue;
                }
                let (s, e) = info.data_offsets;
                if s > e || base + e > map.len() {
                    return Err(bad(format!("tensor `{name}` data range outside the file")));
                }
                let meta = file_meta.get(&name).cloned();
                entries.insert(
                    name,
                    Entry {
                        file: fi,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        offset: base + s,
                        len: e - s,
                        meta,
                    },
                );
            }
            maps.push(Arc::new(map));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            files,
            maps,
            entries,
        })
    }

    /// True when the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Number of (non-vision) tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn entry(&self, name: &str, expected: &[usize]) -> Result<&Entry, ModelError> {
        self.entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected: expected.to_vec(),
                dir: self.dir.clone(),
            })
    }

    fn bytes(&self, e: &Entry) -> &[u8] {
        let all: &[u8] = &self.maps[e.file][..];
        &all[e.offset..e.offset + e.len]
    }

    /// The logical dtype and dims of an entry: plain floats, `U8` + metadata (kvstream
    /// quantized), `F8_E4M3` (public FP8).
    fn logical(&self, name: &str, e: &Entry) -> Result<(WeightDType, Vec<usize>), ModelError> {
        let meta_err = |detail: String| ModelError::QuantMetadata {
            path: self.files.get(e.file).cloned().unwrap_or_default(),
            name: name.to_string(),
            detail,
        };
        Ok(match e.dtype {
            Dtype::F32 => (WeightDType::F32, e.shape.clone()),
            Dtype::F16 => (WeightDType::F16, e.shape.clone()),
            Dtype::BF16 => (WeightDType::Bf16, e.shape.clone()),
            Dtype::F8_E4M3 => (WeightDType::F8E4M3, e.shape.clone()),
            Dtype::U8 => {
                let m = e.meta.as_deref().ok_or_else(|| {
                    meta_err("a U8 tensor without a `__metadata__` entry `FORMAT:[dims]`".into())
                })?;
                parse_meta(m).map_err(meta_err)?
            }
            other => {
                return Err(ModelError::TensorDType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        })
    }

    /// The stored (logical) dtype of `name`, checked for presence and shape like
    /// [`Checkpoint::get`], without reading its bytes.
    pub fn stored_dtype(&self, name: &str, expected: &[usize]) -> Result<WeightDType, ModelError> {
        let e = self.entry(name, expected)?;
        let (dtype, shape) = self.logical(name, e)?;
        if shape != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: shape,
                expected: expected.to_vec(),
            });
        }
        Ok(dtype)
    }

    /// The tensor `name`, which must have shape `expected` (the logical shape for quantized
    /// tensors) and a float, kvstream-quantized or FP8 dtype. Errors name the tensor.
    pub fn get(&self, name: &str, expected: &[usize]) -> Result<TensorRef, ModelError> {
        let e = self.entry(name, expected)?;
        let (dtype, shape) = self.logical(name, e)?;
        if shape != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: shape,
                expected: expected.to_vec(),
            });
        }
        if dtype == WeightDType::F8E4M3 && e.dtype == Dtype::F8_E4M3 {
            return self.get_public_fp8(name, e);
        }
        let want = dtype
            .storage_bytes(&shape)
            .map_err(|source| ModelError::WeightFormat {
                name: name.to_string(),
                source,
            })?;
        if want != e.len {
            return Err(ModelError::Safetensors {
                path: self.dir.clone(),
                detail: format!(
                    "tensor `{name}`: {} bytes for {dtype} {:?} (expected {want})",
                    e.len, shape
                ),
            });
        }
        let source: Arc<dyn AsRef<[u8]> + Send + Sync> = self.maps[e.file].clone();
        Ok(TensorRef {
            dtype,
            shape,
            data: WeightData {
                source,
                offset: e.offset,
                len: e.len,
            },
        })
    }

    /// The scale tensor of a public FP8 weight `name` (`{name}_scale_inv` or `{name}_scale`).
    fn public_fp8_scale(&self, name: &str) -> Result<(String, &Entry, WeightDType), ModelError> {
        let (inv, plain) = (format!("{name}_scale_inv"), format!("{name}_scale"));
        let (sname, se) = match (self.entries.get(&inv), self.entries.get(&plain)) {
            (Some(s), _) => (inv, s),
            (None, Some(s)) => (plain, s),
            (None, None) => {
                return Err(ModelError::ScaleTensor {
                    name: name.to_string(),
                    scale: inv,
                    detail: format!("missing (nor `{plain}`): an F8_E4M3 weight needs its scales"),
                })
            }
        };
        let sdtype = match se.dtype {
            Dtype::F32 => WeightDType::F32,
            Dtype::F16 => WeightDType::F16,
            Dtype::BF16 => WeightDType::Bf16,
            other => {
                return Err(ModelError::ScaleTensor {
                    name: name.to_string(),
                    scale: sname,
                    detail: format!("dtype {other:?} (expected F32, F16 or BF16)"),
                })
            }
        };
        Ok((sname, se, sdtype))
    }

    /// A public FP8 weight (`F8_E4M3` + `{name}_scale_inv` or `{name}_scale`) as an
    /// `fp8_e4m3` blob.
    fn get_public_fp8(&self, name: &str, e: &Entry) -> Result<TensorRef, ModelError> {
        let (sname, se, sdtype) = self.public_fp8_scale(name)?;
        let blob = fp8_blob(
            name,
            self.bytes(e),
            &e.shape,
            &ScaleRef {
                name: &sname,
                dtype: sdtype,
                shape: &se.shape,
                bytes: self.bytes(se),
            },
        )?;
        Ok(TensorRef {
            dtype: WeightDType::F8E4M3,
            shape: e.shape.clone(),
            data: WeightData::from_vec(blob),
        })
    }

    /// `name` converted to `target`, written into the code and scale sections of its rows in a
    /// larger blob (a fused weight, see `quant::convert::convert_into`). Stored tensors are
    /// read in place (mmap); a public FP8 weight is written straight into the sections, so
    /// host memory holds no second copy of any part.
    pub(crate) fn get_into(
        &self,
        name: &str,
        expected: &[usize],
        target: WeightDType,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), ModelError> {
        let e = self.entry(name, expected)?;
        if target == WeightDType::F8E4M3 && e.dtype == Dtype::F8_E4M3 && e.shape == expected {
            let (sname, se, sdtype) = self.public_fp8_scale(name)?;
            let scale = ScaleRef {
                name: &sname,
                dtype: sdtype,
                shape: &se.shape,
                bytes: self.bytes(se),
            };
            return fp8_blob_into(name, self.bytes(e), &e.shape, &scale, codes, scales);
        }
        convert_into(name, &self.get(name, expected)?, target, codes, scales)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("write");
    }

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvq-weights-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn sharded_index_maps_names_to_files_and_errors_name_tensors() {
        let d = tmpdir("shard");
        let a: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [0x3f80u16, 0x4000, 0xc040]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        write_st(
            &d.join("s1.safetensors"),
            &[("x.weight", Dtype::F32, vec![2], a)],
        );
        write_st(
            &d.join("s2.safetensors"),
            &[
                ("y.weight", Dtype::BF16, vec![1, 3], b),
                ("model.visual.z", Dtype::F32, vec![1], vec![0; 4]),
                ("i.weight", Dtype::I32, vec![1], vec![0; 4]),
            ],
        );
        std::fs::write(
            d.join("model.safetensors.index.json"),
            r#"{"metadata": {}, "weight_map": {"x.weight": "s1.safetensors", "y.weight": "s2.safetensors", "i.weight": "s2.safetensors"}}"#,
        )
        .expect("index");
        let c = Checkpoint::open(&d).expect("open");
        assert!(!c.contains("model.visual.z"));
        let x = c.get("x.weight", &[2]).expect("x");
        assert_eq!(x.dtype, WeightDType::F32);
        assert_eq!(
            x.data.bytes(),
            &[1.5f32, -2.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<_>>()[..]
        );
        let y = c.get("y.weight", &[1, 3]).expect("y");
        assert_eq!(y.dtype, WeightDType::Bf16);
        assert_eq!(y.data.bytes()[2..4], [0x00, 0x40]);
        let e = c
            .get("y.weight", &[3])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("y.weight") && e.contains("[3]"), "{e}");
        let e = c
            .get("nope", &[4, 5])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("nope") && e.contains("[4, 5]"), "{e}");
        assert!(matches!(
            c.get("i.weight", &[1]),
            Err(ModelError::TensorDType { .. })
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// compressed-tensors FP8 (`weight_scale` per channel) is read as an `fp8_e4m3` blob whose
    /// values are e4m3(q) · scale[row]; a U8 tensor without metadata is a typed error.
    #[test]
    fn compressed_tensors_fp8_and_u8_without_metadata() {
        use kvstream_memory_contracts::weight_format::{dequantize, e4m3_to_f32};
        let d = tmpdir("ct");
        let (n, k) = (3usize, 200usize);
        let codes: Vec<u8> = (0..n * k).map(|i| (i * 7 % 120) as u8).collect();
        let scales = [0.5f32, 2.0, 0.125];
        let sb: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_st(
            &d.join("model.safetensors"),
            &[
                ("a.weight", Dtype::F8_E4M3, vec![n, k], codes.clone()),
                ("a.weight_scale", Dtype::F32, vec![n, 1], sb),
                ("b.weight", Dtype::U8, vec![16], vec![0; 16]),
            ],
        );
        let c = Checkpoint::open(&d).expect("open");
        assert_eq!(
            c.stored_dtype("a.weight", &[n, k]).ok(),
            Some(WeightDType::F8E4M3)
        );
        let t = c.get("a.weight", &[n, k]).expect("fp8");
        assert_eq!(t.dtype, WeightDType::F8E4M3);
        let v = dequantize(WeightDType::F8E4M3, t.data.bytes(), &[n, k]).expect("deq");
        for r in 0..n {
            for j in 0..k {
                assert_eq!(v[r * k + j], e4m3_to_f32(codes[r * k + j]) * scales[r]);
            }
        }
        assert!(matches!(
            c.get("b.weight", &[16]),
            Err(ModelError::QuantMetadata { name, .. }) if name == "b.weight"
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn missing_and_corrupt_files_are_typed_errors() {
        let d = tmpdir("bad");
        assert!(matches!(Checkpoint::open(&d), Err(ModelError::Io { .. })));
        std::fs::write(d.join("model.safetensors"), b"garbage!garbage").expect("write");
        assert!(matches!(
            Checkpoint::open(&d),
            Err(ModelError::Safetensors { .. })
        ));
        let _ = std::fs::remove_dir_all(&d);
    }
}
