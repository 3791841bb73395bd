"""Query overlap (chunkcache.select.overlap): the sentences holding the query's rarest words, whole, within their
share of the budget; checked on hand-made prompts whose tokens are words."""

import re

import pytest
import torch

from chunkcache.select import REGISTRY, overlap
from chunkcache.select.base import Layout

def prompt(question: str):
    """(layout, text, offsets): a prefix, two chunks of filler and needles, the question; one token per word or mark."""
    chunk1 = ("The museum reviewed the old bridge . The special magic number for amber-falcon is 8898004 . "
              "The council raised money for the garden . The special magic number for quiet-river is 1234567 .\n")
    chunk2 = ("A young painter celebrated the fair . The special magic number for rapid-otter is 7654321 . "
              "The special magic number for velvet-storm is 5555555 . The ferry postponed the concert .\n")
    pieces = ["Passages :\n", chunk1, chunk2, f"Question : {question}"]
    text, offsets, words, spans = "", [], [], []
    for piece in pieces:
        first = len(offsets)
        for m in re.finditer(r"\S+|\n", piece):
            offsets.append((len(text) + m.start(), len(text) + m.end()))
            words.append(m.group())
        text += piece
        spans.append((first, len(offsets)))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    ids = torch.tensor([vocab[w] for w in words])
    layout = Layout(ids, spans[0][1], (spans[1], spans[2]), (spans[3][0], len(words)))
    return layout, text, offsets


def words(layout, text, offsets, mask):
    return " ".join(text[slice(*offsets[i])] for i in mask.nonzero().flatten().tolist())


def test_the_sentence_naming_the_asked_key_is_taken_whole():
    layout, text, offsets = prompt("What is the special magic number for amber-falcon ?")
    got = overlap.pick(layout, text, offsets, room=40)
    # "amber-falcon" occurs once in the context; the other needles share only words every needle has
    assert words(layout, text, offsets, got) == "The special magic number for amber-falcon is 8898004 ."
    assert not overlap.pick(layout, text, offsets, room=8).any()  # a sentence that does not fit is not cut


def test_every_sentence_with_a_rare_word_is_taken_best_first_while_it_fits():
    layout, text, offsets = prompt("Which special magic number is for the museum or the ferry ?")
    both = words(layout, text, offsets, overlap.pick(layout, text, offsets, room=100))
    assert both == "The museum reviewed the old bridge . The ferry postponed the concert ."
    # equal scores ("the" and one rare word each): the earlier sentence first; then the ferry's does not fit
    one = words(layout, text, offsets, overlap.pick(layout, text, offsets, room=7))
    assert one == "The museum reviewed the old bridge ."


def test_top_k_spends_the_rest_by_score_and_keeps_the_budget():
    layout, text, offsets = prompt("What is the special magic number for amber-falcon ?")
    scores = torch.arange(layout.n, dtype=torch.float64)  # later tokens score higher
    k = 20
    picked = overlap.top_k(layout, scores, k, text, offsets, share=0.5)
    assert len(picked) == len(set(picked.tolist())) == k
    assert layout.context_mask()[picked].all()
    needle = overlap.pick(layout, text, offsets, room=10)
    assert set(needle.nonzero().flatten().tolist()) <= set(picked.tolist())
    rest = sorted(set(picked.tolist()) - set(needle.nonzero().flatten().tolist()))
    assert rest == sorted(layout.context_mask().nonzero().flatten().tolist())[-(k - int(needle.sum())):]


class Features:
    def __init__(self, layout, text, offsets):
        self.layout, self.text, self.offsets = layout, text, offsets

    def prompt_text(self):
        return self.text, self.offsets

    def query_attention(self):
        return torch.linspace(1.0, 0.0, self.layout.n)  # earlier tokens score higher

    def kv_deviation(self, layer, which):
        return torch.ones(self.layout.n)


@pytest.mark.parametrize("name", ["prophet", "mix"])
def test_selectors_with_overlap_recompute_the_named_needle(name):
    layout, text, offsets = prompt("What is the special magic number for velvet-storm ?")
    f = Features(layout, text, offsets)
    plain = REGISTRY.create(name).select(layout, 0.3, f).indices.tolist()
    with_overlap = REGISTRY.create(name, overlap=0.5).select(layout, 0.3, f).indices.tolist()
    needle = overlap.pick(layout, text, offsets, room=100).nonzero().flatten().tolist()
    assert words(layout, text, offsets, overlap.pick(layout, text, offsets, room=100)) == \
        "The special magic number for velvet-storm is 5555555 ."
    assert not set(needle) <= set(plain) and set(needle) <= set(with_overlap)
    assert len(plain) == len(with_overlap)  # the same budget
    with pytest.raises(ValueError, match="overlap"):
        REGISTRY.create(name, overlap=1.5)

