#!/usr/bin/env bash
# Packs the .venv's FlashInfer into .fi/ so that chunkbench/gpu_blend.py can use it on the GPU machine, which has
# no flashinfer, no network and takes at most 64 MiB per command. Whole, flashinfer-python 0.7.2 is 593 MB
# installed; gpu_blend.py needs only its Python modules and what the JIT builds of the paged prefill (FA2 with a
# custom mask, FA3 without) and merge_state compile: the headers, CUTLASS's includes and the prefill/cascade
# sources, about 21 MB gzipped (its bundled CCCL stays behind: CUDA 13's nvcc ships its own). `import flashinfer` 0.7.2 was checked to work without its optional cutlass-dsl,
# cudnn-frontend, nccl and cuda-tile dependencies; it does need apache-tvm-ffi, whose .venv build is for CPython
# 3.11 while the GPU machine runs 3.12, so its cp312 wheel goes along (fetched here with pip, a few MB).
# Usage, from the repository root:  bash chunkbench/pack_flashinfer.sh   (then see gpu_blend.py's docstring)
set -euo pipefail
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
    find flashinfer/data/include flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util \
      flashinfer/data/spdlog -type f
    find flashinfer/data/csrc -maxdepth 1 -type f \( -name '*.h' -o -name '*.cuh' -o -name 'batch_prefill*' \
      -o -name '*cascade*' -o -name 'page.cu' -o -name 'flashinfer_page_binding.cu' \)
    find flashinfer_python-*.dist-info -type f
  } | tar -czf - -T -
) >.fi/flashinfer.tar.gz
rm -f .fi/apache_tvm_ffi-*.whl
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d .fi "apache-tvm-ffi==$version"
du -ch .fi/* | tail -n 1
