#!/usr/bin/env bash
# The issue targets measured on the card that comes, in one device call (device tool `run`, carry
# [".device-bin"]), from the repo root; build as for scripts/gpu-session.sh. Then there:
#   OUT=$OUT [FORMATS='bf16 q4_g128 q8_0 fp8_e4m3'] [CONTEXTS=32Ki,256Ki] bash scripts/gpu-qualify.sh
# 1. cuda_bench (ceilings: pinned H2D and HBM read; GEMV per weight format, graph-timed, weights
#    cycled through >= 512 MiB of copies; streamed attention at 64 Ki; GEMM skipped): issue 6's
#    bf16 GEMV >= 80% and attention >= 70% of HBM read, issue 10's 4-bit GEMV >= 70%;
# 2. 27B-geometry decode per weight format at CONTEXTS (2,240 MiB arena, K q8_0 / V q4_0):
#    tok/s, the H2D bytes and GB/s the copy stream moved per step while compute ran (issue 6's
#    overlap) and the roofline.
# Every number goes to stdout and $OUT/summary.txt.
set -u
OUT=${OUT:-/tmp/kvstream-qualify}
. scripts/device-prelude.sh
mkdir -p "$OUT/bench"
step cuda-bench "${T_BENCH:-180}" env KVSTREAM_BENCH_SKIP_GEMM=1 KVSTREAM_BENCH_ROTATE_MIB=512 \
  "$D/cuda_bench" "$OUT/bench"
grep -hE "device:|h2d|hbm_read|T=1:|attention" "$OUT/cuda-bench.log" | sed -E 's/ +/ /g' | head -60 | tee -a "$S"
for w in ${FORMATS:-bf16 q4_g128 q8_0 fp8_e4m3}; do
  step "decode-$w" "${T_DECODE:-110}" "$D/kvstream" bench --backend cuda --synthetic qwen3.8-27b \
    --kv-arena 2240MiB --cache-type-k q8_0 --cache-type-v q4_0 --decode-tokens 4 --reps 2 --quiet \
    --contexts "${CONTEXTS:-32Ki,256Ki}" --spec-draft-n-max 0 --weights "$w" --out "$OUT/decode-$w"
  grep -hE "ceilings|measured/roofline|tok/s|decode/s" "$OUT/decode-$w.log" | head -8 | tee -a "$S"
  grep -vE "^\s*$" "$OUT/decode-$w/bench.csv" 2>/dev/null | head -4 | tee -a "$S"
done
