// Gated DeltaNet: causal depthwise conv1d with state, and the gated delta rule with f32 state.

#define CONV_MAX_K 8

// x [T, C], w [C, 1, K] (dtype dt), state [K-1, C] (oldest row first). One thread per channel.
extern "C" __global__ void causal_conv1d_f32(const float* x, const void* w, int dt, float* state, float* y,
                                             u64 T, u64 C, int K) {
    u64 c = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[CONV_MAX_K];
    float wk[CONV_MAX_K];
    // Unrolled to the bound so the weight and state loads are in flight together.
#pragma unroll
    for (int j = 0; j < CONV_MAX_K; j++) {
        if (j < K) wk[j] = load_w(w, dt, c * K + j);
        if (j < K - 1) win[j] = state[j * C + c];
    }
    for (u64 t = 0; t < T; t++) {
        const float xt = x[t * C + c];
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_MAX_K; j++)
            if (j < K) s += wk[j] * (j == K - 1 ? xt : win[j]);
        y[t * C + c] = silu_f(s);
#pragma unroll
        for (int j = 0; j + 1 < CONV_MAX_K; j++)
            if (j < K - 1) win[j] = j + 1 == K - 1 ? xt : win[j + 1];
    }
#pragma unroll
    for (int j = 0; j + 1 < CONV_MAX_K; j++)
        if (j < K - 1) state[j * C + c] = win[j];
}

// Per token and head: q, k l2-normalised (eps 1e-6), q scaled by 1/sqrt(k_dim). One warp per (t, k head).
extern "C" __global__ void gdn_qk_norm(const float* q, const float* k, float* qn, float* kn, u64 rows, int k_dim) {
    int lane = threadIdx.x & 31;
    u64 r = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const float* qr = q + r * k_dim;
    const float* kr = k + r * k_dim;
    float sq = 0.0f, sk = 0.0f;
    for (int i = lane; i < k_dim; i += 32) { sq += qr[i] * qr[i]; sk += kr[i] * kr[i]; }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    float rq = rsqrtf(sq + 1e-6f) * rsqrtf((float)k_dim);
    float rk = rsqrtf(sk + 1e-6f);
    for (int i = lane; i < k_dim; i += 32) { qn[r * k_dim + i] = qr[i] * rq; kn[r * k_dim + i] = kr[i] * rk; }
}

// beta = sigmoid(b), g = -exp(a_log) * softplus(a + dt_bias); a, b [T, Hv].
extern "C" __global__ void gdn_gates(const float* a, const float* b, const void* a_log, const void* dt_bias, int dt_alog,
                                     int dt_bias_t, float* beta, float* g, u64 T, int Hv) {
    u64 n = T * (u64)Hv;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        int h = (int)(i % Hv);
        beta[i] = sigmoid_f(b[i]);
        g[i] = -expf(load_w(a_log, dt_alog, h)) * softplus_f(a[i] + load_w(dt_bias, dt_bias_t, h));
    }
}

// The recurrence. Block (32 v columns × 8 k slices) per (v head, 32-column group). Each thread keeps
// S[i, j] for its column j and its k slice in registers (k_dim <= 8 * GDN_MAX_KS).
//
// FUSED (`gdn_recurrent_fused`, the decode path): the block also does gdn_qk_norm's and gdn_gates'
// work for its head and tokens, from the raw q, k (warps 0 and 1: the same lane-strided sums,
// warp_sum and scaling as gdn_qk_norm, so the same bits), a, b (every thread: gdn_gates'
// expressions) — two launches and their round trips less per GDN layer. Else q, k are qn, kn and
// `bg_b`, `bg_a` are beta and g from those kernels.
#define GDN_MAX_KS 32
template <bool FUSED>
__device__ __forceinline__ void gdn_recurrent_body(const float* __restrict__ q, const float* __restrict__ k,
                                                   const float* __restrict__ v, const float* __restrict__ bg_b,
                                                   const float* __restrict__ bg_a, const void* a_log,
                                                   const void* dt_bias, int dt_alog, int dt_bias_t,
                                                   float* state, float* o, u64 T, int Hk, int Hv, int k_dim,
                                                   int v_dim) {
    __shared__ float qs[8 * GDN_MAX_KS];
    __shared__ float ks[8 * GDN_MAX_KS];
    __shared__ float red[8][33];
    int h = blockIdx.x;
    int jl = threadIdx.x & 31, sl = threadIdx.x >> 5;
    int j = blockIdx.y * 32 + jl;
    int kh = h / (Hv / Hk);
    int per = (k_dim + 7) / 8;
    int i0 = sl * per;
    float S[GDN_MAX_KS];
    float* st = state + (u64)h * k_dim * v_dim;
#pragma unroll
    for (int e = 0; e < GDN_MAX_KS; e++) {
        int i = i0 + e;
        S[e] = (e < per && i < k_dim && j < v_dim) ? st[(u64)i * v_dim + j] : 0.0f;
    }
    for (u64 t = 0; t < T; t++) {
        float decay, bt;
        if (FUSED) {
            if (sl < 2) {  // warp 0: q, warp 1: k (gdn_qk_norm's arithmetic)
                const float* r = (sl == 0 ? q : k) + (t * Hk + kh) * k_dim;
                // k_dim <= 8 · GDN_MAX_KS = 256: at most 8 values per lane, loaded together.
                float rv[8 * GDN_MAX_KS / 32];
                float sq = 0.0f;
#pragma unroll
                for (int e = 0; e < 8 * GDN_MAX_KS / 32; e++) {
                    const int i = jl + 32 * e;
                    rv[e] = i < k_dim ? r[i] : 0.0f;
                }
#pragma unroll
                for (int e = 0; e < 8 * GDN_MAX_KS / 32; e++)
                    if (jl + 32 * e < k_dim) sq += rv[e] * rv[e];
                sq = warp_sum(sq);
                const float sc = sl == 0 ? rsqrtf(sq + 1e-6f) * rsqrtf((float)k_dim) : rsqrtf(sq + 1e-6f);
                float* dst = sl == 0 ? qs : ks;
#pragma unroll
                for (int e = 0; e < 8 * GDN_MAX_KS / 32; e++)
                    if (jl + 32 * e < k_dim) dst[jl + 32 * e] = rv[e] * sc;
            }
            const u64 gi = t * Hv + h;  // gdn_gates' arithmetic
            bt = sigmoid_f(bg_b[gi]);
            decay = expf(-expf(load_w(a_log, dt_alog, h)) * softplus_f(bg_a[gi] + load_w(dt_bias, dt_bias_t, h)));
        } else {
            for (int i = threadIdx.x; i < k_dim; i += blockDim.x) {
                qs[i] = q[(t * Hk + kh) * k_dim + i];
                ks[i] = k[(t * Hk + kh) * k_dim + i];
            }
            decay = expf(bg_a[t * Hv + h]);
            bt = bg_b[t * Hv + h];
        }
        __syncthreads();
        float part = 0.0f;
#pragma unroll
        for (int e = 0; e < GDN_MAX_KS; e++) {
            int i = i0 + e;
            if (e < per && i < k_dim) { S[e] *= decay; part += ks[i] * S[e]; }
        }
        red[sl][jl] = part;
        __syncthreads();
        float ksum = 0.0f;
        for (int s = 0; s < 8; s++) ksum += red[s][jl];
        float vj = j < v_dim ? v[(t * Hv + h) * v_dim + j] : 0.0f;
        float delta = bt * (vj - ksum);
        float op = 0.0f;
#pragma unroll
        for (int e = 0; e < GDN_MAX_KS; e++) {
            int i = i0 + e;
            if (e < per && i < k_dim) { S[e] += ks[i] * delta; op += qs[i] * S[e]; }
        }
        __syncthreads();
        red[sl][jl] = op;
        __syncthreads();
        if (sl == 0 && j < v_dim) {
            float os = 0.0f;
            for (int s = 0; s < 8; s++) os += red[s][jl];
            o[(t * Hv + h) * v_dim + j] = os;
        }
        __syncthreads();
    }
#pragma unroll
    for (int e = 0; e < GDN_MAX_KS; e++) {
        int i = i0 + e;
        if (e < per && i < k_dim && j < v_dim) st[(u64)i * v_dim + j] = S[e];
    }
}

extern "C" __global__ void gdn_recurrent(const float* qn, const float* kn, const float* v, const float* beta,
                                         const float* g, float* state, float* o, u64 T, int Hk, int Hv, int k_dim,
                                         int v_dim) {
    gdn_recurrent_body<false>(qn, kn, v, beta, g, nullptr, nullptr, 0, 0, state, o, T, Hk, Hv, k_dim, v_dim);
}

// q, k [T, Hk, k_dim] raw; a, b [T, Hv]; a_log, dt_bias [Hv] (dtype codes dt_alog, dt_bias_t).
extern "C" __global__ void gdn_recurrent_fused(const float* q, const float* k, const float* v, const float* b,
                                               const float* a, const void* a_log, const void* dt_bias, int dt_alog,
                                               int dt_bias_t, float* state, float* o, u64 T, int Hk, int Hv,
                                               int k_dim, int v_dim) {
    gdn_recurrent_body<true>(q, k, v, b, a, a_log, dt_bias, dt_alog, dt_bias_t, state, o, T, Hk, Hv, k_dim, v_dim);
}

// ---- Chunked (WY) form for long prefills (qwen-spec §3.6 "Chunked form"), two kernels per segment ----
// A segment is tokens [t0, t0 + tn) of the call; its chunks are C <= GDN_C tokens (the last may be
// shorter). Scratch is head-major over the segment: w [Hv, tn, k_dim], u [Hv, tn, v_dim],
// m [Hv, tn, C], gc [Hv, tn]. Both kernels use 256 threads (8 warps); a thread (c = lane, r = warp)
// owns column c and the chunk rows 8r..8r+7, read as two float4 from transposed tiles of row
// stride GDN_TR (a multiple of 4: 16-byte aligned rows).
#define GDN_C 64
#define GDN_CK_MAX 128
#define GDN_TP 33
#define GDN_TR 68

__device__ __forceinline__ void gdn_axpy8(float* acc, const float* col, float x) {
    float4 p = *(const float4*)col;
    float4 q = *(const float4*)(col + 4);
    acc[0] += p.x * x; acc[1] += p.y * x; acc[2] += p.z * x; acc[3] += p.w * x;
    acc[4] += q.x * x; acc[5] += q.y * x; acc[6] += q.z * x; acc[7] += q.w * x;
}

// Per (v head, chunk), independent of the state: γ = cumulative g inside the chunk,
// T = (I + A)^-1 with A[i,l] = β_i (k_i·k_l) e^{γ_i−γ_l} (l < i) by forward substitution,
// W = T (β e^γ K), U = T (β V), M[i,l] = (q_i·k_l) e^{γ_i−γ_l} (l <= i, else 0).
// Grid (Hv, number of chunks).
extern "C" __global__ void gdn_chunk_prep(const float* qn, const float* kn, const float* v, const float* beta,
                                          const float* g, float* w, float* u, float* m, float* gc, u64 t0, u64 tn,
                                          int Hk, int Hv, int k_dim, int v_dim, int C) {
    __shared__ float tm[GDN_C * (GDN_C + 1)];
    // Gram tiles (two [64, GDN_TP]) first, then T transposed ([l, i], row stride GDN_TR).
    __shared__ __align__(16) float buf[GDN_C * GDN_TR];
    __shared__ float ts[GDN_C * GDN_TP];
    __shared__ float gs[GDN_C];
    __shared__ float bs[GDN_C];
    float* ta = buf;
    float* tb = buf + GDN_C * GDN_TP;
    int h = blockIdx.x;
    int tid = threadIdx.x;
    int kh = h / (Hv / Hk);
    u64 start = (u64)blockIdx.y * C;
    if (start >= tn) return;
    int n = (int)((tn - start) < (u64)C ? (tn - start) : (u64)C);
    u64 row0 = (u64)h * tn + start;  // scratch row of this chunk's first token
    if (tid == 0) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) {
            acc += g[(t0 + start + i) * Hv + h];
            gs[i] = acc;
        }
    }
    if (tid < n) bs[tid] = beta[(t0 + start + tid) * Hv + h];
    __syncthreads();
    if (tid < n) gc[row0 + tid] = gs[tid];

    // Gram matrices K Kᵀ and Q Kᵀ over k tiles of 32; thread (tx, ty) owns rows ty + 16a, cols tx + 16b.
    int tx = tid & 15, ty = tid >> 4;
    float G[4][4], P[4][4];
#pragma unroll
    for (int a = 0; a < 4; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) { G[a][b] = 0.0f; P[a][b] = 0.0f; }
    for (int kt = 0; kt < k_dim; kt += 32) {
        for (int idx = tid; idx < GDN_C * 32; idx += blockDim.x) {
            int i = idx >> 5, c = idx & 31;
            bool ok = i < n && kt + c < k_dim;
            u64 src = ((t0 + start + i) * Hk + kh) * (u64)k_dim + kt + c;
            ta[i * GDN_TP + c] = ok ? kn[src] : 0.0f;
            tb[i * GDN_TP + c] = ok ? qn[src] : 0.0f;
        }
        __syncthreads();
        for (int c = 0; c < 32; c++) {
            float ki[4], qi[4], kl[4];
#pragma unroll
            for (int a = 0; a < 4; a++) {
                ki[a] = ta[(ty + 16 * a) * GDN_TP + c];
                qi[a] = tb[(ty + 16 * a) * GDN_TP + c];
                kl[a] = ta[(tx + 16 * a) * GDN_TP + c];
            }
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) { G[a][b] += ki[a] * kl[b]; P[a][b] += qi[a] * kl[b]; }
        }
        __syncthreads();
    }
#pragma unroll
    for (int a = 0; a < 4; a++) {
        int i = ty + 16 * a;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            int l = tx + 16 * b;
            bool in = i < n && l < n;
            tm[i * (GDN_C + 1) + l] = (in && l < i) ? -(bs[i] * G[a][b]) * expf(gs[i] - gs[l]) : 0.0f;
            if (i < n && l < C) m[(row0 + i) * C + l] = (in && l <= i) ? P[a][b] * expf(gs[i] - gs[l]) : 0.0f;
        }
    }
    __syncthreads();
    // Forward substitution: row i becomes row + Σ_{j < p < i} row[p] T[p, j] (rows above are final).
    for (int i = 1; i < n; i++) {
        float s = 0.0f;
        if (tid < i) {
            s = tm[i * (GDN_C + 1) + tid];
            for (int p = tid + 1; p < i; p++) s += tm[i * (GDN_C + 1) + p] * tm[p * (GDN_C + 1) + tid];
        }
        __syncthreads();
        if (tid < i) tm[i * (GDN_C + 1) + tid] = s;
        __syncthreads();
    }
    // T transposed into buf (the Gram tiles are dead): buf[l, i] = T[i, l]; 1 on the diagonal, 0 above
    // it and outside the chunk.
    for (int idx = tid; idx < GDN_C * GDN_C; idx += blockDim.x) {
        int l = idx >> 6, i = idx & 63;
        buf[l * GDN_TR + i] = (i < n && l == i) ? 1.0f : tm[i * (GDN_C + 1) + l];
    }
    __syncthreads();

    // W and U, 32 columns at a time: ts[l, c] = β_l e^{γ_l} k_l or β_l v_l; rows i = 8r + a.
    int c = tid & 31, r = tid >> 5;
    for (int kt = 0; kt < k_dim; kt += 32) {
        for (int idx = tid; idx < GDN_C * 32; idx += blockDim.x) {
            int l = idx >> 5, cc = idx & 31;
            bool ok = l < n && kt + cc < k_dim;
            ts[l * GDN_TP + cc] =
                ok ? bs[l] * expf(gs[l]) * kn[((t0 + start + l) * Hk + kh) * (u64)k_dim + kt + cc] : 0.0f;
        }
        __syncthreads();
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int l = 0; l < n; l++) gdn_axpy8(acc, buf + l * GDN_TR + 8 * r, ts[l * GDN_TP + c]);
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int i = 8 * r + a;
            if (i < n && kt + c < k_dim) w[(row0 + i) * k_dim + kt + c] = acc[a];
        }
        __syncthreads();
    }
    for (int vt = 0; vt < v_dim; vt += 32) {
        for (int idx = tid; idx < GDN_C * 32; idx += blockDim.x) {
            int l = idx >> 5, cc = idx & 31;
            bool ok = l < n && vt + cc < v_dim;
            ts[l * GDN_TP + cc] = ok ? bs[l] * v[((t0 + start + l) * Hv + h) * (u64)v_dim + vt + cc] : 0.0f;
        }
        __syncthreads();
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        for (int l = 0; l < n; l++) gdn_axpy8(acc, buf + l * GDN_TR + 8 * r, ts[l * GDN_TP + c]);
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int i = 8 * r + a;
            if (i < n && vt + c < v_dim) u[(row0 + i) * v_dim + vt + c] = acc[a];
        }
        __syncthreads();
    }
}

// The sequential part, per (v head, 32-column group), chunks in order, state slice [k_dim, 32] in
// shared memory (k_dim <= GDN_CK_MAX): V' = U − W S, O = (e^γ Q) S + M V',
// S = e^{γ_last} S + (e^{γ_last−γ} K)ᵀ V'. Thread (c, r): column c, chunk rows 8r..8r+7, state
// rows 16r..16r+15. Grid (Hv, ceil(v_dim / 32)).
extern "C" __global__ void gdn_chunk_scan(const float* qn, const float* kn, const float* w, const float* u,
                                          const float* m, const float* gc, float* state, float* o, u64 t0, u64 tn,
                                          int Hk, int Hv, int k_dim, int v_dim, int C) {
    __shared__ float S[GDN_CK_MAX * 32];
    // Two transposed [32, GDN_TR] tiles (W and e^γ Q, or M), or 32 rows of e^{γ_last−γ} K at row
    // stride GDN_CK_MAX (32 · 128 <= 2 · 32 · GDN_TR).
    __shared__ __align__(16) float buf[2 * 32 * GDN_TR];
    __shared__ float vp[GDN_C * 32];
    __shared__ float gs[GDN_C];
    float* ta = buf;
    float* tb = buf + 32 * GDN_TR;
    int h = blockIdx.x;
    int tid = threadIdx.x;
    int c = tid & 31, r = tid >> 5;
    int j = blockIdx.y * 32 + c;
    bool jok = j < v_dim;
    int kh = h / (Hv / Hk);
    float* st = state + (u64)h * k_dim * v_dim;
    for (int kk = r; kk < k_dim; kk += 8) S[kk * 32 + c] = jok ? st[(u64)kk * v_dim + j] : 0.0f;
    __syncthreads();
    for (u64 start = 0; start < tn; start += C) {
        int n = (int)((tn - start) < (u64)C ? (tn - start) : (u64)C);
        u64 row0 = (u64)h * tn + start;
        if (tid < n) gs[tid] = gc[row0 + tid];
        __syncthreads();
        float av[8], ao[8];
#pragma unroll
        for (int a = 0; a < 8; a++) { av[a] = 0.0f; ao[a] = 0.0f; }
        // W S and (e^γ Q) S over k tiles of 32: ta[cc, i] = W[i, kt + cc], tb[cc, i] = e^{γ_i} q_i[kt + cc].
        for (int kt = 0; kt < k_dim; kt += 32) {
            for (int idx = tid; idx < GDN_C * 32; idx += blockDim.x) {
                int i = idx >> 5, cc = idx & 31;
                bool ok = i < n && kt + cc < k_dim;
                ta[cc * GDN_TR + i] = ok ? w[(row0 + i) * k_dim + kt + cc] : 0.0f;
                tb[cc * GDN_TR + i] =
                    ok ? expf(gs[i]) * qn[((t0 + start + i) * Hk + kh) * (u64)k_dim + kt + cc] : 0.0f;
            }
            __syncthreads();
            int cn = k_dim - kt < 32 ? k_dim - kt : 32;
            for (int cc = 0; cc < cn; cc++) {
                float s = S[(kt + cc) * 32 + c];
                gdn_axpy8(av, ta + cc * GDN_TR + 8 * r, s);
                gdn_axpy8(ao, tb + cc * GDN_TR + 8 * r, s);
            }
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int i = 8 * r + a;
            vp[i * 32 + c] = (i < n && jok) ? u[(row0 + i) * v_dim + j] - av[a] : 0.0f;
        }
        // O += M V' over 32-column blocks of M: ta[l, i] = M[i, lt + l].
        for (int lt = 0; lt < n; lt += 32) {
            for (int idx = tid; idx < GDN_C * 32; idx += blockDim.x) {
                int i = idx >> 5, l = idx & 31;
                ta[l * GDN_TR + i] = (i < n && lt + l < n) ? m[(row0 + i) * C + lt + l] : 0.0f;
            }
            __syncthreads();
            int ln = n - lt < 32 ? n - lt : 32;
            for (int l = 0; l < ln; l++) gdn_axpy8(ao, ta + l * GDN_TR + 8 * r, vp[(lt + l) * 32 + c]);
            __syncthreads();
        }
#pragma unroll
        for (int a = 0; a < 8; a++) {
            int i = 8 * r + a;
            if (i < n && jok) o[((t0 + start + i) * Hv + h) * (u64)v_dim + j] = ao[a];
        }
        // State update, 32 tokens at a time: buf[l, kk] = e^{γ_last−γ_l} k_l[kk] (row stride GDN_CK_MAX).
        float last = gs[n - 1];
        float el = expf(last);
        float sa[16];
#pragma unroll
        for (int e = 0; e < 16; e++) {
            int kk = 16 * r + e;
            sa[e] = kk < k_dim ? S[kk * 32 + c] * el : 0.0f;
        }
        for (int lt = 0; lt < n; lt += 32) {
            for (int idx = tid; idx < 32 * GDN_CK_MAX; idx += blockDim.x) {
                int l = idx / GDN_CK_MAX, kk = idx % GDN_CK_MAX;
                buf[idx] = (lt + l < n && kk < k_dim)
                               ? expf(last - gs[lt + l]) * kn[((t0 + start + lt + l) * Hk + kh) * (u64)k_dim + kk]
                               : 0.0f;
            }
            __syncthreads();
            int ln = n - lt < 32 ? n - lt : 32;
            for (int l = 0; l < ln; l++) {
                float x = vp[(lt + l) * 32 + c];
                const float* kr = buf + l * GDN_CK_MAX + 16 * r;
                gdn_axpy8(sa, kr, x);
                gdn_axpy8(sa + 8, kr + 8, x);
            }
            __syncthreads();
        }
#pragma unroll
        for (int e = 0; e < 16; e++) {
            int kk = 16 * r + e;
            if (kk < k_dim) S[kk * 32 + c] = sa[e];
        }
        __syncthreads();
    }
    if (jok)
        for (int kk = r; kk < k_dim; kk += 8) st[(u64)kk * v_dim + j] = S[kk * 32 + c];
}
