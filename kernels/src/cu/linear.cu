// y[T, N] = x[T, K] · w[N, K]ᵀ with f32 accumulation; w is f32, f16 or bf16.

#define GEMV_MAX_T 8

// Decode GEMV: one warp per output column n, all T (<= 8) rows at once, so each weight row is read
// once. Vectorised 16-byte weight loads when `vec` (K % 8 == 0 and 16-byte aligned rows, 2-byte
// dtypes only).
extern "C" __global__ void gemv_f32out(const float* x, const void* w, int dt, float* y, int T, u64 K,
                                       u64 N, int vec) {
    int lane = threadIdx.x & 31;
    u64 n = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    float acc[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.0f;
    if (vec && dt != WT_F32) {
        const uint4* wr = (const uint4*)((const u16*)w + n * K);
        u64 nv = K / 8;
        // Four independent 16-byte loads in flight per lane before any arithmetic.
        for (u64 c0 = lane; c0 < nv; c0 += 128) {
            uint4 pks[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                u64 c = c0 + 32 * u;
                pks[u] = c < nv ? wr[c] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                u64 c = c0 + 32 * u;
                if (c >= nv) break;
                uint4 pk = pks[u];
                u32 words[4] = {pk.x, pk.y, pk.z, pk.w};
                float wf[8];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    u16 lo = (u16)(words[e] & 0xffffu), hi = (u16)(words[e] >> 16);
                    wf[2 * e] = dt == WT_BF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
                    wf[2 * e + 1] = dt == WT_BF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
                }
#pragma unroll
                for (int t = 0; t < GEMV_MAX_T; t++) {
                    if (t < T) {
                        const float4* xr = (const float4*)(x + t * K + c * 8);
                        float4 a = xr[0], b = xr[1];
                        acc[t] += a.x * wf[0] + a.y * wf[1] + a.z * wf[2] + a.w * wf[3] + b.x * wf[4] + b.y * wf[5] +
                                  b.z * wf[6] + b.w * wf[7];
                    }
                }
            }
        }
    } else {
        for (u64 k = lane; k < K; k += 32) {
            float wv = load_w(w, dt, n * K + k);
#pragma unroll
            for (int t = 0; t < GEMV_MAX_T; t++)
                if (t < T) acc[t] += x[t * K + k] * wv;
        }
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[t * N + n] = s;
        }
    }
}

// Prefill GEMM: 64×64 output tile per block of 256 threads, 4×4 outputs per thread, K step 16.
#define GT 64
#define GK 16
extern "C" __global__ void gemm_f32out(const float* x, const void* w, int dt, float* y, u64 T, u64 K, u64 N) {
    __shared__ float xs[GK][GT + 1];
    __shared__ float ws[GK][GT + 1];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    u64 row0 = blockIdx.y * (u64)GT, col0 = blockIdx.x * (u64)GT;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (u64 k0 = 0; k0 < K; k0 += GK) {
        for (int e = threadIdx.x; e < GT * GK; e += blockDim.x) {
            int r = e / GK, kk = e % GK;
            u64 gr = row0 + r, gn = col0 + r, gk = k0 + kk;
            xs[kk][r] = (gr < T && gk < K) ? x[gr * K + gk] : 0.0f;
            ws[kk][r] = (gn < N && gk < K) ? load_w(w, dt, gn * K + gk) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GK; kk++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u64 r = row0 + ty + 16 * i;
        if (r >= T) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u64 c = col0 + tx + 16 * j;
            if (c < N) y[r * N + c] = acc[i][j];
        }
    }
}
