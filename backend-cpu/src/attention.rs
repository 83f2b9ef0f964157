//! The reference streamed attention.
//!
//! State layout: per (query `i`, query head `h`), at `(i · q_heads + h) · (head_dim + 2)`, the
//! values `[m, l, acc[0..head_dim]]`: running max of the scaled scores, running sum of
//! `exp(score − m)`, and the running `Σ exp(score − m) · v`, all f32.
//!
//! One accumulate call walks the plan's spans in token order, decoding each K/V head row with
//! [`decode_unchecked`] and updating the online softmax; tokens past a query's causal limit
//! (`total − width + i`) are skipped. [`StreamedAttention::attn_finish_unchecked`] divides once.
//! Work is split over (KV head, query block, head group) tasks with rayon, but every state is
//! updated by exactly one task in token order, so results do not depend on the thread count, on
//! how the plan is cut into spans, or on how many waves the walk takes.

use crate::{CpuBackend, CpuBuffer, CpuTensor};
use kvstream_memory_contracts::attention::{AttentionShape, StreamedAttention};
use kvstream_memory_contracts::error::{AttentionError, TransferError};
use kvstream_memory_contracts::kv::format::decode_unchecked;
use kvstream_memory_contracts::kv::span::SpanPlan;
use rayon::prelude::*;

/// Queries per task (K/V rows are decoded once per task and reused for its queries).
const QUERY_BLOCK: usize = 16;

/// One unit of parallel work: query heads `[h0, h1)` (all reading KV head `kh`) of queries
/// `[lo, hi)`.
#[derive(Debug, Clone, Copy)]
struct Task {
    kh: usize,
    h0: usize,
    h1: usize,
    lo: usize,
    hi: usize,
}

fn tasks(shape: &AttentionShape) -> Vec<Task> {
    let group = shape.q_heads / shape.kv_heads;
    let blocks = shape.width.div_ceil(QUERY_BLOCK);
    // With few (KV head, query block) pairs, split the group's heads too so decode uses all
    // threads. This only changes which task updates a state, never how.
    let split_heads = shape.kv_heads * blocks < rayon::current_num_threads();
    let mut v = Vec::new();
    for kh in 0..shape.kv_heads {
        for b in 0..blocks {
            let lo = b * QUERY_BLOCK;
            let hi = (lo + QUERY_BLOCK).min(shape.width);
            if split_heads {
                for h in kh * group..(kh + 1) * group {
                    v.push(Task {
                        kh,
                        h0: h,
                        h1: h + 1,
                        lo,
                        hi,
                    });
                }
            } else {
                v.push(Task {
                    kh,
                    h0: kh * group,
                    h1: (kh + 1) * group,
                    lo,
                    hi,
                });
            }
        }
    }
    v
}

fn check_len(name: &'static str, got: usize, expected: usize) -> Result<(), AttentionError> {
    if got != expected {
        return Err(AttentionError::Shape {
            name,
            got,
            expected,
        });
    }
    Ok(())
}

/// Online-softmax update of one `[m, l, acc..]` state with score `s` and value row `v`.
#[inline]
fn update(st: &mut [f32], s: f32, v: &[f32]) {
    if s > st[0] {
        let c = (st[0] - s).exp();
        st[1] *= c;
        for a in &mut st[2..] {
            *a *= c;
        }
        st[0] = s;
    }
    let p = (s - st[0]).exp();
    st[1] += p;
    for (a, x) in st[2..].iter_mut().zip(v) {
        *a += p * x;
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0f32, |s, (x, y)| s + x * y)
}

/// Walks `plan` for one task, starting from (a copy of) its states; returns the new states in
/// task order (query-major, then head).
fn walk(
    shape: &AttentionShape,
    q: &[f32],
    pool: &CpuBuffer,
    plan: &SpanPlan,
    state: &[f32],
    t: Task,
) -> Result<Vec<f32>, AttentionError> {
    let d = shape.head_dim;
    let stride = d + 2;
    let nh = t.h1 - t.h0;
    let mut local = Vec::with_capacity((t.hi - t.lo) * nh * stride);
    for i in t.lo..t.hi {
        let at = (i * shape.q_heads + t.h0) * stride;
        local.extend_from_slice(&state[at..at + nh * stride]);
    }
    let g = plan.geometry();
    let (kb_len, vb_len) = (g.k_head_bytes(), g.v_head_bytes());
    let mut kb = vec![0u8; kb_len];
    let mut vb = vec![0u8; vb_len];
    let mut kf = vec![0f32; d];
    let mut vf = vec![0f32; d];
    // Query i sees tokens 0..=past + i.
    let past = shape.total - shape.width;
    let max_limit = past + t.hi - 1;
    let read = |off: usize, out: &mut [u8]| {
        pool.0.read(off, out).map_err(|_| {
            AttentionError::Transfer(TransferError::OutOfRange {
                what: "kv pool",
                offset: off,
                end: off.saturating_add(out.len()),
                len: pool.0.len(),
            })
        })
    };
    for span in plan.spans() {
        if span.first_token > max_limit {
            break;
        }
        let end = span.end_token().min(max_limit + 1);
        for tok in span.first_token..end {
            read(
                g.k_row_offset(span.offset, span.first_token, tok) + t.kh * kb_len,
                &mut kb,
            )?;
            read(
                g.v_row_offset(span.offset, span.first_token, tok) + t.kh * vb_len,
                &mut vb,
            )?;
            decode_unchecked(shape.k_type, &kb, &mut kf);
            decode_unchecked(shape.v_type, &vb, &mut vf);
            let first_query = t.lo.max(tok.saturating_sub(past));
            for i in first_query..t.hi {
                for h in t.h0..t.h1 {
                    let qa = (i * shape.q_heads + h) * d;
                    let s = dot(&q[qa..qa + d], &kf) * shape.scale;
                    let sa = ((i - t.lo) * nh + (h - t.h0)) * stride;
                    update(&mut local[sa..sa + stride], s, &vf);
                }
            }
        }
    }
    Ok(local)
}

impl StreamedAttention for CpuBackend {
    /// `[width, q_heads, head_dim + 2]`: per (query, head) `m = −∞`, `l = 0`, `acc = 0`.
    fn attn_state_new(&self, shape: &AttentionShape) -> Result<CpuTensor, AttentionError> {
        let stride = shape.head_dim + 2;
        let mut data = vec![0f32; shape.state_len()];
        for st in data.chunks_exact_mut(stride) {
            st[0] = f32::NEG_INFINITY;
        }
        Ok(CpuTensor::new(
            data,
            vec![shape.width, shape.q_heads, stride],
        ))
    }

    fn attn_accumulate_unchecked(
        &self,
        shape: &AttentionShape,
        q: &CpuTensor,
        pool: &CpuBuffer,
        plan: &SpanPlan,
        state: &mut CpuTensor,
    ) -> Result<(), AttentionError> {
        let _span = tracing::trace_span!(
            "cpu_attn_accumulate",
            width = shape.width,
            start = plan.start(),
            end = plan.end(),
            spans = plan.spans().len()
        )
        .entered();
        check_len("q", q.data.len(), shape.query_len())?;
        check_len("state", state.data.len(), shape.state_len())?;
        if shape.kv_heads == 0 || shape.q_heads % shape.kv_heads != 0 {
            return Err(AttentionError::Gqa {
                q_heads: shape.q_heads,
                kv_heads: shape.kv_heads,
            });
        }
        let tasks = tasks(shape);
        let results = tasks
            .par_iter()
            .map(|&t| walk(shape, &q.data, pool, plan, &state.data, t))
            .collect::<Result<Vec<_>, _>>()?;
        let stride = shape.head_dim + 2;
        for (t, local) in tasks.iter().zip(results) {
            let nh = t.h1 - t.h0;
            for (j, i) in (t.lo..t.hi).enumerate() {
                let at = (i * shape.q_heads + t.h0) * stride;
                state.data[at..at + nh * stride]
                    .copy_from_slice(&local[j * nh * stride..(j + 1) * nh * stride]);
            }
        }
        Ok(())
    }

    /// `[width, q_heads · head_dim]`: `acc / l` for every (query, head).
    fn attn_finish_unchecked(
        &self,
        shape: &AttentionShape,
        state: &CpuTensor,
    ) -> Result<CpuTensor, AttentionError> {
        check_len("state", state.data.len(), shape.state_len())?;
        let d = shape.head_dim;
        let mut out = vec![0f32; shape.query_len()];
        out.par_chunks_mut(d)
            .zip(state.data.par_chunks(d + 2))
            .for_each(|(o, st)| {
                let l = st[1];
                if l > 0.0 {
                    for (x, a) in o.iter_mut().zip(&st[2..]) {
                        *x = a / l;
                    }
                }
            });
        Ok(CpuTensor::new(out, vec![shape.width, shape.q_heads * d]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstream_memory_contracts::kv::format::KvType;

    fn shape(width: usize) -> AttentionShape {
        AttentionShape {
            q_heads: 2,
            kv_heads: 1,
            head_dim: 4,
            width,
            total: 5,
            scale: 0.5,
            k_type: KvType::F32,
            v_type: KvType::F32,
        }
    }

    #[test]
    fn fresh_state_and_final_normalisation() {
        let b = CpuBackend::new();
        let sh = shape(2);
        let st = b.attn_state_new(&sh).expect("state");
        assert_eq!(st.data.len(), sh.state_len());
        for s in st.data.chunks(6) {
            assert_eq!(s[0], f32::NEG_INFINITY);
            assert!(s[1..].iter().all(|&x| x == 0.0));
        }
        let mut st = st;
        for (i, s) in st.data.chunks_mut(6).enumerate() {
            s[0] = 1.0;
            s[1] = 2.0 + i as f32;
            for (j, a) in s[2..].iter_mut().enumerate() {
                *a = (i * 4 + j) as f32;
            }
        }
        let out = b.attn_finish_unchecked(&sh, &st).expect("finish");
        assert_eq!(out.dims, vec![2, 8]);
        for (i, o) in out.data.chunks(4).enumerate() {
            for (j, x) in o.iter().enumerate() {
                assert_eq!(*x, (i * 4 + j) as f32 / (2.0 + i as f32));
            }
        }
    }

    #[test]
    fn online_update_equals_two_pass_softmax() {
        let scores = [0.3f32, 2.0, -1.0, 2.5];
        let values = [[1.0f32, 2.0], [3.0, -1.0], [0.5, 0.5], [-2.0, 4.0]];
        let mut st = [f32::NEG_INFINITY, 0.0, 0.0, 0.0];
        for (s, v) in scores.iter().zip(&values) {
            update(&mut st, *s, v);
        }
        let m = 2.5f64;
        let w: Vec<f64> = scores.iter().map(|s| (f64::from(*s) - m).exp()).collect();
        let l: f64 = w.iter().sum();
        assert!((f64::from(st[1]) - l).abs() < 1e-6);
        for j in 0..2 {
            let a: f64 = w
                .iter()
                .zip(&values)
                .map(|(w, v)| w * f64::from(v[j]))
                .sum();
            assert!((f64::from(st[2 + j]) - a).abs() < 1e-5);
        }
        assert_eq!(st[0], 2.5);
    }

    #[test]
    fn mis_sized_inputs_are_shape_errors() {
        let b = CpuBackend::new();
        let sh = shape(1);
        let bad = CpuTensor::new(vec![0.0; 3], vec![3]);
        assert!(matches!(
            b.attn_finish_unchecked(&sh, &bad),
            Err(AttentionError::Shape { name: "state", .. })
        ));
    }
}
