"""Attention kernels timed alone, each `python -m chunkbench.kernels.NAME`. On the CPU: `decode_attention_bench` (one
decode step, SGLang's torch-native backend against `chunkcache_torch`) and `blend_attention_bench` (the blend's
recompute attention). On a GPU, from a plain checkout that has torch but no sglang: `gpu_blend` (the blended prefill)
and `specache_gpu` (SpeCache's decode step); `pack_flashinfer.sh` packs the .venv's FlashInfer for gpu_blend, with the
modules `flashinfer_aot` compiles here for Hopper. Nothing here imports the rest of chunkbench, and this file imports
nothing: the GPU machine runs it first.
"""
