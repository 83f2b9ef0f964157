#!/usr/bin/env python3
"""Registers and local-memory (spill) instructions per kernel of one module, compiled here for a
real architecture with the NVRTC wheel, no GPU needed: the first look at a kernel edit before a
device run (a register count over the launch bounds, or new STL/LDL, shows up here).

Usage: python3 scripts/kernel_regs.py MODULE [--arch sm_90] [--define NAME=VAL ...] [--match REGEX]
Prints `kernel regs STL LDL` rows. Needs the NVRTC wheel (as scripts/check_kernels.py) and, for the
spill counts, nvdisasm from the same wheel folder (`nvidia/cu13/bin`); without it STL/LDL are `-`.
"""
import argparse
import ctypes
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_kernels as ck  # noqa: E402


def compile_cubin(lib, name, src, arch, defines):
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), (name + ".cu").encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in ck.OPTIONS]
    opts += [f"-D{d}".encode() for d in defines]
    r = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if r:
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.value.decode(errors="replace"))
    n = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def kernel_regs(cubin):
    """kernel -> registers: EIATTR_REGCOUNT (0x2f) entries of the `.nv.info` section, whose
    operand is a `.symtab` index."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    # name, type, flags, addr, offset, size, link, info, addralign, entsize
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def name(strtab, off):
        base = heads[strtab][4] + off
        return cubin[base:cubin.index(b"\0", base)].decode()

    secs = {name(shstrndx, h[0]): h for h in heads}
    symtab = secs[".symtab"]
    syms = []
    for i in range(symtab[5] // 24):
        st_name, = struct.unpack_from("<I", cubin, symtab[4] + i * 24)
        syms.append(name(symtab[6], st_name))
    info = secs[".nv.info"]
    out, pos, end = {}, info[4], info[4] + info[5]
    while pos + 4 <= end:
        fmt, attr, size = struct.unpack_from("<BBH", cubin, pos)
        if fmt == 0x04:  # EIFMT_SVAL: a u16 size, then the operand
            if attr == 0x2F and size == 8:
                sym, regs = struct.unpack_from("<II", cubin, pos + 4)
                out[syms[sym]] = regs
            pos += 4 + size
        else:  # EIFMT_NVAL / EIFMT_BVAL / EIFMT_HVAL: a 2-byte inline operand
            pos += 4
    return out


def spills(cubin, nvdisasm):
    """kernel -> (STL, LDL) instruction counts from nvdisasm, or None without it."""
    if not nvdisasm:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout
    out, cur = {}, None
    for line in text.splitlines():
        m = re.match(r"\s*\.text\.(\w+):", line) or re.match(r"\.section\s+\.text\.(\w+)", line)
        if m:
            cur = m.group(1)
            out.setdefault(cur, [0, 0])
        elif cur:
            out[cur][0] += " STL" in line
            out[cur][1] += " LDL" in line
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("module")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--lib", default=None)
    ap.add_argument("--define", action="append", default=[])
    ap.add_argument("--match", default="")
    a = ap.parse_args()
    path = ck.find_nvrtc(a.lib)
    lib = ck.load_nvrtc(path)
    common = open(os.path.join(ck.CU_DIR, "common.cuh"), encoding="utf-8").read()
    src = common + "\n" + open(os.path.join(ck.CU_DIR, a.module + ".cu"), encoding="utf-8").read()
    cubin = compile_cubin(lib, a.module, src, a.arch, a.define)
    nvd = os.path.join(os.path.dirname(os.path.dirname(path)), "bin", "nvdisasm")
    sp = spills(cubin, nvd if os.path.exists(nvd) else None)
    for k, r in sorted(kernel_regs(cubin).items()):
        if re.search(a.match, k):
            st, ld = sp.get(k, ["-", "-"]) if sp is not None else ("-", "-")
            print(f"{k:40s} {r:4d} {st!s:>4} {ld!s:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
