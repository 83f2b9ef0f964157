// Streamed attention over span plans: one walk in token order, one final combine.
//
// Split ownership (both accumulate kernels): the evaluation's tokens are cut into 64-token chunks
// (chunk c = tokens [64c, min(64c + 64, total))) dealt round robin over a FIXED number of splits
// n_splits (chosen from the shape only, n_splits <= number of chunks): split s owns the chunks
// c with c % n_splits == s, INTERLEAVED, so any span of >= 64 * n_splits tokens keeps every split
// (block) busy — a streamed ring wave fills the GPU as well as a resident walk. Each split keeps its
// own (max, sum, acc[head_dim]) per query row in the state tensor
// [n_splits, width, q_heads, head_dim + 2] and walks its chunks in increasing token order, each in
// fixed units aligned to their own size (a unit never straddles a span: spans start on page
// boundaries and units divide both 64 and the page size). The launch that processes a split's
// first token (token 64s, in chunk s) starts that split's state fresh (max = -inf, sum = 0,
// acc = 0); later launches continue it from global memory (f32, exact); a launch whose span holds
// none of a split's tokens leaves the block at once without touching its state. So the arithmetic
// depends only on token indices, never on how tokens are spread over resident pages, ring slots or
// waves: streamed == resident bit for bit. attn_finish combines the splits once.
//
// Scores live in the log2 domain (the scale passed in is softmax_scale * log2(e)) and use exp2f;
// the state's max is therefore a log2-domain max, which attn_finish also uses.

struct AttnGeo {
    int q_heads, kv_heads, head_dim, width, total;
    float scale_log2;
    int k_type, v_type, tpp;
    u64 page_bytes, k_row_bytes, v_row_bytes, k_head_bytes, v_head_bytes, v_plane_off;
};

// ------------------------------------------------------------------------------------------------
// Generic path (every K/V format pair, any width, any head_dim / group size that fits).
//
// Grid: (kv_heads, n_splits, ceil(width / 4)); block: 256 threads. One block reads each K/V unit once
// for all query heads of its GQA group and up to 4 queries. Dynamic shared memory:
// qs[R][D] ks[U][D+1] (padded: no bank conflicts) vs[U][D] acc[R][D] sc[R][U] m[R] l[R] alpha[R],
// R = group * qw.

#define ATT_QW 4
#define ATT_CHUNK 64

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
    // This split's chunks inside this span: chunks [clo, chi) hold the span's tokens
    // [span_first, end); the split's first one is cfirst (block-uniform: an empty block leaves at
    // once, state untouched). A chunk may straddle spans when pages hold < 64 tokens.
    const int end = min(span_first + span_count, geo.total);
    if (end <= span_first) return;
    const int clo = span_first / ATT_CHUNK;
    const int chi = (end + ATT_CHUNK - 1) / ATT_CHUNK;
    const int cfirst = clo + (split - clo % n_splits + n_splits) % n_splits;
    if (cfirst >= chi) return;
    // Fresh iff this launch processes the split's first token, 64 * split.
    const bool fresh = max(cfirst * ATT_CHUNK, span_first) == split * ATT_CHUNK;
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
    // Row r <-> query qi0 + r / G, head kvh * G + r % G.
    for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
        int r = e / D, d = e % D;
        int qi = qi0 + r / G, head = kvh * G + r % G;
        qs[e] = q[((u64)qi * geo.q_heads + head) * D + d];
        const float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        acc[e] = fresh ? 0.0f : st[2 + d];
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) {
        int qi = qi0 + r / G, head = kvh * G + r % G;
        const float* st = state + (((u64)split * geo.width + qi) * geo.q_heads + head) * rowlen;
        mrow[r] = fresh ? NEG_INF : st[0];
        lrow[r] = fresh ? 0.0f : st[1];
    }
    __syncthreads();
    // The split's chunks in token order, each in units of U tokens; every unit start is a multiple
    // of U (chunk starts are multiples of 64, span_first of the page size, and U divides both).
    for (int c = cfirst; c < chi; c += n_splits) {
        const int ulo = max(c * ATT_CHUNK, span_first);
        const int uhi = min(c * ATT_CHUNK + ATT_CHUNK, end);
        for (int u0 = ulo; u0 < uhi; u0 += U) {
            const int cnt = min(U, uhi - u0);
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
            // Scores (log2 domain) with the causal mask: query qi sees tokens <= total - width + qi.
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
                    s = dot * geo.scale_log2;
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
                float alpha = mo == NEG_INF ? 0.0f : exp2f(mo - mn);
                float sum = 0.0f;
                for (int j = 0; j < U; j++) {
                    float s = sc[r * U + j];
                    float p = s == NEG_INF ? 0.0f : exp2f(s - mn);
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

// ------------------------------------------------------------------------------------------------
// Fast path: Q8_0 K / Q4_0 V, head_dim in {64, 128, 256}, pages of >= 64 tokens, R <= 32 query
// rows per block: decode/verification (width <= 4, R = group * width, one query tile) and prefill
// (grid z = query tiles of qt = 32 / group queries; a tile stops at its causal bound). Tensor cores (mma.sync m16n8k16, f16
// inputs, f32 accumulation) with exact operands:
//
// * Q8_0 K values are int8 (exact in f16); the query (times scale * log2 e) is split into
//   hi = f16(x) and lo = f16(x - hi) (about 22 significant bits) and both are multiplied, so
//   S = sum_b kscale(t, b) * (Kint8_b . (Qhi + Qlo)_b) in f32 (one accumulator per 32-value block,
//   scaled by the block's K scale).
// * Q4_0 V values (nibble - 8) are exact in f16; the block's V scale folds into the probabilities:
//   B = p * vscale(t, b), split hi/lo the same way.
//
// Grid: (kv_heads, n_splits, query tiles); block: 128 threads = 4 warps; one block = one (KV head, split) and all
// R query rows of the group, so each K/V byte is read from HBM once for all queries. The split's
// chunks (every n_splits-th 64-token chunk, 64-aligned, inside one page) are walked in token order
// with cp.async, K double buffered and V single buffered (smaller blocks: 4 per SM at width 1):
//
//   wait K(c), V(c - 1) done; sync; issue V(c) (c > 0) into the V buffer, K(c+1) into the other
//                  K buffer (two commit groups);
//   phase 1 (QK):  warp w: tokens 16w..16w+15 of the chunk x all rows -> scores sS[row][token]
//   sync
//   phase 2 (softmax): warp w, lane (rs = lane/4, part = lane%4): row 8w+rs, tokens part+4i;
//                  new max, alpha, p = exp2(s - max), sum; P overwrites S; state m, l, alpha in smem
//   wait V(c) (all but the newest group); sync
//   phase 3 (PV):  warp w: dims [w*D/4, (w+1)*D/4) x all rows, over the 64 tokens;
//                  acc (registers, MMA layout) = acc * alpha + V^T P^T
//
// Every step is a fixed function of the chunk's token indices and contents, processed in token
// order, so layout independence holds exactly as for the generic path.
//
// Dynamic shared memory (bytes): kbuf[2][64][KHB] vbuf[64][VHB] qf[D/16][NT][32] (uint4)
// sS[8·NT][FA_SROW] (f32) sM[32] sL[32] sA[32] bars[3] (u64, FA_TMA; 32 bytes)  (KHB = D/32*34,
// VHB = D/32*18, NT = ceil(R/8)); FA_PIPE adds sS2[8·NT][FA_SROW] (f32) after the barriers.

#define FA_CHUNK 64
#define FA_THREADS 128
#define FA_ROWS 32
#define FA_SROW 68

__device__ __forceinline__ void fa_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void fa_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Waits for all but the newest commit group.
__device__ __forceinline__ void fa_wait_but_newest() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// Packs f16(lo_val) into the low half and f16(hi_val) into the high half (round to nearest even).
__device__ __forceinline__ u32 fa_pack(float lo_val, float hi_val) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_val), "f"(lo_val));
    return r;
}

__device__ __forceinline__ u32 fa_hsub2(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// x0, x1 -> hi = f16x2(x0, x1), lo = f16x2(x0 - hi0, x1 - hi1): hi + lo carries ~22 bits of x.
__device__ __forceinline__ void fa_split(float x0, float x1, u32& hi, u32& lo) {
    hi = fa_pack(x0, x1);
    float h0 = f16_to_f32((u16)(hi & 0xffffu));
    float h1 = f16_to_f32((u16)(hi >> 16));
    lo = fa_pack(x0 - h0, x1 - h1);
}

// Two consecutive int8 values at p (2-byte aligned) as an exact f16x2 (first value in the low half):
// f16(1024 + (x ^ 0x80)) - 1152 == x.
__device__ __forceinline__ u32 fa_q8x2(const u8* p) {
    const u32 w = (u32)(*(const u16*)p) ^ 0x8080u;
    // bytes [x0 ^ 0x80, 0x64, x1 ^ 0x80, 0x64] = f16x2(1024 + (x0 ^ 0x80), 1024 + (x1 ^ 0x80)).
    const u32 h = __byte_perm(w, 0x64646464u, 0x4140);
    return fa_hsub2(h, 0x64806480u);
}

// Q4_0 bytes y0 (token t) and y1 (token t+1): lo = exact f16x2 (low(y0) - 8, low(y1) - 8),
// hi = (high(y0) - 8, high(y1) - 8), using f16(1024 + n) - 1032 == n - 8 and, for the high nibble
// in place (no shift), f16(1024 + 16n) / 16 - 72 == n - 8 (one exact fma) for n in 0..15.
__device__ __forceinline__ void fa_q4p(u32 p, u32& lo, u32& hi) {
    lo = fa_hsub2((p & 0x000f000fu) | 0x64006400u, 0x64086408u);
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(hi) : "r"((p & 0x00f000f0u) | 0x64006400u), "r"(0x2c002c00u),
        "r"(0xd480d480u));
}
// Byte 0 of y0 and of y1 (bytes 0 and 2 of the perm; the others are ignored).
__device__ __forceinline__ void fa_q4pair(u32 y0, u32 y1, u32& lo, u32& hi) {
    fa_q4p(__byte_perm(y0, y1, 0x5410), lo, hi);
}
// Byte 1 of y0 and of y1.
__device__ __forceinline__ void fa_q4pair_b1(u32 y0, u32 y1, u32& lo, u32& hi) {
    fa_q4p(__byte_perm(y0, y1, 0x7531), lo, hi);
}

// 2^x (MUFU.EX2; results below 2^-126 flush to 0, exp2f's denormal handling is not needed here).
__device__ __forceinline__ float fa_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float fa_f16(const u8* p) { return f16_to_f32(*(const u16*)p); }

// D (f32x4) += A (f16 16x16, row) * B (f16 16x8, col).
__device__ __forceinline__ void fa_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// FA_TMA (NVRTC define, default 1; sm_90 and later; measured on an H100 in session 19: 64 Ki
// accumulate width 1 49.0 -> 46.6 us, width 4 93.1 -> 78.9 us): each chunk's K and V tiles arrive as one
// tensor copy each (cp.async.bulk.tensor.3d, Hopper's TMA unit) issued by one thread, completion
// counted in bytes on an mbarrier per buffer, instead of all 128 threads walking 16-byte cp.async
// copies (~900 warp instructions per chunk and block in session 11's ncu, and the MIO-throttle
// stalls behind them). The launcher encodes one tensor map per plane and span: u32 elements,
// dims (row words, tokens of a page, pages of the span), box (KHB / 4, 64, 1) — a head's 64 rows
// land densely as [64][KHB], the cp.async layout. A tensor copy moves whole boxes: rows of a
// partial last chunk past the span's end come along (K's are masked to -inf by the causal/span
// bound; V's scales are zeroed after landing so p = 0 meets a finite scale). Taken where the
// launcher encoded the maps (`tma`; it needs 16-byte aligned rows and planes: vec == 16, D = 256).
#ifndef FA_TMA
#define FA_TMA 1
#endif
#if FA_TMA && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FA_TMA_ON 1
#else
#define FA_TMA_ON 0
#endif

// FA_PIPE (NVRTC define, default 0, A/B for an H200; needs FA_TMA's path): see the pipelined loop
// in fa_body. Adds a second score buffer (8·NT rows of FA_SROW floats) after the barriers, which the
// launcher adds to the block's shared memory when the define is set.
#ifndef FA_PIPE
#define FA_PIPE 0
#endif
#if FA_PIPE && FA_TMA_ON
#define FA_PIPE_ON 1
#else
#define FA_PIPE_ON 0
#endif

// FA_KBUF1 (NVRTC define, default 0, A/B for an H200): the width-1 instances (one query n-tile)
// keep ONE K buffer instead of two (17 KiB less shared memory at head_dim 256) and are built for 5
// blocks per SM instead of 3 (94 registers at head_dim 256, no spills), so five blocks fit an SM
// instead of four: more warps to hide the copies' and the MMAs' latencies. K(ci + 1) is copied once
// QK(ci) has released the buffer (during the softmax and PV of chunk ci), V(ci + 1) once PV(ci) has
// released V. The launcher sizes the block's shared memory and the splits (one full wave) from
// the same define. Every phase computes what the default loop computes: the same bits.
#ifndef FA_KBUF1
#define FA_KBUF1 0
#endif
#if FA_KBUF1 && FA_PIPE
#error "FA_KBUF1 and FA_PIPE exclude each other (FA_PIPE runs K two chunks ahead in two buffers)"
#endif
#if FA_KBUF1
#define FA_N1_MIN_BLOCKS 5
#else
#define FA_N1_MIN_BLOCKS 3
#endif

// FA_I8QK (NVRTC define, default 0, A/B for an H200): QK on the integer tensor cores. The Q8_0
// K values enter mma.m16n8k32.s8 as stored (no f16 conversion: 1-2 shared loads per 4 values
// instead of 2 loads and 6 conversion instructions), and each query row is rounded once, in the
// prologue, to 22-bit integers with a power-of-two scale 2^-E (E from the row's largest
// |q · scale_log2|: the largest value lands in [2^21, 2^22)) split exactly into three signed
// bytes hi·2^16 + mid·2^8 + lo: three k32 MMAs per 32-value block (hi, then mid accumulating
// onto 256·hi, then lo) against four k16 MMAs of the f16 hi/lo split. Exact int32 per block; the
// block's K scale and the row's 2^-E multiply in f32. The rounding depends on the row's own
// values only, so a verification row equals the single step bit for bit and streamed == resident
// as before. A block's 32 values are k-slots in a fixed order: the identity where the block's
// values are 4-byte aligned in the K tile (odd blocks: rows of KHB = D/32·34 bytes, the block's
// values at 34b + 2), rotated by 2 where they are not (even blocks: slot s holds value (s + 2) % 32,
// so a thread's words are aligned loads and one byte permute).
#ifndef FA_I8QK
#define FA_I8QK 0
#endif

// D (s32x4) = A (s8 16x32, row) * B (s8 32x8, col) + C.
__device__ __forceinline__ void fa_mma_i8(int* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1, int c0, int c1,
                                          int c2, int c3) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c0), "r"(c1), "r"(c2), "r"(c3));
}

// FA_I8QK: the value of Q8_0 block b that k-slot s (0..31) of its integer MMA holds.
__device__ __forceinline__ int fa_i8_slot_value(int b, int s) { return (b & 1) ? s : ((s + 2) & 31); }

// FA_I8QK: the A fragment of one Q8_0 block (`blkA`, `blkB`: the block in the K rows of tokens g
// and g + 8 of the warp's 16) in the slot order of fa_i8_slot_value. `sel`: 0x7610 for tq = 3 (its
// last word wraps to values 30, 31, 0, 1), else 0x3210.
template <bool ODD>
__device__ __forceinline__ void fa_i8_kfrag(const u8* blkA, const u8* blkB, int tq, u32 sel, u32& a0, u32& a1,
                                            u32& a2, u32& a3) {
    if (ODD) {  // values at blk + 2, 4-byte aligned
        a0 = *(const u32*)(blkA + 2 + 4 * tq);
        a1 = *(const u32*)(blkB + 2 + 4 * tq);
        a2 = *(const u32*)(blkA + 18 + 4 * tq);
        a3 = *(const u32*)(blkB + 18 + 4 * tq);
    } else {  // blk 4-byte aligned: words [scale, v0 v1], [v2..v5], ..., [v30 v31, next block]
        a0 = *(const u32*)(blkA + 4 + 4 * tq);
        a1 = *(const u32*)(blkB + 4 + 4 * tq);
        a2 = __byte_perm(*(const u32*)(blkA + 20 + 4 * tq), *(const u32*)blkA, sel);
        a3 = __byte_perm(*(const u32*)(blkB + 20 + 4 * tq), *(const u32*)blkB, sel);
    }
}

// FA_I8QK: 2^e as a float for e in [-126, 127].
__device__ __forceinline__ float fa_pow2(int e) { return __int_as_float((127 + e) << 23); }

// FA_I8QK: the exponent E of a query row whose largest |value| is m: m · 2^E in [2^21, 2^22) for
// normal m, at most 126 (so 2^-E stays a normal float); 0 for m = 0.
__device__ __forceinline__ int fa_i8_row_exp(float m) {
    if (!(m > 0.0f)) return 0;
    const int ex = ((__float_as_int(m) >> 23) & 255) - 126;  // m in [2^(ex-1), 2^ex)
    return min(126, 22 - ex);
}

// FA_I8QK: v = hi·2^16 + mid·2^8 + lo with three signed bytes (|v| <= 2^22).
__device__ __forceinline__ void fa_i8_split(int v, int& hi, int& mid, int& lo) {
    lo = ((v + 128) & 255) - 128;
    const int r1 = (v - lo) >> 8;
    mid = ((r1 + 128) & 255) - 128;
    hi = (r1 - mid) >> 8;
}

// A CUtensorMap (opaque, 128 bytes, 64-byte aligned), passed by value as a __grid_constant__.
struct __align__(64) FaTmap {
    u64 opaque[16];
};

#if FA_TMA_ON
__device__ __forceinline__ void fa_bar_init(u32 bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
// Makes the initialised barriers visible to the async proxy (the tensor copies complete on them).
__device__ __forceinline__ void fa_fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Box (c0, c1, c2) of `map` into dst (128-byte aligned), `bytes` (the box's size) expected on `bar`
// by this phase's one arrival, made here before the copy.
__device__ __forceinline__ void fa_tma3(u32 dst, const FaTmap* map, int c0, int c1, int c2, u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"((u64)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
#endif

// Issues the asynchronous copy of `cnt` tokens' head rows of one plane (token t of the chunk at
// src + t * row) into dst[t][HB], without committing. `vec` is the copy width the launcher proved
// aligned for every address (16, 4, or 1 for plain synchronous byte copies). The 16- and 4-byte
// paths walk their copies incrementally: copy i of the plane is (token i / N, part i % N) with
// N = HB / vec parts per row, and each thread's next copy (i + FA_THREADS) is a fixed step away, so
// a copy costs an add, a compare and the cp.async (no division or 64-bit multiply per copy).
template <int HB, int VEC>
__device__ __forceinline__ void fa_issue_walk(u8* dst, const u8* src, int cnt, u64 row) {
    constexpr int N = HB / VEC;
    constexpr int DT = FA_THREADS / N, DP = FA_THREADS % N;
    const int total = cnt * N;
    int i = threadIdx.x;
    int p = i % N;
    const u8* s = src + (u64)(i / N) * row + p * VEC;
    const u64 step = (u64)DT * row + DP * VEC;
    const u64 wrap = row - (u64)N * VEC;
    u32 d = smem_u32(dst) + i * VEC;
    for (; i < total; i += FA_THREADS) {
        if constexpr (VEC == 16) {
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(s) : "memory");
        } else {
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(s) : "memory");
        }
        d += FA_THREADS * VEC;
        s += step;
        p += DP;
        if (p >= N) {
            p -= N;
            s += wrap;
        }
    }
}

template <int HB>
__device__ __forceinline__ void fa_issue_plane(u8* dst, const u8* src, int cnt, u64 row, int vec) {
    if constexpr (HB % 16 == 0) {
        if (vec == 16) {
            fa_issue_walk<HB, 16>(dst, src, cnt, row);
            return;
        }
    }
    if (vec >= 4) {
        fa_issue_walk<HB, 4>(dst, src, cnt, row);
        return;
    }
    for (int i = threadIdx.x; i < cnt * HB; i += FA_THREADS) {  // synchronous byte copies
        int t = i / HB, p = i - t * HB;
        dst[i] = src[t * row + p];
    }
}

template <int NT, int D>
__device__ __forceinline__ void fa_body(const float* __restrict__ q, const u8* __restrict__ pool,
                                        float* __restrict__ state, const AttnGeo& geo, u64 span_offset,
                                        int span_first, int span_count, int n_splits, int vec, int qt,
                                        const FaTmap* tmk, const FaTmap* tmv, int tma_maps, u8* sm) {
    constexpr int KHB = D / 32 * 34;
    constexpr int VHB = D / 32 * 18;
    constexpr int DW = D / 4;    // dims per warp in phase 3
    constexpr int MT = DW / 16;  // 16-dim m-tiles per warp in phase 3
    constexpr int KS = D / 16;   // 16-dim k-steps of QK
    const int G = geo.q_heads / geo.kv_heads;
    const int W = geo.width;
    // Query tile (blockIdx.z): queries [q0, q0 + Wz) of the W, rows r = (query - q0) * G + head.
    // Decode and verification (W <= 4) run one tile of all W queries; prefill tiles hold
    // qt = 32 / G queries (the launcher's choice), so R = G * Wz <= 32 always.
    const int q0 = blockIdx.z * qt;
    const int Wz = min(qt, W - q0);
    if (Wz <= 0) return;
    const int R = G * Wz;
    const int kvh = blockIdx.x, split = blockIdx.y;
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;

    // This split's chunks inside the span [span_first, end): cfirst, cfirst + n_splits, ... < chi.
    // span_first is 64-aligned (a page boundary; pages hold a power of two >= 64 tokens), so the
    // chunks lie wholly inside the span and each inside one page. Block-uniform early exit: a
    // split without a chunk here leaves its state untouched.
    const int end = min(span_first + span_count, geo.total);
    if (end <= span_first) return;
    const int clo = span_first / FA_CHUNK;
    const int cfirst = clo + (split - clo % n_splits + n_splits) % n_splits;
    if (cfirst >= (end + FA_CHUNK - 1) / FA_CHUNK) return;
    const bool fresh = cfirst == split;  // this launch holds the split's first chunk
    // Causal bound of the tile: its last query (W - 1 - (q0 + Wz - 1) rows before the end of
    // the history) sees tokens < total - W + q0 + Wz; later chunks are wholly masked for every
    // row of the tile and are skipped. A tile that skips the split's first chunk still starts
    // the split's state (empty: later launches only hold later, equally masked tokens).
    const int endz = min(end, geo.total - W + q0 + Wz);
    const int chi = (endz + FA_CHUNK - 1) / FA_CHUNK;
    if (cfirst >= chi) {
        if (fresh) {
            const int rowlen0 = D + 2;
            for (int e = tid; e < R * rowlen0; e += FA_THREADS) {
                const int r = e / rowlen0, c = e - r * rowlen0;
                state[(((u64)split * W + q0 + r / G) * geo.q_heads + kvh * G + r % G) * rowlen0 + c] =
                    c == 0 ? NEG_INF : 0.0f;
            }
        }
        return;
    }
    const int nchunks = (chi - cfirst + n_splits - 1) / n_splits;

    // FA_KBUF1: one K buffer for the one-n-tile instances (see the define).
    constexpr bool kb1 = FA_KBUF1 && NT == 1;
    // The K buffer chunk ci lands in.
    auto kslot = [&](int ci) { return kb1 ? 0 : (ci & 1); };
    u8* kbuf = sm;                                        // [2 (FA_KBUF1, NT = 1: 1)][64][KHB]
    u8* vbuf = kbuf + (kb1 ? 1 : 2) * FA_CHUNK * KHB;     // [64][VHB]
    uint4* qf = (uint4*)(vbuf + FA_CHUNK * VHB);          // [KS][NT][32]
    float* sS = (float*)(qf + KS * NT * 32);              // [8·NT][FA_SROW] (rows < 8·NT only)
    float* sM = sS + 8 * NT * FA_SROW;                    // [32]
    float* sL = sM + FA_ROWS;                             // [32]
    float* sA = sL + FA_ROWS;                             // [32]
    u64* bars = (u64*)(sA + FA_ROWS);                     // [3] (FA_TMA: K buffers 0, 1; V)
    const int rowlen = D + 2;

    // Chunk source addresses. A 64-aligned chunk lies inside one page (pages hold a power of two
    // >= 64 tokens and span_first is a page boundary).
    const u8* base = pool + span_offset;
    // Pages hold a power of two tokens (the geometry's invariant): page = rel >> tpp_log2.
    const int tpp_log2 = __ffs(geo.tpp) - 1;
    // Chunk ci's page offset and token count.
    auto where = [&](int ci, int& cnt) {
        const int c0 = (cfirst + ci * n_splits) * FA_CHUNK;
        cnt = min(FA_CHUNK, end - c0);
        const int rel = c0 - span_first;
        return base + (u64)(rel >> tpp_log2) * geo.page_bytes;
    };
    auto slot_of = [&](int ci) {
        return (u64)(((cfirst + ci * n_splits) * FA_CHUNK - span_first) & (geo.tpp - 1));
    };
    auto issue_k = [&](int ci) {  // into K buffer kslot(ci)
        int cnt;
        const u8* pg = where(ci, cnt);
        fa_issue_plane<KHB>(kbuf + kslot(ci) * FA_CHUNK * KHB, pg + slot_of(ci) * geo.k_row_bytes + (u64)kvh * KHB,
                            cnt, geo.k_row_bytes, vec);
    };
    auto issue_v = [&](int ci) {  // into the V buffer
        int cnt;
        const u8* pg = where(ci, cnt);
        fa_issue_plane<VHB>(vbuf, pg + geo.v_plane_off + slot_of(ci) * geo.v_row_bytes + (u64)kvh * VHB, cnt,
                            geo.v_row_bytes, vec);
    };
#if FA_TMA_ON
    // K(ci) completes phase ci / 2 of its buffer's barrier, V(ci) phase ci of the V barrier; every
    // issued copy is waited for before the block ends.
    const bool tma = tma_maps != 0 && vec == 16;
    const u32 bar0 = smem_u32(bars);
    auto kbar = [&](int ci) { return bar0 + (u32)kslot(ci) * 8u; };
    const u32 vbar = bar0 + 16u;
    // Box coordinates of chunk ci: (head's first word, slot in the page, page of the span).
    auto tma_k = [&](int ci) {
        const int rel = (cfirst + ci * n_splits) * FA_CHUNK - span_first;
        fa_tma3(smem_u32(kbuf + kslot(ci) * FA_CHUNK * KHB), tmk, kvh * (KHB / 4), rel & (geo.tpp - 1),
                rel >> tpp_log2, kbar(ci), FA_CHUNK * KHB);
    };
    auto tma_v = [&](int ci) {
        const int rel = (cfirst + ci * n_splits) * FA_CHUNK - span_first;
        fa_tma3(smem_u32(vbuf), tmv, kvh * (VHB / 4), rel & (geo.tpp - 1), rel >> tpp_log2, vbar,
                FA_CHUNK * VHB);
    };
    if (tma) {
        if (tid == 0) {
            fa_bar_init(bar0);
            fa_bar_init(bar0 + 8u);
            fa_bar_init(vbar);
            fa_fence_async();
            tma_k(0);
            tma_v(0);
        }
        __syncthreads();  // the barriers are initialised before any thread waits on them
    } else
#else
    constexpr bool tma = false;
    (void)tmk;
    (void)tmv;
    (void)tma_maps;
    (void)bars;
#endif
    {
        issue_k(0);
        issue_v(0);
        fa_commit();
    }
    // Zeroes the V buffer's rows from `cnt` on (the rows a partial chunk does not fill).
    auto zero_v_rows_from = [&](int cnt) {
        for (int e = cnt * VHB + tid * 4; e < FA_CHUNK * VHB; e += FA_THREADS * 4) *(u32*)(vbuf + e) = 0u;
    };
    if (!tma) {
        // V rows past a partial first chunk are read (with p = 0) but never copied: zero them so
        // their scales are finite (uninitialised shared memory may hold NaN). Disjoint from the
        // rows in flight; later chunks leave the previous chunk's (finite) rows there.
        int cnt0;
        (void)where(0, cnt0);
        zero_v_rows_from(cnt0);
    }

    // Row r's state record (m, l, then D accumulator values) and query vector: one integer
    // division each, so callers compute them once per row rather than per element.
    auto state_row = [&](int r) {
        return state + (((u64)split * W + q0 + r / G) * geo.q_heads + kvh * G + r % G) * rowlen;
    };
    // Row r's query vector (r < R).
    auto qrow_of = [&](int r) { return q + ((u64)(q0 + r / G) * geo.q_heads + kvh * G + r % G) * D; };
#if FA_I8QK
    // FA_I8QK query fragments (B operand of the integer QK, k = slot, n = row): entry
    // (b, nt, plane, lane) holds row nt*8 + lane/4's bytes of plane hi / mid / lo (0, 1, 2) for
    // slots 4·(lane%4) + 0..3 and 16 + 4·(lane%4) + 0..3 of block b (fa_i8_slot_value), as a uint2;
    // then 2^E and 2^-E per row. Pass 1: a warp per row takes the row's largest |value|; pass 2:
    // every entry rounds its 8 values. (Uses 3/4 of the f16 fragments' space, so the launcher's
    // shared-memory size holds either layout.)
    uint2* qi = (uint2*)qf;                              // [D/32][NT][3][32]
    float* sQp = (float*)(qi + D / 32 * NT * 3 * 32);    // [32] 2^E
    float* sQs = sQp + FA_ROWS;                           // [32] 2^-E (NaN for a non-finite row)
    static_assert(D / 32 * NT * 3 * 32 * 8 + 2 * FA_ROWS * 4 <= KS * NT * 32 * 16, "I8 fragments fit");
    for (int r = w; r < FA_ROWS; r += FA_THREADS / 32) {  // warp-uniform rows
        float m = 0.0f;
        bool finite = true;
        if (r < R) {
            const float* qr = qrow_of(r);
            for (int d = lane; d < D; d += 32) {
                const float a = fabsf(qr[d] * geo.scale_log2);
                finite = finite && a < __int_as_float(0x7f800000);  // false for inf and NaN
                m = fmaxf(m, a);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        finite = __all_sync(0xffffffffu, finite);
        if (lane == 0) {
            const int e = fa_i8_row_exp(m);
            sQp[r] = fa_pow2(e);
            sQs[r] = finite ? fa_pow2(-e) : __int_as_float(0x7fc00000);
        }
    }
    __syncthreads();
    for (int e = tid; e < D / 32 * NT * 32; e += FA_THREADS) {  // lane e & 31 == lane
        const int idx = e >> 5;
        const int nt = idx % NT, b = idx / NT;
        const int r = nt * 8 + g;
        const float p2 = sQp[r];
        const float* qr = r < R ? qrow_of(r) : nullptr;
        u32 pk[3][2] = {{0u, 0u}, {0u, 0u}, {0u, 0u}};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int slot = (j < 4 ? 0 : 16) + 4 * tq + (j & 3);
            const float x = qr != nullptr ? qr[b * 32 + fa_i8_slot_value(b, slot)] * geo.scale_log2 : 0.0f;
            int hi, mid, lo;
            fa_i8_split(__float2int_rn(x * p2), hi, mid, lo);
            const int sh = 8 * (j & 3);
            pk[0][j >> 2] |= ((u32)hi & 255u) << sh;
            pk[1][j >> 2] |= ((u32)mid & 255u) << sh;
            pk[2][j >> 2] |= ((u32)lo & 255u) << sh;
        }
#pragma unroll
        for (int pl = 0; pl < 3; pl++) qi[((b * NT + nt) * 3 + pl) * 32 + lane] = make_uint2(pk[pl][0], pk[pl][1]);
    }
    // This thread's score rows nt*8 + 2tq + j: their 2^-E (every pass-1 write is behind the barrier).
    float qsc[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        qsc[nt][0] = sQs[nt * 8 + 2 * tq];
        qsc[nt][1] = sQs[nt * 8 + 2 * tq + 1];
    }
#else
    // Query fragments (B operand of QK, k = dim, n = row): entry (ks, nt, lane) holds rows
    // nt*8 + lane/4, dims ks*16 + 2*(lane%4) + {0, 1, 8, 9}, as {hi(0,1), hi(8,9), lo(0,1), lo(8,9)}.
    // A thread's entries e = tid + FA_THREADS*i keep lane e & 31 = lane, so its NT query rows
    // nt*8 + lane/4 are fixed: their pointers (null for padding rows) are taken once.
    {
        const float* qrow[NT];
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            const int r = nt * 8 + g;
            qrow[nt] = r < R ? qrow_of(r) : nullptr;
        }
        static_assert(KS * NT * 32 % FA_THREADS == 0, "whole query-fragment passes");
#pragma unroll
        for (int i = 0; i < KS * NT * 32 / FA_THREADS; i++) {
            const int e = tid + FA_THREADS * i, idx = e >> 5;
            const int nt = idx % NT, kstep = idx / NT;
            const int d = kstep * 16 + tq * 2;
            float x0 = 0.0f, x1 = 0.0f, x8 = 0.0f, x9 = 0.0f;
            const float* qr = qrow[0];
#pragma unroll
            for (int n = 1; n < NT; n++) qr = nt == n ? qrow[n] : qr;
            if (qr != nullptr) {
                x0 = qr[d] * geo.scale_log2;
                x1 = qr[d + 1] * geo.scale_log2;
                x8 = qr[d + 8] * geo.scale_log2;
                x9 = qr[d + 9] * geo.scale_log2;
            }
            u32 h0, l0, h1, l1;
            fa_split(x0, x1, h0, l0);
            fa_split(x8, x9, h1, l1);
            qf[e] = make_uint4(h0, h1, l0, l1);
        }
    }
#endif
    // Row state: m, l in shared memory; alpha defaults to 1 (padding rows are never read out).
    if (tid < FA_ROWS) {
        const int r = tid;
        float m = NEG_INF, l = 0.0f;
        if (r < R && !fresh) {
            const float* st = state_row(r);
            m = st[0];
            l = st[1];
        }
        sM[r] = m;
        sL[r] = l;
        sA[r] = 1.0f;
    }
    // Accumulators in the MMA C layout of O^T (m = dim, n = row): acc[mt][nt][0..3] =
    // (dim d0+2g, row nt*8+2tq), (d0+2g, +1), (d0+2g+1, nt*8+2tq), (d0+2g+1, +1), d0 = w*DW + mt*16
    // (MMA rows g and g+8 are dims 2g and 2g+1: see the V fragments in phase 3).
    float acc[MT][NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = nt * 8 + 2 * tq + j;
            const float* st = (!fresh && r < R) ? state_row(r) + 2 + w * DW + 2 * g : nullptr;
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                const float2 v = st != nullptr ? *(const float2*)(st + mt * 16) : make_float2(0.0f, 0.0f);
                acc[mt][nt][j] = v.x;
                acc[mt][nt][2 + j] = v.y;
            }
        }
    }

    const int lim0 = geo.total - W;  // query qi sees tokens <= lim0 + qi
    // Per-thread score rows r = nt*8 + 2tq + j (j = 0, 1): row r may see token c0 + t iff
    // c0 + t <= slim (its causal bound and the span's end; -1 for padding rows).
    int slim[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = nt * 8 + 2 * tq + j;
            slim[nt][j] = r < R ? min(lim0 + q0 + r / G, end - 1) : -1;
        }
    }
    // The three phases of a chunk, as the loops below run them (sSb: the chunk's score rows).
    auto qk_phase = [&](int ci, float* sSb) {
        const int c0 = (cfirst + ci * n_splits) * FA_CHUNK;
        const u8* kb = kbuf + kslot(ci) * FA_CHUNK * KHB;
        // ---- phase 1: S[row][token] for tokens 16w + g and 16w + g + 8.
        {
            float sacc[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int i = 0; i < 4; i++) sacc[nt][i] = 0.0f;
            const u8* rowA = kb + (16 * w + g) * KHB;
            const u8* rowB = rowA + 8 * KHB;
#if FA_I8QK
            const uint2* qb = (const uint2*)qf;
            const u32 sel = tq == 3 ? 0x7610u : 0x3210u;
#pragma unroll 1
            for (int bp = 0; bp < D / 64; bp++) {
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int b = 2 * bp + h;
                    const u8* blkA = rowA + b * 34;
                    const u8* blkB = rowB + b * 34;
                    u32 a0, a1, a2, a3;
                    if (h) {
                        fa_i8_kfrag<true>(blkA, blkB, tq, sel, a0, a1, a2, a3);
                    } else {
                        fa_i8_kfrag<false>(blkA, blkB, tq, sel, a0, a1, a2, a3);
                    }
                    const float sA0 = fa_f16(blkA), sB0 = fa_f16(blkB);
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint2* qe = qb + (b * NT + nt) * 3 * 32 + lane;
                        const uint2 qh = qe[0], qm = qe[32], ql = qe[64];
                        int d1[4], d2[4], d3[4];
                        fa_mma_i8(d1, a0, a1, a2, a3, qh.x, qh.y, 0, 0, 0, 0);
                        fa_mma_i8(d2, a0, a1, a2, a3, qm.x, qm.y, d1[0] * 256, d1[1] * 256, d1[2] * 256,
                                  d1[3] * 256);
                        fa_mma_i8(d3, a0, a1, a2, a3, ql.x, ql.y, 0, 0, 0, 0);
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            const float f = fmaf((float)d2[i], 256.0f, (float)d3[i]);
                            sacc[nt][i] = fmaf(i < 2 ? sA0 : sB0, f, sacc[nt][i]);
                        }
                    }
                }
            }
#else
#pragma unroll 2
            for (int b = 0; b < D / 32; b++) {
                const u8* blkA = rowA + b * 34;
                const u8* blkB = rowB + b * 34;
                float ch[NT][4], cl[NT][4];
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        ch[nt][i] = 0.0f;
                        cl[nt][i] = 0.0f;
                    }
#pragma unroll
                for (int kk = 0; kk < 2; kk++) {
                    const int e = 2 + kk * 16 + tq * 2;
                    const u32 a0 = fa_q8x2(blkA + e);
                    const u32 a1 = fa_q8x2(blkB + e);
                    const u32 a2 = fa_q8x2(blkA + e + 8);
                    const u32 a3 = fa_q8x2(blkB + e + 8);
                    const int kstep = b * 2 + kk;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const uint4 bq = qf[(kstep * NT + nt) * 32 + lane];
                        fa_mma(ch[nt], a0, a1, a2, a3, bq.x, bq.y);
                        fa_mma(cl[nt], a0, a1, a2, a3, bq.z, bq.w);
                    }
                }
                const float sA0 = fa_f16(blkA), sB0 = fa_f16(blkB);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    sacc[nt][0] += sA0 * (ch[nt][0] + cl[nt][0]);
                    sacc[nt][1] += sA0 * (ch[nt][1] + cl[nt][1]);
                    sacc[nt][2] += sB0 * (ch[nt][2] + cl[nt][2]);
                    sacc[nt][3] += sB0 * (ch[nt][3] + cl[nt][3]);
                }
            }
#endif
            const int tA = 16 * w + g, tB = tA + 8;
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const int r = nt * 8 + 2 * tq + (i & 1);
                    const int t = (i >> 1) ? tB : tA;
#if FA_I8QK
                    sSb[r * FA_SROW + t] = c0 + t <= slim[nt][i & 1] ? sacc[nt][i] * qsc[nt][i & 1] : NEG_INF;
#else
                    sSb[r * FA_SROW + t] = c0 + t <= slim[nt][i & 1] ? sacc[nt][i] : NEG_INF;
#endif
                }
            }
        }
    };
    auto softmax_phase = [&](float* sSb) {
        // ---- phase 2: online softmax, row 8w + lane/4, tokens lane%4 + 4i (warps w < NT: the
        // others hold only padding rows, whose alpha stays 1 and which are never written out).
        // Measured against all four warps taking rows (16 lanes per row): the spread costs width 4
        // 8% and gains width 1 nothing (docs/benchmarks.md, sessions 12 and 13).
        if (w < NT) {
            const int rs = lane >> 2, part = lane & 3;
            const int r = w * 8 + rs;
            float* row = sSb + r * FA_SROW;
            float v[16];
            float mx = NEG_INF;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                v[i] = row[part + 4 * i];
                mx = fmaxf(mx, v[i]);
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mo = sM[r];
            const float mn = fmaxf(mo, mx);
            const bool none = mn == NEG_INF;  // nothing seen yet for this row: state unchanged
            const float alpha = none ? 1.0f : fa_exp2(mo - mn);
            float sum = 0.0f;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                v[i] = none ? 0.0f : fa_exp2(v[i] - mn);
                sum += v[i];
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            __syncwarp();
            if (r < R) {
#pragma unroll
                for (int i = 0; i < 16; i++) row[part + 4 * i] = v[i];
                if (part == 0) {
                    sL[r] = sL[r] * alpha + sum;
                    sM[r] = mn;
                    sA[r] = alpha;
                }
            }
        }
    };
    auto pv_phase = [&](const float* sSb) {
        const u8* vb = vbuf;
        // ---- phase 3: acc = acc * alpha + V^T P^T over the chunk's 64 tokens.
        {
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const float al0 = sA[nt * 8 + 2 * tq], al1 = sA[nt * 8 + 2 * tq + 1];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    acc[mt][nt][0] *= al0;
                    acc[mt][nt][1] *= al1;
                    acc[mt][nt][2] *= al0;
                    acc[mt][nt][3] *= al1;
                }
            }
#pragma unroll 1
            for (int kt = 0; kt < FA_CHUNK / 16; kt++) {
                const int t0 = kt * 16 + 2 * tq;  // tokens t0, t0+1, t0+8, t0+9
                const u8* v0 = vb + t0 * VHB;
                const u8* v1 = v0 + VHB;
                const u8* v8 = v0 + 8 * VHB;
                const u8* v9 = v0 + 9 * VHB;
                // P[row nt*8+g][t0, t0+1, t0+8, t0+9], shared by every V block.
                float pv[NT][4];
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const float* pr = sSb + (nt * 8 + g) * FA_SROW + t0;
                    const float2 pa = *(const float2*)pr;
                    const float2 pb = *(const float2*)(pr + 8);
                    pv[nt][0] = pa.x;
                    pv[nt][1] = pa.y;
                    pv[nt][2] = pb.x;
                    pv[nt][3] = pb.y;
                }
                // Q4_0 blocks of this warp's dims: with DW >= 32 each block b gives m-tiles 2j (low
                // nibbles, dims b*32 + 0..15) and 2j+1 (high nibbles, dims b*32 + 16..31); with
                // DW == 16 the warp has one m-tile, the half hb of block b.
                constexpr int NB = DW >= 32 ? DW / 32 : 1;
#pragma unroll
                for (int j = 0; j < NB; j++) {
                    const int b = DW >= 32 ? w * NB + j : (w >> 1);
                    // B = P^T * vscale(t, b), hi/lo. No select: a real row's p is finite (0 where
                    // masked) and every scale the buffer holds is finite (a token's own, a previous
                    // chunk's, or the zeros written over a partial first chunk's tail), so masked
                    // entries give exactly 0; a padding row's -inf scores only reach its own MMA
                    // column, which is never written out.
                    const float s0 = fa_f16(v0 + b * 18), s1 = fa_f16(v1 + b * 18);
                    const float s8 = fa_f16(v8 + b * 18), s9 = fa_f16(v9 + b * 18);
                    u32 bh[NT][2], bl[NT][2];
#pragma unroll
                    for (int nt = 0; nt < NT; nt++) {
                        const float x0 = pv[nt][0] * s0;
                        const float x1 = pv[nt][1] * s1;
                        const float x8 = pv[nt][2] * s8;
                        const float x9 = pv[nt][3] * s9;
                        fa_split(x0, x1, bh[nt][0], bl[nt][0]);
                        fa_split(x8, x9, bh[nt][1], bl[nt][1]);
                    }
                    // A = V^T: rows g and g+8 of m-tile 2j (low nibbles) are dims 2g and 2g+1 of
                    // block b (bytes 2g and 2g+1), of m-tile 2j+1 (high nibbles) dims 2g+16 and
                    // 2g+17; columns (tokens) t0, t0+1 (a0, a1) and t0+8, t0+9 (a2, a3). One 16-bit
                    // load per token gives a lane both of its rows.
                    const int o = b * 18 + 2 + 2 * g;
                    const u32 w0 = *(const u16*)(v0 + o), w1 = *(const u16*)(v1 + o);
                    const u32 w8 = *(const u16*)(v8 + o), w9 = *(const u16*)(v9 + o);
                    u32 al[4], ah[4];
                    fa_q4pair(w0, w1, al[0], ah[0]);
                    fa_q4pair_b1(w0, w1, al[1], ah[1]);
                    fa_q4pair(w8, w9, al[2], ah[2]);
                    fa_q4pair_b1(w8, w9, al[3], ah[3]);
                    if constexpr (DW >= 32) {
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) {
                            fa_mma(acc[2 * j][nt], al[0], al[1], al[2], al[3], bh[nt][0], bh[nt][1]);
                            fa_mma(acc[2 * j][nt], al[0], al[1], al[2], al[3], bl[nt][0], bl[nt][1]);
                            fa_mma(acc[2 * j + 1][nt], ah[0], ah[1], ah[2], ah[3], bh[nt][0], bh[nt][1]);
                            fa_mma(acc[2 * j + 1][nt], ah[0], ah[1], ah[2], ah[3], bl[nt][0], bl[nt][1]);
                        }
                    } else {
                        const bool high = (w & 1) != 0;
                        const u32 a0 = high ? ah[0] : al[0], a1 = high ? ah[1] : al[1];
                        const u32 a2 = high ? ah[2] : al[2], a3 = high ? ah[3] : al[3];
#pragma unroll
                        for (int nt = 0; nt < NT; nt++) {
                            fa_mma(acc[0][nt], a0, a1, a2, a3, bh[nt][0], bh[nt][1]);
                            fa_mma(acc[0][nt], a0, a1, a2, a3, bl[nt][0], bl[nt][1]);
                        }
                    }
                }
            }
        }
    };
    if (kb1) {
        // FA_KBUF1: one K buffer (see the define). Three block barriers per chunk on the
        // tensor-copy path (after QK, before PV, after PV), a fourth on the cp.async path.
        // Chunk ci's K (is_k) or V copy: thread 0's tensor copy, or every thread's cp.async group.
        auto issue_next = [&](bool is_k, int ci) {
#if FA_TMA_ON
            if (tma) {
                if (tid == 0) {
                    if (is_k) {
                        tma_k(ci);
                    } else {
                        tma_v(ci);
                    }
                }
                return;
            }
#endif
            if (is_k) {
                issue_k(ci);
            } else {
                issue_v(ci);
            }
            fa_commit();
        };
        __syncthreads();  // the query fragments and row state are visible
        for (int ci = 0; ci < nchunks; ci++) {
            const int cnt = min(FA_CHUNK, end - (cfirst + ci * n_splits) * FA_CHUNK);
#if FA_TMA_ON
            if (tma) {
                mbar_wait_parity(kbar(ci), (u32)ci & 1u);  // K(ci): phase ci of the one K barrier
            } else
#endif
            {
                fa_wait_all();    // K(ci) and V(ci): every copy issued so far
                __syncthreads();  // visible to all
            }
            qk_phase(ci, sS);
            __syncthreads();  // QK(ci) done: the K buffer is free; S(ci) visible
            if (ci + 1 < nchunks) issue_next(true, ci + 1);
            softmax_phase(sS);
#if FA_TMA_ON
            if (tma) {
                mbar_wait_parity(vbar, (u32)ci & 1u);  // V(ci)
                zero_v_rows_from(cnt);            // rows past a partial chunk: finite (zero) scales
            }
#endif
            __syncthreads();  // P(ci), alpha and V(ci) visible
            pv_phase(sS);
            __syncthreads();  // PV(ci) done: the V buffer and the scores are free
            if (ci + 1 < nchunks) issue_next(false, ci + 1);
        }
    } else
#if FA_PIPE_ON
    if (tma) {
        // FA_PIPE: warp 0's softmax of chunk ci overlaps the other warps' QK of chunk ci + 1 (the
        // scores double buffered in sS and sS2), two block barriers per chunk instead of three. Every
        // score, probability and accumulator is computed as in the loop below (the same phases in
        // the same order per row), so the results are that loop's bits. K runs two chunks ahead:
        // K(ci + 3) goes into the buffer QK(ci + 1) has just released.
        float* const sS2 = (float*)((u8*)bars + 32);
        if (tid == 0 && nchunks > 1) tma_k(1);
        mbar_wait_parity(kbar(0), 0u);
        __syncthreads();  // the query fragments and row state are visible
        qk_phase(0, sS);
        __syncthreads();  // QK(0) done: K buffer 0 is free
        if (tid == 0 && nchunks > 2) tma_k(2);
        for (int ci = 0; ci < nchunks; ci++) {
            float* const sc = (ci & 1) ? sS2 : sS;
            float* const sn = (ci & 1) ? sS : sS2;
            const int cnt = min(FA_CHUNK, end - (cfirst + ci * n_splits) * FA_CHUNK);
            softmax_phase(sc);
            if (ci + 1 < nchunks) {
                mbar_wait_parity(kbar(ci + 1), (u32)((ci + 1) >> 1) & 1u);  // K(ci + 1)
                qk_phase(ci + 1, sn);
            }
            mbar_wait_parity(vbar, (u32)ci & 1u);  // V(ci); a partial chunk's extra rows get zero scales
            zero_v_rows_from(cnt);
            __syncthreads();  // P(ci) and alpha visible; QK(ci + 1) done, its K buffer free
            if (tid == 0 && ci + 3 < nchunks) tma_k(ci + 3);
            pv_phase(sc);
            __syncthreads();  // V(ci) and P(ci) consumed
            if (tid == 0 && ci + 1 < nchunks) tma_v(ci + 1);
        }
    } else
#endif
    for (int ci = 0; ci < nchunks; ci++) {
        const int c0 = (cfirst + ci * n_splits) * FA_CHUNK;
        const int cnt = min(FA_CHUNK, end - c0);
#if FA_TMA_ON
        if (tma) {
            mbar_wait_parity(kbar(ci), (u32)(ci >> 1) & 1u);  // K(ci)
            __syncthreads();  // everyone is done with K(ci-1) and V(ci-1)
            if (tid == 0) {
                if (ci > 0) tma_v(ci);
                if (ci + 1 < nchunks) tma_k(ci + 1);
            }
        } else
#endif
        {
            fa_wait_all();    // K(ci) (and, for ci = 0, V(0)); V(ci - 1) was waited for in ci - 1
            __syncthreads();  // K(ci) visible to all; everyone is done with K(ci-1) and V(ci-1)
            if (ci > 0) issue_v(ci);
            fa_commit();
            // K(ci + 1) into the other K buffer, all at once.
            if (ci + 1 < nchunks) issue_k(ci + 1);
        }
        qk_phase(ci, sS);
        if (!tma) fa_commit();  // K(ci + 1) (possibly empty): phase 3 waits for all groups but this one
        __syncthreads();
        softmax_phase(sS);
#if FA_TMA_ON
        if (tma) {
            mbar_wait_parity(vbar, (u32)ci & 1u);  // V(ci)
            // The box brought rows past a partial chunk's end: zero them so their scales are
            // finite (p = 0 there). Only the last chunk is partial, so no later copy lands here.
            zero_v_rows_from(cnt);
        } else
#endif
            fa_wait_but_newest();  // V(ci)
        __syncthreads();
        pv_phase(sS);
    }

    // Write the state back (each value by exactly one thread).
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int r = nt * 8 + 2 * tq + j;
            if (r < R) {
                float* st = state_row(r) + 2 + w * DW + 2 * g;
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    *(float2*)(st + mt * 16) = make_float2(acc[mt][nt][j], acc[mt][nt][2 + j]);
                }
            }
        }
    }
    if (tid < R) {
        const int r = tid;
        float* st = state_row(r);
        st[0] = sM[r];
        st[1] = sL[r];
    }
}

// Fast accumulate (see above): one entry point per (nt, head_dim), so each instance gets the
// registers it needs (a single kernel switching over all twelve took the worst case, 255, for
// every instance: 2 blocks per SM). `nt` = ceil(group * qt / 8) in 1..=4 query n-tiles; `qt`
// queries per tile (grid z = ceil(width / qt); qt = width for decode and verification).
// Instances with nt <= 3 are built for 3 blocks per SM (<= 168 registers with NVRTC 13.0 for
// sm_90; n2_d256 and n3_d256 keep 16 / 24 bytes of spill: four local loads per chunk, in the copy
// issue, none in the MMA loops); nt = 4 keeps 2 (capping it spills in the MMA loops).
// `tmk` / `tmv`: the K / V tensor maps of the span (FA_TMA), used iff `tma_maps` != 0. Dynamic
// shared memory starts the block's window (no static shared memory), so its base is 128-byte
// aligned as the tensor copies need.
#define FA_PARAMS                                                                                        \
    const float *q, const u8 *pool, float *state, AttnGeo geo, u64 span_offset, int span_first, int span_count, \
        int n_splits, int vec, int qt, const __grid_constant__ FaTmap tmk, const __grid_constant__ FaTmap tmv, \
        int tma_maps
#define FA_CALL(N, DD)                                                                                     \
    {                                                                                                     \
        extern __shared__ __align__(128) u8 fa_smem[];                                                   \
        fa_body<N, DD>(q, pool, state, geo, span_offset, span_first, span_count, n_splits, vec, qt, &tmk, &tmv, \
                       tma_maps, fa_smem);                                                                \
    }
extern "C" __launch_bounds__(FA_THREADS, FA_N1_MIN_BLOCKS) __global__ void attn_q8q4_n1_d64(FA_PARAMS) FA_CALL(1, 64)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n2_d64(FA_PARAMS) FA_CALL(2, 64)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n3_d64(FA_PARAMS) FA_CALL(3, 64)
extern "C" __launch_bounds__(FA_THREADS, 2) __global__ void attn_q8q4_n4_d64(FA_PARAMS) FA_CALL(4, 64)
extern "C" __launch_bounds__(FA_THREADS, FA_N1_MIN_BLOCKS) __global__ void attn_q8q4_n1_d128(FA_PARAMS) FA_CALL(1, 128)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n2_d128(FA_PARAMS) FA_CALL(2, 128)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n3_d128(FA_PARAMS) FA_CALL(3, 128)
extern "C" __launch_bounds__(FA_THREADS, 2) __global__ void attn_q8q4_n4_d128(FA_PARAMS) FA_CALL(4, 128)
extern "C" __launch_bounds__(FA_THREADS, FA_N1_MIN_BLOCKS) __global__ void attn_q8q4_n1_d256(FA_PARAMS) FA_CALL(1, 256)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n2_d256(FA_PARAMS) FA_CALL(2, 256)
extern "C" __launch_bounds__(FA_THREADS, 3) __global__ void attn_q8q4_n3_d256(FA_PARAMS) FA_CALL(3, 256)
extern "C" __launch_bounds__(FA_THREADS, 2) __global__ void attn_q8q4_n4_d256(FA_PARAMS) FA_CALL(4, 256)
#undef FA_CALL
#undef FA_PARAMS

// ------------------------------------------------------------------------------------------------
// out[qi, head * D + d] = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M). Every split holds
// tokens, so every split's state was written (acc finite). Grid: (width · q_heads rows,
// ceil(head_dim / 32) dim slices); block: 256 threads = 8 split groups (warps) × 32 dims. Warp j
// sums the splits s ≡ j (mod 8) of its lane's dim in index order, then warp 0 adds the 8 groups in
// order: a fixed order for a given split count, and each thread walks at most ceil(n / 8) splits
// with independent loads (one serial chain over all splits was latency-bound at ~10 µs for the
// 27B's 99 splits). M and L are reduced the same fixed way in every block of a row.
#define ATT_FINISH_MAX_SPLITS 256
#define ATT_FINISH_DIMS 32
#define ATT_FINISH_GROUPS 8

extern "C" __launch_bounds__(ATT_FINISH_DIMS * ATT_FINISH_GROUPS) __global__ void attn_finish(
    const float* state, float* out, int n_splits, int width, int q_heads, int head_dim) {
    __shared__ float wgt[ATT_FINISH_MAX_SPLITS];
    __shared__ float part[ATT_FINISH_GROUPS][ATT_FINISH_DIMS];
    __shared__ float wred[2][ATT_FINISH_GROUPS];
    const int row = blockIdx.x;  // qi * q_heads + head
    const int tid = threadIdx.x, lane = tid & 31, grp = tid >> 5;
    const int rowlen = head_dim + 2;
    const u64 split_stride = (u64)width * q_heads * rowlen;
    const float* base = state + (u64)row * rowlen;
    const int n = min(n_splits, ATT_FINISH_MAX_SPLITS);
    const int nt = ATT_FINISH_DIMS * ATT_FINISH_GROUPS;
    float m = NEG_INF;
    for (int s = tid; s < n; s += nt) m = fmaxf(m, base[s * split_stride]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) wred[0][grp] = m;
    __syncthreads();
    float M = NEG_INF;
#pragma unroll
    for (int j = 0; j < ATT_FINISH_GROUPS; j++) M = fmaxf(M, wred[0][j]);
    float l = 0.0f;
    for (int s = tid; s < n; s += nt) {
        const float ms = base[s * split_stride];
        const float wv = (ms == NEG_INF || M == NEG_INF) ? 0.0f : exp2f(ms - M);
        wgt[s] = wv;
        l += base[s * split_stride + 1] * wv;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) wred[1][grp] = l;
    __syncthreads();  // wgt and the group sums visible
    float L = 0.0f;
#pragma unroll
    for (int j = 0; j < ATT_FINISH_GROUPS; j++) L += wred[1][j];
    const int d = blockIdx.y * ATT_FINISH_DIMS + lane;
    float a = 0.0f;
    if (d < head_dim) {
        const float* col = base + 2 + d;
#pragma unroll 4
        for (int s = grp; s < n; s += ATT_FINISH_GROUPS) a += col[s * split_stride] * wgt[s];
    }
    part[grp][lane] = a;
    __syncthreads();
    if (grp == 0 && d < head_dim) {
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < ATT_FINISH_GROUPS; j++) t += part[j][lane];
        out[(u64)row * head_dim + d] = L > 0.0f ? t * (1.0f / L) : 0.0f;
    }
}
