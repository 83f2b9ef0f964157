#!/usr/bin/env bash
# The q4 decode GEMV as the model runs it, in one device call (device tool `run`, carry
# [".device-bin"]), from the repo root. Build here first (as for scripts/gpu-session.sh):
#   CARGO_TARGET_DIR=target bash scripts/gpu-test.sh
#   cargo build --release -p kvstream-cli --features cuda && strip -o .device-bin/kvstream target/release/kvstream
#   bash scripts/gpu-test.sh --pack
# Then there:  OUT=$OUT [TESTS='test-ops_vs_cpu ...'] [ENGINE=1] [ROTATE_MIBS='0 512'] \
#   [NCU_SKIP=400] bash scripts/gpu-gemv-profile.sh
# Steps:
#   1. TESTS (test binaries of .device-bin, GPU tests included) and, with ENGINE=1, the engine
#      check (scripts/gpu-engine-check.sh);
#   2. cuda_bench's q4_g128 GEMV rows (GEMM and attention skipped) once per ROTATE_MIBS value
#      (KVSTREAM_BENCH_ROTATE_MIB: the weight copies the timed calls cycle through; 0 = one copy,
#      every call re-reading the same weight, partly from L2);
#   3. ncu on NCU_COUNT (default 4) consecutive `gemv_q4i8c1_xs` launches of a 27B q4_g128 decode
#      step (NCU_SKIP of them skipped first: 400 = the qkv+z, out, gate+up and down GEMVs of GDN
#      layer 36 of the second step), caches flushed before each replay pass as a decode step's
#      weights are cold: duration, speed of light, warp stall reasons per issued instruction and
#      per-SASS-instruction source counters ($OUT/gemv-sass.csv.xz).
# Every number also goes to stdout and $OUT/summary.txt (a call returns at most 8 files).
set -u
OUT=${OUT:-/tmp/kvstream-gemv}
. scripts/device-prelude.sh

for t in ${TESTS:-}; do
  step "$t" "${T_TEST:-150}" "$D/$t" --include-ignored --test-threads=1
  grep -hE "^test .*FAILED|panicked|test result" "$OUT/$t.log" | head -6 | tee -a "$S"
done
if [ -n "${ENGINE:-}" ]; then
  step engine "${T_ENGINE:-200}" env KVSTREAM_BIN=$D/kvstream OUT="$OUT/engine" bash scripts/gpu-engine-check.sh
  grep -hE "^FAIL|passed|failed" "$OUT/engine.log" | tail -8 | tee -a "$S"
  rm -rf "$OUT/engine"
fi

for mib in ${ROTATE_MIBS:-0 512}; do
  mkdir -p "$OUT/bench-r$mib"
  step "bench-r$mib" "${T_BENCH:-150}" env KVSTREAM_BENCH_DTYPES=q4_g128 KVSTREAM_BENCH_SKIP_GEMM=1 \
    KVSTREAM_BENCH_SKIP_ATTN=1 KVSTREAM_BENCH_ROTATE_MIB="$mib" "$D/cuda_bench" "$OUT/bench-r$mib"
  grep -hE "hbm_read|i8c" "$OUT/bench-r$mib.log" | sed "s/^/  r$mib: /" | tee -a "$S"
done

if [ -n "${NCU_SKIP-400}" ]; then
  NCU=${NCU:-ncu}
  step ncu-gemv "${T_NCU:-240}" "$NCU" --clock-control none --section SpeedOfLight \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,sm__cycles_elapsed.avg,gpu__time_duration.sum,dram__bytes_read.sum" \
    -k regex:gemv_q4i8c1_xs --launch-skip "${NCU_SKIP:-400}" -c "${NCU_COUNT:-4}" -o "$OUT/gemv" \
    "$D/kvstream" bench --backend cuda --synthetic qwen3.8-27b --kv-arena 2240MiB --cache-type-k q8_0 \
    --cache-type-v q4_0 --contexts 8Ki --decode-tokens 2 --reps 1 --spec-draft-n-max 0 \
    --weights q4_g128 --quiet
  # Per launch: duration, DRAM bytes, instructions and the stall reasons >= 0.05 per issue.
  "$NCU" -i "$OUT/gemv.ncu-rep" --page raw --csv 2>/dev/null | python3 scripts/ncu_raw_summary.py | tee -a "$S"
  "$NCU" -i "$OUT/gemv.ncu-rep" --page details --csv 2>/dev/null | grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issued Warp|No Eligible" | head -40 | tee -a "$S"
  "$NCU" -i "$OUT/gemv.ncu-rep" --page source --csv --print-source sass >"$OUT/gemv-sass.csv" 2>"$OUT/sass.err"
  wc -l "$OUT/gemv-sass.csv"
  xz -9 -f "$OUT/gemv-sass.csv"
  rm -f "$OUT/gemv.ncu-rep"
fi
echo "--- summary"
cat "$S"
