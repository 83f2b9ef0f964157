#!/usr/bin/env python3
"""Host check of the tile-owning q4 GEMV's ring protocol (gemv_mma.cu, `q4i8t_body`).

One producer thread streams a block's tiles, in order and in `nch` stages each (whole tiles, or
chunks of a tile's groups), into S shared-memory slots; two consumer groups of warps take
alternate tiles (group tl % 2) and each of their stages in order. Per slot two mbarriers: `full` (count 1: the
producer's arrive.expect_tx; the copy's bytes complete the phase when they land, at any later
time) and `empty` (count = warps per group: each warp of the consuming group arrives once it has
read the tile). The producer refills a slot for round r only after `empty` completed phase r - 1;
a consumer of round r waits for `full` phase r. Waits are parity waits, modelled exactly:
`try_wait.parity(P)` succeeds iff the barrier's current (incomplete) phase has parity != P, so a
waiter two phases ahead of the barrier passes at once — the race the slot mapping must exclude.

Every interleaving is drawn at random (actors and copy landings), many times per (tiles, stages
per tile, S), and checked: each consumer reads exactly the tile it waits for, no barrier gets more arrivals than its
count, no deadlock, every tile consumed. Also a self-test: the first version's mapping (slot
stage % S, round stage / S), which let both groups share a slot when S is odd, must be caught.
Exit status 1 on a violation (CI runs this).
"""
import random
import sys

WARPS = 2  # per group (the kernel has 8; two suffice to interleave arrivals)


class Barrier:
    def __init__(self, count):
        self.count = count
        self.pending = count
        self.tx = 0
        self.phase = 0  # completed phases

    def arrive(self, what):
        if self.pending == 0:
            raise AssertionError(f"{what}: arrival on a barrier with no pending arrivals")
        self.pending -= 1
        self._maybe_complete()

    def expect_tx(self, n):
        self.tx += n

    def complete_tx(self, n):
        self.tx -= n
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def parity_passed(self, parity):
        return (self.phase & 1) != parity


def new_mapping(tl, c, nch, s):
    """gemv_mma.cu's qt_slot / qt_round: the group's j-th stage."""
    j = (tl >> 1) * nch + c
    return 2 * (j % (s >> 1)) + (tl & 1), j // (s >> 1)


def sequential_mapping(tl, c, nch, s):
    """Slot by the block's stage index: QT_SHARE=1's mapping (qt_place), where every warp of both
    groups reads every stage -- and the first version's, which used it with alternate tiles per
    group (the race the self-test must catch)."""
    i = tl * nch + c
    return i % s, i // s


def run(tiles, nch, s, mapping, rng, share=False):
    """One block: `tiles` tiles of `nch` stages each; every stage lands as two copies (codes and
    scales, or a row's codes and the scales: each completes part of the bytes). `share`: QT_SHARE=1,
    both groups' warps read every stage (empty[] counts all of them)."""
    per_stage = 2 * WARPS if share else WARPS
    full = [Barrier(1) for _ in range(s)]
    empty = [Barrier(per_stage) for _ in range(s)]
    data = [[None, None] for _ in range(s)]  # what each part of a slot holds
    in_flight = []  # (slot, part, stage) copies issued, not landed
    stages = [(tl, c) for tl in range(tiles) for c in range(nch)]
    prod = 0  # next stage to issue
    # Consumer warp: its group's stages in order; phase "wait" | "read" | "arrive".
    cons = []
    for grp in range(2):
        mine = stages if share else [st for st in stages if st[0] % 2 == grp]
        for w in range(WARPS):
            cons.append({"grp": grp, "w": w, "todo": mine, "i": 0, "phase": "wait"})
    consumed = {}
    steps = 0
    while True:
        steps += 1
        if steps > 200000:
            raise AssertionError("no progress (livelock)")
        actions = []
        if prod < len(stages):
            tl, c = stages[prod]
            slot, rnd = mapping(tl, c, nch, s)
            if rnd == 0 or empty[slot].parity_passed((rnd - 1) & 1):
                actions.append(("produce", None))
        for i, _ in enumerate(in_flight):
            actions.append(("land", i))
        for w in cons:
            if w["i"] >= len(w["todo"]):
                continue
            tl, c = w["todo"][w["i"]]
            slot, rnd = mapping(tl, c, nch, s)
            if w["phase"] == "wait":
                if full[slot].parity_passed(rnd & 1):
                    actions.append(("pass", w))
            else:
                actions.append((w["phase"], w))
        if not actions:
            if prod < len(stages) or any(w["i"] < len(w["todo"]) for w in cons):
                raise AssertionError("deadlock")
            break
        kind, arg = rng.choice(actions)
        if kind == "produce":
            tl, c = stages[prod]
            slot, _ = mapping(tl, c, nch, s)
            # arrive.expect_tx: the expected bytes first, then the arrival; then the copies.
            full[slot].expect_tx(2)
            full[slot].arrive(f"full[{slot}] stage {(tl, c)}")
            in_flight += [(slot, 0, (tl, c)), (slot, 1, (tl, c))]
            prod += 1
        elif kind == "land":
            slot, part, st = in_flight.pop(arg)
            data[slot][part] = st
            full[slot].complete_tx(1)
        elif kind == "pass":
            arg["phase"] = "read"
        elif kind == "read":
            st = arg["todo"][arg["i"]]
            slot, _ = mapping(st[0], st[1], nch, s)
            if data[slot] != [st, st]:
                raise AssertionError(
                    f"group {arg['grp']} warp {arg['w']} read slot {slot} holding {data[slot]} for "
                    f"stage {st}"
                )
            arg["phase"] = "arrive"
        elif kind == "arrive":
            st = arg["todo"][arg["i"]]
            slot, _ = mapping(st[0], st[1], nch, s)
            empty[slot].arrive(f"empty[{slot}] stage {st}")
            consumed[st] = consumed.get(st, 0) + 1
            arg["i"] += 1
            arg["phase"] = "wait"
    for st in stages:
        if consumed.get(st) != per_stage:
            raise AssertionError(f"stage {st} consumed by {consumed.get(st)} warps")


def check(mapping, stages, seeds, share=False):
    for s in stages:
        for nch in (1, 2, 3):
            for tiles in range(1, 13):
                for seed in range(seeds):
                    rng = random.Random(seed * 1000 + tiles * 31 + s * 7 + nch)
                    try:
                        run(tiles, nch, s, mapping, rng, share)
                    except AssertionError as e:
                        return f"S={s} stages per tile={nch} tiles={tiles} seed={seed}: {e}"
    return None


def main():
    bad = check(new_mapping, [2, 4, 6], 60)
    if bad:
        print(f"q4 tiles ring: VIOLATION {bad}")
        return 1
    print("q4 tiles ring: per-group slots, S in {2, 4, 6}, 1..3 stages per tile, 1..12 tiles, 60 "
          "schedules each: ok")
    bad = check(sequential_mapping, [2, 3, 4], 60, share=True)
    if bad:
        print(f"q4 tiles ring (QT_SHARE=1): VIOLATION {bad}")
        return 1
    print("q4 tiles ring (QT_SHARE=1): one sequence of slots read by both groups, S in {2, 3, 4}: ok")
    caught = check(sequential_mapping, [3], 60)
    if not caught:
        print("q4 tiles ring: self-test FAILED: the shared-slot mapping (S = 3) passed")
        return 1
    print(f"q4 tiles ring: self-test ok (shared slots, S = 3, caught: {caught})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
