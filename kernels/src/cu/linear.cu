// y[T, N] = x[T, K] · w[N, K]ᵀ with f32 accumulation. w is f32, f16, bf16 or one of the quantized
// layouts of docs (quant-spec): q8_0, q4_g128, fp8_e4m3 (quants row-major, then the scales at the
// 16-byte-aligned offset `soff`). Every kernel dequantises in registers to the EXACT value the
// CPU reference computes (f32(scale) · q, e4m3(q) · scale), then accumulates with explicit fmaf.

// Weight dtype codes beyond common.cuh's WT_F32/WT_F16/WT_BF16 (backend-cuda types.rs).
#define WT_Q8_0 3
#define WT_Q4G128 4
#define WT_F8E4M3 5
// q4_nl_g128: the q4_g128 layout, code c (relabeled at upload, common.cuh) → d · L[swap23(c)].
#define WT_Q4NL 6

#define GEMV_MAX_T 8
// GEMV: default rows per warp team (one x load feeds all of a team's rows).
#define GV_R 4

__device__ __forceinline__ u16 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ float ld_f32(const u8* p) { return *(const float*)p; }

// OCP E4M3 (bias 7, subnormals 2^-6·m/8) → f32, exact: the 7 magnitude bits placed under an f16
// exponent (bias 15) give value / 2^8 exactly, subnormals included; × 256 is exact.
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
    u16 h = (u16)(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
    return f16_to_f32(h) * 256.0f;
}

// Element (n, k) of a weight of dtype `dt` with K columns and scales at byte `soff` (quantized).
__device__ __forceinline__ float load_wq(const u8* w, int dt, u64 n, u64 k, u64 K, u64 soff) {
    switch (dt) {
    case WT_Q8_0: {
        float d = f16_to_f32(ld_u16(w + soff + 2 * (n * (K / 32) + k / 32)));
        return d * (float)(i8)w[n * K + k];
    }
    case WT_Q4G128: {
        float d = f16_to_f32(ld_u16(w + soff + 2 * (n * (K / 128) + k / 128)));
        u32 b = w[n * (K / 2) + k / 2];
        int u = (int)((k & 1) ? (b >> 4) : (b & 15u));
        return d * (float)(u - 8);
    }
    case WT_F8E4M3: {
        u64 g = (K + 127) / 128;
        return e4m3_to_f32(w[n * K + k]) * ld_f32(w + soff + 4 * (n * g + k / 128));
    }
    case WT_Q4NL: {
        float d = f16_to_f32(ld_u16(w + soff + 2 * (n * (K / 128) + k / 128)));
        u32 b = w[n * (K / 2) + k / 2];
        u32 c = (k & 1) ? (b >> 4) : (b & 15u);
        return d * (float)(i8)(q4nl_lookup4(c) & 0xffu);
    }
    default: return load_w(w, dt, n * K + k);
    }
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// ---- Vector decoders: one 16-byte chunk of a weight row → f32 values, 4 at a time. -------------
// Each format: EPC elements per chunk; `row_bytes(K)`; SB bytes per scale (0: none) and GROUP
// values per scale; `scale_off(n, c, K)` the byte offset (after `soff`) of the scale of chunk c of
// row n (one chunk never straddles a scale group); `prep` turns the scale into the constants
// `decode4` uses; `decode4(raw, sub, p, one, o)` writes elements 4·sub .. 4·sub+3 of the chunk
// (`one` = 0x3f800000 held in a register).
//
// Integer quants use the "magic float" trick, exact: f = 1 + u·2^-s is built by OR-ing the code u
// into the mantissa of 1.0f, then fmaf(f, d·2^s, -(2^s + bias)·d) = (u - bias)·d with ONE rounding
// of an exactly representable value (d has 11 significant bits, (2^s + bias) at most 13, so both
// constants are exact in f32), i.e. bit-identical to the CPU's f32(d) · q.
struct P0 {};
struct PQ8 { float m, c; };
struct PQ4 { float m15, c15, m11, c11; };
struct PF8 { float m; };

template <int FMT> struct Fmt;

template <> struct Fmt<WT_BF16> {
    static constexpr int SB = 0, GROUP = 1;
    static __device__ __forceinline__ u64 scale_off(u64, u64, u64) { return 0; }
    static constexpr int EPC = 8;
    typedef P0 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return 2 * K; }
    static __device__ __forceinline__ P prep(float) { return P0{}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P&, u32, float* o) {
        u32 a = word_of(r, 2 * sub), b = word_of(r, 2 * sub + 1);
        o[0] = __uint_as_float(a << 16);
        o[1] = __uint_as_float(a & 0xffff0000u);
        o[2] = __uint_as_float(b << 16);
        o[3] = __uint_as_float(b & 0xffff0000u);
    }
};

template <> struct Fmt<WT_F16> {
    static constexpr int SB = 0, GROUP = 1;
    static __device__ __forceinline__ u64 scale_off(u64, u64, u64) { return 0; }
    static constexpr int EPC = 8;
    typedef P0 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return 2 * K; }
    static __device__ __forceinline__ P prep(float) { return P0{}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P&, u32, float* o) {
        u32 a = word_of(r, 2 * sub), b = word_of(r, 2 * sub + 1);
        o[0] = f16_to_f32((u16)(a & 0xffffu));
        o[1] = f16_to_f32((u16)(a >> 16));
        o[2] = f16_to_f32((u16)(b & 0xffffu));
        o[3] = f16_to_f32((u16)(b >> 16));
    }
};

template <> struct Fmt<WT_F32> {
    static constexpr int SB = 0, GROUP = 1;
    static __device__ __forceinline__ u64 scale_off(u64, u64, u64) { return 0; }
    static constexpr int EPC = 4;
    typedef P0 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return 4 * K; }
    static __device__ __forceinline__ P prep(float) { return P0{}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int, const P&, u32, float* o) {
        o[0] = __uint_as_float(r.x);
        o[1] = __uint_as_float(r.y);
        o[2] = __uint_as_float(r.z);
        o[3] = __uint_as_float(r.w);
    }
};

// q8_0: 16 int8 per chunk (half a 32-group). Code byte b = q ^ 0x80 = q + 128 sits in mantissa
// bits 8..15 of 1.0f: f = 1 + b·2^-15, value = fmaf(f, d·2^15, -(2^15 + 128)·d) = q·d exactly.
template <> struct Fmt<WT_Q8_0> {
    static constexpr int EPC = 16;
    typedef PQ8 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return K; }
    static constexpr int SB = 2, GROUP = 32;
    static __device__ __forceinline__ u64 scale_off(u64 n, u64 c, u64 K) { return 2 * (n * (K / 32) + c / 2); }
    static __device__ __forceinline__ P prep(float d) { return PQ8{d * 32768.0f, d * -32896.0f}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P& p, u32 one, float* o) {
        u32 u = word_of(r, sub) ^ 0x80808080u;
        o[0] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7604)), p.m, p.c);
        o[1] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7614)), p.m, p.c);
        o[2] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7624)), p.m, p.c);
        o[3] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7634)), p.m, p.c);
    }
};

// q4_g128: 32 codes per chunk (a quarter of a 128-group); element e of a 32-bit word is the
// nibble at bits 4e (low nibble = even k). Nibbles are moved to mantissa bits 8..11 (s = 15) or
// 12..15 (s = 11) of 1.0f: f = 1 + u·2^-s, value = fmaf(f, d·2^s, -(2^s + 8)·d) = (u - 8)·d.
template <> struct Fmt<WT_Q4G128> {
    static constexpr int EPC = 32;
    typedef PQ4 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return K / 2; }
    static constexpr int SB = 2, GROUP = 128;
    static __device__ __forceinline__ u64 scale_off(u64 n, u64 c, u64 K) { return 2 * (n * (K / 128) + c / 4); }
    static __device__ __forceinline__ P prep(float d) {
        return PQ4{d * 32768.0f, d * -32776.0f, d * 2048.0f, d * -2056.0f};
    }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P& p, u32 one, float* o) {
        u32 v = word_of(r, sub >> 1);
        // sub even: elements 0..3 of the word (from v << 8 and v); odd: 4..7 (v >> 8, v >> 16).
        u32 a = (sub & 1) ? (v >> 8) : (v << 8);
        u32 b = (sub & 1) ? (v >> 16) : v;
        o[0] = fmaf(__uint_as_float((a & 0x00000f00u) | one), p.m15, p.c15);
        o[1] = fmaf(__uint_as_float((a & 0x0000f000u) | one), p.m11, p.c11);
        o[2] = fmaf(__uint_as_float((b & 0x00000f00u) | one), p.m15, p.c15);
        o[3] = fmaf(__uint_as_float((b & 0x0000f000u) | one), p.m11, p.c11);
    }
};

// q4_nl_g128: the q4_g128 chunk layout; elements 4·(sub & 1) .. +3 of word sub / 2 are the
// selector nibbles of one table lookup (common.cuh) giving the int8 levels L, then as q8_0: the
// byte L + 128 = L ^ 0x80 in mantissa bits 8..15 of 1.0f, fmaf(f, d·2^15, -(2^15 + 128)·d) = L·d
// exactly (the CPU's f32(d) · L).
template <> struct Fmt<WT_Q4NL> {
    static constexpr int EPC = 32;
    typedef PQ8 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return K / 2; }
    static constexpr int SB = 2, GROUP = 128;
    static __device__ __forceinline__ u64 scale_off(u64 n, u64 c, u64 K) { return 2 * (n * (K / 128) + c / 4); }
    static __device__ __forceinline__ P prep(float d) { return PQ8{d * 32768.0f, d * -32896.0f}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P& p, u32 one, float* o) {
        u32 v = word_of(r, sub >> 1);
        u32 u = q4nl_lookup4((sub & 1) ? (v >> 16) : v) ^ 0x80808080u;
        o[0] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7604)), p.m, p.c);
        o[1] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7614)), p.m, p.c);
        o[2] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7624)), p.m, p.c);
        o[3] = fmaf(__uint_as_float(__byte_perm(u, one, 0x7634)), p.m, p.c);
    }
};

// fp8_e4m3: 16 codes per chunk (an eighth of a 128-group). Two codes at a time become an f16x2
// (sign to bit 15, magnitude bits to 13..7: value / 2^8 exactly, subnormals included); then
// value · scale = f16 · (256 · scale), exact because 256 · scale is (scale = amax/448 < 2^120).
template <> struct Fmt<WT_F8E4M3> {
    static constexpr int EPC = 16;
    typedef PF8 P;
    static __device__ __forceinline__ u64 row_bytes(u64 K) { return K; }
    static constexpr int SB = 4, GROUP = 128;
    static __device__ __forceinline__ u64 scale_off(u64 n, u64 c, u64 K) { return 4 * (n * ((K + 127) / 128) + c / 8); }
    static __device__ __forceinline__ P prep(float s) { return PF8{s * 256.0f}; }
    static __device__ __forceinline__ void decode4(const uint4& r, int sub, const P& p, u32 one, float* o) {
        u32 v = word_of(r, sub);
        u32 t01 = __byte_perm(v, 0u, 0x1404), t23 = __byte_perm(v, 0u, 0x3424);
        u32 h01 = (t01 & 0x80008000u) | ((t01 >> 1) & 0x3f803f80u);
        u32 h23 = (t23 & 0x80008000u) | ((t23 >> 1) & 0x3f803f80u);
        o[0] = f16_to_f32((u16)(h01 & 0xffffu)) * p.m;
        o[1] = f16_to_f32((u16)(h01 >> 16)) * p.m;
        o[2] = f16_to_f32((u16)(h23 & 0xffffu)) * p.m;
        o[3] = f16_to_f32((u16)(h23 >> 16)) * p.m;
    }
};

// ---- Decode GEMV (T ≤ 8) -------------------------------------------------------------------------
// Blocks of GP_WARPS = 4 warps. `split` (1, 2 or 4; chosen by the launcher from the dtype, N and K
// only) warps form a team that owns R consecutive rows (R = 8 for TM ≤ 4, 4 for TM = 8); team
// member m, lane l handles the 16-byte chunks c = 32·m + l + 32·split·j (j = 0, 1, ...) of each of
// its R rows ("trip" j). The code chunks and 4-byte scale words travel through a per-warp ring of
// NS shared-memory stages with cp.async (L1 bypassed): NS - 1 trips (R × 16 bytes per lane, 4 KB
// per warp at R = 8) are in flight while one is computed, without holding them in registers.
// Each lane reads back only the bytes it copied itself, so cp.async.wait_group orders everything
// (no barrier). The x values of 8 consecutive elements (2 float4 per row t, L1-cached) are loaded
// together and used for all R rows; the weight is read once for all T rows. Known limit (ncu on
// the H200): lane l's x slice is EPC·4 bytes away from lane l+1's, so each x float4 load touches
// up to 32 L1 lines; at 4-bit codes (EPC = 32) this L1 traffic, not HBM, bounds the kernel.
//
// DETERMINISM / T-INDEPENDENCE (MTP verification compares rows across widths): the value of
// output (t, n) is, for every T in 1..=8 and every instance TM:
//   per lane: acc = 0; for its chunks c ascending, for elements e ascending: acc = fmaf(w, x, acc)
//   per warp: xor-butterfly warp_sum, lane 0's value;  per team: ((p_0 + p_1) + ...) + p_{split-1}.
// Nothing in that sequence depends on T or TM (t only selects which accumulator; rows t >= T of a
// wider instance recompute row 0 and are dropped), and the decoded weights are exact, so row t of a
// T-row call is bit-identical to a 1-row call.
#define GP_WARPS 4
#define GP_NS 4

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// One trip of a warp over R rows: lane `lane` decodes its staged 16-byte chunk of each row (`cs`:
// the stage's R × 32 chunks, `ss`: its scale words, R × 32 or R × 1) and accumulates it against
// the EPC x values at `xc` (+ xoff[t] per token): per row and token, elements ascending, one fmaf
// each. `par` bit r: row r's 2-byte scale is the high half of its staged word.
template <int FMT, int TM, int R>
__device__ __forceinline__ void gp_trip(float (&acc)[R][TM], const uint4* cs, const u32* ss, u32 par,
                                        const float* xc, const u64 (&xoff)[TM], u32 one, int lane) {
    typedef Fmt<FMT> F;
    constexpr int EPC = F::EPC, SW = F::SB ? 32 : 1;
    uint4 cur[R];
    typename F::P p[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        cur[r] = cs[r * 32 + lane];
        float d = 0.0f;
        if (F::SB == 2) {
            u32 v = ss[r * SW + (F::SB ? lane : 0)];
            d = f16_to_f32((u16)(((par >> r) & 1u) ? (v >> 16) : (v & 0xffffu)));
        } else if (F::SB == 4) {
            d = __uint_as_float(ss[r * SW + (F::SB ? lane : 0)]);
        }
        p[r] = F::prep(d);
    }
    constexpr int XG = EPC >= 8 ? 2 : 1;
#pragma unroll
    for (int g = 0; g < EPC / 4; g += XG) {
        float4 xv[TM][XG];
#pragma unroll
        for (int t = 0; t < TM; t++)
#pragma unroll
            for (int i = 0; i < XG; i++) xv[t][i] = __ldg((const float4*)(xc + xoff[t]) + g + i);
#pragma unroll
        for (int i = 0; i < XG; i++) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                float wv[4];
                F::decode4(cur[r], g + i, p[r], one, wv);
#pragma unroll
                for (int t = 0; t < TM; t++) {
                    float a = acc[r][t];
                    a = fmaf(wv[0], xv[t][i].x, a);
                    a = fmaf(wv[1], xv[t][i].y, a);
                    a = fmaf(wv[2], xv[t][i].z, a);
                    a = fmaf(wv[3], xv[t][i].w, a);
                    acc[r][t] = a;
                }
            }
        }
    }
}

template <int FMT, int TM, int R = GV_R, int NS = GP_NS, bool XC = false>
__device__ __forceinline__ void gemv_pipe(const float* __restrict__ x, const u8* __restrict__ w,
                                          float* __restrict__ y, int T, u64 K, u64 N, u64 soff, int split) {
    typedef Fmt<FMT> F;
    constexpr int EPC = F::EPC;
    __shared__ uint4 ring[GP_WARPS][NS][R][32];
    __shared__ u32 sring[GP_WARPS][NS][R][F::SB ? 32 : 1];
    __shared__ float red[GP_WARPS][R][TM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int member = warp % split, team = warp / split;
    const u64 row0 = ((u64)blockIdx.x * (GP_WARPS / split) + team) * R;
    const u64 nch = K / EPC, rb = F::row_bytes(K), stride = 32ull * split;
    const u32 one = 0x3f800000u | ((u32)split >> 8);
    float acc[R][TM];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < TM; t++) acc[r][t] = 0.0f;
    u64 xoff[TM];
#pragma unroll
    for (int t = 0; t < TM; t++) xoff[t] = t < T ? (u64)t * K : 0;
    const u64 c0 = (u64)member * 32 + lane;
    // Issue side: per row the code and scale-word pointers of the next trip, advanced by constant
    // steps (one trip = `stride` chunks; the scale index advances by stride·EPC/GROUP, a whole
    // number of 4-byte words, so the half-word parity of a row's 2-byte scales is fixed).
    const u8* wi[R];
    const u8* si[R];
    u32 par = 0;  // bit r: row r's 2-byte scale is the high half of its staged word
#pragma unroll
    for (int r = 0; r < R; r++) {
        u64 n = row0 + r < N ? row0 + r : N - 1;  // rows past N re-read row N-1, never stored
        wi[r] = w + n * rb + c0 * 16;
        u64 so = soff + F::scale_off(n, c0, K);
        si[r] = w + (so & ~3ull);
        par |= ((u32)(so >> 1) & 1u) << r;
    }
    const u64 wstep = stride * 16, sstep = F::SB ? stride * EPC / F::GROUP * F::SB : 0;
    // XC (q4_g128 with K % 1024 == 0, see "coalesced x" below): lane l's chunk lands in the
    // swizzled slot l ^ ((l >> 3) & 3), so the 2-byte reads of the compute loop are conflict-free.
    const int cslot = XC ? (lane ^ ((lane >> 3) & 3)) : lane;
    const u32 cbase = smem_addr(&ring[warp][0][0][cslot]), sbase = smem_addr(&sring[warp][0][0][F::SB ? lane : 0]);
    u64 ci = c0;
    int sti = 0;
    auto issue = [&]() {
        if (ci < nch) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                u32 d = cbase + (u32)((sti * R + r) * 32 * 16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(wi[r]) : "memory");
                if (F::SB) {
                    u32 e = sbase + (u32)((sti * R + r) * 32 * 4);
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(e), "l"(si[r]) : "memory");
                }
            }
        }
        cp_commit();
#pragma unroll
        for (int r = 0; r < R; r++) {
            wi[r] += wstep;
            si[r] += sstep;
        }
        ci += stride;
        sti = sti + 1 == NS ? 0 : sti + 1;
    };
#pragma unroll
    for (int j = 0; j < NS - 1; j++) issue();
    const float* xc = x + c0 * EPC;
    int st = 0;
    for (u64 c = c0; c < nch; c += stride, xc += stride * EPC, st = st + 1 == NS ? 0 : st + 1) {
        if constexpr (XC) {
            // Coalesced x (q4_g128 only; the launcher picks it when K % 1024 == 0, so every trip
            // of 32 chunks is whole and the loop condition is warp-uniform). Lanes read chunks
            // other lanes copied: the warp syncs before a stage is refilled (WAR) and after the
            // wait (RAW). Lane l = 4G + q works on the 128-group G of the trip (its own chunk's
            // scale group, so its staged scale serves all its values) and takes the 4-value
            // sub-words q, q + 4, ..., q + 28 of that group: at each step the warp's x float4
            // reads are 8 runs of 64 contiguous bytes instead of 32 lines 128 bytes apart.
            // Per-lane order: trips ascending, sub-words ascending, values ascending — a function
            // of K alone, so rows stay bit-identical for every T.
            __syncwarp();
            issue();
            cp_wait<NS - 1>();
            __syncwarp();
            const int G = lane >> 2, q = lane & 3;
            typename F::P p[R];
#pragma unroll
            for (int r = 0; r < R; r++) {
                u32 v = sring[warp][st][r][F::SB ? lane : 0];
                p[r] = F::prep(f16_to_f32((u16)(((par >> r) & 1u) ? (v >> 16) : (v & 0xffffu))));
            }
            const float* xt = xc - (u64)lane * EPC;
#pragma unroll
            for (int i = 0; i < EPC / 4; i++) {
                const int ch = 4 * G + (i >> 1);
                const int slot = ch ^ ((ch >> 3) & 3);
                const int hw = q + 4 * (i & 1);
                float4 xv[TM];
#pragma unroll
                for (int t = 0; t < TM; t++) xv[t] = __ldg((const float4*)(xt + xoff[t]) + 32 * G + q + 4 * i);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    const u32 v = ((const u16*)&ring[warp][st][r][slot])[hw];
                    const u32 a = v << 8;
                    float wv[4];
                    wv[0] = fmaf(__uint_as_float((a & 0x00000f00u) | one), p[r].m15, p[r].c15);
                    wv[1] = fmaf(__uint_as_float((a & 0x0000f000u) | one), p[r].m11, p[r].c11);
                    wv[2] = fmaf(__uint_as_float((v & 0x00000f00u) | one), p[r].m15, p[r].c15);
                    wv[3] = fmaf(__uint_as_float((v & 0x0000f000u) | one), p[r].m11, p[r].c11);
#pragma unroll
                    for (int t = 0; t < TM; t++) {
                        float acc_ = acc[r][t];
                        acc_ = fmaf(wv[0], xv[t].x, acc_);
                        acc_ = fmaf(wv[1], xv[t].y, acc_);
                        acc_ = fmaf(wv[2], xv[t].z, acc_);
                        acc_ = fmaf(wv[3], xv[t].w, acc_);
                        acc[r][t] = acc_;
                    }
                }
            }
            continue;
        }
        issue();
        cp_wait<NS - 1>();
        gp_trip<FMT, TM, R>(acc, &ring[warp][st][0][0], &sring[warp][st][0][0], par, xc, xoff, one, lane);
    }
    cp_wait<0>();
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int t = 0; t < TM; t++)
            if (t < T) acc[r][t] = warp_sum(acc[r][t]);
    if (split == 1) {
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int t = 0; t < TM; t++)
                    if (t < T && row0 + r < N) y[(u64)t * N + row0 + r] = acc[r][t];
        }
        return;
    }
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int t = 0; t < TM; t++) red[warp][r][t] = acc[r][t];
    }
    __syncthreads();
    if (member == 0) {
        for (int i = lane; i < R * TM; i += 32) {
            int r = i / TM, t = i % TM;
            if (t < T && row0 + r < N) {
                float s = red[warp][r][t];
                for (int m = 1; m < split; m++) s += red[warp + m][r][t];
                y[(u64)t * N + row0 + r] = s;
            }
        }
    }
}

#define GEMV_ARGS const float *x, const u8 *w, float *y, int T, u64 K, u64 N, u64 soff, int split
#define GEMV_PASS x, w, y, T, K, N, soff, split
// One instance per (dtype, TM): TM = 1 (plain decode), 4 (T 2..4), 8 (T 5..8). All instances of a
// dtype compute identical per-row results (see above): TM sizes the accumulators, R (rows per
// team) and NS (ring stages) only trade registers for in-flight bytes. Measured on the H200
// (variants of R ∈ {4, 8}, NS ∈ {2, 3, 4}): R = 8 with a 2-stage ring wins for TM = 1 and 4 (it
// halves the strided x reads per weight byte, which saturate L1 otherwise; 8 rows × 16 B per lane
// stay in flight); TM = 8 keeps R = 4 (register budget). Register caps: 4, 3, 2 blocks per SM
// (q4_g128: 3, 2, 2, measured faster than spilling at the tighter caps).
extern "C" __launch_bounds__(128, 4) __global__ void gemv_f32_t1(GEMV_ARGS) { gemv_pipe<WT_F32, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_f32_t4(GEMV_ARGS) { gemv_pipe<WT_F32, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_f32_t8(GEMV_ARGS) { gemv_pipe<WT_F32, 8, 4, 4>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_f16_t1(GEMV_ARGS) { gemv_pipe<WT_F16, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_f16_t4(GEMV_ARGS) { gemv_pipe<WT_F16, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_f16_t8(GEMV_ARGS) { gemv_pipe<WT_F16, 8, 4, 4>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_bf16_t1(GEMV_ARGS) { gemv_pipe<WT_BF16, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_bf16_t4(GEMV_ARGS) { gemv_pipe<WT_BF16, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_bf16_t8(GEMV_ARGS) { gemv_pipe<WT_BF16, 8, 4, 4>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_q8_0_t1(GEMV_ARGS) { gemv_pipe<WT_Q8_0, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_q8_0_t4(GEMV_ARGS) { gemv_pipe<WT_Q8_0, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q8_0_t8(GEMV_ARGS) { gemv_pipe<WT_Q8_0, 8, 4, 4>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_q4g128_t1(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4g128_t4(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4g128_t8(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 8, 4, 4>(GEMV_PASS); }
// q4_g128 with coalesced x reads (K % 1024 == 0; see XC in gemv_pipe): the decode-shape instances.
extern "C" __launch_bounds__(128, 3) __global__ void gemv_q4g128x_t1(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 1, 8, 2, true>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4g128x_t4(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 4, 8, 2, true>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4g128x_t8(GEMV_ARGS) { gemv_pipe<WT_Q4G128, 8, 4, 4, true>(GEMV_PASS); }
// q4_nl_g128: the q4_g128 instance shapes (no coalesced-x variant).
extern "C" __launch_bounds__(128, 3) __global__ void gemv_q4nl_t1(GEMV_ARGS) { gemv_pipe<WT_Q4NL, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4nl_t4(GEMV_ARGS) { gemv_pipe<WT_Q4NL, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_q4nl_t8(GEMV_ARGS) { gemv_pipe<WT_Q4NL, 8, 4, 4>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_f8e4m3_t1(GEMV_ARGS) { gemv_pipe<WT_F8E4M3, 1, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 3) __global__ void gemv_f8e4m3_t4(GEMV_ARGS) { gemv_pipe<WT_F8E4M3, 4, 8, 2>(GEMV_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_f8e4m3_t8(GEMV_ARGS) { gemv_pipe<WT_F8E4M3, 8, 4, 4>(GEMV_PASS); }

// ---- Stream-K decode GEMV (T ≤ 8): `gemv_sk_*` ---------------------------------------------------
// gemv_pipe's blocks own whole row teams, so when the blocks do not divide evenly over the SMs the
// last wave runs partly empty (17408 × 5120 bf16: 4.12 waves at split 4). Here the grid is one
// fixed set of W = gridDim.x · GP_WARPS warps (the launcher: SMs × SK blocks per SM, a function of
// the device only, the same for every T and instance) and the work is cut evenly between them.
//
// Work items: (unit u of SK_R = 8 consecutive rows, trip j), item i = u·TR + j, TR = ceil(nch / 32)
// trips per unit; trip j of a unit is chunk 32·j + lane of each of its rows for lane `lane` (lanes
// past the row end on the last trip skip it). Warp w takes the items [qp_start(w), qp_start(w+1))
// (common.cuh) and streams them, unit after unit, through its cp.async ring exactly as gemv_pipe
// streams its trips: the issue cursor runs NS - 1 steps ahead of the compute cursor across unit
// boundaries, so the ring stays full. An instance holds RH ≤ 8 rows in registers: with RH < 8 a
// warp walks its part of each unit SK_R / RH times, rows [h·RH, (h+1)·RH) in pass h (the weight
// is still read once; each row's accumulation is unchanged).
//
// A unit wholly inside one warp's range is stored directly. A unit shared by warps w0 < ... < w1
// (consecutive; every warp holds at least one item, the launcher ensures work ≥ W) is finished by
// the last to arrive: each writes its warp-reduced partial sums (SK_R × 8 floats) to its scratch
// slot (slot 0 for the first unit of its range, 1 for the last), fences (sk_fence; the hand-off
// without fences under SK_FLAGS, common.cuh), and counts itself in the unit's counter; the warp
// that completes the count adds the partials in warp order ((p_w0 + p_w0+1) + ...) + p_w1, stores, and resets the counter to 0 (the launcher zeroes the
// counters once; every launch leaves them zero) — the scheme of gemv_mma.cu's q4mmap_body.
//
// DETERMINISM / T-INDEPENDENCE: output (t, n) is, for every T in 1..=8 and every instance,
//   per warp w0..w1 holding part of n's unit, per lane: acc = 0; its chunks of that part ascending,
//   elements ascending, acc = fmaf(w, x, acc); then warp_sum; then the partials in warp order.
// The split depends on N, K, the dtype (chunk size) and W only; T and TM only pick accumulators
// (dead tokens t ≥ T re-read token 0 and are never stored), RH only the pass; so row t of a T-row
// call is bit-identical to a 1-row call.
#define SK_R 8
#define SK_SLOT (SK_R * GEMV_MAX_T)

template <int FMT, int TM, int RH, int NS>
__device__ __forceinline__ void gemv_sk(const float* __restrict__ x, const u8* __restrict__ w,
                                        float* __restrict__ y, int T, u64 K, u64 N, u64 soff,
                                        float* __restrict__ scratch, u32* __restrict__ counters) {
    typedef Fmt<FMT> F;
    constexpr int EPC = F::EPC, H = SK_R / RH, SW = F::SB ? 32 : 1;
    static_assert(SK_R % RH == 0, "RH divides the unit");
    __shared__ uint4 ring[GP_WARPS][NS][RH][32];
    __shared__ u32 sring[GP_WARPS][NS][RH][SW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 nch = K / EPC, rb = F::row_bytes(K);
    const u32 TR = (u32)((nch + 31) / 32);
    const u32 units = (u32)((N + SK_R - 1) / SK_R);
    const u32 work = units * TR;  // the launcher keeps it below 2^31
    const u32 W = gridDim.x * GP_WARPS, gw = blockIdx.x * GP_WARPS + warp;
    const u32 i0 = qp_start(gw, W, work), i1 = qp_start(gw + 1, W, work);
    if (i0 >= i1) return;
    const u32 first_unit = i0 / TR;
    const u32 one = 0x3f800000u | ((u32)T >> 8);  // 1.0f, opaque to the compiler (T ≤ 8)
    // Trips [lo, hi) of unit u inside this warp's range.
    auto seg_lo = [&](u32 u) { const u32 b = u * TR; return (i0 > b ? i0 : b) - b; };
    auto seg_hi = [&](u32 u) { const u32 b = u * TR; return (i1 < b + TR ? i1 : b + TR) - b; };
    // Scale-word parity of rows [u·SK_R + h·RH, + RH) at chunk c (fixed along a pass: one trip
    // advances the scale offset by a whole number of 4-byte words).
    auto parity = [&](u32 u, u32 h, u64 c) {
        u32 par = 0;
        if (F::SB == 2) {
#pragma unroll
            for (int r = 0; r < RH; r++) {
                const u64 n0 = (u64)u * SK_R + h * RH + r, n = n0 < N ? n0 : N - 1;
                par |= ((u32)((soff + F::scale_off(n, c, K)) >> 1) & 1u) << r;
            }
        }
        return par;
    };
    float acc[RH][TM];
#pragma unroll
    for (int r = 0; r < RH; r++)
#pragma unroll
        for (int t = 0; t < TM; t++) acc[r][t] = 0.0f;
    u64 xoff[TM];
#pragma unroll
    for (int t = 0; t < TM; t++) xoff[t] = t < T ? (u64)t * K : 0;

    // Issue cursor: unit iu, pass ih, trip ij of [.., ije); per-row code and scale-word pointers.
    u32 iu = first_unit, ih = 0, ij = seg_lo(iu), ije = seg_hi(iu);
    u32 ileft = (i1 - i0) * H;  // steps not yet issued
    const u8* wi[RH];
    const u8* si[RH];
    auto bases = [&]() {
        const u64 c = (u64)ij * 32 + lane;
#pragma unroll
        for (int r = 0; r < RH; r++) {
            const u64 n0 = (u64)iu * SK_R + ih * RH + r, n = n0 < N ? n0 : N - 1;  // past N: row N-1
            wi[r] = w + n * rb + c * 16;
            si[r] = w + ((soff + F::scale_off(n, c, K)) & ~3ull);
        }
    };
    bases();
    const u64 wstep = 32 * 16, sstep = F::SB ? 32 * EPC / F::GROUP * F::SB : 0;
    const u32 cbase = smem_addr(&ring[warp][0][0][lane]), sbase = smem_addr(&sring[warp][0][0][F::SB ? lane : 0]);
    int sti = 0;
    auto issue = [&]() {
        if (ileft > 0) {
            if ((u64)ij * 32 + lane < nch) {
#pragma unroll
                for (int r = 0; r < RH; r++) {
                    const u32 d = cbase + (u32)((sti * RH + r) * 32 * 16);
                    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(wi[r]) : "memory");
                    if (F::SB) {
                        const u32 e = sbase + (u32)((sti * RH + r) * SW * 4);
                        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(e), "l"(si[r]) : "memory");
                    }
                }
            }
            ileft--;
            if (++ij == ije) {
                if (++ih == H) {
                    ih = 0;
                    iu++;
                }
                if (ileft > 0) {
                    ij = seg_lo(iu);
                    ije = seg_hi(iu);
                    bases();
                }
            } else {
#pragma unroll
                for (int r = 0; r < RH; r++) {
                    wi[r] += wstep;
                    si[r] += sstep;
                }
            }
        }
        cp_commit();
        sti = sti + 1 == NS ? 0 : sti + 1;
    };
#pragma unroll
    for (int j = 0; j < NS - 1; j++) issue();

    // Compute cursor: unit cu, pass ch, trip cj of [.., cje).
    u32 cu = first_unit, ch = 0, cj = seg_lo(cu), cje = seg_hi(cu);
    u32 par = parity(cu, ch, (u64)cj * 32 + lane);
    int st = 0;
    for (u32 left = (i1 - i0) * H; left > 0; left--) {
        issue();
        cp_wait<NS - 1>();
        const u64 c = (u64)cj * 32 + lane;
        if (c < nch)
            gp_trip<FMT, TM, RH>(acc, &ring[warp][st][0][0], &sring[warp][st][0][0], par, x + c * EPC, xoff, one,
                                 lane);
        st = st + 1 == NS ? 0 : st + 1;
        if (++cj < cje) continue;
        // Pass ch of unit cu done: reduce, then store (whole unit) or stage the partial.
#pragma unroll
        for (int r = 0; r < RH; r++)
#pragma unroll
            for (int t = 0; t < TM; t++)
                if (t < T) acc[r][t] = warp_sum(acc[r][t]);
        const u32 ub = cu * TR;
        const bool whole = ub >= i0 && ub + TR <= i1;
        const u64 row0 = (u64)cu * SK_R + ch * RH;
        float* mine = scratch + ((u64)gw * 2 + (cu == first_unit ? 0 : 1)) * SK_SLOT;
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < RH; r++)
#pragma unroll
                for (int t = 0; t < TM; t++) {
                    if (t >= T) continue;
                    if (row0 + r >= N) continue;  // stored only where the finisher takes it (SK_FLAGS)
                    if (!whole)
                        sk_put(mine + (ch * RH + r) * GEMV_MAX_T + t, acc[r][t]);
                    else
                        y[(u64)t * N + row0 + r] = acc[r][t];
                }
        }
#pragma unroll
        for (int r = 0; r < RH; r++)
#pragma unroll
            for (int t = 0; t < TM; t++) acc[r][t] = 0.0f;
        if (++ch == H) {
            if (!whole) {
                sk_fence();
                __syncwarp();
                const u32 w0 = qp_owner(ub, W, work), w1 = qp_owner(ub + TR - 1, W, work);
                if (sk_arrive(&counters[cu], gw, w0, w1, lane)) {
                    // The finisher: add the partials in warp order.
                    sk_fence();
                    for (int i = lane; i < SK_R * TM; i += 32) {
                        const int r = i / TM, t = i % TM;
                        const u64 row = (u64)cu * SK_R + r;
                        if (t < T && row < N) {
                            float s = 0.0f;
                            for (u32 ow = w0; ow <= w1; ow++) {
                                const u32 oslot = cu == qp_start(ow, W, work) / TR ? 0 : 1;
                                float* src = scratch + ((u64)ow * 2 + oslot) * SK_SLOT + r * GEMV_MAX_T + t;
                                const float p = sk_settle(src, sk_load(src));
                                s = ow == w0 ? p : s + p;
                            }
                            y[(u64)t * N + row] = s;
                        }
                    }
                    sk_finished(&counters[cu], lane);
                }
            }
            ch = 0;
            cu++;
        }
        if (left > 1) {
            cj = seg_lo(cu);
            cje = seg_hi(cu);
            par = parity(cu, ch, (u64)cj * 32 + lane);
        }
    }
    cp_wait<0>();
}

#define GEMV_SK_ARGS                                                                                  \
    const float *x, const u8 *w, float *y, int T, u64 K, u64 N, u64 soff, float *scratch, u32 *counters
#define GEMV_SK_PASS x, w, y, T, K, N, soff, scratch, counters
// Instances: TM = 1, 4, 8 as gemv_pipe's (same per-row results for every TM and RH, see above).
// Every instance is launched with the same grid (SMs × 4 blocks, SK_BLOCKS_PER_SM in
// sk_plan.rs), so the _t1 and _t4 instances are capped at 128 registers (4 blocks of 128 threads
// per SM: one wave; NVRTC 13 / sm_90: 89–128 registers, no spills; q8_0 and fp8 _t4 hold 4 rows
// in a 3-stage ring to fit). The _t8 instances keep gemv_pipe's 2 blocks per SM and run the grid
// in exactly two full waves.
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f32_t1(GEMV_SK_ARGS) { gemv_sk<WT_F32, 1, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f32_t4(GEMV_SK_ARGS) { gemv_sk<WT_F32, 4, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_sk_f32_t8(GEMV_SK_ARGS) { gemv_sk<WT_F32, 8, 4, 4>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f16_t1(GEMV_SK_ARGS) { gemv_sk<WT_F16, 1, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f16_t4(GEMV_SK_ARGS) { gemv_sk<WT_F16, 4, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_sk_f16_t8(GEMV_SK_ARGS) { gemv_sk<WT_F16, 8, 4, 4>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_bf16_t1(GEMV_SK_ARGS) { gemv_sk<WT_BF16, 1, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_bf16_t4(GEMV_SK_ARGS) { gemv_sk<WT_BF16, 4, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_sk_bf16_t8(GEMV_SK_ARGS) { gemv_sk<WT_BF16, 8, 4, 4>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_q8_0_t1(GEMV_SK_ARGS) { gemv_sk<WT_Q8_0, 1, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_q8_0_t4(GEMV_SK_ARGS) { gemv_sk<WT_Q8_0, 4, 4, 3>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_sk_q8_0_t8(GEMV_SK_ARGS) { gemv_sk<WT_Q8_0, 8, 4, 4>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f8e4m3_t1(GEMV_SK_ARGS) { gemv_sk<WT_F8E4M3, 1, 8, 2>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 4) __global__ void gemv_sk_f8e4m3_t4(GEMV_SK_ARGS) { gemv_sk<WT_F8E4M3, 4, 4, 3>(GEMV_SK_PASS); }
extern "C" __launch_bounds__(128, 2) __global__ void gemv_sk_f8e4m3_t8(GEMV_SK_ARGS) { gemv_sk<WT_F8E4M3, 8, 4, 4>(GEMV_SK_PASS); }

// Fallback GEMV for rows that are not 16-byte chunkable (K not a multiple of the chunk): one warp
// per output row, lane l reads k = l, l + 32, ...; same T-independence argument (per-lane order is
// k ascending, then warp_sum).
extern "C" __global__ void gemv_scalar(const float* x, const u8* w, int dt, float* y, int T, u64 K, u64 N,
                                       u64 soff) {
    int lane = threadIdx.x & 31;
    u64 n = blockIdx.x * (u64)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    float acc[GEMV_MAX_T];
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.0f;
    for (u64 k = lane; k < K; k += 32) {
        float wv = load_wq(w, dt, n, k, K, soff);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++)
            if (t < T) acc[t] = fmaf(wv, x[t * K + k], acc[t]);
    }
#pragma unroll
    for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[t * N + n] = s;
        }
    }
}

// ---- Prefill GEMM (T > 8) ------------------------------------------------------------------------
// 64×64 output tile per block of 256 threads, 4×4 outputs per thread, K step 16; the weight-tile
// loader dequantises any dtype (exact values, as the GEMV).
#define GT 64
#define GK 16
extern "C" __global__ void gemm_f32out(const float* x, const u8* w, int dt, float* y, u64 T, u64 K, u64 N,
                                       u64 soff) {
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
            ws[kk][r] = (gn < N && gk < K) ? load_wq(w, dt, gn, gk, K, soff) : 0.0f;
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
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
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

// ---- Embedding rows of a table in any dtype (quantized tables dequantise the requested rows) ----
// out[i, h] = table[ids[i], h], exactly the CPU's dequantised value.
extern "C" __global__ void embedding_rows_q(const u8* table, int dt, const u32* ids, u64 n_ids, u64 hidden,
                                            u64 soff, float* out) {
    for (u64 i = blockIdx.y; i < n_ids; i += gridDim.y) {
        u64 row = ids[i];
        for (u64 h = blockIdx.x * (u64)blockDim.x + threadIdx.x; h < hidden; h += (u64)gridDim.x * blockDim.x)
            out[i * hidden + h] = load_wq(table, dt, row, h, hidden, soff);
    }
}

// ---- Prefill GEMM through cuBLAS (backend-cuda ops/linear/gemm.rs): split bf16 operands ---------
// Split precision for the cuBLAS prefill GEMM: v = hi + lo + r with hi = bf16(v) and
// lo = bf16(v - hi) (both nearest even), |r| <= 2^-16 |v| (16 significant bits in all).
__device__ __forceinline__ void split_bf16(float v, u16* hi, u16* lo, u64 i) {
    const u16 h = f32_to_bf16(v);
    hi[i] = h;
    lo[i] = f32_to_bf16(v - __uint_as_float((u32)h << 16));
}

// x (f32, n values) -> hi, lo (bf16 each).
extern "C" __global__ void f32_to_bf16x2_rows(const float* x, u16* hi, u16* lo, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        split_bf16(x[i], hi, lo, i);
}

// A tile of weight rows -> hi, lo (bf16): hi[r * K + k] + lo[r * K + k] = w[row0 + r, k] to 16
// significant bits, where w[n, k] is load_wq's value (the CPU's exact dequantised value; bf16
// weights never come here, they are exact as stored). Grid: x strides over k, y over the rows
// (the caller keeps row0 + rows <= N).
extern "C" __global__ void dequant_rows_bf16x2(const u8* w, int dt, u64 row0, u64 rows, u64 K, u64 soff,
                                               u16* hi, u16* lo) {
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        u64 n = row0 + r;
        for (u64 k = blockIdx.x * (u64)blockDim.x + threadIdx.x; k < K; k += (u64)gridDim.x * blockDim.x)
            split_bf16(load_wq(w, dt, n, k, K, soff), hi, lo, r * K + k);
    }
}
