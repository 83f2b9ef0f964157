//! Streamed attention: exact causal softmax attention over a span plan.
//!
//! The contract: for `width` queries (the last `width` of `total` active tokens; query `i` sees
//! tokens `0..=total-width+i`), walk the planned spans **in logical token order** keeping a
//! running (max, sum, accumulator) per query and head in f32, and normalise **once** at the end.
//! A layer may be evaluated in several waves (when its streamed pages exceed the ring): each wave
//! is a plan that continues exactly where the accumulator stopped. There is no per-chunk
//! normalise-and-merge anywhere, so streamed equals resident bit-for-bit on one backend.
//!
//! Backends implement the thin [`StreamedAttention`] trait; the validating entry points
//! [`attention_begin`], [`attention_accumulate`] and [`attention_finish`] live here.

use crate::backend::{Backend, DeviceTensor};
use crate::error::{AttentionError, CapabilityError};
use crate::kv::format::KvType;
use crate::kv::span::SpanPlan;

/// The shape of one attention evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (GQA: query head h reads KV head h / (q_heads / kv_heads)).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Number of queries (the last `width` tokens of `total`).
    pub width: usize,
    /// Active tokens, including the queries' own.
    pub total: usize,
    /// Softmax scale (1/sqrt(head_dim) for Qwen).
    pub scale: f32,
    /// K element type of the pages.
    pub k_type: KvType,
    /// V element type of the pages.
    pub v_type: KvType,
}

impl AttentionShape {
    /// f32 values of accumulator state: per query and head, max, sum and `head_dim` accumulators.
    pub fn state_len(&self) -> usize {
        self.width * self.q_heads * (self.head_dim + 2)
    }
    /// Elements of the query tensor `[width, q_heads, head_dim]`.
    pub fn query_len(&self) -> usize {
        self.width * self.q_heads * self.head_dim
    }
}

/// A resumable accumulator: where the walk is and the backend's f32 state.
#[derive(Debug)]
pub struct AttnAccumulator<B: Backend> {
    shape: AttentionShape,
    next: usize,
    state: B::Tensor,
}

impl<B: Backend> AttnAccumulator<B> {
    /// The evaluation's shape.
    pub fn shape(&self) -> &AttentionShape {
        &self.shape
    }
    /// The next token the walk expects.
    pub fn next_token(&self) -> usize {
        self.next
    }
    /// The backend state (max, sum, accumulators), for backends.
    pub fn state(&self) -> &B::Tensor {
        &self.state
    }
    /// Mutable backend state, for backends.
    pub fn state_mut(&mut self) -> &mut B::Tensor {
        &mut self.state
    }
}

/// The backend side of streamed attention: thin, unchecked (inputs are validated above).
pub trait StreamedAttention: Backend {
    /// A fresh accumulator state: max = -inf, sum = 0, acc = 0. The CPU backend uses exactly
    /// `shape.state_len()` values; a GPU backend may keep one (max, sum, acc) per fixed token
    /// split (ownership by token index, independent of span boundaries, combined once in
    /// `attn_finish_unchecked`), so that streamed still equals resident bit-for-bit.
    fn attn_state_new(&self, shape: &AttentionShape) -> Result<Self::Tensor, AttentionError>;

    /// Continues the walk over `plan` (tokens `[plan.start(), plan.end())`) reading K/V pages from
    /// `pool`; `q` is `[width, q_heads, head_dim]`, already validated against `shape`.
    fn attn_accumulate_unchecked(
        &self,
        shape: &AttentionShape,
        q: &Self::Tensor,
        pool: &Self::Buffer,
        plan: &SpanPlan,
        state: &mut Self::Tensor,
    ) -> Result<(), AttentionError>;

    /// Final normalisation: output `[width, q_heads * head_dim]`.
    fn attn_finish_unchecked(
        &self,
        shape: &AttentionShape,
        state: &Self::Tensor,
    ) -> Result<Self::Tensor, AttentionError>;
}

fn check_caps<B: Backend>(b: &B, shape: &AttentionShape) -> Result<(), AttentionError> {
    let caps = b.capabilities();
    if !caps.supports_kv_pair(shape.k_type, shape.v_type) {
        return Err(CapabilityError::new(
            caps.backend,
            "streamed_attention",
            format!(
                "K/V type pair {}/{} is not supported; supported pairs: {}",
                shape.k_type,
                shape.v_type,
                caps.kv_pairs
                    .iter()
                    .map(|(k, v)| format!("{k}/{v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
        .into());
    }
    let decode_ok = shape.width <= caps.max_decode_width;
    if !decode_ok && !caps.prefill_attention {
        return Err(CapabilityError::new(
            caps.backend,
            "streamed_attention",
            format!(
                "query width {} is not supported (widths 1..={} only)",
                shape.width, caps.max_decode_width
            ),
        )
        .into());
    }
    Ok(())
}

/// Starts a validated evaluation.
pub fn attention_begin<B: StreamedAttention>(
    b: &B,
    shape: AttentionShape,
) -> Result<AttnAccumulator<B>, AttentionError> {
    if shape.kv_heads == 0 || shape.q_heads % shape.kv_heads != 0 {
        return Err(AttentionError::Gqa {
            q_heads: shape.q_heads,
            kv_heads: shape.kv_heads,
        });
    }
    if shape.width == 0 || shape.width > shape.total {
        return Err(AttentionError::Width {
            width: shape.width,
            total: shape.total,
        });
    }
    check_caps(b, &shape)?;
    let state = b.attn_state_new(&shape)?;
    Ok(AttnAccumulator {
        shape,
        next: 0,
        state,
    })
}

/// Continues a validated evaluation over `plan`, which must start where the last one stopped.
pub fn attention_accumulate<B: StreamedAttention>(
    b: &B,
    acc: &mut AttnAccumulator<B>,
    q: &B::Tensor,
    pool: &B::Buffer,
    plan: &SpanPlan,
) -> Result<(), AttentionError> {
    let shape = acc.shape;
    if plan.start() != acc.next {
        return Err(AttentionError::OutOfOrder {
            plan_start: plan.start(),
            next: acc.next,
        });
    }
    if plan.end() > shape.total {
        return Err(AttentionError::Incomplete {
            covered: plan.end(),
            total: shape.total,
        });
    }
    let g = plan.geometry();
    if g.kv_heads() != shape.kv_heads
        || g.head_dim() != shape.head_dim
        || g.k_type() != shape.k_type
        || g.v_type() != shape.v_type
    {
        return Err(AttentionError::GeometryMismatch);
    }
    if q.numel() != shape.query_len() {
        return Err(AttentionError::Shape {
            name: "q",
            got: q.numel(),
            expected: shape.query_len(),
        });
    }
    if crate::backend::DeviceBuffer::len(pool) < plan.buffer_len() {
        return Err(AttentionError::Shape {
            name: "pool",
            got: crate::backend::DeviceBuffer::len(pool),
            expected: plan.buffer_len(),
        });
    }
    b.attn_accumulate_unchecked(&shape, q, pool, plan, &mut acc.state)?;
    acc.next = plan.end();
    Ok(())
}

/// Finishes a validated evaluation; every active token must have been walked.
pub fn attention_finish<B: StreamedAttention>(
    b: &B,
    acc: AttnAccumulator<B>,
) -> Result<B::Tensor, AttentionError> {
    if acc.next != acc.shape.total {
        return Err(AttentionError::Incomplete {
            covered: acc.next,
            total: acc.shape.total,
        });
    }
    b.attn_finish_unchecked(&acc.shape, &acc.state)
}

/// Reference math shared by backends' tests: exact causal attention over dense f32 K/V
/// (`k`, `v`: `[total, kv_heads, head_dim]`; `q`: `[width, q_heads, head_dim]`), computed in f64.
pub fn reference_attention_f64(
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Vec<f32> {
    let (h, kvh, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let group = h / kvh;
    let mut out = vec![0f32; shape.width * h * d];
    for i in 0..shape.width {
        let last = shape.total - shape.width + i;
        for head in 0..h {
            let kh = head / group;
            let qv = &q[(i * h + head) * d..(i * h + head + 1) * d];
            let scores: Vec<f64> = (0..=last)
                .map(|t| {
                    let kv = &k[(t * kvh + kh) * d..(t * kvh + kh + 1) * d];
                    qv.iter()
                        .zip(kv)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum::<f64>()
                        * f64::from(shape.scale)
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = w.iter().sum();
            for j in 0..d {
                let acc: f64 = (0..=last)
                    .map(|t| w[t] * f64::from(v[(t * kvh + kh) * d + j]))
                    .sum();
                out[(i * h + head) * d + j] = (acc / sum) as f32;
            }
        }
    }
    out
}
