#!/usr/bin/env bash
# Builds the CUDA test binaries and the micro-benchmark HERE (no GPU needed), copies them into the
# git-ignored folder .device-bin/ with a runner script, and prints the one command that runs them
# all on the GPU machine.
#
#   scripts/gpu-test.sh            # build + stage
#
# Then on the GPU machine (device tool `run`, carry [".device-bin"]):
#   bash .device-bin/run.sh
# which runs every test binary with --include-ignored --test-threads=1, compute-sanitizer memcheck
# on the op and attention suites and racecheck on the op and attention suites (when
# compute-sanitizer exists there), and the benchmark, writing
# logs and cuda_bench.txt to $OUT.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.device-bin"
# --pack: strip every staged binary and xz it (the device call carries at most 64 MiB together with
# the tracked tree; scripts/gpu-session.sh unpacks them there).
if [ "${1:-}" = "--pack" ]; then
  for f in "$BIN"/test-* "$BIN"/cuda_bench "$BIN"/kvstream; do
    case "$f" in *.xz) continue ;; esac
    [ -e "$f" ] || continue
    strip "$f" && xz -f -T2 -6 "$f"
  done
  du -sh "$BIN" >&2
  exit 0
fi
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
rm -rf "$BIN"
mkdir -p "$BIN"

echo "building CUDA test binaries (release)..." >&2
cargo test -p kvstream-backend-cuda --release --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        if "backend-cuda" in m.get("manifest_path", "") or "backend-cuda" in m.get("package_id", ""):
            print(m["target"]["name"] + "\t" + m["executable"])
' > "$BIN/tests.tsv"
if [ ! -s "$BIN/tests.tsv" ]; then
  echo "no test executables were built; run: cargo test -p kvstream-backend-cuda --release --no-run" >&2
  exit 1
fi
echo "building the micro-benchmark (release)..." >&2
cargo build -p kvstream-backend-cuda --release --example cuda_bench --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_bench":
        print(m["executable"])
' > "$BIN/bench.path"

: > "$BIN/tests.list"
while IFS=$'\t' read -r name exe; do
  cp "$exe" "$BIN/test-$name"
  strip --strip-debug "$BIN/test-$name" 2>/dev/null || true
  echo "test-$name" >> "$BIN/tests.list"
done < "$BIN/tests.tsv"
cp "$(cat "$BIN/bench.path")" "$BIN/cuda_bench"
cp scripts/cublas-path.sh "$BIN/cublas-path.sh"
strip --strip-debug "$BIN/cuda_bench" 2>/dev/null || true
rm -f "$BIN/tests.tsv" "$BIN/bench.path"

cat > "$BIN/run.sh" <<'RUN'
#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: bash .device-bin/run.sh
set -uo pipefail
D="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-/tmp/kvstream-out}"
mkdir -p "$OUT"
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels
export RUST_BACKTRACE=1
# libcublas (pip wheel) on LD_LIBRARY_PATH for the cuBLAS prefill GEMM (scripts/cublas-path.sh).
. "$D/cublas-path.sh"
fail=0
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
for t in $(cat "$D/tests.list"); do
  echo "=== $t" | tee -a "$OUT/tests.log"
  "$D/$t" --include-ignored --test-threads=1 2>&1 | tee -a "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || fail=1
done
"$D/cuda_bench" "$OUT" 2>&1 | tee "$OUT/bench.log" || fail=1
# The large cuBLAS-vs-CPU sweep is left out of the sanitizer runs (time; cuBLAS's kernels are not
# ours, and our conversion/dequant kernels run in the smaller cuBLAS tests).
SAN_SKIP=cublas_prefill_gemm_matches_cpu_for_every_dtype
if command -v compute-sanitizer >/dev/null 2>&1; then
  for t in $(grep -E 'ops_vs_cpu|attention|conformance' "$D/tests.list"); do
    echo "=== memcheck $t" | tee -a "$OUT/memcheck.log"
    timeout "${MEMCHECK_TIMEOUT:-150}" compute-sanitizer --tool memcheck --error-exitcode 99 \
      "$D/$t" --include-ignored --test-threads=1 --skip "$SAN_SKIP" >> "$OUT/memcheck.log" 2>&1
    rc=$?
    echo "memcheck $t rc=$rc" | tee -a "$OUT/memcheck.log"
    [ "$rc" -eq 0 ] || fail=1
  done
  grep -E "ERROR SUMMARY|test result" "$OUT/memcheck.log"
  # racecheck: shared-memory hazards (every kernel that uses shared memory is reached by these).
  for t in $(grep -E 'ops_vs_cpu|attention' "$D/tests.list"); do
    echo "=== racecheck $t" | tee -a "$OUT/racecheck.log"
    timeout "${RACECHECK_TIMEOUT:-150}" compute-sanitizer --tool racecheck --racecheck-report hazard \
      --error-exitcode 99 "$D/$t" --include-ignored --test-threads=1 --skip "$SAN_SKIP" >> "$OUT/racecheck.log" 2>&1
    rc=$?
    echo "racecheck $t rc=$rc" | tee -a "$OUT/racecheck.log"
    [ "$rc" -eq 0 ] || fail=1
  done
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" "$OUT/racecheck.log"
else
  echo "compute-sanitizer not found: memcheck skipped" | tee "$OUT/memcheck.log"
fi
echo "overall: $([ $fail -eq 0 ] && echo PASS || echo FAIL)"
exit $fail
RUN
chmod +x "$BIN/run.sh" "$BIN"/test-* "$BIN/cuda_bench"
du -sh "$BIN" >&2
ls -la "$BIN" >&2
echo
echo "Staged in $BIN. Run on the GPU machine (device tool 'run', carry [\".device-bin\"]):"
echo "  bash .device-bin/run.sh"
