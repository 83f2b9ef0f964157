#!/usr/bin/env python3
"""One line per profiled launch from `ncu -i REPORT --page raw --csv` on stdin: ID, grid, duration,
DRAM bytes read, instructions, cycles, and every warp stall reason of at least --min (default
0.05) warps per issued instruction (scripts/gpu-gemv-profile.sh)."""
import argparse
import csv
import sys

KEEP = ("duration.sum", "dram__bytes_read.sum", "inst_executed.sum", "cycles_elapsed.avg")
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--min", type=float, default=0.05)
    args = ap.parse_args()
    rows = list(csv.reader(sys.stdin))
    if len(rows) < 3:
        print("no launches in the report", file=sys.stderr)
        return 1
    head = rows[0]
    for r in rows[2:]:
        out = []
        for k, v in zip(head, r):
            if k in ("ID", "Kernel Name", "Grid Size") or any(k.endswith(s) for s in KEEP):
                out.append(f"{k}={v}")
            elif k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX):
                x = number(v)
                if x is not None and x >= args.min:
                    out.append(f"{k[len(STALL_PREFIX):-len(STALL_SUFFIX)]}={v}")
        print(" ".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
