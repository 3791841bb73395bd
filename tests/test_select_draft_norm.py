"""The `spec` selector (SpecCache's, chunkcache.select.draft_norm) on hand-built inputs: span segmentation and
completion (Eq. 3-6), exact budget, Eq. 1."""

import pytest
import torch

from chunkcache.align import Alignment
from chunkcache.select.base import Layout
from chunkcache.select.draft_norm import DraftNormSelector, complete_spans, segment_spans
from chunkcache.select.view import DraftView


def test_segment_spans_cuts_on_relative_change():
    # normalised: [0, .476, .5, .524, .952, 1, .976, .143]; delta >= 0.4 after tokens 0, 3 and 6
    scores = torch.tensor([0.0, 10, 10.5, 11, 20, 21, 20.5, 3])
    assert segment_spans(scores).tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    # a looser threshold merges the jumps it no longer sees as cuts
    assert segment_spans(scores, tau_smooth=0.9).tolist() == [0, 1, 1, 1, 1, 1, 1, 1]


def test_segment_spans_caps_span_length():
    scores = torch.tensor([0.0] + [10.0] * 40)
    ids = segment_spans(scores, max_span=16)
    assert ids.tolist() == [0] + [1] * 16 + [2] * 16 + [3] * 8


def test_flat_minimum_run_is_one_span():
    assert segment_spans(torch.tensor([0.0, 0.0, 0.0, 5.0, 5.0])).tolist() == [0, 0, 0, 1, 1]


def test_complete_spans_fills_covered_spans_only():
    spans = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3])
    init = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    # span 1: 2/3 covered (< 0.7) stays; span 2: 4/6 stays; span 0: 1/1 full
    assert complete_spans(spans, init, 0.7).tolist() == init.tolist()
    out = complete_spans(spans, init, 0.6)
    assert out.tolist() == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0]


def _layout(prefix: int, chunk_lens: list[int], query: int) -> Layout:
    spans, pos = [], prefix
    for n in chunk_lens:
        spans.append((pos, pos + n))
        pos += n
    return Layout(torch.arange(pos + query), prefix, tuple(spans), (pos, pos + query))


def _identity_view(layout: Layout) -> DraftView:
    ctx = layout.context_mask()
    return DraftView(layout.token_ids, Alignment.identity(layout.n), ctx, layout.prefix_len)


def test_completion_spends_budget_on_whole_spans():
    layout = _layout(2, [20], 2)  # context = tokens 2..21
    imp = torch.full((24,), 1.0)
    imp[5:9] = torch.tensor([9.0, 9.2, 9.1, 6.0])  # one smooth span whose 4th token ranks low
    imp[15] = 8.0  # an isolated high token
    imp[0] = 0.0
    ratio = 0.2  # K = 4
    sel = DraftNormSelector(whole_units=False)
    picked = sel.pick(layout, ratio, _identity_view(layout), imp, None)
    assert int(picked.sum()) == 4
    # plain top-4 would be {5, 6, 7, 15}; completing the span 5..8 is worth more than the lone token
    assert picked.nonzero().flatten().tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize("ratio", [0.05, 0.15, 0.3, 0.5, 1.0])
def test_budget_exact_after_completion_and_units(ratio):
    torch.manual_seed(0)
    layout = _layout(7, [50, 33, 64], 9)
    imp = torch.rand(layout.n) * 10
    units = torch.arange(layout.n) // 3  # every 3 consecutive tokens form one unit
    for u in (None, units):
        picked = DraftNormSelector().pick(layout, ratio, _identity_view(layout), imp, u)
        assert not (picked & ~layout.context_mask()).any()
        k = layout.budget(ratio)
        if u is None:
            assert int(picked.sum()) == k
        else:
            assert k - 2 <= int(picked.sum()) <= k  # whole units of 3 cannot always fill the last slots
            whole = torch.bincount(u[picked], minlength=int(u.max()) + 1)
            ctx_size = torch.bincount(u[layout.context_mask()], minlength=int(u.max()) + 1)
            assert ((whole == 0) | (whole == ctx_size)).all()


def test_deterministic():
    layout = _layout(4, [30, 30], 5)
    imp = torch.tensor([float(i % 7) for i in range(layout.n)])  # many ties
    a = DraftNormSelector().pick(layout, 0.2, _identity_view(layout), imp, None)
    b = DraftNormSelector().pick(layout, 0.2, _identity_view(layout), imp, None)
    assert torch.equal(a, b)


def test_top_k_whole_takes_best_units_then_fills():
    from chunkcache.select.budget import top_k_whole

    layout = _layout(0, [10], 1)
    scores = torch.tensor([0.0, 9, 1, 1, 8, 7, 0, 0, 0, 5, 0])
    units = torch.tensor([0, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8])  # tokens 1-3 are one number
    # K=3: the number (3 tokens) ranks first and fits exactly
    assert top_k_whole(layout, scores, 3, units).tolist() == [1, 2, 3]
    # K=2: the number no longer fits; the next units by score do
    assert top_k_whole(layout, scores, 2, units).tolist() == [4, 5]
