//! Backend-neutral capability reporting.
//!
//! Two functions every front end uses the same way for every backend:
//!
//! * [`render_capability_table`]: the table `kvstream inspect --backend B` prints (query widths,
//!   K/V pairs, pinned host, copy engine, streaming, ...).
//! * [`first_missing_capability`]: the first [`Requirement`] of a model run that the backend
//!   lacks, as a typed [`CapabilityError`] naming the backend, the capability and why, with a
//!   suggestion of other backends. `kvstream generate/inspect` exit non-zero with it.
//!
//! Both read only [`Capabilities`]; neither touches a device.

use crate::backend::Capabilities;
use crate::error::CapabilityError;
use crate::kv::format::KvType;
use std::fmt::Write as _;

/// Backends a user can fall back to, in the order they are suggested.
pub const FALLBACK_BACKENDS: [&str; 2] = ["cuda", "cpu"];

/// A capability a streamed model run needs, in the order [`first_missing_capability`] checks
/// them (the order a run would hit them: the host KV store is registered first, then the copy
/// engine fills the ring, then attention reads it, then the model ops run).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Requirement {
    /// Page-locked host memory for the authoritative KV history ([`crate::host::PinnedHost`]).
    PinnedHost,
    /// An asynchronous copy engine with ready/consumed fences ([`crate::transfer::CopyEngine`]).
    CopyEngine,
    /// Streamed attention with at least query width 1 and one (K, V) pair
    /// ([`crate::attention::StreamedAttention`]).
    StreamedAttention,
    /// The compute ops of a model forward, reading at least one weight dtype ([`crate::ops`]).
    ComputeOps,
}

impl Requirement {
    /// Every requirement, in checking order.
    pub const ALL: [Requirement; 4] = [
        Requirement::PinnedHost,
        Requirement::CopyEngine,
        Requirement::StreamedAttention,
        Requirement::ComputeOps,
    ];

    /// The capability's name as it appears in [`CapabilityError::operation`].
    pub const fn operation(self) -> &'static str {
        match self {
            Requirement::PinnedHost => "pinned_host",
            Requirement::CopyEngine => "copy_engine",
            Requirement::StreamedAttention => "streamed_attention",
            Requirement::ComputeOps => "compute_ops",
        }
    }

    /// True if `caps` provides this requirement.
    pub fn is_met(self, caps: &Capabilities) -> bool {
        match self {
            Requirement::PinnedHost => caps.pinned_host,
            Requirement::CopyEngine => caps.copy_engine,
            Requirement::StreamedAttention => {
                (caps.max_decode_width >= 1 || caps.prefill_attention) && !caps.kv_pairs.is_empty()
            }
            Requirement::ComputeOps => caps.compute_ops && !caps.weight_dtypes.is_empty(),
        }
    }

    /// Why `caps` does not meet this requirement (meaningful only when it does not).
    fn why(self, caps: &Capabilities) -> String {
        match self {
            Requirement::PinnedHost => {
                "no page-locked host memory for the KV history (the host copy is the truth)".into()
            }
            Requirement::CopyEngine => {
                "no asynchronous copy engine with ready/consumed fences to stream KV pages".into()
            }
            Requirement::StreamedAttention => {
                if caps.kv_pairs.is_empty() {
                    "no streamed attention: no (K, V) element type pair is supported".into()
                } else {
                    "no streamed attention: no query width is supported".into()
                }
            }
            Requirement::ComputeOps => {
                if caps.compute_ops {
                    "the compute ops read no weight dtype".into()
                } else {
                    "no compute ops for a model forward (matmul, norms, RoPE, recurrent ops)".into()
                }
            }
        }
    }
}

/// "use --backend cuda or --backend cpu", leaving out `backend` itself.
pub fn fallback_suggestion(backend: &str) -> String {
    let others: Vec<String> = FALLBACK_BACKENDS
        .iter()
        .filter(|b| **b != backend)
        .map(|b| format!("--backend {b}"))
        .collect();
    if others.is_empty() {
        "no other backend to suggest".into()
    } else {
        format!("use {}", others.join(" or "))
    }
}

/// Every requirement `caps` lacks, in checking order, as typed capability errors.
pub fn missing_capabilities(caps: &Capabilities) -> Vec<CapabilityError> {
    Requirement::ALL
        .iter()
        .filter(|r| !r.is_met(caps))
        .map(|r| {
            CapabilityError::new(
                caps.backend,
                r.operation(),
                format!("{}; {}", r.why(caps), fallback_suggestion(caps.backend)),
            )
        })
        .collect()
}

/// The first capability a streamed model run needs that `caps` lacks (pinned host, copy engine,
/// streamed attention, compute ops, in that order), or `None` when the backend can run a model.
///
/// The error names the backend, the capability (`operation`) and why, and suggests the other
/// backends (`--backend cuda` / `--backend cpu`).
pub fn first_missing_capability(caps: &Capabilities) -> Option<CapabilityError> {
    missing_capabilities(caps).into_iter().next()
}

/// Widest value column before a value is wrapped at spaces.
const VALUE_WIDTH: usize = 76;

/// Splits `text` into lines (at its newlines, then at spaces) of at most `width` characters
/// where possible; a single word longer than `width` stays whole.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut cur = String::new();
        for word in line.split(' ') {
            if !cur.is_empty() && cur.chars().count() + 1 + word.chars().count() > width {
                out.push(std::mem::take(&mut cur));
            }
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(word);
        }
        out.push(cur);
    }
    out
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}

fn query_widths(caps: &Capabilities) -> String {
    match (caps.max_decode_width, caps.prefill_attention) {
        (0, false) => "none".into(),
        (0, true) => "prefill only (any width)".into(),
        (1, false) => "1 (decode)".into(),
        (n, false) => format!("1..={n} (decode / verify)"),
        (n, true) => format!("1..={n} (decode / verify), any width (prefill)"),
    }
}

/// K/V pair rows: one summary line, then the pairs grouped by K type.
fn kv_pair_lines(caps: &Capabilities) -> Vec<String> {
    let all = Capabilities::all_kv_pairs();
    if caps.kv_pairs.is_empty() {
        return vec!["none".into()];
    }
    if all.iter().all(|p| caps.kv_pairs.contains(p)) {
        let names: Vec<&str> = KvType::ALL.iter().map(|t| t.name()).collect();
        return vec![format!(
            "all {} ({} for K and for V)",
            all.len(),
            names.join(", ")
        )];
    }
    let mut lines = vec![format!("{} of {}", caps.kv_pairs.len(), all.len())];
    for k in KvType::ALL {
        let vs: Vec<&str> = caps
            .kv_pairs
            .iter()
            .filter(|(pk, _)| *pk == k)
            .map(|(_, v)| v.name())
            .collect();
        if !vs.is_empty() {
            lines.push(format!("K {} with V {}", k.name(), vs.join(", ")));
        }
    }
    lines
}

fn bytes_human(bytes: u64) -> String {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    const MIB: f64 = 1024.0 * 1024.0;
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.1} GiB ({bytes} bytes)", b / GIB)
    } else if b >= MIB {
        format!("{:.1} MiB ({bytes} bytes)", b / MIB)
    } else {
        format!("{bytes} bytes")
    }
}

/// Renders `caps` as a two-column text table (`capability | support`), one row per capability,
/// values wrapped at spaces to about 76 characters and continued on rows with an empty label. The last rows say whether the backend
/// can stream KV pages and run a model, and name the first missing capability when it cannot.
/// Works for every backend; reads nothing but `caps`.
pub fn render_capability_table(caps: &Capabilities) -> String {
    let dtypes = if caps.weight_dtypes.is_empty() {
        "none".to_string()
    } else {
        caps.weight_dtypes
            .iter()
            .map(|d| d.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let streaming_reqs = [
        Requirement::PinnedHost,
        Requirement::CopyEngine,
        Requirement::StreamedAttention,
    ];
    let streaming_missing: Vec<&str> = streaming_reqs
        .iter()
        .filter(|r| !r.is_met(caps))
        .map(|r| r.operation())
        .collect();
    let streaming = if streaming_missing.is_empty() {
        "yes (host KV history streamed over a page ring)".to_string()
    } else {
        format!("no (missing: {})", streaming_missing.join(", "))
    };
    let model_run = match first_missing_capability(caps) {
        None => "yes".to_string(),
        Some(e) => format!("no: first missing `{}`", e.operation),
    };

    let mut rows: Vec<(&str, Vec<String>)> = vec![
        ("backend", vec![caps.backend.to_string()]),
        (
            "device",
            caps.device.lines().map(str::to_string).collect::<Vec<_>>(),
        ),
        (
            "device memory",
            vec![caps
                .device_memory
                .map(bytes_human)
                .unwrap_or_else(|| "unknown".into())],
        ),
        ("pinned host", vec![yes_no(caps.pinned_host)]),
        ("copy engine", vec![yes_no(caps.copy_engine)]),
        ("query widths", vec![query_widths(caps)]),
        ("K/V pairs", kv_pair_lines(caps)),
        ("compute ops", vec![yes_no(caps.compute_ops)]),
        ("weight dtypes", vec![dtypes]),
        ("streaming", vec![streaming]),
        ("runs a model", vec![model_run]),
    ];
    for (_, v) in &mut rows {
        *v = v.iter().flat_map(|line| wrap(line, VALUE_WIDTH)).collect();
        if v.is_empty() {
            v.push(String::new());
        }
    }

    let header = ("capability", "support");
    let label_w = rows
        .iter()
        .map(|(l, _)| l.len())
        .chain([header.0.len()])
        .max()
        .unwrap_or(0);
    let value_w = rows
        .iter()
        .flat_map(|(_, v)| v.iter().map(|s| s.chars().count()))
        .chain([header.1.len()])
        .max()
        .unwrap_or(0);

    let mut out = String::new();
    // Writing to a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(out, "{:<label_w$} | {}", header.0, header.1);
    let _ = writeln!(out, "{}-+-{}", "-".repeat(label_w), "-".repeat(value_w));
    for (label, values) in &rows {
        for (i, v) in values.iter().enumerate() {
            let l = if i == 0 { *label } else { "" };
            let _ = writeln!(out, "{l:<label_w$} | {v}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::WeightDType;

    fn full(backend: &'static str) -> Capabilities {
        Capabilities {
            backend,
            device: "test device".into(),
            pinned_host: true,
            copy_engine: true,
            max_decode_width: 8,
            prefill_attention: true,
            kv_pairs: Capabilities::all_kv_pairs(),
            compute_ops: true,
            weight_dtypes: vec![WeightDType::F32, WeightDType::Bf16],
            device_memory: Some(3 * 1024 * 1024 * 1024),
        }
    }

    /// Applies bit i of `mask` as "requirement i is removed".
    fn with_removed(mut caps: Capabilities, mask: u32) -> Capabilities {
        if mask & 1 != 0 {
            caps.pinned_host = false;
        }
        if mask & 2 != 0 {
            caps.copy_engine = false;
        }
        if mask & 4 != 0 {
            caps.max_decode_width = 0;
            caps.prefill_attention = false;
        }
        if mask & 8 != 0 {
            caps.compute_ops = false;
        }
        caps
    }

    #[test]
    fn first_missing_follows_requirement_order_for_every_subset() {
        for mask in 0u32..16 {
            let caps = with_removed(full("cuda"), mask);
            let got = first_missing_capability(&caps);
            let expected = (0..4).find(|i| mask & (1 << i) != 0);
            match (got, expected) {
                (None, None) => {}
                (Some(e), Some(i)) => {
                    assert_eq!(e.operation, Requirement::ALL[i].operation(), "mask {mask}");
                    assert_eq!(e.backend, "cuda");
                    assert!(e.detail.contains("--backend cpu"), "{}", e.detail);
                    assert!(!e.detail.contains("--backend cuda"), "{}", e.detail);
                }
                (g, e) => panic!("mask {mask}: got {g:?}, expected requirement {e:?}"),
            }
            assert_eq!(
                missing_capabilities(&caps).len(),
                mask.count_ones() as usize,
                "mask {mask}"
            );
        }
    }

    #[test]
    fn empty_pairs_or_dtypes_count_as_missing() {
        let mut caps = full("wgpu");
        caps.kv_pairs.clear();
        let e = first_missing_capability(&caps).expect("missing");
        assert_eq!(e.operation, "streamed_attention");
        assert!(e.detail.contains("pair"), "{}", e.detail);
        assert!(e.detail.contains("--backend cuda or --backend cpu"));

        let mut caps = full("wgpu");
        caps.weight_dtypes.clear();
        let e = first_missing_capability(&caps).expect("missing");
        assert_eq!(e.operation, "compute_ops");
        assert!(e.detail.contains("weight dtype"), "{}", e.detail);

        // Prefill-only attention still counts as streamed attention.
        let mut caps = full("cpu");
        caps.max_decode_width = 0;
        assert!(first_missing_capability(&caps).is_none());
    }

    #[test]
    fn fallback_suggestion_leaves_out_the_backend_itself() {
        assert_eq!(
            fallback_suggestion("wgpu"),
            "use --backend cuda or --backend cpu"
        );
        assert_eq!(fallback_suggestion("cuda"), "use --backend cpu");
        assert_eq!(fallback_suggestion("cpu"), "use --backend cuda");
    }

    fn row<'a>(table: &'a str, label: &str) -> &'a str {
        table
            .lines()
            .find(|l| l.split('|').next().map(str::trim) == Some(label))
            .and_then(|l| l.split_once('|'))
            .map(|(_, v)| v.trim())
            .unwrap_or_else(|| panic!("no row `{label}` in\n{table}"))
    }

    #[test]
    fn table_reflects_full_capabilities() {
        let caps = full("cpu");
        let t = render_capability_table(&caps);
        assert_eq!(row(&t, "backend"), "cpu");
        assert_eq!(row(&t, "device"), "test device");
        assert_eq!(row(&t, "pinned host"), "yes");
        assert_eq!(row(&t, "copy engine"), "yes");
        assert!(row(&t, "query widths").starts_with("1..=8"));
        assert!(row(&t, "query widths").contains("prefill"));
        assert!(row(&t, "K/V pairs").starts_with("all 25"));
        assert_eq!(row(&t, "weight dtypes"), "f32, bf16");
        assert!(row(&t, "device memory").starts_with("3.0 GiB"));
        assert!(row(&t, "streaming").starts_with("yes"));
        assert_eq!(row(&t, "runs a model"), "yes");
        // Every line has the separator at the same column.
        let cols: Vec<usize> = t
            .lines()
            .map(|l| l.find(['|', '+']).expect("separator"))
            .collect();
        assert!(cols.windows(2).all(|w| w[0] == w[1]), "{t}");
    }

    #[test]
    fn table_reflects_a_capability_less_backend() {
        let caps = Capabilities {
            backend: "wgpu",
            device: "no wgpu adapter found on this machine".into(),
            pinned_host: false,
            copy_engine: false,
            max_decode_width: 0,
            prefill_attention: false,
            kv_pairs: vec![],
            compute_ops: false,
            weight_dtypes: vec![],
            device_memory: None,
        };
        let t = render_capability_table(&caps);
        assert_eq!(row(&t, "device"), caps.device);
        assert_eq!(row(&t, "pinned host"), "no");
        assert_eq!(row(&t, "query widths"), "none");
        assert_eq!(row(&t, "K/V pairs"), "none");
        assert_eq!(row(&t, "device memory"), "unknown");
        assert_eq!(
            row(&t, "streaming"),
            "no (missing: pinned_host, copy_engine, streamed_attention)"
        );
        assert_eq!(row(&t, "runs a model"), "no: first missing `pinned_host`");
    }

    #[test]
    fn long_values_wrap_without_losing_words() {
        let mut caps = full("wgpu");
        let words: Vec<String> = (0..40)
            .map(|i| format!("w{i}x{}", "y".repeat(i % 7)))
            .collect();
        caps.device = words.join(" ");
        let t = render_capability_table(&caps);
        let mut lines = t.lines().skip_while(|l| !l.starts_with("device "));
        let mut got = Vec::new();
        if let Some(first) = lines.next() {
            got.push(
                first
                    .split_once('|')
                    .map(|(_, v)| v.trim())
                    .unwrap_or_default(),
            );
        }
        for l in lines {
            let (label, v) = l.split_once('|').expect("separator");
            if !label.trim().is_empty() {
                break;
            }
            got.push(v.trim());
        }
        assert!(got.len() > 1, "{t}");
        assert!(got.iter().all(|l| l.chars().count() <= VALUE_WIDTH), "{t}");
        assert_eq!(got.join(" "), caps.device);
        // A word longer than the width stays whole on its own line.
        let long = "z".repeat(VALUE_WIDTH + 9);
        assert_eq!(
            wrap(&format!("a {long} b"), VALUE_WIDTH),
            vec!["a", long.as_str(), "b"]
        );
    }

    #[test]
    fn table_lists_partial_kv_pairs_grouped_by_k() {
        let mut caps = full("cuda");
        caps.kv_pairs = vec![
            (KvType::F16, KvType::F16),
            (KvType::Q8_0, KvType::Q8_0),
            (KvType::Q8_0, KvType::Q4_0),
        ];
        caps.max_decode_width = 1;
        caps.prefill_attention = false;
        let t = render_capability_table(&caps);
        assert_eq!(row(&t, "K/V pairs"), "3 of 25");
        assert!(t.contains("K f16 with V f16"), "{t}");
        assert!(t.contains("K q8_0 with V q8_0, q4_0"), "{t}");
        assert!(!t.contains("K f32 with"), "{t}");
        assert_eq!(row(&t, "query widths"), "1 (decode)");
    }
}
