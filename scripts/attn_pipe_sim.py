#!/usr/bin/env python3
"""Host check of the fast attention kernel's buffer protocol on the tensor-map path (attention.cu,
`fa_body`): the default loop, the FA_PIPE loop and the FA_KBUF1 loop (one K buffer), for every
chunk count a block can get.

The kernel's 128 threads run between block barriers in any interleaving, so each loop is modelled
as a list of segments (the code between two `__syncthreads`); within a segment the events of
different threads are unordered. Buffers: K0, K1 (tensor copies completing on one mbarrier each),
V (one mbarrier), the score buffers S0 (sS) and S1 (sS2, FA_PIPE only). Events:

  issue B c   thread 0 arms B's barrier and starts the copy of chunk c into B
  wait B c    every thread waits for the barrier phase of chunk c on B
  read B c    threads read chunk c's data from B (QK reads K, PV reads V)
  zero V c    threads zero the rows past a partial chunk c in V
  qk S c      QK of chunk c writes its scores into score buffer S
  softmax S c the softmax of chunk c turns S's scores into probabilities
  pv S c      PV of chunk c reads S's probabilities

Rules (a violation is a race or a hang on the GPU):
  * a read or zero of (B, c) happens after a wait of (B, c) in the same segment (each thread's own
    wait comes first in its program order) or in an earlier one, and c is the newest copy into B;
  * an issue into B needs every earlier copy into B waited for (one barrier phase in flight: the
    parity wait cannot tell phase n from n + 2), and no read of B's previous chunk in the same
    segment (another thread may still be reading it);
  * a score buffer takes one phase per segment, in the order qk(c), softmax(c), pv(c), then
    qk(c + 2) (FA_PIPE's two buffers) or qk(c + 1) (the default loop's one), each in a later
    segment than the one before;
  * every chunk's QK, softmax and PV run exactly once, in chunk order, and every issued copy is
    waited for by the end.
Exit status 1 on a violation (CI runs this).
"""
import sys


def default_loop(n):
    segs = [[("issue", "K0", 0), ("issue", "V", 0)]]
    for ci in range(n):
        kb = f"K{ci & 1}"
        seg = segs[-1]
        seg.append(("wait", kb, ci))
        segs.append([])  # __syncthreads: everyone is done with K(ci-1) and V(ci-1)
        seg = segs[-1]
        if ci > 0:
            seg.append(("issue", "V", ci))
        if ci + 1 < n:
            seg.append(("issue", f"K{(ci + 1) & 1}", ci + 1))
        seg += [("read", kb, ci), ("qk", "S0", ci)]
        segs.append([("softmax", "S0", ci), ("wait", "V", ci), ("zero", "V", ci)])
        segs.append([("read", "V", ci), ("pv", "S0", ci)])
    return segs


def pipe_loop(n):
    segs = [[("issue", "K0", 0), ("issue", "V", 0)]]
    if n > 1:
        segs[-1].append(("issue", "K1", 1))
    segs[-1].append(("wait", "K0", 0))
    segs.append([("read", "K0", 0), ("qk", "S0", 0)])
    segs.append([])
    if n > 2:
        segs[-1].append(("issue", "K0", 2))
    for ci in range(n):
        sc, sn = f"S{ci & 1}", f"S{(ci + 1) & 1}"
        seg = segs[-1]
        seg.append(("softmax", sc, ci))
        if ci + 1 < n:
            kb = f"K{(ci + 1) & 1}"
            seg += [("wait", kb, ci + 1), ("read", kb, ci + 1), ("qk", sn, ci + 1)]
        seg += [("wait", "V", ci), ("zero", "V", ci)]
        segs.append([])  # P(ci) visible; QK(ci + 1) done
        seg = segs[-1]
        if ci + 3 < n:
            seg.append(("issue", f"K{(ci + 3) & 1}", ci + 3))
        seg += [("read", "V", ci), ("pv", sc, ci)]
        segs.append([])  # V(ci) and P(ci) consumed
        if ci + 1 < n:
            segs[-1].append(("issue", "V", ci + 1))
    return segs


def kbuf1_loop(n):
    segs = [[("issue", "K0", 0), ("issue", "V", 0)]]
    segs.append([])  # __syncthreads: the query fragments and row state are visible
    for ci in range(n):
        segs[-1] += [("wait", "K0", ci), ("read", "K0", ci), ("qk", "S0", ci)]
        segs.append([])  # QK(ci) done: the K buffer is free
        if ci + 1 < n:
            segs[-1].append(("issue", "K0", ci + 1))
        segs[-1] += [("softmax", "S0", ci), ("wait", "V", ci), ("zero", "V", ci)]
        segs.append([("read", "V", ci), ("pv", "S0", ci)])  # P(ci), alpha and V(ci) visible
        segs.append([])  # PV(ci) done: V and the scores are free
        if ci + 1 < n:
            segs[-1].append(("issue", "V", ci + 1))
    return segs


def check(segs, n, name):
    newest = {}  # buffer -> chunk of the newest copy
    waited = {}  # buffer -> set of chunks waited for
    done = {"qk": [], "softmax": [], "pv": []}
    s_state = {}  # score buffer -> (chunk, stage) after its last segment: stage qk/softmax/pv
    errors = []
    for si, seg in enumerate(segs):
        seen_wait = set()
        reads = [(b, c) for op, b, c in seg if op in ("read", "zero") and b in ("K0", "K1", "V")]
        for op, b, c in seg:
            where = f"{name} n={n} segment {si}: {op} {b} {c}"
            if op == "issue":
                prev = newest.get(b)
                if prev is not None and prev not in waited.get(b, set()):
                    errors.append(f"{where}: previous copy {prev} not waited for")
                if prev is not None and (b, prev) in reads:
                    errors.append(f"{where}: chunk {prev} is still read in this segment")
                newest[b] = c
            elif op == "wait":
                if newest.get(b) != c:
                    errors.append(f"{where}: waits for a copy that is not the newest ({newest.get(b)})")
                waited.setdefault(b, set()).add(c)
                seen_wait.add((b, c))
            elif op in ("read", "zero") and b in ("K0", "K1", "V"):
                if newest.get(b) != c:
                    errors.append(f"{where}: buffer holds chunk {newest.get(b)}")
                if c not in waited.get(b, set()):
                    errors.append(f"{where}: not waited for")
            elif op in done:
                done[op].append(c)
        # Score buffers: one phase per segment, in order.
        for b in ("S0", "S1"):
            phases = [(op, c) for op, bb, c in seg if bb == b and op in done]
            if len(phases) > 1:
                errors.append(f"{name} n={n} segment {si}: {b} takes {phases} in one segment")
                continue
            if not phases:
                continue
            stage, c = phases[0]
            prev = s_state.get(b)
            step = 1 if name in ("default", "kbuf1", "kbuf1_early") else 2
            want = {"qk": ("pv", c - step), "softmax": ("qk", c), "pv": ("softmax", c)}[stage]
            if prev != want and not (stage == "qk" and prev is None):
                errors.append(f"{name} n={n} segment {si}: {b} {stage}({c}) after {prev}")
            s_state[b] = (stage, c)
    for op, cs in done.items():
        if cs != list(range(n)):
            errors.append(f"{name} n={n}: {op} ran for chunks {cs}")
    for b, c in newest.items():
        if c not in waited.get(b, set()):
            errors.append(f"{name} n={n}: copy of chunk {c} into {b} never waited for")
    return errors


def main():
    errors = []
    for n in range(1, 12):
        errors += check(default_loop(n), n, "default")
        errors += check(pipe_loop(n), n, "pipe")
        errors += check(kbuf1_loop(n), n, "kbuf1")
    # The checker must catch a broken schedule: K(ci + 2) issued where K(ci + 3) belongs.
    def broken(n):
        segs = pipe_loop(n)
        for seg in segs:
            for i, (op, b, c) in enumerate(seg):
                if op == "issue" and b.startswith("K") and c >= 3:
                    seg[i] = (op, f"K{(c - 1) & 1}", c - 1)
        return segs
    if not check(broken(6), 6, "broken"):
        errors.append("the checker accepted a schedule that overwrites a K buffer in use")

    # ... the barrier between the softmax / next QK and PV dropped.
    def no_barrier(n):
        out = []
        for seg in pipe_loop(n):
            if out and any(op == "pv" for op, _, _ in seg):
                out[-1] += seg
            else:
                out.append(seg)
        return out
    if not check(no_barrier(5), 5, "no_barrier"):
        errors.append("the checker accepted PV in the segment of its own softmax")

    # ... and QK(ci + 1) writing the score buffer the softmax of ci is using.
    def one_buffer(n):
        return [[(op, "S0" if op in ("qk", "softmax", "pv") else b, c) for op, b, c in seg]
                for seg in pipe_loop(n)]
    if not check(one_buffer(4), 4, "one_buffer"):
        errors.append("the checker accepted two chunks in one score buffer at once")
    # ... and FA_KBUF1's K(ci + 1) issued before the barrier that ends QK(ci).
    def kbuf1_early(n):
        segs = kbuf1_loop(n)
        for i in range(1, len(segs)):
            seg = segs[i]
            if seg and seg[0][0] == "issue" and seg[0][1] == "K0":
                segs[i - 1].append(seg.pop(0))
        return segs
    if not check(kbuf1_early(3), 3, "kbuf1_early"):
        errors.append("the checker accepted a K copy into the buffer QK is still reading")
    for e in errors:
        print(e)
    if errors:
        sys.exit(1)
    print("attention buffer protocol: default, FA_PIPE and FA_KBUF1 loops race-free for 1..11 chunks")


if __name__ == "__main__":
    main()
