#!/usr/bin/env python3
"""Per-kernel GPU time of whole decode steps, from an ncu CSV of a `kvstream bench` run.

On the GPU machine (docs/benchmarks.md, session 8, run 2):

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum \\
        --csv --print-units base --log-file ncu.csv \\
        kvstream bench --backend cuda --synthetic qwen3.8-27b ... --decode-tokens 2 --reps 1 \\
        --contexts 8Ki --spec-draft-n-max 0 --weights q4_g128

Here:

    python3 scripts/ncu_steps.py ncu.csv[.xz] [MARKER] [STEPS]

A step ends at each launch whose kernel name contains MARKER (default `gemv_q8_0`: the 27B
synthetic model's lm_head, the last GEMV of a step); the last STEPS (default 2) complete steps
are printed as kernel name, total µs, share, launches and mean µs, largest first.
"""
import collections
import csv
import lzma
import sys


def read_launches(path):
    """(kernel name, duration in ns) of every profiled launch, in launch order."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = csv.reader(lines)
    header = next(rows)
    name_i, value_i = header.index("Kernel Name"), header.index("Metric Value")
    out = []
    for row in rows:
        if row[0] == "ID":
            continue
        try:
            value = float(row[value_i].replace(",", ""))
        except ValueError:
            continue
        out.append((row[name_i].split("(")[0], value))
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    launches = read_launches(sys.argv[1])
    marker = sys.argv[2] if len(sys.argv) > 2 else "gemv_q8_0"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    ends = [i for i, (name, _) in enumerate(launches) if marker in name]
    print(f"{len(launches)} launches profiled, {len(ends)} contain {marker!r}")
    if len(ends) < 2:
        print("need at least two step ends")
        return 1
    for s in range(min(steps, len(ends) - 1)):
        seg = launches[ends[-2 - s] + 1 : ends[-1 - s] + 1]
        total = sum(v for _, v in seg) / 1e3
        print(f"\n== step {len(ends) - 1 - s}: {len(seg)} kernels, {total:.1f} us of kernel time")
        agg = collections.defaultdict(lambda: [0, 0.0])
        for name, v in seg:
            agg[name][0] += 1
            agg[name][1] += v / 1e3
        for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            print(f"{t:9.1f} us {100 * t / total:5.1f}%  n={n:4d}  mean {t / n:7.2f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
