// Gated DeltaNet: causal depthwise conv1d with state, and the gated delta rule with f32 state.

#define CONV_MAX_K 8

// x [T, C], w [C, 1, K] (dtype dt), state [K-1, C] (oldest row first). One thread per channel.
extern "C" __global__ void causal_conv1d_f32(const float* x, const void* w, int dt, float* state, float* y,
                                             u64 T, u64 C, int K) {
    u64 c = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (c >= C) return;
    float win[CONV_MAX_K];
    float wk[CONV_MAX_K];
    for (int j = 0; j < K; j++) wk[j] = load_w(w, dt, c * K + j);
    for (int j = 0; j < K - 1; j++) win[j] = state[j * C + c];
    for (u64 t = 0; t < T; t++) {
        win[K - 1] = x[t * C + c];
        float s = 0.0f;
        for (int j = 0; j < K; j++) s += wk[j] * win[j];
        y[t * C + c] = silu_f(s);
        for (int j = 0; j < K - 1; j++) win[j] = win[j + 1];
    }
    for (int j = 0; j < K - 1; j++) state[j * C + c] = win[j];
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
#define GDN_MAX_KS 32
extern "C" __global__ void gdn_recurrent(const float* qn, const float* kn, const float* v, const float* beta,
                                         const float* g, float* state, float* o, u64 T, int Hk, int Hv, int k_dim,
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
        for (int i = threadIdx.x; i < k_dim; i += blockDim.x) {
            qs[i] = qn[(t * Hk + kh) * k_dim + i];
            ks[i] = kn[(t * Hk + kh) * k_dim + i];
        }
        __syncthreads();
        float decay = expf(g[t * Hv + h]);
        float bt = beta[t * Hv + h];
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
