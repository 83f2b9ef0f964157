//! Decoder-layer weights and their forward passes (qwen-spec §3): zero-centred norms, SwiGLU MLP,
//! gated full attention and Gated DeltaNet, written against the backend-neutral ops.

use crate::attention_kv::{AttentionKv, AttentionPhase};
use crate::config::{GateActivation, QwenConfig};
use crate::error::ModelError;
use crate::fused::Proj;
use crate::quant::role::{decide, Role};
use crate::quant::{LoadReport, WeightPolicy};
use crate::state::GdnState;
use crate::synthetic::TensorSource;
use kvstream_memory_contracts::backend::DeviceWeight;
use kvstream_memory_contracts::ops::{DeltaMode, DeltaShape, ModelBackend, Position3};

/// Loads tensors into backend weights, converting each to the format its role and the
/// [`WeightPolicy`] ask for (one tensor at a time), and records what it did.
pub(crate) struct Loader<'a, B: ModelBackend> {
    pub b: &'a B,
    pub ck: &'a dyn TensorSource,
    pub policy: WeightPolicy,
    /// Role of the linears `Layer::load` asks for (decoder layers, or the MTP head).
    pub linear_role: Role,
    pub report: LoadReport,
    /// Fuse linears that share their input ([`Loader::linears`]).
    pub fuse: bool,
    /// Fused weights made so far.
    pub fused: usize,
}

impl<'a, B: ModelBackend> Loader<'a, B> {
    pub fn new(b: &'a B, ck: &'a dyn TensorSource, policy: WeightPolicy) -> Self {
        Self {
            b,
            ck,
            policy,
            linear_role: Role::DecoderLinear,
            report: LoadReport::default(),
            fuse: true,
            fused: 0,
        }
    }

    /// A tensor kept as stored (norms, conv, GDN `in_proj_a`/`in_proj_b`, ...).
    pub fn get(&mut self, name: &str, shape: &[usize]) -> Result<B::Weight, ModelError> {
        self.load(name, shape, Role::Kept)
    }

    /// A linear weight of the current layer kind ([`Loader::linear_role`]).
    pub fn linear(&mut self, name: &str, shape: &[usize]) -> Result<B::Weight, ModelError> {
        self.load(name, shape, self.linear_role)
    }

    /// `name` loaded with the format of `role` (quantize-at-load when it differs from the
    /// stored one; fallbacks are recorded in the report).
    pub fn load(
        &mut self,
        name: &str,
        shape: &[usize],
        role: Role,
    ) -> Result<B::Weight, ModelError> {
        let stored = self.ck.stored_dtype(name, shape)?;
        let d = decide(role, stored, shape, &self.policy);
        if d.fallback {
            tracing::debug!(name, to = %d.dtype, "format does not fit K: fallback");
            self.report.fallback.push((name.to_string(), d.dtype));
        }
        let t = if d.dtype == stored {
            self.ck.get(name, shape)?
        } else {
            self.ck.get_as(name, shape, d.dtype)?
        };
        let w = self.b.load_weight(name, t.dtype, &t.shape, t.data)?;
        self.report.record(w.dtype(), w.device_bytes());
        Ok(w)
    }
}

/// SwiGLU MLP.
pub(crate) struct Mlp<B: ModelBackend> {
    /// `[gate; up]` (fused: `[2i, h]`).
    gate_up: Proj<B>,
    down: B::Weight,
}

impl<B: ModelBackend> Mlp<B> {
    fn load(l: &mut Loader<'_, B>, p: &str, c: &QwenConfig) -> Result<Self, ModelError> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_up: l.linears(&[
                (format!("{p}mlp.gate_proj.weight"), vec![i, h]),
                (format!("{p}mlp.up_proj.weight"), vec![i, h]),
            ])?,
            down: l.linear(&format!("{p}mlp.down_proj.weight"), &[h, i])?,
        })
    }

    fn forward(&self, b: &B, u: &B::Tensor) -> Result<B::Tensor, ModelError> {
        let [g, up] = self.gate_up.forward_n(b, u)?;
        let a = b.swiglu(&g, &up)?;
        Ok(b.matmul(&a, &self.down)?)
    }
}

/// Gated full attention (qwen-spec §3.4).
/// Rows up to which a layer names its output projection for prefetch (decode and MTP
/// verification widths; a prefill's GEMM is not latency-bound).
const PREFETCH_MAX_ROWS: usize = 8;

/// Between a layer's input and output projections decode runs small kernels that leave memory
/// idle: the output projection's weight is named to the backend then
/// (`LinearOps::prefetch_weight`, a hint that never changes a result).
fn prefetch_for_decode<B: ModelBackend>(b: &B, w: &B::Weight, t: usize) -> Result<(), ModelError> {
    if t <= PREFETCH_MAX_ROWS {
        b.prefetch_weight(w)?;
    }
    Ok(())
}

pub(crate) struct Attention<B: ModelBackend> {
    /// `[q (with gate); k; v]`.
    qkv: Proj<B>,
    o_proj: B::Weight,
    q_norm: B::Weight,
    k_norm: B::Weight,
}

impl<B: ModelBackend> Attention<B> {
    fn load(l: &mut Loader<'_, B>, p: &str, c: &QwenConfig) -> Result<Self, ModelError> {
        let (h, nh, nkv, d) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        Ok(Self {
            qkv: l.linears(&[
                (format!("{p}self_attn.q_proj.weight"), vec![nh * d * 2, h]),
                (format!("{p}self_attn.k_proj.weight"), vec![nkv * d, h]),
                (format!("{p}self_attn.v_proj.weight"), vec![nkv * d, h]),
            ])?,
            o_proj: l.linear(&format!("{p}self_attn.o_proj.weight"), &[h, nh * d])?,
            q_norm: l.get(&format!("{p}self_attn.q_norm.weight"), &[d])?,
            k_norm: l.get(&format!("{p}self_attn.k_norm.weight"), &[d])?,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn forward<K: AttentionKv<B>>(
        &self,
        b: &B,
        c: &QwenConfig,
        u: &B::Tensor,
        positions: &[Position3],
        attn_layer: usize,
        phase: AttentionPhase,
        kv: &mut K,
    ) -> Result<B::Tensor, ModelError> {
        let (nh, nkv, d, t) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            positions.len(),
        );
        let [qg, k, v] = self.qkv.forward_n(b, u)?;
        prefetch_for_decode(b, &self.o_proj, t)?;
        let mut parts = b.split_cols(&qg, nh, &[d, d])?.into_iter();
        let (q, gate) = match (parts.next(), parts.next()) {
            (Some(q), Some(g)) => (q, g),
            _ => return Err(ModelError::Input("q_proj split".into())),
        };
        let q = b.rms_norm(&q, &self.q_norm, c.rms_norm_eps, 1.0)?;
        let k = b.rms_norm(&k, &self.k_norm, c.rms_norm_eps, 1.0)?;
        let q = b.reshape(q, &[t, nh, d])?;
        let k = b.reshape(k, &[t, nkv, d])?;
        let q = b.reshape(b.rope(&q, nh, d, positions, &c.rope)?, &[t, nh * d])?;
        let k = b.reshape(b.rope(&k, nkv, d, positions, &c.rope)?, &[t, nkv * d])?;
        let o = kv
            .append_and_attend(b, attn_layer, phase, &q, &k, &v)
            .map_err(|e| ModelError::Kv(Box::new(e)))?;
        let o = b.sigmoid_gate(&o, &gate)?;
        Ok(b.matmul(&o, &self.o_proj)?)
    }
}

/// Gated DeltaNet (qwen-spec §3.6).
pub(crate) struct Gdn<B: ModelBackend> {
    /// `[in_proj_qkv; in_proj_z]` (fused: `[conv_dim + vd, h]`).
    in_proj_qkvz: Proj<B>,
    /// `[in_proj_b; in_proj_a]` (kept as stored; fused: `[2 hv, h]`).
    in_proj_ba: Proj<B>,
    conv1d: B::Weight,
    dt_bias: B::Weight,
    a_log: B::Weight,
    norm: B::Weight,
    out_proj: B::Weight,
}

/// How a GDN layer evaluates its tokens.
pub(crate) enum GdnRun<'a, B: ModelBackend> {
    /// All tokens in one call with this mode.
    Whole(DeltaMode),
    /// Token by token (recurrent); after token i the layer's state is copied into `cps[i]`.
    Checkpointed {
        gdn_index: usize,
        cps: &'a mut [crate::state::RecurrentState<B>],
    },
}

impl<B: ModelBackend> Gdn<B> {
    fn load(l: &mut Loader<'_, B>, p: &str, c: &QwenConfig) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        let hv = c.linear_num_value_heads;
        let vd = hv * c.linear_value_head_dim;
        let p = format!("{p}linear_attn.");
        Ok(Self {
            in_proj_qkvz: l.linears(&[
                (
                    format!("{p}in_proj_qkv.weight"),
                    vec![c.linear_conv_dim(), h],
                ),
                (format!("{p}in_proj_z.weight"), vec![vd, h]),
            ])?,
            in_proj_ba: l.linears_as(
                &[
                    (format!("{p}in_proj_b.weight"), vec![hv, h]),
                    (format!("{p}in_proj_a.weight"), vec![hv, h]),
                ],
                Role::Kept,
            )?,
            conv1d: l.get(
                &format!("{p}conv1d.weight"),
                &[c.linear_conv_dim(), 1, c.linear_conv_kernel_dim],
            )?,
            dt_bias: l.get(&format!("{p}dt_bias"), &[hv])?,
            a_log: l.get(&format!("{p}A_log"), &[hv])?,
            norm: l.get(&format!("{p}norm.weight"), &[c.linear_value_head_dim])?,
            out_proj: l.linear(&format!("{p}out_proj.weight"), &[h, vd])?,
        })
    }

    fn forward(
        &self,
        b: &B,
        c: &QwenConfig,
        u: &B::Tensor,
        t: usize,
        state: &mut GdnState<B>,
        run: GdnRun<'_, B>,
    ) -> Result<B::Tensor, ModelError> {
        let (hk, hv, dk, dv) = (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim,
        );
        let [m, z] = self.in_proj_qkvz.forward_n(b, u)?;
        prefetch_for_decode(b, &self.out_proj, t)?;
        let [bb, a] = self.in_proj_ba.forward_n(b, u)?;
        let step = |m: &B::Tensor,
                    a: &B::Tensor,
                    bb: &B::Tensor,
                    tokens: usize,
                    mode: DeltaMode,
                    state: &mut GdnState<B>|
         -> Result<B::Tensor, ModelError> {
            let cv = b.causal_conv1d(m, &self.conv1d, &mut state.conv)?;
            let parts = b.split_cols(&cv, 1, &[hk * dk, hk * dk, hv * dv])?;
            let [q, k, v] = &parts[..] else {
                return Err(ModelError::Input("conv split".into()));
            };
            let shape = DeltaShape {
                tokens,
                k_heads: hk,
                v_heads: hv,
                k_dim: dk,
                v_dim: dv,
            };
            Ok(b.gated_delta_rule(
                &shape,
                q,
                k,
                v,
                a,
                bb,
                &self.a_log,
                &self.dt_bias,
                &mut state.ssm,
                mode,
            )?)
        };
        let o = match run {
            GdnRun::Whole(mode) => step(&m, &a, &bb, t, mode, state)?,
            GdnRun::Checkpointed { gdn_index, cps } => {
                let mut outs = Vec::with_capacity(t);
                for (i, cp) in cps.iter_mut().enumerate().take(t) {
                    let o = step(
                        &b.rows(&m, i, 1)?,
                        &b.rows(&a, i, 1)?,
                        &b.rows(&bb, i, 1)?,
                        1,
                        DeltaMode::Recurrent,
                        state,
                    )?;
                    let dst = cp
                        .layers
                        .get_mut(gdn_index)
                        .ok_or_else(|| ModelError::Input("checkpoint layer".into()))?;
                    b.copy_into(&mut dst.conv, &state.conv)?;
                    b.copy_into(&mut dst.ssm, &state.ssm)?;
                    outs.push(b.reshape(o, &[1, hv * dv])?);
                }
                // Row-major [t, C] is [1, t·C]: stack rows with concat_cols, then reshape.
                let mut it = outs.into_iter();
                let mut acc = it
                    .next()
                    .ok_or_else(|| ModelError::Input("no tokens".into()))?;
                for o in it {
                    acc = b.concat_cols(&acc, &o)?;
                }
                b.reshape(acc, &[t, hv * dv])?
            }
        };
        let o = b.reshape(o, &[t * hv, dv])?;
        let z = b.reshape(z, &[t * hv, dv])?;
        let y = match c.output_gate_type {
            GateActivation::Silu => b.gated_rms_norm(&o, &z, &self.norm, c.rms_norm_eps)?,
            GateActivation::Sigmoid => {
                let n = b.rms_norm(&o, &self.norm, c.rms_norm_eps, 0.0)?;
                b.sigmoid_gate(&n, &z)?
            }
        };
        let y = b.reshape(y, &[t, hv * dv])?;
        Ok(b.matmul(&y, &self.out_proj)?)
    }
}

/// A decoder layer's mixer.
pub(crate) enum Mixer<B: ModelBackend> {
    /// GDN layer with its index among GDN layers.
    Gdn(Gdn<B>, usize),
    /// Attention layer with its index among attention layers.
    Attn(Attention<B>, usize),
}

/// One pre-norm decoder layer.
pub(crate) struct Layer<B: ModelBackend> {
    input_norm: B::Weight,
    post_norm: B::Weight,
    pub mixer: Mixer<B>,
    mlp: Mlp<B>,
}

impl<B: ModelBackend> Layer<B> {
    /// Loads layer weights under prefix `p` (ending in `.`).
    pub fn load(
        l: &mut Loader<'_, B>,
        p: &str,
        c: &QwenConfig,
        full: bool,
        index: usize,
    ) -> Result<Self, ModelError> {
        let h = c.hidden_size;
        Ok(Self {
            input_norm: l.get(&format!("{p}input_layernorm.weight"), &[h])?,
            post_norm: l.get(&format!("{p}post_attention_layernorm.weight"), &[h])?,
            mixer: if full {
                Mixer::Attn(Attention::load(l, p, c)?, index)
            } else {
                Mixer::Gdn(Gdn::load(l, p, c)?, index)
            },
            mlp: Mlp::load(l, p, c)?,
        })
    }

    /// `h = x + Mixer(norm(x)); x' = h + MLP(norm(h))`, returning x' as its two terms (the next
    /// norm adds them: [`Residual`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<K: AttentionKv<B>>(
        &self,
        b: &B,
        c: &QwenConfig,
        x: Residual<B>,
        positions: &[Position3],
        phase: AttentionPhase,
        gdn_states: &mut [GdnState<B>],
        kv: &mut K,
        run: Option<GdnRun<'_, B>>,
    ) -> Result<Residual<B>, ModelError> {
        let (x, u) = x.into_norm(b, &self.input_norm, c.rms_norm_eps)?;
        let m = match &self.mixer {
            Mixer::Attn(a, idx) => {
                let _s = tracing::debug_span!("attention_layer", layer = idx).entered();
                a.forward(b, c, &u, positions, *idx, phase, kv)?
            }
            Mixer::Gdn(g, idx) => {
                let _s = tracing::debug_span!("gdn_layer", layer = idx).entered();
                let state = gdn_states.get_mut(*idx).ok_or_else(|| {
                    ModelError::Input(format!("no recurrent state for GDN layer {idx}"))
                })?;
                let run = run.ok_or_else(|| ModelError::Input("GDN run mode missing".into()))?;
                g.forward(b, c, &u, positions.len(), state, run)?
            }
        };
        let (h, u) = b.add_rms_norm(&x, &m, &self.post_norm, c.rms_norm_eps, 1.0)?;
        let _s = tracing::debug_span!("mlp").entered();
        let f = self.mlp.forward(b, &u)?;
        Ok(Residual::Terms(h, f))
    }
}

/// The residual stream between layers: the tensor itself, or the two terms whose sum it is (a
/// layer's `h` and its MLP output), so that the sum is formed by the zero-centred RMSNorm that
/// reads it ([`NormOps::add_rms_norm`]: one launch instead of two on a GPU).
pub(crate) enum Residual<B: ModelBackend> {
    Sum(B::Tensor),
    Terms(B::Tensor, B::Tensor),
}

impl<B: ModelBackend> Residual<B> {
    /// `(x, rms_norm(x, w))` with unit offset 1 (Qwen's zero-centred norm), x the stream's value.
    pub fn into_norm(
        self,
        b: &B,
        w: &B::Weight,
        eps: f32,
    ) -> Result<(B::Tensor, B::Tensor), ModelError> {
        Ok(match self {
            Residual::Sum(x) => {
                let u = b.rms_norm(&x, w, eps, 1.0)?;
                (x, u)
            }
            Residual::Terms(h, f) => b.add_rms_norm(&h, &f, w, eps, 1.0)?,
        })
    }
}
