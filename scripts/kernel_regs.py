#!/usr/bin/env python3
"""Register (and spill) counts of kvstream CUDA kernels, without a GPU.

Usage: python3 scripts/kernel_regs.py [--arch sm_90] [--lib libnvrtc.so.13] [--src DIR]
       [--define NAME[=VAL]]... [--nvdisasm PATH] [--cubin-dir DIR] [REGEX]

Compiles each module like scripts/check_kernels.py (common.cuh + <module>.cu, the same options)
but to a cubin for a real architecture, and reads every kernel's register count from the
cubin's `.nv.info` records (EIATTR_REGCOUNT). `--src DIR` reads the .cu files from another
checkout (A/B of two trees). Prints `kernel regs frame` for the kernels matching REGEX (default: all); a frame > 0 means
spills or local arrays. `--define` adds a -D option (the A/B switches that
KVSTREAM_NVRTC_DEFINES sets at run time). `--nvdisasm PATH` (from the nvidia-cuda-nvdisasm wheel)
also prints each kernel's SASS instruction, tensor-core MMA (HMMA/IMMA) and barrier counts: an
MMA count above the source's means the compiler duplicated MMA blocks into branches, which hangs
when lanes of one warp take different copies (session 11: the fused-softmax attention kernel).
"""
import argparse
import ctypes
import glob
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_kernels  # noqa: E402


def elf_regs(cubin):
    """kernel name -> (registers, frame bytes), from a 64-bit little-endian CUDA ELF: the
    EIATTR_REGCOUNT (0x2f) and EIATTR_FRAME_SIZE (0x11) records of the `.nv.info` sections,
    (symbol index, value) each."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = []
    for i in range(shnum):
        o = shoff + i * shentsize
        name, typ, _flags, _addr, off, size, link, _info = struct.unpack_from("<IIQQQQII", cubin, o)
        secs.append((name, typ, off, size, link))
    stroff = secs[shstrndx][2]

    def cstr(at):
        return cubin[at:cubin.index(b"\0", at)].decode()

    names = {}
    for _n, typ, off, size, link in secs:
        if typ == 2:  # SHT_SYMTAB
            strtab = secs[link][2]
            for j in range(size // 24):
                st_name = struct.unpack_from("<I", cubin, off + 24 * j)[0]
                names[j] = cstr(strtab + st_name)
    out = {}
    for n, _typ, off, size, _link in secs:
        if not cstr(stroff + n).startswith(".nv.info"):
            continue
        at, end = off, off + size
        while at + 2 <= end:
            fmt, attr = cubin[at], cubin[at + 1]
            at += 2
            if fmt == 0x04:  # EIFMT_SVAL: u16 size, data
                (sz,) = struct.unpack_from("<H", cubin, at)
                at += 2
                if attr in (0x2F, 0x11) and sz == 8:  # REGCOUNT, FRAME_SIZE (spills, local arrays)
                    sym, v = struct.unpack_from("<II", cubin, at)
                    regs, frame = out.get(names.get(sym, f"sym{sym}"), (0, 0))
                    out[names.get(sym, f"sym{sym}")] = (v, frame) if attr == 0x2F else (regs, v)
                at += sz
            elif fmt == 0x03:  # EIFMT_HVAL
                at += 2
            elif fmt == 0x02:  # EIFMT_BVAL
                at += 1
    return out


def sass_counts(nvdisasm, cubin):
    """kernel name -> (instructions, MMA instructions, barriers), from `nvdisasm -c`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line)
        if m:
            cur = m.group(1)
            out[cur] = [0, 0, 0]
            continue
        if cur is None or not re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", line):
            continue
        c = out[cur]
        c[0] += 1
        c[1] += bool(re.search(r"\b[HI]MMA\.", line))
        c[2] += "BAR.SYNC" in line
    return {k: tuple(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--src", default=check_kernels.CU_DIR)
    ap.add_argument("--cubin-dir", default=None, help="also write each matching module's cubin there (for nvdisasm)")
    ap.add_argument("--define", action="append", default=[], help="NAME[=VAL]: an extra -D option (repeatable)")
    ap.add_argument("--nvdisasm", default=None, help="nvdisasm binary: also print SASS, MMA and barrier counts")
    ap.add_argument("pattern", nargs="?", default=".")
    args = ap.parse_args()
    lib = check_kernels.load_nvrtc(check_kernels.find_nvrtc(args.lib))
    common = open(os.path.join(args.src, "common.cuh"), encoding="utf-8").read()
    pat = re.compile(args.pattern)
    for p in sorted(glob.glob(os.path.join(args.src, "*.cu"))):
        name = os.path.splitext(os.path.basename(p))[0]
        src = common + "\n" + open(p, encoding="utf-8").read()
        if not any(pat.search(k) for k in re.findall(r'__global__\s+void\s+(\w+)', src)):
            continue
        prog = ctypes.c_void_p()
        lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (name + ".cu").encode(), 0, None, None)
        opts = [f"--gpu-architecture={args.arch}".encode()] + [o.encode() for o in check_kernels.OPTIONS]
        opts += [f"-D{d}".encode() for d in args.define]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
            print(f"{name}: compile error", file=sys.stderr)
            return 1
        size = ctypes.c_size_t()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, buf)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        if args.cubin_dir:
            os.makedirs(args.cubin_dir, exist_ok=True)
            with open(os.path.join(args.cubin_dir, name + ".cubin"), "wb") as f:
                f.write(buf.raw)
        sass = sass_counts(args.nvdisasm, buf.raw) if args.nvdisasm else {}
        for k, (r, frame) in sorted(elf_regs(buf.raw).items()):
            if pat.search(k):
                extra = ""
                if k in sass:
                    n, mma, bar = sass[k]
                    extra = f" {n:>6} SASS {mma:>4} MMA {bar:>3} BAR"
                print(f"{k:<28} {r:>4} regs {frame:>6} B frame{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
