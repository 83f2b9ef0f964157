// The vision tower (ViT) ops: bias add, LayerNorm, GELU, 2-D rotary and bidirectional per-frame
// attention. All f32; 1-D weights (bias, norm) are f32/f16/bf16 read through load_w.

// y[i] = x[i] + b[i % d] over n = rows · d values.
extern "C" __global__ void add_bias_f32(const float* x, const void* b, int dt, u64 d, float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = x[i] + load_w(b, dt, i % d);
}

// One block per row of d values (blockDim.x a multiple of 32). Two passes: mean, then the biased
// variance of the centred values.
extern "C" __global__ void layer_norm_f32(const float* x, const void* w, int wdt, const void* b, int bdt,
                                          u64 d, float eps, float* y) {
    __shared__ float scratch[32];
    const float* xr = x + blockIdx.x * d;
    float* yr = y + blockIdx.x * d;
    float s = 0.0f;
    for (u64 i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
    float mean = block_sum(s, scratch) / (float)d;
    float v = 0.0f;
    for (u64 i = threadIdx.x; i < d; i += blockDim.x) {
        float c = xr[i] - mean;
        v += c * c;
    }
    float r = rsqrtf(block_sum(v, scratch) / (float)d + eps);
    for (u64 i = threadIdx.x; i < d; i += blockDim.x)
        yr[i] = (xr[i] - mean) * r * load_w(w, wdt, i) + load_w(b, bdt, i);
}

// kind 0: tanh approximation (gelu_pytorch_tanh); kind 1: exact (erf).
extern "C" __global__ void gelu_f32(const float* x, float* y, u64 n, int kind) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = x[i];
        if (kind == 0) {
            float c = 0.7978845608028654f;  // sqrt(2/pi)
            y[i] = 0.5f * v * (1.0f + tanhf(c * (v + 0.044715f * v * v * v)));
        } else {
            y[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
        }
    }
}

// qkv [n_tok, 3·heads·hd] → out (same layout): q and k rotated with rotate_half over the full head
// (x·cos + rotate_half(x)·sin, table row i % frame of cos/sin [frame, hd]); v copied.
extern "C" __global__ void vision_rotary_f32(const float* qkv, const float* cos_t, const float* sin_t,
                                             float* out, u64 n_tok, int heads, int hd, u64 frame) {
    u64 h = (u64)heads * hd;
    u64 n = n_tok * 3 * h;
    int half = hd / 2;
    for (u64 idx = blockIdx.x * (u64)blockDim.x + threadIdx.x; idx < n; idx += (u64)gridDim.x * blockDim.x) {
        u64 i = idx / (3 * h);
        u64 c = idx % (3 * h);
        if (c >= 2 * h) { out[idx] = qkv[idx]; continue; }
        int d = (int)(c % hd);
        u64 base = idx - d;
        u64 pi = (i % frame) * hd + d;
        float rot = d < half ? -qkv[base + d + half] : qkv[base + d - half];
        out[idx] = qkv[idx] * cos_t[pi] + rot * sin_t[pi];
    }
}

#define VA_WARPS 4
#define VA_MAX_HD 128

// Bidirectional attention within frames. qkv [n_tok, 3h] rotated; out [n_tok, h]. One warp per
// (query row, head): grid (ceil(n_tok / VA_WARPS), heads), VA_WARPS warps per block. Lane l holds
// dims l, l+32, l+64, l+96 (hd <= VA_MAX_HD, checked by the launcher). Online softmax in f32 over
// the frame's keys.
extern "C" __global__ void vision_attn_f32(const float* qkv, float* out, u64 n_tok, int heads, int hd,
                                           u64 frame, float scale) {
    int lane = threadIdx.x & 31;
    u64 i = (u64)blockIdx.x * VA_WARPS + (threadIdx.x >> 5);
    int head = blockIdx.y;
    if (i >= n_tok || head >= heads) return;  // uniform per warp
    u64 h = (u64)heads * hd;
    u64 f0 = (i / frame) * frame;
    const float* q = qkv + i * 3 * h + (u64)head * hd;
    float qr[4], acc[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int d = lane + 32 * r;
        qr[r] = d < hd ? q[d] : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (u64 j = f0; j < f0 + frame; j++) {
        const float* k = qkv + j * 3 * h + h + (u64)head * hd;
        const float* v = k + h;
        float part = 0.0f;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int d = lane + 32 * r;
            if (d < hd) part += qr[r] * k[d];
        }
        float s = warp_sum(part) * scale;
        float mn = fmaxf(m, s);
        float corr = expf(m - mn);
        float p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int d = lane + 32 * r;
            if (d < hd) acc[r] = acc[r] * corr + p * v[d];
        }
        m = mn;
    }
    float inv = 1.0f / l;
    float* o = out + i * h + (u64)head * hd;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        int d = lane + 32 * r;
        if (d < hd) o[d] = acc[r] * inv;
    }
}
