"""chunkbench.select_fidelity measures what the selectors do: on a tiny model, its `prophet` and `product:*`
candidates' top-K blends equal the `prophet` and `mix` selectors' own (same recomputed tokens, same logits) at the
deviation (K or V, layer) each names, and `sum` equals mix with combine=sum."""

import pytest
import torch

from chunkbench.select_fidelity import Fixed, Probe, candidates
from chunkcache.models import tiny_model
from chunkcache.reference import ReferenceBlender


@pytest.fixture(scope="module")
def blender():
    return ReferenceBlender.from_pretrained(tiny_model("llama", initializer_range=0.1))


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(5, 1000, (6,), generator=g).tolist()
    chunks = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in (24, 17, 21)]
    return prefix, chunks, torch.randint(5, 1000, (7,), generator=g).tolist()


@pytest.mark.parametrize("candidate,selector,options", [
    ("prophet", "prophet", {}), ("product:k3", "mix", {"which": "k"}), ("product:v3", "mix", {"which": "v"}),
    ("product:v1", "mix", {"which": "v", "layer": 1}), ("product:k2", "mix", {"which": "k", "layer": 2}),
    ("sum", "mix", {"combine": "sum", "which": "v"}),
])
def test_candidates_blend_as_their_selectors(blender, prompt, candidate, selector, options):
    probe = Probe()
    blender.blend(*prompt, selector=probe, ratio=0.2)
    scores = candidates(probe)[candidate]
    for ratio in (0.1, 0.3):
        ours = blender.blend(*prompt, selector=Fixed(scores), ratio=ratio)
        theirs = blender.blend(*prompt, selector=selector, ratio=ratio, **options)
        assert torch.equal(ours.recomputed, theirs.recomputed)
        torch.testing.assert_close(ours.logits, theirs.logits)
