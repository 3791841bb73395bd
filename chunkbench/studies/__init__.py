"""The measurements behind one design choice or constant each, run as `python -m chunkbench.studies.NAME` (the
docstring gives the commands, docs/bench/ the results): `select_study` (where selectors lose the oracle's deviation:
`mix`'s weights and check layer), `select_fidelity` (which cheap score ranks the tokens that matter to the answer),
`deviation_depth` (how a chunk's deviation grows with its depth: DEPTH_EXPONENT), `segment_coverage` (content-defined
segments against fixed blocks), `compression` (the disk and remote tiers' KV codec: bytes, seconds, error, quality)
and `specache_study` (SpeCache decoding: memory and quality against full precision).
"""
