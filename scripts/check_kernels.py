#!/usr/bin/env python3
"""Compile every kvstream CUDA kernel module with NVRTC (CI check, no GPU needed).

Setup (CI):  pip install "nvidia-cuda-nvrtc==13.0.*"
Usage:       python3 scripts/check_kernels.py [--arch compute_90] [--lib /path/to/libnvrtc.so.13]
             [--define NAME[=VAL]]...   (the A/B switches KVSTREAM_NVRTC_DEFINES sets at run time)

Each module is compiled exactly as backend-cuda compiles it at run time: kernels/src/cu/common.cuh
prepended to kernels/src/cu/<module>.cu, with the same options. Prints a table (module, result,
PTX bytes, kernels found) and exits non-zero if any module fails to compile or lacks a kernel
that kernels/src/lib.rs lists.
"""
import argparse
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_DIR = os.path.join(ROOT, "kernels", "src", "cu")
LIB_RS = os.path.join(ROOT, "kernels", "src", "lib.rs")
# Must match kernels/src/lib.rs NVRTC_OPTIONS (without the architecture).
OPTIONS = ["--std=c++17", "-default-device"]


def find_nvrtc(explicit):
    if explicit:
        return explicit
    try:
        import nvidia  # type: ignore

        for base in list(getattr(nvidia, "__path__", [])):
            hits = sorted(glob.glob(os.path.join(base, "**", "libnvrtc.so*"), recursive=True))
            hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
            if hits:
                return hits[0]
    except ImportError:
        pass
    return "libnvrtc.so.13"


def load_nvrtc(path):
    """The NVRTC library at `path` (raises OSError)."""
    # libnvrtc dlopen()s libnvrtc-builtins by soname: load it first from the same folder.
    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
        if ".alt." not in b:
            try:
                ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                pass
    return ctypes.CDLL(path)


def expected_kernels():
    """module name -> kernel names, parsed from the Rust table in kernels/src/lib.rs."""
    text = open(LIB_RS, encoding="utf-8").read()
    table = {}
    for m in re.finditer(r'module:\s*"(\w+)".*?kernels:\s*&\[(.*?)\]', text, re.S):
        table[m.group(1)] = re.findall(r'"(\w+)"', m.group(2))
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="compute_90")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--define", action="append", default=[], help="NAME[=VAL], passed as -D")
    args = ap.parse_args()
    path = find_nvrtc(args.lib)
    try:
        lib = load_nvrtc(path)
    except OSError as e:
        print(f"cannot load NVRTC from {path}: {e}", file=sys.stderr)
        return 2
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    defs = " ".join(f"-D{d}" for d in args.define)
    print(f"NVRTC {major.value}.{minor.value} from {path}, arch {args.arch} {defs}".rstrip())
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    common = open(os.path.join(CU_DIR, "common.cuh"), encoding="utf-8").read()
    expected = expected_kernels()
    modules = sorted(p for p in glob.glob(os.path.join(CU_DIR, "*.cu")))
    failures = 0
    rows = []
    for p in modules:
        name = os.path.splitext(os.path.basename(p))[0]
        src = common + "\n" + open(p, encoding="utf-8").read()
        prog = ctypes.c_void_p()
        r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (name + ".cu").encode(), 0, None, None)
        if r != 0:
            rows.append((name, "create failed", 0, ""))
            failures += 1
            continue
        opts = [f"--gpu-architecture={args.arch}".encode()] + [o.encode() for o in OPTIONS]
        opts += [f"-D{d}".encode() for d in args.define]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        r = lib.nvrtcCompileProgram(prog, len(opts), arr)
        log_size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
        log = ctypes.create_string_buffer(log_size.value)
        lib.nvrtcGetProgramLog(prog, log)
        ptx_len = 0
        missing = []
        if r == 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
            ptx = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetPTX(prog, ptx)
            ptx_len = size.value
            text = ptx.value.decode(errors="replace")
            for k in expected.get(name, []):
                if not re.search(r"\.entry\s+" + re.escape(k) + r"\(", text):
                    missing.append(k)
            if name not in expected:
                missing.append("<module not in kernels/src/lib.rs>")
        status = "ok" if r == 0 and not missing else ("compile error" if r != 0 else "missing kernels")
        if status != "ok":
            failures += 1
        rows.append((name, status, ptx_len, ", ".join(missing)))
        if r != 0 or log.value.strip():
            print(f"--- {name}.cu log ---\n{log.value.decode(errors='replace')}")
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    for name in expected:
        if not os.path.exists(os.path.join(CU_DIR, name + ".cu")):
            rows.append((name, "source missing", 0, ""))
            failures += 1
    print(f"{'module':<14} {'result':<16} {'ptx bytes':>10}  notes")
    for name, status, n, notes in rows:
        print(f"{name:<14} {status:<16} {n:>10}  {notes}")
    print(f"{len(rows)} modules, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
