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


def split_launch(tiles, nch, blocks, split, slots, rng):
    """One launch of the kernel's block ranges, mirroring q4i8t_body's index math (u0, u1, tf,
    skip, tlast, cs, ce) and its split hand-off: each block, in a random interleaving with the
    others, runs its producer's stage list and its consumers' tile loop; a tile's sum is the
    sequence of its stage values. Part A is published into slot b + 1 (st.relaxed), part B kept
    and finished after the range by polling slot b (ld.relaxed until not empty, then empty again).
    Checks: the producer's and the consumers' stage lists agree, every tile is stored once with
    all of its stages in order, a finisher only waits for the block before it, and every slot is
    empty again when the launch ends (the invariant the next launch relies on)."""
    units = tiles * nch if split else tiles
    stored = {}
    runs = []
    for b in range(blocks):
        u0, u1 = b * units // blocks, (b + 1) * units // blocks
        if not split:
            u0, u1 = u0 * nch, u1 * nch
        tf = u0 // nch
        skip = u0 - tf * nch
        tlast = (u1 - 1) // nch
        produced = [(u // nch, u % nch) for u in range(u0, u1)]
        steps, consumed = [], []
        for tl in range(0, tlast - tf + 1):
            tile = tf + tl
            cs = skip if tl == 0 else 0
            ce = min(nch, u1 - tile * nch)
            consumed += [(tile, c) for c in range(cs, ce)]
            part = [(tile, c) for c in range(cs, ce)]
            if cs > 0:
                assert tl == 0, "part B is always the block's first tile (reduced by warp 0)"
                steps.append(("keep", tile, part))
            elif ce < nch:
                steps.append(("publish", tile, part, b + 1))
            else:
                steps.append(("store", tile, part))
        if split and skip > 0:
            steps.append(("finish", tf, b))
        if produced != consumed:
            raise AssertionError(f"block {b}: producer {produced} != consumers {consumed}")
        runs.append({"b": b, "steps": steps, "i": 0, "head": None})
    while any(r["i"] < len(r["steps"]) for r in runs):
        ready = []
        for r in runs:
            if r["i"] >= len(r["steps"]):
                continue
            st = r["steps"][r["i"]]
            if st[0] == "finish":
                if st[2] == 0:
                    raise AssertionError("block 0 never starts inside a tile")
                if slots[st[2]] is None:
                    continue  # polls: part A not landed yet
            ready.append(r)
        if not ready:
            raise AssertionError("deadlock: every block polls an empty slot")
        r = rng.choice(ready)
        st = r["steps"][r["i"]]
        r["i"] += 1
        if st[0] == "keep":
            r["head"] = st[2]
        elif st[0] == "publish":
            if slots[st[3]] is not None:
                raise AssertionError(f"slot {st[3]} published twice")
            slots[st[3]] = st[2]
        elif st[0] == "store":
            stored[st[1]] = stored.get(st[1], []) + [st[2]]
        else:  # finish: A (from slot b) + B, then the slot is empty again
            a = slots[st[2]]
            slots[st[2]] = None
            stored[st[1]] = stored.get(st[1], []) + [a + r["head"]]
    for tile in range(tiles):
        want = [[(tile, c) for c in range(nch)]]
        if stored.get(tile) != want:
            raise AssertionError(f"tile {tile} stored as {stored.get(tile)}")
    if any(v is not None for v in slots):
        raise AssertionError("a slot is not empty after the launch")


def check_split(seeds):
    cases = (
        (tiles, nch, blocks, split)
        for tiles in range(1, 40)
        for nch in (1, 2, 3, 5)
        for blocks in range(1, tiles + 1)
        for split in (False, True)
    )
    for tiles, nch, blocks, split in cases:
        slots = [None] * (blocks + 1)  # the same slots for every launch: each must leave them empty
        try:
            for seed in range(seeds):
                split_launch(tiles, nch, blocks, split, slots,
                             random.Random(seed * 7919 + tiles * 131 + nch * 17 + blocks))
        except AssertionError as e:
            return f"tiles={tiles} nch={nch} blocks={blocks} split={split}: {e}"
    return None


def main():
    bad = check_split(3)
    if bad:
        print(f"q4 tiles split ranges: VIOLATION {bad}")
        return 1
    print("q4 tiles split ranges: 1..39 tiles, 1..5 stages per tile, every block count, 3 "
          "launches on the same slots: ok")
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
