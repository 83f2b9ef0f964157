// Streamed attention over span plans: one walk in token order, one final combine.
//
// The token range is split by token index into a FIXED number of splits per evaluation: split s owns
// every 128-token tile t with t % n_splits == s. Each split keeps its own (max, sum, acc[head_dim])
// per query row in the state tensor [n_splits, width, q_heads, head_dim + 2] and processes its tokens
// in token order in units of `unit` tokens (unit divides the page size and 128, so no unit straddles
// a span or a wave). The arithmetic therefore does not depend on how tokens are spread over resident
// pages, ring slots or waves: streamed == resident bit for bit. attn_finish combines the splits once.
//
// Grid: (kv_heads, n_splits, ceil(width / 4)); block: 256 threads. One block reads each K/V unit once
// for all query heads of its GQA group and up to 4 queries (decode widths 1..=4 in one kernel).
// Dynamic shared memory: qs[R][D] ks[U][D+1] (padded: no bank conflicts) vs[U][D] acc[R][D] sc[R][U] m[R] l[R] alpha[R],
// R = group * qw.

#define ATT_TILE 128
#define ATT_QW 4

struct AttnGeo {
    int q_heads, kv_heads, head_dim, width, total;
    float scale;
    int k_type, v_type, tpp;
    u64 page_bytes, k_row_bytes, v_row_bytes, k_head_bytes, v_head_bytes, v_plane_off;
};

extern "C" __global__ void attn_accumulate(const float* q, const u8* pool, float* state, AttnGeo geo,
                                           u64 span_offset, int span_first, int span_count, int n_splits,
                                           int unit) {
    extern __shared__ float smem[];
    const int D = geo.head_dim;
    const int G = geo.q_heads / geo.kv_heads;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int qi0 = blockIdx.z * ATT_QW;
    const int qw = min(ATT_QW, geo.width - qi0);
    const int R = G * qw;
    const int U = unit;
    float* qs = smem;
    float* ks = qs + R * D;
    const int KP = D + 1;
    float* vs = ks + U * KP;
    float* acc = vs + U * D;
    float* sc = acc + R * D;
    float* mrow = sc + R * U;
    float* lrow = mrow + R;
    float* arow = lrow + R;
    const int rowlen = D + 2;
    // Row r ↔ query qi0 + r / G, head kvh * G + r % G.
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int r = e / D, d = e % D;
        int qi = qi0 + r / G, head = kvh * G + r % G;
        qs[e] = q[((u64)qi * geo.q_heads + head) * D + d];
        const float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        acc[e] = st[2 + d];
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int qi = qi0 + r / G, head = kvh * G + r % G;
        const float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        mrow[r] = st[0];
        lrow[r] = st[1];
    }
    __syncthreads();
    const int span_end = span_first + span_count;
    // Units in token order; the first unit of the first owned tile at or after span_first.
    for (int u0 = span_first; u0 < span_end; u0 += U) {
        if ((u0 / ATT_TILE) % n_splits != split) {
            // Skip to the next tile boundary.
            int next_tile = (u0 / ATT_TILE + 1) * ATT_TILE;
            u0 = next_tile - U;
            continue;
        }
        const int cnt = min(U, span_end - u0);
        // Dequantise the unit's K and V head rows into shared memory.
        for (int e = threadIdx.x; e < cnt * D; e += blockDim.x) {
            int j = e / D, d = e % D;
            int rel = u0 + j - span_first;
            u64 page = (u64)(rel / geo.tpp), slot = (u64)(rel % geo.tpp);
            const u8* kp = pool + span_offset + page * geo.page_bytes + slot * geo.k_row_bytes + kvh * geo.k_head_bytes;
            const u8* vp = pool + span_offset + page * geo.page_bytes + geo.v_plane_off + slot * geo.v_row_bytes +
                           kvh * geo.v_head_bytes;
            ks[j * KP + d] = kv_load(kp, geo.k_type, d);
            vs[e] = kv_load(vp, geo.v_type, d);
        }
        __syncthreads();
        // Scores with the causal mask: query qi sees tokens <= total - width + qi.
        for (int e = threadIdx.x; e < R * U; e += blockDim.x) {
            int r = e / U, j = e % U;
            int qi = qi0 + r / G;
            int tok = u0 + j;
            float s = NEG_INF;
            if (j < cnt && tok <= geo.total - geo.width + qi) {
                const float* qr = qs + r * D;
                const float* kr = ks + j * KP;
                float dot = 0.0f;
                for (int d = 0; d < D; d++) dot += qr[d] * kr[d];
                s = dot * geo.scale;
            }
            sc[e] = s;
        }
        __syncthreads();
        // Online softmax update per row.
        for (int r = threadIdx.x; r < R; r += blockDim.x) {
            float mu = NEG_INF;
            for (int j = 0; j < U; j++) mu = fmaxf(mu, sc[r * U + j]);
            if (mu == NEG_INF) {
                // Fully masked unit for this row: no contribution, state unchanged.
                for (int j = 0; j < U; j++) sc[r * U + j] = 0.0f;
                arow[r] = 1.0f;
                continue;
            }
            float mo = mrow[r];
            float mn = fmaxf(mo, mu);
            float alpha = mo == NEG_INF ? 0.0f : expf(mo - mn);
            float sum = 0.0f;
            for (int j = 0; j < U; j++) {
                float s = sc[r * U + j];
                float p = s == NEG_INF ? 0.0f : expf(s - mn);
                sc[r * U + j] = p;
                sum += p;
            }
            lrow[r] = lrow[r] * alpha + sum;
            mrow[r] = mn;
            arow[r] = alpha;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
            int r = e / D, d = e % D;
            float a = arow[r];
            float s = acc[e] * a;
            for (int j = 0; j < cnt; j++) s += sc[r * U + j] * vs[j * D + d];
            acc[e] = s;
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int r = e / D, d = e % D;
        int qi = qi0 + r / G, head = kvh * G + r % G;
        float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        st[2 + d] = acc[e];
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int qi = qi0 + r / G, head = kvh * G + r % G;
        float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        st[0] = mrow[r];
        st[1] = lrow[r];
    }
}

// out[qi, head * D + d] = Σ_s acc_s e^{m_s - M} / Σ_s l_s e^{m_s - M}. One block per (query, head).
extern "C" __global__ void attn_finish(const float* state, float* out, int n_splits, int width, int q_heads,
                                       int head_dim) {
    int row = blockIdx.x;  // qi * q_heads + head
    int rowlen = head_dim + 2;
    u64 split_stride = (u64)width * q_heads * rowlen;
    const float* base = state + (u64)row * rowlen;
    float M = NEG_INF;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, base[s * split_stride]);
    float L = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        float m = base[s * split_stride];
        if (m != NEG_INF) L += base[s * split_stride + 1] * expf(m - M);
    }
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            float m = base[s * split_stride];
            if (m != NEG_INF) a += base[s * split_stride + 2 + d] * expf(m - M);
        }
        out[(u64)row * head_dim + d] = a * inv;
    }
}
