// Shared helpers prepended to every kvstream kernel module (no CUDA headers needed: NVRTC only).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef signed char i8;

// Weight dtypes (kvstream WeightDType): 0 = f32, 1 = f16, 2 = bf16.
#define WT_F32 0
#define WT_F16 1
#define WT_BF16 2
// KV types (kvstream KvType): 0 = f32, 1 = f16, 2 = bf16, 3 = q8_0, 4 = q4_0.
#define KV_F32 0
#define KV_F16 1
#define KV_BF16 2
#define KV_Q8_0 3
#define KV_Q4_0 4
#define QK 32

#define NEG_INF (__int_as_float(0xff800000))

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 → f16, round to nearest even, NaN kept quiet, overflow to inf (the `half` crate's rules).
// Pure integer code: the inline-PTX cvt lost the low byte in the quantiser on sm_90 (seen on the
// H200: the Q8_0 scale's low byte came out 0), so the encoder does not depend on it.
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 ex = (x >> 23) & 0xffu;
    u32 man = x & 0x7fffffu;
    if (ex == 0xffu) return (u16)(sign | 0x7c00u | (man ? (0x200u | (man >> 13)) : 0u));
    int e = (int)ex - 127 + 15;
    if (e >= 0x1f) return (u16)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (u16)sign;
        man |= 0x800000u;
        int shift = 14 - e;
        u32 hm = man >> shift;
        u32 rem = man & ((1u << shift) - 1u);
        u32 halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (hm & 1u))) hm++;
        return (u16)(sign | hm);
    }
    u32 hm = man >> 13;
    u32 rem = man & 0x1fffu;
    u32 out = sign | ((u32)e << 10) | hm;
    if (rem > 0x1000u || (rem == 0x1000u && (hm & 1u))) out++;
    return (u16)out;
}

// Round to nearest even, NaN kept quiet (as the `half` crate does).
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((x >> 16) | 0x40u);
    }
    u32 r = ((x >> 16) & 1u) + 0x7fffu;
    return (u16)((x + r) >> 16);
}

// Element i of a weight of dtype `dt`.
__device__ __forceinline__ float load_w(const void* p, int dt, u64 i) {
    if (dt == WT_BF16) return bf16_to_f32(((const u16*)p)[i]);
    if (dt == WT_F16) return f16_to_f32(((const u16*)p)[i]);
    return ((const float*)p)[i];
}

// The shared-memory address of a generic pointer into shared memory (for cp.async, bulk copies
// and mbarriers).
__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Waits until the phase of the mbarrier at `bar` with parity `parity` has completed (a copy's
// bytes landed and are visible, or the expected arrivals came). A parity wait cannot tell a phase
// from the one two later: a waiter must never run two phases ahead of the barrier.
__device__ __forceinline__ void mbar_wait_parity(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
#endif

// Programmatic dependent launch (sm_90): lets the next kernel of the stream start now if it was
// launched as a programmatic dependent (the q4 tensor-core GEMVs after their x prep: they stream
// their first weights, then `griddepcontrol.wait` for this grid's completion and memory before
// reading its output). A no-op for dependents launched normally, which wait for this grid's
// completion as usual.
// Before sm_90 there is no programmatic launch: nothing to do.
__device__ __forceinline__ void grid_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The other half: a kernel launched as a programmatic dependent waits here for the previous
// kernel's completion and memory before it touches anything that kernel (or any before it) wrote.
// A no-op for a kernel launched normally. The fused-prep producers (RMSNorms, SwiGLU, sigmoid
// gate) call it first thing, so the launcher starts them as dependents of the q4 GEMV before them
// (whose blocks trigger implicitly as they exit): their launch overlaps that GEMV's tail
// (KVSTREAM_PDL_PRODUCERS, backend-cuda/src/ops/pointwise.rs).
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- Integer x prep of the q4 tensor-core GEMVs (layouts documented in gemv_mma.cu) ----
// Each 128-value group of x is rounded to 22-bit integers with a power-of-two scale and split into
// three signed bytes in the fragment order the integer GEMVs read (`gemv_q4i8p*`: QI_U4 uint4 per
// group; the column-packed `gemv_q4i8c*` (COLS): QC_U4). The x-prep kernels (gemv_mma.cu) run it on
// x read from memory; the producers of a GEMV's input (norm.cu's RMSNorms, elementwise.cu's SwiGLU
// and sigmoid gate) run it on their own output in registers and write both (`prep` = PREP_I8C or
// PREP_I8C_NL, 0 = none), so a decode GEMV needs no x-prep launch. Same values in, same bytes out.
#define QI_M 8355711  // 0x7f7f7f
#define QI_U4 25      // uint4 per (token, group)
#define QC_U4 25      // uint4 per (token, group), column-packed layout (gemv_q4i8c*)

#define PREP_I8C 1     // producer x prep: the q4_g128 column-packed layout
#define PREP_I8C_NL 2  // producer x prep: the q4_nl_g128 column-packed layout

// One group: the calling warp holds it, lane l values 4l .. 4l + 3 in v (all 32 lanes call);
// writes the group's QC_U4 (COLS) or QI_U4 uint4 at dst.
template <bool NL, bool COLS>
__device__ __forceinline__ void q4i8_prep_group(const float4 v, uint4* __restrict__ dst, const int lane) {
    const bool bad = !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
    float am = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    const bool any_bad = __any_sync(0xffffffffu, bad);
    // am = f·2^e, f in [0.5, 1): xs = 2^(e - 22), x / xs = ldexpf(x, 22 - e) exactly.
    int e = 0;
    const bool scaled = am > 0.0f && !any_bad;
    if (scaled) frexpf(am, &e);
    const float xs = any_bad ? __int_as_float(0x7fc00000) : (scaled ? ldexpf(1.0f, e - 22) : 0.0f);
    const float vals[4] = {v.x, v.y, v.z, v.w};
    u32 part[3] = {0u, 0u, 0u};  // per part: b0 half (bytes of values 0, 2) | b1 half << 16 (1, 3)
    int s2 = 0, s10 = 0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int X = scaled ? __float2int_rn(ldexpf(vals[i], 22 - e)) : 0;
        X = X > QI_M ? QI_M : (X < -QI_M ? -QI_M : X);
        const int x0 = (int)(i8)(X & 0xff);
        const int r = (X - x0) >> 8;
        const int x1 = (int)(i8)(r & 0xff);
        const int x2 = (r - x1) >> 8;
        s2 += x2;
        s10 += X - 65536 * x2;
        const int sh = NL ? 8 * i : (i & 1 ? 16 : 0) + (i & 2 ? 8 : 0);
        part[0] |= (u32)(x0 & 0xff) << sh;
        part[1] |= (u32)(x1 & 0xff) << sh;
        part[2] |= (u32)(x2 & 0xff) << sh;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        s2 += __shfl_xor_sync(0xffffffffu, s2, o);
        s10 += __shfl_xor_sync(0xffffffffu, s10, o);
    }
    u32 other[3];
#pragma unroll
    for (int p = 0; p < 3; p++) other[p] = __shfl_xor_sync(0xffffffffu, part[p], 1);
    // Lane l holds k = 4l .. 4l + 3 of the group: tq = l / 8, wd = (l / 2) % 4, and the even lane
    // of a pair the first four of the 8-run (bytes j = 0, 1 of b0 and b1), its partner j = 2, 3.
    if ((lane & 1) == 0) {
        const int tq = lane >> 3, wd = (lane >> 1) & 3;
        u32 b0[3], b1[3];
#pragma unroll
        for (int p = 0; p < 3; p++) {
            if (NL) {
                b0[p] = part[p];
                b1[p] = other[p];
            } else {
                b0[p] = (part[p] & 0xffffu) | (other[p] << 16);
                b1[p] = (part[p] >> 16) | (other[p] & 0xffff0000u);
            }
        }
        if (COLS) {
            uint2* q = (uint2*)dst + wd * 12 + tq;
            q[0] = make_uint2(b0[1], b1[1]);  // part 0: x1
            q[4] = make_uint2(b0[0], b1[0]);  // part 1: x0
            q[8] = make_uint2(b0[2], b1[2]);  // part 2: x2
        } else {
            dst[wd * 4 + tq] = make_uint4(b0[2], b1[2], b0[1], b1[1]);
            ((uint2*)(dst + 16))[wd * 4 + tq] = make_uint2(b0[0], b1[0]);
        }
    }
    if (lane == 0) {
        if (COLS) {
            ((uint2*)dst)[48] = make_uint2(__float_as_uint(xs), NL ? 0u : (u32)(-8 * s10));
            ((uint2*)dst)[49] = make_uint2(__float_as_uint(xs * 65536.0f), NL ? 0u : (u32)(-8 * s2));
        } else {
            dst[24] = make_uint4(__float_as_uint(xs), NL ? 0u : (u32)(-8 * s2), NL ? 0u : (u32)(-8 * s10), 0u);
        }
    }
}

// A producer's x prep of group `group` (flat index: token · K/128 + group of the token) into xf.
// Warp-uniform; no-op for prep == 0.
__device__ __forceinline__ void q4c_prep_group(const int prep, const float4 v, uint4* __restrict__ xf, const u64 group,
                                               const int lane) {
    if (prep == PREP_I8C) q4i8_prep_group<false, true>(v, xf + group * QC_U4, lane);
    else if (prep == PREP_I8C_NL) q4i8_prep_group<true, true>(v, xf + group * QC_U4, lane);
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- Stream-K work split (gemv_mma.cu's q4 GEMV, linear.cu's gemv_sk) ----
// W warps take equal contiguous ranges of `work` items: warp w the items [qp_start(w), qp_start(w+1)).
// First item of warp w.
__device__ __forceinline__ u32 qp_start(u32 w, u32 W, u32 work) { return (u32)((u64)w * work / W); }

// The warp whose range holds item `item`: the largest w with w·work/W <= item.
__device__ __forceinline__ u32 qp_owner(u32 item, u32 W, u32 work) {
    return (u32)((((u64)item + 1) * W - 1) / work);
}

// ---- Stream-K partial-sum hand-off (the fix-ups of gemv_mma.cu's q4 GEMVs and linear.cu's gemv_sk) ----
// SK_FLAGS = 0: a warp stores its partial sums, fences (__threadfence) and counts itself in the
// unit's counter; the last to arrive fences again and loads the slots. A fence waits for the warp's
// outstanding loads too, so a range that publishes its first tile mid-range drains its weight
// ring there (ncu: membar stalls, session 16).
// SK_FLAGS = 1: no fences. A slot value is "empty" while it holds SK_EMPTY, a NaN bit pattern no
// float arithmetic produces (their NaNs are 0x7fffffff); publishers store with st.relaxed.gpu, the
// finisher (still chosen by the relaxed counter) loads with ld.relaxed.gpu, reloads a value that
// is still empty (its store has not landed yet: nothing orders it before the count any more), and
// puts SK_EMPTY back once it holds the value. Invariant: between launches every scratch value is
// SK_EMPTY (the launcher fills a new scratch buffer with 0xff bytes; every value a launch stores
// is taken by that launch's finisher), so a finisher never reads an older launch's value.
// SK_FLAGS = 2: no counters either. The finisher of a shared unit is its first warp w0 (the unit
// ends w0's range, so w0 reaches it last but for the skew between ranges of equal length); every
// later contributor stores its slot and goes on. A warp waits only for warps after it, so the grid
// (one wave: every block resident) cannot deadlock. sk_arrive picks the finisher for every level.
// Default: 2 on sm_90 (measured there: 27B q4_g128 decode -2.5% against 0 on an H100, session 19;
// the launchers size one resident wave from Hopper's 228 KiB of shared memory per SM), 0 elsewhere
// (no warp ever waits for another, so a grid that is not wholly resident stays correct).
#ifndef SK_FLAGS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define SK_FLAGS 2
#else
#define SK_FLAGS 0
#endif
#endif
#define SK_EMPTY 0xffffffffu

// Flag-free hand-off slots (the SK_FLAGS levels here, and the tile q4 GEMV's split ranges in
// gemv_mma.cu): a value is empty while it holds SK_EMPTY; the publisher stores with st.relaxed.gpu,
// the taker loads with ld.relaxed.gpu (slot_load, several in flight), reloads a value that is still
// empty (slot_settle), and puts SK_EMPTY back once it holds it. A value still missing after 2^28
// reloads (minutes) is a broken hand-off: trap (a CUDA error) rather than hang.
__device__ __forceinline__ void slot_put(float* p, float v) {
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(__float_as_uint(v)) : "memory");
}
__device__ __forceinline__ float slot_load(const float* p) {
    u32 v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p));
    return __uint_as_float(v);
}
__device__ __forceinline__ float slot_settle(float* p, float v) {
    u32 b = __float_as_uint(v);
    for (u32 tries = 0; b == SK_EMPTY; tries++) {
        if (tries == (1u << 28)) __trap();
        asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(b) : "l"(p));
    }
    asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(SK_EMPTY) : "memory");
    return __uint_as_float(b);
}

// Publisher: one partial-sum value into its slot.
__device__ __forceinline__ void sk_put(float* p, float v) {
#if SK_FLAGS
    slot_put(p, v);
#else
    *p = v;
#endif
}
// Publisher, between its slot stores and its count; finisher, between the count and its loads.
__device__ __forceinline__ void sk_fence() {
#if !SK_FLAGS
    __threadfence();
#endif
}
// After a warp's slot stores (and sk_fence, __syncwarp): is this warp the finisher of the unit
// shared by warps w0..w1 (its counter `counter`)? Levels 0 and 1: the last to count itself (it
// calls sk_finished when done); level 2: w0.
__device__ __forceinline__ bool sk_arrive(u32* counter, u32 gw, u32 w0, u32 w1, int lane) {
#if SK_FLAGS >= 2
    (void)counter;
    (void)w1;
    (void)lane;
    return gw == w0;
#else
    (void)gw;
    u32 prev = 0;
    if (lane == 0) prev = atomicAdd(counter, 1u);
    prev = __shfl_sync(0xffffffffu, prev, 0);
    return prev == w1 - w0;
#endif
}
// The finisher is done: levels 0 and 1 reset the unit's counter for the next launch.
__device__ __forceinline__ void sk_finished(u32* counter, int lane) {
#if SK_FLAGS < 2
    if (lane == 0) *counter = 0u;
#else
    (void)counter;
    (void)lane;
#endif
}
// Finisher: start loading a slot value (several go out before the first sk_settle).
__device__ __forceinline__ float sk_load(const float* p) {
#if SK_FLAGS
    return slot_load(p);
#else
    return __ldcg(p);
#endif
}
// Finisher: the value sk_load started, once it has landed; marks the slot value empty again.
__device__ __forceinline__ float sk_settle(float* p, float v) {
#if SK_FLAGS
    return slot_settle(p, v);
#else
    return v;
#endif
}

// The finisher of a tile shared by the warps w0..w1 (the q4 GEMVs' stream-K fix-up, gemv_mma.cu):
// s[j] = the sum over those warps, in warp order, of value j of each warp's scratch slot (NV
// values per lane, value j at j·32 + lane of a SLOT-float slot; warp w's slots at 2w and 2w + 1).
// Every warp after w0 starts its range inside the tile and published in its slot 0; w0 in slot s0
// (1 unless its range starts at the tile's first item). The loads go out B warps at a time (one L2
// round trip per batch rather than per warp); the adds keep warp order, so the sums do not
// depend on B. The loads and the hand-off: sk_load / sk_settle (SK_FLAGS above).
template <int NV, int B, unsigned SLOT>
__device__ __forceinline__ void sk_sum_slots(float* __restrict__ scratch, u32 w0, u32 w1, u32 s0, int lane,
                                             float* s) {
    auto slot = [&](u32 ow) { return scratch + ((u64)ow * 2 + (ow == w0 ? s0 : 0u)) * SLOT + lane; };
#pragma unroll
    for (int j = 0; j < NV; j++) s[j] = 0.0f;
    for (u32 ob = w0; ob <= w1; ob += B) {
        float q[B][NV];
#pragma unroll
        for (int k = 0; k < B; k++) {
            const u32 ow = ob + k;
            if (ow <= w1) {
#pragma unroll
                for (int j = 0; j < NV; j++) q[k][j] = sk_load(slot(ow) + j * 32);
            }
        }
#pragma unroll
        for (int k = 0; k < B; k++) {
            const u32 ow = ob + k;
            if (ow <= w1) {
#pragma unroll
                for (int j = 0; j < NV; j++) s[j] += sk_settle(slot(ow) + j * 32, q[k][j]);
            }
        }
    }
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, <= 1024). `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = 0.0f;
    for (int i = 0; i < nw; i++) t += scratch[i];
    return t;
}

// Value of element `j` of a KV head stored in `ty` at `p` (the head's first byte).
__device__ __forceinline__ float kv_load(const u8* p, int ty, int j) {
    switch (ty) {
    case KV_F16: return f16_to_f32(((const u16*)p)[j]);
    case KV_BF16: return bf16_to_f32(((const u16*)p)[j]);
    case KV_Q8_0: {
        const u8* b = p + (j / QK) * (2 + QK);
        float d = f16_to_f32((u16)(b[0] | ((u16)b[1] << 8)));
        return (float)(i8)b[2 + (j % QK)] * d;
    }
    case KV_Q4_0: {
        const u8* b = p + (j / QK) * (2 + QK / 2);
        float d = f16_to_f32((u16)(b[0] | ((u16)b[1] << 8)));
        int jj = j % QK;
        u8 q = b[2 + (jj % (QK / 2))];
        int v = jj < QK / 2 ? (q & 0x0f) : (q >> 4);
        return ((float)v - 8.0f) * d;
    }
    default: {
        const u8* e = p + 4 * j;
        return __uint_as_float((u32)e[0] | ((u32)e[1] << 8) | ((u32)e[2] << 16) | ((u32)e[3] << 24));
    }
    }
}

// ---- q4_nl_g128 code lookup (linear.cu, gemv_mma.cu) ----------------------------------------------
// The CUDA upload relabels every q4_nl_g128 code u to c = u with bits 2 and 3 swapped
// (backend-cuda ops/linear/q4nl.rs), so that codes c and c + 8 always index levels of one sign.
// Then one `prmt` per table half looks 4 codes up at once: selector nibble i = code c_i;
// prmt(T0, T1, sel) gives byte T01[c & 7] for c < 8 and, for c >= 8 (selector msb set), the sign
// of T01[c & 7] replicated; prmt(T2, T3, sel ^ 0x8888) the converse. With
// T01 = L[0..3], L[8..11] and T23 = ~L[4..7], L[12..15] (L = the level table), the XOR of the two
// is the int8 level L[swap23(c)] of every byte (tested on the CPU: q4nl.rs).
#define Q4NL_T0 0xC6B5A081u  // -127, -96, -75, -58
#define Q4NL_T1 0x2C1F1206u  //    6,  18,  31,  44
#define Q4NL_T2 0x05111E2Bu  // ~-44, ~-31, ~-18, ~-6
#define Q4NL_T3 0x7F604B3Au  //   58,  75,  96, 127

// prmt.b32 in its default mode (selector msb = replicate the selected byte's sign).
__device__ __forceinline__ u32 prmt_sx(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// The int8 levels of the 4 relabeled codes in selector nibbles 0..3 of `sel` (bytes 0..3).
__device__ __forceinline__ u32 q4nl_lookup4(u32 sel) {
    return prmt_sx(Q4NL_T0, Q4NL_T1, sel) ^ prmt_sx(Q4NL_T2, Q4NL_T3, sel ^ 0x8888u);
}
