"""CacheClip rules on hand-built inputs: windows, grouping, exact budget."""

import torch

from chunkcache.align import Alignment
from chunkcache.select.base import Layout
from chunkcache.select.clip import ClipSelector, group, window_ids


def test_window_ids_restart_at_each_chunk():
    assert window_ids([10, 3], 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]


def test_grouping_keeps_only_dense_windows():
    windows = window_ids([24], 8)
    picked = torch.zeros(24, dtype=torch.bool)
    picked[[0, 1, 2, 3, 4]] = True  # window 0: 5 picks -> kept
    picked[[8, 10, 12, 14]] = True  # window 1: 4 picks -> dropped
    picked[16:24] = True  # window 2: full -> kept
    kept = group(picked, windows, 5)
    assert kept.nonzero().flatten().tolist() == [0, 1, 2, 3, 4, *range(16, 24)]


def test_budget_exact_after_grouping():
    torch.manual_seed(1)
    spans = ((3, 83), (83, 140))
    layout = Layout(torch.arange(150), 3, spans, (140, 150))
    att = torch.rand(137)  # one score per chunk token (identity alignment)
    align = Alignment.identity(137).shifted(0, 3, 137, 150)
    windows = window_ids([80, 57], 8)
    candidates = torch.ones(137, dtype=torch.bool)
    for ratio in (0.1, 0.15, 0.2, 0.5):
        picked = ClipSelector().pick(layout, ratio, align, att, candidates, windows, None)
        assert int(picked.sum()) == layout.budget(ratio)
        assert not (picked & ~layout.context_mask()).any()


def test_clustered_scores_select_whole_windows():
    layout = Layout(torch.arange(40), 0, ((0, 32),), (32, 40))
    att = torch.full((32,), 0.01)
    att[8:16] = 1.0  # one hot window
    att[3] = 0.9  # a lone high token in a sparse window
    picked = ClipSelector().pick(layout, 0.25, Alignment.identity(32).shifted(0, 0, 32, 40), att,
                                 torch.ones(32, dtype=torch.bool), window_ids([32]), None)
    assert picked.nonzero().flatten().tolist() == list(range(8, 16))
