#!/usr/bin/env bash
# One GPU session in one call (device tool `run`, carry [".device-bin"]), from the repo root.
# Build here first:
#   CARGO_TARGET_DIR=target bash scripts/gpu-test.sh              # test binaries + cuda_bench
#   cargo build --release -p kvstream-cli --features cuda && strip -o .device-bin/kvstream target/release/kvstream
#   bash scripts/gpu-test.sh --pack                               # strip + xz (64 MiB carry limit)
# Then there:  OUT=$OUT STAGE=1 bash scripts/gpu-session.sh   (then STAGE=2 and STAGE=3, one call
# each: a call may run 600 s)
#
# STAGE 1 (≈ 7 min), each step under its own timeout so one slow step cannot eat the call:
#   1. every CUDA test binary (GPU tests included: --include-ignored)
#   2. cuda_bench (ceilings, GEMV per format, GEMM cuBLAS vs SIMT, chunked GDN, attention)
#   3. ncu on one launch of the decode attention kernel and of the tensor-core q4 GEMV
#   4. scripts/gpu-engine-check.sh (whole engine CUDA vs CPU, incl. quantized weights and images)
# STAGE 2 (≈ 7 min): 27B-geometry benches: bf16 decode at 8/32/256 Ki (plain and draft 3), a 4 Ki
#   prefill (--fill prefill), q4_g128 / q8_0 / fp8_e4m3 at 32/256 Ki.
# STAGE 3: compute-sanitizer memcheck and racecheck on the op, attention and GDN suites.
# STAGE 4 (≈ 5 min): environment-setting variants A/B'd on 27B decode: AB_VARIANTS (see the
#   stage; default AB_ENV=1 then 0 with AB_ENV=KVSTREAM_Q4_FUSED_PREP), AB_WEIGHTS (default
#   q4_g128) at AB_CONTEXTS (default 8Ki,32Ki,256Ki) and AB_DRAFTS (default 0,3), AB_ROUNDS
#   alternating rounds; AB_TESTS test binaries once per variant first.
# Summary lines go to stdout (the reliable channel back) and $OUT/summary.txt.
set -u
D=.device-bin
OUT=${OUT:-/tmp/kvstream-session}
STAGE=${STAGE:-1}
mkdir -p "$OUT"
# The binaries travel stripped and xz-compressed (a device call carries at most 64 MiB together
# with the tracked tree; scripts/gpu-test.sh --pack makes them so).
for z in "$D"/*.xz; do
  [ -e "$z" ] && xz -df "$z" && chmod +x "${z%.xz}"
done
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels
export RUST_BACKTRACE=1
# libcublas (pip wheel) on LD_LIBRARY_PATH for the cuBLAS prefill GEMM.
. scripts/cublas-path.sh
S="$OUT/summary.txt"
. scripts/device-step.sh
nvidia-smi -L >"$OUT/device.txt" 2>&1
BENCH=("$D/kvstream" bench --backend cuda --synthetic qwen3.8-27b --kv-arena 2240MiB
  --cache-type-k q8_0 --cache-type-v q4_0 --decode-tokens 4 --reps 2 --quiet)
roofline() { grep -hE "ceilings|measured/roofline|prefill" "$OUT/$1.log" | head -${2:-12}; }

if [ "$STAGE" = 1 ]; then
  for t in $(cat "$D/tests.list"); do
    step "$t" "${T_TEST:-120}" "$D/$t" --include-ignored --test-threads=1
    grep -hE "^test .*FAILED|panicked|test result" "$OUT/$t.log" | head -8
  done
  step cuda-bench "${T_BENCH:-120}" "$D/cuda_bench" "$OUT"
  grep -vE "^\s*$" "$OUT/cuda_bench.txt" 2>/dev/null | head -90
  NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis
    --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats -c 1"
  mkdir -p "$OUT/ncu-a" "$OUT/ncu-q"
  step ncu-attn 60 env KVSTREAM_BENCH_SKIP_GEMV=1 KVSTREAM_BENCH_SKIP_GEMM=1 \
    $NCU -k regex:attn_q8q4_n1 "$D/cuda_bench" "$OUT/ncu-a"
  grep -hE "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Block Limit|Stall|No Eligible|Issued Warp|Compute \(SM\)|L1/TEX Hit|Warp Cycles Per Issued" "$OUT/ncu-attn.log" | head -30
  step ncu-q4 60 env KVSTREAM_BENCH_SKIP_GEMM=1 \
    $NCU -k regex:gemv_q4mmap "$D/cuda_bench" "$OUT/ncu-q"
  grep -hE "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|No Eligible|Issued Warp|Compute \(SM\)|L1/TEX Hit|Warp Cycles Per Issued" "$OUT/ncu-q4.log" | head -20
  step engine-check "${T_ENGINE:-150}" env KVSTREAM_BIN=$D/kvstream OUT="$OUT/engine" bash scripts/gpu-engine-check.sh
  grep -hE "^(ok|FAIL)|passed|failed" "$OUT/engine-check.log" | tail -60
elif [ "$STAGE" = 2 ]; then
  step bench-bf16 "${T_BF16:-110}" "${BENCH[@]}" --contexts "${CTX_BF16:-8Ki,32Ki,256Ki}" \
    --spec-draft-n-max 0,3 --weights bf16 --out "$OUT/bench-bf16"
  roofline bench-bf16 12
  step bench-prefill "${T_PREFILL:-90}" "${BENCH[@]}" --fill prefill --contexts 4Ki \
    --spec-draft-n-max 0 --weights bf16 --out "$OUT/bench-prefill"
  grep -hE "4096|prefill|roofline" "$OUT/bench-prefill.log" | head -8
  cat "$OUT/bench-prefill/bench.csv" 2>/dev/null | head -3
  for w in ${QUANT_FORMATS:-q4_g128 q8_0 fp8_e4m3}; do
    step "bench-$w" "${T_Q:-60}" "${BENCH[@]}" --contexts 32Ki,256Ki --spec-draft-n-max 0 \
      --weights "$w" --out "$OUT/bench-$w"
    roofline "bench-$w" 6
  done
elif [ "$STAGE" = 4 ]; then
  # AB_VARIANTS: 'tag:ENV=VAL ENV=VAL;tag:...' (an empty list of settings = the default build),
  # each run AB_ROUNDS times (default 1), the variants alternating within a round. AB_TESTS: test
  # binaries (and an optional name filter after '@', e.g. 'test-ops_vs_cpu@norm') run once per
  # variant first. Without AB_VARIANTS: AB_ENV (default KVSTREAM_Q4_FUSED_PREP) = 1 then 0.
  AB_ENV=${AB_ENV:-KVSTREAM_Q4_FUSED_PREP}
  IFS=';' read -r -a variants <<<"${AB_VARIANTS:-on:$AB_ENV=1;off:$AB_ENV=0}"
  for v in "${variants[@]}"; do
    tag=${v%%:*}
    read -r -a envs <<<"${v#*:}"
    i=0
    for t in ${AB_TESTS:-}; do
      i=$((i + 1))
      filt=()
      [ "${t#*@}" != "$t" ] && filt=("${t#*@}")
      step "t$i-${t%%@*}-$tag" "${T_TEST:-120}" env "${envs[@]}" "$D/${t%%@*}" --include-ignored \
        --test-threads=1 "${filt[@]}"
      grep -hE "^test .*FAILED|panicked|test result" "$OUT/t$i-${t%%@*}-$tag.log" | head -4
    done
  done
  for r in $(seq 1 "${AB_ROUNDS:-1}"); do
    for v in "${variants[@]}"; do
      tag=${v%%:*}
      read -r -a envs <<<"${v#*:}"
      step "ab-$tag-$r" "${T_AB:-140}" env "${envs[@]}" "${BENCH[@]}" \
        --contexts "${AB_CONTEXTS:-8Ki,32Ki,256Ki}" --spec-draft-n-max "${AB_DRAFTS:-0,3}" \
        --weights "${AB_WEIGHTS:-q4_g128}" --out "$OUT/ab-$tag-$r"
      roofline "ab-$tag-$r" 12 | sed "s/^/  $tag $r: /" | tee -a "$S"
    done
  done
else
  for tool in memcheck racecheck; do
    for t in $(grep -E 'ops_vs_cpu|attention|gdn|lend|vision' "$D/tests.list"); do
      extra=()
      [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
      step "$tool-$t" "${T_SAN:-90}" compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 \
        "$D/$t" --include-ignored --test-threads=1 --skip cublas_prefill_gemm_matches_cpu_for_every_dtype
      grep -hE "ERROR SUMMARY|RACECHECK SUMMARY|test result|Hazard|Error:" "$OUT/$tool-$t.log" | sort | uniq -c | head -6
    done
  done
fi
cat "$S"
