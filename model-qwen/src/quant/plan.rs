//! The list of tensors a model loads (name, shape, role) and [`plan_weight_bytes`]: the device
//! and host bytes of a policy, computed from the config alone.
//!
//! Fused projections (`crate::fused`) are counted as their parts: the loader fuses only when the
//! fused blob has exactly the parts' bytes, so the plan is the same with fusion on or off.

use super::policy::WeightPolicy;
use super::role::{decide, Role};
use crate::config::{LayerType, QwenConfig};
use kvstream_memory_contracts::backend::WeightDType;

/// What a tensor is for, for byte accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    /// The embedding table (host).
    Embedding,
    /// A quantizable decoder-layer linear.
    DecoderLinear,
    /// `lm_head`.
    Head,
    /// Anything of the MTP head.
    Mtp,
    /// Norms, conv, `A_log`, `dt_bias`, GDN `in_proj_a`/`in_proj_b`, the final norm.
    Small,
}

/// One tensor of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Planned {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    pub class: Class,
}

/// The tensors of one decoder layer under prefix `p` (mirrors `Layer::load`).
fn layer(
    out: &mut Vec<Planned>,
    p: &str,
    c: &QwenConfig,
    full: bool,
    linear: Role,
    class_linear: Class,
    class_small: Class,
) {
    let mut push = |name: String, shape: Vec<usize>, role: Role| {
        let class = if role == Role::Kept {
            class_small
        } else {
            class_linear
        };
        out.push(Planned {
            name,
            shape,
            role,
            class,
        });
    };
    let (h, i) = (c.hidden_size, c.intermediate_size);
    push(format!("{p}input_layernorm.weight"), vec![h], Role::Kept);
    push(
        format!("{p}post_attention_layernorm.weight"),
        vec![h],
        Role::Kept,
    );
    if full {
        let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let a = format!("{p}self_attn.");
        push(format!("{a}q_proj.weight"), vec![nh * d * 2, h], linear);
        push(format!("{a}k_proj.weight"), vec![nkv * d, h], linear);
        push(format!("{a}v_proj.weight"), vec![nkv * d, h], linear);
        push(format!("{a}o_proj.weight"), vec![h, nh * d], linear);
        push(format!("{a}q_norm.weight"), vec![d], Role::Kept);
        push(format!("{a}k_norm.weight"), vec![d], Role::Kept);
    } else {
        let hv = c.linear_num_value_heads;
        let vd = hv * c.linear_value_head_dim;
        let g = format!("{p}linear_attn.");
        let cd = c.linear_conv_dim();
        push(format!("{g}in_proj_qkv.weight"), vec![cd, h], linear);
        push(format!("{g}in_proj_z.weight"), vec![vd, h], linear);
        push(format!("{g}in_proj_b.weight"), vec![hv, h], Role::Kept);
        push(format!("{g}in_proj_a.weight"), vec![hv, h], Role::Kept);
        push(
            format!("{g}conv1d.weight"),
            vec![cd, 1, c.linear_conv_kernel_dim],
            Role::Kept,
        );
        push(format!("{g}dt_bias"), vec![hv], Role::Kept);
        push(format!("{g}A_log"), vec![hv], Role::Kept);
        push(
            format!("{g}norm.weight"),
            vec![c.linear_value_head_dim],
            Role::Kept,
        );
        push(format!("{g}out_proj.weight"), vec![h, vd], linear);
    }
    push(format!("{p}mlp.gate_proj.weight"), vec![i, h], linear);
    push(format!("{p}mlp.up_proj.weight"), vec![i, h], linear);
    push(format!("{p}mlp.down_proj.weight"), vec![h, i], linear);
}

/// Every tensor the model loads, with `prefix` (`model.language_model.` or `model.`); the head
/// is always listed as `lm_head.weight` (for tied models it is read from the embedding unless
/// the checkpoint has its own `lm_head.weight`).
pub(crate) fn tensor_plan(c: &QwenConfig, prefix: &str, include_mtp: bool) -> Vec<Planned> {
    let (h, v) = (c.hidden_size, c.vocab_size);
    let mut out = vec![
        Planned {
            name: format!("{prefix}embed_tokens.weight"),
            shape: vec![v, h],
            role: Role::Kept,
            class: Class::Embedding,
        },
        Planned {
            name: format!("{prefix}norm.weight"),
            shape: vec![h],
            role: Role::Kept,
            class: Class::Small,
        },
        Planned {
            name: "lm_head.weight".into(),
            shape: vec![v, h],
            role: Role::Head,
            class: Class::Head,
        },
    ];
    for (i, ty) in c.layer_types.iter().enumerate() {
        layer(
            &mut out,
            &format!("{prefix}layers.{i}."),
            c,
            *ty == LayerType::Full,
            Role::DecoderLinear,
            Class::DecoderLinear,
            Class::Small,
        );
    }
    if include_mtp && c.mtp_num_hidden_layers > 0 {
        out.push(Planned {
            name: "mtp.fc.weight".into(),
            shape: vec![h, 2 * h],
            role: Role::Head,
            class: Class::Mtp,
        });
        for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"] {
            out.push(Planned {
                name: format!("mtp.{n}.weight"),
                shape: vec![h],
                role: Role::Kept,
                class: Class::Mtp,
            });
        }
        layer(
            &mut out,
            "mtp.layers.0.",
            c,
            true,
            Role::Head,
            Class::Mtp,
            Class::Mtp,
        );
    }
    out
}

/// Bytes of a model's weights under a policy, by class (from the config alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WeightBytesPlan {
    /// Decoder-layer linear weights (device), fallbacks included.
    pub decoder_linear: u64,
    /// `lm_head` (device; for tied models a device copy of the embedding in the head format).
    pub head: u64,
    /// The MTP head, everything (device; 0 without MTP).
    pub mtp: u64,
    /// Norms, conv, `A_log`, `dt_bias`, GDN `in_proj_a`/`in_proj_b`, the final norm (device).
    pub small: u64,
    /// The embedding table (HOST memory).
    pub host_embedding: u64,
}

impl WeightBytesPlan {
    /// Device bytes of every weight: `decoder_linear + head + mtp + small` (the embedding is
    /// on the host). Equals `QwenModel::weight_bytes` of a model loaded with the same policy
    /// from a checkpoint stored in the plan's stored dtype.
    pub fn device_total(&self) -> u64 {
        self.decoder_linear + self.head + self.mtp + self.small
    }
}

/// [`plan_weight_bytes_stored`] for a checkpoint stored in bf16 (every real Qwen checkpoint).
pub fn plan_weight_bytes(
    cfg: &QwenConfig,
    policy: &WeightPolicy,
    include_mtp: bool,
) -> WeightBytesPlan {
    plan_weight_bytes_stored(cfg, policy, include_mtp, WeightDType::Bf16)
}

/// The bytes of each class of weight when a checkpoint whose tensors are all stored as
/// `stored` is loaded with `policy` (same decisions and fallbacks as the loader). Pure
/// arithmetic: no weights are read.
pub fn plan_weight_bytes_stored(
    cfg: &QwenConfig,
    policy: &WeightPolicy,
    include_mtp: bool,
    stored: WeightDType,
) -> WeightBytesPlan {
    let mut p = WeightBytesPlan::default();
    for t in tensor_plan(cfg, "model.", include_mtp) {
        let dtype = decide(t.role, stored, &t.shape, policy).dtype;
        let bytes = dtype.storage_bytes(&t.shape).map_or_else(
            |_| t.shape.iter().map(|d| *d as u64).product::<u64>() * stored.size() as u64,
            |b| b as u64,
        );
        match t.class {
            Class::Embedding => p.host_embedding += bytes,
            Class::DecoderLinear => p.decoder_linear += bytes,
            Class::Head => p.head += bytes,
            Class::Mtp => p.mtp += bytes,
            Class::Small => p.small += bytes,
        }
    }
    p
}
