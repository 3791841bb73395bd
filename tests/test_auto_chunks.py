"""Automatic chunk detection's pure parts: content-defined segments (chunkcache.segment), their keys and the
detect / encode decisions (chunkcache.blend.auto), on the default model's tokenizer and MuSiQue passages."""

import json
from dataclasses import replace
import pytest
import torch

from chunkbench.workloads import DEFAULT_MUSIQUE
from chunkcache.blend.auto import AutoChunks
from chunkcache.blend.request import RequestHint
from chunkcache.config import AutoConfig, Config, ConfigError
from chunkcache.hashing import chunk_key, entry_key, prefix_key, tenant_key
from chunkcache.segment import Segmenter, break_ids

DATA = DEFAULT_MUSIQUE
FP = "f" * 32


@pytest.fixture(scope="module")
def tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model)


@pytest.fixture(scope="module")
def auto(tok):
    return AutoChunks(AutoConfig(enabled=True), break_ids(tok.batch_decode([[i] for i in range(len(tok))])), FP)


@pytest.fixture(scope="module")
def passages():
    return [f"{c['title']}\n{c['text']}" for r in json.loads(DATA.read_text())[:3] for c in r["ctxs"]]


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


def passage_keys(auto, tok, ids, passage):
    """Keys of the segments lying inside `passage`'s own tokens where it sits in `ids`."""
    own = tok(passage, add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(ids)) if ids[i: i + len(own)] == own)
    segs = auto.segments(ids, "default", None)
    return [k for (s, e), k in zip(segs.spans, segs.keys) if at <= s and e <= at + len(own)], len(own)


def test_segments_cover_the_prompt_and_keep_the_contract():
    seg = Segmenter(break_ids={7}, mean=4, min_tokens=3, max_tokens=8, window=2)
    ids = [1, 2, 3, 7, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 7, 7, 18]
    spans = seg.spans(ids)
    assert spans[0][0] == 0 and spans[-1][1] == len(ids)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gaps, no overlaps
    assert all(e - s <= 8 for s, e in spans)
    breaks = [i for i, t in enumerate(ids) if t == 7]
    assert {(i, i + 1) for i in breaks} <= set(spans)  # every break token is a segment of its own


def test_the_same_passage_yields_the_same_keys_at_any_offset(tok, auto, passages):
    """A passage after other documents, in another template, at another offset: every segment inside it has the
    same key (joined by "\\n\\n", LlamaIndex's and LangChain's join, the passage keeps its standalone ids)."""
    target = passages[3]
    a = chat(tok, "Context information is below.\n---------------------\n" + "\n\n".join(passages[:4]) + "\nQuery: x")
    b = chat(tok, "Answer the question based only on the following context:\n" + "\n\n".join([passages[7], target,
                                                                                               passages[1]]))
    keys_a, n = passage_keys(auto, tok, a, target)
    keys_b, _ = passage_keys(auto, tok, b, target)
    assert keys_a and keys_a == keys_b
    assert sum(e - s for (s, e), k in zip(*_spans_keys(auto, a)) if k in keys_a) >= 0.9 * n
    # its last segment too, though "\n" follows it in a and "\n\n" in b (different tokens): the break is not in it
    last = max(e for (s, e), k in zip(*_spans_keys(auto, a)) if k in keys_a)
    assert tok.decode(a[last - 3: last]) == tok.decode(tok(target, add_special_tokens=False)["input_ids"][-3:])


def _spans_keys(auto, ids):
    segs = auto.segments(ids, "default", None)
    return segs.spans, segs.keys


def test_keys_name_the_tenant_and_the_context_as_a_hinted_chunks_do(auto):
    """A segment's key is entry_key(model, tenant, context, tokens): the context is the canonical head and its
    paragraph's tokens before it, so the same tokens after other text in their paragraph, or for another tenant,
    have another key. A hinted chunk's key names its shared prefix the same way: the same tokens after the same
    context are one key, one KV, whichever path computed it."""
    ids = list(range(100, 180))
    base = auto.segments(ids, "default", None)
    assert base.keys and not set(base.keys) & set(auto.segments(ids, "other", None).keys)
    assert not set(base.keys) & set(auto.segments(ids, "default", "tenant-b").keys)
    (s, e), p = base.spans[0], base.paragraphs[0]
    assert base.contexts[0] == prefix_key(torch.cat([auto.head, torch.tensor(ids[p:s])]))
    assert base.keys[0] == entry_key(FP, tenant_key("default"), base.contexts[0], ids[s:e])
    assert base.keys[0] == chunk_key(FP, "default", prefix_key(ids[:s]), ids[s:e])  # no head, no text before: the same
    assert base.keys[0] != chunk_key(FP, "default", prefix_key([1, 2]), ids[s:e])  # after another prefix: another


def _seg(**knobs):
    """Line breaks (token 0) as the only cuts, a 2-token canonical head."""
    config = AutoConfig(enabled=True, min_reuse_tokens=40, segment_min_tokens=8, segment_mean_tokens=1 << 20, **knobs)
    return AutoChunks(config, frozenset({0}), FP, head=[7, 8])


def test_a_segments_key_depends_on_its_paragraph_not_on_what_precedes_the_paragraph():
    """The same paragraph after other paragraphs, an instruction or nothing: the same keys, contexts and start
    positions; a paragraph whose first tokens differ ("[2] " before the same words) is another context."""
    seg = _seg(segment_max_tokens=12)
    para = list(range(10, 44))  # cut every 12 tokens: 12, 12 and 10, each after the ones before it in context
    alone = seg.segments(para + [0, 99], "ns", None)
    deep = seg.segments([5] * 9 + [0] + list(range(200, 230)) + [0] + para + [0, 99], "ns", None)
    mine = [(k, c) for (s, e), k, c in zip(deep.spans, deep.keys, deep.contexts) if s >= 41]
    assert [e - s for (s, e), p in zip(deep.spans, deep.paragraphs) if p == 41] == [12, 12, 10]
    assert [(k, c) for k, c in zip(alone.keys, alone.contexts)] == mine and len(mine) == 3
    assert alone.contexts[1] == prefix_key([7, 8] + para[:12])  # the head, then its paragraph before it
    numbered = seg.segments([3, 4] + para + [0, 99], "ns", None)
    assert not set(numbered.keys) & set(alone.keys)


def test_detect_takes_the_stored_segments_past_the_exact_prefix_and_before_the_last_token():
    seg = _seg()
    ids = [5] * 3 + [0] + list(range(10, 30)) + [0] + list(range(40, 70)) + [0] + [99]
    segs = seg.segments(ids, "ns", None)
    # each run ends before its break token, a segment of its own too short to keep (no content cut at this mean)
    assert segs.spans == ((4, 24), (25, 55)) and segs.paragraphs == (4, 25)
    stored = set(segs.keys)
    found = seg.detect(segs, len(ids), matched=0, stored=stored)
    assert found.spans == ((4, 24), (25, 55)) and found.tokens == 50
    # a segment the exact prefix reaches into is reused from the prefix's end: 19 + 30 tokens past the match
    found = seg.detect(segs, len(ids), matched=5, stored=stored)
    assert found.spans == ((4, 24), (25, 55)) and found.tokens == 49
    plan = RequestHint(torch.tensor(ids), found.spans, found.keys, "mix", 0.15, "ns", auto=True).plan(matched=5)
    assert [(c.span, c.head) for c in plan.chunks] == [((5, 24), 1), ((25, 55), 0)]
    assert plan.context is None  # a missing segment computed in this prompt is never stored under its key
    assert seg.detect(segs, len(ids), matched=26, stored=stored) is None  # 29 tokens past the match: too few
    assert seg.detect(segs, len(ids), matched=0, stored={segs.keys[1]}) is None
    assert seg.detect(segs, 55, matched=0, stored=stored) is None  # the last prompt token is never reused


def test_to_encode_names_each_paragraph_alone_after_the_head_and_when_crowded_only_those_seen_twice():
    seg = _seg(admit_after=2, segment_max_tokens=16)
    ids = list(range(10, 30)) + [0] + list(range(40, 70)) + [0] + [99]
    segs = seg.segments(ids, "ns", None)
    assert segs.spans == ((0, 16), (21, 37), (37, 51)) and segs.paragraphs == (0, 21, 21)  # (16, 20): too short
    encodes = seg.to_encode(segs, ids, [False, True, False])
    # one forward per paragraph: the head, then the paragraph through its last segment to store
    assert [e.token_ids.tolist() for e in encodes] == [[7, 8] + ids[0:16], [7, 8] + ids[21:51]]
    assert [e.entries for e in encodes] == [(((2, 18), segs.keys[0], segs.contexts[0]),),
                                            (((18, 32), segs.keys[2], segs.contexts[2]),)]
    assert {e.tenant for e in encodes} == {segs.tenant}
    assert seg.to_encode(segs, ids, [True] * 3) == []  # all held
    # the paragraph's last segment held, its first missing: the forward still covers the whole paragraph (a
    # forward of another length may round the first segment's KV otherwise)
    (first,) = seg.to_encode(segs, ids, [True, False, True])
    assert first.token_ids.tolist() == [7, 8] + ids[21:51] and first.entries == (((2, 18), segs.keys[1],
                                                                                   segs.contexts[1]),)
    other = _seg(admit_after=2)
    assert other.to_encode(other.segments(ids, "ns", None), ids, [False] * 2, crowded=True) == []  # seen once
    assert len(other.to_encode(other.segments(ids, "ns", None), ids, [False] * 2, crowded=True)) == 2  # twice


def test_auto_config_is_checked(tmp_path):
    assert Config().auto.enabled is False  # off by default: unmarked requests stay exact
    bad = tmp_path / "c.yaml"
    bad.write_text("auto:\n  segment_mean_tokens: 48\n")
    with pytest.raises(ConfigError, match="segment_mean_tokens: must be a power of two"):
        Config.load(bad)


def test_a_passage_taught_bare_is_found_on_a_line_that_wraps_it_in_tags(tok, auto, passages):
    """Ingest and the documents API teach a passage as a paragraph of its own ("Documents:\n\n" + passage + "\n\n");
    a client pasting it in tags has the tags on the passage's line. Read as a wrapper and the taught paragraph
    (Form.lead), and its last segment trimmed, the detected chunks cover >= 95 % of the passage's tokens, each token
    once; with edge_tokens 0 nothing of it is found (every segment's context holds the tag)."""
    target, other = passages[4].replace("\n", " "), passages[5].replace("\n", " ")
    taught = chat(tok, "Documents:\n\n" + target + "\n\n" + other + "\n\nQuestion: x")
    stored = set(auto.segments(taught, "default", None).keys)
    ids = chat(tok, "Answer from these.\n" + "\n".join(f"<document>{p}</document>" for p in (other, target))
               + "\nQuestion: y")
    found = auto.detect(auto.segments(ids, "default", None), len(ids), matched=0, stored=stored)
    own = tok(target, add_special_tokens=False)["input_ids"]
    at = next(i for i in range(len(ids)) if ids[i: i + len(own)] == own)
    covered = [span for span in found.spans if at <= span[0] and span[1] <= at + len(own)]
    assert sum(e - s for s, e in covered) >= 0.95 * len(own), (len(own), covered)
    assert all(e <= s2 for (_, e), (s2, _) in zip(found.spans, found.spans[1:]))  # no token twice
    bare = AutoChunks(replace(auto.config, edge_tokens=0), auto.segmenter.break_ids, FP)
    assert bare.detect(bare.segments(ids, "default", None), len(ids), 0, stored) is None
