"""Answer quality of blended prefills against full recompute and the gold answers.

`chunkcache eval` (`quality`): selectors x recompute budgets rho on a workload, through the torch reference blender
(`reference_path`) or a live server (`server_path`), scored with chunkbench.scoring and `fidelity_measures`
(teacher-forced agreement, first-token KL), rows kept by `rowlog` for --resume; `analysis` adds SpecCache's layer-wise
deviation and top-20 % overlap. Standalone, each `python -m chunkbench.quality.NAME`: `selector_quality` (selectors on
synthetic cases), `auto_quality` (automatic chunk detection against hinted blending) and `fidelity_fit` (measures,
fits and judges the fidelity estimate, chunkcache/configs/fidelity.json).
"""
