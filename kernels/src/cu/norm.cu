// RMSNorm (zero-centred via unit_offset) and the gated RMSNorm of Gated DeltaNet. One block per row.

// Float4s of a row each thread keeps in registers between the sum of squares and the scaling:
// rows up to NORM_CACHE · 4 · blockDim values (8,192 with 256 threads, 16,384 with the 512 the
// launcher gives rows of 4,096 values or more unless KVSTREAM_NORM_WIDE=0: the RMSNorm kernels carry no
// __launch_bounds__, which changed the default build's register allocation, and use <= 128
// registers, so 512-thread blocks launch) are read
// from memory once, with all of a thread's loads in flight together (a loop that waits on each
// load made a single-row norm of 5,120 values take ~13 µs on an H200, latency-bound).
#define NORM_CACHE 8

__device__ __forceinline__ float4 norm_add4(float4 p, float4 q) {
    return make_float4(p.x + q.x, p.y + q.y, p.z + q.z, p.w + q.w);
}
__device__ __forceinline__ float norm_sq4(float s, float4 v) {
    s += v.x * v.x;
    s += v.y * v.y;
    s += v.z * v.z;
    s += v.w * v.w;
    return s;
}
__device__ __forceinline__ float4 norm_w4(const void* __restrict__ w, int dt, u64 i4) {
    const u64 i = 4 * i4;
    return make_float4(load_w(w, dt, i), load_w(w, dt, i + 1), load_w(w, dt, i + 2), load_w(w, dt, i + 3));
}
__device__ __forceinline__ float4 norm_scale4(float4 v, float r, float4 wv, float off) {
    return make_float4(v.x * r * (wv.x + off), v.y * r * (wv.y + off), v.z * r * (wv.z + off), v.w * r * (wv.w + off));
}

// One row: h = a + b (ADD; stored) or h = a, then y = h · rsqrt(mean(h²) + eps) · (w + off).
// Per-thread element order and the block reduction depend only on d and blockDim, so a row's
// result does not depend on the number of rows, and ADD gives bit for bit what add_f32 followed
// by the ADD = false path gives.
// prep ≠ 0 (PREP_I8C / PREP_I8C_NL, common.cuh): y's x prep for the q4 integer GEMVs into xf as
// well, from the values in registers. The launcher asks for it only when d % 128 == 0 and every
// pointer is 16-byte aligned (the vector path): float4 i of the row is lane i % 32 of warp-group
// i / 32 (blockDim a multiple of 32), so each warp holds whole 128-groups and i < d4 is
// warp-uniform.
template <bool ADD>
__device__ __forceinline__ void rms_row(const float* __restrict__ a, const float* __restrict__ b,
                                        const void* __restrict__ w, int dt, u64 d, float eps, float off,
                                        float* __restrict__ h, float* __restrict__ y, uint4* __restrict__ xf,
                                        int prep) {
    __shared__ float scratch[32];
    if (prep) grid_launch_dependents();  // the q4 GEMV reading xf streams its first weights now
    grid_dependency_wait();              // a programmatic dependent of the GEMV that wrote a / b
    const u64 row = blockIdx.x;
    const int lane = threadIdx.x & 31;
    const u64 row_group = row * (d / 128);
    a += row * d;
    y += row * d;
    if (ADD) {
        b += row * d;
        h += row * d;
    }
    const bool vec = d % 4 == 0 && ((unsigned long long)a | (unsigned long long)y |
                                    (ADD ? ((unsigned long long)b | (unsigned long long)h) : 0ull)) % 16 == 0;
    float s = 0.0f;
    if (vec) {
        const u64 d4 = d / 4;
        const float4* A = (const float4*)a;
        const float4* B = (const float4*)b;
        float4 c[NORM_CACHE], wc[NORM_CACHE];
#pragma unroll
        for (int j = 0; j < NORM_CACHE; j++) {
            const u64 i = threadIdx.x + (u64)j * blockDim.x;
            if (i < d4) {
                c[j] = ADD ? norm_add4(A[i], B[i]) : A[i];
                wc[j] = norm_w4(w, dt, i);  // in flight with the row, used after the reduction
            }
        }
#pragma unroll
        for (int j = 0; j < NORM_CACHE; j++) {
            const u64 i = threadIdx.x + (u64)j * blockDim.x;
            if (i < d4) {
                if (ADD) ((float4*)h)[i] = c[j];
                s = norm_sq4(s, c[j]);
            }
        }
        for (u64 i = threadIdx.x + (u64)NORM_CACHE * blockDim.x; i < d4; i += blockDim.x) {
            const float4 v = ADD ? norm_add4(A[i], B[i]) : A[i];
            if (ADD) ((float4*)h)[i] = v;
            s = norm_sq4(s, v);
        }
        const float r = rsqrtf(block_sum(s, scratch) / (float)d + eps);
#pragma unroll
        for (int j = 0; j < NORM_CACHE; j++) {
            const u64 i = threadIdx.x + (u64)j * blockDim.x;
            if (i < d4) {
                const float4 o = norm_scale4(c[j], r, wc[j], off);
                ((float4*)y)[i] = o;
                q4c_prep_group(prep, o, xf, row_group + i / 32, lane);
            }
        }
        for (u64 i = threadIdx.x + (u64)NORM_CACHE * blockDim.x; i < d4; i += blockDim.x) {
            const float4 v = ADD ? norm_add4(A[i], B[i]) : A[i];
            const float4 o = norm_scale4(v, r, norm_w4(w, dt, i), off);
            ((float4*)y)[i] = o;
            q4c_prep_group(prep, o, xf, row_group + i / 32, lane);
        }
    } else {
#pragma unroll 4
        for (u64 i = threadIdx.x; i < d; i += blockDim.x) {
            const float v = ADD ? a[i] + b[i] : a[i];
            if (ADD) h[i] = v;
            s += v * v;
        }
        const float r = rsqrtf(block_sum(s, scratch) / (float)d + eps);
#pragma unroll 4
        for (u64 i = threadIdx.x; i < d; i += blockDim.x) {
            const float v = ADD ? a[i] + b[i] : a[i];
            y[i] = v * r * (load_w(w, dt, i) + off);
        }
    }
}

// One block per row. xf / prep: the fused x prep (rms_row; prep = 0: none, xf unused).
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const void* __restrict__ w, int dt, u64 d,
                                        float eps, float unit_offset, float* __restrict__ y, uint4* __restrict__ xf,
                                        int prep) {
    rms_row<false>(x, nullptr, w, dt, d, eps, unit_offset, nullptr, y, xf, prep);
}

// h = a + b stored, then the RMSNorm of h: bit-identical to add_f32 followed by rms_norm_f32
// (same per-thread elements and reduction order), one launch and one read of the row.
extern "C" __global__ void add_rms_norm_f32(const float* __restrict__ a, const float* __restrict__ b,
                                            const void* __restrict__ w, int dt, u64 d, float eps,
                                            float unit_offset, float* __restrict__ h, float* __restrict__ y,
                                            uint4* __restrict__ xf, int prep) {
    rms_row<true>(a, b, w, dt, d, eps, unit_offset, h, y, xf, prep);
}

// One block per row. prep ≠ 0 (d % 128 == 0, y 16-byte aligned): after the row is written, each
// warp x-preps whole 128-groups of it, read back from memory (a block's own global writes are
// visible to it after __syncthreads).
extern "C" __global__ void gated_rms_norm_f32(const float* x, const float* z, const void* w, int dt, u64 d,
                                              float eps, float* y, uint4* __restrict__ xf, int prep) {
    __shared__ float scratch[32];
    if (prep) grid_launch_dependents();
    grid_dependency_wait();
    const float* xr = x + blockIdx.x * d;
    const float* zr = z + blockIdx.x * d;
    float* yr = y + blockIdx.x * d;
    float s = 0.0f;
    for (u64 i = threadIdx.x; i < d; i += blockDim.x) s += xr[i] * xr[i];
    float total = block_sum(s, scratch);
    float r = rsqrtf(total / (float)d + eps);
    for (u64 i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * r * load_w(w, dt, i) * silu_f(zr[i]);
    if (prep) {
        __syncthreads();
        const int lane = threadIdx.x & 31;
        const u64 groups = d / 128;
        for (u64 g = threadIdx.x >> 5; g < groups; g += blockDim.x >> 5) {
            const float4 v = ((const float4*)(yr + g * 128))[lane];
            q4c_prep_group(prep, v, xf, blockIdx.x * groups + g, lane);
        }
    }
}
