#!/usr/bin/env bash
# Attention kernel A/B and profile in one device call (device tool `run`, carry [".device-bin"]),
# from the repo root. Build here first (as for scripts/gpu-session.sh):
#   CARGO_TARGET_DIR=target bash scripts/gpu-test.sh
#   cargo build --release -p kvstream-cli --features cuda && strip -o .device-bin/kvstream target/release/kvstream
#   bash scripts/gpu-test.sh --pack
# Then there:  OUT=$OUT [AB_DEFINES='NAME=VAL,...;NAME=VAL'] [BASE_BENCH=.device-bin/cuda_bench_base] \
#   [AB_ONLY=1] bash scripts/gpu-attn-profile.sh
# Steps: the attention suite (default build, and each AB_DEFINES variant), cuda_bench's
# attention rows for each (and for BASE_BENCH, another commit's cuda_bench, when given), ncu on
# one width-1 launch of the tensor-core kernel (stall reasons per issued instruction, instruction
# count, and per-SASS-instruction source counters as $OUT/att-sass.csv.xz), racecheck on the
# streamed-equals-resident test (the whole suite under racecheck takes > 120 s on an H100), the
# engine check (NCU_ONLY=1 stops after the profile).
set -u
D=.device-bin
OUT=${OUT:-/tmp/kvstream-attn}
mkdir -p "$OUT/bench" "$OUT/ncu"
for z in "$D"/*.xz; do [ -e "$z" ] && xz -df "$z" && chmod +x "${z%.xz}"; done
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels RUST_BACKTRACE=1
. scripts/cublas-path.sh
S="$OUT/summary.txt"
. scripts/device-step.sh
export KVSTREAM_BENCH_SKIP_GEMV=1 KVSTREAM_BENCH_SKIP_GEMM=1
# variant TAG DEFINES: the attention suite and cuda_bench's attention rows of one build (DEFINES =
# a KVSTREAM_NVRTC_DEFINES value; empty = the default build); logs $OUT/attentionTAG.log and
# $OUT/benchTAG.log.
variant() {
  local tag=$1 defs=$2
  local envs=(env -u KVSTREAM_NVRTC_DEFINES)
  [ -n "$defs" ] && envs=(env KVSTREAM_NVRTC_DEFINES="$defs")
  mkdir -p "$OUT/bench$tag"
  step attention$tag 90 "${envs[@]}" "$D/test-attention" --include-ignored --test-threads=1
  grep -hE "test result|panicked" "$OUT/attention$tag.log" | head -4
  step bench$tag 60 "${envs[@]}" "$D/cuda_bench" "$OUT/bench$tag"
  # Into the summary too: a device call returns at most 8 files, so every number is in summary.txt.
  grep -h "in a graph\|hbm_read" "$OUT/bench$tag.log" | sed "s/^/  bench$tag: /" | tee -a "$S"
}
# AB_DEFINES: one or more variants separated by ';' (each a KVSTREAM_NVRTC_DEFINES value, e.g.
# "FA_K_BURST=1;FA_COPY_WALK=1"; ab_variants, scripts/device-step.sh). BASE_BENCH: optionally a
# second cuda_bench binary (another commit's build) timed alongside.
ab_variants variant
if [ -n "${BASE_BENCH:-}" ]; then
  mkdir -p "$OUT/bench-base"
  chmod +x "$BASE_BENCH"
  step bench-base 60 "$BASE_BENCH" "$OUT/bench-base"
  grep -h "in a graph" "$OUT/bench-base.log" | sed "s/^/  bench-base: /" | tee -a "$S"
  step bench-again 60 "$D/cuda_bench" "$OUT/bench"
  grep -h "accumulate kernel in a graph" "$OUT/bench-again.log" | sed "s/^/  bench-again: /" | tee -a "$S"
fi
# AB_ONLY=1: the suites and timings above only (no ncu, racecheck or engine check).
if [ -n "${AB_ONLY:-}" ]; then
  cat "$S"
  exit 0
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
# NCU_ONLY=1: stop after the profile (no racecheck or engine check).
if [ -n "${NCU_ONLY:-}" ]; then
  cat "$S"
  exit 0
fi
step racecheck 120 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 \
  "$D/test-attention" --include-ignored --test-threads=1 fast_decode_kernel_streamed_equals_resident_bit_for_bit
grep -hE "RACECHECK SUMMARY|ERROR SUMMARY|test result" "$OUT/racecheck.log" | head -4
step engine 150 env KVSTREAM_BIN=$D/kvstream OUT="$OUT/engine" bash scripts/gpu-engine-check.sh
grep -hE "^FAIL|passed|failed" "$OUT/engine.log" | tail -8
rm -rf "$OUT/engine"
cat "$S"
