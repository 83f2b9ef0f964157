#!/usr/bin/env python3
"""Host check of the tile-owning q4 GEMV's ring protocol (gemv_mma.cu, `q4i8t_body`).

One producer thread streams a block's tiles, in order, into S shared-memory slots; two consumer
groups of warps take alternate tiles (group tl % 2). Per slot two mbarriers: `full` (count 1: the
producer's arrive.expect_tx; the copy's bytes complete the phase when they land, at any later
time) and `empty` (count = warps per group: each warp of the consuming group arrives once it has
read the tile). The producer refills a slot for round r only after `empty` completed phase r - 1;
a consumer of round r waits for `full` phase r. Waits are parity waits, modelled exactly:
`try_wait.parity(P)` succeeds iff the barrier's current (incomplete) phase has parity != P, so a
waiter two phases ahead of the barrier passes at once — the race the slot mapping must exclude.

Every interleaving is drawn at random (actors and copy landings), many times per (tiles, S), and
checked: each consumer reads exactly the tile it waits for, no barrier gets more arrivals than its
count, no deadlock, every tile consumed. Also a self-test: the first version's mapping (slot
tl % S, round tl / S), which let both groups share a slot when S is odd, must be caught.
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


def new_mapping(tl, s):
    return 2 * ((tl >> 1) % (s >> 1)) + (tl & 1), (tl >> 1) // (s >> 1)


def old_mapping(tl, s):
    return tl % s, tl // s


def run(tiles, s, mapping, rng):
    full = [Barrier(1) for _ in range(s)]
    empty = [Barrier(WARPS) for _ in range(s)]
    data = [None] * s
    in_flight = []  # (slot, tile) copies issued, not landed
    prod = {"tl": 0, "armed": False}
    # Consumer warp state: next tile index, stage ("wait" | "read" | "arrive").
    cons = []
    for grp in range(2):
        for w in range(WARPS):
            cons.append({"grp": grp, "w": w, "tl": grp, "stage": "wait", "seen": None})
    consumed = {}
    steps = 0
    while True:
        steps += 1
        if steps > 100000:
            raise AssertionError("no progress (livelock)")
        actions = []
        if prod["tl"] < tiles:
            tl = prod["tl"]
            slot, rnd = mapping(tl, s)
            if rnd == 0 or empty[slot].parity_passed((rnd - 1) & 1):
                actions.append(("produce", None))
        for i, _ in enumerate(in_flight):
            actions.append(("land", i))
        for c in cons:
            if c["tl"] >= tiles:
                continue
            slot, rnd = mapping(c["tl"], s)
            if c["stage"] == "wait":
                if full[slot].parity_passed(rnd & 1):
                    actions.append(("pass", c))
            else:
                actions.append((c["stage"], c))
        if not actions:
            if prod["tl"] < tiles or any(c["tl"] < tiles for c in cons):
                raise AssertionError("deadlock")
            break
        kind, arg = rng.choice(actions)
        if kind == "produce":
            tl = prod["tl"]
            slot, _ = mapping(tl, s)
            # arrive.expect_tx: the expected bytes first, then the arrival.
            full[slot].expect_tx(1)
            full[slot].arrive(f"full[{slot}] tile {tl}")
            in_flight.append((slot, tl))
            prod["tl"] += 1
        elif kind == "land":
            slot, tl = in_flight.pop(arg)
            data[slot] = tl
            full[slot].complete_tx(1)
        elif kind == "pass":
            arg["stage"] = "read"
        elif kind == "read":
            slot, _ = mapping(arg["tl"], s)
            if data[slot] != arg["tl"]:
                raise AssertionError(
                    f"group {arg['grp']} warp {arg['w']} read slot {slot} holding tile {data[slot]} "
                    f"for tile {arg['tl']}"
                )
            arg["stage"] = "arrive"
        elif kind == "arrive":
            slot, _ = mapping(arg["tl"], s)
            empty[slot].arrive(f"empty[{slot}] tile {arg['tl']}")
            consumed[arg["tl"]] = consumed.get(arg["tl"], 0) + 1
            arg["tl"] += 2
            arg["stage"] = "wait"
    for tl in range(tiles):
        if consumed.get(tl) != WARPS:
            raise AssertionError(f"tile {tl} consumed by {consumed.get(tl)} warps")


def check(mapping, stages, seeds):
    for s in stages:
        for tiles in range(1, 19):
            for seed in range(seeds):
                rng = random.Random(seed * 1000 + tiles * 31 + s)
                try:
                    run(tiles, s, mapping, rng)
                except AssertionError as e:
                    return f"S={s} tiles={tiles} seed={seed}: {e}"
    return None


def main():
    bad = check(new_mapping, [2, 4, 6], 150)
    if bad:
        print(f"q4 tiles ring: VIOLATION {bad}")
        return 1
    print("q4 tiles ring: per-group slots, S in {2, 4, 6}, 1..18 tiles, 150 schedules each: ok")
    caught = check(old_mapping, [3], 150)
    if not caught:
        print("q4 tiles ring: self-test FAILED: the shared-slot mapping (S = 3) passed")
        return 1
    print(f"q4 tiles ring: self-test ok (shared slots, S = 3, caught: {caught})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
