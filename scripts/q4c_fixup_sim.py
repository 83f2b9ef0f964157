#!/usr/bin/env python3
"""Host mirror of the stream-K tile fix-up of the column-packed q4 GEMV (`q4i8c_body`, `qc_publish`,
`qc_arrive` in kernels/src/cu/gemv_mma.cu), no GPU needed.

Each warp walks its item range [w·work/W, (w+1)·work/W) of (16-row tile, 128-group) items and, where
a tile ends or the range does, stores the tile (it owns all of it) or publishes its partial sums to
its scratch slot (0: the range's first tile, 1: its last) and counts itself in the tile's counter;
the last of a tile's warps to arrive adds the partials in warp order and stores the tile. Warps are
interleaved at random at every fence and every atomic (the kernel's only ordering points). Checks:
every tile is stored exactly once with the sum of all its items in ascending order (the
bit-for-bit contract: the order is a function of N, K and W only), no finisher reads a slot that
is not published or holds another tile, and every counter ends at zero. Keep it in step with the
kernel when the fix-up changes.

Both hand-offs of common.cuh are checked. Fenced (SK_FLAGS=0): a published slot is visible once
its warp has fenced. Fence-free (SK_FLAGS=1): a published slot lands at a random later point, in
no order with its warp's count (nothing orders them); the finisher reloads a slot until it is no
longer empty and empties it again; at SK_FLAGS=2 there are no counters and the finisher is the
tile's first warp. Its launches run back to back over one scratch (shapes of
different sizes), so a finisher reading an older launch's value, a store landing on a value not
yet taken, or a launch leaving a value behind are violations too.

Usage: python3 scripts/q4c_fixup_sim.py [--seeds N]   (exit status 1 on a violation)
"""
import argparse
import random
import sys


def qp_start(w, W, work):
    return w * work // W


def qp_owner(item, W, work):
    return ((item + 1) * W - 1) // work


class Violation(Exception):
    pass


def warp(gw, W, work, NG, st):
    """One warp of q4i8c_body's loop; yields at each ordering point."""
    i0, i1 = qp_start(gw, W, work), qp_start(gw + 1, W, work)
    if i0 >= i1:
        return
    first_tile = i0 // NG
    ct, cg = first_tile, i0 % NG
    acc = []
    total = i1 - i0
    for j in range(total):
        acc.append(i0 + j)
        cg += 1
        if cg == NG or j + 1 == total:
            tfirst = ct * NG
            whole = tfirst >= i0 and tfirst + NG - 1 < i1
            if whole:
                store(st, ct, tuple(acc))
            else:
                slot = 0 if ct == first_tile else 1
                value = (st["launch"], ct, tuple(acc))
                if st["flags"]:
                    if any(k == (gw, slot) for k, _ in st["pending"]):
                        raise Violation(f"warp {gw} publishes slot {slot} twice")
                    st["pending"].append(((gw, slot), value))  # lands later (land_one)
                else:
                    if (gw, slot) in st["scratch"]:
                        raise Violation(f"warp {gw} publishes slot {slot} twice")
                    st["scratch"][(gw, slot)] = value
                    yield "fence"
                yield from arrive_at(ct, gw, W, work, NG, st)
            acc = []
            cg = 0
            ct += 1


def arrive_at(ct, gw, W, work, NG, st):
    """sk_arrive (common.cuh), then the finisher's sums."""
    tfirst, tlast = ct * NG, ct * NG + NG - 1
    w0, w1 = qp_owner(tfirst, W, work), qp_owner(tlast, W, work)
    if st["flags"] >= 2:
        if gw != w0:
            return
    else:
        yield "atomic"
        prev = st["counters"].get(ct, 0)
        st["counters"][ct] = prev + 1
        if prev != w1 - w0:
            return
        st["counters"][ct] = 0
    items = []
    # The kernel's slot rule: every warp after w0 starts its range inside the tile (slot 0); w0
    # used slot 1 unless its range starts at the tile's first item.
    s0 = 1 if qp_start(w0, W, work) < tfirst else 0
    for ow in range(w0, w1 + 1):
        oslot = s0 if ow == w0 else 0
        if oslot != (0 if ct == qp_start(ow, W, work) // NG else 1):
            raise Violation(f"tile {ct}: the slot rule picks slot {oslot} for warp {ow}")
        if st["flags"]:
            # sk_load / sk_settle: reload while empty, take the value, leave the slot empty.
            while (ow, oslot) not in st["scratch"]:
                yield "reload"
            got = st["scratch"].pop((ow, oslot), None)
        else:
            got = st["scratch"].get((ow, oslot))
        if got is None or got[:2] != (st["launch"], ct):
            raise Violation(f"tile {ct}: warp {ow} slot {oslot} holds {got}")
        items.extend(got[2])
    store(st, ct, tuple(items))


def store(st, ct, items):
    if ct in st["y"]:
        raise Violation(f"tile {ct} stored twice")
    st["y"][ct] = items


def land_one(st, rng):
    """One pending fence-free store reaches memory."""
    key, value = st["pending"].pop(rng.randrange(len(st["pending"])))
    if key in st["scratch"]:
        raise Violation(f"slot {key} is stored over a value not taken yet: {st['scratch'][key]}")
    st["scratch"][key] = value


def run(N, K, W, seed, st):
    """One launch over the scratch and counters in st (kept across launches)."""
    NG = K // 128
    tiles = (N + 15) // 16
    work = tiles * NG
    assert work >= W  # q4_mmap_plan: blocks <= work / 8
    st["launch"] += 1
    st["y"] = {}
    if not st["flags"]:
        st["scratch"] = {}
    live = [warp(gw, W, work, NG, st) for gw in range(W)]
    rng = random.Random(seed)
    while live or st["pending"]:
        if st["pending"] and (not live or rng.random() < 0.3):
            land_one(st, rng)
            continue
        i = rng.randrange(len(live))
        try:
            next(live[i])
        except StopIteration:
            live[i] = live[-1]
            live.pop()
    if st["flags"] and st["scratch"]:
        raise Violation(f"the launch leaves {len(st['scratch'])} slot(s) not empty")
    for ct in range(tiles):
        want = tuple(range(ct * NG, ct * NG + NG))
        if st["y"].get(ct) != want:
            raise Violation(f"tile {ct}: stored {st['y'].get(ct)}, want items {want[0]}..{want[-1]}")
    if any(st["counters"].values()):
        raise Violation("a counter is not back at zero")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    # (N, K, W): ragged ranges (W not dividing work), ranges inside one tile, ranges spanning
    # many tiles, a warp per item, and the 27B decode shapes at 132 SMs × 2 blocks × 8 warps.
    shapes = [(64, 1024, 8), (100, 384, 16), (1000, 1024, 48), (264, 5120, 40), (48, 256, 6),
              (16, 1280, 10), (5120, 6144, 2112), (16384, 5120, 2112), (5120, 17408, 2112)]
    bad = 0
    for flags in (0, 1, 2):
        # Fence-free launches share one scratch, as the backend's stream-K buffers do.
        st = {"flags": flags, "scratch": {}, "pending": [], "counters": {}, "launch": 0}
        for seed in range(a.seeds):
            for (N, K, W) in shapes:
                try:
                    run(N, K, W, seed, st)
                except Violation as e:
                    bad += 1
                    print(f"SK_FLAGS={flags} N={N} K={K} W={W} seed={seed}: {e}")
                    st.update(scratch={}, pending=[], counters={})
    print(f"{'FAILED' if bad else 'ok'}: {bad} violations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
