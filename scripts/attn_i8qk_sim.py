#!/usr/bin/env python3
"""Host mirror of the integer QK of the fast attention kernel (attention.cu, `FA_I8QK=1`).

Checks, for head sizes 64, 128 and 256 and random Q8_0 K tiles and queries:
  * the A fragments: each thread (g = lane / 4, tq = lane % 4) loads the words `fa_i8_kfrag` loads
    from a [64][KHB] shared-memory K tile (odd blocks: aligned words at blk + 2; even blocks: words
    at blk + 4 and a byte permute of blk + 20 + 4·tq with the block's first word), every address
    4-byte aligned, and the bytes land on the k-slots `fa_i8_slot_value` names;
  * the B fragments built in the prologue (the same slot order, 22-bit rounding with the row's
    power-of-two scale, three signed bytes) and the three mma.m16n8k32 in PTX's fragment layout
    (hi, mid onto 256·hi, lo) give exactly the integer dot product of the K values and the rounded
    query, with no int32 overflow;
  * the score (block K scale, then 2^-E) is within 2^-21 · max|q| · sum|K| of the f64 dot product.
Exit status 1 on a violation (CI runs this).
"""
import random
import struct
import sys

BAD = []


def check(cond, what):
    if not cond:
        BAD.append(what)


def byte_perm(x, y, sel):
    """CUDA __byte_perm: result byte i = byte (sel >> 4i) & 7 of the 8 bytes y:x."""
    b = struct.pack("<II", x, y)
    return sum(b[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def ld32(mem, addr):
    check(addr % 4 == 0, f"unaligned 32-bit load at {addr}")
    return struct.unpack_from("<I", mem, addr)[0]


def slot_value(b, s):
    return s if b & 1 else (s + 2) & 31


def kfrag(mem, blk_a, blk_b, b, tq):
    """fa_i8_kfrag: (a0, a1, a2, a3) for block b (blk_a / blk_b: the block in rows g, g + 8)."""
    if b & 1:
        return (ld32(mem, blk_a + 2 + 4 * tq), ld32(mem, blk_b + 2 + 4 * tq),
                ld32(mem, blk_a + 18 + 4 * tq), ld32(mem, blk_b + 18 + 4 * tq))
    sel = 0x7610 if tq == 3 else 0x3210
    return (ld32(mem, blk_a + 4 + 4 * tq), ld32(mem, blk_b + 4 + 4 * tq),
            byte_perm(ld32(mem, blk_a + 20 + 4 * tq), ld32(mem, blk_a), sel),
            byte_perm(ld32(mem, blk_b + 20 + 4 * tq), ld32(mem, blk_b), sel))


def s8(v, i):
    x = (v >> (8 * i)) & 255
    return x - 256 if x >= 128 else x


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def row_exp(m):
    """fa_i8_row_exp."""
    if not m > 0.0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", m))[0]
    ex = ((bits >> 23) & 255) - 126
    return min(126, 22 - ex)


def split(v):
    """fa_i8_split: v = hi·2^16 + mid·2^8 + lo, three signed bytes."""
    lo = ((v + 128) & 255) - 128
    r1 = (v - lo) >> 8
    mid = ((r1 + 128) & 255) - 128
    hi = (r1 - mid) >> 8
    check(all(-128 <= t <= 127 for t in (hi, mid, lo)) and hi * 65536 + mid * 256 + lo == v,
          f"split of {v}")
    return hi, mid, lo


def rint(x):
    """__float2int_rn: round half to even."""
    return int(round(x))


def mma_i8(a, b, c):
    """mma.m16n8k32.row.col.s32.s8.s8.s32 for one warp: a[lane] = 4 words, b[lane] = 2 words,
    c[lane] = 4 ints; PTX's fragment layout (g = lane / 4, t = lane % 4)."""
    A = [[0] * 32 for _ in range(16)]
    B = [[0] * 8 for _ in range(32)]
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, col0) in enumerate([(g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t)]):
            for i in range(4):
                A[row][col0 + i] = s8(a[lane][reg], i)
        for reg, k0 in enumerate([4 * t, 16 + 4 * t]):
            for i in range(4):
                B[k0 + i][g] = s8(b[lane][reg], i)
    d = []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        out = []
        for i, (row, col) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            v = c[lane][i] + sum(A[row][k] * B[k][col] for k in range(32))
            check(-2**31 <= v < 2**31, f"int32 overflow {v}")
            out.append(v)
        d.append(out)
    return d


def one_case(rng, D, qscale):
    nb = D // 32
    khb = nb * 34
    # One 16-token tile of K rows (the warp's tokens 16w..16w+15, here w = 0) in the [64][KHB] layout.
    mem = bytearray(64 * khb)
    kvals = [[rng.randint(-128, 127) for _ in range(D)] for _ in range(16)]
    kscl = [[f32(rng.uniform(0.001, 0.05)) for _ in range(nb)] for _ in range(16)]
    for t in range(16):
        for b in range(nb):
            off = t * khb + b * 34
            struct.pack_into("<e", mem, off, kscl[t][b])
            kscl[t][b] = struct.unpack_from("<e", mem, off)[0]
            for i in range(32):
                mem[off + 2 + i] = kvals[t][b * 32 + i] & 255
    # Eight query rows (one n-tile); row 7 is padding (zeros); row 6 is all zero.
    q = [[f32(rng.gauss(0, qscale) * (10 ** rng.uniform(-3, 0))) for _ in range(D)] for _ in range(8)]
    q[6] = [0.0] * D
    q[7] = [0.0] * D
    p2, qs = [], []
    for r in range(8):
        e = row_exp(max(abs(x) for x in q[r]))
        p2.append(2.0 ** e)
        qs.append(2.0 ** -e)
    # B fragments per block and plane, as the prologue builds them.
    qint = [[0] * D for _ in range(8)]
    frag = {}
    for b in range(nb):
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            pk = [[0, 0] for _ in range(3)]
            for j in range(8):
                slot = (0 if j < 4 else 16) + 4 * tq + (j & 3)
                d = b * 32 + slot_value(b, slot)
                v = rint(q[g][d] * p2[g])
                check(abs(v) <= 2**22, f"|q_int| {v} > 2^22")
                qint[g][d] = v
                for pl, part in enumerate(split(v)):
                    pk[pl][j >> 2] |= (part & 255) << (8 * (j & 3))
            frag[b, lane] = pk
    sacc = [[0.0] * 4 for _ in range(32)]
    for b in range(nb):
        a = []
        for lane in range(32):
            g, tq = lane // 4, lane % 4
            a.append(kfrag(mem, g * khb + b * 34, (g + 8) * khb + b * 34, b, tq))
        zero = [[0] * 4 for _ in range(32)]
        d1 = mma_i8(a, [frag[b, ln][0] for ln in range(32)], zero)
        d2 = mma_i8(a, [frag[b, ln][1] for ln in range(32)], [[v * 256 for v in x] for x in d1])
        d3 = mma_i8(a, [frag[b, ln][2] for ln in range(32)], zero)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for i, (tok, row) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
                exact = sum(kvals[tok][b * 32 + k] * qint[row][b * 32 + k] for k in range(32))
                check(d2[lane][i] * 256 + d3[lane][i] == exact, f"D={D} block {b} lane {lane} elem {i}")
                sacc[lane][i] += kscl[tok][b] * (d2[lane][i] * 256.0 + d3[lane][i])
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i, (tok, row) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]):
            got = sacc[lane][i] * qs[row]
            want = sum(kscl[tok][k // 32] * kvals[tok][k] * q[row][k] for k in range(D))
            mag = sum(abs(kscl[tok][k // 32] * kvals[tok][k]) for k in range(D)) * max(abs(x) for x in q[row])
            check(abs(got - want) <= 2.0**-21 * mag + 1e-30, f"D={D} score ({tok}, {row}): {got} vs {want}")


def main():
    rng = random.Random(7)
    for D in (64, 128, 256):
        for qscale in (1e-3, 1.0, 40.0):
            one_case(rng, D, qscale)
    if BAD:
        print(f"attention integer QK (FA_I8QK=1): VIOLATION {BAD[:5]} ({len(BAD)} in all)")
        return 1
    print("attention integer QK (FA_I8QK=1): fragments, slots, three-plane sums and scores: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
