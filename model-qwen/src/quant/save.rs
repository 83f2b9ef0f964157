//! [`save_quantized`]: writes a model directory whose weights are already in their device
//! formats, so that loading it is a zero-copy mmap (no requantization).
//!
//! Layout (also in `docs/weights.md`):
//! * safetensors shards (`model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
//!   `model.safetensors.index.json` past the shard size), written tensor by tensor (host memory
//!   holds one converted tensor at a time);
//! * a quantized tensor is ONE `U8` tensor `[total_bytes]` holding the exact quant-spec blob
//!   (codes, padding to 16 bytes, scales), with the shard's `__metadata__` entry
//!   `tensor name → "FORMAT:[logical dims]"` (e.g. `q4_g128:[17408,5120]`); plain tensors keep
//!   their F32/F16/BF16 dtype and shape; `__metadata__` also has `"format": "pt"`;
//! * `config.json` copied with `"quantization_config": {"quant_method": "kvstream", "format":
//!   ..., "head_format": ...}` (null = as stored); tokenizer, chat-template and generation files
//!   copied as they are;
//! * the vision tower (`model.visual.*`) is copied as stored (a quantized VL model keeps its
//!   image input); the scale tensors of FP8 sources are not written (their weights are).

use super::convert::convert;
use super::fp8::check_quantization_config;
use super::meta::format_meta;
use super::plan::{tensor_plan, Class};
use super::policy::WeightPolicy;
use super::report::LoadReport;
use super::role::decide;
use crate::config::QwenConfig;
use crate::error::ModelError;
use crate::weights::Checkpoint;
use kvstream_memory_contracts::backend::WeightDType;
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Shard size limit of [`save_quantized`] (bytes of tensor data per file).
pub const SHARD_BYTES: usize = 4 << 30;

/// Side files copied verbatim when present.
const SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
];

/// One tensor to write.
struct Item {
    /// Name in the written file.
    name: String,
    /// Name in the source checkpoint.
    source: String,
    shape: Vec<usize>,
    dtype: WeightDType,
    bytes: usize,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn st_dtype(d: WeightDType) -> &'static str {
    match d {
        WeightDType::F32 => "F32",
        WeightDType::F16 => "F16",
        WeightDType::Bf16 => "BF16",
        _ => "U8",
    }
}

/// Converts the model in `src` with `policy` and writes it to `dst` (created; must differ from
/// `src`). The MTP head is written when `load_mtp` is set and the config has one. Returns the
/// report a load with the same policy would give (device bytes, fallbacks). Loading `dst` with
/// [`WeightPolicy::as_stored`] (or the same policy) gives bit-identical weights to loading `src`
/// with `policy`.
pub fn save_quantized(
    src: &Path,
    dst: &Path,
    policy: &WeightPolicy,
    load_mtp: bool,
) -> Result<LoadReport, ModelError> {
    save_sharded(src, dst, policy, load_mtp, SHARD_BYTES)
}

/// [`save_quantized`] with a shard size limit (tests use small ones).
pub(crate) fn save_sharded(
    src: &Path,
    dst: &Path,
    policy: &WeightPolicy,
    load_mtp: bool,
    shard_bytes: usize,
) -> Result<LoadReport, ModelError> {
    let _s =
        tracing::info_span!("save_quantized", src = %src.display(), dst = %dst.display()).entered();
    check_quantization_config(src)?;
    let cfg = QwenConfig::from_model_dir(src)?;
    let ck = Checkpoint::open_including_vision(src)?;
    std::fs::create_dir_all(dst).map_err(io(dst))?;
    if let (Ok(a), Ok(b)) = (src.canonicalize(), dst.canonicalize()) {
        if a == b {
            return Err(ModelError::Input(format!(
                "save_quantized: the output directory `{}` is the input directory",
                dst.display()
            )));
        }
    }
    let prefix = if ck.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    };
    let embed_name = format!("{prefix}embed_tokens.weight");
    let mut report = LoadReport::default();
    let mut items = Vec::new();
    let mut embed_dtype = None;
    for t in tensor_plan(&cfg, prefix, load_mtp) {
        let mut source = t.name.clone();
        let is_head = t.class == Class::Head;
        if is_head && cfg.tie_word_embeddings && !ck.contains(&t.name) {
            source = embed_name.clone();
        }
        let stored = ck.stored_dtype(&source, &t.shape)?;
        let d = decide(t.role, stored, &t.shape, policy);
        if d.fallback {
            report.fallback.push((t.name.clone(), d.dtype));
        }
        let bytes = d
            .dtype
            .storage_bytes(&t.shape)
            .map_err(|source| ModelError::WeightFormat {
                name: t.name.clone(),
                source,
            })?;
        if t.class == Class::Embedding {
            report.host_embedding_bytes += bytes;
            embed_dtype = Some(d.dtype);
        } else {
            report.record(d.dtype, bytes);
        }
        // A tied head that stays as stored is read from the embedding at load time.
        if is_head && source == embed_name && Some(d.dtype) == embed_dtype {
            continue;
        }
        items.push(Item {
            name: t.name,
            source,
            shape: t.shape,
            dtype: d.dtype,
            bytes,
        });
    }
    // The vision tower (`model.visual.*`) is copied through as stored: the vision loader reads
    // it from the output directory like from the source.
    for (name, shape) in ck.tensors_with_prefix("model.visual.") {
        let dtype = ck.stored_dtype(&name, &shape)?;
        let bytes = dtype
            .storage_bytes(&shape)
            .map_err(|source| ModelError::WeightFormat {
                name: name.clone(),
                source,
            })?;
        items.push(Item {
            source: name.clone(),
            name,
            shape,
            dtype,
            bytes,
        });
    }
    // Shards.
    let mut shards: Vec<Vec<Item>> = vec![Vec::new()];
    let mut size = 0usize;
    for it in items {
        if size > 0 && size + it.bytes > shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += it.bytes;
        if let Some(s) = shards.last_mut() {
            s.push(it);
        }
    }
    let n = shards.len();
    let file_name = |i: usize| {
        if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        }
    };
    let mut weight_map = Map::new();
    let mut total = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let path = dst.join(file_name(i));
        write_shard(&ck, &path, shard)?;
        for it in shard {
            weight_map.insert(it.name.clone(), Value::String(file_name(i)));
            total += it.bytes;
        }
    }
    let index = dst.join("model.safetensors.index.json");
    if n > 1 {
        let v = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(&index, v.to_string()).map_err(io(&index))?;
    } else if index.exists() {
        std::fs::remove_file(&index).map_err(io(&index))?;
    }
    write_config(src, dst, policy)?;
    for f in SIDE_FILES {
        let from = src.join(f);
        if from.is_file() {
            std::fs::copy(&from, dst.join(f)).map_err(io(&from))?;
        }
    }
    Ok(report)
}

/// Writes one safetensors file: header (with the quantization metadata), then every tensor's
/// bytes in order, converting one tensor at a time.
fn write_shard(ck: &Checkpoint, path: &Path, items: &[Item]) -> Result<(), ModelError> {
    let mut header = Map::new();
    let mut meta = Map::new();
    meta.insert("format".into(), "pt".into());
    let mut off = 0usize;
    for it in items {
        let shape = if it.dtype.is_quantized() {
            meta.insert(
                it.name.clone(),
                Value::String(format_meta(it.dtype, &it.shape)),
            );
            vec![it.bytes]
        } else {
            it.shape.clone()
        };
        header.insert(
            it.name.clone(),
            json!({"dtype": st_dtype(it.dtype), "shape": shape, "data_offsets": [off, off + it.bytes]}),
        );
        off += it.bytes;
    }
    header.insert("__metadata__".into(), Value::Object(meta));
    let mut h = Value::Object(header).to_string().into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let tmp: PathBuf = path.with_extension("safetensors.partial");
    let file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 22, file);
    w.write_all(&(h.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(&h))
        .map_err(io(&tmp))?;
    for it in items {
        let t = ck.get(&it.source, &it.shape)?;
        let t = convert(&it.name, t, it.dtype)?;
        if t.data.len != it.bytes {
            return Err(ModelError::Input(format!(
                "tensor `{}`: {} bytes, planned {}",
                it.name, t.data.len, it.bytes
            )));
        }
        w.write_all(t.data.bytes()).map_err(io(&tmp))?;
    }
    w.flush().map_err(io(&tmp))?;
    drop(w);
    std::fs::rename(&tmp, path).map_err(io(path))
}

/// `config.json` with `quantization_config` set to the kvstream form (any source
/// `quantization_config`, e.g. FP8, is replaced: the tensors are now in kvstream formats).
fn write_config(src: &Path, dst: &Path, policy: &WeightPolicy) -> Result<(), ModelError> {
    let from = src.join("config.json");
    let text = std::fs::read_to_string(&from).map_err(io(&from))?;
    let mut v: Value = serde_json::from_str(&text).map_err(|source| ModelError::Json {
        path: from.clone(),
        source,
    })?;
    let name = |d: Option<WeightDType>| d.map_or(Value::Null, |d| Value::String(d.name().into()));
    let q = json!({
        "quant_method": "kvstream",
        "format": name(policy.format),
        "head_format": name(policy.effective_head()),
    });
    if let Some(o) = v.as_object_mut() {
        if let Some(Value::Object(t)) = o.get_mut("text_config") {
            t.remove("quantization_config");
        }
        o.insert("quantization_config".into(), q);
    }
    let to = dst.join("config.json");
    let text = serde_json::to_string_pretty(&v).map_err(|source| ModelError::Json {
        path: to.clone(),
        source,
    })?;
    std::fs::write(&to, text).map_err(io(&to))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoadOptions, QwenModel};
    use kvstream_backend_cpu::CpuBackend;

    /// A small shard limit splits the checkpoint into several files plus an index; loading it
    /// gives the same device bytes and report as quantize-at-load, and the index lists every
    /// written tensor once.
    #[test]
    fn sharded_save_writes_an_index_and_loads_back() {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-bare-text");
        let dst = std::env::temp_dir().join(format!("kvq-shards-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dst);
        let policy = WeightPolicy::new(WeightDType::Q8_0);
        let rep = save_sharded(&src, &dst, &policy, true, 100_000).expect("save");
        let index: Value = serde_json::from_str(
            &std::fs::read_to_string(dst.join("model.safetensors.index.json")).expect("index"),
        )
        .expect("json");
        let map = index["weight_map"].as_object().expect("map");
        let files: std::collections::BTreeSet<&str> =
            map.values().filter_map(|v| v.as_str()).collect();
        assert!(files.len() > 3, "{files:?}");
        assert!(files.iter().all(|f| dst.join(f).is_file()));
        assert!(!dst.join("model.safetensors").exists());
        assert!(map.contains_key("mtp.fc.weight") && map.contains_key("lm_head.weight"));
        let b = CpuBackend::new();
        let opts = LoadOptions {
            load_mtp: true,
            weights: policy,
            ..LoadOptions::default()
        };
        let direct = QwenModel::load(&b, &src, &opts).expect("direct");
        let saved = QwenModel::load(
            &b,
            &dst,
            &LoadOptions {
                load_mtp: true,
                ..LoadOptions::default()
            },
        )
        .expect("saved");
        assert_eq!(saved.load_report(), direct.load_report());
        assert_eq!(&rep, direct.load_report());
        assert_eq!(
            index["metadata"]["total_size"].as_u64(),
            Some((rep.device_weight_bytes + rep.host_embedding_bytes) as u64)
        );
        // Saving onto the source directory is refused.
        assert!(matches!(
            save_quantized(&src, &src, &policy, false),
            Err(ModelError::Input(_))
        ));
        let _ = std::fs::remove_dir_all(&dst);
    }
}
