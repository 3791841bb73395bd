"""chunkbench: the benchmark harness beside chunkcache (engine-agnostic core) and sglang_patch (SGLang glue).

It imports both; neither imports it: the `chunkcache` CLI finds `chunkcache bench` / `chunkcache eval` through the
`chunkcache.commands` entry points (pyproject.toml). Two kinds of modules:

- the harness of `chunkcache bench` / `chunkcache eval` (`cli` parses their arguments): the A/B harness against
  stock prefix caching (`ab`, `closed_loop`, `load`, `client`, `report`, `closed_report`, `plots`), the
  quality sweep (`quality`, `reference_path`, `server_path`, `fidelity`, `analysis`, `intervals`, `scoring`,
  `rowlog`) and their workloads (`workloads`, `synthetic`). It talks HTTP to the servers it starts (`servers`),
  never importing sglang; the reference-path sweep runs the torch reference blender in-process.
- standalone benchmarks, each run as `python -m chunkbench.NAME` (its docstring gives the commands and what it
  measures): `ttft_shuffled` and `soak` (serving), `selector_quality` and `select_study` (selectors on the reference
  blender), `deviation_depth` (how a chunk's deviation grows with depth), `specache` (SpeCache decoding),
  `decode_attention` and `sparse_attention` (CPU attention kernels),
  `gpu_blend` (the blended prefill on a GPU, from a plain checkout; `pack_flashinfer.sh` packs FlashInfer for it,
  with the modules `flashinfer_aot` compiles here for Hopper),
  `remote_get_latency` (the remote store tier).
"""
