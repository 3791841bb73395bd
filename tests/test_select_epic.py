"""EPIC: the first k tokens of each chunk."""

import torch

from chunkcache.select import create
from chunkcache.select.base import Layout


def _layout():
    # prefix 5, chunks of 20, 7, 30, query 6
    return Layout(torch.arange(68), 5, ((5, 25), (25, 32), (32, 62)), (62, 68))


def test_fixed_k_picks_first_k_of_each_chunk():
    layout = _layout()
    sel = create("epic", k=4).select(layout, 0.15, None)
    ctx = [i for i in sel.indices.tolist() if layout.context_mask()[i]]
    assert ctx == [5, 6, 7, 8, 25, 26, 27, 28, 32, 33, 34, 35]
    assert set(range(62, 68)) <= set(sel.indices.tolist())


def test_fixed_k_longer_than_chunk_takes_the_chunk():
    layout = _layout()
    sel = create("epic", k=10).select(layout, 0.15, None)
    assert set(range(25, 32)) <= set(sel.indices.tolist())


def test_ratio_budget_spreads_evenly_then_earliest_first():
    layout = _layout()  # 57 context tokens; rho 0.2 -> K = 12 -> 4 per chunk
    sel = create("epic").select(layout, 0.2, None)
    ctx = [i for i in sel.indices.tolist() if layout.context_mask()[i]]
    assert ctx == [5, 6, 7, 8, 25, 26, 27, 28, 32, 33, 34, 35]
    # K = 14: the two extra tokens go to the first two chunks
    sel = create("epic").select(layout, 14 / 57, None)
    ctx = [i for i in sel.indices.tolist() if layout.context_mask()[i]]
    assert len(ctx) == 14 and ctx[:5] == [5, 6, 7, 8, 9] and 29 in ctx and 36 not in ctx


def test_short_chunk_leaves_its_share_to_others():
    layout = _layout()  # K = 29 at rho 0.5: chunk 2 has only 7 tokens
    sel = create("epic").select(layout, 0.5, None)
    ctx = [i for i in sel.indices.tolist() if layout.context_mask()[i]]
    assert len(ctx) == layout.budget(0.5)
    assert set(range(25, 32)) <= set(ctx)
