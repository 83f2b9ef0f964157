#!/usr/bin/env bash
# Runs ON THE GPU MACHINE from the repo root (device tool, carry [".device-bin"]):
# the whole engine on CUDA against the CPU backend, on every fixture and the demo model.
#   build here:  cargo build --release -p kvstream-cli --features cuda
#                mkdir -p .device-bin && cp target/release/kvstream .device-bin/
#   run there:   bash scripts/gpu-engine-check.sh
# Checks: greedy tokens identical (CPU vs CUDA, resident vs tiny streaming arena, plain vs MTP),
# logits and MTP logits within 1e-2 of the CPU backend. Writes logs to $OUT.
# These strict checks run the default prefill GEMM (cuBLAS on split bf16 operands, f32-class
# accuracy); the SIMT fallback (KVSTREAM_GEMM=simt) is checked separately per model: logits
# within 1e-2 and greedy tokens equal to the CPU backend's.
set -u
[ -f scripts/cublas-path.sh ] && . scripts/cublas-path.sh
B=${KVSTREAM_BIN:-.device-bin/kvstream}
OUT=${OUT:-/tmp/kvstream-gpu-check}
mkdir -p "$OUT"
pass=0
fail=0
ok() { echo "ok   $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }
tokens_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["tokens"])' "$1" 2>/dev/null; }
PROMPT="5,17,33,2,90,11,7,63,100,21,3,44,8,19"
LONG_PROMPT=$(python3 -c 'print(",".join(str((i*53+7)%180+1) for i in range(100)))')
for m in fixtures/tiny-gqa-f32 fixtures/tiny-mha-tied-bf16 fixtures/tiny-bare-text models/kvstream-demo-tiny; do
  n=$(basename "$m")
  common=(--model "$m" --prompt-tokens "$PROMPT" --n-predict 64 --ignore-eos --json --kv-page-tokens 16)
  for be in cpu cuda; do
    "$B" generate --backend $be "${common[@]}" >"$OUT/$n-$be-resident.json" 2>>"$OUT/err.log"
    "$B" generate --backend $be "${common[@]}" --kv-max-pool-pages 8 --cache-type-k q8_0 --cache-type-v q4_0 >"$OUT/$n-$be-stream-q.json" 2>>"$OUT/err.log"
  done
  "$B" generate --backend cuda "${common[@]}" --kv-max-pool-pages 8 >"$OUT/$n-cuda-stream.json" 2>>"$OUT/err.log"
  "$B" generate --backend cuda "${common[@]}" --kv-max-pool-pages 10 --spec-type draft-mtp --spec-draft-n-max 3 >"$OUT/$n-cuda-mtp.json" 2>>"$OUT/err.log"
  ref=$(tokens_of "$OUT/$n-cpu-resident.json")
  [ -n "$ref" ] || { bad "$n: cpu reference failed"; continue; }
  [ "$(tokens_of "$OUT/$n-cuda-resident.json")" = "$ref" ] && ok "$n: cuda greedy == cpu greedy (64 tokens)" || bad "$n: cuda greedy != cpu greedy"
  [ "$(tokens_of "$OUT/$n-cuda-stream.json")" = "$ref" ] && ok "$n: cuda tiny streaming arena == resident" || bad "$n: cuda streaming != resident"
  [ "$(tokens_of "$OUT/$n-cuda-mtp.json")" = "$ref" ] && ok "$n: cuda MTP draft 3 == plain greedy" || bad "$n: cuda MTP != plain"
  [ "$(tokens_of "$OUT/$n-cuda-stream-q.json")" = "$(tokens_of "$OUT/$n-cpu-stream-q.json")" ] && ok "$n: q8_0/q4_0 streaming cuda == cpu" || bad "$n: q8_0/q4_0 streaming cuda != cpu"
  # 64-token pages with Q8_0 K / Q4_0 V: the tensor-core attention kernel for prefill (a
  # 100-token prompt: query tiles over grid z) and decode; MTP verification on it too.
  long=(--model "$m" --prompt-tokens "$LONG_PROMPT" --n-predict 32 --ignore-eos --json --kv-page-tokens 64
    --cache-type-k q8_0 --cache-type-v q4_0)
  for be in cpu cuda; do
    "$B" generate --backend $be "${long[@]}" >"$OUT/$n-$be-tc.json" 2>>"$OUT/err.log"
  done
  "$B" generate --backend cuda "${long[@]}" --spec-type draft-mtp --spec-draft-n-max 3 >"$OUT/$n-cuda-tc-mtp.json" 2>>"$OUT/err.log"
  tc=$(tokens_of "$OUT/$n-cpu-tc.json")
  [ -n "$tc" ] && [ "$(tokens_of "$OUT/$n-cuda-tc.json")" = "$tc" ] && ok "$n: q8_0/q4_0 64-token pages (tensor-core prefill) cuda == cpu" || bad "$n: tensor-core prefill cuda != cpu"
  [ -n "$tc" ] && [ "$(tokens_of "$OUT/$n-cuda-tc-mtp.json")" = "$(tokens_of "$OUT/$n-cuda-tc.json")" ] && ok "$n: tensor-core MTP draft 3 == plain" || bad "$n: tensor-core MTP != plain"
  ids=$(python3 -c 'print(",".join(str((i*37+11)%200) for i in range(48)))')
  for be in cpu cuda; do
    "$B" logits --backend $be --model "$m" --tokens "$ids" --mtp --out "$OUT/$n-$be-logits.safetensors" 2>>"$OUT/err.log"
  done
  python3 - "$OUT/$n-cpu-logits.safetensors" "$OUT/$n-cuda-logits.safetensors" <<'PY' && ok "$n: logits + mtp_logits within 1e-2" || bad "$n: logits differ"
import sys
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
worst = max(float(abs(a[k] - b[k]).max()) for k in ("logits", "mtp_logits"))
print(f"     max |cpu - cuda| = {worst:.3e}")
sys.exit(0 if worst <= 1e-2 else 1)
PY
  KVSTREAM_GEMM=simt "$B" logits --backend cuda --model "$m" --tokens "$ids" --mtp --out "$OUT/$n-simt-logits.safetensors" 2>>"$OUT/err.log"
  python3 - "$OUT/$n-cpu-logits.safetensors" "$OUT/$n-simt-logits.safetensors" <<'PY' && ok "$n: SIMT-GEMM prefill logits within 1e-2" || bad "$n: SIMT-GEMM prefill logits differ"
import sys
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
worst = max(float(abs(a[k] - b[k]).max()) for k in ("logits", "mtp_logits"))
print(f"     simt: max |cpu - cuda| = {worst:.3e}")
sys.exit(0 if worst <= 1e-2 else 1)
PY
  KVSTREAM_GEMM=simt "$B" generate --backend cuda "${common[@]}" >"$OUT/$n-simt-resident.json" 2>>"$OUT/err.log"
  [ "$(tokens_of "$OUT/$n-simt-resident.json")" = "$ref" ] && ok "$n: SIMT-GEMM greedy == cpu greedy" || bad "$n: SIMT-GEMM greedy != cpu greedy"
  python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))["stats"]; print("     cuda mtp: decode %.1f tok/s, acceptance %s" % (d["decode_tok_per_s"], (d.get("spec") or {}).get("acceptance_rate")))' "$OUT/$n-cuda-mtp.json" 2>/dev/null
done
# Quantized weights (issue 10): CUDA greedy == CPU greedy on the demo model (hidden 256, so
# q4_g128 and q4_nl_g128 really apply), plus MTP on CUDA == plain on CUDA.
m=models/kvstream-demo-tiny
for w in q8_0 q4_g128 q4_nl_g128 fp8_e4m3; do
  common=(--model "$m" --prompt-tokens "$PROMPT" --n-predict 64 --ignore-eos --json --kv-page-tokens 16 --weights $w)
  for be in cpu cuda; do
    "$B" generate --backend $be "${common[@]}" >"$OUT/demo-$w-$be.json" 2>>"$OUT/err.log"
  done
  "$B" generate --backend cuda "${common[@]}" --kv-max-pool-pages 10 --spec-type draft-mtp --spec-draft-n-max 3 >"$OUT/demo-$w-cuda-mtp.json" 2>>"$OUT/err.log"
  ref=$(tokens_of "$OUT/demo-$w-cpu.json")
  [ -n "$ref" ] && [ "$(tokens_of "$OUT/demo-$w-cuda.json")" = "$ref" ] && ok "demo $w: cuda greedy == cpu greedy" || bad "demo $w: cuda greedy != cpu greedy"
  [ -n "$ref" ] && [ "$(tokens_of "$OUT/demo-$w-cuda-mtp.json")" = "$(tokens_of "$OUT/demo-$w-cuda.json")" ] && ok "demo $w: cuda MTP draft 3 == plain" || bad "demo $w: cuda MTP != plain"
done
# Images (issue 11): the vision tower on the GPU. Greedy tokens of a 2-image prompt on tiny-vl
# (image_token_id 250 between vision start/end 248/249), CUDA == CPU (tower weights uploaded per
# image and freed after it).
m=fixtures/tiny-vl
VLP="5,17,248,250,249,33,248,250,249,90,11"
common=(--model "$m" --prompt-tokens "$VLP" --image "$m/img_a.png" --image "$m/img_b.png" --n-predict 32 --ignore-eos --json --kv-page-tokens 4)
for be in cpu cuda; do
  "$B" generate --backend $be "${common[@]}" >"$OUT/vl-$be.json" 2>>"$OUT/err.log"
done
ref=$(tokens_of "$OUT/vl-cpu.json")
[ -n "$ref" ] && [ "$(tokens_of "$OUT/vl-cuda.json")" = "$ref" ] && ok "tiny-vl --image x2: cuda greedy == cpu greedy (vision tower on the GPU)" || bad "tiny-vl --image: cuda greedy != cpu greedy"
echo "$pass passed, $fail failed"
