# Sourced (bash): puts the folder of libcublas on LD_LIBRARY_PATH so that the CUDA backend's
# prefill GEMM finds it. cudarc dlopen()s `libcublas.so`, `libcublas.so.13`, … by name (see
# backend-cuda/src/blas.rs), so a pip-installed cuBLAS (wheel `nvidia-cublas`: CUDA 13 puts it in
# site-packages/nvidia/cu13/lib, CUDA 12 in site-packages/nvidia/cublas/lib) is only found through
# LD_LIBRARY_PATH. System installs (ldconfig, /usr/local/cuda/lib64) need nothing. Without
# libcublas the backend logs one warning and runs the SIMT GEMM.
KVSTREAM_CUBLAS_DIR="$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = []
try:
    roots += site.getsitepackages() + [site.getusersitepackages()]
except Exception:
    pass
roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
for r in dict.fromkeys(roots):
    hits = sorted(glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so*"), recursive=True))
    if hits:
        print(os.path.dirname(hits[0]))
        break
PY
)"
if [ -n "$KVSTREAM_CUBLAS_DIR" ]; then
  export LD_LIBRARY_PATH="$KVSTREAM_CUBLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "cuBLAS: $KVSTREAM_CUBLAS_DIR" >&2
elif ! ldconfig -p 2>/dev/null | grep -q 'libcublas\.so'; then
  echo "cuBLAS: not found (pip install nvidia-cublas); the prefill GEMM falls back to SIMT" >&2
fi
