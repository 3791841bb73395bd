"""The selectors' shared contracts: one ranking behind every top-k, and a registry that refuses a taken name."""

from typing import ClassVar

import pytest
import torch

from chunkcache.select import REGISTRY
from chunkcache.select.base import Layout, Registry
from chunkcache.select.budget import rank, top_k


def test_rank_is_best_first_ties_to_the_lower_index_and_eligible_only():
    scores = torch.tensor([0.5, 2.0, 0.5, 9.0, 2.0, 0.5])
    eligible = torch.tensor([True, True, True, False, True, True])
    assert rank(scores, eligible).tolist() == [1, 4, 0, 2, 5]


def test_plain_top_k_is_a_prefix_of_the_ranking_over_context_tokens():
    g = torch.Generator().manual_seed(0)
    layout = Layout(token_ids=torch.arange(20), prefix_len=2, chunk_spans=((2, 8), (9, 15)), query_span=(15, 20))
    scores = torch.randint(0, 3, (20,), generator=g).float()  # many ties
    order = rank(scores, layout.context_mask())
    for ratio in (0.0, 0.1, 0.5, 1.0):
        picked = top_k(layout, scores, ratio, features=None, whole_units=False)
        assert picked.tolist() == order[: layout.budget(ratio)].tolist()


class _Named:
    name: ClassVar[str] = "a"


def test_registry_refuses_a_taken_name_and_keeps_the_first():
    reg = Registry()
    reg.register(_Named)
    other = type("Other", (), {"name": "a"})
    with pytest.raises(ValueError, match=r"selector 'a' is already registered by .*_Named; .*Other needs another name"):
        reg.register(other)
    assert isinstance(reg.create("a"), _Named)


@pytest.mark.parametrize("name", [None, "", "  ", 3])
def test_registry_refuses_a_class_without_a_usable_name(name):
    cls = type("Bad", (), {} if name is None else {"name": name})
    with pytest.raises(ValueError, match="needs a non-empty string `name`"):
        Registry().register(cls)


def test_registry_says_what_exists():
    reg = Registry()
    for n in ("b", "a"):
        reg.register(type(n.upper(), (), {"name": n}))
    assert reg.names() == ["a", "b"] and "a" in reg and "c" not in reg
    with pytest.raises(ValueError, match="unknown selector 'c'; known: a, b"):
        reg.create("c")


def test_builtin_selectors_are_registered_once_each():
    assert REGISTRY.names() == ["cacheblend", "clip", "epic", "full", "mix", "none", "oracle", "prophet", "spec"]
