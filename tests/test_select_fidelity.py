"""chunkbench.studies.select_fidelity measures what the selectors do: on a tiny model, its `prophet` and `product:*`
candidates' top-K blends equal the `prophet` and `mix` selectors' own (same recomputed tokens, same logits) at the
deviation (K or V, layer) each names, and `sum` equals mix with combine=sum."""

import pytest
import torch

from chunkbench.studies.select_fidelity import Fixed, Probe, by_candidate, candidates, paired
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


def test_report_pairs_each_rho_of_a_selector_on_shared_cases():
    """An eval file holding `mix` at two rho keeps both (`mix@0.15`, `mix@0.135`) instead of the later replacing the
    earlier; the pairing uses only the cases every chosen candidate holds (hand-computed differences)."""
    def row(sel, ratio, item, kl):
        return {"selector": sel, "ratio": ratio, "item": item, "kl_first": kl, "tf_agreement": 1.0}
    rows = [row("prophet", 0.15, "a", 0.4), row("prophet", 0.15, "b", 0.2), row("prophet", 0.15, "c", 0.6),
            row("mix", 0.15, "a", 0.1), row("mix", 0.15, "b", 0.3),
            row("mix", 0.135, "a", 0.2), row("mix", 0.135, "b", 0.5), row("mix", 0.135, "c", 0.9),
            row("full", None, "a", 0.0), row("full", None, "b", 0.0), row("full", None, "c", 0.0)]
    by = by_candidate(rows)
    assert set(by) == {"prophet", "mix@0.15", "mix@0.135", "full"}
    assert by["mix@0.135"]["b"]["kl_first"] == 0.5 and by["mix@0.15"]["b"]["kl_first"] == 0.3
    cases, table = paired(by, "prophet", ["mix@0.135"])
    assert cases == ["a", "b", "c"]  # mix@0.15 lacks c but is not chosen
    (t,) = table
    assert t["diff"][0] == pytest.approx((-0.2 + 0.3 + 0.3) / 3) and t["better"] == 1
    assert t["relative"] == pytest.approx(0.4 / 1.2)
    cases, table = paired(by, "prophet", ["mix@0.15", "mix@0.135"])
    assert cases == ["a", "b"] and [t["better"] for t in table] == [1, 1]
    assert table[0]["diff"][0] == pytest.approx(-0.1) and table[1]["diff"][0] == pytest.approx(0.05)
    with pytest.raises(SystemExit, match="mix@0.3"):
        paired(by, "prophet", ["mix@0.3"])
