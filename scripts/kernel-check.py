#!/usr/bin/env python3
"""Compile lockstep's CUDA sources here, without a GPU, with the options the engine uses.

    python3 scripts/kernel-check.py [src/engine/backend/cuda/quant.cu ...] [--arch 90]

NVRTC (the options of `CudaDevice::compile`: no FMA contraction, no FTZ, IEEE div/sqrt) turns each
file into PTX; nvJitLink then assembles it for sm_ARCH and prints each kernel's registers, spills
and shared memory. It needs the PyPI packages `cuda-bindings`, `nvidia-cuda-nvrtc` and
`nvidia-nvjitlink` (pip install cuda-bindings nvidia-cuda-nvrtc nvidia-nvjitlink); the engine
itself never runs this. Exit status 1 on a compile error, with NVRTC's log.
"""
import argparse
import os
import sys

from cuda.bindings import nvjitlink, nvrtc

DEFAULT = ["src/engine/backend/cuda/quant.cu"]


def check(res, what):
    err = res[0] if isinstance(res, tuple) else res
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"{what}: {err}")
    return res[1:] if isinstance(res, tuple) else None


def compile_ptx(path, arch):
    src = open(path, "rb").read()
    if b"// needs: prelude.cuh" in src:  # as CudaDevice::compile_with_prelude does
        src = open(os.path.join(os.path.dirname(path), "prelude.cuh"), "rb").read() + b"\n" + src
    (prog,) = check(nvrtc.nvrtcCreateProgram(src, path.encode(), 0, [], []), "create")
    opts = [b"--fmad=false", b"--ftz=false", b"--prec-div=true", b"--prec-sqrt=true",
            f"--gpu-architecture=compute_{arch}".encode()]
    err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
    (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "log size")
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(prog, log), "log")
    text = log.decode(errors="replace").strip("\x00 \n")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        print(text, file=sys.stderr)
        raise SystemExit(f"{path}: NVRTC failed ({err})")
    if text:
        print(text)
    (size,) = check(nvrtc.nvrtcGetPTXSize(prog), "ptx size")
    ptx = b" " * size
    check(nvrtc.nvrtcGetPTX(prog, ptx), "ptx")
    return ptx


def assemble(ptx, arch):
    h = nvjitlink.create(3, [f"-arch=sm_{arch}", "-verbose", "-O3"])
    try:
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, ptx, len(ptx), "k")
        nvjitlink.complete(h)
        n = nvjitlink.get_info_log_size(h)
        buf = bytearray(n)
        nvjitlink.get_info_log(h, buf)
        return buf.decode(errors="replace").strip("\x00")
    except Exception:
        n = nvjitlink.get_error_log_size(h)
        buf = bytearray(n)
        nvjitlink.get_error_log(h, buf)
        raise SystemExit(buf.decode(errors="replace"))
    finally:
        nvjitlink.destroy(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=DEFAULT)
    ap.add_argument("--arch", default="90")
    a = ap.parse_args()
    for path in a.files:
        info = assemble(compile_ptx(path, a.arch), a.arch)
        fn = None
        for line in info.splitlines():
            if "Compiling entry function" in line:
                fn = line.split("'")[1]
            elif "Used" in line and fn:
                print(f"{path}: {fn}: {line.split('info    :')[-1].strip()}")
            elif "spill" in line and fn and "0 bytes spill stores, 0 bytes spill loads" not in line:
                print(f"{path}: {fn}: {line.split('info    :')[-1].strip()}")


if __name__ == "__main__":
    main()
