#!/usr/bin/env python3
"""Host mirror of gemv_sk's control flow (kernels/src/cu/linear.cu), no GPU needed.

The issue and compute cursors, the cp.async ring stages, the passes (RH < 8 rows), the scratch
slots and the fix-up counters, run warp by warp in random orders. Checks that every compute step
reads the stage the issue side filled for the same (unit, pass, trip), that every output is stored
exactly once with its partials in warp order covering all trips of its unit, and that the counters
end at zero. Keep it in step with gemv_sk when the kernel changes. Usage: python3 scripts/gemv_sk_sim.py
"""
import random
def qp_start(w, W, work): return w * work // W
def qp_owner(item, W, work): return ((item + 1) * W - 1) // work

def run(N, nch, W, RH, NS, T, seed):
    SK_R = 8; H = SK_R // RH
    TR = (nch + 31) // 32; units = (N + SK_R - 1) // SK_R; work = units * TR
    assert work >= W  # sk_split: at least one item per warp
    counters = [0] * units
    scratch = {}
    y = {}  # (t,row) -> value description
    order = list(range(W)); random.Random(seed).shuffle(order)
    for gw in order:
        i0, i1 = qp_start(gw, W, work), qp_start(gw + 1, W, work)
        if i0 >= i1: continue
        first_unit = i0 // TR
        seg_lo = lambda u: max(i0, u * TR) - u * TR
        seg_hi = lambda u: min(i1, u * TR + TR) - u * TR
        ring = [None] * NS
        st_ = {'iu': first_unit, 'ih': 0, 'ij': seg_lo(first_unit), 'ije': seg_hi(first_unit),
               'ileft': (i1 - i0) * H, 'sti': 0, 'base': (first_unit, 0, seg_lo(first_unit)), 'off': 0}
        pending = []
        def issue():
            s = st_
            if s['ileft'] > 0:
                bu, bh, bj = s['base']
                assert (bu, bh) == (s['iu'], s['ih'])
                ring[s['sti']] = (s['iu'], s['ih'], bj + s['off'])  # pointer = base + off·wstep
                assert bj + s['off'] == s['ij']
                s['ileft'] -= 1
                s['ij'] += 1
                if s['ij'] == s['ije']:
                    s['ih'] += 1
                    if s['ih'] == H:
                        s['ih'] = 0; s['iu'] += 1
                    if s['ileft'] > 0:
                        s['ij'] = seg_lo(s['iu']); s['ije'] = seg_hi(s['iu'])
                        s['base'] = (s['iu'], s['ih'], s['ij']); s['off'] = 0
                else:
                    s['off'] += 1
            else:
                ring[s['sti']] = 'empty'
            s['sti'] = 0 if s['sti'] + 1 == NS else s['sti'] + 1
        for _ in range(NS - 1): issue()
        cu, ch = first_unit, 0
        cj, cje = seg_lo(cu), seg_hi(cu)
        st = 0
        acc = {}  # row-in-pass -> list of trips
        left = (i1 - i0) * H
        while left > 0:
            # issue() writes stage (st + NS - 1) % NS, i.e. not st (NS >= 2)
            saved = ring[st]
            issue()
            assert ring[st] == saved or NS == 1
            assert saved == (cu, ch, cj), (saved, (cu, ch, cj))
            for r in range(RH): acc.setdefault(r, []).append(cj)
            st = 0 if st + 1 == NS else st + 1
            cj += 1
            if cj < cje:
                left -= 1; continue
            ub = cu * TR
            whole = ub >= i0 and ub + TR <= i1
            row0 = cu * SK_R + ch * RH
            slot = 0 if cu == first_unit else 1
            for r in range(RH):
                for t in range(T):
                    if not whole:
                        key = (gw, slot, ch * RH + r, t)
                        scratch[key] = (gw, tuple(acc[r]))
                    elif row0 + r < N:
                        assert (t, row0 + r) not in y
                        y[(t, row0 + r)] = ((gw, tuple(acc[r])),)
            acc = {}
            ch += 1
            if ch == H:
                if not whole:
                    w0, w1 = qp_owner(ub, W, work), qp_owner(ub + TR - 1, W, work)
                    prev = counters[cu]; counters[cu] += 1
                    if prev == w1 - w0:
                        for i in range(SK_R * T):
                            r, t = i // T, i % T
                            row = cu * SK_R + r
                            if row < N:
                                parts = []
                                for ow in range(w0, w1 + 1):
                                    oslot = 0 if cu == qp_start(ow, W, work) // TR else 1
                                    parts.append(scratch[(ow, oslot, r, t)])
                                assert (t, row) not in y
                                y[(t, row)] = tuple(parts)
                        counters[cu] = 0
                ch = 0; cu += 1
            if left > 1:
                cj, cje = seg_lo(cu), seg_hi(cu)
            left -= 1
    assert all(c == 0 for c in counters), "counters not reset"
    for t in range(T):
        for row in range(N):
            parts = y[(t, row)]
            ws = [p[0] for p in parts]
            assert ws == sorted(ws) and len(set(ws)) == len(ws)
            trips = [j for p in parts for j in p[1]]
            assert trips == list(range(TR)), (row, trips)
    return len(y)

n = 0
for (N, nch, W) in [(1001, 1544, 64), (17, 100, 5), (8, 64, 2), (203, 4096 // 8, 37), (2176 * 8, 640, 2112), (1000, 1024, 333), (9, 33, 3), (100, 31, 13)]:
    for RH, NS in [(8, 2), (4, 3), (4, 4), (2, 5)]:
        for T in (1, 3):
            for seed in range(3):
                units = (N + 7) // 8; TR = (nch + 31) // 32
                if units * TR < W: continue
                n += run(N, nch, W, RH, NS, T, seed)
print("ok", n)
