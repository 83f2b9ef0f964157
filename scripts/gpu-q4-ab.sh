#!/usr/bin/env bash
# A/B of q4 GEMV kernel defines in one device call (device tool `run`, carry [".device-bin"]),
# from the repo root. Build here first (as for scripts/gpu-session.sh), then there:
#   OUT=$OUT AB_DEFINES='NAME=VAL,...;NAME=VAL' [TESTS='test-ops_vs_cpu ...'] \
#     [CONTEXTS=8Ki,32Ki] [DRAFTS=0,3] bash scripts/gpu-q4-ab.sh
# For the default build and each AB_DEFINES variant (a KVSTREAM_NVRTC_DEFINES value, or
# `env:NAME=VAL ...` for launcher switches such as `env:KVSTREAM_Q4_TILES=1`): TESTS (GPU
# tests included; default: the op suite, the fused x prep and the conformance suite), cuda_bench's
# q4_g128 GEMV rows (graph-timed, weights cycled through >= 512 MiB of copies, GEMM and attention
# skipped; the "pair" rows time the SwiGLU producer and the GEMV together, as decode runs them),
# and 27B-geometry q4_g128 decode (2,240 MiB arena, K q8_0 / V q4_0) at CONTEXTS with DRAFTS.
# Every number also goes to stdout and $OUT/summary.txt (a call returns at most 8 files).
set -u
OUT=${OUT:-/tmp/kvstream-q4ab}
. scripts/device-prelude.sh

variant() {
  local tag=$1 defs=$2
  local envs=(env -u KVSTREAM_NVRTC_DEFINES)
  # "env:NAME=VAL NAME=VAL": a variant of launcher switches (environment) on the default kernels.
  case "$defs" in
  env:*) read -r -a kv <<<"${defs#env:}" && envs=(env -u KVSTREAM_NVRTC_DEFINES "${kv[@]}") ;;
  ?*) envs=(env KVSTREAM_NVRTC_DEFINES="$defs") ;;
  esac
  for t in ${TESTS:-test-ops_vs_cpu test-fused_prep test-conformance}; do
    step "$t$tag" "${T_TEST:-150}" "${envs[@]}" "$D/$t" --include-ignored --test-threads=1
    grep -hE "^test .*FAILED|panicked|test result" "$OUT/$t$tag.log" | head -6 | tee -a "$S"
  done
  mkdir -p "$OUT/bench$tag"
  step "bench$tag" "${T_BENCH:-150}" "${envs[@]}" KVSTREAM_BENCH_DTYPES=q4_g128 KVSTREAM_BENCH_SKIP_GEMM=1 \
    KVSTREAM_BENCH_SKIP_ATTN=1 KVSTREAM_BENCH_ROTATE_MIB=512 "$D/cuda_bench" "$OUT/bench$tag"
  grep -hE "hbm_read|i8c" "$OUT/bench$tag.log" | sed -E 's/ +/ /g' | sed "s/^/  bench$tag: /" | tee -a "$S"
  step "decode$tag" "${T_DECODE:-150}" "${envs[@]}" "$D/kvstream" bench --backend cuda \
    --synthetic qwen3.8-27b --kv-arena 2240MiB --cache-type-k q8_0 --cache-type-v q4_0 \
    --decode-tokens 4 --reps 2 --quiet --contexts "${CONTEXTS:-8Ki,32Ki}" \
    --spec-draft-n-max "${DRAFTS:-0,3}" --weights q4_g128 --out "$OUT/decode$tag"
  grep -vE "^\s*$" "$OUT/decode$tag/bench.csv" 2>/dev/null | head -8 | sed "s/^/  decode$tag: /" | tee -a "$S"
}

ab_variants variant
cat "$S"
