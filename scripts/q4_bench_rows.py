#!/usr/bin/env python3
"""One short line per q4_g128 GEMV row of a cuda_bench log (scripts/gpu-next-run.sh): the
x-prepared GEMV in a graph and the in-model SwiGLU + GEMV pair, with shape, T, µs, % of HBM read
and the kernel. Usage: q4_bench_rows.py LOG TAG."""
import re, sys
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"\[(\d+x\d+)\] T=(\d)", line)
    if not m or "q4_g128" not in line:
        continue
    if "pair in a graph" in line:
        p = re.search(r"graph\s+([\d.]+) us.*?\(\s*(\d+)% of HBM", line)
        print(f"  {sys.argv[2]} {m.group(1)} T={m.group(2)} pair {p.group(1)} us {p.group(2)}%")
    elif "x prepared" in line:
        p = re.search(r"graph\s+([\d.]+) us.*?\(\s*(\d+)%\)", line)
        k = re.search(r"\[(gemv_\w+)\]", line)
        print(f"  {sys.argv[2]} {m.group(1)} T={m.group(2)} xprep {p.group(1)} us {p.group(2)}% {k.group(1) if k else ''}")
