"""Builds here, with no GPU, the FlashInfer modules that the blend's paged prefill loads on a Hopper GPU.

A GPU session has 15 device minutes, and FlashInfer 0.7.2 JIT-compiles on first use: the FA3 paged prefill and
merge_state alone took 1 min 45 s of one call on the H100 (docs/bench/gpu.md). nvcc
compiles for sm_90a without a GPU, so `pack_flashinfer.sh --aot` builds them here with this module and packs them
where FlashInfer looks for ahead-of-time modules before it compiles (`flashinfer/data/aot/<name>/<name>.so`, the
names its own JIT specs give). A module that is not there is still JIT-built on the GPU machine, as before.

The local CUDA toolkit is incomplete for a link: no libcuda stub (the driver's library, absent on a machine with no
GPU) and curand's headers live in the pip wheel nvidia-curand, outside nvcc's include path (CUTLASS's tools include
them for FA3). So the build runs against an overlay of the toolkit in a temporary folder: its own folders linked, an
empty `libcuda.so` with the driver's soname (nothing in these modules calls the driver API: the linker drops it) and
curand's headers added to `include/`.

    .venv/bin/python -m chunkbench.kernels.flashinfer_aot OUT_DIR [--dtypes bfloat16,float16] [--arch 9.0a]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAD_DIM = 128  # every model shape gpu_blend and tests/test_paged_attention.py run on the GPU


def toolkit_overlay(root: Path) -> Path:
    """A CUDA_HOME under `root` that links the local toolkit and adds what a link of these modules needs."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        sys.exit("no nvcc on PATH: a CUDA toolkit is needed to build FlashInfer's modules")
    # nvcc on PATH may be a wrapper script (here /usr/local/bin/nvcc): nvcc's dry run names its toolkit (TOP)
    dry = subprocess.run([nvcc, "-dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True).stderr
    top = next((line.split("=", 1)[1] for line in dry.splitlines() if line.startswith("#$ TOP=")), None)
    toolkit = Path(top).resolve() if top else Path(nvcc).resolve().parents[1]
    home = root / "cuda"
    (home / "lib64" / "stubs").mkdir(parents=True)
    for name in ("bin", "nvvm", "targets"):
        if (toolkit / name).exists():
            (home / name).symlink_to(toolkit / name)
    include = home / "include"
    include.mkdir()
    for header in (toolkit / "include").iterdir():
        (include / header.name).symlink_to(header)
    import nvidia  # the pip CUDA wheels' namespace package (torch's dependencies)
    for base in map(Path, nvidia.__path__):
        for header in base.glob("*/include/curand*.h"):
            if not (include / header.name).exists():
                (include / header.name).symlink_to(header)
    if not list(include.glob("curand_kernel.h")):
        sys.exit("curand_kernel.h is in neither the toolkit nor the pip nvidia wheels: FA3 cannot be built")
    lib = next(p for p in (toolkit / "lib64", toolkit / "lib") if (p / "libcudart.so").exists())
    (home / "lib64" / "libcudart.so").symlink_to(lib / "libcudart.so")
    stub = home / "lib64" / "stubs" / "libcuda.so"
    source = root / "empty.c"
    source.write_text("")
    subprocess.run(["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(source)], check=True)
    return home


def specs(dtypes: list[str]):
    """The JIT specs PagedSparsePrefill and gpu_blend's FlashInfer variants load: per dtype the FA2 prefill (custom
    mask), the FA3 one (Hopper's unmasked pass); merge_state; segment_packbits."""
    import torch
    from flashinfer.jit.attention.modules import _gen_batch_prefill_primary_module, gen_batch_prefill_module
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.quantization import gen_quantization_module

    out = [gen_quantization_module(), gen_cascade_module()]
    for name in dtypes:
        dtype = getattr(torch, name)
        # dtype q/kv/o, index dtype, head dims, no RoPE in the kernel, no window, no soft cap, fp32 q.k sums
        args = (dtype, dtype, dtype, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False)
        out += [_gen_batch_prefill_primary_module("fa2", *args), gen_batch_prefill_module("fa3", *args)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chunkbench.kernels.flashinfer_aot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="folder that receives flashinfer/data/aot/<name>/<name>.so")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--arch", default="9.0a", help="FLASHINFER_CUDA_ARCH_LIST (H100 and H200: 9.0a)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flashinfer-aot-") as tmp:
        # flashinfer reads these when it is imported: set them first
        os.environ.update(CUDA_HOME=str(toolkit_overlay(Path(tmp))), FLASHINFER_CUDA_ARCH_LIST=args.arch,
                          FLASHINFER_WORKSPACE_BASE=tmp, MAX_JOBS=str(args.jobs))
        for spec in specs([d for d in args.dtypes.split(",") if d]):
            start = time.perf_counter()
            spec.build()
            dest = args.out / "flashinfer" / "data" / "aot" / spec.name / f"{spec.name}.so"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(spec.jit_library_path, dest)
            print(f"{spec.name}: {dest.stat().st_size / 2**20:.1f} MB, {time.perf_counter() - start:.0f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
