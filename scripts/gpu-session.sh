#!/usr/bin/env bash
# One GPU session in one call (device tool `run`, carry [".device-bin"]), from the repo root.
# Build here first:
#   CARGO_TARGET_DIR=target bash scripts/gpu-test.sh              # test binaries + cuda_bench
#   cargo build --release -p kvstream-cli --features cuda && strip -o .device-bin/kvstream target/release/kvstream
# Runs, each step under its own timeout so one slow step cannot eat the session:
#   1. the CUDA attention suite (GPU tests, --include-ignored)
#   2. scripts/gpu-engine-check.sh (whole engine CUDA vs CPU, incl. quantized weights)
#   3. 27B-geometry decode bench, bf16 at 8/32/256 Ki (plain and draft 3)
#   4. cuda_bench (attention GB/s at 64 Ki, widths 1 and 4; HBM and H2D ceilings); its GEMV
#      section is skipped here (run .device-bin/cuda_bench alone for it)
#   5. 27B benches of each quantized weight format at 32 and 256 Ki, then the conformance suite.
# Most important first: a call cut short by its time limit still returns what $OUT holds.
set -u
D=.device-bin
OUT=${OUT:-/tmp/kvstream-session}
mkdir -p "$OUT"
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels
export RUST_BACKTRACE=1
# libcublas (pip wheel) on LD_LIBRARY_PATH for the cuBLAS prefill GEMM.
. scripts/cublas-path.sh
S="$OUT/summary.txt"
step() { # name timeout cmd...
  local name=$1 t=$2
  shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc ${SECONDS}s total ($((SECONDS - t0))s)" | tee -a "$S"
}
nvidia-smi -L >"$OUT/device.txt" 2>&1
step attention-tests "${T_ATT:-80}" "$D/test-attention" --include-ignored --test-threads=1
step engine-check "${T_ENGINE:-140}" env KVSTREAM_BIN=$D/kvstream OUT="$OUT/engine" bash scripts/gpu-engine-check.sh
BENCH=("$D/kvstream" bench --backend cuda --synthetic qwen3.8-27b --kv-arena 2240MiB
  --cache-type-k q8_0 --cache-type-v q4_0 --decode-tokens 4 --reps 2 --quiet)
step bench-bf16 "${T_BF16:-100}" "${BENCH[@]}" --contexts "${CTX_BF16:-8Ki,32Ki,256Ki}" \
  --spec-draft-n-max 0,3 --weights bf16 --out "$OUT/bench-bf16"
step cuda-bench "${T_BENCH:-80}" env KVSTREAM_BENCH_SKIP_GEMV=1 "$D/cuda_bench" "$OUT"
for w in ${QUANT_FORMATS:-q4_g128 q8_0 fp8_e4m3}; do
  step "bench-$w" "${T_Q:-45}" "${BENCH[@]}" --contexts 32Ki,256Ki --spec-draft-n-max 0 \
    --weights "$w" --out "$OUT/bench-$w"
done
step conformance-tests "${T_CONF:-40}" "$D/test-conformance" --include-ignored --test-threads=1
grep -hE "passed|failed|FAIL" "$OUT/engine-check.log" | tail -3 >>"$S"
grep -hE "test result" "$OUT/attention-tests.log" "$OUT/conformance-tests.log" >>"$S"
cat "$S"
