// Tensor-core decode GEMV for q4_g128 weights (T ≤ 8): y[T, N] = x[T, K] · w[N, K]ᵀ.
//
// Why: at 4 bits an H200 SM must retire ~34 weights per cycle to keep up with HBM, i.e. < 4
// lane-instructions per weight for dequantisation, the multiply and the x loads together. The
// SIMT GEMV (linear.cu) spends ~3.2 and is issue-bound at 37–42% of HBM (ncu). Here the products
// run on the tensor cores (mma.m16n8k16, bf16 in, f32 accumulate) and the dequantisation costs
// 11 instructions per 8 codes (~1.4 per weight): codes become exact bf16 values q - 8 with the
// magic-number trick ((n | 0x4300) as bf16 = 128 + n, then fma(·, 1, -136)).
//
// Precision: x enters as two bf16 terms x = hi + lo (|x - hi - lo| ≤ 2^-17 |x|, f32 range), each
// product code · (hi + lo) is exact in the f32 accumulator, the group's sum is scaled by the f32
// value of the group's f16 scale: per output ≲ 2^-16 · Σ|x·w| from the CPU's f32 result (tests
// bound it by 1e-4 · Σ|x·w|).
//
// The K permutation: a dot product does not depend on the order of k, so the k "slots" of an MMA
// fragment are assigned to whatever the cheapest loads give, and x is laid out to match. Lane
// (g = lane / 4, tq = lane % 4) loads 16 contiguous code bytes of a 128-group for row g and row
// g + 8 of its m-tile: the 32 codes k = 128·G + 32·tq + 8·w + e (word w, nibble e). For the
// k16-step (w, h) its A registers hold (e, e + 4) pairs: h = 0 → slots (2tq, 2tq+1) = codes (0, 4)
// and slots (2tq+8, 2tq+9) = codes (1, 5); h = 1 → (2, 6) and (3, 7). `gemv_q4mma_xprep` writes
// x in exactly that order (per token t, group G, lane-quarter tq: 8 uint4 of {hi, hi, lo, lo}),
// so the B fragment of a step is one 16-byte load, and the C fragment columns are the tokens.
//
// Work split: see the stream-K kernel below (`gemv_q4mmap*`). Each output column (token) is
// computed by the tensor core independently of the others, so row t of a T-row call is
// bit-identical to a 1-row call (MTP verification).

#define QM_WARPS 8

// Two floats as bf16x2, round to nearest even (`lo_val` in the low half).
__device__ __forceinline__ u32 qm_bf16x2(float lo_val, float hi_val) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi_val), "f"(lo_val));
    return r;
}

// x0, x1 → bf16x2 hi and lo terms (x = hi + lo to 2^-17 relative).
__device__ __forceinline__ void qm_split(float x0, float x1, u32& hi, u32& lo) {
    hi = qm_bf16x2(x0, x1);
    const float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xffff0000u);
    lo = qm_bf16x2(x0 - h0, x1 - h1);
}

// Nibbles at bits 0..3 and 16..19 of u (the rest masked off) → exact bf16x2 (n0 - 8, n1 - 8).
__device__ __forceinline__ u32 qm_deq(u32 u) {
    u32 h;
    asm("lop3.b32 %0, %1, 0x000f000f, 0x43004300, 0xea;" : "=r"(h) : "r"(u));  // (u & m) | c
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(0x3f803f80u), "r"(0xc308c308u));
    return r;
}

// q4_nl_g128 (`gemv_q4nlmmap*`, NL = true): the levels of codes e and e + 4 of a word as exact
// bf16x2 (|L| ≤ 127: 7 bits), from the table lookups s (codes 0..3) and t (codes 4..7) of the
// word (common.cuh); low half = code e, as qm_deq.
__device__ __forceinline__ u32 qm_nl_pair(u32 s, u32 t, int e) {
    const float lo = (float)(int)(i8)((s >> (8 * e)) & 0xffu);
    const float hi = (float)(int)(i8)((t >> (8 * e)) & 0xffu);
    return qm_bf16x2(lo, hi);
}

// D (f32x4) += A (bf16 16x16, row) * B (bf16 16x8, col).
__device__ __forceinline__ void qm_mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 qm_word(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// Programmatic dependent launch (sm_90): the x-prep kernels let the GEMV that follows them start
// at once (`qm_grid_launch_dependents`); the GEMV streams its first weights, then waits for the
// x-prep grid's completion and memory (`qm_grid_wait`) before it reads x. Both are no-ops for a
// kernel launched without the programmatic-serialization attribute. The GEMV itself triggers its
// dependents only implicitly, as its blocks exit: an explicit trigger once its first weights are in
// flight let the next GEMV's blocks start in this one's tail (-0.8 to -1.5 µs per call in a
// GEMV-after-GEMV chain) but made decode slower, +0.3 to +0.9% per 27B q4 step on an H100
// (session 17) and +3.7 / +4.7% at 8 / 32 Ki on an H200 (session 21): measured twice, dropped.
__device__ __forceinline__ void qm_grid_launch_dependents() { grid_launch_dependents(); }

__device__ __forceinline__ void qm_grid_wait() { grid_dependency_wait(); }

// Streaming 16-byte load (read once: no L1 allocation). QM_L2_HINT (0, 128 or 256; other values via
// KVSTREAM_NVRTC_DEFINES for A/B builds) asks L2 to fetch that many bytes around the address: a
// warp's next item is the same 16 rows' next 64-byte group, so the 128-byte fetch turns two
// half-line requests per row into one line. Measured (session 7, run 3, graph-timed T = 1):
// 248320×5120 63% → 81% of HBM, 17408×5120 46% → 50%, 5120×17408 40% → 44% (256: 80/48/45%).
#ifndef QM_L2_HINT
#define QM_L2_HINT 128
#endif
__device__ __forceinline__ uint4 qm_ld_stream(const u8* p) {
    uint4 v;
#if QM_L2_HINT == 256
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#elif QM_L2_HINT == 128
    asm volatile("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
    return v;
}

// x [T, K] f32 → xf [T][K/128][8][4] uint4 in the fragment order above: entry (t, G, j = 2w + h,
// tq). One thread per (t, group, tq, w): codes e = 0..7 of word w, as {hi(0,4), hi(1,5), lo(0,4),
// lo(1,5)} (step h = 0) and {hi(2,6), hi(3,7), lo(2,6), lo(3,7)} (step h = 1). The four lanes of a
// token column (tq = 0..3) read 64 contiguous bytes per step (no bank or sector conflicts).
// K % 128 == 0.
extern "C" __global__ void gemv_q4mma_xprep(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    qm_grid_launch_dependents();
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;  // = t * K/8 + k/8
    if (i >= (u64)T * (K / 8)) return;
    const float4 a = ((const float4*)x)[2 * i];
    const float4 b = ((const float4*)x)[2 * i + 1];
    u32 h04, l04, h15, l15, h26, l26, h37, l37;
    qm_split(a.x, b.x, h04, l04);
    qm_split(a.y, b.y, h15, l15);
    qm_split(a.z, b.z, h26, l26);
    qm_split(a.w, b.w, h37, l37);
    // i enumerates (t, G, tq, w): k/8 = 16·G + 4·tq + w, and i / 16 = t·K/128 + G.
    const u64 w = i & 3, tq = (i >> 2) & 3, base = (i >> 4) * 32;
    xf[base + (2 * w) * 4 + tq] = make_uint4(h04, h15, l04, l15);
    xf[base + (2 * w + 1) * 4 + tq] = make_uint4(h26, h37, l26, l37);
}

// Stages x fragments in shared memory: token t's `per` uint4 at xs[t · tstride], then a block
// barrier. Every copy is a cp.async issued before any is waited for, so the block waits one L2
// round trip (a load-then-store loop waited once per element: up to 18 round trips at K = 17408,
// seen in the SASS of session 9).
__device__ __forceinline__ void qp_stage_x(uint4* xs, const uint4* __restrict__ xf, int T, u32 per, u32 tstride) {
    for (int t = 0; t < T; t++) {
        for (u32 i = threadIdx.x; i < per; i += blockDim.x) {
            u32 d;
            asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(xs + t * tstride + i));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(xf + (u64)t * per + i) : "memory");
        }
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// ------------------------------------------------------------------------------------------------
// The GEMV (`gemv_q4mmap`, `gemv_q4mmap_xs`, and the 3-blocks-per-SM builds `gemv_q4mmap3*`):
// persistent stream-K, so every warp streams an equal share of the work without pause. (It
// replaced a one-tile-per-block kernel that measured slower on every shape, session 5.)
//
// Work: the items (16-row m-tile, 128-group), tile-major (item i = tile i / NG, group i % NG). The
// W = gridDim.x · QM_WARPS warps of the grid (the launcher: SMs × resident blocks, never a function
// of T) take equal contiguous ranges: warp w the items [w·Work/W, (w+1)·Work/W). A warp's items
// flow through a QP_P-stage register ring (codes and scales of QP_P items in flight) across tile
// boundaries. Per item two independent MMA chains (the hi and the lo halves of x) accumulate the
// group's products; the group sum (hi + lo) is scaled by the group's scale:
// acc = fmaf(d, hi + lo, acc), groups ascending. A tile wholly inside one warp's range is stored
// directly. A tile shared by warps w0 < w1 < ... (consecutive) is finished by the last of them to
// arrive: each writes its partial sums to its scratch slot (slot 0 for the first tile of its
// range, 1 for the last), fences (sk_fence; no fences under SK_FLAGS, common.cuh), and counts itself
// in the tile's counter; the warp that completes
// the count adds the partials in warp order ((p_w0 + p_w0+1) + ...), stores the tile and resets the
// counter to 0 (the launcher zeroes the counters once; every launch leaves them zero). The sums
// are therefore a function of N, K and W only: row t of a T-row call equals a 1-row call bit for
// bit (dead token columns read token 0's x and are never stored), whichever warp finishes.
// `_xs`: the x fragments are first staged in shared memory, token t at uint4 offset t·(NG·32 + 1);
// otherwise they are read from global memory (L1). Both read the same values.

// The split helpers `qp_start` / `qp_owner` are in common.cuh (shared with linear.cu's stream-K
// GEMV).

// Warps' partial-sum slots the finisher loads at once (sk_sum_slots; see QC_FIN_BATCH): qp_tile_done's
// B, 1 in the 3-blocks-per-SM builds (80 registers: they spill with more).
#ifndef QP_FIN_BATCH
#define QP_FIN_BATCH 4
#endif

// One warp's part of tile `ct` is done (its range [i0, i1) ends inside the tile or the tile ends):
// store the tile when the warp owns all of it, else publish the partial sums and let the last
// contributor add them in warp order (see above). C layout: acc[0], acc[1] = (row g, tokens 2tq,
// 2tq + 1); acc[2], acc[3] = (row g + 8, same tokens). Zeroes acc.
template <int B>
__device__ __forceinline__ void qp_tile_done(float* acc, u32 ct, u32 first_tile, u32 i0, u32 i1, u32 NG, u32 W,
                                             u32 work, u32 gw, int lane, int g, int tq, int T, u64 N,
                                             float* __restrict__ y, float* __restrict__ scratch,
                                             u32* __restrict__ counters) {
    const u64 r0 = (u64)ct * 16 + g;
    const int t0 = 2 * tq;
    const u32 tfirst = ct * NG, tlast = tfirst + NG - 1;
    if (tfirst >= i0 && tlast < i1) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u64 row = r0 + (i >= 2 ? 8 : 0);
            const int t = t0 + (i & 1);
            if (t < T && row < N) y[(u64)t * N + row] = acc[i];
        }
    } else {
        const u32 slot = ct == first_tile ? 0 : 1;
        float* mine = scratch + ((u64)gw * 2 + slot) * 128;
#pragma unroll
        for (int i = 0; i < 4; i++) sk_put(mine + i * 32 + lane, acc[i]);
        sk_fence();
        __syncwarp();
        const u32 w0 = qp_owner(tfirst, W, work), w1 = qp_owner(tlast, W, work);
        if (sk_arrive(&counters[ct], gw, w0, w1, lane)) {
            // The finisher: add the partials in warp order.
            sk_fence();
            float v[4];
            sk_sum_slots<4, B, 128>(scratch, w0, w1, qp_start(w0, W, work) < tfirst ? 1u : 0u, lane, v);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u64 row = r0 + (i >= 2 ? 8 : 0);
                const int t = t0 + (i & 1);
                if (t < T && row < N) y[(u64)t * N + row] = v[i];
            }
            sk_finished(&counters[ct], lane);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) acc[i] = 0.0f;
}

template <bool XS, int QP_P, bool NL = false>
__device__ __forceinline__ void q4mmap_body(const uint4* __restrict__ xf, const u8* __restrict__ w,
                                            float* __restrict__ y, int T, u64 K, u64 N, u64 soff,
                                            float* __restrict__ scratch, u32* __restrict__ counters) {
    extern __shared__ __align__(16) uint4 qp_xs[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const u32 NG = (u32)(K / 128);
    const u64 rb = K / 2;
    const u32 tiles = (u32)((N + 15) / 16);
    const u32 W = gridDim.x * QM_WARPS;
    const u32 gw = blockIdx.x * QM_WARPS + warp;
    const u32 work = tiles * NG;  // the launcher keeps it below 2^31
    const u32 tstride = XS ? NG * 32u + 1u : NG * 32u;
    // A warp without items (i0 == i1) computes pointers but loads nothing, then leaves after the
    // staging barrier.
    const u32 i0 = qp_start(gw, W, work), i1 = qp_start(gw + 1, W, work);
    const u32 first_tile = i0 / NG;
    // x fragments of token column g (dead columns g >= T read token 0; never stored).
    const uint4* xq = (XS ? (const uint4*)qp_xs : xf) + (u64)(g < T ? g : 0) * tstride + tq;

    // Load cursor: tile lt, group lg; pointers of rows g and g + 8 at group lg.
    u32 lt = first_tile, lg = i0 % NG;
    const u8* pa = w;
    const u8* pb = w;
    const u16* sa = (const u16*)(w + soff);
    const u16* sb = sa;
    auto bases = [&]() {
        const u64 na = (u64)lt * 16 + g, nb = na + 8;
        const u64 ra = na < N ? na : N - 1, rr = nb < N ? nb : N - 1;  // past N: re-read row N - 1
        pa = w + ra * rb + (u64)lg * 64 + tq * 16;
        pb = w + rr * rb + (u64)lg * 64 + tq * 16;
        sa = (const u16*)(w + soff) + ra * NG + lg;
        sb = (const u16*)(w + soff) + rr * NG + lg;
    };
    bases();
    uint4 ca[QP_P], cb[QP_P];
    u32 da[QP_P], db[QP_P];
    u32 issued = i0;
    auto load = [&](int s) {
        if (issued < i1) {
            ca[s] = qm_ld_stream(pa);
            cb[s] = qm_ld_stream(pb);
            da[s] = *sa;
            db[s] = *sb;
            issued++;
            if (++lg == NG) {
                lg = 0;
                lt++;
                if (issued < i1) bases();
            } else {
                pa += 64;
                pb += 64;
                sa += 1;
                sb += 1;
            }
        }
    };
#pragma unroll
    for (int s = 0; s < QP_P; s++) load(s);  // weights: independent of the previous kernel
    qm_grid_wait();                          // x from here on
    if (XS) qp_stage_x(qp_xs, xf, T, NG * 32u, tstride);
    if (i0 >= i1) return;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 ct = first_tile, cg = i0 % NG;
    const u32 total = i1 - i0;
    for (u32 j0 = 0; j0 < total; j0 += QP_P) {
#pragma unroll
        for (int s = 0; s < QP_P; s++) {
            if (j0 + s >= total) break;
            const uint4 va4 = ca[s], vb4 = cb[s];
            const float qa = f16_to_f32((u16)da[s]), qb = f16_to_f32((u16)db[s]);
            const uint4* xg = xq + (u64)cg * 32;
            float ch[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cl[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int wd = 0; wd < 4; wd++) {
                const u32 va = qm_word(va4, wd), vb = qm_word(vb4, wd);
                const uint4 x0 = xg[(2 * wd) * 4], x1 = xg[(2 * wd + 1) * 4];
                if (NL) {
                    const u32 sa = q4nl_lookup4(va), ta = q4nl_lookup4(va >> 16);
                    const u32 sb = q4nl_lookup4(vb), tb = q4nl_lookup4(vb >> 16);
                    u32 a0 = qm_nl_pair(sa, ta, 0), a1 = qm_nl_pair(sb, tb, 0);
                    u32 a2 = qm_nl_pair(sa, ta, 1), a3 = qm_nl_pair(sb, tb, 1);
                    qm_mma(ch, a0, a1, a2, a3, x0.x, x0.y);
                    qm_mma(cl, a0, a1, a2, a3, x0.z, x0.w);
                    a0 = qm_nl_pair(sa, ta, 2);
                    a1 = qm_nl_pair(sb, tb, 2);
                    a2 = qm_nl_pair(sa, ta, 3);
                    a3 = qm_nl_pair(sb, tb, 3);
                    qm_mma(ch, a0, a1, a2, a3, x1.x, x1.y);
                    qm_mma(cl, a0, a1, a2, a3, x1.z, x1.w);
                    continue;
                }
                u32 a0 = qm_deq(va), a1 = qm_deq(vb), a2 = qm_deq(va >> 4), a3 = qm_deq(vb >> 4);
                qm_mma(ch, a0, a1, a2, a3, x0.x, x0.y);
                qm_mma(cl, a0, a1, a2, a3, x0.z, x0.w);
                a0 = qm_deq(va >> 8);
                a1 = qm_deq(vb >> 8);
                a2 = qm_deq(va >> 12);
                a3 = qm_deq(vb >> 12);
                qm_mma(ch, a0, a1, a2, a3, x1.x, x1.y);
                qm_mma(cl, a0, a1, a2, a3, x1.z, x1.w);
            }
            load(s);  // refill this stage with the item QP_P further on (see q4i8p_body)
            acc[0] = fmaf(qa, ch[0] + cl[0], acc[0]);
            acc[1] = fmaf(qa, ch[1] + cl[1], acc[1]);
            acc[2] = fmaf(qb, ch[2] + cl[2], acc[2]);
            acc[3] = fmaf(qb, ch[3] + cl[3], acc[3]);
            if (++cg == NG || j0 + s + 1 == total) {
                qp_tile_done<(QP_P >= 4 ? QP_FIN_BATCH : 1)>(acc, ct, first_tile, i0, i1, NG, W, work, gw, lane, g, tq, T, N, y, scratch, counters);
                cg = 0;
                ct++;
            }
        }
    }
}

#define Q4MMAP_ARGS                                                                                   \
    const uint4 *xf, const u8 *w, float *y, int T, u64 K, u64 N, u64 soff, float *scratch, u32 *counters
#define Q4MMAP_PASS xf, w, y, T, K, N, soff, scratch, counters
// Two builds: 2 blocks per SM with a 4-stage ring (128 registers), 3 blocks per SM with a 2-stage
// ring (80 registers); the launcher sizes its grid and x staging for the one it runs.
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4mmap(Q4MMAP_ARGS) {
    q4mmap_body<false, 4>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4mmap_xs(Q4MMAP_ARGS) {
    q4mmap_body<true, 4>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 3) __global__ void gemv_q4mmap3(Q4MMAP_ARGS) {
    q4mmap_body<false, 2>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 3) __global__ void gemv_q4mmap3_xs(Q4MMAP_ARGS) {
    q4mmap_body<true, 2>(Q4MMAP_PASS);
}
// q4_nl_g128 builds (same shapes, x prepared by gemv_q4mma_xprep).
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nlmmap(Q4MMAP_ARGS) {
    q4mmap_body<false, 4, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nlmmap_xs(Q4MMAP_ARGS) {
    q4mmap_body<true, 4, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 3) __global__ void gemv_q4nlmmap3(Q4MMAP_ARGS) {
    q4mmap_body<false, 2, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 3) __global__ void gemv_q4nlmmap3_xs(Q4MMAP_ARGS) {
    q4mmap_body<true, 2, true>(Q4MMAP_PASS);
}

// ------------------------------------------------------------------------------------------------
// Integer tensor-core variant (`gemv_q4i8p*`): the same stream-K split, fix-up and register ring,
// but the products run as mma.m16n8k32.u8.s8 (exact int32) and a code costs 3/8 instruction to
// unpack instead of ~1.4, and one MMA covers 512 codes instead of 256.
//
// x: per (token t, 128-group G) `gemv_q4i8_xprep` rounds x to X = rint(x / xs) with the power of
// two xs = 2^(e − 22), amax < 2^e ≤ 2·amax, so |X| < 2^22 ≤ QI_M = 0x7f7f7f, and splits X exactly
// into three signed bytes X = 65536·x2 + 256·x1 + x0 (x0, x1, x2 in [-127, 127]): 22 significant
// bits relative to the group's largest |x|. A power of two keeps every scaling exact: values
// that are multiples of xs (one-hot, small integers) give exactly the CPU's f32(d)·q·x. Groups
// whose largest |x| is below 2^-127 get xs = 0 (their products flush to zero).
// Codes enter unsigned (u = q + 8 = the stored nibble, as u8), so per item and part p the MMA
// chain gives C_p = Σ u·x_p exactly, and the group's value is
//   Σ q·X = 65536·(C2 − 8·S2) + (256·C1 + C0 − 8·S10),  S2 = Σ x2, S10 = Σ (256·x1 + x0)
// (xprep stores −8·S2 and −8·S10); both brackets are exact int32 (|C2| ≤ 128·15·127), the f32
// combination rounds once, then acc = fmaf(v, xs·d, acc), groups ascending.
// Error per output ≤ Σ_G (xs_G / 2)·Σ_{k∈G}|w_k| + f32 rounding: ≤ 2^-22 of the group's largest |x|
// per weight (the split-bf16 kernel: 2^-17 of each |x|); NaN or ±inf in a group makes xs NaN.
//
// Fragments (m16n8k32, row.col): lane (g, tq) holds A bytes (row g: a0 = k-slots 4tq..4tq+3, a2 =
// 16+4tq..; row g + 8: a1, a3) and B bytes b0 = k-slots 4tq.., b1 = 16+4tq.. of token column g.
// Lane (g, tq) loads code bytes 16tq..16tq+15 of its rows' group, word wd = codes 32tq + 8wd + e
// (nibble e); step wd puts the even nibbles (word & 0x0f0f0f0f: e = 0, 2, 4, 6) in a0/a1 and the
// odd ones ((word >> 4) & 0x0f0f0f0f) in a2/a3, so b0 must hold x at k = 128G + 32tq + 8wd + 2j and
// b1 at ... + 2j + 1 (byte j). Per (t, G) xprep writes 25 uint4: [wd·4 + tq] = {x2.b0, x2.b1,
// x1.b0, x1.b1}; uint2 [32 + wd·4 + tq] (bytes 256..383) = {x0.b0, x0.b1}; [24] = {xs, −8·S2,
// −8·S10, 0}.
// QI_M, QI_U4 and QC_U4 are defined in common.cuh (the producers' fused x prep writes this layout).

// q4_nl_g128 (`gemv_q4nli8p*`, NL = true): the codes are looked up as int8 levels (common.cuh:
// one prmt pair per 4 codes) and enter mma.m16n8k32.s8.s8 signed, so no offset is folded in
// (xprep stores 0 for −8·S2 and −8·S10; |C2| ≤ 128·127·127, 256·C1 + C0 < 2^30: exact int32).
// The lookup takes 4 consecutive codes per selector (the low or high 16 bits of a code word), so
// A byte j of a0 (a2) is code e = j (e = 4 + j) of word wd, and b0 (b1) holds x at
// k = 128G + 32tq + 8wd + j (+ 4): xprep packs the NL fragments in that order.

// x [T, K] f32 → the fragments above, one warp per (t, G) (K % 128 == 0, x 16-byte aligned):
// `q4i8_prep_group` (common.cuh) on the group's 128 values.
// COLS: the column-packed layout of `gemv_q4i8c*` (see there) instead, QC_U4 uint4 per (t, G).
template <bool NL, bool COLS = false>
__device__ __forceinline__ void q4i8_xprep_body(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    qm_grid_launch_dependents();
    const u64 gi = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;  // t·NG + G
    const int lane = threadIdx.x & 31;
    if (gi >= (u64)T * (K / 128)) return;  // warp-uniform
    const float4 v = ((const float4*)(x + gi * 128))[lane];
    q4i8_prep_group<NL, COLS>(v, xf + gi * (COLS ? QC_U4 : QI_U4), lane);
}

extern "C" __global__ void gemv_q4i8_xprep(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    q4i8_xprep_body<false>(x, xf, T, K);
}
extern "C" __global__ void gemv_q4nl_i8_xprep(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    q4i8_xprep_body<true>(x, xf, T, K);
}

// D (s32x4) += A (u8 16x32, row) * B (s8 32x8, col).
__device__ __forceinline__ void qi_mma(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D (s32x4) += A (s8 16x32, row) * B (s8 32x8, col).
__device__ __forceinline__ void qi_mma_s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The group value of C element i (see above) for the token whose metadata is m.
__device__ __forceinline__ float qi_value(const int* c2, const int* c1, const int* c0, int i, const uint4& m) {
    const int hi = c2[i] + (int)m.y;
    const int lo = c1[i] * 256 + c0[i] + (int)m.z;
    return __fmaf_rn(__int2float_rn(hi), 65536.0f, __int2float_rn(lo));
}

// ODD: compute the odd token columns (2tq + 1) too; the T = 1 builds skip them (column 2tq gets
// the same instructions either way). NL: q4_nl_g128 codes (table lookup, s8 MMA; see above).
template <bool XS, int QP_P, bool ODD, bool NL = false>
__device__ __forceinline__ void q4i8p_body(const uint4* __restrict__ xf, const u8* __restrict__ w,
                                           float* __restrict__ y, int T, u64 K, u64 N, u64 soff,
                                           float* __restrict__ scratch, u32* __restrict__ counters) {
    extern __shared__ __align__(16) uint4 qp_xs[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const u32 NG = (u32)(K / 128);
    const u64 rb = K / 2;
    const u32 tiles = (u32)((N + 15) / 16);
    const u32 W = gridDim.x * QM_WARPS;
    const u32 gw = blockIdx.x * QM_WARPS + warp;
    const u32 work = tiles * NG;
    const u32 per = NG * QI_U4;
    const u32 tstride = XS ? per + 1u : per;
    // A warp without items (i0 == i1) computes pointers but loads nothing, then leaves after the
    // staging barrier.
    const u32 i0 = qp_start(gw, W, work), i1 = qp_start(gw + 1, W, work);
    const u32 first_tile = i0 / NG;
    const uint4* xsrc = XS ? (const uint4*)qp_xs : xf;
    // B fragments: token column g; metadata: the C columns 2tq, 2tq + 1 (dead ones read token 0).
    const uint4* xb = xsrc + (u64)(g < T ? g : 0) * tstride;
    const int ta = 2 * tq, tb = 2 * tq + 1;
    const uint4* ma = xsrc + (u64)(ta < T ? ta : 0) * tstride + 24;
    const uint4* mb = xsrc + (u64)(tb < T ? tb : 0) * tstride + 24;

    u32 lt = first_tile, lg = i0 % NG;
    const u8* pa = w;
    const u8* pb = w;
    const u16* sa = (const u16*)(w + soff);
    const u16* sb = sa;
    auto bases = [&]() {
        const u64 na = (u64)lt * 16 + g, nb = na + 8;
        const u64 ra = na < N ? na : N - 1, rr = nb < N ? nb : N - 1;  // past N: re-read row N - 1
        pa = w + ra * rb + (u64)lg * 64 + tq * 16;
        pb = w + rr * rb + (u64)lg * 64 + tq * 16;
        sa = (const u16*)(w + soff) + ra * NG + lg;
        sb = (const u16*)(w + soff) + rr * NG + lg;
    };
    bases();
    uint4 ca[QP_P], cb[QP_P];
    u32 da[QP_P], db[QP_P];
    u32 issued = i0;
    auto load = [&](int s) {
        if (issued < i1) {
            ca[s] = qm_ld_stream(pa);
            cb[s] = qm_ld_stream(pb);
            da[s] = *sa;
            db[s] = *sb;
            issued++;
            if (++lg == NG) {
                lg = 0;
                lt++;
                if (issued < i1) bases();
            } else {
                pa += 64;
                pb += 64;
                sa += 1;
                sb += 1;
            }
        }
    };
#pragma unroll
    for (int s = 0; s < QP_P; s++) load(s);  // weights: independent of the previous kernel
    qm_grid_wait();                          // x from here on
    if (XS) qp_stage_x(qp_xs, xf, T, per, tstride);
    if (i0 >= i1) return;

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 ct = first_tile, cg = i0 % NG;
    const u32 total = i1 - i0;
    for (u32 j0 = 0; j0 < total; j0 += QP_P) {
#pragma unroll
        for (int s = 0; s < QP_P; s++) {
            if (j0 + s >= total) break;
            const uint4 va4 = ca[s], vb4 = cb[s];
            const float qa = f16_to_f32((u16)da[s]), qb = f16_to_f32((u16)db[s]);
            const uint4* xg = xb + (u64)cg * QI_U4;
            int c2[4] = {0, 0, 0, 0}, c1[4] = {0, 0, 0, 0}, c0[4] = {0, 0, 0, 0};
#pragma unroll
            for (int wd = 0; wd < 4; wd++) {
                const u32 va = qm_word(va4, wd), vb = qm_word(vb4, wd);
                const uint4 p21 = xg[wd * 4 + tq];
                const uint2 p0 = ((const uint2*)(xg + 16))[wd * 4 + tq];
                if (NL) {
                    const u32 a0 = q4nl_lookup4(va), a1 = q4nl_lookup4(vb);
                    const u32 a2 = q4nl_lookup4(va >> 16), a3 = q4nl_lookup4(vb >> 16);
                    qi_mma_s8(c2, a0, a1, a2, a3, p21.x, p21.y);
                    qi_mma_s8(c1, a0, a1, a2, a3, p21.z, p21.w);
                    qi_mma_s8(c0, a0, a1, a2, a3, p0.x, p0.y);
                } else {
                    const u32 a0 = va & 0x0f0f0f0fu, a1 = vb & 0x0f0f0f0fu;
                    const u32 a2 = (va >> 4) & 0x0f0f0f0fu, a3 = (vb >> 4) & 0x0f0f0f0fu;
                    qi_mma(c2, a0, a1, a2, a3, p21.x, p21.y);
                    qi_mma(c1, a0, a1, a2, a3, p21.z, p21.w);
                    qi_mma(c0, a0, a1, a2, a3, p0.x, p0.y);
                }
            }
            // Refill this stage with the item QP_P further on once its codes are unpacked: the
            // load then writes the registers it frees (issued before the unpacking, it needed a
            // second set of ring registers, which the rolled loop copied back every trip: ~8
            // moves per item and a spill).
            load(s);
            const uint4 m0 = ma[(u64)cg * QI_U4];
            const float xa = __uint_as_float(m0.x);
            acc[0] = fmaf(qi_value(c2, c1, c0, 0, m0), __fmul_rn(xa, qa), acc[0]);
            acc[2] = fmaf(qi_value(c2, c1, c0, 2, m0), __fmul_rn(xa, qb), acc[2]);
            if (ODD) {
                const uint4 m1 = mb[(u64)cg * QI_U4];
                const float xb1 = __uint_as_float(m1.x);
                acc[1] = fmaf(qi_value(c2, c1, c0, 1, m1), __fmul_rn(xb1, qa), acc[1]);
                acc[3] = fmaf(qi_value(c2, c1, c0, 3, m1), __fmul_rn(xb1, qb), acc[3]);
            }
            if (++cg == NG || j0 + s + 1 == total) {
                qp_tile_done<QP_FIN_BATCH>(acc, ct, first_tile, i0, i1, NG, W, work, gw, lane, g, tq, T, N, y, scratch, counters);
                cg = 0;
                ct++;
            }
        }
    }
}

// Builds: every T (`gemv_q4i8p`) and T = 1 only (`gemv_q4i8p1`, even columns), x read from global
// memory or staged (`_xs`); 2 blocks of 8 warps per SM, 4-stage ring.
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8p(Q4MMAP_ARGS) {
    q4i8p_body<false, 4, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8p_xs(Q4MMAP_ARGS) {
    q4i8p_body<true, 4, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8p1(Q4MMAP_ARGS) {
    q4i8p_body<false, 4, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8p1_xs(Q4MMAP_ARGS) {
    q4i8p_body<true, 4, false>(Q4MMAP_PASS);
}

// q4_nl_g128 builds of the integer kernel (same shapes as gemv_q4i8p*).
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8p(Q4MMAP_ARGS) {
    q4i8p_body<false, 4, true, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8p_xs(Q4MMAP_ARGS) {
    q4i8p_body<true, 4, true, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8p1(Q4MMAP_ARGS) {
    q4i8p_body<false, 4, false, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8p1_xs(Q4MMAP_ARGS) {
    q4i8p_body<true, 4, false, true>(Q4MMAP_PASS);
}

// ------------------------------------------------------------------------------------------------
// Column-packed integer variant (`gemv_q4i8c*`): the codes, the A fragments, the stream-K split and
// the register ring of `gemv_q4i8p*`, but the three bytes of x travel in the MMA's B columns
// instead of three MMAs: at T = 1 a word costs one mma.m16n8k32 (was three) and one 8-byte B load
// (was 24 bytes), and a 2-token pair fits one MMA too. The T = 1 kernel is issue-bound (ncu,
// session 8: ~153 warp-instructions per 2,048-code item), so instructions are the currency.
//
// B columns of token pair p (tokens 2p, 2p + 1; dead tokens read token 0, never stored): column
// 4h + c holds part c of token 2p + h: c = 0 → x1, 1 → x0, 2 → x2, 3 → x1 again (a copy: no
// storage for a zero column). Lane (g, tq) loads the B fragment of column g, so C lane (g, tq) gets
// columns 2tq, 2tq + 1 of rows g and g + 8:
// even tq → (C1, C0) of token 2p + tq/2: v = 256·C1 + C0 − 8·S10 (exact int32), scale xs·d;
// odd tq  → (C2, C1):                    v = C2 − 8·S2 (exact, |v| < 2^24),  scale 65536·xs·d.
// One code path for both: v = C[col 2tq]·mul + C[col 2tq + 1]·mul1 + corr, (mul, mul1) = (256, 1)
// or (1, 0) per lane, corr and the scale from the lane's metadata entry. Each lane accumulates acc = fmaf(f32(v), xs'·d, acc)
// over its groups (ascending); a tile's output is acc_even + acc_odd of the lane pair (then the
// stream-K partials of its warps in warp order). Per token the arithmetic depends only on its own
// columns and lanes, so a row of a T-row call equals a 1-row call bit for bit.
//
// xprep layout (QC_U4 = 25 uint4 per (t, G), the size of gemv_q4i8p's), as uint2: [wd·12 + c·4 +
// tq] = {b0, b1} of part c < 3 (the byte order of gemv_q4i8p's b0/b1), [48] = {f32 xs, −8·S10},
// [49] = {f32 65536·xs, −8·S2} (q4_nl: corrections 0, parts s8 in its lookup order).
// The end of a warp's part of a tile (see qp_tile_done for the stream-K split), in pieces: the
// lane pairs are added first
// (`qc_pair_sums`), then the tile is stored (`qc_store`, the warp owns it all) or its partials
// written to the warp's scratch slot (`qc_publish`: slot 0 for the first tile of the range, 1 for
// the last), made visible by one fence, and counted in the tile's counter (`qc_arrive`), where the
// last of the tile's warps to arrive adds the partials in warp order and stores the tile. Even
// lanes store token 2p + tq/2, rows g (v[p][0]) and g + 8 (v[p][1]).
#define QC_SLOT 256  // floats per scratch slot: 4 pairs × 2 rows × 32 lanes

// QC_FIN_BATCH: partial-sum slots the finisher of a shared tile loads at once, for one token pair
// (QC_FIN_BATCH / NP slots for NP pairs). One slot at a time (an L2 round trip per contributing
// warp, ~7 warps per tile on the 5120-row shapes) cost 27B q4_g128 decode 3.5–3.9% per step and
// the out projection 38% → 47% of HBM (H100, session 17).
#ifndef QC_FIN_BATCH
#define QC_FIN_BATCH 8
#endif

// An opaque copy of v: the compiler must keep it in a register rather than recompute it.
__device__ __forceinline__ u32 qc_keep(u32 v) {
    asm volatile("" : "+r"(v));
    return v;
}

template <int NP>
__device__ __forceinline__ void qc_pair_sums(const float (*acc)[2], float (*v)[2]) {
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int i = 0; i < 2; i++) v[p][i] = acc[p][i] + __shfl_xor_sync(0xffffffffu, acc[p][i], 1);
}

template <int NP>
__device__ __forceinline__ void qc_store(const float (*v)[2], u32 ct, int g, int tq, int T, u64 N,
                                         float* __restrict__ y) {
    const u64 r0 = (u64)ct * 16 + g;
    if (tq & 1) return;
#pragma unroll
    for (int p = 0; p < NP; p++) {
        const int t = 2 * p + (tq >> 1);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u64 row = r0 + 8 * i;
            if (t < T && row < N) y[(u64)t * N + row] = v[p][i];
        }
    }
}

template <int NP>
__device__ __forceinline__ void qc_publish(const float (*v)[2], u32 slot, u32 gw, int lane,
                                           float* __restrict__ scratch) {
    float* mine = scratch + ((u64)gw * 2 + slot) * QC_SLOT;
#pragma unroll
    for (int p = 0; p < NP; p++)
#pragma unroll
        for (int i = 0; i < 2; i++) sk_put(mine + (p * 2 + i) * 32 + lane, v[p][i]);
}

// After qc_publish and a fence: count this warp in tile ct; the finisher (sk_arrive) adds the partials.
template <int NP>
__device__ __forceinline__ void qc_arrive(u32 ct, u32 NG, u32 W, u32 work, u32 gw, int lane, int g, int tq, int T,
                                          u64 N, float* __restrict__ y, float* __restrict__ scratch,
                                          u32* __restrict__ counters) {
    const u32 tfirst = ct * NG, tlast = tfirst + NG - 1;
    const u32 w0 = qp_owner(tfirst, W, work), w1 = qp_owner(tlast, W, work);
    if (!sk_arrive(&counters[ct], gw, w0, w1, lane)) return;
    // The finisher: add the partials in warp order.
    sk_fence();
    // QC_FIN_BATCH / NP warps' slots per batch of loads (sk_sum_slots, common.cuh); one at a time
    // for 4 pairs, whose _xs build spills with more.
    float s[NP][2];
    constexpr int B = NP >= 4 ? 1 : (QC_FIN_BATCH / NP > 0 ? QC_FIN_BATCH / NP : 1);
    sk_sum_slots<NP * 2, B, QC_SLOT>(scratch, w0, w1, qp_start(w0, W, work) < tfirst ? 1u : 0u, lane, &s[0][0]);
    qc_store<NP>(s, ct, g, tq, T, N, y);
    sk_finished(&counters[ct], lane);
}

// Lane constants of the column-packed kernels: uint2 offsets (from a group's block of token 0) of
// lane (g, tq)'s B fragments and metadata per token pair (dead tokens read token 0), and its
// (mul, mul1) (see the layout above). They pass through qc_keep: otherwise NVRTC recomputes them
// from %tid in every item (seen in the SASS).
template <int NP>
__device__ __forceinline__ void qc_lane_offsets(int g, int tq, int T, u32 tstride, u32* xoff, u32* moff, int& mul,
                                                int& mul1) {
#pragma unroll
    for (int p = 0; p < NP; p++) {
        const int tb = 2 * p + (g >> 2), tm = 2 * p + (tq >> 1);
        xoff[p] = qc_keep((u32)(tb < T ? tb : 0) * tstride * 2 + ((g & 3) == 3 ? 0 : (g & 3)) * 4 + tq);
        moff[p] = qc_keep((u32)(tm < T ? tm : 0) * tstride * 2 + 48 + (tq & 1));
    }
    mul = (int)qc_keep((tq & 1) ? 1u : 256u);
    mul1 = (int)qc_keep((tq & 1) ? 0u : 1u);
}

// One item of the column-packed kernels (`gemv_q4i8c*`, `gemv_q4i8t*`), in two halves so the
// stream-K kernel can refill its register ring between them: the MMAs of the item's four code
// words (codes of rows g, g + 8 in va4, vb4; x fragments of the group at xg) into c, then the
// group's value per token pair scaled into acc (see the layout above).
template <int NP, bool NL>
__device__ __forceinline__ void qc_item_mmas(const uint4& va4, const uint4& vb4, const uint2* xg, const u32* xoff,
                                             int (*c)[4]) {
#pragma unroll
    for (int p = 0; p < NP; p++) c[p][0] = c[p][1] = c[p][2] = c[p][3] = 0;
#pragma unroll
    for (int wd = 0; wd < 4; wd++) {
        const u32 va = qm_word(va4, wd), vb = qm_word(vb4, wd);
        u32 a0, a1, a2, a3;
        if (NL) {
            a0 = q4nl_lookup4(va);
            a1 = q4nl_lookup4(vb);
            a2 = q4nl_lookup4(va >> 16);
            a3 = q4nl_lookup4(vb >> 16);
        } else {
            a0 = va & 0x0f0f0f0fu;
            a1 = vb & 0x0f0f0f0fu;
            a2 = (va >> 4) & 0x0f0f0f0fu;
            a3 = (vb >> 4) & 0x0f0f0f0fu;
        }
#pragma unroll
        for (int p = 0; p < NP; p++) {
            const uint2 b = (xg + xoff[p])[wd * 12];
            if (NL) {
                qi_mma_s8(c[p], a0, a1, a2, a3, b.x, b.y);
            } else {
                qi_mma(c[p], a0, a1, a2, a3, b.x, b.y);
            }
        }
    }
}

template <int NP>
__device__ __forceinline__ void qc_item_acc(const int (*c)[4], const uint2* xg, const u32* moff, int mul, int mul1,
                                            float qa, float qb, float (*acc)[2]) {
#pragma unroll
    for (int p = 0; p < NP; p++) {
        const uint2 m = *(xg + moff[p]);
        const float xsc = __uint_as_float(m.x);
        const int va = c[p][0] * mul + c[p][1] * mul1 + (int)m.y;
        const int vb = c[p][2] * mul + c[p][3] * mul1 + (int)m.y;
        acc[p][0] = fmaf(__int2float_rn(va), __fmul_rn(xsc, qa), acc[p][0]);
        acc[p][1] = fmaf(__int2float_rn(vb), __fmul_rn(xsc, qb), acc[p][1]);
    }
}

// NP token pairs (T ≤ 2·NP); NL: q4_nl_g128 codes (table lookup, s8 MMA).
template <bool XS, int QP_P, int NP, bool NL>
__device__ __forceinline__ void q4i8c_body(const uint4* __restrict__ xf, const u8* __restrict__ w,
                                           float* __restrict__ y, int T, u64 K, u64 N, u64 soff,
                                           float* __restrict__ scratch, u32* __restrict__ counters) {
    extern __shared__ __align__(16) uint4 qp_xs[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const u32 NG = (u32)(K / 128);
    const u64 rb = K / 2;
    const u32 tiles = (u32)((N + 15) / 16);
    const u32 W = gridDim.x * QM_WARPS;
    const u32 gw = blockIdx.x * QM_WARPS + warp;
    const u32 work = tiles * NG;
    const u32 per = NG * QC_U4;
    const u32 tstride = XS ? per + 1u : per;
    const u32 i0 = qp_start(gw, W, work), i1 = qp_start(gw + 1, W, work);
    const u32 first_tile = i0 / NG;
    const uint2* x2 = (const uint2*)(XS ? (const uint4*)qp_xs : xf);
    u32 xoff[NP], moff[NP];
    int mul, mul1;
    qc_lane_offsets<NP>(g, tq, T, tstride, xoff, moff, mul, mul1);

    u32 lt = first_tile, lg = i0 % NG;
    const u8* pa = w;
    const u8* pb = w;
    const u16* sa = (const u16*)(w + soff);
    const u16* sb = sa;
    auto bases = [&]() {
        const u64 na = (u64)lt * 16 + g, nb = na + 8;
        const u64 ra = na < N ? na : N - 1, rr = nb < N ? nb : N - 1;  // past N: re-read row N - 1
        pa = w + ra * rb + (u64)lg * 64 + tq * 16;
        pb = w + rr * rb + (u64)lg * 64 + tq * 16;
        sa = (const u16*)(w + soff) + ra * NG + lg;
        sb = (const u16*)(w + soff) + rr * NG + lg;
    };
    bases();
    uint4 ca[QP_P], cb[QP_P];
    u32 da[QP_P], db[QP_P];
    u32 issued = i0;
    auto load = [&](int s) {
        if (issued < i1) {
            ca[s] = qm_ld_stream(pa);
            cb[s] = qm_ld_stream(pb);
            da[s] = *sa;
            db[s] = *sb;
            issued++;
            if (++lg == NG) {
                lg = 0;
                lt++;
                if (issued < i1) bases();
            } else {
                pa += 64;
                pb += 64;
                sa += 1;
                sb += 1;
            }
        }
    };
#pragma unroll
    for (int s = 0; s < QP_P; s++) load(s);  // weights: independent of the previous kernel
    qm_grid_wait();                          // x from here on
    if (XS) qp_stage_x(qp_xs, xf, T, per, tstride);
    if (i0 >= i1) return;

    float acc[NP][2];
#pragma unroll
    for (int p = 0; p < NP; p++) acc[p][0] = acc[p][1] = 0.0f;
    u32 ct = first_tile, cg = i0 % NG;
    const uint2* xg = x2 + cg * (QC_U4 * 2);  // group cg of token 0
    const u32 total = i1 - i0;
    for (u32 j0 = 0; j0 < total; j0 += QP_P) {
#pragma unroll
        for (int s = 0; s < QP_P; s++) {
            if (j0 + s >= total) break;
            const uint4 va4 = ca[s], vb4 = cb[s];
            const float qa = f16_to_f32((u16)da[s]), qb = f16_to_f32((u16)db[s]);
            int c[NP][4];
            qc_item_mmas<NP, NL>(va4, vb4, xg, xoff, c);
            load(s);  // refill this stage once its codes are unpacked (see q4i8p_body)
            qc_item_acc<NP>(c, xg, moff, mul, mul1, qa, qb, acc);
            xg += QC_U4 * 2;
            if (++cg == NG || j0 + s + 1 == total) {
                const u32 tfirst = ct * NG;
                const bool whole = tfirst >= i0 && tfirst + NG - 1 < i1;
                float v[NP][2];
                qc_pair_sums<NP>(acc, v);
                if (whole) {
                    qc_store<NP>(v, ct, g, tq, T, N, y);
                } else {
                    qc_publish<NP>(v, ct == first_tile ? 0 : 1, gw, lane, scratch);
                }
                if (!whole) {
                    sk_fence();
                    __syncwarp();
                    qc_arrive<NP>(ct, NG, W, work, gw, lane, g, tq, T, N, y, scratch, counters);
                }
#pragma unroll
                for (int p = 0; p < NP; p++) acc[p][0] = acc[p][1] = 0.0f;
                cg = 0;
                xg = x2;
                ct++;
            }
        }
    }
}

extern "C" __global__ void gemv_q4i8c_xprep(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    q4i8_xprep_body<false, true>(x, xf, T, K);
}
extern "C" __global__ void gemv_q4nl_i8c_xprep(const float* __restrict__ x, uint4* __restrict__ xf, int T, u64 K) {
    q4i8_xprep_body<true, true>(x, xf, T, K);
}

// Builds: 1, 2 and 4 token pairs (T ≤ 2, 4, 8), x read from global memory or staged (`_xs`);
// 2 blocks of 8 warps per SM, 4-stage ring (3 stages for 4 pairs reading x from global memory:
// 4 spill). The ring depth moves loads only, never the arithmetic. A 6-stage ring in the 1-pair
// builds (126 registers, no spills) was no faster on an H100 (session 17) nor on an H200 (session
// 20: -1 to -3 points of HBM on five of the six 27B shapes), so every 1-pair build keeps 4.
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c1(Q4MMAP_ARGS) {
    q4i8c_body<false, 4, 1, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c1_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 1, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c2(Q4MMAP_ARGS) {
    q4i8c_body<false, 4, 2, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c2_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 2, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c4(Q4MMAP_ARGS) {
    q4i8c_body<false, 3, 4, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4i8c4_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 4, false>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c1(Q4MMAP_ARGS) {
    q4i8c_body<false, 4, 1, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c1_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 1, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c2(Q4MMAP_ARGS) {
    q4i8c_body<false, 4, 2, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c2_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 2, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c4(Q4MMAP_ARGS) {
    q4i8c_body<false, 3, 4, true>(Q4MMAP_PASS);
}
extern "C" __launch_bounds__(QM_WARPS * 32, 2) __global__ void gemv_q4nli8c4_xs(Q4MMAP_ARGS) {
    q4i8c_body<true, 4, 4, true>(Q4MMAP_PASS);
}

// ------------------------------------------------------------------------------------------------
// Tile-owning variant (`gemv_q4i8t*`, q4_nl_g128 `gemv_q4nli8t*`): the column-packed arithmetic of
// `gemv_q4i8c*` per item, but a different way to the weights and a different split.
//
// Why: on the mid-size 27B shapes (5120×6144 … 16384×5120: 16–42 MB, 4–10 µs at HBM speed) the
// stream-K register-ring kernel pays ~4 µs per call that is not bandwidth (session 21's fit): its
// warps hold 4 items (4 KiB) each, cannot start before the previous kernel's blocks leave (128
// registers × 512 threads fill the register file), and ~7 warps share each tile (a global fix-up).
// Here one thread per block streams whole 16-row tiles into a ring of shared-memory stages with
// bulk copies (cp.async.bulk, Hopper's TMA unit): a tile's codes are 16 · K/2 contiguous bytes and
// its scales 16 · K/128 · 2, two copies per tile (a first version copied 16-row × 8-group chunks,
// 32 copies of 16–512 bytes each, and ran at half the stream-K kernel's speed on an H100: the
// copy unit's rate per operation, not the bytes, was the limit). A block owns whole tiles, so no
// tile is shared between blocks (no scratch, counters or fences), and up to ~200 KiB of weights
// per SM are requested before x exists.
//
// Block: 2 consumer groups of QT_GW = 8 warps + 1 producer warp, one block per SM. Block b owns
// tiles [b·tiles/B, (b+1)·tiles/B); tile tl of the block goes to group tl % 2. A stage holds
// `chunk` groups of a tile: the whole tile (two copies) where two such stages fit the SM (K ≤ 6144),
// else a divisor of K/128 (the down projection, K = 17408: two halves of 68 groups, sixteen
// 4,352-byte row copies each) — and always the tile's whole scales (one copy; the second half
// carries them again, +3% bytes). Warp wi of the group takes each stage's groups wi, wi + 8, …
// (the item of `gemv_q4i8c*`: rows g, g + 8, 16 code bytes each per lane; K % 1024 == 0) and
// accumulates the tile's groups in that fixed order. At the end of a tile the group's 8 pair sums meet in shared
// memory (double-buffered per group, one named barrier per tile and group) and warp
// (tile / 2) % 8 adds them in warp order and stores. So an output is a function of N and K only
// (not of T, the grid or whether x is staged): row t of a T-row call equals a 1-row call bit for
// bit. (Rows of a stage are dense at K/2 bytes: the code loads of rows g and g + 1 share banks,
// two wavefronts per quarter warp.)
//
// Barriers: full[s] (1 arrival, the producer's expect_tx; the copies complete the bytes), empty[s]
// (QT_GW arrivals, one per warp of the consuming group once its lanes have read the stage). Round
// r of slot s waits full[s] phase r (parity r & 1); the producer refills slot s for round r only
// after empty[s] phase r - 1. Each group has its own slots (qt_slot).
#define QT_GW 8
#define QT_THREADS ((2 * QT_GW + 1) * 32)

// Ring slots are per group (S even): the j-th stage of group grp (the stages of its tiles, in
// order) takes slot 2·(j % (S/2)) + grp in round j / (S/2). A slot shared by both groups would let
// a group wait for a round two phases ahead of the barrier (the other group's stage between them
// not yet landed), which a parity wait mistakes for the phase before: the first version of this
// kernel (slot tile % S, S odd at T = 4) read stale tiles and faulted on an H100 (clean under
// memcheck, which serialises). scripts/q4_tiles_sim.py checks the mapping.
__device__ __forceinline__ u32 qt_slot(u32 j, u32 grp, int S) { return 2u * (j % ((u32)S >> 1)) + grp; }
__device__ __forceinline__ u32 qt_round(u32 j, int S) { return j / ((u32)S >> 1); }

// QT_SHARE=1 (A/B define, off by default): both groups read every stage — all 16 consumer warps
// share each tile (warp w takes the stage's groups w, w + 16, …) and the 16 pair sums meet per
// tile — so a block's last tile is not one group's alone (a block of 3 tiles: 1.5 tiles' compute
// per warp instead of 2). The ring is then one sequence: the block's i-th stage takes slot i % S
// in round i / S, and a slot is empty after all 16 warps' arrivals (each warp waits for every
// stage in order, so no wait can run two phases ahead; scripts/q4_tiles_sim.py checks it).
#ifndef QT_SHARE
#define QT_SHARE 0
#endif
#define QT_CW (QT_SHARE ? 2 * QT_GW : QT_GW)  // consumer warps per tile (and empty[] arrivals)

// Slot and round of stage c of the block's tile tl (`nch` stages per tile; the block's first tile
// starts at its stage `skip`, nonzero only for a split range, below).
__device__ __forceinline__ void qt_place(u32 tl, u32 c, u32 nch, u32 skip, int S, u32& slot, u32& round) {
    if (QT_SHARE) {
        const u32 i = tl * nch + c - skip;
        slot = i % (u32)S;
        round = i / (u32)S;
    } else {
        const u32 j = (tl >> 1) * nch + c;
        slot = qt_slot(j, tl & 1u, S);
        round = qt_round(j, S);
    }
}

// Split ranges (`scratch` non-null, QT_SHARE builds; the launcher's `KVSTREAM_Q4_TILES_SPLIT`):
// whole tiles per block leave blocks unequal where tiles / B is just above an integer (the 27B
// out and down projections: 320 tiles on 132 SMs, 2.42 per block, so the blocks of 3 set the
// time: 81% of an even share). Then the block ranges are equal runs of stages instead, [b·U/B,
// (b+1)·U/B) of the U = tiles · NCH stages in tile order (the launcher cuts such shapes into
// smaller stages, e.g. half tiles), and every range holds at least NCH stages, so a tile is shared
// by at most two neighbouring blocks: block b's range ends in it (its first stages, "part A") and
// block b + 1's begins in it (part B). Block b publishes part A's sums into scratch slot b + 1
// when it reaches that tile (its last); block b + 1 keeps part B's sums (it reads that tile first)
// and, after its whole range, waits for part A, adds A + B and stores. A block waits only for the
// block before it, which the hardware schedules first, so even a grid that is not wholly resident
// cannot deadlock. The hand-off needs no fence: common.cuh's slot_put / slot_load / slot_settle
// (a value is empty while it holds SK_EMPTY, a NaN bit pattern float arithmetic never produces;
// the launcher fills a new scratch buffer with 0xff bytes, its own buffer whatever SK_FLAGS is,
// and every launch takes every value it publishes). The sums are a function of N, K and B, never
// of T.
#define QT_SPLIT_SLOT 256  // floats per scratch slot: NP · 2 values per lane, NP ≤ 4

// `bytes` (a multiple of 16) from global src to shared dst (both 16-byte aligned), counted on the
// mbarrier at `bar`.
__device__ __forceinline__ void qt_bulk(u32 dst, const u8* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Named barriers among consumer warps only (the producer never joins): 1 + group for one group's
// 8 warps, 3 for both groups.
__device__ __forceinline__ void qt_group_sync(int grp) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + grp), "n"(QT_GW * 32) : "memory");
}
__device__ __forceinline__ void qt_consumers_sync() {
    asm volatile("bar.sync 3, %0;\n" ::"n"(2 * QT_GW * 32) : "memory");
}

// Shared memory: full[S], empty[S] (u64), the tile sums [2 groups][2][QT_GW][NP·64] floats, x (XS:
// T rows of `tstride` uint4), then the ring at `ring_off`: S stages of `stage_bytes` (a chunk's
// codes [16][chunk·64], then the tile's scales [16][K/128] u16; 128-aligned). The launcher computes the same
// layout (backend-cuda/src/ops/linear/q4tiles.rs).
template <bool XS, int NP, bool NL>
__device__ __forceinline__ void q4i8t_body(const uint4* __restrict__ xf, const u8* __restrict__ w,
                                           float* __restrict__ y, int T, u64 K, u64 N, u64 soff, int S,
                                           u32 ring_off, u32 stage_bytes, u32 chunk, float* __restrict__ scratch) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 qt_sm[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 NG = (u32)(K / 128);
    const u32 RB = (u32)(K / 2);  // code bytes per row
    const u32 CB = chunk * 64;    // code bytes per row and stage
    const u32 NCH = NG / chunk;   // stages per tile
    const u32 tiles = (u32)((N + 15) / 16);
    // The block's stages [u0, u1) in tile order: whole tiles, or an equal run (split, see above).
    const bool split = QT_SHARE && scratch != nullptr;
    const u64 units = split ? (u64)tiles * NCH : (u64)tiles;
    u32 u0 = (u32)((u64)blockIdx.x * units / gridDim.x), u1 = (u32)((u64)(blockIdx.x + 1) * units / gridDim.x);
    if (!split) u0 *= NCH, u1 *= NCH;
    const u32 tf = u0 / NCH, skip = u0 - tf * NCH;  // first tile, its first stage
    const u32 per = NG * QC_U4;
    const u32 tstride = XS ? per + 1u : per;
    const u32 bars = smem_u32(qt_sm);  // full[i] at bars + 8i, empty[i] at bars + 8(S + i)
    float* red = (float*)(qt_sm + 16 * S);
    uint4* xs = (uint4*)(red + 2 * 2 * QT_GW * NP * 64);
    u8* ring = qt_sm + ring_off;
    if (threadIdx.x == 0) {
        for (int i = 0; i < S; i++) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bars + 8u * i) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bars + 8u * (S + i)), "n"(QT_CW)
                         : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == 2 * QT_GW) {
        // The producer (one thread): weights only, independent of the previous kernel, so no grid
        // wait. Stage (tile tl, chunk c): its codes (one copy for a whole tile, else one per row)
        // and the tile's scales (one copy).
        if (lane != 0) return;
        for (u32 u = u0; u < u1; u++) {
            const u32 tile = u / NCH, c = u - tile * NCH;
            const u64 row0 = (u64)tile * 16;
            const u32 rows = (u32)min((u64)16, N - row0);
            const u32 sb = rows * NG * 2;
            u32 slot, round;
            qt_place(tile - tf, c, NCH, skip, S, slot, round);
            if (round > 0) mbar_wait_parity(bars + 8u * ((u32)S + slot), (round - 1) & 1u);
            const u32 full = bars + 8u * slot;
            const u32 st = smem_u32(ring + (u64)slot * stage_bytes);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(full),
                         "r"(rows * CB + sb)
                         : "memory");
            const u8* src = w + row0 * RB + (u64)c * CB;
            if (NCH == 1) {
                qt_bulk(st, src, rows * CB, full);
            } else {
                for (u32 r = 0; r < rows; r++) qt_bulk(st + r * CB, src + (u64)r * RB, CB, full);
            }
            qt_bulk(st + 16u * CB, w + soff + row0 * ((u64)NG * 2), sb, full);
        }
        return;
    }

    grid_dependency_wait();  // x from here on
    if (XS) {
        for (int t = 0; t < T; t++) {
            for (u32 i = threadIdx.x; i < per; i += 2 * QT_GW * 32) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(xs + t * tstride + i)),
                             "l"(xf + (u64)t * per + i)
                             : "memory");
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        qt_consumers_sync();
    }
    // QT_SHARE: one "group" of all 16 consumer warps.
    const int grp = QT_SHARE ? 0 : warp / QT_GW, wi = QT_SHARE ? warp : warp % QT_GW;
    const int g = lane >> 2, tq = lane & 3;
    const uint2* x2 = (const uint2*)(XS ? (const uint4*)xs : xf);
    u32 xoff[NP], moff[NP];
    int mul, mul1;
    qc_lane_offsets<NP>(g, tq, T, tstride, xoff, moff, mul, mul1);
    // This lane's bytes of a stage at its first group: codes of rows g and g + 8, their scales.
    const u32 offa = (u32)g * CB + (u32)tq * 16, offb = offa + 8 * CB;
    const u32 osa = 16 * CB + (u32)g * NG * 2, osb = osa + 8 * NG * 2;

    const u32 tlast = (u1 - 1) / NCH;
    float head[NP][2];  // part B of the block's first tile (split), finished after the range
#pragma unroll
    for (int p = 0; p < NP; p++) head[p][0] = head[p][1] = 0.0f;
    for (u32 tl = (u32)grp; tf + tl <= tlast; tl += QT_SHARE ? 1 : 2) {
        const u32 tile = tf + tl;
        const u32 cs = tl == 0 ? skip : 0u, ce = min(NCH, u1 - tile * NCH);  // this range's stages
        float acc[NP][2];
#pragma unroll
        for (int p = 0; p < NP; p++) acc[p][0] = acc[p][1] = 0.0f;
        for (u32 c = cs; c < ce; c++) {
            u32 slot, round;
            qt_place(tl, c, NCH, skip, S, slot, round);
            mbar_wait_parity(bars + 8u * slot, round & 1u);
            const u8* st = ring + (u64)slot * stage_bytes;
            // Two items in flight per warp (the MMA chains of one item are serial).
#pragma unroll 2
            for (u32 gl = (u32)wi; gl < chunk; gl += QT_CW) {
                const u32 gi = c * chunk + gl;
                const uint4 va4 = *(const uint4*)(st + offa + gl * 64), vb4 = *(const uint4*)(st + offb + gl * 64);
                const float qa = f16_to_f32(*(const u16*)(st + osa + gi * 2));
                const float qb = f16_to_f32(*(const u16*)(st + osb + gi * 2));
                const uint2* xg = x2 + gi * (QC_U4 * 2);
                int cc[NP][4];
                qc_item_mmas<NP, NL>(va4, vb4, xg, xoff, cc);
                qc_item_acc<NP>(cc, xg, moff, mul, mul1, qa, qb, acc);
            }
            // This warp has read its part of the stage: release the slot once the tile's QT_CW have.
            __syncwarp();
            if (lane == 0) {
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bars + 8u * ((u32)S + slot))
                             : "memory");
            }
        }
        // The tile's QT_CW pair sums meet; warp k % QT_CW (k: the tile's index among this group's)
        // adds them in warp order and stores. (QT_SHARE: the 16 warps' buffers [2][16] fill the
        // same bytes as the groups' [2 groups][2][8].)
        const u32 k = QT_SHARE ? tl : tl >> 1;
        float v[NP][2];
        qc_pair_sums<NP>(acc, v);
        float* part = red + ((u32)(grp * 2) + (k & 1u)) * QT_CW * (NP * 64);
#pragma unroll
        for (int p = 0; p < NP; p++)
#pragma unroll
            for (int i = 0; i < 2; i++) part[wi * (NP * 64) + (p * 2 + i) * 32 + lane] = v[p][i];
        if (QT_SHARE) {
            qt_consumers_sync();
        } else {
            qt_group_sync(grp);
        }
        if ((u32)wi == k % QT_CW) {
            float sum[NP][2];
#pragma unroll
            for (int p = 0; p < NP; p++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    float a = part[(p * 2 + i) * 32 + lane];
                    for (int q = 1; q < QT_CW; q++) a += part[q * (NP * 64) + (p * 2 + i) * 32 + lane];
                    sum[p][i] = a;
                }
            if (cs > 0) {
                // Part B of a split tile (the block's first: this is warp 0): finished below.
#pragma unroll
                for (int p = 0; p < NP; p++) head[p][0] = sum[p][0], head[p][1] = sum[p][1];
            } else if (ce < NCH) {
                // Part A (the block's last tile): block b + 1 adds it to its part B.
                float* slotp = scratch + (u64)(blockIdx.x + 1) * QT_SPLIT_SLOT + lane;
#pragma unroll
                for (int p = 0; p < NP; p++)
#pragma unroll
                    for (int i = 0; i < 2; i++) slot_put(slotp + (p * 2 + i) * 32, sum[p][i]);
            } else {
                qc_store<NP>(sum, tile, g, tq, T, N, y);
            }
        }
    }
    if (split && skip > 0 && wi == 0) {
        // The first tile's part A from block b - 1 (published when it reached its last tile), then
        // A + B in that order.
        float* slotp = scratch + (u64)blockIdx.x * QT_SPLIT_SLOT + lane;
        float a[NP][2];
#pragma unroll
        for (int p = 0; p < NP; p++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float* q = slotp + (p * 2 + i) * 32;
                a[p][i] = slot_settle(q, slot_load(q)) + head[p][i];
            }
        qc_store<NP>(a, tf, g, tq, T, N, y);
    }
#else
    // Bulk copies and transaction-counted barriers are sm_90 features: the launcher never
    // runs this kernel below sm_90 (backend-cuda/src/ops/linear/q4tiles.rs).
    (void)xf, (void)w, (void)y, (void)T, (void)K, (void)N, (void)soff, (void)S, (void)ring_off, (void)stage_bytes,
        (void)chunk, (void)scratch;
    __trap();
#endif
}

#define Q4I8T_ARGS                                                                                  \
    const uint4 *xf, const u8 *w, float *y, int T, u64 K, u64 N, u64 soff, int S, u32 ring_off, u32 stage_bytes, \
        u32 chunk, float *scratch
#define Q4I8T_PASS xf, w, y, T, K, N, soff, S, ring_off, stage_bytes, chunk, scratch
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t1(Q4I8T_ARGS) {
    q4i8t_body<false, 1, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t1_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 1, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t2(Q4I8T_ARGS) {
    q4i8t_body<false, 2, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t2_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 2, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t4(Q4I8T_ARGS) {
    q4i8t_body<false, 4, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4i8t4_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 4, false>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t1(Q4I8T_ARGS) {
    q4i8t_body<false, 1, true>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t1_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 1, true>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t2(Q4I8T_ARGS) {
    q4i8t_body<false, 2, true>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t2_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 2, true>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t4(Q4I8T_ARGS) {
    q4i8t_body<false, 4, true>(Q4I8T_PASS);
}
extern "C" __launch_bounds__(QT_THREADS, 1) __global__ void gemv_q4nli8t4_xs(Q4I8T_ARGS) {
    q4i8t_body<true, 4, true>(Q4I8T_PASS);
}
