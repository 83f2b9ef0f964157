#!/usr/bin/env python3
"""Host check of the fast attention kernel's buffer protocol on the tensor-map path (attention.cu,
`fa_body`): the default loop and the FA_PIPE loop, for every chunk count a block can get.

The kernel's 128 threads run between block barriers in any interleaving, so each loop is modelled
as a list of segments (the code between two `__syncthreads`); within a segment the events of
different threads are unordered. Buffers: K0, K1 (tensor copies completing on one mbarrier each),
V (one mbarrier), the score buffers S0 (sS) and S1 (sS2, FA_PIPE only). Events:

  issue B c   thread 0 arms B's barrier and starts the copy of chunk c into B
  wait B c    every thread waits for the barrier phase of chunk c on B
  read B c    threads read chunk c's data from B (QK reads K, PV reads V and P)
  write B c   threads write chunk c's scores / probabilities into B
  zero V c    threads zero the rows past a partial chunk c in V

Rules (a violation is a race or a hang on the GPU):
  * a read or zero of (B, c) happens after a wait of (B, c) in the same segment (each thread's own
    wait comes first in its program order) or in an earlier one, and c is the newest copy into B;
  * an issue into B needs every earlier copy into B waited for (one barrier phase in flight: the
    parity wait cannot tell phase n from n + 2), and no read of B's previous chunk in the same
    segment (another thread may still be reading it);
  * writes and reads of a score buffer in one segment belong to one chunk and one phase: S(c) is
    written by QK(c), read and rewritten by the softmax of c, read by PV(c), in three different
    segments, and a buffer is not rewritten for c + 2 before PV(c) has read it in an earlier segment;
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
        seg += [("read", kb, ci), ("write", "S0", ci), ("qk", None, ci)]
        segs.append([("read", "S0", ci), ("write", "S0", ci), ("softmax", None, ci)])
        segs[-1] += [("wait", "V", ci), ("zero", "V", ci)]
        segs.append([("read", "V", ci), ("read", "S0", ci), ("pv", None, ci)])
    return segs


def pipe_loop(n):
    segs = [[("issue", "K0", 0), ("issue", "V", 0)]]
    if n > 1:
        segs[-1].append(("issue", "K1", 1))
    segs[-1].append(("wait", "K0", 0))
    segs.append([("read", "K0", 0), ("write", "S0", 0), ("qk", None, 0)])
    segs.append([])
    if n > 2:
        segs[-1].append(("issue", "K0", 2))
    for ci in range(n):
        sc, sn = f"S{ci & 1}", f"S{(ci + 1) & 1}"
        seg = segs[-1]
        seg += [("read", sc, ci), ("write", sc, ci), ("softmax", None, ci)]
        if ci + 1 < n:
            kb = f"K{(ci + 1) & 1}"
            seg += [("wait", kb, ci + 1), ("read", kb, ci + 1), ("write", sn, ci + 1), ("qk", None, ci + 1)]
        seg += [("wait", "V", ci), ("zero", "V", ci)]
        segs.append([])  # P(ci) visible; QK(ci + 1) done
        seg = segs[-1]
        if ci + 3 < n:
            seg.append(("issue", f"K{(ci + 3) & 1}", ci + 3))
        seg += [("read", "V", ci), ("read", sc, ci), ("pv", None, ci)]
        segs.append([])  # V(ci) and P(ci) consumed
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
        # Score buffers: one chunk and one stage per segment.
        for b in ("S0", "S1"):
            ops = [(op, c) for op, bb, c in seg if bb == b]
            if not ops:
                continue
            chunks = {c for _, c in ops}
            if len(chunks) != 1:
                errors.append(f"{name} n={n} segment {si}: {b} holds chunks {sorted(chunks)} at once")
                continue
            (c,) = chunks
            stage = next(op for op, bb, cc in seg if op in done and cc == c and
                         ((op == "qk" and ("write", b, c) in [(o, x, y) for o, x, y in seg]) or
                          (op != "qk" and ("read", b, c) in [(o, x, y) for o, x, y in seg])))
            prev = s_state.get(b)
            want = {"qk": ("pv", c - 2), "softmax": ("qk", c), "pv": ("softmax", c)}[stage]
            if stage == "qk" and prev is None:
                pass
            elif stage == "qk" and name == "default" and prev == ("pv", c - 1):
                pass  # the default loop reuses one buffer for every chunk
            elif prev != want:
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
    for e in errors:
        print(e)
    if errors:
        sys.exit(1)
    print("attention buffer protocol: default and FA_PIPE loops race-free for 1..11 chunks")


if __name__ == "__main__":
    main()
