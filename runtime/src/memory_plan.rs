//! The device memory plan: everything the engine holds on the device, by class, and a verdict
//! against a device budget (`kvstream inspect --device-memory 16GiB`).
//!
//! Device memory = weights (by class) + recurrent (GDN) state copies + the KV arena (pool,
//! workspace and attention scratch: [`crate::phase`]) + a fixed overhead. Host memory (shown
//! for information, never counted against the device budget) = the embedding table and the
//! pinned KV history at the configured context.
//!
//! ## The fixed overhead ([`DEFAULT_FIXED_OVERHEAD_BYTES`] = 512 MiB)
//!
//! What a process holds on the device before it allocates anything of its own: the CUDA
//! context (per-SM local-memory/stack reservation, printf FIFO, device heap, driver
//! bookkeeping), the loaded kernel modules and the cuBLAS handle. Measured on an NVIDIA H200
//! (CUDA 13, lazy module loading, 132 SMs): `total - free` is 526 MiB right after context
//! creation and 594 MiB after `cublasCreate` plus a first f32 and bf16 GEMM. About 258 MiB of the
//! context is the per-thread stack reservation, which scales with the SM count
//! (132 SMs × 2048 threads × 1 KiB); a 16 GiB card has at most ~84 SMs × 1536 threads, i.e. about
//! 126 MiB, so its context + cuBLAS lands near 460 MiB. 512 MiB covers that plus kvstream's
//! NVRTC modules (a few MiB). On an H200 itself pass `--device-overhead 600MiB`.
//!
//! ## Recurrent state copies
//!
//! One live GDN state (f32 `S [v_heads, k_dim, v_dim]` + f32 conv `[kernel-1, conv_dim]` per GDN
//! layer, exactly [`kvstream_model_qwen::RecurrentState::device_bytes`]), plus one step
//! checkpoint when [`EngineConfig::checkpoint_steps`] is set, plus `draft_n_max + 1` verify
//! checkpoints with speculative decoding (one per verified token, [`crate::mtp`]), plus the prompt
//! cache's checkpoint when the server reuses prefixes.

use crate::engine::EngineConfig;
use crate::error::{Result, RuntimeError};
use kvstream_memory_contracts::backend::WeightDType;
use kvstream_memory_contracts::kv::geometry::PageGeometry;
use kvstream_model_qwen::{
    plan_weight_bytes, LoadReport, QwenConfig, WeightBytesPlan, WeightPolicy,
};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Bytes a process holds on the device before its own allocations (CUDA context, modules,
/// cuBLAS handle). See the module documentation for the measurement behind it.
pub const DEFAULT_FIXED_OVERHEAD_BYTES: u64 = 512 << 20;

const MIB: f64 = (1u64 << 20) as f64;
const GIB: u64 = 1 << 30;

/// The weight rows of a plan: device bytes by class, and the host bytes of the embedding table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightRows {
    /// Device rows (decoder linears, `lm_head`, MTP, small tensors; or one row when loaded).
    pub device: Vec<PlanRow>,
    /// Host bytes of the embedding table (kept on the host; rows are gathered per step).
    pub host_embedding: u64,
}

fn fmt_name(f: Option<WeightDType>) -> String {
    f.map_or_else(|| "as stored".to_string(), |d| d.name().to_string())
}

impl WeightRows {
    /// From the config alone: [`plan_weight_bytes`] for a bf16 checkpoint loaded with `policy`
    /// (the MTP head counted when `include_mtp`).
    pub fn planned(config: &QwenConfig, policy: &WeightPolicy, include_mtp: bool) -> Self {
        Self::from_plan(&plan_weight_bytes(config, policy, include_mtp), policy)
    }

    /// From a [`WeightBytesPlan`] computed for `policy`.
    pub fn from_plan(p: &WeightBytesPlan, policy: &WeightPolicy) -> Self {
        let head = fmt_name(policy.effective_head());
        let mut device = vec![PlanRow::new(
            "weights: decoder linears",
            p.decoder_linear,
            fmt_name(policy.format),
        )];
        if p.head > 0 {
            device.push(PlanRow::new("weights: lm_head", p.head, head.clone()));
        }
        if p.mtp > 0 {
            device.push(PlanRow::new("weights: MTP head", p.mtp, head));
        }
        device.push(PlanRow::new(
            "weights: norms + small GDN tensors",
            p.small,
            "as stored".into(),
        ));
        Self {
            device,
            host_embedding: p.host_embedding,
        }
    }

    /// From a loaded model's [`LoadReport`] (one device row: the loader does not split bytes by
    /// class).
    pub fn loaded(report: &LoadReport, policy: &WeightPolicy) -> Self {
        Self {
            device: vec![PlanRow::new(
                "weights (as loaded)",
                report.device_weight_bytes as u64,
                format!(
                    "{} / head {}; {} quantized, {} kept, {} fallback tensors",
                    fmt_name(policy.format),
                    fmt_name(policy.effective_head()),
                    report.quantized,
                    report.kept,
                    report.fallback.len()
                ),
            )],
            host_embedding: report.host_embedding_bytes as u64,
        }
    }

    /// Device bytes of all weight rows.
    pub fn device_total(&self) -> u64 {
        self.device
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes))
    }
}

/// One line of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanRow {
    /// What the bytes are.
    pub label: String,
    /// Bytes.
    pub bytes: u64,
    /// How they were computed (shapes, formats, counts).
    pub detail: String,
}

impl PlanRow {
    /// A row.
    pub fn new(label: &str, bytes: u64, detail: String) -> Self {
        Self {
            label: label.into(),
            bytes,
            detail,
        }
    }
}

/// How the plan is built beyond the engine configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanOptions {
    /// Fixed overhead (CUDA context, modules, cuBLAS); default [`DEFAULT_FIXED_OVERHEAD_BYTES`].
    pub fixed_overhead: u64,
    /// The device budget the verdict is against (`None`: no verdict).
    pub budget: Option<u64>,
    /// Count the prompt cache's recurrent checkpoint (the server reuses prefixes).
    pub prompt_cache: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            fixed_overhead: DEFAULT_FIXED_OVERHEAD_BYTES,
            budget: None,
            prompt_cache: false,
        }
    }
}

/// Whether the device total fits the budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// No budget was given.
    NoBudget,
    /// Fits, with `spare` bytes left.
    Fits { budget: u64, spare: u64 },
    /// Does not fit: `short` bytes are missing.
    DoesNotFit { budget: u64, short: u64 },
}

impl Verdict {
    /// True unless the plan is over budget.
    pub fn fits(&self) -> bool {
        !matches!(self, Verdict::DoesNotFit { .. })
    }
}

/// `16 GiB` for whole GiB, else `2240.0 MiB`.
pub fn human_bytes(b: u64) -> String {
    if b >= GIB && b % GIB == 0 {
        format!("{} GiB", b / GIB)
    } else {
        format!("{:.1} MiB", b as f64 / MIB)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Verdict::NoBudget => f.write_str("no device budget given (--device-memory)"),
            Verdict::Fits { budget, spare } => write!(
                f,
                "fits in {} ({:.1} MiB spare)",
                human_bytes(budget),
                spare as f64 / MIB
            ),
            Verdict::DoesNotFit { budget, short } => write!(
                f,
                "does not fit in {}: short by {:.1} MiB",
                human_bytes(budget),
                short as f64 / MIB
            ),
        }
    }
}

/// Device and host memory of one engine configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryPlan {
    /// Device rows (their sum is [`MemoryPlan::device_total`]).
    pub device: Vec<PlanRow>,
    /// Host rows (information only).
    pub host: Vec<PlanRow>,
    /// The device budget, if any.
    pub budget: Option<u64>,
}

impl MemoryPlan {
    /// Sum of the device rows (saturating).
    pub fn device_total(&self) -> u64 {
        self.device
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes))
    }
    /// Sum of the host rows (saturating).
    pub fn host_total(&self) -> u64 {
        self.host
            .iter()
            .fold(0u64, |a, r| a.saturating_add(r.bytes))
    }
    /// The device total against the budget.
    pub fn verdict(&self) -> Verdict {
        let total = self.device_total();
        match self.budget {
            None => Verdict::NoBudget,
            Some(budget) if total <= budget => Verdict::Fits {
                budget,
                spare: budget - total,
            },
            Some(budget) => Verdict::DoesNotFit {
                budget,
                short: total - budget,
            },
        }
    }

    /// The plan as a text table (MiB and GiB per row, totals, verdict).
    pub fn render(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, r: &PlanRow| {
            s.push_str(&format!(
                "  {:<34} {:>12.1} MiB {:>8.3} GiB  {}\n",
                r.label,
                r.bytes as f64 / MIB,
                r.bytes as f64 / GIB as f64,
                r.detail
            ));
        };
        s.push_str("device memory plan:\n");
        for r in &self.device {
            line(&mut s, r);
        }
        let total = PlanRow {
            label: "device total".into(),
            bytes: self.device_total(),
            detail: String::new(),
        };
        line(&mut s, &total);
        s.push_str("host memory (not on the device):\n");
        for r in &self.host {
            line(&mut s, r);
        }
        s.push_str(&format!("verdict: {}\n", self.verdict()));
        s
    }
}

/// Device bytes of one recurrent state of `config` (f32 S and f32 conv state of every GDN
/// layer); equals `RecurrentState::device_bytes` of a freshly created state.
pub fn recurrent_state_bytes(config: &QwenConfig) -> u64 {
    let ssm =
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim;
    let conv = config.linear_conv_kernel_dim.saturating_sub(1) * config.linear_conv_dim();
    ((ssm + conv) * 4 * config.n_linear_layers()) as u64
}

/// How many recurrent states the engine holds at its peak, with what each copy is for.
pub fn recurrent_copies(cfg: &EngineConfig, prompt_cache: bool) -> (usize, String) {
    let mut n = 1;
    let mut why = vec!["live".to_string()];
    if cfg.checkpoint_steps {
        n += 1;
        why.push("step checkpoint".into());
    }
    if let Some(spec) = &cfg.spec {
        n += spec.draft_n_max + 1;
        why.push(format!("{} verify checkpoints", spec.draft_n_max + 1));
    }
    if prompt_cache {
        n += 1;
        why.push("prompt cache".into());
    }
    (n, why.join(", "))
}

/// Builds the plan of `cfg` over a model of `config` whose weights take `weights`.
///
/// Fails with [`RuntimeError::InvalidConfig`] for a page geometry the KV format rejects.
pub fn plan_memory(
    config: &QwenConfig,
    cfg: &EngineConfig,
    weights: &WeightRows,
    opts: &PlanOptions,
) -> Result<MemoryPlan> {
    let mut device = weights.device.clone();
    let one = recurrent_state_bytes(config);
    let (copies, why) = recurrent_copies(cfg, opts.prompt_cache);
    device.push(PlanRow::new(
        "recurrent state (GDN)",
        one.saturating_mul(copies as u64),
        format!(
            "{:.1} MiB x {copies} ({why}); f32 S [{},{},{}] + conv [{},{}] x {} layers",
            one as f64 / MIB,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim.saturating_sub(1),
            config.linear_conv_dim(),
            config.n_linear_layers()
        ),
    ));
    device.push(PlanRow::new(
        "KV arena",
        cfg.arena_bytes,
        "pool + workspace + attention scratch".into(),
    ));
    device.push(PlanRow::new(
        "fixed overhead",
        opts.fixed_overhead,
        "CUDA context, modules, cuBLAS".into(),
    ));

    let geometry = PageGeometry::new(
        cfg.page_tokens,
        config.num_key_value_heads,
        config.head_dim,
        cfg.k_type,
        cfg.v_type,
    )
    .map_err(|e| RuntimeError::InvalidConfig(format!("KV page geometry: {e}")))?;
    let layers = config.n_attention_layers() + usize::from(cfg.spec.is_some());
    let history = (geometry.pages_for(cfg.ctx_size) as u64)
        .saturating_mul(geometry.page_bytes() as u64)
        .saturating_mul(layers as u64);
    let host = vec![
        PlanRow::new(
            "embedding table",
            weights.host_embedding,
            format!("[{}, {}]", config.vocab_size, config.hidden_size),
        ),
        PlanRow::new(
            "KV history (pinned)",
            history,
            format!(
                "{} tokens, K {} / V {}, {layers} layers",
                cfg.ctx_size, cfg.k_type, cfg.v_type
            ),
        ),
    ];
    Ok(MemoryPlan {
        device,
        host,
        budget: opts.budget,
    })
}

/// [`plan_memory`] with the weights planned from the config and `cfg.weights` (the MTP head
/// counted when `cfg.spec` is set): the plan `kvstream inspect` prints, no weight read.
pub fn plan_from_config(
    config: &QwenConfig,
    cfg: &EngineConfig,
    opts: &PlanOptions,
) -> Result<MemoryPlan> {
    let weights = WeightRows::planned(config, &cfg.weights, cfg.spec.is_some());
    plan_memory(config, cfg, &weights, opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speculative::SpecConfig;
    use std::path::Path;

    /// The Qwen3.8-27B text config (qwen-spec §1).
    pub(crate) fn config_27b() -> QwenConfig {
        let layer_types: Vec<&str> = (0..64)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        let json = serde_json::json!({
            "model_type": "qwen3_5_text",
            "hidden_size": 5120, "num_hidden_layers": 64, "layer_types": layer_types,
            "full_attention_interval": 4, "intermediate_size": 17408,
            "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
            "attn_output_gate": true, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                "mrope_interleaved": true},
            "partial_rotary_factor": 0.25, "max_position_embeddings": 262_144,
            "vocab_size": 248_320, "tie_word_embeddings": false, "mtp_num_hidden_layers": 1,
            "eos_token_id": 248_044
        });
        QwenConfig::from_json_str(&json.to_string(), Path::new("27b.json")).expect("27b config")
    }

    fn plan_bytes(decoder: u64, head: u64) -> WeightBytesPlan {
        WeightBytesPlan {
            decoder_linear: decoder,
            head,
            mtp: 0,
            small: 50 << 20,
            host_embedding: 2_542_796_800,
        }
    }

    fn budget16() -> PlanOptions {
        PlanOptions {
            budget: Some(16 << 30),
            ..PlanOptions::default()
        }
    }

    #[test]
    fn recurrent_state_of_27b_matches_the_spec() {
        // qwen-spec §7: S is 3,145,728 B per layer in f32; the conv state [3, 10240] is
        // 122,880 B in f32; 48 GDN layers.
        let c = config_27b();
        assert_eq!(recurrent_state_bytes(&c), 48 * (3_145_728 + 122_880));
    }

    #[test]
    fn recurrent_state_bytes_equal_a_real_state() {
        use kvstream_backend_cpu::CpuBackend;
        use kvstream_model_qwen::{LoadOptions, QwenModel};
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-gqa-f32");
        let b = CpuBackend::new();
        let m = QwenModel::load(&b, &dir, &LoadOptions::default()).expect("model");
        let st = m.new_recurrent_state(&b).expect("state");
        assert!(st.device_bytes() > 0);
        assert_eq!(recurrent_state_bytes(m.config()), st.device_bytes() as u64);
    }

    #[test]
    fn engine_loads_with_the_policy_and_plans_its_loaded_weights() {
        use crate::engine::Engine;
        use kvstream_backend_cpu::CpuBackend;
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-gqa-f32");
        let mut cfg = EngineConfig::new(&dir);
        cfg.ctx_size = 256;
        cfg.arena_bytes = 8 << 20;
        let plain = Engine::load(CpuBackend::new(), cfg.clone()).expect("engine");
        cfg.weights = WeightPolicy::new(WeightDType::Q8_0);
        let q8 = Engine::load(CpuBackend::new(), cfg.clone()).expect("engine");
        let (rp, rq) = (plain.load_report(), q8.load_report());
        assert_eq!(rp.quantized, 0);
        assert!(rq.quantized > 0, "{rq:?}");
        // f32 fixture → q8_0 (8.5 bits) for the decoder linears: far fewer device bytes.
        assert!(
            rq.device_weight_bytes * 2 < rp.device_weight_bytes,
            "{rq:?} {rp:?}"
        );
        let plan = q8.memory_plan(&PlanOptions::default()).expect("plan");
        assert_eq!(plan.device[0].bytes, rq.device_weight_bytes as u64);
        assert!(
            plan.device[0].detail.contains("q8_0"),
            "{:?}",
            plan.device[0]
        );
        assert_eq!(
            plan.device_total(),
            rq.device_weight_bytes as u64
                + 2 * recurrent_state_bytes(q8.model_config())
                + cfg.arena_bytes
                + DEFAULT_FIXED_OVERHEAD_BYTES
        );
    }

    #[test]
    fn copies_follow_checkpointing_speculation_and_prompt_cache() {
        let mut cfg = EngineConfig::new("m");
        assert_eq!(recurrent_copies(&cfg, false).0, 2);
        cfg.checkpoint_steps = false;
        assert_eq!(recurrent_copies(&cfg, false).0, 1);
        cfg.spec = Some(SpecConfig { draft_n_max: 3 });
        assert_eq!(recurrent_copies(&cfg, true).0, 1 + 4 + 1);
    }

    #[test]
    fn device_total_is_the_sum_of_its_classes_and_the_verdict_follows_the_budget() {
        let c = config_27b();
        let mut cfg = EngineConfig::new("m");
        cfg.arena_bytes = 2240 << 20;
        let p = plan_bytes(12_543_590_400, 1_350_860_800);
        let w = WeightRows::from_plan(&p, &WeightPolicy::new(WeightDType::Q4G128));
        assert_eq!(w.device_total(), p.device_total());
        let mut opts = budget16();
        let plan = plan_memory(&c, &cfg, &w, &opts).expect("plan");
        let want = p.device_total()
            + 2 * recurrent_state_bytes(&c)
            + cfg.arena_bytes
            + DEFAULT_FIXED_OVERHEAD_BYTES;
        assert_eq!(plan.device_total(), want);
        assert!(plan.render().contains("q8_0"), "{}", plan.render());
        // A budget one byte below the total is short by exactly one byte.
        opts.budget = Some(want - 1);
        let tight = plan_memory(&c, &cfg, &w, &opts).expect("plan");
        assert_eq!(
            tight.verdict(),
            Verdict::DoesNotFit {
                budget: want - 1,
                short: 1
            }
        );
        opts.budget = Some(want);
        let exact = plan_memory(&c, &cfg, &w, &opts).expect("plan");
        assert_eq!(
            exact.verdict(),
            Verdict::Fits {
                budget: want,
                spare: 0
            }
        );
        // Host: embeddings + the pinned history at ctx (f16 K/V: 4 KiB per token per layer).
        let hist = plan
            .host
            .iter()
            .find(|r| r.label.contains("KV"))
            .expect("kv row");
        assert_eq!(hist.bytes, 4096 * 16 * cfg.ctx_size as u64);
        assert_eq!(plan.host_total(), hist.bytes + p.host_embedding);
    }

    #[test]
    fn qwen38_27b_fits_16_gib_with_q4_g128_and_not_with_bf16() {
        let c = config_27b();
        let mut cfg = EngineConfig::new("m");
        cfg.arena_bytes = 2240 << 20;
        cfg.ctx_size = 262_144;
        cfg.weights = WeightPolicy::new(WeightDType::Q4G128);
        let q4 = plan_from_config(&c, &cfg, &budget16()).expect("plan");
        // qwen-spec §7 parameter counts: 24,326,963,200 decoder linear weights (all K multiples
        // of 128) at 4.125 bits; lm_head 248,320 x 5,120 in q8_0 (8.5 bits); embeddings on the
        // host.
        let row = |p: &MemoryPlan, l: &str| {
            p.device
                .iter()
                .find(|r| r.label.contains(l))
                .map(|r| r.bytes)
                .unwrap_or(0)
        };
        assert_eq!(row(&q4, "decoder"), 24_326_963_200 * 33 / 64);
        assert_eq!(row(&q4, "lm_head"), 1_271_398_400 * 17 / 16);
        assert_eq!(row(&q4, "MTP"), 0);
        assert!(q4.verdict().fits(), "{}", q4.render());
        // q4_nl_g128 has the q4_g128 layout: the same plan, byte for byte.
        cfg.weights = WeightPolicy::new(WeightDType::Q4NlG128);
        let nl = plan_from_config(&c, &cfg, &budget16()).expect("plan");
        assert_eq!(nl.device_total(), q4.device_total());
        assert_eq!(row(&nl, "decoder"), row(&q4, "decoder"));
        assert!(nl.verdict().fits(), "{}", nl.render());
        cfg.weights = WeightPolicy::new(WeightDType::Bf16);
        let bf16 = plan_from_config(&c, &cfg, &budget16()).expect("plan");
        assert!(!bf16.verdict().fits(), "{}", bf16.render());
        assert!(bf16.render().contains("does not fit in 16 GiB: short by"));
        assert!(row(&bf16, "decoder") == 24_326_963_200 * 2);
    }

    #[test]
    fn speculation_adds_state_copies_and_the_mtp_row() {
        let c = config_27b();
        let mut cfg = EngineConfig::new("m");
        cfg.weights = WeightPolicy::new(WeightDType::Q4G128);
        let base = plan_from_config(&c, &cfg, &PlanOptions::default()).expect("plan");
        cfg.spec = Some(SpecConfig { draft_n_max: 2 });
        let spec = plan_from_config(&c, &cfg, &PlanOptions::default()).expect("plan");
        let mtp = spec
            .device
            .iter()
            .find(|r| r.label.contains("MTP"))
            .expect("MTP row");
        // qwen-spec §7: the MTP head has 424,699,392 parameters, most of them in q8_0 linears.
        assert!(
            mtp.bytes > 424_699_392 && mtp.bytes < 424_699_392 * 9 / 8,
            "{mtp:?}"
        );
        assert_eq!(
            spec.device_total() - base.device_total(),
            mtp.bytes + 3 * recurrent_state_bytes(&c)
        );
        assert_eq!(base.verdict(), Verdict::NoBudget);
        // The 17th attention layer's history is on the host too.
        let kv = |p: &MemoryPlan| {
            p.host
                .iter()
                .find(|r| r.label.contains("KV"))
                .map_or(0, |r| r.bytes)
        };
        assert_eq!(kv(&spec) * 16, kv(&base) * 17);
    }
}
