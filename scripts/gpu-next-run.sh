#!/usr/bin/env bash
# The waiting GPU measurements of sessions 24-25 in two device calls (carry [".device-bin"], binaries
# of HEAD from scripts/gpu-test.sh --pack plus a stripped kvstream), from the repo root:
#   bash scripts/gpu-next-run.sh checks   # ~9.5 min: q4 tile test (with the split) in the background,
#                                         # FA_I8QK attention suite, attention split counts x FA_I8QK,
#                                         # q4 GEMV rows stream-K / tiles / tiles split, engine check on tiles
#   bash scripts/gpu-next-run.sh decode   # ~6 min: prefetch suite, 27B q4_g128 decode A/B (stream-K,
#                                         # L2 prefetch, tiles, split, split + prefetch), conformance
# Every number goes to stdout and $OUT/<mode>/summary.txt (docs/wip/README.md says what decides what).
set -u
mode=${1:-checks}
OUT=${OUT:-/tmp/kvstream-next}/$mode
. scripts/device-prelude.sh
Q="KVSTREAM_Q4_TILES=1 KVSTREAM_NVRTC_DEFINES=QT_SHARE=1"
case "$mode" in
checks)
  ( step tt 480 env $Q $D/test-ops_vs_cpu --include-ignored --test-threads=1 q4_tile; grep -h "test result\|FAILED\|panicked" $OUT/tt.log | head -5 | sed "s/^/  tt: /" | tee -a $S ) &
  step ai8 150 env KVSTREAM_NVRTC_DEFINES=FA_I8QK=1 $D/test-attention --include-ignored --test-threads=1
  grep -h "test result\|FAILED\|panicked" $OUT/ai8.log | head -6 | sed "s/^/  ai8: /" | tee -a $S
  b() { mkdir -p $OUT/b$1; step b$1 120 env KVSTREAM_BENCH_SKIP_GEMV=1 KVSTREAM_BENCH_SKIP_GEMM=1 KVSTREAM_ATTN_TARGET_BLOCKS=$2 $3 $D/cuda_bench $OUT/b$1; grep -h "hbm_read\|accumulate kernel in" $OUT/b$1.log | sed -E 's/ +/ /g; s/attention q8_0\/q4_0 64Ki tokens//' | sed "s/^/  b$1: /" | tee -a $S; }
  b 528 528; b i528 528 KVSTREAM_NVRTC_DEFINES=FA_I8QK=1; b 396 396; b i396 396 KVSTREAM_NVRTC_DEFINES=FA_I8QK=1
  q() { mkdir -p $OUT/q$1; step q$1 120 env KVSTREAM_BENCH_DTYPES=q4_g128 KVSTREAM_BENCH_SKIP_GEMM=1 KVSTREAM_BENCH_SKIP_ATTN=1 KVSTREAM_BENCH_ROTATE_MIB=512 "${@:2}" $D/cuda_bench $OUT/q$1; python3 scripts/q4_bench_rows.py $OUT/q$1.log q$1 | tee -a $S; }
  q sk KVSTREAM_Q4_TILES=0
  q ts $Q
  q sp $Q KVSTREAM_Q4_TILES_SPLIT=1
  left=$((575 - SECONDS)); echo "eng budget ${left}s" | tee -a $S
  [ $left -gt 60 ] && step eng $left env OUT=$OUT/eng $Q bash scripts/gpu-engine-check.sh
  grep -h "^FAIL" $OUT/eng.log | head -10 | sed "s/^/  eng: /" | tee -a $S
  grep -c "^ok" $OUT/eng.log | sed "s/^/  eng ok count: /" | tee -a $S
  wait; echo =====; cat $S
  ;;
decode)
  d() { step d$1 150 env "${@:2}" $D/kvstream bench --backend cuda --synthetic qwen3.8-27b --kv-arena 2240MiB --cache-type-k q8_0 --cache-type-v q4_0 --decode-tokens 4 --reps 2 --quiet --contexts 32Ki,64Ki --spec-draft-n-max 0,3 --weights q4_g128 --out $OUT/d$1; grep -vE "^\s*$" $OUT/d$1/bench.csv | head -8 | sed "s/^/  d$1: /" | tee -a $S; }
  step pf 120 $D/test-prefetch --include-ignored --test-threads=1
  grep -h "test result\|FAILED\|panicked" $OUT/pf.log | head -4 | sed "s/^/  pf: /" | tee -a $S
  d sk KVSTREAM_Q4_TILES=0
  d skp KVSTREAM_Q4_TILES=0 KVSTREAM_L2_PREFETCH=1
  d ts $Q
  d sp $Q KVSTREAM_Q4_TILES_SPLIT=1
  d spp $Q KVSTREAM_Q4_TILES_SPLIT=1 KVSTREAM_L2_PREFETCH=1
  step cf 150 env $Q KVSTREAM_Q4_TILES_SPLIT=1 KVSTREAM_L2_PREFETCH=1 $D/test-conformance --include-ignored --test-threads=1
  grep -h "test result\|FAILED\|panicked" $OUT/cf.log | head -4 | sed "s/^/  cf: /" | tee -a $S
  echo =====; cat $S
  ;;
*) echo "usage: $0 checks|decode" >&2; exit 2 ;;
esac
