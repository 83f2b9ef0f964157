#!/usr/bin/env bash
# Attention kernel A/B and profile in one device call (device tool `run`, carry [".device-bin"]),
# from the repo root. Build here first (as for scripts/gpu-session.sh):
#   CARGO_TARGET_DIR=target bash scripts/gpu-test.sh
#   cargo build --release -p kvstream-cli --features cuda && strip -o .device-bin/kvstream target/release/kvstream
#   bash scripts/gpu-test.sh --pack
# Then there:  OUT=$OUT [AB_DEFINES=NAME=VAL,...] bash scripts/gpu-attn-profile.sh
# Steps: the attention suite (default build, and the AB_DEFINES build when given), cuda_bench's
# attention rows for both builds, ncu on one width-1 launch of the tensor-core kernel (stall
# reasons per issued instruction, instruction count, and per-SASS-instruction source counters as
# $OUT/att-sass.csv.xz), racecheck on the attention suite, the engine check.
set -u
D=.device-bin
OUT=${OUT:-/tmp/kvstream-attn}
mkdir -p "$OUT/bench" "$OUT/bench-ab" "$OUT/ncu"
for z in "$D"/*.xz; do [ -e "$z" ] && xz -df "$z" && chmod +x "${z%.xz}"; done
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels RUST_BACKTRACE=1
. scripts/cublas-path.sh
S="$OUT/summary.txt"
. scripts/device-step.sh
export KVSTREAM_BENCH_SKIP_GEMV=1 KVSTREAM_BENCH_SKIP_GEMM=1
step attention 90 "$D/test-attention" --include-ignored --test-threads=1
grep -hE "test result|panicked" "$OUT/attention.log" | head -4
step bench 60 "$D/cuda_bench" "$OUT/bench"
grep -h "attention\|hbm_read" "$OUT/bench.log"
if [ -n "${AB_DEFINES:-}" ]; then
  step attention-ab 90 env KVSTREAM_NVRTC_DEFINES="$AB_DEFINES" "$D/test-attention" --include-ignored --test-threads=1
  grep -hE "test result|panicked" "$OUT/attention-ab.log" | head -4
  step bench-ab 60 env KVSTREAM_NVRTC_DEFINES="$AB_DEFINES" "$D/cuda_bench" "$OUT/bench-ab"
  grep -h "attention" "$OUT/bench-ab.log"
fi
NCU=${NCU:-/usr/local/cuda/bin/ncu}
step ncu 120 "$NCU" --clock-control none --section WarpStateStats --section SchedulerStats \
  --section SourceCounters \
  --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.avg" \
  -k regex:attn_q8q4_n1 -c 1 -o "$OUT/att" "$D/cuda_bench" "$OUT/ncu"
# Stall reasons >= 0.05 per issued instruction, and the totals.
"$NCU" -i "$OUT/att.ncu-rep" --page raw --csv 2>/dev/null | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) >= 3:
    for k, v in zip(rows[0], rows[2]):
        if "stalled" in k or "inst_executed.sum" in k or "cycles_elapsed.avg" in k:
            try:
                if float(v.replace(",", "")) >= 0.05:
                    print(k, v)
            except ValueError:
                pass
' | tee "$OUT/stalls.txt"
"$NCU" -i "$OUT/att.ncu-rep" --page source --csv --print-source sass >"$OUT/att-sass.csv" 2>"$OUT/sass.err"
wc -l "$OUT/att-sass.csv"
xz -9 -f "$OUT/att-sass.csv"
rm -f "$OUT/att.ncu-rep"
step racecheck 120 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 \
  "$D/test-attention" --include-ignored --test-threads=1
grep -hE "RACECHECK SUMMARY|ERROR SUMMARY|test result" "$OUT/racecheck.log" | head -4
step engine 150 env KVSTREAM_BIN=$D/kvstream OUT="$OUT/engine" bash scripts/gpu-engine-check.sh
grep -hE "^FAIL|passed|failed" "$OUT/engine.log" | tail -8
rm -rf "$OUT/engine"
cat "$S"
