#!/usr/bin/env bash
# Builds scripts/gdn_chunk_emu.cpp with the chunked GDN kernels of kernels/src/cu/recurrent.cu and
# runs it on ragged shapes, chunk sizes and segment lengths; fails if any error exceeds 1e-4 · rms.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -n '/---- Chunked/,$p' "$root/kernels/src/cu/recurrent.cu" > "$tmp/kernels.inc"
g++ -std=c++20 -O2 -w -pthread -DGDN_KERNELS="\"$tmp/kernels.inc\"" "$root/scripts/gdn_chunk_emu.cpp" -o "$tmp/emu"
for args in "1 2 4 128 128 64 2048" "63 2 4 128 128 64 2048" "64 2 4 128 128 64 2048" \
    "65 2 4 128 128 64 2048" "1000 2 4 128 128 64 2048" "300 1 3 40 48 64 128" "300 1 3 40 48 16 100" \
    "150 2 2 33 70 7 2048" "130 4 8 128 32 64 64" "200 2 4 128 48 64 2048 x"; do
    # shellcheck disable=SC2086
    "$tmp/emu" $args
done
