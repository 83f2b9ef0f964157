// Element-wise ops, layout copies, embedding gather and greedy argmax.

extern "C" __global__ void add_f32(const float* a, const float* b, float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = a[i] + b[i];
}

extern "C" __global__ void swiglu_f32(const float* gate, const float* up, float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = silu_f(gate[i]) * up[i];
}

extern "C" __global__ void sigmoid_gate_f32(const float* x, const float* gate, float* y, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        y[i] = x[i] * sigmoid_f(gate[i]);
}

// SwiGLU / sigmoid gate with the fused x prep of the q4 integer GEMVs (common.cuh): one warp per
// 128-group of the output (n % 128 == 0, every pointer 16-byte aligned), lane l values 4l .. 4l + 3;
// y as the plain kernels write it (same per-value expression) plus xf (prep = PREP_I8C or
// PREP_I8C_NL).
template <bool SWIGLU>
__device__ __forceinline__ void gate_prep(const float* __restrict__ a, const float* __restrict__ g,
                                          float* __restrict__ y, u64 n, uint4* __restrict__ xf, int prep) {
    grid_launch_dependents();
    grid_dependency_wait();  // a programmatic dependent of the GEMV that wrote a / g
    const u64 group = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (group >= n / 128) return;  // warp-uniform
    const u64 i4 = group * 32 + lane;
    const float4 av = ((const float4*)a)[i4];
    const float4 gv = ((const float4*)g)[i4];
    float4 o;
    if (SWIGLU) {  // a = gate, g = up
        o = make_float4(silu_f(av.x) * gv.x, silu_f(av.y) * gv.y, silu_f(av.z) * gv.z, silu_f(av.w) * gv.w);
    } else {  // a = x, g = gate
        o = make_float4(av.x * sigmoid_f(gv.x), av.y * sigmoid_f(gv.y), av.z * sigmoid_f(gv.z),
                        av.w * sigmoid_f(gv.w));
    }
    ((float4*)y)[i4] = o;
    q4c_prep_group(prep, o, xf, group, lane);
}

extern "C" __global__ void swiglu_prep_f32(const float* __restrict__ gate, const float* __restrict__ up,
                                           float* __restrict__ y, u64 n, uint4* __restrict__ xf, int prep) {
    gate_prep<true>(gate, up, y, n, xf, prep);
}

extern "C" __global__ void sigmoid_gate_prep_f32(const float* __restrict__ x, const float* __restrict__ gate,
                                                 float* __restrict__ y, u64 n, uint4* __restrict__ xf, int prep) {
    gate_prep<false>(x, gate, y, n, xf, prep);
}

// dst[r, dst_col0 + c] = src[r, src_col0 + c] for r < rows, c < cols.
extern "C" __global__ void copy_cols_f32(const float* src, u64 src_stride, u64 src_col0, float* dst,
                                         u64 dst_stride, u64 dst_col0, u64 rows, u64 cols) {
    u64 n = rows * cols;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 r = i / cols, c = i % cols;
        dst[r * dst_stride + dst_col0 + c] = src[r * src_stride + src_col0 + c];
    }
}

// Up to four consecutive column ranges of src [rows, width], starting at column col0, into their own
// [rows, s_p] tensors in one launch (split_cols of more than one row: one copy_cols per part
// before, ~8 launches per layer of an MTP verification step). A part with s_p = 0 is skipped.
extern "C" __global__ void split_cols_f32(const float* __restrict__ src, u64 width, u64 rows, u64 col0,
                                          float* d0, u64 s0, float* d1, u64 s1, float* d2, u64 s2, float* d3,
                                          u64 s3) {
    const u64 span = s0 + s1 + s2 + s3;
    const u64 n = rows * span;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / span;
        u64 c = i % span;
        const float v = src[r * width + col0 + c];
        if (c < s0) {
            d0[r * s0 + c] = v;
        } else if ((c -= s0) < s1) {
            d1[r * s1 + c] = v;
        } else if ((c -= s1) < s2) {
            d2[r * s2 + c] = v;
        } else {
            c -= s2;
            d3[r * s3 + c] = v;
        }
    }
}

// out[i, :] = table[ids[i], :] as f32. One block row per id.
extern "C" __global__ void embedding_gather(const void* table, int dt, const u32* ids, u64 n_ids,
                                            u64 hidden, float* out) {
    for (u64 i = blockIdx.y; i < n_ids; i += gridDim.y) {
        u64 row = ids[i];
        for (u64 h = blockIdx.x * (u64)blockDim.x + threadIdx.x; h < hidden; h += (u64)gridDim.x * blockDim.x)
            out[i * hidden + h] = load_w(table, dt, row * hidden + h);
    }
}

// Index of the largest value of each row (lowest index on ties; NaN never wins). One block per row.
extern "C" __global__ void argmax_rows_f32(const float* x, u64 cols, u32* out) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    const float* row = x + blockIdx.x * cols;
    float best = NEG_INF;
    u32 bi = 0xffffffffu;
    for (u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = row[c];
        if (v > best || (bi == 0xffffffffu && !(v != v))) { best = v; bi = (u32)c; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        u32 oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > best || (ov == best && oi < bi))) { best = ov; bi = oi; }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            float ov = sv[w];
            u32 oi = si[w];
            if (oi != 0xffffffffu && (bi == 0xffffffffu || ov > best || (ov == best && oi < bi))) { best = ov; bi = oi; }
        }
        out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
    }
}

// Weight prefetch into L2 (`CudaBackend::prefetch_weight`, `KVSTREAM_L2_PREFETCH`): `bytes` from
// p (16-byte aligned) requested into L2 without waiting for them. sm_90: one bulk prefetch per
// 64 KiB (the copy unit fetches; a block of one warp issues them all); below sm_90 one line
// prefetch per 128 bytes (the launcher sizes the grid to the bytes). Launched as a programmatic
// dependent of the kernel before it, it issues its requests while that kernel drains, then waits
// for it, so its completion still implies the previous kernel's (stream order for the next one).
extern "C" __global__ void l2_prefetch(const u8* __restrict__ p, u64 bytes) {
    const u64 lane = (u64)blockIdx.x * blockDim.x + threadIdx.x, lanes = (u64)gridDim.x * blockDim.x;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const u64 chunk = 1u << 16;
    for (u64 off = lane * chunk; off < bytes; off += lanes * chunk) {
        const u32 n = (u32)min(chunk, bytes - off) & ~15u;
        if (n > 0) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
    }
#else
    for (u64 off = lane * 128; off < bytes; off += lanes * 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
#endif
    grid_dependency_wait();
}
