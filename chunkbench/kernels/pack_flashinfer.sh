#!/usr/bin/env bash
# Packs the .venv's FlashInfer into .fi/ so that chunkbench/kernels/gpu_blend.py can use it on the GPU machine, which
# has no flashinfer, no network and takes at most 64 MiB per command. Whole, flashinfer-python 0.7.2 is 593 MB
# installed; gpu_blend.py needs only its Python modules and what the JIT builds of the paged prefill (FA2 with a
# custom mask, FA3 without), merge_state and the custom mask's bit packing (segment_packbits) compile: the headers, CUTLASS's includes and the prefill/cascade
# sources, about 24 MB gzipped. `import flashinfer` 0.7.2 was checked to work without its optional cutlass-dsl,
# cudnn-frontend, nccl and cuda-tile dependencies; it does need apache-tvm-ffi, whose .venv build is for CPython
# 3.11 while the GPU machine runs 3.12, so its cp312 wheel goes along (fetched here with pip, a few MB).
# With --aot, the modules those builds make are compiled here first for sm_90a (chunkbench/kernels/flashinfer_aot.py:
# ~10 minutes on 2 cores for bf16 and fp16, kept in .fi/aot for the next pack; delete it to rebuild) and packed where
# FlashInfer loads them without compiling, which spares the GPU machine about 2 of its 15 minutes.
# Usage, from the repository root:  bash chunkbench/kernels/pack_flashinfer.sh [--aot]
# (then see gpu_blend.py's docstring)
set -euo pipefail
aot=()
if [[ "${1:-}" == --aot ]]; then
  [[ -d .fi/aot/flashinfer ]] || .venv/bin/python -m chunkbench.kernels.flashinfer_aot .fi/aot
  aot=(-C "$PWD/.fi/aot" flashinfer/data/aot)
fi
site=$(.venv/bin/python -c 'import flashinfer, pathlib; print(pathlib.Path(flashinfer.__file__).parents[1])')
version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("apache-tvm-ffi"))')
exclude=$(git rev-parse --git-path info/exclude)  # .git may be a worktree's gitfile
mkdir -p "$(dirname "$exclude")"
grep -qsx '/.fi/' "$exclude" || echo /.fi/ >>"$exclude"
mkdir -p .fi
(
  cd "$site"
  {
    find flashinfer -name '*.py' ! -path 'flashinfer/data/*' ! -path '*/__pycache__/*'
    # its bundled CCCL too: FlashInfer 0.7.2's fastdiv.cuh needs cuda::fast_mod_div, which CUDA 13.0's own CCCL
    # lacks (the FA2 build failed there without it; seen on the H100)
    find flashinfer/data/include flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util \
      flashinfer/data/spdlog flashinfer/data/cccl/cub/cub flashinfer/data/cccl/libcudacxx/include \
      flashinfer/data/cccl/thrust/thrust -type f
    find flashinfer/data/csrc -maxdepth 1 -type f \( -name '*.h' -o -name '*.cuh' -o -name 'batch_prefill*' \
      -o -name '*cascade*' -o -name 'page.cu' -o -name 'flashinfer_page_binding.cu' \
      -o -name 'quantization.cu' -o -name 'flashinfer_quantization_binding.cu' \)
    find flashinfer_python-*.dist-info -type f
    # CUTLASS's tools/util headers that FlashInfer's FA3 (sm90) prefill includes want <curand_kernel.h>, which a
    # CUDA toolkit from pip keeps in the nvidia-curand wheel, outside nvcc's include path: it goes to an -isystem dir
    find nvidia/cu13/include -name 'curand*.h'
  } | tar -czf - --transform 's,^nvidia/cu13/include/,flashinfer/data/include/,' -T - "${aot[@]}"
) >.fi/flashinfer.tar.gz
rm -f .fi/apache_tvm_ffi-*.whl .fi/redis-*.whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .fi "apache-tvm-ffi==$version"
# chunkcache's store imports redis-py (pure Python), which the GPU machine's image lacks
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .fi \
  "redis==$(.venv/bin/python -c 'import redis; print(redis.__version__)')"
du -ch .fi/* | tail -n 1
