"""chunkbench: the benchmark harness beside chunkcache (engine-agnostic core) and sglang_patch (SGLang glue).

It imports both; neither imports it: the `chunkcache` CLI finds `chunkcache bench` / `chunkcache eval` through the
`chunkcache.commands` entry points (pyproject.toml), which name `commands` here (it parses their arguments). A folder
per question asked:

- `serving/`: speed against stock SGLang prefix caching (`chunkcache bench`, and the serving benchmarks);
- `quality/`: answer quality of blends against full recompute and the gold answers (`chunkcache eval`, and the
  quality benchmarks);
- `studies/`: the measurements behind one design choice or constant each;
- `kernels/`: attention kernels timed alone, on the CPU or, from a plain checkout, on a GPU.

Each folder's docstring names its modules. At this level, what the folders share: `workloads` (the RAG prompts both
A/B sides send) with `synthetic` (seeded tasks with known answers), `scoring` (F1 / EM of an answer) and `intervals`
(bootstrap intervals of a mean). A folder imports these and the folders below it (serving, then quality, then
studies; kernels none: tests/test_import_graph.py); they import no folder. The harness talks HTTP to the servers it
starts, never importing sglang; the reference path runs the torch reference blender in-process. A standalone
benchmark runs as `python -m chunkbench.FOLDER.NAME`; its docstring gives the commands and what it measures.
"""
