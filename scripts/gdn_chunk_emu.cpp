// Host emulation of the chunked gated delta rule kernels (gdn_chunk_prep, gdn_chunk_scan in
// kernels/src/cu/recurrent.cu) against an f64 token recurrence, for checking their logic without a
// GPU: each block runs as 256 std::threads with a std::barrier for __syncthreads, blocks one after
// another (so __shared__ = static). Run through scripts/gdn_chunk_emu.sh.
// Usage: gdn_chunk_emu T k_heads v_heads k_dim v_dim chunk segment [x = extreme decays]
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#include <random>
typedef unsigned long long u64;
struct D3 { unsigned x = 0, y = 0, z = 0; };
thread_local D3 threadIdx, blockIdx;
D3 blockDim, gridDim;
std::barrier<>* bar;
static void __syncthreads() { bar->arrive_and_wait(); }
#define __global__
#define __shared__ static
#define __device__
#define __forceinline__ inline
#define __align__(n) __attribute__((aligned(n)))
struct float4 { float x, y, z, w; };
#include GDN_KERNELS

template <class F> void launch(unsigned gx, unsigned gy, F f) {
    gridDim = {gx, gy, 1};
    blockDim = {256, 1, 1};
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            std::barrier<> b(256);
            bar = &b;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < 256; t++)
                ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; f(); });
            for (auto& t : ts) t.join();
        }
}

int main(int argc, char** argv) {
    int T = atoi(argv[1]), Hk = atoi(argv[2]), Hv = atoi(argv[3]), kd = atoi(argv[4]), vd = atoi(argv[5]);
    int C = atoi(argv[6]), SEG = atoi(argv[7]);
    std::mt19937 rng(42);
    std::uniform_real_distribution<float> U(-1, 1);
    std::vector<float> q(T * Hk * kd), k(T * Hk * kd), v(T * Hv * vd), beta(T * Hv), g(T * Hv), s0(Hv * kd * vd);
    for (auto& x : q) x = U(rng);
    for (auto& x : k) x = U(rng);
    for (auto& x : v) x = U(rng);
    for (auto& x : s0) x = 0.3f * U(rng);
    for (int i = 0; i < T * Hv; i++) {
        beta[i] = 1 / (1 + expf(-3 * U(rng)));
        g[i] = argc > 8 ? -7.0f * (1 + U(rng)) : logf(0.75f + 0.25f * U(rng));
    }
    // normalise
    for (int r = 0; r < T * Hk; r++) {
        float sq = 0, sk = 0;
        for (int i = 0; i < kd; i++) { sq += q[r * kd + i] * q[r * kd + i]; sk += k[r * kd + i] * k[r * kd + i]; }
        float rq = 1 / sqrtf(sq + 1e-6f) / sqrtf((float)kd), rk = 1 / sqrtf(sk + 1e-6f);
        for (int i = 0; i < kd; i++) { q[r * kd + i] *= rq; k[r * kd + i] *= rk; }
    }
    // reference recurrence in double
    std::vector<double> S(s0.begin(), s0.end()), oref(T * Hv * vd);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < Hv; h++) {
            int kh = h / (Hv / Hk);
            double* sh = &S[(size_t)h * kd * vd];
            double dec = exp((double)g[t * Hv + h]);
            for (int i = 0; i < kd * vd; i++) sh[i] *= dec;
            const float* kk = &k[(t * Hk + kh) * kd];
            const float* qq = &q[(t * Hk + kh) * kd];
            for (int j = 0; j < vd; j++) {
                double kv = 0;
                for (int i = 0; i < kd; i++) kv += sh[i * vd + j] * kk[i];
                double d = beta[t * Hv + h] * (v[(t * Hv + h) * vd + j] - kv);
                for (int i = 0; i < kd; i++) sh[i * vd + j] += kk[i] * d;
                double o = 0;
                for (int i = 0; i < kd; i++) o += sh[i * vd + j] * qq[i];
                oref[(t * Hv + h) * vd + j] = o;
            }
        }
    // emulated kernels
    std::vector<float> st(s0), o(T * Hv * vd, NAN);
    int seg = (SEG / C) * C;
    int cap = seg < T ? seg : T;
    std::vector<float> w(Hv * cap * kd, NAN), u(Hv * cap * vd, NAN), m(Hv * cap * C, NAN), gc(Hv * cap, NAN);
    for (int t0 = 0; t0 < T; t0 += seg) {
        int tn = seg < T - t0 ? seg : T - t0;
        launch(Hv, (tn + C - 1) / C, [&] {
            gdn_chunk_prep(q.data(), k.data(), v.data(), beta.data(), g.data(), w.data(), u.data(), m.data(), gc.data(),
                           t0, tn, Hk, Hv, kd, vd, C);
        });
        launch(Hv, (vd + 31) / 32, [&] {
            gdn_chunk_scan(q.data(), k.data(), w.data(), u.data(), m.data(), gc.data(), st.data(), o.data(), t0, tn, Hk,
                           Hv, kd, vd, C);
        });
    }
    double ss = 0, eo = 0, es = 0, sss = 0;
    for (size_t i = 0; i < o.size(); i++) { ss += oref[i] * oref[i]; double e = fabs(o[i] - oref[i]); if (!(e <= eo)) eo = e; }
    for (size_t i = 0; i < st.size(); i++) { sss += S[i] * S[i]; double e = fabs(st[i] - S[i]); if (!(e <= es)) es = e; }
    double rms = sqrt(ss / o.size()), srms = sqrt(sss / st.size());
    printf("T=%d Hk=%d Hv=%d kd=%d vd=%d C=%d seg=%d: out rms %.3e max err %.3e (%.2e rel); state rms %.3e max err %.3e (%.2e rel)\n",
           T, Hk, Hv, kd, vd, C, seg, rms, eo, eo / rms, srms, es, es / srms);
    return (eo / rms < 1e-4 && es / srms < 1e-4) ? 0 : 1;
}
