// Partial (M-)RoPE, NeoX half layout over the first rotary_dim dims of every head.
// positions: [T, 3] (t, h, w); axis[j], inv_freq[j] for j < rotary_dim / 2 (computed on the host).

extern "C" __global__ void rope_f32(const float* x, float* y, u64 tokens, int heads, int head_dim,
                                    int rotary_dim, const u32* positions, const int* axis,
                                    const float* inv_freq) {
    int half = rotary_dim / 2;
    u64 n = tokens * (u64)heads * head_dim;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        int d = (int)(i % head_dim);
        u64 th = i / head_dim;
        u64 t = th / heads;
        const float* xh = x + th * head_dim;
        if (d >= rotary_dim) { y[i] = xh[d]; continue; }
        int j = d < half ? d : d - half;
        float pos = (float)positions[t * 3 + axis[j]];
        float ang = pos * inv_freq[j];
        float c = cosf(ang), s = sinf(ang);
        float x1 = xh[j], x2 = xh[j + half];
        y[i] = d < half ? x1 * c - x2 * s : x2 * c + x1 * s;
    }
}
