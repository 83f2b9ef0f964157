//! `RecurrentOps` for the CPU backend: the causal depthwise conv and the gated delta rule
//! (token recurrence and the chunked WY form of qwen-spec §3.6), per v-head in parallel, f32.

use super::weights::view;
use super::{sigmoid, silu, softplus};
use crate::{CpuBackend, CpuTensor, CpuWeight};
use kvstream_memory_contracts::error::OpError;
use kvstream_memory_contracts::ops::{DeltaMode, DeltaShape, RecurrentOps};
use rayon::prelude::*;

/// Per-token, per-v-head inputs of the delta rule after normalisation and gating.
struct Prepared {
    /// `[T, k_heads, k_dim]`, l2-normalised and scaled by 1/sqrt(k_dim).
    q: Vec<f32>,
    /// `[T, k_heads, k_dim]`, l2-normalised.
    k: Vec<f32>,
    /// `[T, v_heads]`.
    beta: Vec<f32>,
    /// `[T, v_heads]` log-decay g.
    g: Vec<f32>,
}

fn l2norm_rows(x: &[f32], d: usize, scale: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    for r in out.chunks_exact_mut(d) {
        let ss: f32 = r.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss + 1e-6).sqrt();
        for v in r.iter_mut() {
            *v = *v * inv * scale;
        }
    }
    out
}

fn prepare(
    s: &DeltaShape,
    q: &CpuTensor,
    k: &CpuTensor,
    a: &CpuTensor,
    b: &CpuTensor,
    a_log: &CpuWeight,
    dt_bias: &CpuWeight,
) -> Result<Prepared, OpError> {
    let a_log = view(a_log)?.to_vec();
    let dt_bias = view(dt_bias)?.to_vec();
    if a_log.len() != s.v_heads || dt_bias.len() != s.v_heads {
        return Err(OpError::shape(
            "gated_delta_rule",
            format!(
                "A_log/dt_bias have {}/{} values, expected v_heads = {}",
                a_log.len(),
                dt_bias.len(),
                s.v_heads
            ),
        ));
    }
    let scale = 1.0 / (s.k_dim as f32).sqrt();
    let q = l2norm_rows(&q.data, s.k_dim, 1.0)
        .into_iter()
        .map(|v| v * scale)
        .collect();
    let k = l2norm_rows(&k.data, s.k_dim, 1.0);
    let beta = b.data.iter().map(|v| sigmoid(*v)).collect();
    let g = a
        .data
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let h = i % s.v_heads;
            -a_log[h].exp() * softplus(v + dt_bias[h])
        })
        .collect();
    Ok(Prepared { q, k, beta, g })
}

/// Views of one v-head's inputs.
struct HeadIo<'a> {
    s: &'a DeltaShape,
    p: &'a Prepared,
    v: &'a [f32],
    kh: usize,
    h: usize,
}

impl HeadIo<'_> {
    fn q(&self, t: usize) -> &[f32] {
        let o = (t * self.s.k_heads + self.kh) * self.s.k_dim;
        &self.p.q[o..o + self.s.k_dim]
    }
    fn k(&self, t: usize) -> &[f32] {
        let o = (t * self.s.k_heads + self.kh) * self.s.k_dim;
        &self.p.k[o..o + self.s.k_dim]
    }
    fn v(&self, t: usize) -> &[f32] {
        let o = (t * self.s.v_heads + self.h) * self.s.v_dim;
        &self.v[o..o + self.s.v_dim]
    }
    fn beta(&self, t: usize) -> f32 {
        self.p.beta[t * self.s.v_heads + self.h]
    }
    fn g(&self, t: usize) -> f32 {
        self.p.g[t * self.s.v_heads + self.h]
    }
}

/// Token recurrence for one head; `st` is `[k_dim, v_dim]`; returns `[T, v_dim]`.
fn recurrent_head(io: &HeadIo<'_>, st: &mut [f32]) -> Vec<f32> {
    let (dk, dv) = (io.s.k_dim, io.s.v_dim);
    let mut out = vec![0f32; io.s.tokens * dv];
    let mut kv = vec![0f32; dv];
    for t in 0..io.s.tokens {
        let decay = io.g(t).exp();
        st.iter_mut().for_each(|x| *x *= decay);
        let (k, q, v, beta) = (io.k(t), io.q(t), io.v(t), io.beta(t));
        kv.iter_mut().for_each(|x| *x = 0.0);
        for (i, &ki) in k.iter().enumerate() {
            for (a, s) in kv.iter_mut().zip(&st[i * dv..(i + 1) * dv]) {
                *a += s * ki;
            }
        }
        for (d, vv) in kv.iter_mut().zip(v) {
            *d = (vv - *d) * beta;
        }
        for (i, &ki) in k.iter().enumerate() {
            for (s, d) in st[i * dv..(i + 1) * dv].iter_mut().zip(&kv) {
                *s += ki * d;
            }
        }
        let o = &mut out[t * dv..(t + 1) * dv];
        for i in 0..dk {
            let qi = q[i];
            for (a, s) in o.iter_mut().zip(&st[i * dv..(i + 1) * dv]) {
                *a += s * qi;
            }
        }
    }
    out
}

fn dotf(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Chunked (WY) form for one head (qwen-spec §3.6 "Chunked form").
fn chunked_head(io: &HeadIo<'_>, st: &mut [f32], chunk: usize) -> Vec<f32> {
    let (dk, dv) = (io.s.k_dim, io.s.v_dim);
    let mut out = vec![0f32; io.s.tokens * dv];
    let mut start = 0;
    while start < io.s.tokens {
        let n = chunk.min(io.s.tokens - start);
        let tk = |i: usize| start + i;
        // Cumulative log-decay inside the chunk.
        let mut gc = vec![0f32; n];
        let mut acc = 0f32;
        for (i, g) in gc.iter_mut().enumerate() {
            acc += io.g(tk(i));
            *g = acc;
        }
        // T = (I + A)^-1 by forward substitution, with A[i,j] = β_i (k_i·k_j) e^{γ_i−γ_j}, j < i.
        let mut tm = vec![0f32; n * n];
        for i in 0..n {
            let bi = io.beta(tk(i));
            for j in 0..i {
                tm[i * n + j] = -(bi * dotf(io.k(tk(i)), io.k(tk(j)))) * (gc[i] - gc[j]).exp();
            }
        }
        for i in 1..n {
            let row: Vec<f32> = tm[i * n..i * n + i].to_vec();
            for j in 0..i {
                let mut s = row[j];
                for m in (j + 1)..i {
                    s += row[m] * tm[m * n + j];
                }
                tm[i * n + j] = s;
            }
        }
        for i in 0..n {
            tm[i * n + i] = 1.0;
        }
        // U = T (β V), W = T (β e^γ K), V' = U − W S0.
        let mut vp = vec![0f32; n * dv];
        let mut w = vec![0f32; dk];
        for i in 0..n {
            w.iter_mut().for_each(|x| *x = 0.0);
            let u = &mut vp[i * dv..(i + 1) * dv];
            for j in 0..=i {
                let c = tm[i * n + j] * io.beta(tk(j));
                let ce = c * gc[j].exp();
                for (a, vv) in u.iter_mut().zip(io.v(tk(j))) {
                    *a += c * vv;
                }
                for (a, kk) in w.iter_mut().zip(io.k(tk(j))) {
                    *a += ce * kk;
                }
            }
            for (kk, &wk) in w.iter().enumerate() {
                for (a, s) in u.iter_mut().zip(&st[kk * dv..(kk + 1) * dv]) {
                    *a -= wk * s;
                }
            }
        }
        // O = (e^γ Q) S0 + M V'.
        for i in 0..n {
            let o = &mut out[tk(i) * dv..(tk(i) + 1) * dv];
            let eg = gc[i].exp();
            let q = io.q(tk(i));
            for (kk, &qk) in q.iter().enumerate() {
                let c = qk * eg;
                for (a, s) in o.iter_mut().zip(&st[kk * dv..(kk + 1) * dv]) {
                    *a += c * s;
                }
            }
            for j in 0..=i {
                let m = dotf(q, io.k(tk(j))) * (gc[i] - gc[j]).exp();
                for (a, vv) in o.iter_mut().zip(&vp[j * dv..(j + 1) * dv]) {
                    *a += m * vv;
                }
            }
        }
        // S = e^{γ_C} S0 + (e^{γ_C − γ} K)ᵀ V'.
        let last = gc[n - 1];
        let el = last.exp();
        st.iter_mut().for_each(|x| *x *= el);
        for j in 0..n {
            let d = (last - gc[j]).exp();
            for (kk, &kv) in io.k(tk(j)).iter().enumerate() {
                let c = kv * d;
                for (s, vv) in st[kk * dv..(kk + 1) * dv]
                    .iter_mut()
                    .zip(&vp[j * dv..(j + 1) * dv])
                {
                    *s += c * vv;
                }
            }
        }
        start += n;
    }
    out
}

impl RecurrentOps for CpuBackend {
    fn causal_conv1d(
        &self,
        x: &CpuTensor,
        w: &CpuWeight,
        state: &mut CpuTensor,
    ) -> Result<CpuTensor, OpError> {
        let _s = tracing::trace_span!("cpu.causal_conv1d").entered();
        let (c, kk) = match w.dims[..] {
            [c, 1, k] | [c, k] => (c, k),
            _ => {
                return Err(OpError::shape(
                    "causal_conv1d",
                    format!("kernel dims {:?} are not [C, 1, K]", w.dims),
                ))
            }
        };
        if kk == 0 || c == 0 || x.data.len() % c != 0 || state.data.len() != (kk - 1) * c {
            return Err(OpError::shape(
                "causal_conv1d",
                format!(
                    "x {:?} / state {:?} do not fit kernel [{c}, 1, {kk}]",
                    x.dims, state.dims
                ),
            ));
        }
        let t = x.data.len() / c;
        let wv = view(w)?.to_vec();
        let mut ext = Vec::with_capacity((kk - 1 + t) * c);
        ext.extend_from_slice(&state.data);
        ext.extend_from_slice(&x.data);
        let mut out = vec![0f32; t * c];
        out.par_chunks_mut(c).enumerate().for_each(|(tt, o)| {
            for (ch, ov) in o.iter_mut().enumerate() {
                let mut s = 0f32;
                for j in 0..kk {
                    s += wv[ch * kk + j] * ext[(tt + j) * c + ch];
                }
                *ov = silu(s);
            }
        });
        let keep = (kk - 1) * c;
        state.data.copy_from_slice(&ext[ext.len() - keep..]);
        Ok(CpuTensor::new(out, x.dims.clone()))
    }

    fn gated_delta_rule(
        &self,
        shape: &DeltaShape,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &CpuWeight,
        dt_bias: &CpuWeight,
        state: &mut CpuTensor,
        mode: DeltaMode,
    ) -> Result<CpuTensor, OpError> {
        let s = *shape;
        let _span = tracing::trace_span!("cpu.gated_delta_rule", t = s.tokens, ?mode).entered();
        let bad = |what: &str| {
            Err(OpError::shape(
                "gated_delta_rule",
                format!("{what} does not match {s:?}"),
            ))
        };
        if s.k_heads == 0 || s.v_heads % s.k_heads != 0 || s.k_dim == 0 || s.v_dim == 0 {
            return bad("head counts");
        }
        if q.data.len() != s.tokens * s.k_heads * s.k_dim || k.data.len() != q.data.len() {
            return bad("q/k");
        }
        if v.data.len() != s.tokens * s.v_heads * s.v_dim {
            return bad("v");
        }
        if a.data.len() != s.tokens * s.v_heads || b.data.len() != a.data.len() {
            return bad("a/b");
        }
        if state.data.len() != s.v_heads * s.k_dim * s.v_dim {
            return bad("state");
        }
        if let DeltaMode::Chunked { chunk: 0 } = mode {
            return bad("chunk size 0");
        }
        let p = prepare(&s, q, k, a, b, a_log, dt_bias)?;
        let group = s.v_heads / s.k_heads;
        let per_head: Vec<Vec<f32>> = state
            .data
            .par_chunks_mut(s.k_dim * s.v_dim)
            .enumerate()
            .map(|(h, st)| {
                let io = HeadIo {
                    s: &s,
                    p: &p,
                    v: &v.data,
                    kh: h / group,
                    h,
                };
                match mode {
                    DeltaMode::Recurrent => recurrent_head(&io, st),
                    DeltaMode::Chunked { chunk } => chunked_head(&io, st, chunk),
                }
            })
            .collect();
        let mut out = vec![0f32; s.tokens * s.v_heads * s.v_dim];
        for (h, o) in per_head.iter().enumerate() {
            for t in 0..s.tokens {
                let dst = (t * s.v_heads + h) * s.v_dim;
                out[dst..dst + s.v_dim].copy_from_slice(&o[t * s.v_dim..(t + 1) * s.v_dim]);
            }
        }
        Ok(CpuTensor::new(out, vec![s.tokens, s.v_heads, s.v_dim]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{max_abs_diff, tensor, weight, Rng};
    use kvstream_memory_contracts::backend::WeightDType;

    struct Inputs {
        s: DeltaShape,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        a: Vec<f32>,
        b: Vec<f32>,
        a_log: Vec<f32>,
        dt: Vec<f32>,
        s0: Vec<f32>,
    }

    fn inputs(tokens: usize, seed: u64) -> Inputs {
        let s = DeltaShape {
            tokens,
            k_heads: 2,
            v_heads: 4,
            k_dim: 8,
            v_dim: 12,
        };
        let mut r = Rng::new(seed);
        Inputs {
            q: r.vec(tokens * 16, 1.0),
            k: r.vec(tokens * 16, 1.0),
            v: r.vec(tokens * 48, 1.0),
            a: r.vec(tokens * 4, 2.0),
            b: r.vec(tokens * 4, 3.0),
            a_log: r.vec(4, 1.0),
            dt: r.vec(4, 1.0),
            s0: r.vec(4 * 8 * 12, 0.5),
            s,
        }
    }

    fn run(inp: &Inputs, mode: DeltaMode) -> (Vec<f32>, Vec<f32>) {
        let b = CpuBackend::new();
        let s = inp.s;
        let (al, _) = weight(&b, WeightDType::F32, &inp.a_log, &[4]);
        let (dt, _) = weight(&b, WeightDType::F32, &inp.dt, &[4]);
        let mut st = tensor(inp.s0.clone(), &[4, 8, 12]);
        let o = b
            .gated_delta_rule(
                &s,
                &tensor(inp.q.clone(), &[s.tokens, 2, 8]),
                &tensor(inp.k.clone(), &[s.tokens, 2, 8]),
                &tensor(inp.v.clone(), &[s.tokens, 4, 12]),
                &tensor(inp.a.clone(), &[s.tokens, 4]),
                &tensor(inp.b.clone(), &[s.tokens, 4]),
                &al,
                &dt,
                &mut st,
                mode,
            )
            .expect("gdn");
        (o.data, st.data)
    }

    /// Naive f64 recurrence straight from the spec.
    fn reference(inp: &Inputs) -> (Vec<f64>, Vec<f64>) {
        let s = inp.s;
        let (dk, dv) = (s.k_dim, s.v_dim);
        let mut st: Vec<f64> = inp.s0.iter().map(|v| f64::from(*v)).collect();
        let mut out = vec![0f64; s.tokens * s.v_heads * dv];
        let norm = |x: &[f32], scale: f64| -> Vec<f64> {
            let ss: f64 = x.iter().map(|v| f64::from(*v).powi(2)).sum();
            let inv = 1.0 / (ss + 1e-6).sqrt();
            x.iter().map(|v| f64::from(*v) * inv * scale).collect()
        };
        for t in 0..s.tokens {
            for h in 0..s.v_heads {
                let kh = h / (s.v_heads / s.k_heads);
                let qo = (t * s.k_heads + kh) * dk;
                let q = norm(&inp.q[qo..qo + dk], 1.0 / (dk as f64).sqrt());
                let k = norm(&inp.k[qo..qo + dk], 1.0);
                let vo = (t * s.v_heads + h) * dv;
                let beta = 1.0 / (1.0 + (-f64::from(inp.b[t * 4 + h])).exp());
                let x = f64::from(inp.a[t * 4 + h]) + f64::from(inp.dt[h]);
                let g = -f64::from(inp.a_log[h]).exp() * if x > 20.0 { x } else { x.exp().ln_1p() };
                let sh = &mut st[h * dk * dv..(h + 1) * dk * dv];
                sh.iter_mut().for_each(|v| *v *= g.exp());
                for j in 0..dv {
                    let kv: f64 = (0..dk).map(|i| sh[i * dv + j] * k[i]).sum();
                    let d = beta * (f64::from(inp.v[vo + j]) - kv);
                    for i in 0..dk {
                        sh[i * dv + j] += k[i] * d;
                    }
                }
                for j in 0..dv {
                    out[vo + j] = (0..dk).map(|i| sh[i * dv + j] * q[i]).sum();
                }
            }
        }
        (out, st)
    }

    #[test]
    fn recurrent_matches_f64_reference() {
        let inp = inputs(37, 21);
        let (o, st) = run(&inp, DeltaMode::Recurrent);
        let (ro, rst) = reference(&inp);
        assert!(max_abs_diff(&o, &ro) < 1e-5, "{}", max_abs_diff(&o, &ro));
        assert!(max_abs_diff(&st, &rst) < 1e-5);
    }

    #[test]
    fn chunked_equals_recurrent_over_several_chunks() {
        let inp = inputs(150, 22);
        let (o, st) = run(&inp, DeltaMode::Recurrent);
        for chunk in [64usize, 16, 7] {
            let (oc, stc) = run(&inp, DeltaMode::Chunked { chunk });
            let od: Vec<f64> = o.iter().map(|v| f64::from(*v)).collect();
            let sd: Vec<f64> = st.iter().map(|v| f64::from(*v)).collect();
            assert!(
                max_abs_diff(&oc, &od) < 2e-5,
                "chunk {chunk}: {}",
                max_abs_diff(&oc, &od)
            );
            assert!(max_abs_diff(&stc, &sd) < 2e-5);
        }
    }

    #[test]
    fn conv1d_matches_reference_and_carries_state() {
        let b = CpuBackend::new();
        let mut r = Rng::new(31);
        let (t, c, kk) = (9, 5, 4);
        let x = r.vec(t * c, 1.0);
        let (w, held) = weight(&b, WeightDType::Bf16, &r.vec(c * kk, 1.0), &[c, 1, kk]);
        let s0 = r.vec((kk - 1) * c, 1.0);
        // Whole sequence in one call.
        let mut st = tensor(s0.clone(), &[kk - 1, c]);
        let y = b
            .causal_conv1d(&tensor(x.clone(), &[t, c]), &w, &mut st)
            .expect("conv");
        let mut ext: Vec<f64> = s0.iter().map(|v| f64::from(*v)).collect();
        ext.extend(x.iter().map(|v| f64::from(*v)));
        let mut reference = vec![0f64; t * c];
        for tt in 0..t {
            for ch in 0..c {
                let s: f64 = (0..kk)
                    .map(|j| f64::from(held[ch * kk + j]) * ext[(tt + j) * c + ch])
                    .sum();
                reference[tt * c + ch] = s / (1.0 + (-s).exp());
            }
        }
        assert!(max_abs_diff(&y.data, &reference) < 1e-5);
        assert_eq!(st.data, x[(t - kk + 1) * c..].to_vec());
        // Token by token gives the same outputs.
        let mut st2 = tensor(s0, &[kk - 1, c]);
        for tt in 0..t {
            let yt = b
                .causal_conv1d(
                    &tensor(x[tt * c..(tt + 1) * c].to_vec(), &[1, c]),
                    &w,
                    &mut st2,
                )
                .expect("conv step");
            assert!(max_abs_diff(&yt.data, &reference[tt * c..(tt + 1) * c]) < 1e-5);
        }
        assert_eq!(st2.data, st.data);
        let mut bad = tensor(vec![0.0; 2], &[2]);
        assert!(b.causal_conv1d(&tensor(x, &[t, c]), &w, &mut bad).is_err());
    }
}
