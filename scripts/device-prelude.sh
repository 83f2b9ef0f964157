# Sourced by the one-call device scripts (scripts/gpu-gemv-profile.sh, scripts/gpu-qualify.sh)
# once they have set OUT: unpacks the binaries in D=.device-bin (scripts/gpu-test.sh --pack),
# points the kernel cache and the cuBLAS wheel's libraries at their places, defines S (the
# summary file) and `step` (scripts/device-step.sh), and records the card.
D=.device-bin
mkdir -p "$OUT"
for z in "$D"/*.xz; do [ -e "$z" ] && xz -df "$z" && chmod +x "${z%.xz}"; done
export KVSTREAM_KERNEL_CACHE=/tmp/kvstream-kernels RUST_BACKTRACE=1
. scripts/cublas-path.sh
S="$OUT/summary.txt"
. scripts/device-step.sh
nvidia-smi -L | tee -a "$S"
