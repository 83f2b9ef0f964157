//! Reads the `model.visual.*` tensors of a checkpoint directory (single file or sharded) as f32.
//! [`crate::weights::Checkpoint`] deliberately skips them, so this is the vision tower's loader;
//! it memory-maps the same files and converts only what the tower asks for.

use crate::error::ModelError;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

struct Entry {
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// The `model.visual.*` tensors of a checkpoint directory.
pub(crate) struct VisualTensors {
    dir: PathBuf,
    maps: Vec<Mmap>,
    entries: HashMap<String, Entry>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl VisualTensors {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`.
    pub(crate) fn open(dir: &Path) -> Result<Self, ModelError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(io(&index))?;
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
            let mut names: Vec<&str> = map
                .iter()
                .filter(|(k, _)| k.starts_with("model.visual."))
                .filter_map(|(_, f)| f.as_str())
                .collect();
            names.sort_unstable();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        let mut maps = Vec::new();
        let mut entries = HashMap::new();
        for (fi, path) in files.iter().enumerate() {
            let file = File::open(path).map_err(io(path))?;
            // SAFETY: the checkpoint is opened read-only and must not change while mapped (the
            // usual contract of safetensors loaders); we never write through the map.
            let map = unsafe { Mmap::map(&file) }.map_err(io(path))?;
            let bad = |detail: String| ModelError::Safetensors {
                path: path.clone(),
                detail,
            };
            let (header, meta) =
                SafeTensors::read_metadata(&map).map_err(|e| bad(e.to_string()))?;
            let base = 8 + header;
            for (name, info) in meta.tensors() {
                if !name.starts_with("model.visual.") {
                    continue;
                }
                let (s, e) = info.data_offsets;
                if s > e || base + e > map.len() {
                    return Err(bad(format!("tensor `{name}` data range outside the file")));
                }
                entries.insert(
                    name,
                    Entry {
                        file: fi,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        offset: base + s,
                        len: e - s,
                    },
                );
            }
            maps.push(map);
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            maps,
            entries,
        })
    }

    /// Tensor `name` (shape must be `expected`) converted to f32 (from F32, F16 or BF16).
    pub(crate) fn f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>, ModelError> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                expected: expected.to_vec(),
                dir: self.dir.clone(),
            })?;
        if e.shape != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                got: e.shape.clone(),
                expected: expected.to_vec(),
            });
        }
        let numel: usize = expected.iter().product();
        let size = match e.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => {
                return Err(ModelError::TensorDType {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if numel * size != e.len {
            return Err(ModelError::Safetensors {
                path: self.dir.clone(),
                detail: format!("tensor `{name}`: {} bytes for shape {:?}", e.len, e.shape),
            });
        }
        let bytes = &self.maps[e.file][e.offset..e.offset + e.len];
        Ok(match e.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}
